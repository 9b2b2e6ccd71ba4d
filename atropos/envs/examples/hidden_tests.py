"""Hidden-test verification that the code under test cannot forge.

It runs in the slot's verification phase (``Lease.verify``, see docs/verification.md): every
process of the agent is dead before it starts, the workspace is read-only, and the program below
(``PROGRAM``) runs in a fresh sandbox as a non-dumpable process that alone holds the expected
answers (in memory; they never touch a file, argv or environment variable). The verdict comes
back through the host's protocol, so nothing in the workspace can plant or race it. What is left
to defend against is the solution itself, which the program has to run:

* each case runs in a child (``CHILD``, ``python3 -I``: no user site, no ``.pth`` of the
  workspace) that imports a private copy of solution.py and gets only that case's arguments; it
  reports the returned value as JSON on a descriptor of its own, so the answer is a plain value and
  an object whose ``__eq__`` always says True cannot cross; a child that exits early, hangs or
  crashes fails its case;
* before and after each case every other process of the verification sandbox is killed
  (``kill(-1)``, in ``atropos/envs/verify_child.py``: nothing a case forks can write into the next
  case's answer);
* the program compares with ``type(got) is type(want) and want == got`` (recursively; ``want``
  on the left, and both sides are plain JSON values);
* the env takes the number of cases from the item, not from anything the program or the slot
  says; stdout is never read: ``PASSED 4/4`` printed by the solution means nothing.
"""

from __future__ import annotations

import json
from typing import Any

from atropos.envs.verify_child import RUN_CHILD, passed_flags
from atropos.slots.lease import Lease

CHILD = r'''
import importlib.util, json, os, sys
channel = os.dup(1)
os.dup2(2, 1)  # the solution's prints go where stderr goes (nowhere); the answer has its own fd
try:
    args = json.loads(sys.stdin.read())
    spec = importlib.util.spec_from_file_location("solution", "solution.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    text = json.dumps({"got": getattr(mod, sys.argv[1])(*args)})
except BaseException as exc:
    text = json.dumps({"error": type(exc).__name__})
os.write(channel, (text + "\n").encode())
'''

PROGRAM = RUN_CHILD + r'''
import json, os, tempfile


def same(want, got):
    if type(got) is not type(want):
        return False
    if type(want) is list:
        return len(want) == len(got) and all(same(w, g) for w, g in zip(want, got))
    if type(want) is dict:
        return want.keys() == got.keys() and all(same(want[k], got[k]) for k in want)
    return want == got


def verify(workspace, secrets, args):
    cases = json.loads(secrets["cases"])
    work = tempfile.mkdtemp(prefix="verify-")
    try:
        source = read_workspace("solution.py")
    except OSError:
        return {"score": 0.0, "passed": [False] * len(cases), "error": "no solution.py"}
    with open(os.path.join(work, "solution.py"), "wb") as fh:
        fh.write(source)
    passed = []
    for case_args, want in cases:

        def judge(code, lines):
            reply = json.loads(lines[-1]) if lines else {}
            return code == 0 and isinstance(reply, dict) and "got" in reply and same(want, reply["got"])

        passed.append(run_child(args["child"], [args["fn"]], work, case_args, args["timeout"], judge))
    return {"score": sum(passed) / len(passed) if passed else 0.0, "passed": passed}
'''

CASE_TIMEOUT_S = 5.0


async def verify(lease: Lease, item: dict[str, Any], *, case_timeout_s: float = CASE_TIMEOUT_S
                 ) -> tuple[float, dict[str, Any]]:
    """Run ``item["hidden"]`` against the slot's solution.py; the score is the passed fraction."""
    cases = item["hidden"]
    total = len(cases)
    # A crash of the host raises HostUnavailable here (infrastructure: the rollout is retried).
    result = await lease.verify(PROGRAM, secrets={"cases": json.dumps(cases)},
                                args={"fn": item["name"], "timeout": case_timeout_s, "child": CHILD},
                                timeout_s=15 + total * (case_timeout_s + 1))
    passed = passed_flags(result, total)
    if isinstance(passed, str):
        return 0.0, {"hidden_passed": 0, "hidden_total": total, "verifier_error": passed}
    n = sum(passed)
    meta: dict[str, Any] = {"hidden_passed": n, "hidden_total": total}
    if (result.verdict or {}).get("error") == "no solution.py":  # PROGRAM's own word (the solution cannot reach it)
        meta["verifier_error"] = "no_solution"
    return (n / total if total else 0.0), meta
