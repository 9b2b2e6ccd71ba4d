"""first_file: the first file-tool call of a lease, 16 leases at once (issue 37, item 4).

A slot whose sandbox runs slotd (docs/native-supervisor.md) used to hand the sandbox over to the
Python supervisor on its first file call: every process of the sandbox ended and a Python started on
that call's path (~44 ms alone, far more with 16 slots of a group doing it at once). slotd now does
the file tools' system calls itself. Per lease, in lock-step rounds of 16: one ``bash true`` (the
sandbox up and warm, as an agent's first command leaves it), then the timed ``write_file`` (the
first file call), then a timed ``read_file`` (a later file call), then release.

Variants, interleaved round by round on hosts started side by side (``benchmarks.common.start_host``):

- this tree, ``--native-supervisor always``: slotd from the start, serving the file tools;
- this tree, ``--native-supervisor never``: the Python supervisor prestarted off the calls' path (the
  reference for a file call that starts nothing);
- with ``ATROPOS_BENCH_BASELINE_TREE`` (another revision's tree, e.g. ``git archive main``), its
  slotd host: the hand-over as it was.

The baseline row is the warm ``bash true`` of this tree's slotd host in the same rounds. Target:
first file call p50 <= 5 ms (issue 37).
"""

from __future__ import annotations

import asyncio
import os
import secrets
import time
from pathlib import Path
from typing import Any

from benchmarks.common import REPO, Row, ScenarioResult, Target, baseline_tree, scenario_main, start_host

NAME = "first_file"
SLOTS = 16


async def _trajectory(client: Any, name: str, out: dict[str, list[float]], failed: list[str]) -> None:
    """One lease's calls; a failed one (a sandbox that could not start in time on a machine this
    loaded) ends the lease's trajectory and is counted, never timed."""
    from atropos.sandbox.contract.protocol import ToolCall

    lease = await client.lease(name)
    try:
        for key, tool, args in (("true", "bash", {"command": "true"}),
                                ("first", "write_file", {"path": "notes.txt", "content": "x"}),
                                ("later", "read_file", {"path": "notes.txt"})):
            t0 = time.perf_counter()
            r = await client.call(ToolCall(id=secrets.token_hex(4), slot=lease.slot, lease=lease.lease, tool=tool,
                                           args=args))
            if not r.ok:
                failed.append(f"{tool}: {r.error}")
                return
            out[key].append((time.perf_counter() - t0) * 1e3)
    finally:
        await client.release(lease.slot, lease.lease)


async def run(quick: bool) -> ScenarioResult:
    rounds = 3 if quick else 12
    res = ScenarioResult(NAME, "first file call of a lease, 16 leases at once (wall ms per call)",
                         params={"slots": SLOTS, "concurrent_leases": SLOTS, "rounds": rounds})
    trees: list[tuple[str, Path]] = [("this tree", REPO)]
    other = baseline_tree()
    if other is not None:
        trees.append(("baseline tree", other))
    else:
        res.notes.append("no baseline tree (set ATROPOS_BENCH_BASELINE_TREE to another revision's tree)")
    hosts: dict[str, Any] = {}
    clients: dict[str, Any] = {}
    samples: dict[str, dict[str, list[float]]] = {}
    failed: dict[str, list[str]] = {}
    try:
        variants = [("this tree", REPO, "always"), ("this tree", REPO, "never")]
        variants += [(label, tree, "always") for label, tree in trees[1:]]
        for label, tree, mode in variants:
            key = f"{label}, {'slotd' if mode == 'always' else 'Python supervisor'}"
            data = Path(f"/tmp/atropos-bench-{os.getpid()}-{secrets.token_hex(3)}")
            hosts[key] = start_host(data, slots=SLOTS, extra=["--native-supervisor", mode], tree=tree)
            clients[key] = hosts[key].client()
            samples[key] = {"true": [], "first": [], "later": []}
        for r in range(rounds + 1):  # round 0 warms up (first sandboxes, caches): not counted
            for key, client in clients.items():
                got: dict[str, list[float]] = {"true": [], "first": [], "later": []}
                await asyncio.gather(*(_trajectory(client, f"ff-{r}-{i}", got, failed.setdefault(key, []))
                                       for i in range(SLOTS)))
                if r:
                    for k, v in got.items():
                        samples[key][k] += v
    finally:
        for client in clients.values():
            await client.aclose()
        for host in hosts.values():
            host.stop()
    for key, why in failed.items():
        if why:
            res.notes.append(f"{key}: {len(why)} trajectories ended by a failed call (not timed), e.g. {why[0]}")
    ours = samples["this tree, slotd"]
    res.rows.append(Row("this tree, slotd: bash true (warm)", ours["true"], baseline=True))
    for key, s in samples.items():
        res.rows.append(Row(f"{key}: first file call (write_file)", s["first"]))
        res.rows.append(Row(f"{key}: a later file call (read_file)", s["later"]))
    for key in samples:
        row = next(r for r in res.rows if r.name == f"{key}: first file call (write_file)")
        if key.startswith("this tree"):
            row.target = "<= 5 ms"
            row.passed = row.p50 <= 5.0
            res.targets.append(Target(f"{key}: first file call p50 <= 5 ms, 16 at once",
                                      f"p50 {row.p50:.1f} ms (p99 {row.p99:.1f})", row.passed))
    return res


if __name__ == "__main__":
    scenario_main(NAME, run)
