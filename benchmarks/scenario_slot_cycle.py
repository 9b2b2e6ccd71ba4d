"""slot_cycle: what one trajectory's slot costs the machine, whole (lease, calls, release).

Per call we are cheap; per trajectory the cycle around the calls (sandbox start, cgroup, mounts,
warm-interpreter prestarts, kill, uid sweep, workspace renewal and verification) is what a GRPO run
of many short rollouts pays. Measured on the local backend, 1 host x 16 slots, 16 trajectories at
a time, in lock-step rounds: the 16 leases, then the 16 trajectories' calls, then the 16 releases,
each phase bracketed by samples of

- **machine CPU**: every process and the kernel, from ``/proc/stat`` (user, nice, system, irq,
  softirq, steal). On a shared machine other load lands here too: the load average is printed and
  the attributed rows below are immune to it;
- **attributed CPU**, by process: the pool (this benchmark's process: pool, client, the loop), the
  host server itself, the mount helper's tree, and everything else under the host (slot sandboxes:
  bubblewrap, the supervisor, commands, tmux; the host's short helper programs). The host's whole
  tree is counted by a cpuacct cgroup the benchmark moves it into (cgroup v1; children inherit it,
  so processes killed at a reset before anyone reaped them are counted too); without one, by the
  live processes' own and waited-for children's times (``benchmarks.common.cpu_seconds``), which
  misses what a killed pid namespace never reported.

Variants: ``lease, 1 x bash true, release``; ``lease, 10 x bash true, release``; ``lease, 1 x bash
true + 1 x write_file, release`` (a file tool, served by slotd itself since issue 37,
docs/native-supervisor.md; that call's wall time is a row of its own); ``lease, 1 x terminal,
release`` (the terminal's first use starts tmux). Each row's samples are one value per round: CPU ms
per trajectory of that round.

Baselines in the same run: a bare ``bwrap ... true`` (a fresh sandbox, the floor of any cycle), and,
where Docker and the sandbox image are available, a container per trajectory (``docker run -d``,
one ``docker exec true``, ``docker rm -f``), machine CPU per trajectory.

Targets (issue 30, docs/targets.md): lease + 1 ``true`` + release <= 20 ms machine CPU per
trajectory and >= 100 trajectories/s on 2 cores; a terminal trajectory <= 40 ms.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import subprocess
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks import perf_tree
from benchmarks.common import (
    BENCH_ROOT,
    DOCKER_IMAGE,
    Row,
    ScenarioResult,
    Target,
    cpu_seconds,
    docker_problem,
    host_pids,
    local_pool,
    process_tree,
    scenario_main,
)
from benchmarks.perf_tree import PerfTree

NAME = "slot_cycle"
SLOTS = 16
_CLK_TCK = os.sysconf("SC_CLK_TCK")
PHASES = ("lease", "calls", "release")
PARTS = ("pool", "host server", "mount helper", "sandboxes and helpers", "kernel and other")


def machine_busy_s() -> float:
    """Busy CPU seconds of the whole machine since boot (all CPUs), from /proc/stat."""
    with open("/proc/stat") as fh:
        f = fh.readline().split()
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(x) for x in f[1:9])
    return (user + nice + system + irq + softirq + steal) / _CLK_TCK


def own_cpu_s() -> float:
    t = os.times()
    return t.user + t.system


def _cmdline(pid: int) -> bytes:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as fh:
            return fh.read()
    except OSError:
        return b""


@dataclass
class Sample:
    machine: float
    parts: dict[str, float]


CPUACCT = Path("/sys/fs/cgroup/cpuacct")


class TreeCounter:
    """CPU of the host's whole process tree: a cpuacct cgroup holding it, or /proc as a fallback."""

    def __init__(self, host: int) -> None:
        self.host = host
        self.group: Path | None = None
        if (CPUACCT / "cpuacct.usage").exists() and os.geteuid() == 0:
            group = CPUACCT / f"atropos-bench-{os.getpid()}"
            group.mkdir(exist_ok=True)
            for pid in process_tree([host]):
                with contextlib.suppress(OSError):
                    (group / "cgroup.procs").write_text(str(pid))
            self.group = group

    def total_s(self) -> float:
        if self.group is not None:
            return int((self.group / "cpuacct.usage").read_text()) / 1e9
        return cpu_seconds(process_tree([self.host]))

    def close(self) -> None:
        if self.group is not None:
            root = CPUACCT / "cgroup.procs"
            for pid in (self.group / "cgroup.procs").read_text().split():
                with contextlib.suppress(OSError):
                    root.write_text(pid)
            with contextlib.suppress(OSError):
                self.group.rmdir()


