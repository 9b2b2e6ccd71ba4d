"""The bubblewrap command line of a slot sandbox (see docs/isolation.md)."""

from __future__ import annotations

import functools
import os
import struct
from dataclasses import dataclass
from pathlib import Path

from atropos.sandbox.host.config import Limits

WORKSPACE = "/workspace"
RUN_DIR = "/run/term"
LIB_DIR = "/run/atropos"

SANDBOX_ENV = {
    "PATH": "/usr/local/bin:/usr/bin:/bin",
    "HOME": WORKSPACE,
    "LANG": "C.UTF-8",
    "TMPDIR": "/tmp",
    "TERM": "xterm-256color",
    "USER": "sandbox",
    "SHELL": "/bin/bash",
    "PYTHONDONTWRITEBYTECODE": "1",
    # The terminal tool recognises this prompt's end ("]$ ") to know a command finished.
    "PS1": "[sandbox \\W]\\$ ",
}


@dataclass(frozen=True)
class SandboxPaths:
    """Host-side directories bound into one slot sandbox."""

    workspace: Path
    run_dir: Path
    lib_dir: Path
    etc_dir: Path
    # capped tmpfs mounts (size and inodes) made by the host for /tmp and /dev/shm; None: bubblewrap
    # mounts its own tmpfs there, capped in size only
    tmp: Path | None = None
    shm: Path | None = None


# Every slot sandbox: its own namespaces of every kind (a user namespace it cannot nest), dies with
# its starter, no controlling terminal, no capability.
NAMESPACES = ("--unshare-all", "--unshare-user", "--disable-userns", "--die-with-parent", "--new-session",
              "--cap-drop", "ALL")


def _scratch(paths: SandboxPaths, limits: Limits) -> list[str]:
    """/dev/shm and /tmp: the slot's capped tmpfs mounts, else bubblewrap's own (capped in size only)."""
    return [*(["--bind", str(paths.shm), "/dev/shm"] if paths.shm is not None else
              ["--size", str(limits.shm_bytes), "--perms", "1777", "--tmpfs", "/dev/shm"]),
            *(["--bind", str(paths.tmp), "/tmp"] if paths.tmp is not None else
              ["--size", str(limits.tmp_bytes), "--perms", "1777", "--tmpfs", "/tmp"])]


def bwrap_argv(bwrap: str, paths: SandboxPaths, limits: Limits, *, network: bool, seccomp_fd: int,
               private_net: bool = False) -> list[str]:
    """Arguments that start a hardened sandbox; the command to run inside is appended by the caller.

    Start it with ``env={}`` (bwrap's own PID 1 keeps the caller's environment, readable from
    ``/proc/1/environ``) and as an unprivileged uid (a uid-0 caller makes ``--uid`` cosmetic).
    Never put secrets in this argv: it is visible in ``/proc/1/cmdline`` inside.
    With ``network`` and ``private_net`` the sandbox keeps its own network namespace and waits
    for ``atropos.sandbox.host.isolation.network`` to plug slirp4netns in (``{info_fd}``/``{block_fd}``
    placeholders: the caller substitutes the descriptors).
    """
    argv = [
        bwrap,
        *NAMESPACES,
        "--ro-bind", "/usr", "/usr",
        "--symlink", "usr/bin", "/bin", "--symlink", "usr/lib", "/lib",
        "--symlink", "usr/lib64", "/lib64", "--symlink", "usr/sbin", "/sbin",
        "--ro-bind-try", "/etc/alternatives", "/etc/alternatives",
        "--ro-bind-try", "/etc/ld.so.cache", "/etc/ld.so.cache",
        "--ro-bind-try", "/etc/ssl", "/etc/ssl",
        "--ro-bind-try", "/etc/ca-certificates", "/etc/ca-certificates",
        "--ro-bind-try", "/etc/localtime", "/etc/localtime",
        "--ro-bind-try", "/etc/mime.types", "/etc/mime.types",
        "--ro-bind", str(paths.etc_dir / "passwd"), "/etc/passwd",
        "--ro-bind", str(paths.etc_dir / "group"), "/etc/group",
        "--ro-bind", str(paths.etc_dir / "hosts"), "/etc/hosts",
        "--bind", str(paths.workspace), WORKSPACE,
        "--bind", str(paths.run_dir), RUN_DIR,
        "--ro-bind", str(paths.lib_dir), LIB_DIR,
        "--chdir", WORKSPACE,
        "--proc", "/proc", "--ro-bind", "/proc/sys", "/proc/sys",
        "--dev", "/dev",
        *_scratch(paths, limits),
        "--clearenv",
        "--uid", "1000", "--gid", "1000", "--hostname", "sandbox",
        "--seccomp", str(seccomp_fd),
    ]
    if network and private_net:
        argv += ["--ro-bind", str(paths.etc_dir / "resolv.conf"), "/etc/resolv.conf",
                 "--ro-bind-try", "/etc/nsswitch.conf", "/etc/nsswitch.conf",
                 "--info-fd", "{info_fd}", "--block-fd", "{block_fd}"]
    elif network:
        argv[argv.index("--unshare-all") + 1 : argv.index("--unshare-all") + 1] = ["--share-net"]
        argv += ["--ro-bind-try", "/etc/resolv.conf", "/etc/resolv.conf",
                 "--ro-bind-try", "/etc/nsswitch.conf", "/etc/nsswitch.conf"]
    # bwrap's own root and /dev are uncapped tmpfs: read-only, or a slot could fill host RAM
    # through /etc or /run. /proc read-only: a slot cannot lower its oom_score_adj (or write any
    # other per-process knob). Last, so every mount point above already exists.
    argv += ["--remount-ro", "/proc", "--remount-ro", "/dev", "--remount-ro", "/"]
    for key, value in SANDBOX_ENV.items():
        argv += ["--setenv", key, value]
    argv.append("--")
    return argv


