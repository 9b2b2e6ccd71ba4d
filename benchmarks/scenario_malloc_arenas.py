"""malloc_arenas: what capping glibc's malloc arenas costs the pool's calls (issue 40).

The pool runs in the trainer's process, so its allocator setting is the trainer's environment:
``MALLOC_ARENA_MAX=2`` bounds the free pages glibc keeps per arena (a soak's pool had 6 arenas and its
RSS grew ~30 KB per 1,000 trajectories faster than its live heap; hosts capped at 2 did not;
benchmarks/README.md, "Memory over millions of trajectories"). The cap's possible price is lock
contention: threads that malloc at once share an arena instead of each having one.

Each variant is a fresh child process (the setting is read at malloc's first use) holding a real
local SlotPool (1 host, 2 slots) and a ToolExecutor, timing ``bash: true`` through
``ToolExecutor.execute`` (every AgentEnv rollout's route) while ``TRAINER_THREADS`` threads of the
same process allocate and free buffers of 4-256 KiB in a loop with short sleeps (a trainer's data
loader, tokenizer and logging threads). Variants alternate child by child, ``rounds`` times each, so
load changes on a shared machine hit both alike.

- ``default arenas`` [baseline]: no ``MALLOC_ARENA_MAX`` (glibc: up to 8 per core).
- ``MALLOC_ARENA_MAX=2``: the setting documented for the trainer.

Reported per variant: p50/p99 of the call, and the child's arena count and RSS at the end.
Target: the cap costs the call nothing measurable (p50 <= 1.05x the default, same run).
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import subprocess
import sys
import threading
import time
from contextlib import AsyncExitStack

from benchmarks.common import REPO, Row, ScenarioResult, Target, percentile, scenario_main, time_calls

NAME = "malloc_arenas"
TRAINER_THREADS = 4
VARIANTS = {"default arenas": None, "MALLOC_ARENA_MAX=2": "2"}


def _trainer_thread(stop: threading.Event, seed: int) -> None:
    """Allocate and free buffers the way a trainer's side threads do (``bytearray`` of 4-256 KiB
    goes to malloc, not to CPython's small-object allocator)."""
    rng = random.Random(seed)
    held: list[bytearray] = []
    while not stop.is_set():
        held.append(bytearray(rng.randint(4, 256) * 1024))
        if len(held) > 16:
            del held[rng.randrange(len(held))]
        time.sleep(0.0005)


async def _child(calls: int) -> dict[str, object]:
    from atropos import memstats
    from benchmarks.routes import pool_routes

    stop = threading.Event()
    threads = [threading.Thread(target=_trainer_thread, args=(stop, n), daemon=True) for n in range(TRAINER_THREADS)]
    for t in threads:
        t.start()
    try:
        async with AsyncExitStack() as stack:
            routes = await pool_routes(stack)
            samples = await time_calls(routes["bash: true (ToolExecutor.execute)"], calls, warmup=20)
    finally:
        stop.set()
        for t in threads:
            t.join()
    info = memstats.mallinfo()
    return {"samples_ms": samples, "arenas": info.arenas if info else None, "rss_kb": memstats.rss_kb()}


def _run_child(arena_max: str | None, calls: int) -> dict[str, object]:
    env = {k: v for k, v in os.environ.items() if k != "MALLOC_ARENA_MAX"}
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    if arena_max is not None:
        env["MALLOC_ARENA_MAX"] = arena_max
    proc = subprocess.run([sys.executable, "-m", "benchmarks.scenario_malloc_arenas", "--child", str(calls)],
                          capture_output=True, text=True, cwd=REPO, env=env, timeout=600)
    if proc.returncode != 0:
        raise RuntimeError(f"child failed ({proc.returncode}): {proc.stderr.strip()[-2000:]}")
    out: dict[str, object] = json.loads(proc.stdout.strip().splitlines()[-1])
    return out


async def run(quick: bool) -> ScenarioResult:
    rounds, calls = (2, 100) if quick else (4, 300)
    res = ScenarioResult(NAME, "the pool's call with malloc arenas capped (the trainer's MALLOC_ARENA_MAX)",
                         params={"rounds": rounds, "calls_per_child": calls, "trainer_threads": TRAINER_THREADS,
                                 "route": "bash: true through ToolExecutor.execute, 1 local host"})
    samples: dict[str, list[float]] = {name: [] for name in VARIANTS}
    arenas: dict[str, list[object]] = {name: [] for name in VARIANTS}
    rss: dict[str, list[object]] = {name: [] for name in VARIANTS}
    p50s: dict[str, list[float]] = {name: [] for name in VARIANTS}  # per child: the spread between runs
    for _ in range(rounds):
        for name, value in VARIANTS.items():
            got = await asyncio.to_thread(_run_child, value, calls)
            samples[name] += got["samples_ms"]  # type: ignore[arg-type]
            p50s[name].append(round(percentile(got["samples_ms"], 50), 2))  # type: ignore[arg-type]
            arenas[name].append(got["arenas"])
            rss[name].append(got["rss_kb"])
    for name in VARIANTS:
        res.rows.append(Row(name, samples[name], baseline=name == "default arenas",
                            note=f"p50 per child {p50s[name]} ms; malloc arenas at the end {arenas[name]}, "
                                 f"RSS KB {rss[name]}",
                            extra={"arenas": arenas[name], "rss_kb": rss[name], "p50_per_child_ms": p50s[name]}))
    base, capped = res.rows
    ratio = capped.p50 / base.p50 if base.p50 else None
    res.targets.append(Target("MALLOC_ARENA_MAX=2 costs the pool's call nothing measurable (p50 <= 1.05x)",
                              f"p50 {capped.p50:.2f} vs {base.p50:.2f} ms" + (f" ({ratio:.2f}x)" if ratio else ""),
                              None if ratio is None else ratio <= 1.05))
    return res


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--child":
        print(json.dumps(asyncio.run(_child(int(sys.argv[2])))), flush=True)
    else:
        scenario_main(NAME, run)
