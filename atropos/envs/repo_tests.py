"""SWE-bench-style verification of a repository on a fresh root of the task's image
(``Lease.verify`` with ``fresh_root``, docs/verification.md): the task's FAIL_TO_PASS and
PASS_TO_PASS tests, run as the task's own test command runs them, score 1 only if every one passes.

The tests run on a **new root**, not the agent's: the image's layers plus only the agent's changes
to the repository (its diff against the image, without ``__pycache__``, ``*.pyc``,
``.pytest_cache`` and ``.git``; deletions carried over; links out of the repository dropped), with
the task's test files and test settings taken from the image (``RepoTests.from_image``) and, for a
published instance, the task's test patch applied over them (``test_patch``, with the image's own
``git apply``, as SWE-bench's evaluation script does). Whatever the agent did outside the repository
(``/etc/ld.so.preload``, a planted shared library or name-service module, the env's interpreter or
site-packages, a ``.pth``, the standard library) does not exist there; neither do the byte-code
caches beside unchanged tests.

On that root the program runs pytest once, in a child (``verify_child.run_child``) started as the
task's ``python -m pytest`` would be: the env's interpreter (``python``, or the first ``python`` on
the image's ``PATH``: a real file or a link into the image), the image's ``Env`` (as ``docker run``
gives it), the image's ``User``, the repository as working directory and first on ``sys.path`` (so a
repository installed in development mode or not installed at all imports as in the task's own
command), pytest's own discovery of the repository's settings file (``-c`` only when the task names
one), ``--rootdir`` the repository (the node ids are relative to it), ``-p no:cacheprovider``. The
outcome of each test comes from a reporting plugin of the program's child, written with a nonce on
a descriptor of its own: output, exit codes, ``os._exit``, a crash or a hang fail every test.

What it cannot do, as no pytest-based grader can (SWE-bench's included): the code under test runs in
pytest's process, so a change to the repository's code that patches pytest when imported can make
its tests report passed. Taking the tests, their settings and everything outside the repository from
the image takes away every way that does not go through the code the task asks to change.
"""

from __future__ import annotations

import json
import posixpath
import subprocess
from typing import Any

from pydantic import BaseModel, Field

from atropos.envs.verify_child import RUN_CHILD, passed_flags
from atropos.errors import ConfigError
from atropos.sandbox.contract.protocol import FreshRoot
from atropos.slots.lease import Lease

__all__ = ["CHILD", "DOCKER_DEFAULT_PATH", "PROGRAM", "TEST_SETTINGS", "RepoTests", "run_repo_tests"]

# the files that decide which tests pytest runs and how, taken from the image in every directory from
# the repository's root down to each test file (``__init__.py`` only in a test file's own directory:
# above it, it is the package's code the task may ask to change)
TEST_SETTINGS = ("conftest.py", "pytest.ini", "tox.ini", "setup.cfg", "pyproject.toml")
MAX_WHY_CHARS = 300  # one line per failed test for the researcher's log
# what ``docker run`` puts in PATH when the image's Env has none
DOCKER_DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


