"""fork: a prepared workspace (a real virtualenv, ~50,000 files / ~500 MB) forked into 16 slots.

Local backend, 1 host x 16 slots. The template is built once: a copy of this benchmark's own
virtualenv (``sys.prefix``; top-level site-packages entries in name order while they fit in
500 MB) plus small generated source files up to 50,000 files; it is uploaded to the pool as a tar
stream (``pool.upload_template``). Then:

* fork x16: ``pool.lease_many(16 ids, template=...)`` timed end to end (lease + 16 copy-on-write
  forks + their verification), from a warm idle pool (every free slot's sandbox prewarmed, as
  between groups in training; the forks kill those), then released outside the timed region
  and the host left to prewarm again; the first round also
  checks that a write in one fork is invisible in another and that a fork sees every file.
  The host-side share is each fork's ``ResetResult.duration_ms`` (the pool's ``HostClient.reset``
  is wrapped on the instance; benchmark-side instrumentation only).
* disk per idle fork: what the slots hold before and after one round of 16 forks, divided by 16,
  measured where the forks' layers are: the used bytes of every tmpfs mounted under the host's
  ``slots/`` in the workspace mount namespaces (read through each slot namespace's ``/proc/PID/root``;
  each slot's upper layer lives there) plus the allocated blocks under ``slots/`` on disk. The
  measurement checks itself: 20 MB written into one fork must show up as >= 19 MB more.
* reset of a fork that wrote 1,000 files: one leased fork; each iteration fills it with one bash
  call (1,000 new files, appends to 20 template files, deletes a template directory; the call
  first checks the previous reset left no trace) and times ``lease.reset(template)``: host side and
  end to end.

Baseline in the same run: ``cp -a`` of the same tree into a fresh directory, 16 times in a row
(2 with ``--quick``, total extrapolated), each copy's disk use, copies removed outside the timing.

Targets (docs/targets.md): fork into 16 slots < 250 ms total, disk growth per idle
fork <= 1 MiB, reset of a 1,000-file slot p99 < 20 ms, verified.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from benchmarks.common import (
    BENCH_ROOT,
    Row,
    ScenarioResult,
    Target,
    bench_dir,
    local_pool,
    process_tree,
    scenario_main,
)

NAME = "fork"
SLOTS = 16
FILL = ('test -e w && echo DIRTY; test -e {probe} || echo DIRTY; '
        "mkdir w && for i in $(seq 1000); do echo $i > w/f$i; done; "
        "for f in $(find {appends} -type f | head -20); do echo x >> $f; done; rm -rf {delete}; ls w | wc -l")


def _size(path: Path) -> tuple[int, int]:
    """(regular files, bytes) under path (or of path itself), not following symlinks."""
    if not path.is_dir() or path.is_symlink():
        st = os.lstat(path)
        return (1, st.st_size) if path.is_file() and not path.is_symlink() else (0, 0)
    files = size = 0
    for dirpath, _dirs, names in os.walk(path):
        for name in names:
            st = os.lstat(os.path.join(dirpath, name))
            if not os.path.islink(os.path.join(dirpath, name)):
                files += 1
                size += st.st_size
    return files, size


def _blocks(path: Path) -> int:
    """Allocated bytes of everything (directories too) under path."""
    total = os.lstat(path).st_blocks * 512
    for dirpath, dirs, names in os.walk(path):
        for name in dirs + names:
            total += os.lstat(os.path.join(dirpath, name)).st_blocks * 512
    return total


def build_tree(dst: Path, target_files: int, target_bytes: int) -> tuple[int, int, str]:
    """A copy of this interpreter's virtualenv (site-packages trimmed to the byte budget), topped
    up with small generated source files to the file count. Returns (files, bytes, description)."""
    venv = Path(sys.prefix)
    sites = sorted(venv.glob("lib/python*/site-packages"))
    if sys.prefix == sys.base_prefix or not sites:
        raise RuntimeError("run the benchmark from a virtualenv: its site-packages is the template")
    site = sites[0]
    dst.mkdir(parents=True)
    for entry in sorted(venv.iterdir()):
        if entry.name != "lib":
            subprocess.run(["cp", "-a", str(entry), str(dst)], check=True)
    dst_site = dst / site.relative_to(venv)
    dst_site.mkdir(parents=True)
    files, size = _size(dst)
    kept = skipped = 0
    for entry in sorted(site.iterdir(), key=lambda p: p.name):
        f, b = _size(entry)
        if size + b > target_bytes:
            skipped += 1
            continue
        subprocess.run(["cp", "-a", str(entry), str(dst_site)], check=True)
        files, size, kept = files + f, size + b, kept + 1
    generated = 0
    body = "".join(f"def f{i}(x):\n    return x * {i}  # generated filler\n" for i in range(30)).encode()
    while files < target_files:
        d = dst / "src" / f"pkg{generated // 500:03d}"
        d.mkdir(parents=True, exist_ok=True)
        (d / f"mod{generated % 500:03d}.py").write_bytes(body)
        files, size, generated = files + 1, size + len(body), generated + 1
    what = (f"virtualenv {venv} ({kept} site-packages entries, {skipped} left out for the size budget) "
            f"+ {generated} generated .py files")
    return files, size, what


async def _settle(client: Any, timeout: float = 30.0) -> None:
    """Wait until every slot's sandbox is running again after the releases (prewarm done)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if all(s.sandbox_running for s in await client.slots()):
            break
        await asyncio.sleep(0.05)
    await asyncio.sleep(0.2)


