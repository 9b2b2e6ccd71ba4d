"""The one way a verification program runs the agent's code: a child per test or case.

``RUN_CHILD`` is Python source that a verifier program (``Lease.verify``, docs/verification.md)
starts with; both ``atropos/envs/hidden_test_files.py`` and
``atropos/envs/examples/hidden_tests.py`` build their ``PROGRAM`` on it. It defines, inside the
verification sandbox:

* ``kill_others()``: SIGKILL every process of the sandbox but the program (and its init), so
  nothing a child forked survives into the next child's answer;
* ``run_child(child, argv, cwd, request, timeout, judge, python=None, env=None, isolated=True)``:
  kill the others, start ``child`` (Python source) as ``python -I -c child *argv`` (``python`` an
  absolute path, by default the runner's own interpreter; ``env`` the child's whole environment, by
  default the runner's; ``isolated=False`` leaves out ``-I``, so the child starts as the task's own
  ``python -m pytest`` would: its ``PYTHON*`` variables, the working directory first on
  ``sys.path``: for a fresh root, where nothing outside the repository is the agent's) in its own
  session with ``request`` as JSON on its stdin (stderr discarded), and
  return ``judge(exit code, the lines it wrote on stdout)``; a hang past ``timeout``, a crash of
  the start or any exception of ``judge`` (a reply that is not JSON, one nested too deep to parse)
  is ``False``; the others are killed again, and the child reaped, before it returns. What counts
  as passed (one line with a nonce, the last line's value) is the caller's ``judge``: the child's
  stdout is written by the agent's code too.

Such a program answers ``{"score", "passed": [one bool a test or case]}``; ``passed_flags`` reads
that answer on the env's side.
"""

from __future__ import annotations

from atropos.sandbox.contract.protocol import VerifyResult

__all__ = ["RUN_CHILD", "passed_flags"]

RUN_CHILD = r'''
import json, os, signal, subprocess, sys


def kill_others():
    try:
        os.kill(-1, signal.SIGKILL)  # every process of this sandbox but us (and its init)
    except OSError:
        pass


def run_child(child, argv, cwd, request, timeout, judge, python=None, env=None, isolated=True):
    kill_others()
    flags = ["-I"] if isolated else []
    proc = subprocess.Popen([python or sys.executable, *flags, "-c", child, *argv], cwd=cwd, env=env,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(json.dumps(request).encode(), timeout=timeout)
        return bool(judge(proc.returncode, out.decode("utf-8", "replace").strip().splitlines()))
    except Exception:
        return False
    finally:
        kill_others()
        proc.wait()
'''


def passed_flags(result: VerifyResult, total: int) -> list[bool] | str:
    """The verdict's ``passed`` list, one flag per test or case (only ``True`` passes), or why
    there is none: the host's error code, ``no_verdict``, or ``wrong_shape`` when it is not a list
    of ``total`` entries (``total`` is the env's own count, never the program's)."""
    if not result.ok or result.verdict is None:
        return result.error.code if result.error is not None else "no_verdict"
    passed = result.verdict.get("passed")
    if not isinstance(passed, list) or len(passed) != total:
        return "wrong_shape"
    return [p is True for p in passed]