_SAMPLING_S = [0.0]  # this process's CPU spent in sample() so far: not the pool's


def sample(host: int, counter: TreeCounter) -> Sample:
    """The counters now. The pool's share is this process's CPU less what sample() itself took (two
    scans of every /proc entry per sample, 4 samples per round: ~10 ms per trajectory of 16 on a
    machine of ~500 processes, which the attributed rows counted as the pool's until issue 38)."""
    pool = own_cpu_s()
    tree = process_tree([host])
    helpers = [p for p in tree if b"mounthelper.py" in _cmdline(p)]
    helper_tree = process_tree(helpers) if helpers else []
    host_own = _own(host)
    total = counter.total_s()
    helper = cpu_seconds(helper_tree)
    machine = machine_busy_s()
    out = Sample(machine, {"pool": pool - _SAMPLING_S[0], "host server": host_own, "mount helper": helper,
                           "sandboxes and helpers": total - host_own - helper})
    _SAMPLING_S[0] += own_cpu_s() - pool
    return out


def perf_roots(host: int) -> dict[int, str]:
    """The trees perf attributes: the pool (this process), the host server, its mount helper."""
    helpers = [p for p in process_tree([host]) if b"mounthelper.py" in _cmdline(p)]
    return {os.getpid(): "pool", host: "host", **dict.fromkeys(helpers, "mount helper")}


def _own(pid: int) -> float:
    with open(f"/proc/{pid}/stat", "rb") as fh:
        f = fh.read().rsplit(b")", 1)[1].split()
    return (int(f[11]) + int(f[12])) / _CLK_TCK


@dataclass
class Tally:
    """CPU seconds per phase and part, summed over rounds; per-round machine CPU per trajectory."""

    by_phase: dict[str, dict[str, float]] = field(default_factory=lambda: {p: dict.fromkeys(PARTS, 0.0)
                                                                         for p in PHASES})
    per_round_ms: list[float] = field(default_factory=list)
    per_round_ours_ms: list[float] = field(default_factory=list)  # the pool and the host's tree only
    wall_s: float = 0.0
    trajectories: int = 0

    def add(self, phase: str, a: Sample, b: Sample) -> float:
        parts = {k: b.parts[k] - a.parts[k] for k in a.parts}
        machine = b.machine - a.machine
        parts["kernel and other"] = machine - sum(parts.values())
        for k, v in parts.items():
            self.by_phase[phase][k] += v
        return machine


async def run_variant(pool: Any, host: TreeCounter, name: str, calls: Callable[[Any], Awaitable[None]], rounds: int,
                      tally: Tally, perf: PerfTree | None = None) -> None:
    for r in range(rounds + 1):  # round 0 warms up (first sandboxes, first prestarts): not counted
        if r == 1 and perf is not None:
            perf.start(perf_roots(host.host))
        t0 = time.perf_counter()
        s0 = sample(host.host, host)
        leases = await asyncio.gather(*(pool.lease(f"{name}-{r}-{i}") for i in range(SLOTS)))
        s1 = sample(host.host, host)
        await asyncio.gather(*(calls(lease) for lease in leases))
        s2 = sample(host.host, host)
        await asyncio.gather(*(pool.release(lease) for lease in leases))
        await asyncio.sleep(0)  # let the releases' background work be scheduled before the sample
        s3 = sample(host.host, host)
        if not r:
            continue
        tally.wall_s += time.perf_counter() - t0
        tally.trajectories += SLOTS
        machine = tally.add("lease", s0, s1) + tally.add("calls", s1, s2) + tally.add("release", s2, s3)
        tally.per_round_ms.append(machine * 1e3 / SLOTS)
        ours = sum(s3.parts[k] - s0.parts[k] for k in s0.parts)
        tally.per_round_ours_ms.append(ours * 1e3 / SLOTS)


