"""One shard of a sharded pool (shards.py): a process holding a ``SlotPool`` over hosts of its own.

Started by the front as ``python -m atropos.slots.shard_worker`` with the channel on its stdin and
stdout (shard_channel.py); its stdout is moved to a descriptor of its own first and fd 1 pointed at
stderr, so nothing a library prints can corrupt a frame. Its first frame names the backend factory,
the pool's settings and the shard's index; it answers ``ready`` with its capacity once its hosts
are up, then serves lease / call / release / status until ``stop`` or the end of its stdin (its
front is gone: the pool stops, its hosts with it).
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
from typing import Any

from atropos.errors import LeaseError
from atropos.slots.lease import Lease
from atropos.slots.pool import SlotPool
from atropos.slots.shard_channel import Message, Outbox, error_tuple, read_frame

log = logging.getLogger(__name__)


class ShardServer:
    """Serves the front's requests on one pool; its leases by the ids the front knows them by."""

    def __init__(self, pool: SlotPool, outbox: Outbox) -> None:
        self.pool = pool
        self.outbox = outbox
        self.leases: dict[int, Lease] = {}
        self._next = 0
        self.tasks: set[asyncio.Task[None]] = set()
        self.stopping = asyncio.Event()

    def dispatch(self, message: Message) -> None:
        rid, op, payload = message
        handler = getattr(self, f"_op_{op}", None)
        if handler is None:
            self.outbox.put((rid, False, error_tuple(LeaseError(f"unknown shard op {op!r}"))))
            return
        task = asyncio.ensure_future(self._answer(rid, handler(*payload)))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def _answer(self, rid: int, work: Any) -> None:
        try:
            value = await work
        except Exception as exc:  # every failure goes back to the caller, as its class
            self.outbox.put((rid, False, error_tuple(exc)))
        else:
            self.outbox.put((rid, True, value))

    def capacity(self) -> int:
        """The slots this shard can serve without the front holding requests back: those of its
        live hosts, plus those of the hosts its pool may still start (up to ``max_hosts``, each with
        the backend's ``slots_per_host``, or where a backend does not say, as many as its hosts have).
        Sent with every lease and release answer, so the front's count follows hosts lost, replaced
        and scaled rather than the shard's first host count; a shard whose hosts all died still
        counts the hosts it will start."""
        hosts = [h for h in self.pool.hosts.values() if h.leasable]
        per_host = self.pool.backend.host_slots() or max((h.info.slots for h in self.pool.hosts.values()), default=0)
        return sum(h.info.slots for h in hosts) + max(0, self.pool.cfg.max_hosts - len(hosts)) * per_host

    def _lease(self, lid: int) -> Lease:
        lease = self.leases.get(lid)
        if lease is None:
            raise LeaseError(f"lease {lid} is not held in this shard (released)")
        return lease

    async def _op_lease(self, trajectory_id: str, timeout: float | None, network: bool,
                        image: str | None) -> tuple[int, str, int, int, int]:
        lease = await self.pool.lease(trajectory_id, timeout, network=network, image=image)
        self._next += 1
        self.leases[self._next] = lease
        return self._next, lease.host.id, lease.slot, lease.generation, self.capacity()

    async def _op_call(self, lid: int, tool: str, args: dict[str, Any] | None, timeout_s: float | None,
                       call_id: str | None) -> tuple[Any, ...]:
        result = await self._lease(lid).call(tool, args, timeout_s=timeout_s, call_id=call_id)
        error = None if result.error is None else (result.error.code, result.error.message, result.error.status)
        return result.id, result.slot, result.ok, result.result, error, result.notes, result.duration_ms

    async def _op_release(self, lid: int) -> int:
        lease = self.leases.pop(lid, None)
        if lease is not None:
            await lease.release()
        return self.capacity()

    async def _op_status(self) -> dict[str, Any]:
        status = self.pool.status().model_dump()
        status["double_leased"] = self.pool.audit.double_leased
        return status

    async def _op_stop(self) -> None:
        self.stopping.set()


async def serve(reader: asyncio.StreamReader, write_fd: int) -> None:
    loop = asyncio.get_running_loop()
    transport, protocol = await loop.connect_write_pipe(asyncio.streams.FlowControlMixin, os.fdopen(write_fd, "wb"))
    writer = asyncio.StreamWriter(transport, protocol, None, loop)
    outbox = Outbox(writer.write)
    (_, _, (factory, cfg, index, step)) = (await read_frame(reader))[0]
    pool = SlotPool(factory(index, cfg.pool_id), cfg)
    try:
        await pool.start(step=step)
    except Exception as exc:
        outbox.put((0, False, error_tuple(exc)))
        outbox.flush()
        await writer.drain()
        return
    server = ShardServer(pool, outbox)
    outbox.put((0, True, server.capacity()))

    async def read_loop() -> None:
        try:
            while True:
                for message in await read_frame(reader):
                    server.dispatch(message)
        except (asyncio.IncompleteReadError, ConnectionError):
            server.stopping.set()  # the front is gone

    reading = asyncio.ensure_future(read_loop())
    await server.stopping.wait()
    reading.cancel()
    for task in list(server.tasks):
        task.cancel()
    await pool.stop()
    outbox.put((-1, True, None))  # stopped
    outbox.flush()
    await writer.drain()
    writer.close()


async def _main() -> None:
    write_fd = os.dup(1)
    os.dup2(2, 1)  # what anything prints (sys.stdout is fd 1) goes to stderr, never into a frame
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader(limit=1 << 20)
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin.buffer)
    await serve(reader, write_fd)


if __name__ == "__main__":
    logging.basicConfig(level=os.environ.get("ATROPOS_LOG_LEVEL", "WARNING"), stream=sys.stderr)
    asyncio.run(_main())
