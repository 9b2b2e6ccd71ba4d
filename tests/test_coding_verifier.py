"""The coding env's hidden-test verifier against solutions that try to forge their score, in a real slot."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

import pytest
import pytest_asyncio

from atropos.envs.examples.coding import TASKS, visible_test
from atropos.envs.examples.hidden_tests import verify
from atropos.slots.pool import SlotPool
from tests.pool_backends import local_pool

ADD = TASKS[0]  # add(a, b), 4 hidden cases
assert ADD["name"] == "add" and len(ADD["hidden"]) == 4

pytestmark = pytest.mark.asyncio(loop_scope="module")


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def pool() -> AsyncIterator[SlotPool]:
    async with local_pool(2, "verifier") as p:
        yield p


async def run(pool: SlotPool, files: dict[str, str], item: dict = ADD) -> tuple[float, dict]:
    async with pool.leased("verifier-test") as lease:
        for path, text in files.items():
            await lease.write_file(path, text)
        return await verify(lease, item, case_timeout_s=3.0)


async def test_correct_solution_passes(pool: SlotPool) -> None:
    score, meta = await run(pool, {"solution.py": "def add(a, b):\n    return a + b\n"})
    assert score == 1.0 and meta == {"hidden_passed": 4, "hidden_total": 4}


async def test_printing_passed_and_exiting_at_import_scores_zero(pool: SlotPool) -> None:
    # the old runner parsed the last "PASSED x/y" line of stdout and took the total from it
    cheat = "import os\nprint('PASSED 1/1')\nprint('PASSED 4/4', flush=True)\nos._exit(0)\n"
    score, meta = await run(pool, {"solution.py": cheat})
    assert score == 0.0 and meta["hidden_passed"] == 0 and meta["hidden_total"] == 4


async def test_object_equal_to_everything_scores_zero(pool: SlotPool) -> None:
    cheat = ("class Anything:\n    def __eq__(self, other):\n        return True\n    __hash__ = None\n\n"
             "class Int(int):\n    def __eq__(self, other):\n        return True\n\n"
             "def add(a, b):\n    return Anything() if a > 0 else Int(12345)\n")
    score, _ = await run(pool, {"solution.py": cheat})
    assert score == 0.0


async def test_a_float_for_an_int_is_not_the_answer(pool: SlotPool) -> None:
    score, meta = await run(pool, {"solution.py": "def add(a, b):\n    return float(a + b)\n"})
    assert score == 0.0 and meta["hidden_passed"] == 0


async def test_forging_the_result_file_or_reading_the_verifier_scores_zero(pool: SlotPool) -> None:
    # The import reads what it can of its parent (the verifier) through /proc: stdin (where the
    # secrets arrived), memory, environment. A daemon that outlives its case then rewrites every
    # result file with "all passed", signed with any key it found. Without the verifier's
    # protections this scores 1.0.
    cheat = r"""
import glob, hashlib, hmac, json, os, re, time
ppid = os.getppid()
found = b""
for path in ("/proc/%d/fd/0" % ppid, "/proc/%d/environ" % ppid, "/proc/%d/cmdline" % ppid):
    try:
        with open(path, "rb") as fh:
            found += fh.read()
    except OSError:
        pass
try:
    with open("/proc/%d/maps" % ppid) as maps, open("/proc/%d/mem" % ppid, "rb") as mem:
        for line in maps:
            lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
            if "rw" in line.split()[1] and hi - lo < (64 << 20):
                try:
                    mem.seek(lo)
                    found += mem.read(hi - lo)
                except OSError:
                    pass
except OSError:
    pass
keys = re.findall(rb'"key": "([0-9a-f]{64})"', found)
if os.fork() == 0:
    os.setsid()
    deadline = time.time() + 30
    while time.time() < deadline:
        for f in glob.glob("/workspace/.verify-*.json"):
            body = json.dumps({"passed": [True] * 4}, separators=(",", ":"))
            key = bytes.fromhex(keys[0].decode()) if keys else b"guess"
            mac = hmac.new(key, body.encode(), hashlib.sha256).hexdigest()
            try:
                with open(f, "w") as fh:
                    json.dump({"body": body, "mac": mac}, fh)
            except OSError:
                pass
        time.sleep(0.002)
    os._exit(0)

def add(a, b):
    return "no"
"""
    score, meta = await run(pool, {"solution.py": cheat})
    assert score == 0.0, meta


async def test_correct_solution_with_edited_visible_tests_still_passes(pool: SlotPool) -> None:
    score, _ = await run(pool, {"solution.py": "def add(a, b):\n    return a + b\n",
                                "test_visible.py": "print('ok')\n"})
    assert score == 1.0


async def test_wrong_solution_with_edited_visible_tests_fails(pool: SlotPool) -> None:
    async with pool.leased("verifier-visible") as lease:
        await lease.write_file("solution.py", "def add(a, b):\n    return 3\n")
        await lease.write_file("test_visible.py", "print('ok')\n")  # the edit makes the visible test pass
        out = await lease.bash("python3 test_visible.py")
        assert out["stdout"] == "ok\n"
        score, meta = await verify(lease, ADD, case_timeout_s=3.0)
    assert score == 0.0 and meta["hidden_passed"] == 0  # hidden: add(2,3)=5, (-1,1)=0, (10,5)=15, (0,0)=0


async def test_the_visible_test_checks_the_visible_cases(pool: SlotPool) -> None:
    async with pool.leased("verifier-visible-ok") as lease:
        await lease.write_file("solution.py", "def add(a, b):\n    return a + b\n")
        await lease.write_file("test_visible.py", visible_test(ADD))
        assert (await lease.bash("python3 test_visible.py"))["stdout"] == "ok\n"


async def test_total_comes_from_the_item_and_a_hang_fails_its_case(pool: SlotPool) -> None:
    item = {**ADD, "hidden": [*ADD["hidden"], [[7, 7], 14]]}
    solution = "import time\ndef add(a, b):\n    if a == 7:\n        time.sleep(60)\n    return a + b\n"
    score, meta = await run(pool, {"solution.py": solution}, item)
    assert meta == {"hidden_passed": 4, "hidden_total": 5} and score == pytest.approx(0.8)
    assert json.dumps(meta)  # plain values
