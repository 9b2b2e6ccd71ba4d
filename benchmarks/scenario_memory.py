"""memory: the pool's own memory per live slot, with 256 slots leased (local backend, 4 x 64).

Runs in a fresh child process (so earlier scenarios' garbage does not blur the numbers):
1. import everything, ``gc.collect()``, read this process's RSS, start ``tracemalloc``;
2. start a SlotPool (4 hosts x 64 slots; ``prewarm=False`` so a loaded machine does not hit the
   host start timeout; the end state is the same), lease all 256 slots and run one ``terminal``
   call on each (so every slot has a live supervisor sandbox and a live tmux);
3. ``gc.collect()``, read RSS and tracemalloc again.

Reported per slot: the pool process's RSS growth (minus tracemalloc's own bookkeeping) and the
Python heap growth traced by tracemalloc; separately, the hosts' memory: RSS and PSS summed over
every host process and all their descendants (supervisors, bwrap, tmux, bash), per slot. RSS
double-counts shared pages (libpython, bash); PSS splits them fairly.

Target (docs/targets.md): the pool's own memory < 1 MiB per slot.
"""

from __future__ import annotations

import asyncio
import gc
import json
import os
import shutil
import subprocess
import sys
import time
import tracemalloc
from pathlib import Path

from benchmarks.common import (
    BENCH_ROOT,
    REPO,
    Row,
    ScenarioResult,
    Target,
    host_pids,
    local_pool,
    process_tree,
    pss_kib,
    rss_kib,
    scenario_main,
)

NAME = "memory"
MIB = 1024.0  # KiB per MiB


async def _child(hosts: int, slots: int) -> dict[str, object]:
    # imported before the baseline is read, so imports do not count as per-slot memory
    import atropos.slots.pool
    import atropos.tools.executor

    del atropos

    total = hosts * slots
    gc.collect()
    rss0 = rss_kib(os.getpid())
    tracemalloc.start()
    t0 = time.perf_counter()
    pool = local_pool(f"bench-mem-{os.getpid()}", hosts, slots,
                      backend_kw={"prewarm": False, "start_timeout_s": 240.0})
    await pool.start()
    started = time.perf_counter() - t0
    out: dict[str, object] = {}
    try:
        leases = [await pool.lease(f"mem-{i}", timeout=60) for i in range(total)]
        sem = asyncio.Semaphore(16)
        failures: list[str] = []

        async def term(lease: object) -> None:
            async with sem:
                r = await lease.call("terminal", {"input": "echo hi", "wait_ms": 5000}, timeout_s=60)  # type: ignore[attr-defined]
                if not r.ok:
                    failures.append(str(r.error))

        t1 = time.perf_counter()
        await asyncio.gather(*(term(lease) for lease in leases))
        terminals_s = time.perf_counter() - t1
        gc.collect()
        traced, peak = tracemalloc.get_traced_memory()
        tm_overhead = tracemalloc.get_tracemalloc_memory()
        rss1 = rss_kib(os.getpid())
        tree = process_tree(host_pids(pool))
        comms = []
        for pid in tree:
            try:
                comms.append(Path(f"/proc/{pid}/comm").read_text().strip())
            except OSError:
                pass
        out = {
            "slots": total, "leased": len(leases), "terminal_failures": failures[:5], "n_failures": len(failures),
            "rss0_kib": rss0, "rss1_kib": rss1, "tracemalloc_overhead_kib": tm_overhead / 1024,
            "traced_kib": traced / 1024, "traced_peak_kib": peak / 1024,
            "hosts_rss_kib": sum(rss_kib(p) for p in tree), "hosts_pss_kib": sum(pss_kib(p) for p in tree),
            "host_processes": len(tree), "tmux_servers": comms.count("tmux: server"),
            "processes_by_name": {c: comms.count(c) for c in sorted(set(comms))},
            "pool_start_s": round(started, 2), "terminals_s": round(terminals_s, 2),
        }
        # Side measurement: one reset at a time while all the other slots stay live (the host's
        # reset scans /proc for the slot uid's processes, so the machine's process count matters).
        tracemalloc.stop()
        reset_host: list[float] = []
        reset_e2e: list[float] = []
        for host in pool.hosts.values():
            original = host.client.reset

            async def recording(*a: object, _orig: object = original, **kw: object) -> object:
                r = await _orig(*a, **kw)  # type: ignore[operator]
                reset_host.append(r.duration_ms)
                return r

            host.client.reset = recording
        for lease in leases[:10]:
            t2 = time.perf_counter()
            await pool.release(lease)
            reset_e2e.append((time.perf_counter() - t2) * 1e3)
        out["reset_host_ms"] = list(reset_host)
        out["reset_e2e_ms"] = reset_e2e
        out["live_processes_machine"] = sum(1 for n in os.listdir("/proc") if n.isdigit())
        await asyncio.gather(*(pool.release(lease) for lease in leases[10:]), return_exceptions=True)
    finally:
        await pool.stop()
        shutil.rmtree(BENCH_ROOT / "local" / pool.cfg.pool_id, ignore_errors=True)
    return out


