"""peers: sandbox start and per-call latency of atropos-sandbox next to SWE-ReX and llm-sandbox.

All measured in this one run, on this machine, under the same load:

- atropos-sandbox local: a ``python -m atropos.sandbox`` host with 1 slot (bubblewrap on), started
  until its ready line, then one lease; calls are ``HostClient.call`` of the bash tool.
- atropos-sandbox docker: ``DockerBackend.start_host()`` with 1 slot (image atropos-sandbox:dev),
  then one lease; calls as above, into the container's host.
- ``release+lease (reset)``: ours' fresh sandbox for the next trajectory on a running host (the
  slot's workspace and processes reset), timed among the per-call rows.
- the peers from ``benchmarks/peers.py``: SWE-ReX (local, docker) and llm-sandbox (bubblewrap,
  docker), each through its documented API; skipped with a reason where they cannot run.

Per-call rows (``true``, ``echo hello``) are timed in alternating chunks over all open sandboxes
(so load changes hit all alike); their ``x base`` is the ratio to atropos-sandbox local ``true``
p50. ``start`` is from nothing to the first call possible (``stop`` is its teardown), starts
interleaved across implementations; their ``x base`` divides by atropos-sandbox local's start
(resp. stop). No target: the design has none for peers; the table reports.
"""

from __future__ import annotations

import asyncio
import inspect
import secrets
import shutil
import time
from pathlib import Path
from typing import Any

from benchmarks import peers
from benchmarks.common import (
    DOCKER_IMAGE,
    Fn,
    Row,
    ScenarioResult,
    bench_dir,
    docker_problem,
    scenario_main,
    start_host,
    time_interleaved,
)
from benchmarks.peers import PeerSession, PeerSpec

NAME = "peers"
OURS = "atropos-sandbox local"


