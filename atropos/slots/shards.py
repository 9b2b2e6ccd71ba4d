"""A pool sharded over processes: calls/s that grow with the shards (issue 38, item 5).

One ``SlotPool`` is one asyncio process, and its CPU per call (the host exchange, the wire models,
the lease checks, the audit, the counters) caps it at a few thousand calls/s on a core. A
``ShardedPool`` runs N of them as child processes beside the trainer, each with hosts and a lease
table of its own (shard_worker.py), and routes: a lease is made in one shard and every call,
release and status of it goes to that shard (``ShardLease`` names it). The front keeps for each
call only a future and a few bytes in a frame that carries every message of one event-loop turn
(shard_channel.py), so the trainer's process pays a small fraction of what a pool pays per call.

What each shard keeps, as ``SlotPool`` does: no double lease (its hosts are its own: each shard's
pool id is ``<pool_id>.s<i>``, which its backend labels its hosts with, so no shard reaps
another's), health, the lease audit (``audit_path`` + ``.s<i>``), its status and counters.
Fair waiting is kept across shards: the front sends a lease to a shard only while that shard has
a slot not held (counted here), and otherwise queues it FIFO itself, so a request never waits in
a full shard while another has room, and requests are served in the order they came.

A shard that dies (its process exits, is killed, or its pipe closes) fails fast and visibly: its
calls in flight and every later call of its leases raise ``HostUnavailable`` naming the shard and
how it ended, its slots are no longer counted, and the front keeps leasing from the other shards.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sys
from collections import deque
from collections.abc import AsyncIterator, Callable
from typing import Any

from pydantic import BaseModel, Field

from atropos.backends.base import Backend
from atropos.errors import HostUnavailable, SlotUnavailable
from atropos.sandbox.contract.protocol import CallResult, ErrorInfo
from atropos.slots.config import PoolConfig
from atropos.slots.grant_wait import await_grant, drop_grant
from atropos.slots.lease import LeaseCalls
from atropos.slots.pool_status import PoolStatus
from atropos.slots.shard_channel import Message, Outbox, encode, error_from, read_frame

__all__ = ["BackendFactory", "ShardLease", "ShardedPool", "ShardedStatus"]

log = logging.getLogger(__name__)

# Builds shard i's backend in the shard's process: (shard index, the shard's pool id) -> Backend.
# Pickled to the shard, so a module-level function or a functools.partial of one. The backend must
# label its hosts with the pool id it is given (every backend of atropos/backends does, from its
# settings' pool_id) so that each shard's hosts are its own.
BackendFactory = Callable[[int, str], Backend]

STOP_GRACE_S = 30.0


class ShardedStatus(BaseModel):
    """Every shard's ``PoolStatus``, their totals, and the shards that died."""

    shards: list[PoolStatus]
    dead: dict[int, str] = Field(default_factory=dict, description="shard index -> how it ended")
    free: int
    leased: int
    waiting: int = Field(description="lease requests queued in the front and in the shards")
    calls_total: int
    calls_per_s: float
    double_leased: int = Field(description="double leases every shard's audit saw (0 unless a bug)")


