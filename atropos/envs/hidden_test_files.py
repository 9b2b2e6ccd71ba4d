"""Run test files the verifier brings (pytest-style ``test_*`` functions and ``unittest`` classes)
against the agent's code, inside ``lease.verify`` (docs/verification.md).

The slot's root has no pytest, and pytest would read the agent's ``conftest.py``, ``pytest.ini``,
``pyproject.toml``, ``setup.cfg`` and plugins; so this is a small stdlib runner that reads none of
them. What the agent's code cannot do to it:

* change the tests: they come from the env (``tests``: file name -> source) as secrets of the
  verification program, written to its own temporary directory; a test file of the same name in
  the workspace is never read, and no test configuration of the workspace is either;
* run start-up code: each test runs in its own child ``python3 -I`` (no user site, no
  ``PYTHON*`` variables, the workspace not on ``sys.path`` while ``site`` runs, so a planted
  ``sitecustomize.py`` or ``.pth`` does not run), and the workspace is appended to ``sys.path``
  last, after the runner's own imports (a planted ``unittest.py`` or ``json.py`` shadows nothing);
* say it passed: a test passes only when its child reports ``passed`` with a nonce of that child
  on a descriptor of its own, and exits 0; output, an exit code, ``sys.exit``, ``os._exit``, a
  crash, a hang (``timeout_s`` per test), a killed runner all fail the test; every other process of
  the verification sandbox is killed before and after each test; the number of tests comes from
  the env, not from the program's answer.

What it cannot do: a test runs the agent's code in its own process, so code that inspects the
runner's frames or memory can find the nonce, and an object whose ``__eq__`` always says True
passes ``assert f(x) == y``. Write hidden tests that check types (``assert type(r) is int and r ==
5``) and, where the reward must hold against such code, compare plain values across a process
boundary as ``atropos/envs/examples/hidden_tests.py`` does. Tests take no fixtures (a test function
with parameters fails) and cannot ``import pytest`` (the root has none).
"""

from __future__ import annotations

import ast
import json
from collections.abc import Mapping, Sequence
from typing import Any

from atropos.envs.verify_child import RUN_CHILD, passed_flags
from atropos.slots.lease import Lease

__all__ = ["CHILD", "PROGRAM", "hidden_test_ids", "run_hidden_tests"]

CHILD = r'''
import importlib.util, json, os, sys, unittest
channel = os.dup(1)
os.dup2(2, 1)  # the code under test prints where stderr goes (nowhere); the report has its own fd
request = json.loads(sys.stdin.read())
os.close(0)


def report(outcome, _nonce=request.pop("nonce")):
    os.write(channel, (json.dumps({"nonce": _nonce, "outcome": outcome}) + "\n").encode())


sys.dont_write_bytecode = True  # the workspace is read-only; nothing is cached for a later test
sys.path.insert(0, os.path.dirname(request["file"]))  # the hidden tests' own helper modules
sys.path.append(request["workspace"])  # the agent's code, after the standard library
outcome = "failed"
try:
    spec = importlib.util.spec_from_file_location("hidden_test_" + str(os.getpid()), request["file"])
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    parts = request["name"].split("::")
    if len(parts) == 2:
        cls = getattr(module, parts[0])
        if isinstance(cls, type) and issubclass(cls, unittest.TestCase):
            result = unittest.TestResult()
            cls(parts[1])(result)
            if result.testsRun == 1 and result.wasSuccessful() and not result.skipped:
                outcome = "passed"
        else:
            getattr(cls(), parts[1])()
            outcome = "passed"
    else:
        getattr(module, parts[0])()
        outcome = "passed"
except BaseException:
    outcome = "failed"
report(outcome)
'''

PROGRAM = RUN_CHILD + r'''
import json, os, secrets as tokens, tempfile


def verify(workspace, secrets, args):
    files = json.loads(secrets["tests"])
    work = tempfile.mkdtemp(prefix="hidden-tests-")
    for name, source in files.items():
        with open(os.path.join(work, name), "w") as fh:
            fh.write(source)
    passed = []
    for test_id in json.loads(secrets["ids"]):
        name, _, rest = test_id.partition("::")
        nonce = tokens.token_hex(16)
        request = {"file": os.path.join(work, name), "name": rest, "nonce": nonce, "workspace": workspace}

        def judge(code, lines):
            return code == 0 and len(lines) == 1 and json.loads(lines[0]) == {"nonce": nonce, "outcome": "passed"}

        passed.append(run_child(args["child"], [], workspace, request, args["timeout"], judge))
    return {"score": sum(passed) / len(passed) if passed else 0.0, "passed": passed}
'''


def hidden_test_ids(tests: Mapping[str, str]) -> list[str]:
    """Every test of ``tests`` as ``file::test_fn`` or ``file::TestClass::test_method`` (pytest's
    ids): module-level ``test*`` functions and ``test*`` methods of ``Test*`` classes, read from
    the source (the env's own, so parsing it here is safe)."""
    ids: list[str] = []
    for name, source in tests.items():
        for node in ast.parse(source).body:
            if isinstance(node, ast.FunctionDef) and node.name.startswith("test"):
                ids.append(f"{name}::{node.name}")
            elif isinstance(node, ast.ClassDef) and node.name.startswith("Test"):
                ids += [f"{name}::{node.name}::{f.name}" for f in node.body
                        if isinstance(f, ast.FunctionDef) and f.name.startswith("test")]
    return ids


async def run_hidden_tests(lease: Lease, tests: Mapping[str, str], ids: Sequence[str] | None = None, *,
                           timeout_s: float = 10.0) -> tuple[float, dict[str, Any]]:
    """Run ``tests`` (file name -> source; ``ids`` picks some, default all) against the sealed
    slot's workspace; the score is the passed fraction, the dict says which failed (and
    ``verifier_error`` when the run itself failed)."""
    for name in tests:
        if "/" in name or not name.endswith(".py") or name.startswith("."):
            raise ValueError(f"test file names are plain *.py names: {name!r}")
    chosen = list(ids) if ids is not None else hidden_test_ids(tests)
    unknown = [i for i in chosen if i.split("::", 1)[0] not in tests]
    if unknown or not chosen:
        raise ValueError(f"no such test file for {unknown}" if unknown else "no test to run")
    total = len(chosen)
    result = await lease.verify(PROGRAM, secrets={"tests": json.dumps(dict(tests)), "ids": json.dumps(chosen)},
                                args={"child": CHILD, "timeout": timeout_s}, timeout_s=15 + total * (timeout_s + 1))
    passed = passed_flags(result, total)
    if isinstance(passed, str):
        return 0.0, {"tests_passed": 0, "tests_total": total, "verifier_error": passed}
    n = sum(passed)
    return n / total, {"tests_passed": n, "tests_total": total,
                       "failed": [i for i, p in zip(chosen, passed, strict=True) if not p]}
