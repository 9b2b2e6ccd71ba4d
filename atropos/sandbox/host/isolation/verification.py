"""The verification sandbox of a slot: how it differs from the slot's working sandboxes.

It is the slot's own sandbox command line (same seccomp filter, namespaces, read-only system,
capped ``/tmp``) with four changes: the workspace is bound read-only, the run dir (the terminal's
socket and log) is not there at all, the runner is the sandbox's PID 1, and ``HOME`` and the
working directory are the private ``/tmp``, so start-up files the agent left in the workspace
(``.bashrc``, ``.local/lib/python3*/site-packages/*.pth``, ``.profile``) are not where any program
looks for them. No network. See docs/verification.md for the whole phase.
"""

from __future__ import annotations

from atropos.sandbox.host.isolation.bwrap import RUN_DIR, SANDBOX_ENV, WORKSPACE, SandboxPaths

VERIFIER_HOME = "/tmp"
VERIFIER_ENV = {k: v for k, v in SANDBOX_ENV.items() if k != "PS1"} | {"HOME": VERIFIER_HOME}


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
