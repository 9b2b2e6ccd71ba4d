"""slot_occupancy: one trajectory's slot cycle against how full its host is (issue 38, item 1).

bubblewrap formats ``/proc/self/mountinfo`` once per bind it makes and copies the mount table of the
namespace it starts in: when every slot's mounts sat in one namespace, each sandbox start paid for
every other slot's (an image slot of 40 layers holds 45 mounts). Each slot's mounts now live in a
namespace of their own (host/workspace/mounthelper.py, SlotNamespace).

Measured on the local backend, 1 host x ``SLOTS`` slots: ``occupied`` other slots leased (each ran
one ``true``: their sandboxes are up and their mounts made), then cycles of one trajectory, one at a
time: lease + one ``bash true`` + release, on the default root and on a root of a ``DEEP_LAYERS``-layer
task image (tests/task_images.py ``deep``, built locally, no registry), the others on the same root.
Per cycle: wall ms, machine CPU ms (``/proc/stat``: every process and the kernel, so other load on a
shared machine lands here too) and attributed CPU ms (the pool and the host's whole tree, a cpuacct
cgroup: immune to other load; the targets are judged on it). Ratios are against the empty host of
the same root, and the image root against the default root, same occupancy, within the run.

Also reported: the mounts in the measured slot's own namespace and in all slots' namespaces together
(what one shared namespace would have held).
"""

from __future__ import annotations

import asyncio
import os
import shutil
import time
from typing import Any

from benchmarks import perf_tree
from benchmarks.common import (
    BENCH_ROOT,
    Row,
    ScenarioResult,
    Target,
    host_pids,
    local_pool,
    process_tree,
    scenario_main,
)
from benchmarks.perf_tree import PerfTree
from benchmarks.scenario_slot_cycle import TreeCounter, machine_busy_s, own_cpu_s, perf_roots

NAME = "slot_occupancy"
# SLOT_OCCUPANCY="0" (comma-separated) measures only those occupancies: a quick before/after of one
# change to the cycle itself (the image root against the default root) needs only the empty host.
OCCUPANCY = tuple(int(n) for n in os.environ.get("SLOT_OCCUPANCY", "0,16,48").split(","))
SLOTS = max(OCCUPANCY) + 2
# SLOT_OCCUPANCY_REPEATS=N: the cycles split in N blocks per occupancy, the occupancies alternating
# block by block (the others leased and released again each time): load drift hits each alike.
REPEATS = max(1, int(os.environ.get("SLOT_OCCUPANCY_REPEATS", "1")))


def _deep_image() -> tuple[str | None, str]:
    """The 40-layer task image (built here if the engine lacks it), or why not."""
    try:
        from tests.task_images import DEEP_LAYERS, TaskImageUnavailable, ensure
    except ImportError as exc:  # an installed package without the tests
        return None, f"tests/task_images.py not importable: {exc}"
    try:
        return ensure("deep").reference, f"{DEEP_LAYERS} layers"
    except (TaskImageUnavailable, RuntimeError, OSError) as exc:
        return None, str(exc)


def _mount_lines(host_pid: int, slot: int) -> tuple[int, int]:
    """(lines in slot ``slot``'s namespace, lines in every slot namespace and the helper's together)."""
    mine, total = 0, 0
    for pid in process_tree([host_pid]):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as fh:
                if b"mounthelper.py" not in fh.read():
                    continue
            with open(f"/proc/{pid}/stat") as fh:
                comm = fh.read().split("(", 1)[1].rsplit(")", 1)[0]
            with open(f"/proc/{pid}/mountinfo") as fh:
                n = sum(1 for _ in fh)
        except OSError:
            continue
        total += n
        if comm == f"slotns-{slot}":
            mine = n
    return mine, total


async def _settle(client: Any, timeout: float = 60.0) -> None:
    """Until every slot's sandbox runs (the host's prewarm after start and after the others'
    leases), or no more came up for 5 s (a prewarm that timed out on a loaded machine is not retried
    until that slot's next lease)."""
    deadline, best, since = time.monotonic() + timeout, -1, time.monotonic()
    while time.monotonic() < deadline:
        slots = await client.slots()
        running = sum(s.sandbox_running for s in slots)
        if running == len(slots):
            return
        if running > best:
            best, since = running, time.monotonic()
        elif time.monotonic() - since > 5.0:
            return
        await asyncio.sleep(0.1)


