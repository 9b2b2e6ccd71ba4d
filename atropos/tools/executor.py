"""ToolExecutor: route each model tool call to its trajectory's slot, batching calls per host.

Calls are queued per host and sent together after ``tool_batch_window_ms`` or once
``tool_max_batch_size`` are waiting; each batch is its own request, many are in flight at
once, and the host streams results back as each call finishes, so a slow call never delays
another trajectory's fast one. Leasing a slot for a new trajectory happens outside the queues:
a trajectory waiting for a slot never blocks anyone else's calls.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import Coroutine, Sequence
from typing import Any

import httpx
from pydantic import BaseModel, Field

from atropos.errors import HostUnavailable, InfrastructureError, LeaseError
from atropos.sandbox.protocol import CallResult, ToolCall
from atropos.slots.lease import Lease, PoolHost
from atropos.slots.pool import SlotPool
from atropos.tools.formatting import format_result
from atropos.tools.registry import ToolRegistry

log = logging.getLogger(__name__)


class ExecutorConfig(BaseModel):
    tool_batch_window_ms: float = Field(20.0, ge=0, description="how long a host's queue collects calls")
    tool_max_batch_size: int = Field(200, ge=1, description="a queue this long is sent at once")
    default_timeout_s: float = Field(60.0, gt=0)
    min_timeout_s: float = Field(1.0, gt=0)
    max_timeout_s: float = Field(600.0, gt=0)
    lease_timeout_s: float | None = Field(None, description="wait for a slot on first use (pool default)")
    network: bool = Field(False, description="slots leased by the executor may reach the network")
    tool_server_url: str | None = Field(None, description="ToolServer for external tools")
    tool_server_token: str | None = Field(None, repr=False)


class AgentToolCall(BaseModel):
    """A call as the model made it (id from the model; arguments already parsed)."""

    id: str
    name: str
    arguments: dict[str, Any] = Field(default_factory=dict)


class ToolOutcome(BaseModel):
    call_id: str
    name: str
    ok: bool
    content: str = Field(description="what the model reads")
    raw: dict[str, Any] | None = None
    duration_ms: float = 0.0


class _HostQueue:
    def __init__(self, executor: ToolExecutor, host: PoolHost) -> None:
        self.executor = executor
        self.host = host
        self.items: list[tuple[ToolCall, asyncio.Future[CallResult]]] = []
        self.wake = asyncio.Event()
        self.full = asyncio.Event()
        self.task = asyncio.create_task(self._run())

    def put(self, call: ToolCall) -> asyncio.Future[CallResult]:
        fut: asyncio.Future[CallResult] = asyncio.get_running_loop().create_future()
        self.items.append((call, fut))
        self.wake.set()
        if len(self.items) >= self.executor.cfg.tool_max_batch_size:
            self.full.set()
        return fut

    async def _run(self) -> None:
        cfg = self.executor.cfg
        while True:
            await self.wake.wait()
            if cfg.tool_batch_window_ms > 0 and len(self.items) < cfg.tool_max_batch_size:
                try:
                    await asyncio.wait_for(self.full.wait(), cfg.tool_batch_window_ms / 1000)
                except asyncio.TimeoutError:
                    pass
            batch = self.items[: cfg.tool_max_batch_size]
            del self.items[: len(batch)]
            if len(self.items) < cfg.tool_max_batch_size:
                self.full.clear()
            if not self.items:
                self.wake.clear()
            if batch:
                self.executor._spawn(self._send(batch))

    async def _send(self, batch: list[tuple[ToolCall, asyncio.Future[CallResult]]]) -> None:
        pending = {call.id: fut for call, fut in batch}
        self.executor.requests_sent += 1
        self.executor.calls_sent += len(batch)
        self.executor.pool.count_call(len(batch))

        async def consume() -> None:
            async for result in self.host.client.call_batch([call for call, _ in batch]):
                fut = pending.pop(result.id, None)
                if fut is not None and not fut.done():
                    fut.set_result(result)

        try:
            await self.host.guard(consume())
            if pending:
                raise HostUnavailable(f"host {self.host.id} ended the batch without {len(pending)} result(s)")
        except Exception as exc:
            if isinstance(exc, HostUnavailable):
                self.executor.pool.suspect(self.host)
            error = exc if isinstance(exc, InfrastructureError) else HostUnavailable(f"{type(exc).__name__}: {exc}")
            for fut in pending.values():
                if not fut.done():
                    fut.set_exception(error)


class ToolExecutor:
    def __init__(self, pool: SlotPool, registry: ToolRegistry | None = None, cfg: ExecutorConfig | None = None,
                 *, tool_server_transport: httpx.AsyncBaseTransport | None = None) -> None:
        self.pool = pool
        self.registry = registry or ToolRegistry.default()
        self.cfg = cfg or ExecutorConfig()
        self._leases: dict[str, Lease] = {}
        self._leasing: dict[str, asyncio.Future[Lease]] = {}
        self._queues: dict[str, _HostQueue] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._ids = itertools.count()
        self.requests_sent = 0
        self.calls_sent = 0
        self._external: httpx.AsyncClient | None = None
        if self.cfg.tool_server_url:
            headers = {"Authorization": f"Bearer {self.cfg.tool_server_token}"} if self.cfg.tool_server_token else {}
            self._external = httpx.AsyncClient(base_url=self.cfg.tool_server_url, headers=headers,
                                               transport=tool_server_transport, timeout=httpx.Timeout(120.0))

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # -- leases ----------------------------------------------------------------------------
    def bind(self, trajectory_id: str, lease: Lease) -> None:
        """Use an already leased slot for this trajectory (e.g. leased by AgentEnv for a group)."""
        self._leases[trajectory_id] = lease

    def unbind(self, trajectory_id: str) -> None:
        """Forget the trajectory's slot without releasing it (its owner releases it)."""
        self._leases.pop(trajectory_id, None)

    def lease_of(self, trajectory_id: str) -> Lease | None:
        """The lease bound to (or taken for) the trajectory, if any."""
        return self._leases.get(trajectory_id)

    async def lease_for(self, trajectory_id: str) -> Lease:
        """The trajectory's lease, taken from the pool on first use (concurrent first calls share it)."""
        lease = self._leases.get(trajectory_id)
        if lease is not None:
            return lease
        waiting = self._leasing.get(trajectory_id)
        if waiting is not None:  # two first calls of one trajectory share one lease
            return await asyncio.shield(waiting)
        fut: asyncio.Future[Lease] = asyncio.get_running_loop().create_future()
        self._leasing[trajectory_id] = fut
        try:
            lease = await self.pool.lease(trajectory_id, self.cfg.lease_timeout_s, network=self.cfg.network)
            self._leases[trajectory_id] = lease
            fut.set_result(lease)
            return lease
        except BaseException as exc:
            fut.set_exception(exc)
            fut.exception()  # retrieved: no "never retrieved" warning when nobody else waits
            raise
        finally:
            self._leasing.pop(trajectory_id, None)

    async def release_trajectory(self, trajectory_id: str) -> None:
        """Reset the trajectory's slot and return it to the pool."""
        lease = self._leases.pop(trajectory_id, None)
        if lease is not None:
            await lease.release()

    # -- calls -----------------------------------------------------------------------------
    def clamp(self, requested: float | None) -> float:
        """The timeout a call gets: the default when none is asked, else within [min, max]."""
        if requested is None:
            return self.cfg.default_timeout_s
        return min(max(requested, self.cfg.min_timeout_s), self.cfg.max_timeout_s)

    async def execute(self, trajectory_id: str, call: AgentToolCall, *, timeout_s: float | None = None) -> ToolOutcome:
        """Run one call in the trajectory's slot (or on the ToolServer for external tools); a tool
        failure is an outcome with ``ok=False`` for the model, infrastructure failures raise."""
        return (await self.execute_many(trajectory_id, [call], timeout_s=timeout_s))[0]

    async def execute_many(self, trajectory_id: str, calls: Sequence[AgentToolCall], *,
                           timeout_s: float | None = None) -> list[ToolOutcome]:
        """Run one turn's calls; calls on the slot run in the given order. Infra failures raise."""
        t0 = time.perf_counter()
        outcomes: list[ToolOutcome | None] = [None] * len(calls)
        sandbox: list[tuple[int, AgentToolCall]] = []
        externals: list[tuple[int, AgentToolCall]] = []
        for i, call in enumerate(calls):
            tool = self.registry.get(call.name)
            if tool is None:
                outcomes[i] = ToolOutcome(call_id=call.id, name=call.name, ok=False,
                                          content=f"error (unknown_tool): no tool named {call.name!r}; available: "
                                                  f"{', '.join(self.registry.names())}")
            elif tool.kind == "external":
                externals.append((i, call))
            else:
                sandbox.append((i, call))
        if sandbox:
            lease = await self.lease_for(trajectory_id)
            lease.check()
            queue = self._queue(lease.host)
            futures = []
            for i, call in sandbox:
                args = dict(call.arguments)
                requested = timeout_s if timeout_s is not None else args.pop("timeout_s", None)
                if requested is not None and not isinstance(requested, int | float):
                    requested = None
                wire = lease.tool_call(call.name, args, timeout_s=self.clamp(requested), call_id=str(next(self._ids)))
                lease.calls += 1
                futures.append((i, call, queue.put(wire)))
            for i, call, fut in futures:
                result = await fut
                if result.error is not None and result.error.code == "lease_invalid":
                    raise LeaseError(result.error.message)
                if result.error is not None and result.error.code == "sandbox_failed":
                    # the slot's sandbox did not answer or start: the platform's failure, not the model's
                    raise InfrastructureError(result.error.message)
                ok, text = format_result(call.name, result)
                outcomes[i] = ToolOutcome(call_id=call.id, name=call.name, ok=ok, content=text, raw=result.result,
                                          duration_ms=result.duration_ms)
        for i, call in externals:
            outcomes[i] = await self._external_call(call)
        done = [o for o in outcomes if o is not None]
        log.debug("trajectory %s: %d call(s) in %.1f ms", trajectory_id, len(done), (time.perf_counter() - t0) * 1e3)
        return done

    def _queue(self, host: PoolHost) -> _HostQueue:
        for host_id, stale in list(self._queues.items()):  # forget hosts that died or were removed
            if stale.host.dead.is_set() or host_id not in self.pool.hosts:
                if not stale.items:
                    stale.task.cancel()
                    del self._queues[host_id]
        queue = self._queues.get(host.id)
        if queue is None or queue.host is not host:
            queue = self._queues[host.id] = _HostQueue(self, host)
        return queue

    async def _external_call(self, call: AgentToolCall) -> ToolOutcome:
        if self._external is None:
            return ToolOutcome(call_id=call.id, name=call.name, ok=False,
                               content=f"error (unavailable): {call.name} needs a ToolServer, none is configured")
        try:
            resp = await self._external.post(f"/v1/tools/{call.name}/invoke", json={"args": call.arguments})
        except httpx.TransportError as exc:
            raise InfrastructureError(f"ToolServer unreachable: {exc}") from exc
        if resp.status_code >= 500:
            raise InfrastructureError(f"ToolServer error {resp.status_code}: {resp.text[:500]}")
        body = resp.json()
        if resp.status_code >= 400:
            err = body.get("error", {})
            return ToolOutcome(call_id=call.id, name=call.name, ok=False,
                               content=f"error ({err.get('code', resp.status_code)}): {err.get('message', '')}")
        return ToolOutcome(call_id=call.id, name=call.name, ok=bool(body.get("ok", True)),
                           content=str(body.get("content", "")), raw=body.get("raw"))

    async def close(self) -> None:
        """Stop the batching tasks and close the ToolServer client; leases stay with their owners."""
        for queue in self._queues.values():
            queue.task.cancel()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*(q.task for q in self._queues.values()), *self._tasks, return_exceptions=True)
        self._queues.clear()
        if self._external is not None:
            await self._external.aclose()