async def _tar_stream(path: Path) -> AsyncIterator[bytes]:
    proc = await asyncio.create_subprocess_exec("tar", "-c", "-f", "-", "-C", str(path), ".",
                                                stdout=asyncio.subprocess.PIPE)
    assert proc.stdout is not None
    while chunk := await proc.stdout.read(1 << 20):
        yield chunk
    if await proc.wait() != 0:
        raise RuntimeError("tar of the template failed")


def _helper_pids(host_pid: int) -> list[int]:
    """The host's workspace mount helper and its forks (each slot's mount namespace holds that
    slot's layers)."""
    found = []
    for pid in process_tree([host_pid]):
        try:
            if b"mounthelper" in Path(f"/proc/{pid}/cmdline").read_bytes():
                found.append(pid)
        except OSError:
            continue
    return found


def _slot_bytes(slots_dir: Path, host_pid: int | None) -> int:
    """Bytes the slots hold: used bytes of the tmpfs mounts under ``slots_dir`` inside the workspace
    namespaces (upper layers, capped workspaces), plus blocks allocated under it on disk."""
    from atropos.sandbox.host.workspace.mountns import read_mountinfo

    total = _blocks(slots_dir)
    prefix = os.path.realpath(slots_dir) + "/"
    seen = set()
    for helper in [] if host_pid is None else _helper_pids(host_pid):
        try:
            mounts = read_mountinfo(helper)
        except OSError:  # a fork that came and went
            continue
        for mount in mounts:
            if mount.fstype == "tmpfs" and mount.mountpoint.startswith(prefix) and mount.mountpoint not in seen:
                seen.add(mount.mountpoint)
                st = os.statvfs(f"/proc/{helper}/root{mount.mountpoint}")
                total += (st.f_blocks - st.f_bfree) * st.f_frsize
    return total


