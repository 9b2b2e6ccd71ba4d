"""throughput: 64 trajectories issuing trivial calls (bash ``true``) through ``ToolExecutor``.

Local backend, 4 hosts x 16 slots (one slot per trajectory, no waiting for slots). Each of the
64 trajectories runs a closed loop: ``await executor.execute(tid, bash true)``, next call as soon
as the previous returns, for N seconds. Measured per executor batch window (0, 5 and 20 ms; 20 is
the default): calls/s, per-call latency as the trajectory sees it, and requests per call
(``executor.requests_sent / executor.calls_sent`` over the timed window). Also reported: CPU
seconds per call of this process (the pool/executor side) and of the host process trees (HTTP
server, supervisors, the forked bash), and how busy the whole machine was (/proc/stat; includes
other tenants).

Baseline in the same run: the machine's own ceiling for this work, ``bash -c true`` forked and
exec'd back to back by one process per core with nothing else around it (no sandbox, no HTTP, no
pool). No sandbox can beat it; the ratio says what share of it our whole stack reaches. A last row
runs ``stat`` (no process spawned) to show what the stack itself sustains.

Only successful calls count: calls/s is ``ok`` outcomes per second (failures are reported beside it).

Targets (docs/targets.md): >= 1,500 calls/s on 2 cores, and >= 75% of the spawn floor
measured in the same run.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import resource
import shutil
import time

from benchmarks.common import (
    BENCH_ROOT,
    Row,
    ScenarioResult,
    Target,
    cpu_seconds,
    host_pids,
    local_pool,
    process_tree,
    scenario_main,
)

NAME = "throughput"
TRAJECTORIES = 64
HOSTS, SLOTS = 4, 16
WINDOWS_MS = (0.0, 5.0, 20.0)
TARGET = 1500.0
FLOOR_SHARE = 0.75


def _machine_busy() -> tuple[int, int]:
    with open("/proc/stat") as fh:
        fields = [int(x) for x in fh.readline().split()[1:]]
    idle = fields[3] + fields[4]
    return sum(fields) - idle, sum(fields)


def _self_cpu() -> float:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


def _own_cpu(pids: list[int]) -> float:
    """utime+stime of the host processes themselves (HTTP, slots, frames), without their sandboxes."""
    total = 0.0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat", "rb") as fh:
                fields = fh.read().rsplit(b")", 1)[1].split()
        except OSError:
            continue
        total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return total


def _spawn_loop(seconds: float, out: multiprocessing.SimpleQueue) -> None:  # type: ignore[type-arg]
    lat: list[float] = []
    stop = time.perf_counter() + seconds
    while time.perf_counter() < stop:
        t0 = time.perf_counter()
        pid = os.posix_spawn("/bin/bash", ["bash", "-c", "true"], {})
        os.waitpid(pid, 0)
        lat.append((time.perf_counter() - t0) * 1e3)
    out.put(lat)


async def _floor(duration: float) -> Row:
    """``bash -c true`` spawned back to back by one process per core: the ceiling for this work."""
    ctx = multiprocessing.get_context("fork")
    out = ctx.SimpleQueue()
    workers = [ctx.Process(target=_spawn_loop, args=(duration, out)) for _ in range(os.cpu_count() or 1)]
    t0 = time.perf_counter()
    for w in workers:
        w.start()
    lat: list[float] = []
    for _ in workers:
        lat += await asyncio.to_thread(out.get)
    elapsed = time.perf_counter() - t0
    for w in workers:
        w.join()
    row = Row(f"bash -c true spawned, {len(workers)} loops (floor)", lat, throughput=len(lat) / elapsed,
              baseline=True)
    row.note = "no sandbox, HTTP or pool: the machine's ceiling for these calls"
    return row


async def _window(pool: object, window_ms: float, duration: float, tool: str = "bash") -> Row:
    from atropos.tools.executor import AgentToolCall, ExecutorConfig, ToolExecutor

    ex = ToolExecutor(pool, cfg=ExecutorConfig(tool_batch_window_ms=window_ms))  # type: ignore[arg-type]
    args = {"command": "true"} if tool == "bash" else {"path": "."}
    call = AgentToolCall(id="c", name=tool, arguments=args)
    tids = [f"tp-{tool}-{window_ms:g}-{i}" for i in range(TRAJECTORIES)]
    try:
        for _ in range(3):  # warm-up: leases every slot, opens the connections
            await asyncio.gather(*(ex.execute(t, call) for t in tids))
        lat: list[float] = []
        failures = 0
        req0, calls0 = ex.requests_sent, ex.calls_sent
        hosts = process_tree(host_pids(pool))
        host_cpu0, self_cpu0, busy0 = cpu_seconds(hosts), _self_cpu(), _machine_busy()
        own0 = _own_cpu(host_pids(pool))
        stop = time.perf_counter() + duration

        async def loop(tid: str) -> None:
            nonlocal failures
            while time.perf_counter() < stop:
                t0 = time.perf_counter()
                out = await ex.execute(tid, call)
                if out.ok:  # a failed call is no throughput
                    lat.append((time.perf_counter() - t0) * 1e3)
                else:
                    failures += 1

        t0 = time.perf_counter()
        await asyncio.gather(*(loop(t) for t in tids))
        elapsed = time.perf_counter() - t0
        hosts = process_tree(host_pids(pool))
        host_cpu = cpu_seconds(hosts) - host_cpu0
        own_cpu = _own_cpu(host_pids(pool)) - own0
        self_cpu = _self_cpu() - self_cpu0
        busy1 = _machine_busy()
        calls = len(lat)  # successful ones
        requests = ex.requests_sent - req0
        sent = ex.calls_sent - calls0
    finally:
        await asyncio.gather(*(ex.release_trajectory(t) for t in tids), return_exceptions=True)
        await ex.close()
    rate = calls / elapsed
    label = f"batch window {window_ms:g} ms" + (" (upper bound, adaptive)" if window_ms else "")
    busy = (busy1[0] - busy0[0]) / max(1, busy1[1] - busy0[1])
    if tool == "bash":
        row = Row(label, lat, throughput=rate, target=f">= {TARGET:,.0f} ok calls/s", passed=rate >= TARGET)
    else:  # no process spawned: what the stack itself (executor, HTTP, host, supervisor) sustains
        row = Row(f"{tool} (no spawn), {label}", lat, throughput=rate)
    row.extra = {"calls": calls, "failed": failures, "seconds": round(elapsed, 2), "requests": requests,
                 "requests_per_call": round(requests / sent, 3) if sent else None,
                 "pool_cpu_ms_per_call": round(self_cpu / calls * 1e3, 3) if calls else None,
                 "hosts_cpu_ms_per_call": round(host_cpu / calls * 1e3, 3) if calls else None,
                 "host_processes_cpu_ms_per_call": round(own_cpu / calls * 1e3, 3) if calls else None,
                 "machine_busy_pct": round(busy * 100, 1)}
    row.note = (f"{requests / sent if sent else 0:.3f} requests/call, {failures} failed, CPU/call: pool "
                f"{row.extra['pool_cpu_ms_per_call']} ms + hosts {row.extra['hosts_cpu_ms_per_call']} ms (host "
                f"processes {row.extra['host_processes_cpu_ms_per_call']} ms, the rest sandboxes); "
                f"machine busy {row.extra['machine_busy_pct']}%")
    return row


async def run(quick: bool) -> ScenarioResult:
    duration = 4.0 if quick else 15.0
    res = ScenarioResult(NAME, f"{TRAJECTORIES} trajectories x bash `true` through ToolExecutor, "
                               f"{duration:g} s per window" + (" (quick)" if quick else ""),
                         params={"trajectories": TRAJECTORIES, "hosts": HOSTS, "slots_per_host": SLOTS,
                                 "seconds_per_window": duration, "windows_ms": list(WINDOWS_MS)})
    res.rows.append(await _floor(duration))
    pool = local_pool(f"bench-tp-{time.monotonic_ns() % 10**6}", HOSTS, SLOTS)
    await pool.start()
    try:
        for w in WINDOWS_MS:
            res.rows.append(await _window(pool, w, duration))
        res.rows.append(await _window(pool, WINDOWS_MS[-1], duration, tool="stat"))
    finally:
        await pool.stop()
        shutil.rmtree(BENCH_ROOT / "local" / pool.cfg.pool_id, ignore_errors=True)
    ours = [r for r in res.rows if r.target]
    best = max(ours, key=lambda r: r.throughput or 0.0)
    floor = res.rows[0].throughput or 0.0
    share = (best.throughput or 0) / max(floor, 1e-9)
    res.targets.append(Target(f">= {TARGET:,.0f} ok calls/s (64 trajectories, trivial calls)",
                              "; ".join(f"{r.name}: {r.throughput:,.0f}/s" for r in ours)
                              + f" (best: {best.name}; {share:.0%} of the {floor:,.0f}/s floor)",
                              (best.throughput or 0) >= TARGET))
    res.targets.append(Target(f">= {FLOOR_SHARE:.0%} of the spawn floor measured in this run",
                              f"{best.throughput or 0:,.0f}/s of {floor:,.0f}/s = {share:.0%}", share >= FLOOR_SHARE))
    return res


if __name__ == "__main__":
    scenario_main(NAME, run)