class _Atropos(PeerSession):
    """Common part of ours: one leased slot of a host, calls through ``HostClient.call``."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._client: Any = None
        self._lease: Any = None

    async def _lease_slot(self, client: Any) -> None:
        self._client = client
        self._lease = await client.lease(f"bench-peers-{secrets.token_hex(3)}")

    async def _release(self) -> None:
        if self._client is not None:
            try:
                if self._lease is not None:
                    await self._client.release(self._lease.slot, self._lease.lease)
            finally:
                await self._client.aclose()
                self._client = self._lease = None

    def calls(self) -> dict[str, Fn]:
        from atropos.sandbox.contract.protocol import ToolCall

        client = self._client

        def bash(command: str) -> Fn:
            async def call() -> None:
                lease = self._lease  # read per call: the release+lease variant replaces it
                result = await client.call(ToolCall(id=secrets.token_hex(4), slot=lease.slot, lease=lease.lease,
                                                    tool="bash", args={"command": command}))
                if not result.ok:
                    raise RuntimeError(f"bash {command!r} failed: {result.error}")
            return call

        async def next_trajectory() -> None:
            # Our unit of "a fresh sandbox" on a running host: release resets the slot's workspace
            # and processes, the next lease gets it clean (the peers' analogue is their start).
            await client.release(self._lease.slot, self._lease.lease)
            self._lease = await client.lease(f"bench-peers-{secrets.token_hex(3)}")

        return {"true": bash("true"), "echo hello": bash("echo hello"), "release+lease (reset)": next_trajectory}


class AtroposLocal(_Atropos):
    def __init__(self, root: Path) -> None:
        super().__init__(OURS)
        self._root = root
        self._host: Any = None

    async def open(self) -> None:
        self._host = await asyncio.to_thread(start_host, self._root / f"host-{secrets.token_hex(3)}", 1)
        await self._lease_slot(self._host.client())

    async def close(self) -> None:
        try:
            await self._release()
        finally:
            if self._host is not None:
                await asyncio.to_thread(self._host.stop)
                self._host = None


class AtroposDocker(_Atropos):
    def __init__(self) -> None:
        super().__init__("atropos-sandbox docker")
        self._backend: Any = None
        self._host_id: str | None = None

    async def open(self) -> None:
        from atropos.backends.docker import DockerBackend, DockerBackendConfig
        from atropos.sandbox.contract.client import HostClient

        self._backend = DockerBackend(DockerBackendConfig(image=DOCKER_IMAGE, pool_id="bench-peers", slots_per_host=1))
        info = await self._backend.start_host()
        self._host_id = info.id
        await self._lease_slot(HostClient(info.address, info.token))

    async def close(self) -> None:
        try:
            await self._release()
        finally:
            if self._backend is not None:
                if self._host_id is not None:
                    await self._backend.stop_host(self._host_id)
                await self._backend.close()
                self._backend = self._host_id = None


async def _open(session: PeerSession) -> float:
    """Open (timed, ms) then check it; closes it again if either fails."""
    t0 = time.perf_counter()
    try:
        await session.open()
        elapsed = (time.perf_counter() - t0) * 1e3
        await session.check()
    except BaseException:
        await _close_quietly(session)
        raise
    return elapsed


async def _close_quietly(session: PeerSession) -> None:
    try:
        await session.close()
    except Exception as exc:
        print(f"   ({session.name}: close failed: {type(exc).__name__}: {exc})")


async def _time_starts(specs: list[PeerSpec], quick: bool) -> dict[str, tuple[list[float], list[float]] | str]:
    """{name: (start ms, stop ms) samples, or why it failed}; one start of each peer per round."""
    out: dict[str, tuple[list[float], list[float]] | str] = {s.name: ([], []) for s in specs}
    rounds = max(s.n_starts(quick) for s in specs)
    for r in range(rounds):
        for spec in specs:
            got = out[spec.name]
            if r >= spec.n_starts(quick) or isinstance(got, str):
                continue
            session = spec.make()
            try:
                got[0].append(await _open(session))
            except Exception as exc:
                out[spec.name] = f"failed: {type(exc).__name__}: {str(exc)[:300]}"
                continue
            t0 = time.perf_counter()
            await session.close()
            got[1].append((time.perf_counter() - t0) * 1e3)
    return out


async def _time_calls(specs: list[PeerSpec], quick: bool) -> tuple[dict[str, list[float]], dict[str, str]]:
    """Open one sandbox of each, time their calls interleaved, close them: (samples, failures)."""
    sessions: list[PeerSession] = []
    failed: dict[str, str] = {}
    variants: dict[str, tuple[Fn, int]] = {}
    try:
        for spec in specs:
            session = spec.make()
            try:
                await _open(session)
            except Exception as exc:
                failed[spec.name] = f"failed to open: {type(exc).__name__}: {str(exc)[:300]}"
                continue
            sessions.append(session)
            for label, fn in session.calls().items():
                name = f"{spec.name}: {label}"
                variants[name] = (_noting_failure(name, fn, failed), spec.n_calls(quick))
        samples = await time_interleaved(variants, warmup=3, rounds=5 if quick else 10)
    finally:
        for session in sessions:
            await _close_quietly(session)
    return {k: v for k, v in samples.items() if k not in failed}, failed


def _noting_failure(name: str, fn: Fn, failed: dict[str, str]) -> Fn:
    """``fn`` that records its first exception in ``failed`` instead of raising (a failing peer call
    must not take the other rows down; its samples are dropped)."""
    async def call() -> None:
        if name in failed:
            return
        try:
            result = fn()
            if inspect.isawaitable(result):
                await result
        except Exception as exc:
            failed[name] = f"failed: {type(exc).__name__}: {str(exc)[:300]}"
    return call


async def run(quick: bool) -> ScenarioResult:
    res = ScenarioResult(NAME, "sandbox start and per-call latency vs SWE-ReX and llm-sandbox (same run)")
    root = bench_dir(NAME)
    label = f"peers-{secrets.token_hex(4)}"  # this run's peer containers, removed at the end
    try:
        specs, skipped = await asyncio.to_thread(peers.discover, root, label)
        ours = [PeerSpec(OURS, lambda: AtroposLocal(root), starts=(3, 8), calls=(60, 300))]
        problem = await asyncio.to_thread(docker_problem)
        if problem is None:
            ours.append(PeerSpec("atropos-sandbox docker", AtroposDocker, starts=(2, 5), calls=(60, 300)))
        else:
            skipped["atropos-sandbox docker"] = problem
        specs = ours + specs
        res.params = {"starts": {s.name: s.n_starts(quick) for s in specs},
                      "calls": {s.name: s.n_calls(quick) for s in specs if s.per_call}}
        samples, call_failed = await _time_calls([s for s in specs if s.per_call], quick)
        starts = await _time_starts(specs, quick)
    finally:
        left = await asyncio.to_thread(peers.remove_containers, label) if shutil.which("docker") else 0
        shutil.rmtree(root, ignore_errors=True)
    if left:
        res.notes.append(f"{left} peer container(s) were left behind and removed")

    # Per-call block first: its first row (ours `true`) is the scenario's baseline.
    for spec in specs:
        if not spec.per_call:
            continue
        for name, why in call_failed.items():
            if name == spec.name or name.startswith(f"{spec.name}: "):
                res.rows.append(Row(name if name != spec.name else f"{name}: calls", n=0, note=why))
        for name, xs in samples.items():
            if name.startswith(f"{spec.name}: "):
                res.rows.append(Row(name, xs, baseline=name == f"{OURS}: true"))
    for spec in specs:
        got = starts[spec.name]
        if isinstance(got, str):
            res.rows.append(Row(f"{spec.name}: start", n=0, note=got))
            continue
        res.rows.append(Row(f"{spec.name}: start", got[0], base=f"{OURS}: start", baseline=spec.name == OURS,
                            note=spec.note))
        res.rows.append(Row(f"{spec.name}: stop", got[1], base=f"{OURS}: stop"))
    for name, why in skipped.items():
        res.rows.append(Row(name, n=0, note=f"skipped: {why}"))
    res.notes.append("x base: per-call rows / atropos-sandbox local `true` p50; start (stop) rows / its start (stop)")
    return res


if __name__ == "__main__":
    scenario_main(NAME, run)
