"""The bubblewrap command line of a slot sandbox (see docs/isolation.md)."""

from __future__ import annotations

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
        "--unshare-all", "--unshare-user", "--disable-userns",
        "--die-with-parent", "--new-session", "--cap-drop", "ALL",
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
        *(["--bind", str(paths.shm), "/dev/shm"] if paths.shm is not None else
          ["--size", str(limits.shm_bytes), "--perms", "1777", "--tmpfs", "/dev/shm"]),
        *(["--bind", str(paths.tmp), "/tmp"] if paths.tmp is not None else
          ["--size", str(limits.tmp_bytes), "--perms", "1777", "--tmpfs", "/tmp"]),
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
