#!/usr/bin/env python3
"""Soak test of slot resets: N reset cycles on one real host, then check nothing leaked.

    .venv/bin/python scripts/reset_soak.py                  # 10,000 cycles (~10 min on 2 cores)
    .venv/bin/python scripts/reset_soak.py --cycles 300 --workspace-mode copy

Each cycle dirties a leased slot (files written into the template's tree and beside it, every 10th
cycle also a background process that keeps writing) and resets it, alternating between "fork of
the template" and "empty workspace". Before and after (with the slot released and the host idle):
mounts below the soak's directory in the host's own namespace (/proc/self/mountinfo; the rest of
that table belongs to other tenants of the machine), workspace mounts in the host's mount
namespace (health ``mounts``), processes in the host's process tree, and allocated bytes and
entries under its data dir. Exit status 1 when any of them drifted, a reset failed, or a reset
left the previous lease's files behind. Progress (reset p50/p99 so far) every ``--report-every``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from atropos.sandbox.contract.client import HostClient
from atropos.sandbox.contract.protocol import LeaseInfo, ToolCall


def tree_pids(root: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                ppid = int(Path(f"/proc/{name}/stat").read_bytes().rsplit(b")", 1)[1].split()[1])
            except (OSError, IndexError):
                continue
            children.setdefault(ppid, []).append(int(name))
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo.extend(children.get(pid, []))
    return out


def disk(path: Path) -> tuple[int, int]:
    used = entries = 0
    for dirpath, dirnames, filenames in os.walk(path):
        for name in dirnames + filenames:
            entries += 1
            if name in filenames:
                used += os.lstat(os.path.join(dirpath, name)).st_blocks * 512
    return used, entries


def host_mounts(under: Path) -> int:
    """Mounts below ``under`` in this (the host's) namespace. Not the whole table: other tenants
    of the machine (Docker containers, ...) mount and unmount things all the time."""
    prefix = os.path.realpath(under) + "/"
    with open("/proc/self/mountinfo") as fh:
        return sum(1 for line in fh if line.split()[4].startswith(prefix))


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round((len(xs) - 1) * q / 100))] if xs else float("nan")


async def bash(c: HostClient, lease: LeaseInfo, command: str) -> str:
    result = await c.call(ToolCall(id=secrets.token_hex(4), slot=lease.slot, lease=lease.lease, tool="bash",
                                   args={"command": command}, timeout_s=60))
    if not result.ok or result.result is None:
        raise RuntimeError(f"bash failed: {result.error}")
    return str(result.result["stdout"])


async def settle(c: HostClient, data_dir: Path) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        infos = await c.slots()
        if not list((data_dir / "trash").iterdir()) and all(i.sandbox_running for i in infos):
            return
        await asyncio.sleep(0.1)


def start_host(args: argparse.Namespace) -> tuple[Path, Path, subprocess.Popen[bytes], str, int]:
    work = Path(tempfile.mkdtemp(prefix="atropos-soak-"))
    os.chmod(work, 0o755)
    src = work / "src"
    (src / "pkg").mkdir(parents=True)
    for i in range(200):
        (src / "pkg" / f"m{i}.py").write_text(f"X = {i}\n" * 20)
    token = secrets.token_urlsafe(16)
    proc = subprocess.Popen(
        [sys.executable, "-m", "atropos.sandbox", "--port", "0", "--slots", "2", "--data-dir", str(work / "host"),
         "--log-level", "WARNING", "--template-source-dir", str(src), "--workspace-mode", args.workspace_mode,
         "--parent-pid", str(os.getpid())],
        stdout=subprocess.PIPE, env={**os.environ, "ATROPOS_SANDBOX_TOKEN": token},
        cwd=Path(__file__).resolve().parent.parent)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if not line:
        raise SystemExit(f"the host did not start (exit {proc.wait(10)})")
    return work, src, proc, token, int(json.loads(line)["port"])


async def soak(args: argparse.Namespace, work: Path, src: Path, proc: subprocess.Popen[bytes], token: str,
               port: int) -> int:
    data_dir = work / "host"
    c = HostClient(f"http://127.0.0.1:{port}", token)
    failures: list[str] = []
    try:
        health = await c.health()
        print(f"host: workspace mode {health.workspace_mode} ({health.workspace_detail})", flush=True)
        template = await c.create_template("dir", path=str(src))
        lease = await c.lease("soak")
        for t in (template.id, None):  # one cycle of each before the baseline
            r = await c.reset(lease.slot, lease.lease, template=t)
            assert r.lease is not None
            lease = r.lease
        await c.release(lease.slot, lease.lease)
        await settle(c, data_dir)
        base = {"host mounts": host_mounts(work), "workspace mounts": (await c.health()).mounts,
                "processes": len(tree_pids(proc.pid))}
        base_disk = disk(data_dir)
        print(f"baseline: {base}, disk {base_disk[0]} bytes in {base_disk[1]} entries", flush=True)
        lease = await c.lease("soak")
        forked = False
        times: list[float] = []
        t_start = time.monotonic()
        for i in range(args.cycles):
            check = "test -e pkg/m0.py || echo MISSING; " if forked else "test -z \"$(ls -A)\" || echo DIRTY; "
            dirty = "mkdir -p w && for i in 1 2 3 4 5 6 7 8 9 10; do echo $i > w/f$i; done; "
            if forked:
                dirty += "echo x >> pkg/m1.py; rm pkg/m2.py; "
            if i % 10 == 0:
                dirty += "(while true; do echo bg >> bg.txt; sleep 0.01; done) >/dev/null 2>&1 & "
            out = await bash(c, lease, check + dirty + "true")
            if "MISSING" in out or "DIRTY" in out:
                failures.append(f"cycle {i}: workspace not as reset left it: {out.strip()}")
            forked = i % 2 == 0
            r = await c.reset(lease.slot, lease.lease, template=template.id if forked else None)
            if not r.ok or r.lease is None:
                failures.append(f"cycle {i}: reset failed: {r.detail}")
                break
            times.append(r.duration_ms)
            lease = r.lease
            if (i + 1) % args.report_every == 0 or i + 1 == args.cycles:
                rate = (i + 1) / (time.monotonic() - t_start)
                health = await c.health()
                print(f"{i + 1:>6} cycles  reset p50 {pct(times, 50):.1f} ms  p99 {pct(times, 99):.1f} ms  "
                      f"({rate:.1f} cycles/s, load {os.getloadavg()[0]:.1f})  now: workspace mounts "
                      f"{health.mounts}, processes {len(tree_pids(proc.pid))}, data-dir entries "
                      f"{disk(data_dir)[1]}", flush=True)
        await c.release(lease.slot, lease.lease)
        await settle(c, data_dir)
        after = {"host mounts": host_mounts(work), "workspace mounts": (await c.health()).mounts,
                 "processes": len(tree_pids(proc.pid))}
        after_disk = disk(data_dir)
        print(f"after:    {after}, disk {after_disk[0]} bytes in {after_disk[1]} entries", flush=True)
        for key, value in base.items():
            if after[key] != value:
                failures.append(f"{key}: {value} -> {after[key]}")
        if after_disk[1] != base_disk[1]:
            failures.append(f"entries under the data dir: {base_disk[1]} -> {after_disk[1]}")
        if after_disk[0] > base_disk[0] + (64 << 10):
            failures.append(f"disk usage: {base_disk[0]} -> {after_disk[0]} bytes")
        if (await c.health()).quarantined:
            failures.append("a slot was quarantined")
    finally:
        await c.aclose()
    for f in failures[:20]:
        print("FAIL:", f)
    print("OK: nothing leaked" if not failures else f"{len(failures)} problem(s)")
    return 1 if failures else 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cycles", type=int, default=10_000)
    p.add_argument("--report-every", type=int, default=500)
    p.add_argument("--workspace-mode", choices=("auto", "overlay", "copy"), default="overlay")
    args = p.parse_args()
    work, src, proc, token, port = start_host(args)
    try:
        return asyncio.run(soak(args, work, src, proc, token, port))
    finally:
        proc.terminate()
        proc.wait(30)
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
