"""verify_runner: what a verification costs on a task image's root, where the runner starts from
host files and the programs it checks run chrooted in the slot's root (docs/verification.md),
beside the same verification on a default-root slot (the baseline row: its runner's root is the
slot's own, host-made one), interleaved round by round in one run.

Each round: lease (a default-root slot, or one on the ``pyenv`` test image of tests/task_images.py),
then ``lease.verify`` of a program that starts one child (``/bin/true``, as a checker starts its
tests) and reads one file of the root; the row is the verify call's wall time (seal, the runner's
start, the child, the teardown), measured by the client.

``python -m benchmarks.scenario_verify_runner [--rounds 20]``
"""

from __future__ import annotations

import argparse
import asyncio
import time

from benchmarks.common import load_avg, machine_line, summarize
from tests.pool_backends import local_pool

PROGRAM = '''
import os, subprocess


def verify(workspace, secrets, args):
    child = subprocess.run(["/bin/true"])
    seen = os.path.exists(os.path.join(globals().get("ROOT", "/"), "etc/passwd"))  # ROOT: none before
    return {"score": 1.0 if child.returncode == 0 and seen else 0.0}
'''


async def run(rounds: int) -> dict[str, list[float]]:
    from tests.task_images import ensure

    image = ensure("pyenv").reference
    times: dict[str, list[float]] = {"default root (baseline)": [], "image root": []}
    async with local_pool(2, "benchverify") as pool:
        await pool.prepare_images([image])
        for i in range(rounds + 2):  # two warm-up rounds
            for name, ref in (("default root (baseline)", None), ("image root", image)):
                async with pool.leased(f"bench-verify-{i}", image=ref) as lease:
                    await lease.bash("true")
                    t0 = time.perf_counter()
                    result = await lease.verify(PROGRAM, timeout_s=60)
                    elapsed = (time.perf_counter() - t0) * 1000
                    assert result.ok and result.score == 1.0, result
                    if i >= 2:
                        times[name].append(elapsed)
    return times


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=20)
    args = p.parse_args()
    before = load_avg()
    times = asyncio.run(run(args.rounds))
    base = summarize(times["default root (baseline)"])["p50"]
    print(machine_line())
    print(f"load average before: {before[0]} {before[1]} {before[2]}; rounds: {args.rounds}")
    print(f"{'verify':<26} {'p50 ms':>8} {'p99 ms':>8} {'x baseline p50':>15}")
    for name, samples in times.items():
        s = summarize(samples)
        print(f"{name:<26} {s['p50']:>8.1f} {s['p99']:>8.1f} {s['p50'] / base:>15.2f}")


if __name__ == "__main__":
    main()