async def run(quick: bool) -> ScenarioResult:
    hosts, slots = (4, 16) if quick else (4, 64)
    total = hosts * slots
    res = ScenarioResult(NAME, f"pool memory per live slot, {total} slots leased (local backend)",
                         params={"hosts": hosts, "slots_per_host": slots, "leased": total,
                                 "per_slot": "1 terminal call (live tmux)"})
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = await asyncio.to_thread(
        subprocess.run, [sys.executable, "-m", "benchmarks.scenario_memory", "--child", str(hosts), str(slots)],
        capture_output=True, text=True, cwd=REPO, env=env, timeout=900)
    if proc.returncode != 0:
        raise RuntimeError(f"child failed ({proc.returncode}): {proc.stderr.strip()[-2000:]}")
    m = json.loads(proc.stdout.strip().splitlines()[-1])
    pool_rss = (m["rss1_kib"] - m["rss0_kib"] - m["tracemalloc_overhead_kib"]) / total
    traced = m["traced_kib"] / total
    own = max(pool_rss, traced)
    target = "< 1 MiB/slot"
    res.rows = [
        Row("pool RSS growth / slot", value=pool_rss, unit="KiB", target=target, passed=pool_rss < MIB,
            n=total, note=f"RSS {m['rss0_kib'] / MIB:.1f} -> {m['rss1_kib'] / MIB:.1f} MiB, minus tracemalloc's "
                          f"own {m['tracemalloc_overhead_kib'] / MIB:.1f} MiB"),
        Row("pool Python heap (tracemalloc) / slot", value=traced, unit="KiB", target=target, passed=traced < MIB,
            n=total, note=f"traced {m['traced_kib'] / MIB:.2f} MiB, peak {m['traced_peak_kib'] / MIB:.2f} MiB"),
        Row("hosts RSS sum / slot", value=m["hosts_rss_kib"] / total, unit="KiB", n=total,
            note=f"{m['host_processes']} processes: {m['processes_by_name']}"),
        Row("hosts PSS sum / slot", value=m["hosts_pss_kib"] / total, unit="KiB", n=total),
    ]
    res.rows += [
        Row(f"side: reset, host duration_ms, {total - 1} others live", m["reset_host_ms"],
            note=f"{m['live_processes_machine']} processes on the machine; released one at a time"),
        Row(f"side: release end to end, {total - 1} others live", m["reset_e2e_ms"]),
    ]
    res.targets.append(Target("pool's own memory < 1 MiB per slot",
                              f"{own:.1f} KiB/slot (larger of RSS growth {pool_rss:.1f} and heap {traced:.1f})",
                              own < MIB))
    res.notes.append(f"{m['leased']} leased, {m['tmux_servers']} tmux servers alive, {m['n_failures']} terminal "
                     f"calls failed {m['terminal_failures'] or ''}; pool start {m['pool_start_s']}s, "
                     f"256 terminal calls {m['terminals_s']}s" .replace("256", str(total)))
    return res


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--child":
        print(json.dumps(asyncio.run(_child(int(sys.argv[2]), int(sys.argv[3])))), flush=True)
    else:
        scenario_main(NAME, run)