class Shard:
    """The front's view of one shard process: its channel, requests in flight, slots held."""

    def __init__(self, index: int, proc: asyncio.subprocess.Process) -> None:
        self.index = index
        self.proc = proc
        assert proc.stdin is not None and proc.stdout is not None
        self.reader = proc.stdout
        self.writer = proc.stdin
        self.outbox = Outbox(self._write)
        self.pending: dict[int, asyncio.Future[Any]] = {}
        self._next = 0
        self.slots = 0  # the shard's capacity as of its last answer (shard_worker.ShardServer.capacity)
        self.held = 0  # leases granted or on their way to it, not yet released
        self.dead: str | None = None
        self.reading: asyncio.Task[None] | None = None
        self.leases: set[ShardLease] = set()
        self.stopping = False

    def stop(self) -> None:
        """Ask it to stop its pool and exit (the front stops reading it as failed)."""
        self.stopping = True
        if self.dead is None and self.proc.returncode is None:
            self.outbox.put((0, "stop", ()))
            self.outbox.flush()

    def __repr__(self) -> str:
        return f"Shard({self.index}, pid {self.proc.pid})"

    @property
    def room(self) -> int:
        return 0 if self.dead is not None else self.slots - self.held

    def _write(self, data: bytes) -> None:
        if self.dead is None:
            self.writer.write(data)

    def request(self, op: str, *payload: Any) -> asyncio.Future[Any]:
        fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        if self.dead is not None:
            fut.set_exception(self.gone())
            return fut
        self._next += 1
        self.pending[self._next] = fut
        self.outbox.put((self._next, op, payload))
        return fut

    def gone(self) -> HostUnavailable:
        return HostUnavailable(f"pool shard {self.index} (pid {self.proc.pid}) is dead: {self.dead}")

    def answered(self, messages: list[Message]) -> None:
        for rid, ok, value in messages:
            fut = self.pending.pop(rid, None)
            if fut is None or fut.done():
                continue
            if ok:
                fut.set_result(value)
            else:
                fut.set_exception(error_from(value))

    def reported(self, capacity: int) -> None:
        """The shard's capacity, as its answer to a lease or release gave it: hosts lost, replaced
        or scaled change it (shard_worker.ShardServer.capacity)."""
        self.slots = capacity

    def hold(self) -> None:
        self.held += 1

    def unhold(self) -> None:
        self.held -= 1

    def start_reading(self, slots: int, on_death: Callable[[Shard], None]) -> None:
        """The shard is up with room for ``slots`` leases (its capacity: the slots of its hosts and of
        those its pool may still start; updated by each lease and release answer): read its answers
        until its channel ends."""
        self.slots = slots

        async def loop() -> None:
            try:
                while True:
                    self.answered(await read_frame(self.reader))
            except (asyncio.IncompleteReadError, ConnectionError, ValueError) as exc:
                code = await self.proc.wait()
                if self.stopping:
                    return  # the pool stops it: ShardedPool.stop ends it quietly
                self.die(f"its process ended (exit code {code}; {type(exc).__name__})")
                on_death(self)

        self.reading = asyncio.ensure_future(loop())

    def die(self, reason: str, *, stopped: bool = False) -> None:
        """Its process is gone: every call in flight and every later call of its leases fails now."""
        if self.dead is not None:
            return
        self.dead = reason
        (log.info if stopped else log.error)("pool shard %d (pid %s) died: %s; its %d lease(s) are lost",
                                             self.index, self.proc.pid, reason, len(self.leases))
        error = self.gone()
        pending, self.pending = self.pending, {}
        for fut in pending.values():
            if not fut.done():
                fut.set_exception(error)
        for lease in self.leases:
            lease.lose(str(error))


class ShardLease(LeaseCalls):
    """One slot held by one trajectory in one shard: calls, release and verify all go to that shard."""

    def __init__(self, pool: ShardedPool, shard: Shard, lid: int, trajectory_id: str, host_id: str, slot: int,
                 generation: int) -> None:
        self.pool = pool
        self.shard = shard
        self.lid = lid
        self.trajectory_id = trajectory_id
        self.host_id = host_id
        self.slot = slot
        self.generation = generation
        self.released = False
        self.lost: str | None = None

    def __repr__(self) -> str:
        return (f"ShardLease({self.trajectory_id!r} -> shard {self.shard.index}: {self.host_id}/{self.slot} "
                f"gen {self.generation})")

    @property
    def key(self) -> tuple[int, str, int]:
        """``(shard, host id, slot)``: the slot this lease holds."""
        return (self.shard.index, self.host_id, self.slot)

    async def call(self, tool: str, args: dict[str, Any] | None = None, *, timeout_s: float | None = None,
                   call_id: str | None = None) -> CallResult:
        """As ``Lease.call``: tool failures in the result; LeaseError, HostUnavailable and the
        platform's errors raised (by the shard's ``Lease.call``, or here when the shard died)."""
        self.check()
        out = await self.shard.request("call", self.lid, tool, args, timeout_s, call_id)
        cid, slot, ok, result, error, notes, duration_ms = out
        # validated in the shard, from the host's bytes: rebuilt here without a second validation
        info = None if error is None else ErrorInfo.model_construct(code=error[0], message=error[1], status=error[2])
        return CallResult.model_construct(id=cid, slot=slot, ok=ok, result=result, error=info, notes=notes,
                                          duration_ms=duration_ms)

    async def release(self) -> None:
        await self.pool.release(self)