async def _health_cpu(client: Any, counter: TreeCounter, n: int = 10) -> dict[bool, float]:
    """CPU ms of the host's tree per health check, without and with the workspace mount count."""
    out = {}
    for mounts in (False, True):
        c0 = counter.total_s()
        for _ in range(n):
            await client.health(mounts=mounts)
        out[mounts] = (counter.total_s() - c0) * 1e3 / n
    return out


async def _cycles(pool: Any, counter: TreeCounter, image: str | None, n: int, tag: str, perf: PerfTree | None
                  ) -> tuple[list[float], list[float], list[float], int]:
    wall, machine, ours = [], [], []
    slot = -1
    for i in range(n + 1):  # cycle 0 warms up (the slot's namespace, its first sandbox)
        if i == 1 and perf is not None:
            perf.start(perf_roots(counter.host))
        m0, o0, t0 = machine_busy_s(), own_cpu_s() + counter.total_s(), time.perf_counter()
        lease = await pool.lease(f"{tag}-{i}", image=image)
        out = await lease.bash("true")
        assert out.exit_code == 0, out
        slot = lease.slot
        await pool.release(lease)
        await asyncio.sleep(0)
        t1 = time.perf_counter()
        # the release's prewarm runs on into the next cycle's window: one cycle's cost, on average
        m1, o1 = machine_busy_s(), own_cpu_s() + counter.total_s()
        if i:
            wall.append((t1 - t0) * 1e3)
            machine.append((m1 - m0) * 1e3)
            ours.append((o1 - o0) * 1e3)
    return wall, machine, ours, slot


