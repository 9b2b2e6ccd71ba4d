"""fleet_sim: the pool's own cost as the fleet grows, on simulated hosts (benchmarks/fake_fleet.py)
that answer at once: 1, 10 and 100 hosts x 64 slots.

The fake hosts run in a child process; the pool (a real SlotPool, its health loop included) runs
here. Workers (as many as half the slots, at most 512) loop: lease (timed), 4 ``true`` calls,
release. Measured in this process only: CPU per call (process CPU time / calls; lease and release
are counted in, spread over the calls), lease p50/p99, and memory per slot (RSS after the pool
took every host's slots, minus RSS before, over the slots).
"""

from __future__ import annotations

import asyncio
import resource
import secrets
import time
from typing import Any

from benchmarks.common import Row, ScenarioResult, scenario_main, summarize
from benchmarks.fake_fleet import FakeFleetBackend, running_fleet

NAME = "fleet_sim"
SLOTS = 64
CALLS_PER_LEASE = 4
BATCH = 10


def _rss_bytes() -> int:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * resource.getpagesize()


async def _one(hosts: int, seconds: float) -> dict[str, Any]:
    from atropos.slots.config import PoolConfig
    from atropos.slots.pool import SlotPool

    token = secrets.token_urlsafe(16)
    async with running_fleet(hosts, SLOTS, token) as (ports, _):
        rss0 = _rss_bytes()
        pool = SlotPool(FakeFleetBackend(ports, token, SLOTS),
                        PoolConfig(pool_id=f"sim{hosts}", min_hosts=min(hosts, BATCH), max_hosts=hosts,
                                   acquire_timeout_s=120))
        t0 = time.perf_counter()
        await pool.start()
        # The rest BATCH hosts at a time: a start leases every slot of every host at once, and
        # 100 x 64 connections opened together time out (see benchmarks/README.md, "The limit").
        while len(pool.hosts) < hosts:
            await asyncio.gather(*(pool.fleet._add_host() for _ in range(min(BATCH, hosts - len(pool.hosts)))))
        pool.cfg.min_hosts = hosts
        start_s = time.perf_counter() - t0
        rss1 = _rss_bytes()
        workers = min(hosts * SLOTS // 2, 512)
        lease_ms: list[float] = []
        calls = 0
        stop_at = time.monotonic() + seconds

        async def worker(w: int) -> None:
            nonlocal calls
            i = 0
            while time.monotonic() < stop_at:
                t = time.perf_counter()
                lease = await pool.lease(f"w{w}-{i}")
                lease_ms.append((time.perf_counter() - t) * 1e3)
                for _ in range(CALLS_PER_LEASE):
                    await lease.bash("true")
                    calls += 1
                await lease.release()
                i += 1

        cpu0, wall0 = time.process_time(), time.perf_counter()
        await asyncio.gather(*(worker(w) for w in range(workers)))
        cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
        await pool.stop()
    s = summarize(lease_ms)
    return {"hosts": hosts, "slots": hosts * SLOTS, "workers": workers, "calls": calls,
            "calls_per_s": calls / wall, "cpu_us_per_call": 1e6 * cpu / max(calls, 1),
            "pool_cpu_share": cpu / wall, "lease_ms": lease_ms, "lease_p50": s.get("p50", 0.0),
            "lease_p99": s.get("p99", 0.0), "bytes_per_slot": (rss1 - rss0) / (hosts * SLOTS), "start_s": start_s}


async def run(quick: bool) -> ScenarioResult:
    seconds = 4.0 if quick else 12.0
    res = ScenarioResult(NAME, f"the pool's own cost on simulated hosts that answer at once (x {SLOTS} slots)",
                         params={"slots_per_host": SLOTS, "seconds_per_size": seconds,
                                 "calls_per_lease": CALLS_PER_LEASE, "workers": "min(slots/2, 512)"})
    for hosts in (1, 10, 100):
        m = await _one(hosts, seconds)
        res.rows.append(Row(
            f"{hosts} host(s) x {SLOTS}: lease", m["lease_ms"], throughput=m["calls_per_s"],
            note=(f"{m['cpu_us_per_call']:.0f} us pool CPU/call, {m['bytes_per_slot'] / 1024:.1f} KiB/slot, "
                  f"{m['workers']} workers, pool busy {100 * m['pool_cpu_share']:.0f}% of a core, "
                  f"start {m['start_s']:.1f} s"),
            extra={k: v for k, v in m.items() if k != "lease_ms"}))
    res.notes.append("throughput = `true` calls/s through the pool; one asyncio process drives the pool, so "
                     "pool CPU share near 100% of a core is the ceiling")
    return res


if __name__ == "__main__":
    scenario_main(NAME, run)