class _Waiter:
    __slots__ = ("future",)

    def __init__(self) -> None:
        self.future: asyncio.Future[Shard] = asyncio.get_running_loop().create_future()


class ShardedPool:
    """N ``SlotPool`` shards in child processes, one lease table each; the same lease/call/release."""

    def __init__(self, backend_factory: BackendFactory, cfg: PoolConfig | None = None, *, shards: int = 2,
                 start_step: int | None = None) -> None:
        if shards < 1:
            raise ValueError("a sharded pool has at least one shard")
        self.factory = backend_factory
        self.cfg = cfg or PoolConfig()
        self.count = shards
        self.start_step = start_step
        self.shards: list[Shard] = []
        self._waiters: deque[_Waiter] = deque()
        self._running = False
        self.last_status: ShardedStatus | None = None  # the latest status() (atropos/metrics.py shows it)

    def shard_cfg(self, index: int) -> PoolConfig:
        """Shard ``index``'s settings: the pool's, under a pool id and audit file of its own."""
        audit = None if self.cfg.audit_path is None else self.cfg.audit_path.with_name(
            f"{self.cfg.audit_path.name}.s{index}")
        return self.cfg.model_copy(update={"pool_id": f"{self.cfg.pool_id}.s{index}"[:64], "audit_path": audit})

    # -- lifecycle -------------------------------------------------------------------------
    async def start(self) -> None:
        """Start every shard and its hosts; raises the first shard's error if any could not start
        (the others are stopped)."""
        procs = [await asyncio.create_subprocess_exec(
            sys.executable, "-m", "atropos.slots.shard_worker", stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE, limit=1 << 20) for _ in range(self.count)]
        self.shards = [Shard(i, proc) for i, proc in enumerate(procs)]
        for shard in self.shards:
            shard.writer.write(encode([(0, "init", (self.factory, self.shard_cfg(shard.index), shard.index,
                                                     self.start_step))]))
        try:
            ready = await asyncio.gather(*(self._ready(s) for s in self.shards))
        except BaseException:
            await self.stop()
            raise
        for shard, slots in zip(self.shards, ready, strict=True):
            shard.start_reading(slots, self._shard_died)
        self._running = True

    @staticmethod
    async def _ready(shard: Shard) -> int:
        try:
            messages = await read_frame(shard.reader)
        except (asyncio.IncompleteReadError, ConnectionError) as exc:
            code = await shard.proc.wait()
            raise HostUnavailable(f"pool shard {shard.index} ended before it was ready (exit code {code})") from exc
        _, ok, value = messages[0]
        if not ok:
            raise error_from(value)
        return int(value)

    async def stop(self) -> None:
        """Stop every shard (its pool, its hosts); leases still held become invalid. Safe twice."""
        self._running = False
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.future.done():
                waiter.future.set_exception(SlotUnavailable("the pool is stopping"))
        for shard in self.shards:
            shard.stop()
        for shard in self.shards:
            try:
                await asyncio.wait_for(shard.proc.wait(), STOP_GRACE_S)
            except TimeoutError:
                log.error("pool shard %d did not stop within %gs: killed", shard.index, STOP_GRACE_S)
                with contextlib.suppress(ProcessLookupError):
                    shard.proc.kill()
                await shard.proc.wait()
            if shard.reading is not None:
                with contextlib.suppress(asyncio.CancelledError):
                    await shard.reading
            shard.die("the pool stopped", stopped=True)

    async def __aenter__(self) -> ShardedPool:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    def _shard_died(self, shard: Shard) -> None:
        if self._running and not any(s.dead is None for s in self.shards):
            while self._waiters:  # nobody is left to serve them
                waiter = self._waiters.popleft()
                if not waiter.future.done():
                    waiter.future.set_exception(shard.gone())

    # -- leasing ---------------------------------------------------------------------------
    def _roomiest(self) -> Shard | None:
        best = max(self.shards, key=lambda s: s.room, default=None)
        return best if best is not None and best.room > 0 else None

    def _grant_waiters(self) -> None:
        while self._waiters:
            shard = self._roomiest()
            if shard is None:
                return
            waiter = self._waiters.popleft()
            if not waiter.future.done():
                shard.hold()
                waiter.future.set_result(shard)

    async def _pick(self, timeout: float) -> Shard:
        """A shard with room, reserved for this request: at once when nobody waits, else in FIFO order."""
        if not self._waiters:
            shard = self._roomiest()
            if shard is not None:
                shard.hold()
                return shard
        if not any(s.dead is None for s in self.shards):
            raise self.shards[0].gone()
        waiter = _Waiter()
        self._waiters.append(waiter)
        shard = await await_grant(waiter.future, timeout, lambda: self._abandon(waiter))
        if shard is None:
            raise SlotUnavailable(
                f"no slot within {timeout:g}s: {sum(s.slots for s in self.shards if s.dead is None)} slots in "
                f"{sum(s.dead is None for s in self.shards)} live shard(s), {len(self._waiters)} request(s) queued")
        return shard

    def _abandon(self, waiter: _Waiter) -> None:
        drop_grant(waiter.future, Shard.unhold)
        with contextlib.suppress(ValueError):
            self._waiters.remove(waiter)
        self._grant_waiters()

    async def lease(self, trajectory_id: str, timeout: float | None = None, *, network: bool = False,
                    image: str | None = None) -> ShardLease:
        """Lease one slot in one shard, waiting FIFO (across all shards) up to ``timeout`` seconds."""
        if not self._running:
            raise SlotUnavailable("the pool is not running")
        timeout = self.cfg.acquire_timeout_s if timeout is None else timeout
        shard = await self._pick(timeout)
        fut = shard.request("lease", trajectory_id, timeout, network, image)
        try:
            lid, host_id, slot, generation, capacity = await asyncio.shield(fut)
        except asyncio.CancelledError:
            # the caller left: a lease the shard still grants is given straight back
            fut.add_done_callback(lambda f: self._give_back(shard, f))
            raise
        except BaseException:
            shard.unhold()
            self._grant_waiters()
            raise
        shard.reported(capacity)
        lease = ShardLease(self, shard, lid, trajectory_id, host_id, slot, generation)
        shard.leases.add(lease)
        if self._waiters:
            self._grant_waiters()  # the answer may have brought more room (a host its pool started)
        return lease

    def _give_back(self, shard: Shard, fut: asyncio.Future[Any]) -> None:
        if not fut.cancelled() and fut.exception() is None:
            shard.request("release", fut.result()[0])
        shard.unhold()
        self._grant_waiters()

    async def release(self, lease: ShardLease) -> None:
        """End a lease in its shard (the slot is reset there and freed, or quarantined). Idempotent;
        a lease of a dead shard ends here with nothing to send."""
        if not lease.end():
            return
        shard = lease.shard
        shard.leases.discard(lease)
        if shard.dead is not None:
            return
        try:
            # shielded, as SlotPool.release: a caller cancelled mid-release must not strand the slot
            shard.reported(await asyncio.shield(shard.request("release", lease.lid)))
        except HostUnavailable:
            if shard.dead is None:
                raise
        finally:
            shard.unhold()
            self._grant_waiters()

    @contextlib.asynccontextmanager
    async def leased(self, trajectory_id: str, timeout: float | None = None, **kw: Any) -> AsyncIterator[ShardLease]:
        lease = await self.lease(trajectory_id, timeout, **kw)
        try:
            yield lease
        finally:
            await self.release(lease)

    # -- status ----------------------------------------------------------------------------
    def waiting_in_front(self) -> int:
        """Lease requests queued in the front (no shard had a slot not held for them)."""
        return len(self._waiters)

    async def status(self) -> ShardedStatus:
        """Every live shard's status, and the totals."""
        live = [s for s in self.shards if s.dead is None]
        answers = await asyncio.gather(*(s.request("status") for s in live), return_exceptions=True)
        shards, double = [], 0
        for answer in answers:
            if isinstance(answer, BaseException):
                continue  # it died meanwhile: listed under dead
            double += answer.pop("double_leased", 0)
            shards.append(PoolStatus.model_validate(answer))
        self.last_status = ShardedStatus(
            shards=shards, dead={s.index: s.dead for s in self.shards if s.dead is not None},
            free=sum(s.free for s in shards), leased=sum(s.leased for s in shards),
            waiting=len(self._waiters) + sum(s.waiting for s in shards),
            calls_total=sum(s.calls_total for s in shards), calls_per_s=sum(s.calls_per_s for s in shards),
            double_leased=double)
        return self.last_status