async def one_true(lease: Any) -> None:
    out = await lease.bash("true")
    assert out.exit_code == 0, out


async def ten_true(lease: Any) -> None:
    for _ in range(10):
        await one_true(lease)


FIRST_FILE_MS: list[float] = []  # wall time of each trajectory's first file-tool call (one_true_one_file)


async def one_true_one_file(lease: Any) -> None:
    """A trajectory that also uses a file tool (slotd serves it: before issue 37 the first file call
    handed the sandbox over to the Python supervisor on that call's path, docs/native-supervisor.md)."""
    await one_true(lease)
    t0 = time.perf_counter()
    out = await lease.call("write_file", {"path": "notes.txt", "content": "x"})
    FIRST_FILE_MS.append((time.perf_counter() - t0) * 1e3)
    assert out.ok, out


async def one_terminal(lease: Any) -> None:
    out = await lease.call("terminal", {"input": "true", "wait_ms": 2000})
    assert out.ok, out


def bwrap_floor(n: int) -> list[float]:
    """Machine CPU ms per bare ``bwrap ... true`` (a fresh sandbox with fresh namespaces)."""
    argv = ["bwrap", "--ro-bind", "/usr", "/usr", "--symlink", "usr/bin", "/bin", "--symlink", "usr/lib", "/lib",
            "--symlink", "usr/lib64", "/lib64", "--proc", "/proc", "--dev", "/dev", "--tmpfs", "/tmp",
            "--unshare-all", "--die-with-parent", "--new-session", "/bin/true"]
    out = []
    for _ in range(n):
        m0 = machine_busy_s()
        subprocess.run(argv, check=True)
        out.append((machine_busy_s() - m0) * 1e3)
    return out


def docker_per_trajectory(n: int) -> list[float]:
    """Machine CPU ms of a container per trajectory: run -d, one exec of true, rm -f."""
    out = []
    for _ in range(n):
        m0 = machine_busy_s()
        cid = subprocess.run(["docker", "run", "-d", "--rm", "--network", "none", "--entrypoint", "sleep",
                              DOCKER_IMAGE, "600"], check=True, capture_output=True, text=True).stdout.strip()
        subprocess.run(["docker", "exec", cid, "true"], check=True)
        subprocess.run(["docker", "rm", "-f", cid], check=True, capture_output=True)
        out.append((machine_busy_s() - m0) * 1e3)
    return out


