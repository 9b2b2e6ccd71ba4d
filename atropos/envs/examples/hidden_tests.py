"""Hidden-test verification that the code under test cannot forge.

The solution is untrusted code running as the same uid in the same slot, so nothing it can print,
write or fake may decide its score:

* the verifier (``VERIFIER``, run with ``python3 -I`` in the slot) gets the expected answers, an
  HMAC key and a random result-file name on stdin only (never argv or a file: ``/proc/<pid>/cmdline``
  is readable by every process of the slot), swaps its stdin for /dev/null (the memfd could be
  reopened through ``/proc/<pid>/fd/0``) and makes itself non-dumpable, so no process of the uid
  can read its memory, fds or environment;
* each case runs in a child (``CHILD``) that imports the solution from a private copy and gets only
  that case's arguments; it reports the returned value as JSON, so the answer is a plain value and
  an object whose ``__eq__`` always says True cannot cross; a child that exits early, hangs or
  crashes fails its case;
* the verifier compares with ``type(got) is type(want) and want == got`` (recursively; ``want`` on
  the left, and both sides are plain JSON values), and writes ``{"passed": [...]}`` plus an HMAC
  of it to the result file;
* the env checks the HMAC and takes the number of cases from the item, not from anything in the
  slot. stdout is never read: ``PASSED 1/1`` printed by the solution means nothing.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import secrets
import shlex
from typing import Any

from atropos.errors import ToolError
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

VERIFIER = r'''
import ctypes, hashlib, hmac, json, os, shutil, signal, subprocess, sys, tempfile
spec = json.loads(sys.stdin.read())
null = os.open(os.devnull, os.O_RDONLY)
os.dup2(null, 0)
os.close(null)
if ctypes.CDLL(None, use_errno=True).prctl(4, 0, 0, 0, 0) != 0:  # PR_SET_DUMPABLE = 0
    sys.exit("verifier: cannot make itself non-dumpable")
key = bytes.fromhex(spec.pop("key"))
result_path = os.path.join(os.getcwd(), spec.pop("out"))
work = tempfile.mkdtemp(prefix="verify-")
try:
    shutil.copyfile("solution.py", os.path.join(work, "solution.py"))
    present = True
except OSError:
    present = False


def same(want, got):
    if type(got) is not type(want):
        return False
    if type(want) is list:
        return len(want) == len(got) and all(same(w, g) for w, g in zip(want, got))
    if type(want) is dict:
        return want.keys() == got.keys() and all(same(want[k], got[k]) for k in want)
    return want == got


passed = []
for args, want in spec["cases"]:
    ok = False
    if present:
        proc = subprocess.Popen([sys.executable, "-I", "-c", spec["child"], spec["fn"]], cwd=work,
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                start_new_session=True)
        try:
            out, _ = proc.communicate(json.dumps(args).encode(), timeout=spec["timeout"])
            lines = out.decode("utf-8", "replace").strip().splitlines()
            reply = json.loads(lines[-1]) if lines else {}
            ok = proc.returncode == 0 and isinstance(reply, dict) and "got" in reply and same(want, reply["got"])
        except Exception:
            ok = False
        finally:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except OSError:
                pass
            proc.wait()
    passed.append(ok)
body = json.dumps({"passed": passed}, separators=(",", ":"))
tmp = result_path + ".tmp"
with open(tmp, "w") as fh:
    json.dump({"body": body, "mac": hmac.new(key, body.encode(), hashlib.sha256).hexdigest()}, fh)
os.replace(tmp, result_path)
'''

CASE_TIMEOUT_S = 5.0


async def verify(lease: Lease, item: dict[str, Any], *, case_timeout_s: float = CASE_TIMEOUT_S
                 ) -> tuple[float, dict[str, Any]]:
    """Run ``item["hidden"]`` against the slot's solution.py; the score is the passed fraction."""
    cases = item["hidden"]
    total = len(cases)
    key = secrets.token_bytes(32)
    out = f".verify-{secrets.token_hex(16)}.json"
    spec = {"key": key.hex(), "out": out, "fn": item["name"], "cases": cases, "timeout": case_timeout_s,
            "child": CHILD}
    # A crash of the host raises HostUnavailable here (infrastructure: the rollout is retried).
    await lease.call("bash", {"command": "exec python3 -I -c " + shlex.quote(VERIFIER), "stdin": json.dumps(spec)},
                     timeout_s=15 + total * (case_timeout_s + 1))
    try:
        record = json.loads(await lease.read_file(out))
        body = record["body"]
        mac = record["mac"]
    except (ToolError, ValueError, KeyError, TypeError):
        return 0.0, {"hidden_passed": 0, "hidden_total": total, "error": "no verifier result"}
    expected = hmac.new(key, str(body).encode(), hashlib.sha256).hexdigest()
    if not isinstance(mac, str) or not hmac.compare_digest(mac, expected):
        return 0.0, {"hidden_passed": 0, "hidden_total": total, "error": "verifier result was tampered with"}
    passed = json.loads(body)["passed"]
    if not isinstance(passed, list) or len(passed) != total:
        return 0.0, {"hidden_passed": 0, "hidden_total": total, "error": "verifier result has the wrong shape"}
    n = sum(1 for p in passed if p is True)
    return (n / total if total else 0.0), {"hidden_passed": n, "hidden_total": total}