async def run(quick: bool) -> ScenarioResult:
    target_files, target_bytes = (10_000, 100 * 10**6) if quick else (50_000, 500 * 10**6)
    rounds = 3 if quick else 12
    n_resets = 20 if quick else 150
    copies = 2 if quick else SLOTS
    budget = 40.0 if quick else 120.0
    res = ScenarioResult(NAME, f"fork a prepared virtualenv (~{target_files:,} files / {target_bytes // 10**6} MB"
                               f"{', quick' if quick else ''}) into 16 copy-on-write slots; reset of a fork",
                         params={"hosts": 1, "slots_per_host": SLOTS, "rounds": rounds, "resets_max": n_resets,
                                 "cp_copies": copies, "target_files": target_files, "target_bytes": target_bytes})
    root = bench_dir(NAME)
    src = root / "template"
    t0 = time.perf_counter()
    files, size, what = await asyncio.to_thread(build_tree, src, target_files, target_bytes)
    res.notes.append(f"template: {files:,} files, {size / 1e6:.0f} MB: {what}; built in "
                     f"{time.perf_counter() - t0:.1f}s")
    pool = local_pool(f"bench-fork-{time.monotonic_ns() % 10**6}", 1, SLOTS)
    await pool.start()
    fork_ms: list[float] = []
    host_fork_ms: list[float] = []
    reset_host: list[float] = []
    reset_e2e: list[float] = []
    cp_ms: list[float] = []
    cp_disk: list[int] = []
    disk_per_fork = float("nan")
    probe_mb = float("nan")
    problems: list[str] = []
    try:
        host = next(iter(pool.hosts.values()))
        data_dir = BENCH_ROOT / "local" / pool.cfg.pool_id / host.id
        t0 = time.perf_counter()
        template = await pool.upload_template(_tar_stream(src), name="venv")
        upload_ms = (time.perf_counter() - t0) * 1e3
        health = await host.client.health()
        res.params["workspace_mode"] = health.workspace_mode
        if health.workspace_mode != "overlay":
            res.notes.append(f"host is in copy mode: {health.workspace_detail}")
        if template.info.files != files:
            problems.append(f"template has {template.info.files} files, built {files}")

        original = host.client.reset
        sink: list[float] | None = None

        async def recording_reset(*args: Any, **kw: Any) -> Any:
            result = await original(*args, **kw)
            if sink is not None:
                sink.append(result.duration_ms)
            if not result.ok or (kw.get("template") and not result.verified):
                problems.append(f"reset not ok/verified: {result.detail}")
            return result

        host.client.reset = recording_reset
        slots_dir = data_dir / "slots"
        host_pid = pool.backend.pid(host.id)
        helper = host_pid  # the helper and its slots' namespaces are looked up at each count
        if helper is None or not _helper_pids(helper):
            res.notes.append("no workspace mount helper found: disk per fork counts on-disk blocks only")
        for r in range(rounds + 1):  # round 0 is a warm-up (first sandboxes in the namespace)
            await _settle(host.client)  # forks start from a warm, idle pool (all sandboxes prewarmed)
            before = await asyncio.to_thread(_slot_bytes, slots_dir, helper)
            sink = host_fork_ms if r else None
            t0 = time.perf_counter()
            leases = await pool.lease_many([f"f{r}-{i}" for i in range(SLOTS)], template=template)
            elapsed = (time.perf_counter() - t0) * 1e3
            sink = None
            if r:
                fork_ms.append(elapsed)
            if r == 1:
                after = await asyncio.to_thread(_slot_bytes, slots_dir, helper)
                disk_per_fork = (after - before) / SLOTS
                a, b = leases[0], leases[1]
                await a.bash("head -c 20000000 /dev/zero > probe-20mb.bin", timeout_s=120)
                probe_mb = (await asyncio.to_thread(_slot_bytes, slots_dir, helper) - after) / 1e6
                if probe_mb < 19:
                    problems.append(f"disk measurement blind: 20 MB written into a fork showed as {probe_mb:.1f} MB")
                await a.bash("echo mine > only-in-a && rm -rf bin")
                seen = (await b.bash("test -e only-in-a && echo LEAK; test -e bin || echo MISSING; "
                                     "find . -type f | wc -l"))["stdout"].split()
                if seen != [str(files)]:
                    problems.append(f"fork isolation / completeness: {seen} (template has {files} files)")
            await asyncio.gather(*(lease.release() for lease in leases))

        # reset of a fork that wrote 1,000 files
        lease = await pool.lease("reset", template=template)
        site = next(src.glob("lib/python*/site-packages")).relative_to(src)
        victims = sorted(p.name for p in (src / site).iterdir() if p.is_dir() and not p.is_symlink())
        fill = FILL.format(probe=site / victims[0], appends=site / victims[1], delete=site / victims[0])
        deadline = time.monotonic() + budget
        dirty = 0
        for i in range(n_resets + 3):
            if i >= 10 and time.monotonic() > deadline:
                res.notes.append(f"reset: time budget of {budget:g}s reached after {i} iterations")
                break
            out = await lease.bash(fill, timeout_s=120)
            dirty += "DIRTY" in out["stdout"]
            sink = reset_host if i >= 3 else None
            t0 = time.perf_counter()
            await lease.reset(template)
            if i >= 3:
                reset_e2e.append((time.perf_counter() - t0) * 1e3)
            sink = None
        out = await lease.bash(fill.split("mkdir")[0] + "true")
        dirty += "DIRTY" in out["stdout"]
        await lease.release()
        if dirty:
            problems.append(f"{dirty} resets left the previous lease's changes behind")
        host.client.reset = original
        await pool.delete_template(template)
    finally:
        await pool.stop()
        shutil.rmtree(BENCH_ROOT / "local" / pool.cfg.pool_id, ignore_errors=True)

    # baseline: cp -a of the same tree into fresh directories
    try:
        for i in range(copies):
            dst = root / f"copy{i}"
            t0 = time.perf_counter()
            await asyncio.to_thread(subprocess.run, ["cp", "-a", str(src), str(dst)], check=True)
            cp_ms.append((time.perf_counter() - t0) * 1e3)
            cp_disk.append(await asyncio.to_thread(_blocks, dst))
            await asyncio.to_thread(shutil.rmtree, dst, True)
    finally:
        await asyncio.to_thread(shutil.rmtree, root, True)

    cp_total = sum(cp_ms) * (SLOTS / len(cp_ms))
    fork_row = Row("fork into 16 slots: pool.lease_many(16, template)", fork_ms, target="p99 < 250 ms")
    fork_row.passed = fork_row.p99 < 250 and not problems
    disk_row = Row("disk per idle fork", value=disk_per_fork / 1024, unit="KiB", target="<= 1024 KiB")
    disk_row.passed = disk_per_fork <= 1 << 20 and probe_mb >= 19  # a blind measurement passes nothing
    disk_row.note = (f"tmpfs layers in the workspace namespace + disk; check: 20 MB written into a fork "
                     f"showed as {probe_mb:.1f} MB")
    reset_row = Row("reset of a fork that wrote 1,000 files (host)", reset_host, target="p99 < 20 ms")
    reset_row.passed = reset_row.p99 < 20 and not problems
    res.rows = [
        Row("cp -a of the template, one copy", cp_ms, baseline=True),
        Row("cp -a x16 (sum" + (", extrapolated)" if copies < SLOTS else ")"), value=cp_total, unit="ms"),
        fork_row,
        Row("fork, host side per slot (ResetResult.duration_ms)", host_fork_ms),
        disk_row,
        Row("disk per cp -a copy", value=(sum(cp_disk) / len(cp_disk)) / 2**20, unit="MiB"),
        reset_row,
        Row("reset of a fork that wrote 1,000 files (end to end)", reset_e2e),
        Row("(once: template upload as a tar stream)", value=upload_ms, unit="ms"),
    ]
    res.targets += [
        Target(f"fork a {files:,}-file/{size / 1e6:.0f} MB workspace into 16 slots < 250 ms total"
               + (" (quick: the target is for 50k files / 500 MB)" if quick else ""),
               f"p50 {fork_row.p50:.1f} ms, p99 {fork_row.p99:.1f} ms over {len(fork_ms)} rounds "
               f"(cp -a x16: {cp_total / 1000:.1f} s)", fork_row.passed),
        Target("disk growth per idle fork <= 1 MiB", f"{disk_per_fork / 1024:.1f} KiB "
               f"(a cp -a copy: {(sum(cp_disk) / len(cp_disk)) / 2**20:.0f} MiB)", disk_row.passed),
        Target("reset of a fork that wrote 1,000 files p99 < 20 ms, verified",
               f"host p99 {reset_row.p99:.2f} ms (p50 {reset_row.p50:.2f}), end to end p99 "
               f"{Row('', reset_e2e).p99:.2f} ms; problems: {problems or 'none'}", reset_row.passed),
    ]
    return res


if __name__ == "__main__":
    scenario_main(NAME, run)
