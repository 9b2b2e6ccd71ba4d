"""Warm interpreters inside a slot: a ``bash`` (and a ``python3``) started while the slot is idle,
waiting for the source of the slot's next default call.

Standard library only; copied into the host's lib dir beside ``supervisor.py`` (see there).
"""

from __future__ import annotations

import os
import subprocess

# Warm interpreters: a `bash` (and, once the slot has used `python`, a `python3`) that has already
# paid for exec, dynamic loading and start-up, waiting for its command: the next default call only
# writes the source into a memfd (seekable, so bash's `read` takes it in blocks, not a byte per
# syscall) and says go through a pipe. What the bootstrap needs is gone before the source runs, so
# the source sees what a fresh `bash -c` / `python3 -c` gives it.
BASH = "/bin/bash"
PYTHON = "python3"


def _bash_boot(go_fd: int, src_fd: int) -> str:
    return (f'IFS= read -r -n 1 -u {go_fd} __atropos_go || exit 0; '
            f'IFS= read -r -d "" -u {src_fd} __atropos_cmd; exec {go_fd}<&- {src_fd}<&-; '
            # the source runs from BASH_EXECUTION_STRING (as in `bash -c`): a syntax error in it
            # quotes its own line, never this bootstrap
            'unset __atropos_go; BASH_EXECUTION_STRING=$__atropos_cmd; unset __atropos_cmd; '
            ': "$0"; eval "$BASH_EXECUTION_STRING"')


def _python_boot(go_fd: int, src_fd: int) -> str:
    # One function, deleted from __main__ before the source runs in __main__'s namespace. Uncaught
    # exceptions are printed by sys.excepthook without the bootstrap's own frame, as `python3 -c`
    # prints them (exit status 1); SystemExit propagates to the interpreter as usual.
    return f"""def _atropos_boot():
    import os, sys
    if not os.read({go_fd}, 1):
        os._exit(0)
    os.close({go_fd})
    parts = []
    while True:
        part = os.read({src_fd}, 1 << 20)
        if not part:
            break
        parts.append(part)
    os.close({src_fd})
    namespace = sys.modules["__main__"].__dict__
    del namespace["_atropos_boot"]
    source = b"".join(parts).decode("utf-8", "surrogateescape")
    try:
        exec(compile(source, "<string>", "exec"), namespace)
    except SystemExit:
        raise
    except BaseException as exc:
        exc.__traceback__ = exc.__traceback__.tb_next  # the printer reads it from the exception
        sys.excepthook(type(exc), exc, exc.__traceback__)
        raise SystemExit(1) from None
_atropos_boot()
"""


WARM_KINDS = {BASH: _bash_boot, PYTHON: _python_boot}


class WarmInterpreter:
    """A pre-started interpreter for the slot's next default call of its kind (workspace cwd, slot
    env, no stdin), fed its source through a memfd."""

    def __init__(self, kind: str, cwd: str, env: dict[str, str]) -> None:
        self.src_fd = os.memfd_create("source", os.MFD_CLOEXEC)
        go_r, self.go_w = os.pipe2(os.O_CLOEXEC)
        devnull = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
        try:
            self.proc = subprocess.Popen(
                [kind, "-c", WARM_KINDS[kind](go_r, self.src_fd)], stdin=devnull,
                stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=cwd, env=env, close_fds=True,
                start_new_session=True, pass_fds=(go_r, self.src_fd),
            )
        except BaseException:
            os.close(self.src_fd)
            os.close(self.go_w)
            raise
        finally:
            os.close(go_r)
            os.close(devnull)
        self.kind = kind
        self.cwd = cwd

    def alive(self) -> bool:
        return self.proc.poll() is None

    def go(self, source: str) -> None:
        data = os.fsencode(source) + (b"\0" if self.kind == BASH else b"")
        os.pwrite(self.src_fd, data, 0)
        os.write(self.go_w, b"g")
        self.close_fds()

    def close_fds(self) -> None:
        for fd in (self.src_fd, self.go_w):
            try:
                os.close(fd)
            except OSError:
                pass
        self.src_fd = self.go_w = -1

    def drop(self) -> None:
        """Kill (if still alive) and reap."""
        self.close_fds()  # EOF on the go pipe: it would exit by itself
        for pipe in (self.proc.stdout, self.proc.stderr):
            if pipe is not None:
                pipe.close()
        try:
            self.proc.kill()
        except OSError:
            pass
        self.proc.wait()

