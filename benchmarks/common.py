"""Shared helpers of the benchmarks: timing loops, percentiles, the result model, tables, machine
info, process-tree accounting, a real sandbox host process, JSON and PNG output.

Every timing is wall-clock ``time.perf_counter()`` in milliseconds. Percentiles interpolate
linearly between the two nearest samples (numpy's default), so a p99 over fewer than 100 samples is
close to the maximum: read it together with ``n``.
"""

from __future__ import annotations

import argparse
import asyncio
import inspect
import json
import logging
import math
import os
import platform
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
BENCH_ROOT = Path(tempfile.gettempdir()) / "atropos-bench"
DOCKER_IMAGE = os.environ.get("ATROPOS_SANDBOX_IMAGE", "atropos-sandbox:dev")
BENCH_LABEL = "io.atropos-sandbox.bench"

Fn = Callable[[], Any]  # sync or async, no arguments


# -- statistics ------------------------------------------------------------------------------
def percentile(samples: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) with linear interpolation; NaN for no samples."""
    if not samples:
        return math.nan
    xs = sorted(samples)
    if len(xs) == 1:
        return xs[0]
    pos = (len(xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def summarize(samples: Sequence[float]) -> dict[str, float]:
    if not samples:
        return {"n": 0}
    return {
        "n": len(samples), "mean": sum(samples) / len(samples), "min": min(samples),
        "p50": percentile(samples, 50), "p90": percentile(samples, 90), "p99": percentile(samples, 99),
        "max": max(samples),
    }


# -- timing loops ----------------------------------------------------------------------------
async def _call(fn: Fn) -> Any:
    result = fn()
    if inspect.isawaitable(result):
        result = await result
    return result


async def time_calls(fn: Fn, n: int, warmup: int = 5) -> list[float]:
    """Run ``fn`` ``warmup`` times untimed, then ``n`` times timed; returns milliseconds."""
    for _ in range(warmup):
        await _call(fn)
    out: list[float] = []
    for _ in range(n):
        t0 = time.perf_counter()
        await _call(fn)
        out.append((time.perf_counter() - t0) * 1e3)
    return out


async def time_interleaved(variants: dict[str, tuple[Fn, int]], warmup: int = 5,
                           rounds: int = 10) -> dict[str, list[float]]:
    """Time several variants in alternating chunks so that a load change on a shared machine
    hits every variant alike (instead of whichever happened to run during it)."""
    for fn, _ in variants.values():
        for _ in range(warmup):
            await _call(fn)
    out: dict[str, list[float]] = {name: [] for name in variants}
    for r in range(rounds):
        for name, (fn, n) in variants.items():
            chunk = n // rounds + (1 if r < n % rounds else 0)
            out[name] += await time_calls(fn, chunk, warmup=0)
    return out


# -- result model ----------------------------------------------------------------------------
@dataclass
class Row:
    """One variant of a scenario: latency samples (ms) and/or a single value."""

    name: str
    samples_ms: list[float] = field(default_factory=list, repr=False)
    throughput: float | None = None  # operations per second
    value: float | None = None  # for rows that are one number (memory), in ``unit``
    unit: str = ""
    baseline: bool = False
    target: str = ""
    passed: bool | None = None  # None: no target on this row (or not measurable)
    note: str = ""
    extra: dict[str, Any] = field(default_factory=dict)
    n: int | None = None  # defaults to len(samples_ms)
    base: str | None = None  # name of the row its ``x base`` ratio divides by (default: the baseline row)

    @property
    def count(self) -> int:
        return self.n if self.n is not None else len(self.samples_ms)

    @property
    def p50(self) -> float:
        return percentile(self.samples_ms, 50)

    @property
    def p99(self) -> float:
        return percentile(self.samples_ms, 99)

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name, "n": self.count, "latency_ms": summarize(self.samples_ms),
            "throughput_per_s": self.throughput, "value": self.value, "unit": self.unit,
            "baseline": self.baseline, "target": self.target or None, "passed": self.passed,
            "note": self.note or None, "extra": self.extra, "ratio_base": self.base,
        }


@dataclass
class Target:
    what: str
    measured: str
    passed: bool | None  # None: could not be measured here (e.g. no Docker engine)


@dataclass
class ScenarioResult:
    name: str
    title: str
    rows: list[Row] = field(default_factory=list)
    targets: list[Target] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    params: dict[str, Any] = field(default_factory=dict)
    skipped: str | None = None
    error: str | None = None
    load_before: tuple[float, float, float] | None = None
    load_after: tuple[float, float, float] | None = None
    duration_s: float = 0.0

    def row(self, name: str) -> Row | None:
        return next((r for r in self.rows if r.name == name), None)

    @property
    def baseline(self) -> Row | None:
        return next((r for r in self.rows if r.baseline and r.samples_ms), None)

    def ratio(self, row: Row) -> float | None:
        base = self.row(row.base) if row.base else self.baseline
        if base is None or not row.samples_ms or not base.p50:
            return None
        return row.p50 / base.p50

    @property
    def passed(self) -> bool | None:
        verdicts = [t.passed for t in self.targets if t.passed is not None]
        return None if not verdicts else all(verdicts)

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name, "title": self.title, "params": self.params, "skipped": self.skipped,
            "error": self.error, "load_before": self.load_before, "load_after": self.load_after,
            "duration_s": round(self.duration_s, 2),
            "baseline": None if self.baseline is None else self.baseline.name,
            "rows": [dict(r.to_json(), ratio_vs_baseline=self.ratio(r)) for r in self.rows],
            "targets": [{"what": t.what, "measured": t.measured, "passed": t.passed} for t in self.targets],
            "passed": self.passed, "notes": self.notes,
        }


def verdict(passed: bool | None) -> str:
    return {True: "PASS", False: "MISS", None: "n/a"}[passed]


# -- machine ---------------------------------------------------------------------------------
def load_avg() -> tuple[float, float, float]:
    one, five, fifteen = os.getloadavg()
    return (round(one, 2), round(five, 2), round(fifteen, 2))


def machine_info() -> dict[str, Any]:
    cpu = "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem_kib = 0
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                mem_kib = int(line.split()[1])
    except OSError:
        pass
    return {
        "cpu_model": cpu, "cores": os.cpu_count(), "kernel": platform.release(),
        "python": platform.python_version(), "mem_gib": round(mem_kib / 2**20, 1),
        "loadavg": load_avg(), "uid": os.geteuid(), "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


def machine_line(info: dict[str, Any] | None = None) -> str:
    m = info or machine_info()
    la = m["loadavg"]
    return (f"machine: {m['cpu_model']}, {m['cores']} cores, {m['mem_gib']} GiB, kernel {m['kernel']}, "
            f"python {m['python']}, load average {la[0]} {la[1]} {la[2]}")


# -- processes -------------------------------------------------------------------------------
_CLK_TCK = os.sysconf("SC_CLK_TCK")


def _stat_fields(pid: int) -> list[bytes] | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            return fh.read().rsplit(b")", 1)[1].split()
    except (OSError, IndexError):
        return None


def process_tree(root_pids: Sequence[int]) -> list[int]:
    """The given pids and every live descendant (by parent pid, read from /proc)."""
    children: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        fields = _stat_fields(int(name))
        if fields is None:
            continue
        children.setdefault(int(fields[1]), []).append(int(name))
    out: list[int] = []
    todo = [p for p in root_pids if _stat_fields(p) is not None]
    seen: set[int] = set()
    while todo:
        pid = todo.pop()
        if pid in seen:
            continue
        seen.add(pid)
        out.append(pid)
        todo.extend(children.get(pid, []))
    return out


def cpu_seconds(pids: Sequence[int]) -> float:
    """utime+stime of the processes plus that of their waited-for children (cutime+cstime)."""
    total = 0
    for pid in pids:
        f = _stat_fields(pid)
        if f is not None:
            total += int(f[11]) + int(f[12]) + int(f[13]) + int(f[14])
    return total / _CLK_TCK


def own_cpu_seconds(pid: int) -> float | None:
    """utime+stime of one process (its threads, not its children); None when it is gone."""
    f = _stat_fields(pid)
    return None if f is None else (int(f[11]) + int(f[12])) / _CLK_TCK


def rss_kib(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def pss_kib(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith("Pss:"):
                return int(line.split()[1])
    except (OSError, PermissionError):
        pass
    return 0


# -- a real sandbox host (as tests/conftest.py's start_host) -----------------------------------
@dataclass
class RunningHost:
    address: str
    token: str
    proc: subprocess.Popen[bytes]
    data_dir: Path

    def client(self, **kw: Any) -> Any:
        from atropos.sandbox.contract.client import HostClient

        return HostClient(self.address, self.token, **kw)

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        shutil.rmtree(self.data_dir, ignore_errors=True)


BASELINE_TREE_ENV = "ATROPOS_BENCH_BASELINE_TREE"


def baseline_tree() -> Path | None:
    """Another revision's source tree (e.g. ``git archive <rev> | tar -x -C DIR``) to time beside this
    one in the same run, from $ATROPOS_BENCH_BASELINE_TREE; None when unset."""
    value = os.environ.get(BASELINE_TREE_ENV)
    return Path(value).resolve() if value else None


def tree_env(tree: Path, env: dict[str, str]) -> dict[str, str]:
    """``env`` for a process (and its children) that imports ``atropos`` from ``tree``."""
    return env if tree == REPO else {**env, "PYTHONPATH": str(tree)}


def start_host(data_dir: Path, slots: int = 8, extra: list[str] | None = None, tree: Path = REPO) -> RunningHost:
    """Start ``python -m atropos.sandbox`` (from ``tree``) and wait for its ready line (blocking)."""
    token = secrets.token_urlsafe(16)
    env = tree_env(tree, {**os.environ, "ATROPOS_SANDBOX_TOKEN": token})
    proc = subprocess.Popen(
        [sys.executable, "-m", "atropos.sandbox", "--port", "0", "--slots", str(slots),
         "--data-dir", str(data_dir), "--log-level", "WARNING", *(extra or [])],
        stdout=subprocess.PIPE, env=env, cwd=tree,
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if not line:
        proc.wait(10)
        raise RuntimeError(f"sandbox host failed to start (exit {proc.returncode})")
    ready = json.loads(line)
    return RunningHost(f"http://127.0.0.1:{ready['port']}", token, proc, data_dir)


def bench_dir(name: str) -> Path:
    """A fresh scratch directory for one scenario run (removed by the caller)."""
    d = BENCH_ROOT / f"{name}-{os.getpid()}-{secrets.token_hex(3)}"
    d.mkdir(parents=True, exist_ok=True)
    os.chmod(BENCH_ROOT, 0o711)
    os.chmod(d, 0o711)
    return d


def backend_pool(kind: str, pool_id: str, hosts: int, slots_per_host: int,
                 backend_kw: dict[str, Any] | None = None, **pool_kw: Any) -> Any:
    """A SlotPool with exactly ``hosts`` hosts (min = max) on a backend built as the CLI and AgentEnv
    build it (atropos.backends.config); ``backend_kw`` sets any other field of that backend's config."""
    from atropos.backends.config import BackendSettings, build_backend
    from atropos.slots.config import PoolConfig
    from atropos.slots.pool import SlotPool

    backend = build_backend(BackendSettings(kind=kind, pool_id=pool_id, slots_per_host=slots_per_host,
                                            image=DOCKER_IMAGE), **(backend_kw or {}))
    cfg = PoolConfig(pool_id=pool_id, min_hosts=hosts, max_hosts=hosts, **pool_kw)
    return SlotPool(backend, cfg)


