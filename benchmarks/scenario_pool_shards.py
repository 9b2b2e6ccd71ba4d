"""pool_shards: a trainer with 1,000 and 10,000 concurrent trajectories on a simulated fleet of 100 hosts
x 100 slots (benchmarks/fake_fleet.py: hosts that answer at once), through one in-process ``SlotPool``
and through a ``ShardedPool`` (atropos/slots/shards.py) of 1, 2 and 4 shard processes.

Each trajectory loops: lease, ``CALLS_PER_LEASE`` bash ``true`` calls (each timed), release. After a
warm-up, for a measured window: calls/s through the pool (wall), call latency p50/p99 (the hosts
answer at once, so this is the pool's overhead plus queueing: with every trajectory in a closed
loop, latency ~ trajectories / calls/s), and CPU time per call of each process involved, read from
/proc (utime + stime): the trainer's (the front: the trajectories' own coroutines plus the pool,
or the sharded pool's routing), each shard's, and the fake fleet's. ``calls per shard CPU-second``
is what one core would carry if it ran nothing but one shard: the per-core figure that does not
depend on how loaded the shared machine was.
"""

from __future__ import annotations

import asyncio
import functools
import json
import os
import secrets
import sys
import time
from typing import Any

from atropos.errors import InfrastructureError
from benchmarks.common import Row, ScenarioResult, scenario_main, summarize
from benchmarks.fake_fleet import FakeFleetBackend, running_fleet, shard_backend

NAME = "pool_shards"
# The fleet by default; POOL_SHARDS_HOSTS / _TRAJECTORIES / _LAYOUTS (comma lists; "pool" for
# the in-process SlotPool) scale it down for a machine too loaded to start 10,000 slots (README).
HOSTS = int(os.environ.get("POOL_SHARDS_HOSTS", "100"))
SLOTS = 100
CALLS_PER_LEASE = 8
WARM_MAX_S = 240.0
_TICK = os.sysconf("SC_CLK_TCK")


def _cpu_s(pid: int) -> float:
    """utime + stime of a process, in seconds."""
    with open(f"/proc/{pid}/stat") as fh:
        fields = fh.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _TICK


def _cfg(pool_id: str) -> Any:
    from atropos.slots.config import PoolConfig

    # probes far apart and patient, connects too: the fake hosts never fail, and a probe or connect
    # sent from a pool process that gets a few % of a core under 1,000-10,000 closed-loop trajectories
    # waits out that process's own event-loop lag (seconds to tens of seconds): with a 5 s connect and
    # probes every 5 s, every host was declared dead (benchmarks/README.md)
    return PoolConfig(pool_id=pool_id, min_hosts=HOSTS, max_hosts=HOSTS, acquire_timeout_s=300,
                      health_interval_s=30.0, health_timeout_s=120.0, connect_timeout_s=60.0)


async def _drive(pool: Any, trajectories: int, warm_s: float, seconds: float, pids: dict[str, list[int]],
                 counters: Any) -> dict[str, Any]:
    """Run the trajectories, measure a window after the warm-up; ``counters()``: calls per shard."""
    calls = 0
    latencies: list[float] = []
    measuring = False
    stop = False

    failures: dict[str, int] = {}
    started: set[int] = set()  # trajectories with a call answered
    failed_total = 0  # warm-up included

    async def trajectory(t: int) -> None:
        nonlocal calls, failed_total
        # started over the first half of the warm-up: thousands of first connections opened in one
        # instant time out connecting on a loaded machine (benchmarks/README.md, "The limit")
        await asyncio.sleep(warm_s / 2 * t / trajectories)
        i = 0
        while not stop:
            lease = await pool.lease(f"t{t}-{i}")
            try:
                for _ in range(CALLS_PER_LEASE):
                    if stop:
                        break  # the window is over: release now rather than after 8 more calls per trajectory
                    t0 = time.perf_counter()
                    await lease.bash("true")
                    started.add(t)
                    if measuring:
                        latencies.append((time.perf_counter() - t0) * 1e3)
                    calls += 1
            except InfrastructureError as exc:  # counted and shown, the trajectory goes on (an env retries)
                failed_total += 1
                if measuring:
                    failures[type(exc).__name__] = failures.get(type(exc).__name__, 0) + 1
            finally:
                await lease.release()
            i += 1

    tasks = [asyncio.ensure_future(trajectory(t)) for t in range(trajectories)]
    # warm: at least warm_s, and until every trajectory has had a call answered (its first connection
    # opened), so the window measures the steady state rather than 10,000 first connections
    t_warm = time.perf_counter()
    await asyncio.sleep(warm_s)
    while len(started) < trajectories and time.perf_counter() - t_warm < WARM_MAX_S:
        await asyncio.sleep(0.5)
    warmed_s = time.perf_counter() - t_warm
    measuring = True
    cpu0 = {role: [_cpu_s(p) for p in ps] for role, ps in pids.items()}
    per_shard0 = await counters()
    calls0, wall0 = calls, time.perf_counter()
    await asyncio.sleep(seconds)
    wall = time.perf_counter() - wall0
    n = calls - calls0
    cpu = {role: [_cpu_s(p) - c0 for p, c0 in zip(ps, cpu0[role], strict=True)] for role, ps in pids.items()}
    per_shard = [b - a for a, b in zip(per_shard0, await counters(), strict=True)]
    measuring = False
    stop = True
    await asyncio.gather(*tasks)
    s = summarize(latencies)
    load = os.getloadavg()[0]
    shard_cpu = cpu.get("shards", [])
    return {
        "trajectories": trajectories, "load": load, "warm_s": warmed_s, "started": len(started), "calls": n,
        "failures": failures, "failures_total": failed_total, "seconds": wall, "calls_per_s": n / wall,
        "latency_ms": latencies, "p50": s.get("p50", 0.0), "p99": s.get("p99", 0.0),
        "front_us_per_call": 1e6 * sum(cpu["front"]) / max(n, 1),
        "shards_us_per_call": 1e6 * sum(shard_cpu) / max(n, 1) if shard_cpu else None,
        "fleet_us_per_call": 1e6 * sum(cpu["fleet"]) / max(n, 1),
        "front_busy": sum(cpu["front"]) / wall, "shard_busy": [c / wall for c in shard_cpu],
        "calls_per_shard": per_shard,
        # what one core carries running one shard only: its calls over its CPU seconds
        "calls_per_shard_cpu_s": ([c / max(cs, 1e-9) for c, cs in zip(per_shard, shard_cpu, strict=True)]
                                  if shard_cpu else []),
    }


