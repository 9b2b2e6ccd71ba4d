#!/usr/bin/env python3
"""Soak: random trajectories through a ToolExecutor on the local backend for a while, with figures.

Each of ``--concurrency`` workers loops: a new trajectory leases a slot (on its first call), makes
1-20 calls drawn from bash / write_file / read_file / terminal, checks every result, and releases.
Every ``--report-every`` seconds it prints throughput, p50/p99 call latency, and the RSS of this
process and of the hosts (server process, and the whole tree with its sandboxes). At the end it
checks the invariants: every result correct, no infrastructure error, no lease held, no slot leased
twice, nothing quarantined, and nothing of the pool left once it stopped; and it reports, per
process (this one, which runs the pool and executor; each host server; all sandboxes together),
the RSS at start and end and its slope after a warm-up (KB per minute and per 1,000 trajectories:
an RL run leases millions of slots, so any per-trajectory record left behind shows here), and
calls/s in the first and last interval. This script keeps only bounded samples itself.

    .venv/bin/python scripts/soak.py                       # 10 minutes
    .venv/bin/python scripts/soak.py --duration 60
    .venv/bin/python scripts/soak.py --trajectories 1000 --concurrency 1000 --calls 10 --tools bash
        # the 1,000 x 10 load (tests/test_executor.py) with memory figures
    .venv/bin/python scripts/soak.py --plateau --concurrency 16
        # issue 40's run: 2 hours or 100,000 trajectories, whichever first; per process the RSS and
        # live-heap slopes over the last half (KB per 1,000 trajectories)
    .venv/bin/python scripts/soak.py --duration 1200 --diagnose [--trace-frames 1]
        # what grows: after the warm-up, live objects by type, grown containers, malloc's and
        # pymalloc's view (and tracemalloc by allocation site) in the pool and every host (their
        # token-gated POST /v1/debug/memory), reported per 1,000 trajectories at the end

Every sample also reads each process's live heap (malloc's bytes in use and mmapped blocks, and
CPython's small-object blocks): RSS growing while the live heap is flat is the allocator keeping
free pages, not a record left behind (benchmarks/README.md, "Memory over millions of trajectories").

Exit status 0 when every invariant holds.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import random
import resource
import secrets
import sys
import tempfile
import time
from array import array
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(1, str(REPO / "tests"))  # test modules import their conftest by name, as under pytest

from atropos import memstats  # noqa: E402
from atropos.backends.local import LocalBackend, LocalBackendConfig  # noqa: E402
from atropos.errors import InfrastructureError  # noqa: E402
from atropos.slots.config import PoolConfig  # noqa: E402
from atropos.slots.pool import SlotPool  # noqa: E402
from atropos.tools.executor import AgentToolCall, ExecutorConfig, ToolExecutor  # noqa: E402
from tests.pool_backends import DATA_ROOT  # noqa: E402
from tests.test_chaos import eventually, pool_leftovers  # noqa: E402

TOOLS = ("bash", "write_file", "read_file", "terminal")


def vm_kb(pid: int | str, key: str) -> int:
    try:
        with open(f"/proc/{pid}/status") as fh:
            for line in fh:
                if line.startswith(key + ":"):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return 0


def cpu_s(pid: int | str) -> float:
    """CPU seconds of a process and of its reaped children (utime+stime+cutime+cstime): a host's
    sandboxes are its children, so this is the host's whole cost, whatever else loads the machine."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            fields = fh.read().rsplit(b")", 1)[1].split()
        return sum(int(f) for f in fields[11:15]) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return 0.0