def local_pool(pool_id: str, hosts: int, slots_per_host: int, backend_kw: dict[str, Any] | None = None,
               **pool_kw: Any) -> Any:
    """A SlotPool on the local backend with exactly ``hosts`` hosts (min = max)."""
    kw = {"data_root": BENCH_ROOT / "local", "max_timeout_s": 120, **(backend_kw or {})}
    return backend_pool("local", pool_id, hosts, slots_per_host, kw, **pool_kw)


def docker_pool(pool_id: str, hosts: int, slots_per_host: int, backend_kw: dict[str, Any] | None = None,
                **pool_kw: Any) -> Any:
    """A SlotPool on the Docker backend (image DOCKER_IMAGE) with exactly ``hosts`` hosts (min = max).
    Raises ConfigError without the docker SDK."""
    return backend_pool("docker", pool_id, hosts, slots_per_host, backend_kw, **pool_kw)


async def lease_first_true(pool: Any, tid: str, image: str | None, *, reset: bool = False) -> tuple[float, float]:
    """(lease ms, lease + first ``true`` ms) of ``pool.lease(tid, image=image)`` and its first bash
    ``true`` (on any backend: the image scenarios' first-call rows); the slot is released after,
    untimed. ``reset``: a default-root lease reset once more before its call (a fresh sandbox with
    no prewarm finished, as an image lease's first call finds it)."""
    t0 = time.perf_counter()
    lease = await pool.lease(tid, image=image)
    if reset:
        await lease.reset()
    t1 = time.perf_counter()
    try:
        out = await lease.bash("true")
        t2 = time.perf_counter()
        assert out.exit_code == 0, out
    finally:
        await pool.release(lease)
    return (t1 - t0) * 1e3, (t2 - t0) * 1e3


