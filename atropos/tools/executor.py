"""ToolExecutor: route each model tool call to its trajectory's slot, batching calls per host.

Calls are batched per host adaptively (see ``_HostQueue``): a call goes out at once when no
batch to its host is running, and calls that arrive while one runs go out together when it
ends, after ``tool_batch_window_ms`` at the latest. Each batch is its own request, many are in
flight at once, and the host streams results back as each call finishes, so a slow call never
holds another trajectory's fast one for more than that window. Leasing a slot for a new
trajectory happens outside the queues: a trajectory waiting for a slot never blocks anyone
else's calls.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import logging
import time
from collections import deque
from collections.abc import Sequence
from typing import Any

import httpx
from pydantic import BaseModel, Field, model_validator

from atropos.errors import HostUnavailable, InfrastructureError
from atropos.renamed import accept_renamed
from atropos.sandbox.contract.protocol import (
    DEFAULT_MAX_TIMEOUT_S,
    CallResult,
    CallTimeouts,
    DefaultTimeoutS,
    MaxTimeoutS,
    ToolCall,
)
from atropos.slots.config import RENAMED
from atropos.slots.lease import Lease, PoolHost
from atropos.slots.pool import SlotPool
from atropos.tools.formatting import format_result
from atropos.tools.registry import ToolRegistry

log = logging.getLogger(__name__)


class ExecutorConfig(BaseModel):
    tool_batch_window_ms: float = Field(20.0, ge=0, description=(
        "upper bound on how long a call waits for a batch in flight to its host (a lone call does not wait)"))
    tool_max_batch_size: int = Field(200, ge=1, description="calls per request at most (a turn is never split)")
    default_timeout_s: DefaultTimeoutS = CallTimeouts.model_fields["default_timeout_s"].default
    min_timeout_s: float = Field(1.0, gt=0)
    max_timeout_s: MaxTimeoutS = DEFAULT_MAX_TIMEOUT_S
    acquire_timeout_s: float | None = Field(None, description="wait for a slot on first use (pool default)")
    network: bool = Field(False, description="slots leased by the executor may reach the network")
    tool_server_url: str | None = Field(None, description="ToolServer for external tools")
    tool_server_token: str | None = Field(None, repr=False)

    @model_validator(mode="before")
    @classmethod
    def _renamed(cls, data: Any) -> Any:
        return accept_renamed(data, RENAMED, "ExecutorConfig")


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


TYPICAL_START_S = 0.005
TYPICAL_WEIGHT = 0.2
MIN_HOLD_S = 0.001

_Pending = tuple[ToolCall, "asyncio.Future[CallResult]"]


class _Request:
    """One batch in flight: its unanswered calls and whether it still holds the next batch back."""

    __slots__ = ("holding", "pending", "task")

    def __init__(self, batch: list[_Pending]) -> None:
        self.pending = {call.id: fut for call, fut in batch}
        self.task: asyncio.Future[None] | None = None
        self.holding = True


class _HostQueue:
    """Adaptive batching for one host (group commit): no fixed wait.

    A turn goes out at the next turn of the event loop when nothing is in flight to the host; calls
    arriving while a request *holds* wait and go out together the moment it stops holding. A request
    holds from its send until all its results are back, but never longer than the *hold time*: twice
    the host's recent per-call latency (an average that an outlier moves only a little), capped by
    ``tool_batch_window_ms``. Calls arriving while requests are in flight but none holds (their calls
    are slow) wait at most one hold time from the oldest of them. So a lone call waits for nothing, a
    slow call holds a fast one back for about one typical call, and under load the calls arriving
    while batches run share one request per hold time, as the fixed window shared one per window.
    """

    def __init__(self, executor: ToolExecutor, host: PoolHost) -> None:
        self.executor = executor
        self.host = host
        self.loop = asyncio.get_running_loop()
        self.turns: deque[list[_Pending]] = deque()  # a turn's calls always share one request (slot order)
        self.items = 0  # calls waiting in turns
        self.holding = 0
        self.inflight: set[_Request] = set()
        self._soon: asyncio.Handle | None = None
        self._deadline: asyncio.TimerHandle | None = None
        self._due = 0.0  # when _deadline fires (loop time)
        self._first_wait = 0.0  # arrival of the oldest waiting call (loop time)
        self.typical_s = TYPICAL_START_S  # moving average of send -> result, for the hold

    def put(self, calls: Sequence[ToolCall]) -> list[asyncio.Future[CallResult]]:
        turn: list[_Pending] = [(call, self.loop.create_future()) for call in calls]
        if not self.turns:
            self._first_wait = self.loop.time()
        self.turns.append(turn)
        self.items += len(turn)
        self._schedule()
        return [fut for _, fut in turn]

    def _schedule(self) -> None:
        if not self.turns or self._soon is not None:
            return
        cfg = self.executor.cfg
        if self.holding:  # sent when the holding request(s) stop holding; the window bounds the wait
            due = self._first_wait + cfg.tool_batch_window_ms / 1000
        elif any(r.pending for r in self.inflight):  # only slow calls in flight: wait one hold time for company
            due = self._first_wait + self.hold_s()
        else:
            due = 0.0
        if due <= self.loop.time() or self.items >= cfg.tool_max_batch_size:
            # call_soon, not now: the callers woken by the last results queue their next calls first
            self._soon = self.loop.call_soon(self._flush)
        elif self._deadline is None or due < self._due:
            if self._deadline is not None:
                self._deadline.cancel()
            self._due = due
            self._deadline = self.loop.call_at(due, self._flush)

    def hold_s(self) -> float:
        return min(self.executor.cfg.tool_batch_window_ms / 1000, max(2 * self.typical_s, MIN_HOLD_S))

    def _flush(self) -> None:
        self._soon = None
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None
        limit = self.executor.cfg.tool_max_batch_size
        while self.turns:
            batch: list[_Pending] = []
            while self.turns and (not batch or len(batch) + len(self.turns[0]) <= limit):
                turn = self.turns.popleft()
                self.items -= len(turn)
                batch.extend(p for p in turn if not p[1].done())  # drop cancelled calls
            if batch:
                self._start(batch)

    def _start(self, batch: list[_Pending]) -> None:
        request = _Request(batch)
        self.holding += 1
        self.inflight.add(request)
        hold = self.hold_s()
        timer = self.loop.call_later(hold, self._unhold, request) if hold > 0 else None
        if timer is None:
            self._unhold(request)
        request.task = task = asyncio.ensure_future(self._send(request, [call for call, _ in batch]))

        def finished(_task: object) -> None:
            if timer is not None:
                timer.cancel()
            self.inflight.discard(request)
            if request.holding:
                self._unhold(request)
            else:
                self._schedule()  # calls waiting for company need not wait for this one any more

        task.add_done_callback(finished)
        abandoned = functools.partial(self._abandoned, request=request)
        for _, fut in batch:
            fut.add_done_callback(abandoned)

    def _unhold(self, request: _Request) -> None:
        if request.holding:
            request.holding = False
            self.holding -= 1
            self._schedule()

    @staticmethod
    def _abandoned(fut: asyncio.Future[CallResult], request: _Request) -> None:
        """Every caller still waiting on the request gave up: close it, the host cancels those calls."""
        if fut.cancelled() and all(f.done() for f in request.pending.values()):
            if request.task is not None and not request.task.done():
                request.task.cancel()

    async def _send(self, request: _Request, calls: list[ToolCall]) -> None:
        pending = request.pending
        self.executor.requests_sent += 1
        self.executor.calls_sent += len(calls)

        sent = time.perf_counter()

        async def consume() -> None:
            async for result in self.host.client.call_batch(calls):
                took = time.perf_counter() - sent
                self.typical_s += TYPICAL_WEIGHT * (min(took, 4 * self.typical_s) - self.typical_s)
                fut = pending.pop(result.id, None)
                if fut is not None and not fut.done():
                    fut.set_result(result)
                if not pending:
                    self._unhold(request)

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

    def close(self) -> list[asyncio.Future[None]]:
        """Stop: waiting calls are cancelled, requests in flight too (the tasks to await)."""
        for handle in (self._soon, self._deadline):
            if handle is not None:
                handle.cancel()
        self._soon = self._deadline = None
        while self.turns:
            for _, fut in self.turns.popleft():
                fut.cancel()
        self.items = 0
        tasks = [r.task for r in self.inflight if r.task is not None]
        for task in tasks:
            task.cancel()
        return tasks


class ToolExecutor:
    def __init__(self, pool: SlotPool, registry: ToolRegistry | None = None, cfg: ExecutorConfig | None = None,
                 *, tool_server_transport: httpx.AsyncBaseTransport | None = None) -> None:
        self.pool = pool
        self.registry = registry or ToolRegistry.default()
        self.cfg = cfg or ExecutorConfig()
        self._leases: dict[str, Lease] = {}
        self._leasing: dict[str, asyncio.Future[Lease]] = {}
        self._queues: dict[str, _HostQueue] = {}
        self._ids = itertools.count()
        self.requests_sent = 0
        self.calls_sent = 0
        self._external: httpx.AsyncClient | None = None
        if self.cfg.tool_server_url:
            headers = {"Authorization": f"Bearer {self.cfg.tool_server_token}"} if self.cfg.tool_server_token else {}
            self._external = httpx.AsyncClient(base_url=self.cfg.tool_server_url, headers=headers,
                                               transport=tool_server_transport, timeout=httpx.Timeout(120.0))

    # -- leases ----------------------------------------------------------------------------
    def bind(self, trajectory_id: str, lease: Lease) -> None:
        """Use an already leased slot for this trajectory (e.g. leased by AgentEnv for a group)."""
        self._leases[trajectory_id] = lease

    def unbind(self, trajectory_id: str) -> None:
        """Forget the trajectory's slot without releasing it (its owner releases it)."""
        self._leases.pop(trajectory_id, None)

    @property
    def trajectories(self) -> int:
        """Trajectories the executor holds state for (a slot bound or being leased): only live ones."""
        return len(self._leases) + len(self._leasing)

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
            lease = await self.pool.lease(trajectory_id, self.cfg.acquire_timeout_s, network=self.cfg.network)
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
            wires = []
            for _, call in sandbox:
                args = dict(call.arguments)
                requested = timeout_s if timeout_s is not None else args.pop("timeout_s", None)
                if requested is not None and not isinstance(requested, int | float):
                    requested = None
                wires.append(lease.start_call(call.name, args, timeout_s=self.clamp(requested),
                                              call_id=str(next(self._ids))))
            futures = self._queue(lease.host).put(wires)
            try:
                results = [await fut for fut in futures]
            except BaseException:
                for fut in futures:  # a caller that gives up takes the rest of its turn along
                    if not fut.cancel() and not fut.cancelled():
                        fut.exception()  # retrieved: the first failure is the one raised
                raise
            for (i, call), result in zip(sandbox, results, strict=True):
                ok, text = format_result(call.name, lease.settled(result))
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
                if not stale.turns and not stale.inflight:
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
        tasks = [task for queue in self._queues.values() for task in queue.close()]
        await asyncio.gather(*tasks, return_exceptions=True)
        self._queues.clear()
        if self._external is not None:
            await self._external.aclose()