async def run(quick: bool) -> ScenarioResult:
    cycles = 8 if quick else 30
    res = ScenarioResult(NAME, "slot cycle (lease + 1 bash true + release) by host occupancy, default and "
                               "deep image roots", params={"hosts": 1, "slots_per_host": SLOTS, "cycles": cycles,
                                                           "occupancy": list(OCCUPANCY),
                                                           "repeats": REPEATS})
    image, about = await asyncio.to_thread(_deep_image)
    roots: list[tuple[str, str | None]] = [("default root", None)]
    if image is None:
        res.notes.append(f"image rows not measured: {about}")
    else:
        roots.append((f"{about} image root", image))
    pool_id = f"bench-occ-{os.getpid() % 10**5}-{time.monotonic_ns() % 10**4}"
    # a store of this pool's own (inside its data dir, removed with it)
    pool = local_pool(pool_id, 1, SLOTS, {"image_store": BENCH_ROOT / "local" / pool_id / "images"},
                      health_timeout_s=60.0, health_failures=5)  # 50 slots prewarming on a loaded machine
    counter: TreeCounter | None = None
    by: dict[tuple[str, int], Row] = {}
    done = False
    try:
        await pool.start()
        (host_pid,) = host_pids(pool)
        await _settle(next(iter(pool.hosts.values())).client, 300.0)  # the host's first prewarm
        counter = TreeCounter(host_pid)
        if counter.group is None:
            res.notes.append("no cpuacct cgroup: the host's tree is counted from /proc")
        no_perf = perf_tree.available() if os.environ.get("ATROPOS_BENCH_PERF", "1") != "0" else "turned off"
        if no_perf:
            res.notes.append(f"no breakdown by program: {no_perf}")
        client = next(iter(pool.hosts.values())).client

        async def block(root: str, ref: str | None, occupied: int, n: int, rep: int) -> dict[str, Any]:
            """``occupied`` other slots leased (each ran a ``true``), then ``n`` measured cycles."""
            others = [await pool.lease(f"other-{root[:5]}-{occupied}-{rep}-{i}", image=ref) for i in range(occupied)]
            try:
                for lease in others:
                    await lease.bash("true")
                await _settle(client, 300.0)
                perf = None if no_perf or rep or occupied not in (0, max(OCCUPANCY)) else PerfTree()
                try:
                    wall, machine, ours, slot = await _cycles(pool, counter, ref, n, f"c{occupied}-{rep}", perf)
                    by_program = perf.stop() if perf is not None else {}
                finally:
                    if perf is not None:
                        perf.close()
                mine, total = _mount_lines(host_pid, slot)
                health = await _health_cpu(client, counter) if not rep else {}
            finally:
                await asyncio.gather(*(pool.release(lease) for lease in others))
            return {"wall": wall, "machine": machine, "ours": ours, "by_program": by_program, "mine": mine,
                    "total": total, "health": health}

        per_block = max(1, cycles // REPEATS)
        for root, ref in roots:
            got: dict[int, dict[str, Any]] = {}
            # REPEATS > 1: the occupancies alternate in blocks, so a change of the machine's load
            # lands on each alike (8 cycles at load 30 read 1.05x and 1.34x in two runs)
            for rep in range(REPEATS):
                for occupied in OCCUPANCY:
                    b = await block(root, ref, occupied, per_block, rep)
                    if occupied not in got:
                        got[occupied] = b
                    else:
                        for key in ("wall", "machine", "ours"):
                            got[occupied][key] += b[key]
            for occupied in OCCUPANCY:
                b = got[occupied]
                n = len(b["ours"])
                if b["by_program"]:
                    top = sorted(b["by_program"].items(), key=lambda kv: -kv[1])
                    res.notes.append(f"{root}, {occupied} other slots / by program (perf, ms per cycle, first "
                                     "block): " + ", ".join(f"{k} {v * 1e3 / per_block:.1f}" for k, v in top
                                                           if v * 1e3 / per_block >= 0.3)
                                     + f" (total sampled {sum(b['by_program'].values()) * 1e3 / per_block:.1f})")
                label = f"{root}, {occupied} other slots leased"
                health = b["health"]
                res.notes.append(f"{label}: the host's health check, CPU ms of the host's tree per check: "
                                 f"{health[False]:.1f} as the pool asks it, {health[True]:.1f} with the mount count "
                                 "(every slot namespace's mount table read; the pool's check did that every 2 s "
                                 "before issue 38)")
                row = Row(f"{label} (attributed CPU ms)", b["ours"], baseline=(occupied == 0 and ref is None),
                          base=f"{root}, 0 other slots leased (attributed CPU ms)" if occupied else None,
                          note=f"pool + host tree; {n} cycles in {REPEATS} block(s); mounts: {b['mine']} in the "
                               f"slot's namespace, {b['total']} in all namespaces together")
                by[(root, occupied)] = row
                res.rows.append(row)
                res.rows.append(Row(f"{label} (machine CPU ms)", b["machine"],
                                    base=f"{root}, 0 other slots leased (machine CPU ms)",
                                    note="every process on the machine: other load lands here"))
                res.rows.append(Row(f"{label} (wall ms)", b["wall"], base=f"{root}, 0 other slots leased (wall ms)"))
        done = True
    finally:
        await pool.stop()
        if counter is not None:
            counter.close()
        if done:  # else the host's log stays for the error's reader
            shutil.rmtree(BENCH_ROOT / "local" / pool.cfg.pool_id, ignore_errors=True)
    for root, _ in roots:
        empty, full = by.get((root, 0)), by.get((root, max(OCCUPANCY)))
        if empty is not None and full is not None and empty.samples_ms and full.samples_ms:
            ratio = full.p50 / empty.p50
            res.targets.append(Target(f"{root}: cycle with {max(OCCUPANCY)} other slots <= 1.1x the empty host's",
                                      f"{ratio:.2f}x (p50 {full.p50:.1f} vs {empty.p50:.1f} ms attributed CPU)",
                                      ratio <= 1.1))
    if len(roots) > 1:
        for occupied in OCCUPANCY:
            d, i = by.get((roots[0][0], occupied)), by.get((roots[1][0], occupied))
            if d is not None and i is not None and d.samples_ms and i.samples_ms:
                ratio = i.p50 / d.p50
                res.targets.append(Target(f"image root <= 1.2x the default root ({occupied} other slots)",
                                          f"{ratio:.2f}x (p50 {i.p50:.1f} vs {d.p50:.1f} ms attributed CPU)",
                                          ratio <= 1.2))
    return res


if __name__ == "__main__":
    scenario_main(NAME, run)
