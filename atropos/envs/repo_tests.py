"""SWE-bench-style verification of a repository on a task image's root (``Lease.verify`` with
``restore``, docs/verification.md): the task's FAIL_TO_PASS and PASS_TO_PASS tests run with the
image's own interpreter and pytest, and the score is 1 only if every one passes.

Only the agent's changes to the repository's code count. Before the verifier program runs, the
host puts back, exactly as the image has them (``RepoTests.restore_paths``):

* the task env's interpreter and what it reads before the repository's code runs (the env's
  directory with its site-packages, the standard library, the loader's configuration and the
  interpreter's shared libraries; ``system_paths``): a planted ``.pth``, ``sitecustomize.py``,
  entry-point plugin, fake ``pytest`` or ``python``, ``/etc/ld.so.preload`` is gone;
* in the repository, the test files, and in every directory from the repository's root down to each
  test file: ``conftest.py``, ``__init__.py``, ``pytest.ini``, ``tox.ini``, ``setup.cfg`` and
  ``pyproject.toml`` (one the image did not have is removed): edited tests, a planted conftest,
  ``addopts`` that deselect a test, a symlink in a test file's place do not count.

The program then runs pytest once, in a child (``verify_child.run_child``): the env's interpreter
by its absolute path with ``-I`` (no ``PYTHON*`` variables, no user site, the working directory not
on ``sys.path``), an environment of its own (``PYTEST_DISABLE_PLUGIN_AUTOLOAD=1``), the image's
test configuration named with ``-c``, ``--rootdir`` and ``--confcutdir`` the repository (no
``conftest.py`` above it is read), ``-p no:cacheprovider``, the test ids on the command line. The
outcome of each test comes from a reporting plugin of the program's child, written with a nonce on
a descriptor of its own: output, exit codes, ``os._exit``, a crash or a hang fail every test.

What it cannot do, as no pytest-based grader can (SWE-bench's included): the code under test runs in
pytest's process, so a change to the repository's code that patches pytest when imported can make
its tests report passed. Restoring the tests and configuration takes away every way that does not
go through the code the task asks to change.
"""

from __future__ import annotations

import posixpath
from typing import Any

from pydantic import BaseModel

from atropos.envs.verify_child import RUN_CHILD, passed_flags
from atropos.slots.lease import Lease

__all__ = ["CHILD", "PROGRAM", "TEST_SETTINGS", "RepoTests", "run_repo_tests"]

# the files that decide which tests pytest runs and how, in every directory from the root to a test
TEST_SETTINGS = ("conftest.py", "__init__.py", "pytest.ini", "tox.ini", "setup.cfg", "pyproject.toml")
MAX_WHY_CHARS = 300  # one line per failed test for the researcher's log


class RepoTests(BaseModel):
    """Where the repository and its interpreter are in the image, and which tests decide."""

    repo_dir: str  # absolute, e.g. /testbed
    python: str  # the task env's interpreter, absolute, e.g. /opt/miniconda3/envs/testbed/bin/python
    pytest_config: str  # the file pytest takes its settings from, relative to repo_dir
    test_files: list[str]  # relative to repo_dir: restored before the run
    fail_to_pass: list[str]  # pytest node ids relative to repo_dir
    pass_to_pass: list[str]
    # outside the repository: the env and what its interpreter reads at start-up (absolute; the
    # image's whole root would be surer, but the host restores by copying, hundreds of MB a rollout)
    system_paths: list[str]

    @property
    def ids(self) -> list[str]:
        return [*self.fail_to_pass, *self.pass_to_pass]

    def restore_paths(self) -> list[str]:
        """What the host puts back as the image has it before the verifier runs."""
        repo = self.repo_dir.rstrip("/")
        paths = set(self.system_paths)
        files = {*self.test_files, self.pytest_config, *(i.split("::", 1)[0] for i in self.ids)}
        for rel in files:
            paths.add(posixpath.join(repo, rel))
            parts = posixpath.dirname(rel).split("/") if posixpath.dirname(rel) else []
            for depth in range(len(parts) + 1):
                where = posixpath.join(repo, *parts[:depth])
                paths.update(posixpath.join(where, name) for name in TEST_SETTINGS)
        return sorted(paths)

    def pytest_argv(self) -> list[str]:
        repo = self.repo_dir.rstrip("/")
        return ["-c", posixpath.join(repo, self.pytest_config), "--rootdir", repo, "--confcutdir", repo,
                "-p", "no:cacheprovider", "-q", *self.ids]

    def child_env(self) -> dict[str, str]:
        """The pytest child's whole environment (the image's Env and the agent's do not reach it)."""
        bin_dir = posixpath.dirname(self.python)
        return {"PATH": f"{bin_dir}:/usr/local/bin:/usr/bin:/bin", "HOME": "/tmp", "TMPDIR": "/tmp",
                "LANG": "C.UTF-8", "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"}

    def must_be_real(self) -> list[str]:
        """Paths the program checks are what they claim after the restore (no link on the way)."""
        repo = self.repo_dir.rstrip("/")
        return [self.python, posixpath.join(repo, self.pytest_config),
                *(posixpath.join(repo, f) for f in self.test_files)]


