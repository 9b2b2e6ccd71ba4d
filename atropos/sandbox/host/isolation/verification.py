"""The verification sandbox of a slot: how it differs from the slot's working sandboxes.

It is the slot's own sandbox command line (same seccomp filter, namespaces, read-only system,
capped ``/tmp``) with four changes: the workspace is bound read-only, the run dir (the terminal's
socket and log) is not there at all, the runner is the sandbox's PID 1, and ``HOME`` and the
working directory are the private ``/tmp``, so start-up files the agent left in the workspace
(``.bashrc``, ``.local/lib/python3*/site-packages/*.pth``, ``.profile``) are not where any program
looks for them. No network. See docs/verification.md for the whole phase.

On a slot whose ``/`` is a task image the agent could write every file of that root (uid 0 in it),
so the runner does not run inside it (``image_verifier_bwrap``): its own root is made of host files
only, as a default slot's is, and the slot's root is a directory of it (``CHECKED_ROOT``), where the
programs the verifier starts run with it as their ``/`` (``verifier.py`` chroots them).
"""

from __future__ import annotations

from pathlib import Path

from atropos.sandbox.host.config import Limits
from atropos.sandbox.host.isolation.bwrap import (
    IMAGE_RUN_DIR,
    LIB_DIR,
    NAMESPACES,
    RUN_DIR,
    SANDBOX_ENV,
    WORKSPACE,
    SandboxPaths,
    bwrap_argv,
)

VERIFIER_HOME = "/tmp"
VERIFIER_ENV = {k: v for k, v in SANDBOX_ENV.items() if k != "PS1"} | {"HOME": VERIFIER_HOME}
# Where the runner of an image slot sees the root it checks (the slot's; a fresh one is a root like it).
CHECKED_ROOT = "/run/checked"
RUNNER_TMP_BYTES = 64 << 20  # the runner's own /tmp: only the verifier program writes there


def _find(argv: list[str], *items: str) -> int:
    n = len(items)
    for i in range(len(argv) - n + 1):
        if argv[i : i + n] == list(items):
            return i
    # bwrap.py changed shape: fail loudly rather than start a verifier with a writable workspace
    raise ValueError(f"the sandbox command line has no {' '.join(items)!r}")


def verifier_bwrap(argv: list[str], paths: SandboxPaths) -> list[str]:
    """The verification variant of a slot's bwrap argv (before the ``--`` and the command)."""
    out = list(argv)
    out[_find(out, "--bind", str(paths.workspace), WORKSPACE)] = "--ro-bind"
    i = _find(out, "--bind", str(paths.run_dir), RUN_DIR)
    del out[i : i + 3]
    out[_find(out, "--chdir", WORKSPACE) + 1] = VERIFIER_HOME
    out[_find(out, "--setenv", "HOME", WORKSPACE) + 2] = VERIFIER_HOME
    i = _find(out, "--setenv", "PS1", SANDBOX_ENV["PS1"])
    del out[i : i + 3]
    # The runner itself is PID 1: no bwrap init holds the protocol pipes as its dumpable fds 0-2
    # (through /proc/1/fd/1 the checked code could otherwise write a verdict frame of its own where
    # the pipe's owner is the slot's uid), and PID 1 ignores the signals it has no handler for,
    # so the code it checks cannot kill it either.
    out.insert(_find(out, "--unshare-all"), "--as-pid-1")
    return out


def image_verifier_bwrap(bwrap: str, root: Path, paths: SandboxPaths, limits: Limits, *,
                         uid: tuple[int, int]) -> list[str]:
    """The verification sandbox of a slot whose root is ``root`` (a task image's, mounted with its
    mount points by the mount helper): the runner itself starts from host files only (the host's
    ``/usr`` and loader configuration, the lib dir, the host-made ``/etc`` files a default slot has:
    ``bwrap_argv``'s system), with ``bwrap --clearenv`` and ``VERIFIER_ENV``, and nothing of
    ``root`` on its way (the loader never reads the root's ``/etc/ld.so.preload``, the image's
    ``Env`` never reaches it). ``root`` is at ``CHECKED_ROOT`` with its own ``/proc``, ``/dev``
    and the slot's capped ``/tmp`` and ``/dev/shm``, the run dir hidden, and the runner keeps
    ``CAP_SYS_CHROOT`` (in the sandbox's user namespace only) to start the programs it checks
    there: they drop every capability before their exec (``verifier.py``). Same namespaces, no
    network, PID 1 (``verifier_bwrap`` for why); ``uid`` is the image's user, as in the slot."""
    base = bwrap_argv(bwrap, paths, limits, network=False, seccomp_fd=-1)
    system = base[base.index("--ro-bind", 1) : _find(base, "--bind", str(paths.workspace), WORKSPACE)]
    checked = CHECKED_ROOT
    argv = [
        bwrap, "--as-pid-1", *NAMESPACES, "--cap-add", "CAP_SYS_CHROOT",
        *system,
        "--ro-bind", str(paths.lib_dir), LIB_DIR,
        "--proc", "/proc", "--dev", "/dev",
        "--size", str(RUNNER_TMP_BYTES), "--perms", "1777", "--tmpfs", VERIFIER_HOME,
        "--bind", str(root), checked,
        "--proc", f"{checked}/proc", "--dev", f"{checked}/dev",
        *(["--bind", str(paths.shm), f"{checked}/dev/shm"] if paths.shm is not None else
          ["--size", str(limits.shm_bytes), "--perms", "1777", "--tmpfs", f"{checked}/dev/shm"]),
        *(["--bind", str(paths.tmp), f"{checked}/tmp"] if paths.tmp is not None else
          ["--size", str(limits.tmp_bytes), "--perms", "1777", "--tmpfs", f"{checked}/tmp"]),
        "--size", "4096", "--tmpfs", f"{checked}{IMAGE_RUN_DIR}",  # the terminal's socket and log: not here
        "--chdir", VERIFIER_HOME,
        "--clearenv",
        "--uid", str(uid[0]), "--gid", str(uid[1]), "--hostname", "sandbox",
        "--seccomp", "{seccomp_fd}",
        "--remount-ro", "/proc", "--remount-ro", "/dev", "--remount-ro", f"{checked}/proc",
        "--remount-ro", f"{checked}/dev", "--remount-ro", "/",
    ]
    for key, value in VERIFIER_ENV.items():
        argv += ["--setenv", key, value]
    argv.append("--")
    return argv