class RepoTests(BaseModel):
    """Where the repository is in the image, which tests decide, and how the task runs them.
    ``RepoTests.for_image`` works the rest out from the image."""

    repo_dir: str  # absolute, e.g. /testbed
    fail_to_pass: list[str]  # pytest node ids relative to repo_dir
    pass_to_pass: list[str]
    # relative to repo_dir, taken from the image (default: the files of the test ids)
    test_files: list[str] = Field(default_factory=list)
    # the task env's interpreter, absolute (a real file or a link); None: the first ``python`` on
    # the image's PATH outside the repository, as the task's own ``python -m pytest`` finds it
    python: str | None = None
    # the environment of the test command: the image's Env as ``docker run`` gives it
    env: dict[str, str] = Field(default_factory=lambda: {"PATH": DOCKER_DEFAULT_PATH})
    # a settings file relative to repo_dir when the task's command names one; None: pytest finds the
    # repository's own (or none)
    pytest_config: str | None = None
    test_patch: str | None = None  # a published instance's test patch, applied over the image's tests

    @classmethod
    def for_image(cls, image: str, repo_dir: str, fail_to_pass: list[str], pass_to_pass: list[str], *,
                  test_files: list[str] | None = None, python: str | None = None,
                  test_patch: str | None = None) -> RepoTests:
        """The tests of the repository at ``repo_dir`` in the local Docker engine's ``image``: the
        image's ``Env`` (one ``docker image inspect``; nothing is run), the interpreter found on its
        ``PATH`` at verification time unless ``python`` names one, the repository's own pytest
        settings. ``test_files`` defaults to the files of the test ids (and, with ``test_patch``,
        the files it touches)."""
        env = image_env(image)
        files = list(test_files) if test_files is not None else sorted(
            {i.split("::", 1)[0] for i in [*fail_to_pass, *pass_to_pass]} | set(patch_files(test_patch or "")))
        return cls(repo_dir=repo_dir, fail_to_pass=list(fail_to_pass), pass_to_pass=list(pass_to_pass),
                   test_files=files, python=python, env=env, test_patch=test_patch)

    @property
    def ids(self) -> list[str]:
        return [*self.fail_to_pass, *self.pass_to_pass]

    def from_image(self) -> list[str]:
        """What the verification root takes from the image (relative to the repository): the test
        files, their test settings in every directory from the repository's root down, and a test
        file's whole directory when it is a test directory (``tests``, ``test_x``, ``x_tests``:
        helper modules and data the tests import are the task's, not the agent's)."""
        files = {*self.test_files, *(i.split("::", 1)[0] for i in self.ids)}
        if self.pytest_config:
            files.add(self.pytest_config)
        paths, whole = set(files), set()
        for rel in files:
            parts = posixpath.dirname(rel).split("/") if posixpath.dirname(rel) else []
            for depth in range(len(parts) + 1):
                paths.update(posixpath.join(*parts[:depth], name) for name in TEST_SETTINGS)
            paths.add(posixpath.join(*parts, "__init__.py"))
            if parts and is_test_dir(parts[-1]):
                whole.add(posixpath.join(*parts))
        # a directory taken whole holds what is named below it
        return sorted(whole | {p for p in paths if not any(p.startswith(d + "/") for d in whole)})

    def fresh_root(self) -> FreshRoot:
        return FreshRoot(repo_dir=self.repo_dir.rstrip("/"), from_image=self.from_image())

    def pytest_argv(self) -> list[str]:
        repo = self.repo_dir.rstrip("/")
        config = ["-c", posixpath.join(repo, self.pytest_config)] if self.pytest_config else []
        return [*config, "--rootdir", repo, "-p", "no:cacheprovider", "-q", *self.ids]


def is_test_dir(name: str) -> bool:
    return name in ("test", "tests", "testing") or name.startswith("test_") or name.endswith("_tests")


def image_env(image: str) -> dict[str, str]:
    """The environment ``docker run`` gives ``image``'s processes: its ``Env`` over the default
    ``PATH`` (``HOME``, when the image sets none, is the user's home in the image's passwd: the
    verifier reads it there)."""
    try:
        done = subprocess.run(["docker", "image", "inspect", "--format", "{{json .Config.Env}}", image],
                              capture_output=True, timeout=60)
    except FileNotFoundError as exc:
        raise ConfigError("RepoTests.for_image reads the image's Env with the docker CLI; it is not installed") from exc
    if done.returncode != 0:
        raise ConfigError(f"RepoTests.for_image: no image {image!r} in the local Docker engine "
                          f"({done.stderr.decode(errors='replace').strip()[:300]})")
    env = {"PATH": DOCKER_DEFAULT_PATH}
    for item in json.loads(done.stdout or b"null") or []:
        key, sep, value = str(item).partition("=")
        if sep and key:
            env[key] = value
    return env


def patch_files(patch: str) -> list[str]:
    """The files a unified diff touches (its ``diff --git a/X b/Y`` lines, both sides)."""
    out: set[str] = set()
    for line in patch.splitlines():
        if line.startswith("diff --git a/"):
            a, sep, b = line[len("diff --git a/"):].partition(" b/")
            if sep:
                out.update((a, b))
    return sorted(out)


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
import json, os, secrets as tokens, subprocess