def host_pids(pool: Any) -> list[int]:
    """Pids of a local-backend pool's host processes."""
    pids = []
    for host_id in pool.hosts:
        pid = pool.backend.pid(host_id)
        if pid is not None:
            pids.append(pid)
    return pids


# -- docker ----------------------------------------------------------------------------------
def docker_problem(image: str | None = DOCKER_IMAGE) -> str | None:
    """Why Docker cannot be benchmarked here, or None when an engine and the image (if any) exist."""
    if shutil.which("docker") is None:
        return "no engine (docker CLI not installed)"
    try:
        info = subprocess.run(["docker", "info"], capture_output=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"no engine ({exc})"
    if info.returncode != 0:
        return "no engine (`docker info` failed)"
    if image is None:
        return None
    img = subprocess.run(["docker", "image", "inspect", image], capture_output=True, timeout=20)
    if img.returncode != 0:
        return f"no image {image} (scripts/build_image.sh builds it)"
    return None


# -- output ----------------------------------------------------------------------------------
def _fmt(x: float | None, digits: int = 2) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    if abs(x) >= 1000:
        return f"{x:,.0f}"
    if abs(x) >= 100:
        return f"{x:.1f}"
    return f"{x:.{digits}f}"


def format_table(res: ScenarioResult) -> str:
    lines = []
    la0 = " ".join(str(x) for x in res.load_before) if res.load_before else "?"
    la1 = " ".join(str(x) for x in res.load_after) if res.load_after else "?"
    lines.append(f"== {res.name}: {res.title}")
    lines.append(f"   load average (1/5/15 min) before: {la0}   after: {la1}   took {res.duration_s:.1f}s")
    if res.params:
        lines.append("   params: " + ", ".join(f"{k}={v}" for k, v in res.params.items()))
    if res.skipped:
        lines.append(f"   skipped: {res.skipped}")
    if res.error:
        lines.append(f"   ERROR: {res.error}")
    if res.rows:
        has_value = any(r.value is not None for r in res.rows)
        has_tp = any(r.throughput is not None for r in res.rows)
        has_lat = any(r.samples_ms for r in res.rows)
        header = ["variant", "n"]
        if has_lat:
            header += ["p50 ms", "p99 ms"]
        if has_value:
            header += ["value", "unit"]
        if has_tp:
            header += ["per s"]
        if res.baseline is not None:
            header += ["x base"]
        header += ["target", "verdict"]
        table = [header]
        for r in res.rows:
            cells = [r.name + (" [baseline]" if r.baseline else ""), str(r.count)]
            if has_lat:
                cells += [_fmt(r.p50 if r.samples_ms else None), _fmt(r.p99 if r.samples_ms else None)]
            if has_value:
                cells += [_fmt(r.value), r.unit]
            if has_tp:
                cells += [_fmt(r.throughput, 0)]
            if res.baseline is not None:
                ratio = res.ratio(r)
                cells += ["-" if ratio is None else f"{ratio:.2f}x"]
            cells += [r.target or "", "" if r.passed is None and not r.target else verdict(r.passed)]
            table.append(cells)
        widths = [max(len(row[i]) for row in table) for i in range(len(header))]
        left = {0, len(header) - 2, len(header) - 1}
        for j, row in enumerate(table):
            cells = [c.ljust(widths[i]) if i in left else c.rjust(widths[i]) for i, c in enumerate(row)]
            lines.append("   " + "  ".join(cells).rstrip())
            if j == 0:
                lines.append("   " + "  ".join("-" * w for w in widths))
        for r in res.rows:
            if r.note:
                lines.append(f"   * {r.name}: {r.note}")
    for t in res.targets:
        lines.append(f"   [{verdict(t.passed)}] {t.what}: {t.measured}")
    for note in res.notes:
        lines.append(f"   note: {note}")
    return "\n".join(lines)


def write_json(results: Sequence[ScenarioResult], path: Path, machine: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    body = {"machine": machine, "scenarios": [r.to_json() for r in results]}
    path.write_text(json.dumps(body, indent=2, default=str) + "\n")


def write_png(results: Sequence[ScenarioResult], path: Path, machine: dict[str, Any]) -> bool:
    """One panel per scenario: latency distributions (box = p25..p75, whiskers p1..p99, dot = p50)
    on a log axis, or bars for single-value rows. Returns False when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    panels: list[tuple[ScenarioResult, list[Row], bool]] = []  # (scenario, rows, latency?)
    for res in results:
        lat_rows = [r for r in res.rows if r.samples_ms]
        val_rows = [r for r in res.rows if r.value is not None and not r.samples_ms]
        if val_rows:
            panels.append((res, val_rows, False))
        if lat_rows:
            panels.append((res, lat_rows, True))
    if not panels:
        return False
    heights = [max(1.6, 0.45 * len(rows) + 1.0) for _, rows, _ in panels]
    fig, axes = plt.subplots(len(panels), 1, figsize=(11, sum(heights)),
                             gridspec_kw={"height_ratios": heights}, squeeze=False)
    for ax, (res, rows, latency) in zip(axes[:, 0], panels, strict=True):
        la = " ".join(str(x) for x in res.load_before) if res.load_before else "?"
        title = f"{res.name} — {res.title}  (load {la}; {verdict(res.passed)})"
        if latency:
            ax.boxplot([r.samples_ms for r in rows], vert=False, whis=(1, 99), showfliers=False, widths=0.6)
            ax.scatter([r.p50 for r in rows], range(1, len(rows) + 1), color="tab:red", zorder=3, s=12)
            ax.scatter([r.p99 for r in rows], range(1, len(rows) + 1), color="tab:orange", marker="|",
                       zorder=3, s=80)
            ax.set_yticks(range(1, len(rows) + 1), [f"{r.name} (n={r.count})" for r in rows], fontsize=8)
            ax.set_xscale("log")
            ax.set_xlabel("ms (log; box p25-p75, whiskers to the last sample inside p1-p99, red dot p50, "
                          "orange tick p99)", fontsize=8)
            ax.invert_yaxis()
        else:
            values = [max(r.value or 0.0, 1e-3) for r in rows]
            colors = ["tab:green" if r.passed else "tab:red" if r.passed is False else "tab:gray" for r in rows]
            ax.barh(range(len(rows)), values, color=colors)
            for i, (r, v) in enumerate(zip(rows, values, strict=True)):
                ax.text(v, i, f" {_fmt(r.value)} {r.unit}", va="center", fontsize=8)
            ax.set_yticks(range(len(rows)), [f"{r.name} ({r.unit})" for r in rows], fontsize=8)
            ax.set_xscale("log")
            ax.set_xlim(left=min(values) / 3, right=max(values) * 20)
            ax.invert_yaxis()
        ax.set_title(title, fontsize=9, loc="left")
        ax.grid(axis="x", alpha=0.3, which="both")
    fig.suptitle(machine_line(machine), fontsize=8, y=0.998)
    fig.tight_layout(rect=(0, 0, 1, 1 - 0.25 / sum(heights)))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


# -- running one scenario --------------------------------------------------------------------
ScenarioFn = Callable[[bool], Coroutine[Any, Any, ScenarioResult]]


def run_scenario(name: str, fn: ScenarioFn, quick: bool) -> ScenarioResult:
    """Run one scenario in its own event loop, recording load and duration; never raises."""
    before = load_avg()
    t0 = time.perf_counter()
    try:
        res = asyncio.run(fn(quick))
    except Exception as exc:  # a crashed scenario is reported, the others still run
        import traceback

        traceback.print_exc()
        res = ScenarioResult(name=name, title="crashed", error=f"{type(exc).__name__}: {exc}")
    res.load_before = before
    res.load_after = load_avg()
    res.duration_s = time.perf_counter() - t0
    return res


def setup_logging(verbose: bool) -> None:
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")


def scenario_main(name: str, fn: ScenarioFn) -> None:
    """``python -m benchmarks.scenario_<name> [--quick] [--json F] [--png F]``."""
    p = argparse.ArgumentParser(prog=f"python -m benchmarks.scenario_{name}")
    p.add_argument("--quick", action="store_true", help="fewer iterations (a smoke run)")
    p.add_argument("--json", type=Path, help="write the result as JSON here")
    p.add_argument("--png", type=Path, help="write a latency chart here")
    p.add_argument("-v", "--verbose", action="store_true", help="show the product's INFO logs")
    args = p.parse_args()
    setup_logging(args.verbose)
    machine = machine_info()
    print(machine_line(machine), flush=True)
    res = run_scenario(name, fn, args.quick)
    print(format_table(res), flush=True)
    if args.json:
        write_json([res], args.json, machine)
    if args.png:
        write_png([res], args.png, machine)
    sys.exit(1 if res.error else 0)