async def _mode(shards: int | None, sizes: tuple[int, ...], warm_s: float, seconds: float) -> list[dict[str, Any]]:
    """One pool layout (None: one in-process SlotPool; else a ShardedPool of that many shards) at each size."""
    from atropos.slots.pool import SlotPool
    from atropos.slots.shards import ShardedPool

    token = secrets.token_urlsafe(16)
    out = []
    async with running_fleet(HOSTS, SLOTS, token) as (ports, fleet_pids):
        pids: dict[str, list[int]] = {"front": [os.getpid()], "fleet": fleet_pids}
        pool: Any
        if shards is None:
            pool = SlotPool(FakeFleetBackend(ports, token, SLOTS), _cfg("bench-pool"))
            await pool.start()  # every host at once: the pool bounds its start requests (start_requests)

            async def counters() -> list[int]:
                return [pool.status().calls_total]
        else:
            split = [ports[i::shards] for i in range(shards)]
            cfg = _cfg("bench-shards").model_copy(update={"min_hosts": len(split[0]), "max_hosts": len(split[0])})
            pool = ShardedPool(functools.partial(shard_backend, split, token, SLOTS), cfg, shards=shards)
            await pool.start()
            pids["shards"] = [s.proc.pid for s in pool.shards]

            async def counters() -> list[int]:
                return [s.calls_total for s in (await pool.status()).shards]
        try:
            for trajectories in sizes:
                m = await _drive(pool, trajectories, warm_s, seconds, pids, counters)
                m["layout"] = "SlotPool in the trainer" if shards is None else f"{shards} shard(s)"
                m["shards"] = shards
                if shards is None:
                    m["calls_per_shard_cpu_s"] = [m["calls"] / max(m["front_busy"] * m["seconds"], 1e-9)]
                out.append(m)
                # each row as it is measured (a long run at 10,000 trajectories keeps what it had)
                print(json.dumps({k: v for k, v in m.items() if k != "latency_ms"}), file=sys.stderr, flush=True)
        finally:
            await pool.stop()
    return out


async def run(quick: bool) -> ScenarioResult:
    warm_s, seconds = (3.0, 4.0) if quick else (5.0, 10.0)
    sizes = tuple(int(n) for n in os.environ.get("POOL_SHARDS_TRAJECTORIES", "1000,10000").split(","))
    layouts: list[int | None] = [None if x == "pool" else int(x)
                                 for x in os.environ.get("POOL_SHARDS_LAYOUTS", "pool,1,2,4").split(",")]
    res = ScenarioResult(NAME, f"a trainer's trajectories on a simulated fleet of {HOSTS} x {SLOTS} slots, "
                               "one pool vs pool shards",
                         params={"hosts": HOSTS, "slots_per_host": SLOTS, "calls_per_lease": CALLS_PER_LEASE,
                                 "warm_s": warm_s, "seconds": seconds, "trajectories": list(sizes),
                                 "cpus": os.cpu_count()})
    for shards in layouts:
        for m in await _mode(shards, sizes, warm_s, seconds):
            per_core = m["calls_per_shard_cpu_s"]
            shard_part = ("" if m["shards_us_per_call"] is None else
                          f", shards {m['shards_us_per_call']:.0f} us/call (busy "
                          + "/".join(f"{100 * b:.0f}%" for b in m["shard_busy"]) + ")")
            res.rows.append(Row(
                f"{m['layout']}, {m['trajectories']:,} trajectories", m["latency_ms"], throughput=m["calls_per_s"],
                baseline=shards is None,
                note=(f"trainer {m['front_us_per_call']:.0f} us/call (busy {100 * m['front_busy']:.0f}%)"
                      f"{shard_part}, fleet {m['fleet_us_per_call']:.0f} us/call; calls per pool CPU-second "
                      + "/".join(f"{c:,.0f}" for c in per_core)
                      + (f"; failed calls {m['failures']}" if m["failures"] else "")
                      + (f"; failed in all (warm-up too) {m['failures_total']}" if m["failures_total"] else "")
                      + f"; warm-up {m['warm_s']:.0f} s"),
                extra={k: v for k, v in m.items() if k != "latency_ms"}))
    res.notes.append("throughput = bash `true` calls/s through the pool, wall clock, on a machine shared with "
                     "the fake fleet (and other work): the per-process CPU per call is the figure to compare")
    return res


if __name__ == "__main__":
    scenario_main(NAME, run)