async def run(quick: bool) -> ScenarioResult:
    rounds = 3 if quick else 12
    res = ScenarioResult(NAME, "one trajectory's slot cycle: machine CPU per trajectory (all processes)",
                         params={"hosts": 1, "slots_per_host": SLOTS, "concurrent_trajectories": SLOTS,
                                 "rounds": rounds})
    floor = bwrap_floor(10 if quick else 40)
    res.rows.append(Row("bare bwrap true (CPU ms per sandbox)", floor, baseline=True,
                        note="fresh namespaces, host /usr, no cgroup, no supervisor"))
    variants: list[tuple[str, Callable[[Any], Awaitable[None]], float | None]] = [
        ("lease, 1 x bash true, release", one_true, 20.0),
        ("lease, 10 x bash true, release", ten_true, None),
        ("lease, 1 x terminal, release", one_terminal, 40.0),
        # last: before issue 37 its leases needed the Python supervisor, which new sandboxes then
        # started with (host/supervisor_choice.py); kept last so figures compare with earlier runs
        ("lease, 1 x bash true + 1 x write_file, release", one_true_one_file, None),
    ]
    pool = local_pool(f"bench-cycle-{time.monotonic_ns() % 10**6}", 1, SLOTS)
    counter: TreeCounter | None = None
    try:
        await pool.start()
        (host_pid,) = host_pids(pool)
        host = counter = TreeCounter(host_pid)
        if counter.group is None:
            res.notes.append("no cpuacct cgroup here: the host's tree is counted from /proc (killed sandboxes "
                             "that no one reaped are missed)")
        no_perf = perf_tree.available() if os.environ.get("ATROPOS_BENCH_PERF", "1") != "0" else "turned off"
        if no_perf:
            res.notes.append(f"no breakdown by program: {no_perf}")
        for name, calls, target in variants:
            tally = Tally()
            perf = None if no_perf else PerfTree()
            sampling0 = _SAMPLING_S[0]
            try:
                await run_variant(pool, host, name.split(",")[1].strip().replace(" ", ""), calls, rounds, tally,
                                  perf)
                by_program = perf.stop() if perf is not None else {}
            finally:
                if perf is not None:
                    perf.close()
            row = Row(f"{name} (machine CPU ms per trajectory)", tally.per_round_ms,
                      throughput=tally.trajectories / tally.wall_s if tally.wall_s else None,
                      target=f"<= {target:g} ms" if target else "")
            if target:
                row.passed = row.p50 <= target
                res.targets.append(Target(f"{name}: <= {target:g} ms machine CPU per trajectory",
                                          f"p50 {row.p50:.1f} ms (p99 {row.p99:.1f}); "
                                          f"{row.throughput or 0:.1f} trajectories/s with {SLOTS} at a time",
                                          row.passed))
            res.rows.append(row)
            res.rows.append(Row(f"{name} (attributed CPU ms per trajectory: pool + host's tree)",
                                tally.per_round_ours_ms,
                                note="immune to other load; misses kernel threads' deferred work"))
            if calls is one_true_one_file and len(FIRST_FILE_MS) > SLOTS:  # round 0 (warm-up) not counted
                res.rows.append(Row("  its write_file call, wall ms (16 at a time)", FIRST_FILE_MS[SLOTS:],
                                    note="the first file tool of a lease (slotd serves it; before issue 37, a "
                                         "hand-over to the Python supervisor on this call's path)"))
                FIRST_FILE_MS.clear()
            per = tally.trajectories or 1
            for phase in PHASES:
                parts = tally.by_phase[phase]
                total = sum(parts.values())
                res.notes.append(f"{name} / {phase}: {total * 1e3 / per:.1f} ms per trajectory = "
                                 + ", ".join(f"{k} {v * 1e3 / per:.1f}" for k, v in parts.items()))
            res.notes.append(f"{name} / the benchmark's own /proc sampling: "
                             f"{(_SAMPLING_S[0] - sampling0) * 1e3 / ((rounds + 1) * SLOTS):.1f} ms per trajectory "
                             "(left out of the pool's share and the attributed rows; inside perf's 'pool')")
            if by_program:
                top = sorted(by_program.items(), key=lambda kv: -kv[1])
                shown = [(k, v) for k, v in top if v * 1e3 / per >= 0.3]
                res.notes.append(f"{name} / by program (perf, all phases): " + ", ".join(
                    f"{k} {v * 1e3 / per:.1f}" for k, v in shown) + f" ms per trajectory (total sampled "
                    f"{sum(by_program.values()) * 1e3 / per:.1f})")
    finally:
        await pool.stop()
        if counter is not None:
            counter.close()
        shutil.rmtree(BENCH_ROOT / "local" / pool.cfg.pool_id, ignore_errors=True)
    problem = docker_problem()
    if problem is None:
        res.rows.append(Row("docker run + exec true + rm (CPU ms per trajectory)",
                            docker_per_trajectory(3 if quick else 10), note="a container per trajectory"))
    else:
        res.notes.append(f"docker baseline not measured: {problem}")
    res.notes.append("'kernel and other' = machine CPU not attributed to the pool or the host's tree: kernel "
                     "work in interrupts and kernel threads (cgroup and namespace teardown), and any other load "
                     "on the machine (see the load average)")
    return res


if __name__ == "__main__":
    scenario_main(NAME, run)