# The pytest child: runs in the task env's interpreter (-I). Its report goes out on a duplicate of
# its stdout, which is then pointed at stderr (discarded), so what the code under test prints is
# never read as the report.
CHILD = r'''
import json, os, sys
channel = os.dup(1)
os.dup2(2, 1)
request = json.loads(sys.stdin.read())
null = os.open(os.devnull, os.O_RDONLY)
os.dup2(null, 0)
nonce = request.pop("nonce")
sys.dont_write_bytecode = True
outcomes, why = {}, {}


def last_line(report):
    crash = getattr(getattr(report, "longrepr", None), "reprcrash", None)  # "AssertionError: assert 1 == 2"
    text = getattr(crash, "message", None) or getattr(report, "longreprtext", "") or ""
    lines = [line for line in str(text).splitlines() if line.strip()]
    return (lines[0] if crash is not None and lines else lines[-1] if lines else "").strip()[:MAX_WHY_CHARS]


class Record:
    def pytest_runtest_logreport(self, report):
        if report.failed:
            outcomes[report.nodeid] = "failed" if report.when == "call" else "error"
            why.setdefault(report.nodeid, report.when + ": " + last_line(report))
        elif report.when == "call" or (report.skipped and report.when == "setup"):
            outcomes[report.nodeid] = "skipped" if report.skipped else "passed"

    def pytest_collectreport(self, report):
        if report.failed:
            why[report.nodeid or "collection"] = "collection: " + last_line(report)


code = -1
try:
    import pytest
    code = int(pytest.main(request["argv"], plugins=[Record()]))
except BaseException as exc:
    why["pytest"] = type(exc).__name__ + ": " + str(exc)[:200]
os.write(channel, (json.dumps({"nonce": nonce, "exit": code, "outcomes": outcomes, "why": why}) + "\n").encode())
'''.replace("MAX_WHY_CHARS", str(MAX_WHY_CHARS))

PROGRAM = RUN_CHILD + r'''
import json, os, secrets as tokens, stat


def verify(workspace, secrets, args):
    tampered = []
    for path in args["must_be_real"]:
        at = os.path.join(ROOT, path.lstrip("/"))  # where the runner sees the root it checks
        try:
            real = os.path.realpath(at) == at and stat.S_ISREG(os.lstat(at).st_mode)
        except OSError:
            real = False
        if not real:
            tampered.append(path)
    ids = args["ids"]
    if tampered:
        return {"score": 0.0, "passed": [False] * len(ids), "tampered": tampered}
    nonce = tokens.token_hex(16)
    seen = {}

    def judge(code, lines):
        if len(lines) != 1:
            return False
        report = json.loads(lines[0])
        if report.get("nonce") != nonce:
            return False
        seen.update(report)
        return True

    reported = run_child(args["child"], [], args["cwd"], {"nonce": nonce, "argv": args["argv"]}, args["timeout"],
                         judge, python=args["python"], env=args["env"])
    outcomes = seen.get("outcomes") or {}
    passed = [reported and outcomes.get(i) == "passed" for i in ids]
    why = seen.get("why") or {}
    return {"score": 1.0 if passed and all(passed) else 0.0, "passed": passed, "reported": reported,
            "outcomes": {i: outcomes.get(i, "not run") for i in ids},
            "why": {k: str(v)[:300] for k, v in list(why.items())[:20]}}
'''


async def run_repo_tests(lease: Lease, tests: RepoTests, *, timeout_s: float = 120.0) -> tuple[float, dict[str, Any]]:
    """Run ``tests`` on the sealed slot's image root with its tests and test settings restored; 1.0
    only if every FAIL_TO_PASS and PASS_TO_PASS test passes. The dict says which failed and why
    (``verifier_error`` when the run itself failed or a restored path was not what it claims)."""
    ids = tests.ids
    if not ids:
        raise ValueError("no test to run")
    args = {"child": CHILD, "argv": tests.pytest_argv(), "ids": ids, "cwd": tests.repo_dir, "python": tests.python,
            "env": tests.child_env(), "timeout": timeout_s, "must_be_real": tests.must_be_real()}
    result = await lease.verify(PROGRAM, args=args, timeout_s=timeout_s + 30, restore=tests.restore_paths())
    score, info = score_verdict(tests, result.verdict if result.ok else None, passed_flags(result, len(ids)))
    if result.error is not None:  # the host's words (restore_failed, timed_out, ...) for the log
        info["verifier_message"] = result.error.message[:MAX_WHY_CHARS]
    return score, info


def score_verdict(tests: RepoTests, verdict: dict[str, Any] | None,
                  passed: list[bool] | str) -> tuple[float, dict[str, Any]]:
    """The score and the researcher's log from the program's verdict (``passed`` as ``passed_flags``
    read it: the flags, or why there are none)."""
    ids = tests.ids
    if isinstance(passed, str):
        return 0.0, {"tests_passed": 0, "tests_total": len(ids), "verifier_error": passed}
    verdict = verdict or {}
    failed = [i for i, p in zip(ids, passed, strict=True) if not p]
    info: dict[str, Any] = {
        "tests_passed": len(ids) - len(failed), "tests_total": len(ids),
        "fail_to_pass_failed": [i for i in tests.fail_to_pass if i in failed],
        "pass_to_pass_failed": [i for i in tests.pass_to_pass if i in failed]}
    outcomes: dict[str, Any] = verdict["outcomes"] if isinstance(verdict.get("outcomes"), dict) else {}
    why: dict[str, Any] = verdict["why"] if isinstance(verdict.get("why"), dict) else {}
    if failed:
        info["why"] = {i: f"{outcomes.get(i, 'not run')}: {why.get(i, '')}".rstrip(": ") for i in failed[:20]}
        others = {k: v for k, v in why.items() if k not in ids}  # collection errors, pytest itself
        if others:
            info["errors"] = others
    if verdict.get("tampered"):
        info["verifier_error"] = "tampered"
        info["tampered"] = verdict["tampered"]
    elif verdict.get("reported") is False:
        info["verifier_error"] = "no_report"
    return (1.0 if not failed else 0.0), info