def in_root(path):
    """Where the runner sees ``path`` of the checked root, its links followed as that root
    resolves them (an absolute link means the checked root's ``/``, never the runner's)."""
    parts, cur, hops = [p for p in path.split("/") if p], "/", 0
    while parts:
        part = parts.pop(0)
        if part in (".", ".."):
            cur = os.path.dirname(cur) if part == ".." else cur
            continue
        nxt = os.path.join(cur, part)
        at = os.path.join(ROOT, nxt.lstrip("/"))
        if os.path.islink(at):
            hops += 1
            if hops > 40:
                return None
            target = os.readlink(at)
            cur = "/" if target.startswith("/") else cur
            parts = [p for p in target.split("/") if p] + parts
            continue
        cur = nxt
    return os.path.join(ROOT, cur.lstrip("/"))


def find_python(args, env):
    if args["python"]:
        return args["python"]
    repo = args["repo"].rstrip("/") + "/"
    for d in env.get("PATH", "").split(":"):
        if not d.startswith("/") or (d.rstrip("/") + "/").startswith(repo):
            continue  # the agent's files are never the interpreter
        for name in ("python", "python3"):
            path = os.path.join(d, name)
            at = in_root(path)  # where the runner sees the root it checks
            if at is not None and os.path.isfile(at) and os.access(at, os.X_OK):
                return path
    return None


def home_of(uid):
    try:
        with open(os.path.join(ROOT, "etc/passwd"), encoding="utf-8", errors="replace") as fh:
            for line in fh:
                f = line.rstrip("\n").split(":")
                if len(f) > 5 and f[2] == str(uid) and f[5]:
                    return f[5]
    except OSError:
        pass
    return "/root" if uid == 0 else "/"


def apply_test_patch(patch, repo, env):
    done = subprocess.run(["git", "-c", "core.hooksPath=/dev/null", "apply", "-v", "-"], input=patch.encode(),
                          cwd=repo, env=env, capture_output=True, timeout=120)
    return done.returncode == 0, done.stderr.decode("utf-8", "replace")[-300:]


def verify(workspace, secrets, args):
    ids = args["ids"]
    env = dict(args["env"])
    env.setdefault("HOME", home_of(os.getuid()))
    if args.get("test_patch"):
        ok, why = apply_test_patch(args["test_patch"], args["repo"], env)
        if not ok:
            return {"score": 0.0, "passed": [False] * len(ids), "setup_error": "test_patch: " + why}
    python = find_python(args, env)
    if python is None:
        return {"score": 0.0, "passed": [False] * len(ids), "setup_error": "no python on the image's PATH"}
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

    reported = run_child(args["child"], [], args["repo"], {"nonce": nonce, "argv": args["argv"]}, args["timeout"],
                         judge, python=python, env=env, isolated=False)
    outcomes = seen.get("outcomes") or {}
    passed = [reported and outcomes.get(i) == "passed" for i in ids]
    why = seen.get("why") or {}
    return {"score": 1.0 if passed and all(passed) else 0.0, "passed": passed, "reported": reported,
            "python": python, "outcomes": {i: outcomes.get(i, "not run") for i in ids},
            "why": {k: str(v)[:300] for k, v in list(why.items())[:20]}}
'''


async def run_repo_tests(lease: Lease, tests: RepoTests, *, timeout_s: float = 120.0) -> tuple[float, dict[str, Any]]:
    """Run ``tests`` on a fresh root of the sealed slot's image holding only the agent's changes to
    the repository; 1.0 only if every FAIL_TO_PASS and PASS_TO_PASS test passes. The dict says which
    failed and why (``verifier_error`` when the run itself failed)."""
    ids = tests.ids
    if not ids:
        raise ValueError("no test to run")
    args = {"child": CHILD, "argv": tests.pytest_argv(), "ids": ids, "repo": tests.repo_dir.rstrip("/"),
            "python": tests.python, "env": tests.env, "timeout": timeout_s, "test_patch": tests.test_patch}
    result = await lease.verify(PROGRAM, args=args, timeout_s=timeout_s + 60, fresh_root=tests.fresh_root())
    score, info = score_verdict(tests, result.verdict if result.ok else None, passed_flags(result, len(ids)))
    if result.error is not None:  # the host's words (fresh_root_failed, timed_out, ...) for the log
        info["verifier_message"] = result.error.message[:MAX_WHY_CHARS]
    if result.fresh_root is not None:
        info["fresh_root"] = result.fresh_root
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
    if verdict.get("setup_error"):
        info["verifier_error"] = str(verdict["setup_error"])[:MAX_WHY_CHARS]
    elif verdict.get("reported") is False:
        info["verifier_error"] = "no_report"
    return (1.0 if not failed else 0.0), info
