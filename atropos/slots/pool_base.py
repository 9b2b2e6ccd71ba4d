"""What every part of the SlotPool shares: its state, its background tasks and the FIFO queue of
requests waiting for slots. The parts build on it in a line: ``PoolBase`` -> ``PoolHosts``
(hosts, health, scaling; pool_hosts.py) -> ``PoolTemplates`` (pool_templates.py) -> ``SlotPool``
(leasing; pool.py)."""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Coroutine
from dataclasses import dataclass, field
from typing import Any

from atropos.backends.base import Backend
from atropos.slots.audit import LeaseAudit
from atropos.slots.config import PoolConfig
from atropos.slots.lease import Lease, PoolHost


@dataclass
class _Waiter:
    ids: list[str]
    network: bool
    future: asyncio.Future[list[Lease]] = field(default_factory=lambda: asyncio.get_running_loop().create_future())
    colocate: bool = False
    prefer: frozenset[str] = frozenset()


class PoolBase:
    def __init__(self, backend: Backend, cfg: PoolConfig | None = None) -> None:
        self.backend = backend
        self.cfg = cfg or PoolConfig()
        self.hosts: dict[str, PoolHost] = {}
        self.audit = LeaseAudit(self.cfg.audit_path)
        self._waiters: deque[_Waiter] = deque()
        self._starting = 0
        self._scale = asyncio.Event()
        self._tasks: set[asyncio.Task[None]] = set()
        self._running = False
        self._leases_total = 0
        self._calls_total = 0
        self._call_times: deque[float] = deque(maxlen=10_000)
        self._lost_hosts = 0
        self._scale_ups = 0
        self._scale_downs = 0
        self._quarantines = 0

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def free_count(self) -> int:
        """Slots that could be leased right now, on hosts that take leases."""
        return sum(len(h.free) for h in self.hosts.values() if h.leasable)

    def _grant_waiters(self) -> None:
        """Hand free slots to the requests at the head of the queue (defined by the leasing part)."""
        raise NotImplementedError