# -- slots whose root is a task image (docs/task-images.md) -----------------------------------
# What a slot on an image root holds of ours, all under one directory the mount helper made a
# read-only mount point (see mounthelper.image_mount_points): the helpers, the host's /usr (the
# helpers' interpreter and tmux, run through the host's own loader: the image may have no python3,
# an old one, or a musl libc), the slot's run dir and the image as it was (the verifier restores
# test files from it).
# The layout is spelled here only: the mount helper gets the names in its request
# (slot_workspace.image_root_request), the sandbox and the verifier these paths.
IMAGE_HELPERS = "/.atropos"
IMAGE_LIB_DIR = f"{IMAGE_HELPERS}/lib"
IMAGE_HOST_USR = f"{IMAGE_HELPERS}/usr"
IMAGE_RUN_DIR = f"{IMAGE_HELPERS}/term"
IMAGE_PRISTINE = f"{IMAGE_HELPERS}/image"


def image_helper_name(path: str) -> str:
    """The name of ``path`` (one of the IMAGE_* above) inside IMAGE_HELPERS."""
    name = path.removeprefix(IMAGE_HELPERS + "/")
    if name == path or "/" in name:
        raise ValueError(f"{path}: not a directory of {IMAGE_HELPERS}")
    return name


def image_bwrap_argv(bwrap: str, root: Path, paths: SandboxPaths, limits: Limits, *, network: bool,
                     seccomp_fd: int, private_net: bool, env: dict[str, str], uid: tuple[int, int]) -> list[str]:
    """The sandbox of a slot whose ``/`` is an image root (mounted with its mount points by the mount
    helper): the same namespaces, seccomp filter, capped ``/tmp`` and ``/dev/shm``, read-only
    ``/proc`` and ``/dev`` as ``bwrap_argv``; the root itself is the slot's writable overlay,
    capped in size and inodes. ``uid`` is the image's user and group inside the sandbox's user
    namespace ((0, 0) for the usual root image), which map to the slot's own unprivileged uid outside.
    (An image slot's verifier never runs here: ``verification.image_verifier_bwrap`` gives it a root
    of host files.)"""
    argv = [
        bwrap,
        *NAMESPACES,
        "--bind", str(root), "/",
        "--proc", "/proc", "--ro-bind", "/proc/sys", "/proc/sys",
        "--dev", "/dev",
        *_scratch(paths, limits),
        # "/": the image's WorkingDir is the supervisor's to enter (the slot's root user may have
        # removed it; a start must not fail for that)
        "--chdir", "/",
        "--clearenv",
        "--uid", str(uid[0]), "--gid", str(uid[1]), "--hostname", "sandbox",
        "--seccomp", str(seccomp_fd),
    ]
    # No bind onto the image's own /etc (a path the slot's root user controls, which bubblewrap would
    # follow): a network slot keeps the image's resolv.conf.
    if network and private_net:
        argv += ["--info-fd", "{info_fd}", "--block-fd", "{block_fd}"]
    elif network:
        argv[argv.index("--unshare-all") + 1 : argv.index("--unshare-all") + 1] = ["--share-net"]
    argv += ["--remount-ro", "/proc", "--remount-ro", "/dev"]
    for key, value in env.items():
        argv += ["--setenv", key, value]
    argv.append("--")
    return argv


def _elf_interpreter(path: str) -> str:
    """The program interpreter (PT_INTERP) an ELF64 executable names: its dynamic loader."""
    with open(path, "rb") as fh:
        head = fh.read(64)
        if head[:5] != b"\x7fELF\x02":
            raise OSError(f"{path}: not an ELF64 executable")
        phoff, = struct.unpack_from("<Q", head, 0x20)
        phentsize, phnum = struct.unpack_from("<HH", head, 0x36)
        for i in range(phnum):
            fh.seek(phoff + i * phentsize)
            ptype, _, offset, _, _, filesz = struct.unpack("<IIQQQQ", fh.read(40))
            if ptype == 3:  # PT_INTERP
                fh.seek(offset)
                return fh.read(filesz).rstrip(b"\0").decode()
    raise OSError(f"{path}: a static executable names no loader")


@functools.lru_cache(maxsize=8)
def host_program(path: str) -> tuple[str, ...]:
    """The argv prefix that runs the host's ``path`` (a program of its ``/usr``) inside an image
    root: through the host's own loader and libraries (at ``IMAGE_HOST_USR``), never the image's (a
    musl image has no glibc loader; an old one, an older glibc). ``--library-path`` holds for this
    process only: nothing it starts inherits it."""
    real = os.path.realpath(path)
    loader = os.path.realpath(_elf_interpreter(real))
    libdirs = [os.path.dirname(loader), "/usr/lib"]
    for p in (real, loader, *libdirs):
        if not p.startswith("/usr/"):
            raise OSError(f"{p} is not under /usr: an image slot cannot bring it from the host")

    def inside(p: str) -> str:
        return IMAGE_HOST_USR + p.removeprefix("/usr")

    return (inside(loader), "--library-path", ":".join(map(inside, libdirs)), inside(real))