def descendants(root: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as fh:
                ppid = int(fh.read().rsplit(b")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(name))
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo += children.get(pid, [])
    return out


def live_kb(r: memstats.MemoryReport) -> int:
    """A process's live heap: malloc's bytes in use (mmapped blocks too) and CPython's small
    objects, which its own allocator keeps in mmapped arenas outside malloc."""
    assert r.malloc is not None
    return r.malloc.in_use_kb + r.malloc.mmapped_kb + (r.pymalloc.allocated_kb if r.pymalloc else 0)


def percentile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


class Reservoir:
    """A uniform sample of at most ``size`` values (percentiles of a run of any length, bounded).

    Its memory is taken in full at the start (an array of doubles): a list of float objects that
    fills as the run goes grew this process by ~320 KB per reservoir, the lease-wait one until
    trajectory 10,000, and that read as the pool's growth in a soak's memory figures."""

    def __init__(self, size: int = 10_000, seed: int = 0) -> None:
        self.size, self.seen = size, 0
        self._values = array("d", bytes(8 * size))
        self._rng = random.Random(seed)

    @property
    def values(self) -> list[float]:
        return self._values[:min(self.seen, self.size)].tolist()

    def append(self, value: float) -> None:
        self.seen += 1
        if self.seen <= self.size:
            self._values[self.seen - 1] = value
        else:
            i = self._rng.randrange(self.seen)
            if i < self.size:
                self._values[i] = value


def slope(points: list[tuple[float, float]]) -> float:
    """Least-squares slope of y over x (0 with fewer than two distinct x)."""
    if len(points) < 2:
        return 0.0
    mx = sum(x for x, _ in points) / len(points)
    my = sum(y for _, y in points) / len(points)
    sxx = sum((x - mx) ** 2 for x, _ in points)
    return 0.0 if sxx == 0 else sum((x - mx) * (y - my) for x, y in points) / sxx


@dataclass
class Sample:
    t_s: float
    trajectories: int
    rss_kb: dict[str, int]  # process label -> RSS
    in_use_kb: dict[str, int] = field(default_factory=dict)  # process label -> live heap (live_kb)


class SampleLog:
    """The memory samples, one JSON line each in a temporary file, read back once at the end: a
    list of them in this process (~1.2 KB a sample, one per report) grew the pool's figure by more
    than the 10 KB per 1,000 trajectories it is checked against, at a few trajectories a second."""

    def __init__(self) -> None:
        self._fh = tempfile.TemporaryFile("w+")
        self.count = 0

    def append(self, sample: Sample) -> None:
        self._fh.write(json.dumps([sample.t_s, sample.trajectories, sample.rss_kb, sample.in_use_kb]) + "\n")
        self.count += 1

    def load(self) -> list[Sample]:
        self._fh.flush()
        self._fh.seek(0)
        out = [Sample(*json.loads(line)) for line in self._fh if line.strip()]
        self._fh.seek(0, os.SEEK_END)
        return out


@dataclass
class Stats:
    trajectories: int = 0
    calls: int = 0
    wrong: int = 0
    infra: int = 0
    other: int = 0
    by_tool: Counter[str] = field(default_factory=Counter)
    latencies: list[float] = field(default_factory=list)  # ms per call (slot already leased), since the last report
    all_latencies: Reservoir = field(default_factory=Reservoir)
    lease_waits: Reservoir = field(default_factory=Reservoir)  # ms from a trajectory's start to its slot
    samples: SampleLog = field(default_factory=SampleLog)  # one per report, kept in a file
    # one per report interval (8 bytes each: 2 KB over 2 hours)
    rates: array[float] = field(default_factory=lambda: array("d"))  # calls/s
    cpu_per_call: array[float] = field(default_factory=lambda: array("d"))  # ms of CPU (pool + hosts) per call
    problems: list[str] = field(default_factory=list)
    peak_host_kb: int = 0
    peak_tree_kb: int = 0

    def problem(self, text: str) -> None:
        if len(self.problems) < 30:
            self.problems.append(text)
            print(f"  problem at {time.strftime('%H:%M:%S')}: {text}", flush=True)  # as it happens


class Soak:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.rng = random.Random(args.seed)
        self.pool_id = f"soak{secrets.token_hex(3)}"
        self.backend = LocalBackend(LocalBackendConfig(
            slots_per_host=args.slots, pool_id=self.pool_id, data_root=DATA_ROOT, max_timeout_s=120))
        self.pool = SlotPool(self.backend, PoolConfig(
            pool_id=self.pool_id, min_hosts=args.hosts, max_hosts=args.hosts, acquire_timeout_s=3600,
            # tracing (--diagnose) slows the pool and the hosts: a probe on a loaded machine then
            # takes longer than the default 5 s without anything being wrong
            health_interval_s=2.0, health_timeout_s=30.0 if args.diagnose else 5.0))
        self.ex = ToolExecutor(self.pool, cfg=ExecutorConfig(acquire_timeout_s=3600))
        self.stats = Stats()
        self.tools = [t.strip() for t in args.tools.split(",")]
        self.started = 0.0
        self.t0 = time.monotonic()
        self.stop = asyncio.Event()
        self.diag_base: tuple[int, dict[str, memstats.MemoryReport]] | None = None

    # -- one trajectory -----------------------------------------------------------------------
    async def call(self, tid: str, name: str, arguments: dict[str, Any]) -> str | None:
        t0 = time.perf_counter()
        try:
            out = await self.ex.execute(tid, AgentToolCall(id="c", name=name, arguments=arguments))
        except InfrastructureError as exc:
            self.stats.infra += 1
            self.stats.problem(f"{tid} {name}: infrastructure error {exc}")
            return None
        except Exception as exc:
            self.stats.other += 1
            self.stats.problem(f"{tid} {name}: {type(exc).__name__}: {exc}")
            return None
        ms = (time.perf_counter() - t0) * 1000
        self.stats.latencies.append(ms)
        self.stats.all_latencies.append(ms)
        self.stats.calls += 1
        self.stats.by_tool[name] += 1
        if not out.ok:
            self.stats.wrong += 1
            self.stats.problem(f"{tid} {name}{arguments}: failed: {out.content[:200]}")
            return None
        return out.content

    async def trajectory(self, tid: str) -> None:
        rng = self.rng
        written: dict[str, str] = {}
        t0 = time.perf_counter()
        try:
            await self.ex.lease_for(tid)  # waiting for a slot is not part of a call's latency
        except Exception as exc:
            self.stats.other += 1
            self.stats.problem(f"{tid}: no slot: {type(exc).__name__}: {exc}")
            return
        self.stats.lease_waits.append((time.perf_counter() - t0) * 1000)
        n = self.args.calls or rng.randint(1, 20)
        for _ in range(n):
            tool = rng.choice(self.tools)
            if tool == "read_file" and not written:
                tool = "write_file" if "write_file" in self.tools else "bash"
            marker = secrets.token_hex(6)
            if tool == "bash":
                out = await self.call(tid, "bash", {"command": f"echo {marker} | tr a-f A-F"})
                ok = out is None or out == marker.upper()
            elif tool == "write_file":
                path = f"dir{rng.randint(0, 3)}/f{rng.randint(0, 9)}.txt"
                content = f"{tid}:{marker}\n" * rng.randint(1, 50)
                out = await self.call(tid, "write_file", {"path": path, "content": content})
                if out is not None:
                    written[path] = content
                ok = True
            elif tool == "read_file":
                path = rng.choice(sorted(written))
                out = await self.call(tid, "read_file", {"path": path})
                ok = out is None or out == written[path]
            else:
                out = await self.call(tid, "terminal", {"input": f"echo {marker}-$((6*7))", "wait_ms": 3000})
                seen = out or ""
                for _ in range(3):  # the prompt can come back before tmux flushed the output
                    if out is None or f"{marker}-42" in seen:
                        break
                    more = await self.call(tid, "terminal", {"input": "", "wait_ms": 1000})
                    seen += more or ""
                ok = out is None or f"{marker}-42" in seen
            if not ok:
                self.stats.wrong += 1
                self.stats.problem(f"{tid} {tool}: wrong result {out!r:.200}")
        try:
            await self.ex.release_trajectory(tid)
        except Exception as exc:
            self.stats.other += 1
            self.stats.problem(f"release of {tid}: {type(exc).__name__}: {exc}")
        self.stats.trajectories += 1

    async def worker(self) -> None:
        while not self.stop.is_set():
            if self.args.trajectories and self.started >= self.args.trajectories:
                self.stop.set()  # the reporter and the other workers end too (a --duration may remain)
                return
            self.started += 1
            await self.trajectory(f"soak-{secrets.token_hex(5)}")

    # -- reporting -----------------------------------------------------------------------------
    def _proc_memory(self) -> tuple[dict[str, int], int, int]:
        """RSS per process (from /proc; in a thread, the walk over /proc is slow on a busy machine)."""
        host_kb = tree_kb = servers_kb = 0
        per_process = {"pool": vm_kb("self", "VmRSS")}
        for n, host_id in enumerate(sorted(self.pool.hosts)):
            pid = self.backend.pid(host_id)
            if pid is None:
                continue
            rss = vm_kb(pid, "VmRSS")
            per_process[f"host{n}"] = rss
            host_kb, servers_kb = max(host_kb, rss), servers_kb + rss
            self.stats.peak_host_kb = max(self.stats.peak_host_kb, vm_kb(pid, "VmHWM"))
            tree_kb += sum(vm_kb(p, "VmRSS") for p in descendants(pid))
        per_process["sandboxes"] = tree_kb - servers_kb  # everything the hosts started, together
        return per_process, host_kb, tree_kb

    async def host_reports(self, req: memstats.MemoryRequest) -> dict[str, memstats.MemoryReport]:
        """Each host server's own memory report (its token-gated debug route), by label."""
        labels = {f"host{n}": self.pool.hosts[h] for n, h in enumerate(sorted(self.pool.hosts))}

        async def one(host: Any) -> memstats.MemoryReport | None:
            try:
                return await host.client.memory(req)
            except Exception as exc:  # a host gone mid-run is the invariants' business, not this sample's
                self.stats.problem(f"memory report of {host.id}: {type(exc).__name__}: {exc}")
                return None

        got = await asyncio.gather(*(one(h) for h in labels.values()))
        return {label: r for label, r in zip(labels, got, strict=True) if r is not None}

    async def memory(self, record: bool = True) -> dict[str, float]:
        """Sample every process's RSS and live heap. ``record``: keep the sample for the slopes; the
        samples taken once the load stops are not (the drain frees what was in flight: the 55-minute
        run's last sample alone moved the pool's last-half slope from 142 to 86 KB per 1,000)."""
        per_process, host_kb, tree_kb = await asyncio.to_thread(self._proc_memory)
        # what malloc holds in use per process: live memory, against RSS (the rest is malloc's free
        # pages and fragmentation)
        req = memstats.MemoryRequest(pymalloc=True)
        reports = {"pool": memstats.report(req), **await self.host_reports(req)}
        in_use = {label: live_kb(r) for label, r in reports.items() if r.malloc is not None}
        if record:
            self.stats.samples.append(Sample(time.monotonic() - self.t0, self.stats.trajectories, per_process, in_use))
        self.stats.peak_tree_kb = max(self.stats.peak_tree_kb, tree_kb)
        return {"self_rss_mb": vm_kb("self", "VmRSS") / 1024,
                "self_peak_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                "host_rss_max_mb": host_kb / 1024, "hosts_tree_rss_mb": tree_kb / 1024}

    def cpu_total_s(self) -> float:
        """CPU seconds used so far by this process and every host (with the sandboxes it reaped)."""
        pids = [self.backend.pid(h) for h in self.pool.hosts]
        return cpu_s("self") + sum(cpu_s(p) for p in pids if p is not None)

    async def reporter(self, t0: float) -> None:
        last_t, last_calls, last_cpu = t0, 0, self.cpu_total_s()
        while not self.stop.is_set():
            try:
                await asyncio.wait_for(self.stop.wait(), self.args.report_every)
            except asyncio.TimeoutError:
                pass
            now = time.monotonic()
            lat, self.stats.latencies = self.stats.latencies, []
            # the interval's latencies (up to ~1,500 floats, ~48 KB, fewer as a loaded run slows) are
            # freed before the sample: their size followed the call rate into the pool's slope
            p50, p99 = percentile(lat, 0.5), percentile(lat, 0.99)
            del lat
            mem = await self.memory(record=not self.stop.is_set())
            status = self.pool.status()
            rate = (self.stats.calls - last_calls) / max(now - last_t, 1e-9)
            cpu = self.cpu_total_s()
            cpu_ms = (cpu - last_cpu) * 1000 / max(self.stats.calls - last_calls, 1)
            if not self.stop.is_set():  # the last interval is cut short by the drain: not a rate
                self.stats.rates.append(rate)
                self.stats.cpu_per_call.append(cpu_ms)
            print(json.dumps({
                "t_s": round(now - t0), "trajectories": self.stats.trajectories, "calls": self.stats.calls,
                "calls_per_s": round(rate, 1), "cpu_ms_per_call": round(cpu_ms, 2),
                "load1": round(os.getloadavg()[0], 1),
                "p50_ms": round(p50, 1), "p99_ms": round(p99, 1),
                **{k: round(v, 1) for k, v in mem.items()},
                "leased": status.leased, "free": status.free, "quarantined": status.quarantined,
                "errors": self.stats.wrong + self.stats.infra + self.stats.other,
                "wrong": self.stats.wrong, "infra": self.stats.infra, "other": self.stats.other,
            }), flush=True)
            last_t, last_calls, last_cpu = now, self.stats.calls, cpu
            if self.args.diagnose and self.diag_base is None and self.progress(now - t0) >= self.args.warmup:
                await self.diagnose_start()

    # -- diagnosis (--diagnose): what grows, by type and by allocation site -------------------
    def progress(self, elapsed: float) -> float:
        """How far the run is (0..1): by time or by trajectories, whichever is further."""
        done = elapsed / self.args.duration if self.args.duration else 0.0
        if self.args.trajectories:
            done = max(done, self.stats.trajectories / self.args.trajectories)
        return done

    async def trace_from_start(self) -> None:
        """Trace every process from the start; the warm-up's end only retakes the baseline. Tracing
        begun at the baseline counts every bounded window as growth while its untraced entries are
        replaced by traced ones (the pool's lease audit, 2,048 events full long before: ~1 MB at each
        of its two ``audit.record`` sites after 1,790 trajectories, in a 20-minute run)."""
        req = memstats.MemoryRequest(trace="start", frames=self.args.trace_frames)
        memstats.report(req)
        await self.host_reports(req)

    async def diagnose_start(self) -> None:
        """After the warm-up: count live objects by type and start tracing, here and in every host."""
        frames = self.args.trace_frames
        req = memstats.MemoryRequest(trace="start" if frames else None, frames=max(frames, 1), types=True, top=80,
                                     pymalloc=True, containers="start")
        t0 = time.perf_counter()
        # in the event loop, not a thread: a walk of every object in a thread fights the loop for
        # the GIL (seconds, under load), and the pool is paused a moment either way
        reports = {"pool": memstats.report(req)}
        t1 = time.perf_counter()
        reports.update(await self.host_reports(req))
        self.diag_base = (self.stats.trajectories, reports)
        print(json.dumps({"event": "diagnose_start", "trajectories": self.stats.trajectories,
                          "took_s": [round(t1 - t0, 2), round(time.perf_counter() - t1, 2)],
                          **{k: {"rss_kb": r.rss_kb, "gc_objects": r.gc_objects,
                                 "malloc": r.malloc.model_dump() if r.malloc else None}
                             for k, r in reports.items()}}), flush=True)

    async def diagnose_end(self) -> None:
        """Per process: the object types and allocation sites that grew since ``diagnose_start``,
        per 1,000 trajectories, and malloc's view against RSS (then what a malloc_trim gives back)."""
        if self.diag_base is None:
            return
        n0, base = self.diag_base
        runs = max(self.stats.trajectories - n0, 1)
        names = sorted({t for r in base.values() for t in r.types})
        req = memstats.MemoryRequest(trace="stop" if self.args.trace_frames else None, types=True, type_names=names,
                                     top=30, pymalloc=True, containers="diff", min_growth=100)
        reports = {"pool": memstats.report(req), **await self.host_reports(req)}
        trims = {"pool": memstats.report(memstats.MemoryRequest(trim=True)),
                 **await self.host_reports(memstats.MemoryRequest(trim=True))}
        for label, now in reports.items():
            before = base.get(label)
            if before is None:
                continue
            types = {t: now.types.get(t, 0) - before.types.get(t, 0) for t in set(now.types) | set(before.types)}
            grew = sorted(((t, d) for t, d in types.items() if d > 0), key=lambda kv: -kv[1])[:15]
            print(json.dumps({
                "event": "diagnose", "process": label, "trajectories": runs,
                "rss_kb": [before.rss_kb, now.rss_kb],
                "malloc_before": before.malloc.model_dump() if before.malloc else None,
                "malloc_after": now.malloc.model_dump() if now.malloc else None,
                "trim_gave_back_kb": trims[label].trimmed_kb if label in trims else None,
                "periodic_trims": now.trims.model_dump() if now.trims else None,
                "pymalloc_before": before.pymalloc.model_dump() if before.pymalloc else None,
                "pymalloc_after": now.pymalloc.model_dump() if now.pymalloc else None,
                "gc_objects": [before.gc_objects, now.gc_objects],
                "threads": now.threads, "asyncio_tasks": now.asyncio_tasks, "open_fds": now.open_fds,
                "types_grown": {t: d for t, d in grew},
                # lists, dicts, sets, deques grown by 100+ entries, by owner (bound: a deque's maxlen)
                "containers_grown": [c.model_dump() for c in now.containers],
                "traced_kb": now.traced_kb,
                "sites_grown_kb_per_1k": [
                    {"site": g.site, "kb_per_1k": round(g.size_diff_kb * 1000 / runs, 2),
                     "blocks_per_1k": round(g.count_diff * 1000 / runs, 1), "kb": g.size_kb}
                    for g in now.growth if g.size_diff_kb > 0],
            }), flush=True)

    # -- run ----------------------------------------------------------------------------------
    async def run(self) -> int:
        t0 = time.monotonic()
        await self.pool.start()
        alloc = memstats.mallinfo()
        print(json.dumps({"event": "started", "pool_id": self.pool_id, "hosts": self.args.hosts,
                          "slots": self.args.hosts * self.args.slots, "concurrency": self.args.concurrency,
                          "start_s": round(time.monotonic() - t0, 1),
                          # the pool's process is the trainer's: its allocator setting is the environment's
                          "pool_malloc_arena_max": os.environ.get("MALLOC_ARENA_MAX"),
                          "pool_malloc_arenas": alloc.arenas if alloc else None,
                          "pool_malloc_trim_interval_s": self.pool.cfg.malloc_trim_interval_s}), flush=True)
        if self.args.diagnose and self.args.trace_frames:
            await self.trace_from_start()
        t0 = self.t0 = time.monotonic()
        await self.memory()  # the baseline sample
        reporter = asyncio.create_task(self.reporter(t0))
        workers = [asyncio.create_task(self.worker()) for _ in range(self.args.concurrency)]
        # --duration and --trajectories: whichever comes first (a worker sets stop at the count)
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self.stop.wait(), self.args.duration)
        self.stop.set()  # workers finish their current trajectory
        await asyncio.gather(*workers)
        wall = time.monotonic() - t0
        self.stop.set()
        await reporter
        return await self.finish(wall)

    def flatness(self) -> dict[str, Any]:
        """Per process: RSS at start and end, and its slope after the warm-up; calls/s first and last."""
        samples = self.stats.samples.load()
        warm = [x for x in samples if x.t_s >= self.args.warmup * (samples[-1].t_s if samples else 0)]
        out: dict[str, Any] = {"warmup_fraction": self.args.warmup,
                               "calls_per_s_first": round(self.stats.rates[0], 1) if self.stats.rates else None,
                               "calls_per_s_last": round(self.stats.rates[-1], 1) if self.stats.rates else None,
                               # calls/s depends on whatever else runs on the machine; the CPU a call
                               # costs the pool and hosts does not, so it is the flatness figure
                               "cpu_ms_per_call_first": round(self.stats.cpu_per_call[0], 2)
                               if self.stats.cpu_per_call else None,
                               "cpu_ms_per_call_last": round(self.stats.cpu_per_call[-1], 2)
                               if self.stats.cpu_per_call else None,
                               "cpu_ms_per_call_slope_per_hour": round(slope(
                                   [(i * self.args.report_every / 3600, v)
                                    for i, v in enumerate(self.stats.cpu_per_call)]), 3),
                               "processes": {}}
        half = [x for x in samples if x.t_s >= 0.5 * (samples[-1].t_s if samples else 0)]
        out["last_half_from_trajectory"] = half[0].trajectories if half else None
        for label in samples[0].rss_kb if samples else {}:
            series = [x for x in warm if label in x.rss_kb]
            per_min = slope([(x.t_s / 60, x.rss_kb[label]) for x in series])
            per_traj = slope([(x.trajectories, x.rss_kb[label]) for x in series])
            last = [x for x in half if label in x.rss_kb]
            used = [x for x in half if label in x.in_use_kb]
            out["processes"][label] = {
                "start_mb": round(samples[0].rss_kb[label] / 1024, 1),
                "end_mb": round(samples[-1].rss_kb.get(label, 0) / 1024, 1),
                "after_warmup_mb": round(series[0].rss_kb[label] / 1024, 1) if series else None,
                "slope_kb_per_min": round(per_min, 1),
                "slope_kb_per_1k_trajectories": round(per_traj * 1000, 1),
                # issue 40's figure: the slope over the last half of the run (the plateau, if any)
                "last_half_slope_kb_per_1k_trajectories": round(
                    slope([(x.trajectories, x.rss_kb[label]) for x in last]) * 1000, 1),
                # the live heap over the same half (malloc's bytes in use, its mmapped blocks, and the
                # small-object allocator's blocks in use); RSS minus this is free pages and code
                "last_half_in_use_slope_kb_per_1k_trajectories": round(
                    slope([(x.trajectories, x.in_use_kb[label]) for x in used]) * 1000, 1) if used else None,
                "in_use_end_mb": round(samples[-1].in_use_kb[label] / 1024, 1)
                if label in samples[-1].in_use_kb else None,
            }
        return out

    async def finish(self, wall: float) -> int:
        mem = await self.memory(record=False)
        await self.diagnose_end()
        status = self.pool.status()
        # checked online over the whole run (the audit keeps only a window of events in memory)
        dl = self.pool.audit.problems
        await self.ex.close()
        await self.pool.stop()
        left = await eventually(lambda: pool_leftovers("local", self.pool_id))
        s = self.stats
        figures = {
            "event": "final", "wall_s": round(wall, 1), "trajectories": s.trajectories, "calls": s.calls,
            "calls_per_s": round(s.calls / wall, 1), "p50_ms": round(percentile(s.all_latencies.values, 0.5), 1),
            "p99_ms": round(percentile(s.all_latencies.values, 0.99), 1), "by_tool": dict(s.by_tool),
            "lease_wait_p50_ms": round(percentile(s.lease_waits.values, 0.5), 1),
            "lease_wait_p99_ms": round(percentile(s.lease_waits.values, 0.99), 1),
            "wrong_results": s.wrong, "infra_errors": s.infra, "other_errors": s.other,
            "leases_held_at_end": status.leased, "quarantined": status.quarantined,
            "double_leases": self.pool.audit.double_leased,
            "orphans_after_stop": len(left), "self_peak_rss_mb": round(mem["self_peak_mb"], 1),
            "host_peak_rss_mb": round(s.peak_host_kb / 1024, 1),
            "hosts_tree_peak_rss_mb": round(s.peak_tree_kb / 1024, 1),
        }
        print(json.dumps(figures), flush=True)
        flat = self.flatness()
        print(json.dumps({"event": "flatness", **flat}), flush=True)
        invariants = {"wrong_results": s.wrong, "infra_errors": s.infra, "other_errors": s.other,
                      "leases_held_at_end": status.leased, "quarantined": status.quarantined,
                      "double_leases": self.pool.audit.double_leased, "audit_problems": len(dl),
                      "orphans_after_stop": len(left)}
        # the bar, per process, in one line: RSS and live heap over the last half
        bar = self.args.bar_kb_per_1k
        per = {label: {"rss_kb_per_1k": p["last_half_slope_kb_per_1k_trajectories"],
                       "live_heap_kb_per_1k": p["last_half_in_use_slope_kb_per_1k_trajectories"],
                       "at_bar": p["last_half_slope_kb_per_1k_trajectories"] <= bar}
               for label, p in flat["processes"].items() if label != "sandboxes"}
        print(json.dumps({"event": "verdict", "bar_kb_per_1k_trajectories": bar, "trajectories": s.trajectories,
                          "last_half_from_trajectory": flat.get("last_half_from_trajectory"),
                          "processes": per, "every_process_at_bar": all(v["at_bar"] for v in per.values()),
                          "invariants": invariants, "invariants_hold": not any(invariants.values())}), flush=True)
        for p in s.problems + dl[:10] + left[:10]:
            print(f"  problem: {p}", flush=True)
        root = DATA_ROOT / self.pool_id
        if root.exists() and not any(p.is_dir() for p in root.iterdir()):
            for log in root.iterdir():
                log.unlink()
            root.rmdir()
        clean = not (s.wrong or s.infra or s.other or status.leased or status.quarantined or dl or left)
        return 0 if clean else 1


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--duration", type=float, default=None,
                   help="seconds of load (default 600, or no limit with --trajectories; with both: "
                        "whichever comes first)")
    p.add_argument("--trajectories", type=int, default=0, help="stop after this many trajectories")
    p.add_argument("--plateau", action="store_true",
                   help="issue 40's run: 2 hours or 100,000 trajectories, whichever first (unless given), "
                        "and the RSS slope of each process over the last half")
    p.add_argument("--diagnose", action="store_true",
                   help="after the warm-up, count live objects by type and trace the Python heap in the "
                        "pool and every host (tracemalloc: slower); at the end report what grew, per "
                        "1,000 trajectories, by type and by allocation site, and malloc's view against RSS")
    p.add_argument("--trace-frames", type=int, default=1,
                   help="with --diagnose: frames per traced allocation (0: no tracemalloc; each frame "
                        "slows the traced processes, 8 made a loaded pool ~10x slower; default %(default)s)")
    p.add_argument("--concurrency", type=int, default=64, help="trajectories at once (default %(default)s)")
    p.add_argument("--calls", type=int, default=0, help="calls per trajectory (default: random 1-20)")
    p.add_argument("--tools", default=",".join(TOOLS), help="comma-separated mix (default %(default)s)")
    p.add_argument("--hosts", type=int, default=4)
    p.add_argument("--slots", type=int, default=16, help="slots per host")
    p.add_argument("--report-every", type=float, default=30.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--bar-kb-per-1k", type=float, default=10.0,
                   help="the verdict line's bar: RSS slope per process over the last half, KB per 1,000 "
                        "trajectories (issue 40: %(default)s)")
    p.add_argument("--warmup", type=float, default=0.2,
                   help="fraction of the run left out of the memory slopes (default %(default)s)")
    args = p.parse_args()
    if args.plateau:
        args.duration = 7200.0 if args.duration is None else args.duration
        args.trajectories = args.trajectories or 100_000
    if args.duration is None:
        args.duration = None if args.trajectories else 600.0
    if not 0 <= args.warmup < 1:  # a count of seconds here would leave no sample to take a slope from
        p.error(f"--warmup is a fraction of the run in [0, 1), got {args.warmup:g}")
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    sys.exit(asyncio.run(Soak(args).run()))


if __name__ == "__main__":
    main()
