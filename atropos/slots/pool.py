"""SlotPool: one slot per trajectory across many warm hosts; fair waiting, health, scaling.

The pool holds the host-issued lease token of every free slot, so leasing is a local pop
(microseconds) and releasing is one reset request that hands back a fresh token. A slot is in
exactly one place at a time: a host's free list, one ``Lease``, or nowhere (being reset, lost
with its host, or quarantined); nothing ever puts a leased slot back in a free list except the
reset that ends its lease.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import AsyncIterable, AsyncIterator, Awaitable, Callable, Coroutine, Sequence
from typing import Any

from atropos import memstats
from atropos.backends.base import Backend
from atropos.errors import (
    AtroposSandboxError,
    GroupTooLarge,
    HostUnavailable,
    ImageRejected,
    LeaseError,
    SlotUnavailable,
)
from atropos.sandbox.contract.imageref import ImageRef
from atropos.sandbox.contract.launch import make_undumpable
from atropos.sandbox.contract.protocol import ImageInfo, ResetResult
from atropos.slots.audit import LeaseAudit
from atropos.slots.background import Background
from atropos.slots.config import PoolConfig
from atropos.slots.lease import Lease, PoolHost, PoolTemplate
from atropos.slots.pool_hosts import HostFleet
from atropos.slots.pool_queue import SlotQueue
from atropos.slots.pool_status import HostStatus, PoolStatus
from atropos.slots.pool_templates import TemplateShipper

__all__ = ["GroupTooLarge", "HostStatus", "PoolStatus", "SlotPool"]

log = logging.getLogger(__name__)
# How long the pool keeps a host's refusal of an image in mind (sending it elsewhere meanwhile): a
# refusal for room in its store, or a node that lacked the image, may not last.
IMAGE_REFUSAL_TTL_S = 300.0

RATE_WINDOW_S = 10  # status().calls_per_s: the calls of the last this many seconds


class SlotPool:
    """The pool: leasing and release, over collaborators that each own their state: the host fleet
    (hosts, health, scaling; pool_hosts.py), the slot queue (free slots to leases, FIFO waiters;
    pool_queue.py), the template shipper (pool_templates.py) and the background tasks
    (background.py). Status models: pool_status.py."""

    def __init__(self, backend: Backend, cfg: PoolConfig | None = None) -> None:
        self.backend = backend
        self.cfg = cfg or PoolConfig()
        self.audit = LeaseAudit(self.cfg.audit_path)
        self.background = Background()
        self.fleet = HostFleet(backend, self.cfg, self.audit, self.background,
                               on_capacity=lambda: self.queue._grant_waiters(), demand=lambda: self.queue.demand())
        self.queue = SlotQueue(self, self.fleet, self.audit, release=self._begin_release)
        self.templates = TemplateShipper(self.fleet)
        self._calls_total = 0
        # calls per whole second of the last RATE_WINDOW_S: the calls/s rate in O(1) memory (a time per
        # call kept 10,000 floats, ~320 KB filled over a soak's first thousand trajectories; issue 40)
        self._call_seconds: deque[list[int]] = deque(maxlen=RATE_WINDOW_S + 1)  # [second, calls]
        self._quarantines = 0
        self._shipping: dict[tuple[str, str], asyncio.Future[None]] = {}  # images on their way to a host

    @property
    def hosts(self) -> dict[str, PoolHost]:
        """The pool's hosts by id (owned by the fleet)."""
        return self.fleet.hosts

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
        return self.background.spawn(coro)

    # -- lifecycle -------------------------------------------------------------------------
    async def start(self, *, step: int | None = None) -> None:
        """Reap what crashed earlier pools left, start ``min_hosts`` hosts and the health and scaling
        loops. Raises the first error only when no host could start.

        ``step``: start the hosts that many at a time (each start leases every slot of its host at
        once: 100 hosts x 64 slots started together open 6,400 connections and time out connecting;
        benchmarks/README.md, "The limit")."""
        if not self.cfg.dumpable:
            # before the first host token exists: this process will hold every one of them, and
            # every other process of the user (a Ray job, another trainer) could read its memory
            make_undumpable()
        reaped = await self.backend.reap_orphans()
        if reaped:
            log.info("reaped %d orphaned host(s) of earlier pools", reaped)
        self.background.start()
        # No host prewarms while others still start (on a shared machine the first hosts' sandboxes
        # would take the CPU the last ones need to come up): the fleet is asked once all of it is up.
        step = step or self.cfg.min_hosts
        results: list[PoolHost | BaseException] = []
        for first in range(0, self.cfg.min_hosts, max(step, 1)):
            results += await asyncio.gather(
                *(self.fleet._add_host(prewarm=False) for _ in range(min(step, self.cfg.min_hosts - first))),
                return_exceptions=True)
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors and len(errors) == len(results):
            await self.stop()
            raise errors[0]
        self.fleet._request_prewarm([r for r in results if not isinstance(r, BaseException)])
        self._spawn(self.fleet._health_loop())
        self._spawn(self.fleet._scale_loop())
        if self.cfg.malloc_trim_interval_s is not None:
            # the pool's process is the trainer's: freed pages of its millions of leases (and of the
            # trainer) go back to the kernel; issue 40, benchmarks/README.md
            self._spawn(memstats.trim_periodically(self.cfg.malloc_trim_interval_s))

    async def stop(self) -> None:
        """Stop every host and loop; leases still held become invalid. Safe to call twice."""
        await self.background.stop()
        self.queue.fail_all("the pool is stopping")
        for host in self.fleet.forget_all():
            for lease in host.leases.values():
                lease.lose("the pool stopped")
            await host.client.aclose()
        await self.backend.close()
        self.audit.close()

    async def __aenter__(self) -> SlotPool:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    # -- leasing ---------------------------------------------------------------------------
    def max_slots(self) -> int | None:
        """The most slots this pool can ever hold (None while the host size is unknown)."""
        per_host = max((h.info.slots for h in self.hosts.values()), default=None) or self.backend.host_slots()
        return None if per_host is None else per_host * self.cfg.max_hosts

    async def lease(self, trajectory_id: str, timeout: float | None = None, *, network: bool = False,
                    template: PoolTemplate | None = None, image: str | ImageRef | None = None) -> Lease:
        """Lease one slot for a trajectory, waiting FIFO up to ``timeout`` seconds; with
        ``template`` the slot starts as a copy-on-write fork of it; with ``image`` its ``/`` is a
        fresh root of that task image (docs/task-images.md)."""
        return (await self.lease_many([trajectory_id], timeout, network=network, template=template,
                                      image=image))[0]

    async def lease_many(self, trajectory_ids: Sequence[str], timeout: float | None = None, *,
                         network: bool = False, template: PoolTemplate | None = None,
                         colocate: bool | None = None, image: str | ImageRef | None = None) -> list[Lease]:
        """Lease one slot per id, all or nothing (a GRPO group starts together).

        ``template``: every slot starts as a fresh copy-on-write fork of it. ``image``: every
        slot's root is a fresh root of that task image (``ImageRef``: a Docker engine reference,
        ``oci:DIR[:TAG]``, ``derived:...``, ``docker://...``; parsed here, ImageRejected if it is none).
        ``colocate`` (default: when a template or image is given) puts the group on as few hosts as
        possible, preferring hosts that already hold the template or image."""
        if not self.background.running:
            raise SlotUnavailable("the pool is not running")
        if template is not None and image is not None:
            raise ValueError("a slot's root is a task image or its workspace a template fork, not both")
        image = None if image is None else ImageRef.parse(image)  # the pool's boundary: one type from here
        ids = list(trajectory_ids)
        # A single slot always fits (max_hosts >= 1, hosts have >= 1 slot): skip the walk over hosts.
        most = self.max_slots() if len(ids) > 1 else None
        if most is not None and len(ids) > most:
            raise GroupTooLarge(
                f"a group of {len(ids)} can never be leased: the pool holds at most {most} slots "
                f"(max_hosts {self.cfg.max_hosts} x {most // self.cfg.max_hosts} slots per host)")
        colocate = (template is not None or image is not None) if colocate is None else colocate
        prefer = frozenset(template.copies) if template is not None else frozenset()
        avoid: frozenset[str] = frozenset()
        if image is not None:
            prefer = frozenset(h.id for h in self.hosts.values() if image in h.images)
            avoid = self._refusing(image)
        if self.queue.can_take_now(len(ids), avoid):
            leases = self.queue._take_group(ids, network, colocate, prefer, image, avoid)
        else:
            leases = await self.queue._wait(ids, network, self.cfg.acquire_timeout_s if timeout is None else timeout,
                                            colocate, prefer, image, avoid)

        async def prepare(lease: Lease) -> None:
            # its root already is a fresh one of the reference (as of the slot's last reset)
            warm = template is None and lease.image == image
            if warm and (image is None or image.fixed):  # the same image for good
                if network:
                    await (self._enable_network(lease) if image is None else
                           lease.reset(network=True, image=image))
                return
            if image is not None:
                try:
                    # shipped first to a host that cannot get it itself (Lease.reset); a warm slot is
                    # kept only if the reference still names the image its root was made of (a tag
                    # moved meanwhile: reset to what it names now), in the one request
                    await lease.reset(template, network=network or None, image=image, keep_if_fresh=warm)
                except ImageRejected as exc:
                    # named by where it ran (a Ray or Nomad node): the host's address alone may be
                    # a loopback one, the same on every node
                    node = lease.host.info.labels.get("node")
                    named = type(exc)(f"host {lease.host.id}" + (f" on node {node}" if node else "") + f": {exc}")
                    lease.host.refused[image] = (time.monotonic(), str(named))
                    raise named from None
                return
            await lease.reset(template, network=network or None, image=image)

        if template is not None or network or (image is not None and not image.fixed) or \
                any(lease.image != image for lease in leases):
            try:
                await self._prepare_or_release(leases, prepare)
            except ImageRejected:
                # a host refused it (a Ray node without the image): elsewhere, if a host has not
                if image is None or self._refusing(image) == avoid:
                    raise
                return await self.lease_many(trajectory_ids, timeout, network=network, colocate=colocate,
                                             image=image)
        return leases

    def _refusing(self, image: ImageRef) -> frozenset[str]:
        """Hosts that refused ``image`` lately; every host of the pool: ImageRejected now, with
        their reasons (no slot is taken for an image no host will serve)."""
        refusing = {h.id: why for h in self.hosts.values()
                    if (why := h.refusal(image, IMAGE_REFUSAL_TTL_S)) is not None}
        if self.hosts and len(refusing) == len(self.hosts):
            raise ImageRejected(f"every host of the pool refused {image!r}: " + "; ".join(refusing.values()))
        return frozenset(refusing)

    async def _enable_network(self, lease: Lease) -> None:
        result = await lease.host.guard(lease.host.client.reset(
            lease.slot, lease.token, trajectory_id=lease.trajectory_id, network=True))
        if not result.ok or result.lease is None:
            raise HostUnavailable(f"could not enable network on {lease!r}: {result.detail}")
        lease.renewed(result.lease.lease, result.lease.generation)

    async def release(self, lease: Lease) -> None:
        """End a lease: the slot is reset and returns to the pool, or is quarantined. Idempotent."""
        reset = self._begin_release(lease)
        if reset is not None:
            # Shielded: a caller cancelled mid-release must not strand the slot half-reset.
            await asyncio.shield(reset)

    def _begin_release(self, lease: Lease) -> asyncio.Task[None] | None:
        """The synchronous part of ``release``: the lease ends now and its reset is already
        running when this returns, so no cancellation can come between the two."""
        if not lease.end():
            return None
        host = lease.host
        host.drop(lease)
        self.audit.record("release", lease.trajectory_id, host.id, lease.slot, lease.generation)
        if lease.lost is not None or host.dead.is_set():
            return None
        return self._spawn(self._reset_back(host, lease))

    async def _prepare_or_release(self, leases: list[Lease], prepare: Callable[[Lease], Awaitable[object]]) -> None:
        """Run ``prepare`` on every lease of a fresh group; if any fails or the caller is
        cancelled, release the whole group before re-raising (all or nothing: the caller never
        saw these leases, so nobody else would ever give the slots back)."""
        steps = [asyncio.ensure_future(prepare(lease)) for lease in leases]
        try:
            await asyncio.gather(*steps)
        except BaseException:
            # Stop the siblings first: a prepare still rotating a slot's token would race the
            # release's reset (one of the two is then refused and the slot lost).
            for step in steps:
                step.cancel()
            with contextlib.suppress(BaseException):
                await asyncio.wait(steps)
            # Started synchronously (not as gather'd coroutines, which a cancellation could
            # kill before their first step) and then awaited shielded.
            resets = [t for t in (self._begin_release(lease) for lease in leases) if t is not None]
            with contextlib.suppress(BaseException):
                await asyncio.shield(asyncio.gather(*resets, return_exceptions=True))
            raise

    async def _reset_back(self, host: PoolHost, lease: Lease) -> None:
        try:
            result, keep = await self._release_reset(host, lease)
        except HostUnavailable:
            self.fleet.suspect(host)
            return
        except LeaseError as exc:
            self.quarantine(host, lease.slot, f"reset refused: {exc}")
            return
        if result.ok and result.lease is not None:
            host.give_back(lease.slot, result.lease.lease, result.lease.generation, keep)
            self.queue._grant_waiters()
        else:
            self.quarantine(host, lease.slot, result.detail)

    async def _release_reset(self, host: PoolHost, lease: Lease) -> tuple[ResetResult, str | None]:
        """The release's reset, to a fresh root of the lease's image (prewarmed: the next lease of it
        starts at once), or to the default root when the image cannot be had any more (untagged,
        evicted). network=False: a free slot never keeps the network a previous lease had."""
        def reset(image: str | None) -> Awaitable[ResetResult]:
            return host.guard(host.client.reset(lease.slot, lease.token, network=False,
                                                trajectory_id=f"pool:{self.cfg.pool_id}", image=image))

        if lease.image is not None:
            try:
                return await reset(lease.image), lease.image
            except (HostUnavailable, LeaseError):
                raise
            except AtroposSandboxError as exc:
                log.info("release of %r keeps no image root (%s)", lease, exc)
        return await reset(None), None

    def quarantine(self, host: PoolHost, slot: int, why: str) -> None:
        """Count a slot that failed its reset: it never returns to the free list."""
        host.quarantine_slot()
        self._quarantines += 1
        log.error("slot %s/%d quarantined: %s", host.id, slot, why)

    @contextlib.asynccontextmanager
    async def leased(self, trajectory_id: str, timeout: float | None = None, *,
                     network: bool = False, template: PoolTemplate | None = None,
                     image: str | None = None) -> AsyncIterator[Lease]:
        """``async with pool.leased(tid) as lease:``: ``lease`` for the block, released after it
        (also on error or cancellation)."""
        lease = await self.lease(trajectory_id, timeout, network=network, template=template, image=image)
        try:
            yield lease
        finally:
            await self.release(lease)

    # -- status ----------------------------------------------------------------------------
    def count_call(self, n: int = 1) -> None:
        """Count ``n`` tool calls for ``status()`` (the calls/s rate and the total)."""
        self._calls_total += n
        second = int(time.monotonic())
        if self._call_seconds and self._call_seconds[-1][0] == second:
            self._call_seconds[-1][1] += n
        else:
            self._call_seconds.append([second, n])

    def status(self) -> PoolStatus:
        """A snapshot: hosts, free/leased slots, lease ages, calls, scaling and quarantine counts."""
        now = time.monotonic()
        hosts = []
        for h in self.hosts.values():
            ages = [now - lease.leased_at for lease in h.leases.values()]
            hosts.append(HostStatus(
                id=h.id, address=h.info.address, slots=h.info.slots, free=len(h.free), leased=len(h.leases),
                quarantined=h.quarantined, healthy=h.leasable and h.failures == 0,
                health_ms=None if h.last_health_ms is None else round(h.last_health_ms, 2),
                oldest_lease_s=round(max(ages), 1) if ages else None, node=h.info.labels.get("node"),
                images=sorted(h.images),
            ))
        # the current second (still counting) and the RATE_WINDOW_S - 1 before it
        current = int(now)
        recent = sum(n for second, n in self._call_seconds if current - RATE_WINDOW_S < second <= current)
        return PoolStatus(
            pool_id=self.cfg.pool_id, backend=self.backend.name, hosts=hosts, starting_hosts=self.fleet.starting,
            free=sum(h.free for h in hosts), leased=sum(h.leased for h in hosts),
            quarantined=sum(h.quarantined for h in hosts),
            waiting=self.queue.waiting(), leases_total=self.queue.leases_total, calls_total=self._calls_total,
            calls_per_s=round(recent / RATE_WINDOW_S, 2), lost_hosts=self.fleet.lost_hosts,
            scale_ups=self.fleet.scale_ups, scale_downs=self.fleet.scale_downs, quarantines=self._quarantines,
        )

    # -- the collaborators' public parts, under the names users and leases call -------------
    def free_count(self) -> int:
        """Slots that could be leased right now, on hosts that take leases."""
        return self.fleet.free_count()

    def declare_dead(self, host: PoolHost, reason: str) -> None:
        """Take ``host`` out of service: its leases are lost (their calls raise HostUnavailable)."""
        self.fleet.declare_dead(host, reason)

    def suspect(self, host: PoolHost) -> None:
        """A call saw a transport error: probe ``host`` now, lease nothing from it until a probe passes."""
        self.fleet.suspect(host)

    async def _ship_image(self, host: PoolHost, reference: ImageRef) -> None:
        """The backend gives ``host`` the image if it cannot get it itself (a Docker container's
        host); one shipment per host and image at a time, however many leases wait for it."""
        key = (host.id, reference)
        task = self._shipping.get(key)
        if task is None:
            task = asyncio.ensure_future(host.guard(self.backend.ship_image(host.client, reference)))
            self._shipping[key] = task
            task.add_done_callback(lambda _: self._shipping.pop(key, None))
        await asyncio.shield(task)

    async def prepare_images(self, references: Sequence[str | ImageRef]) -> dict[str, list[ImageInfo]]:
        """Import task images into every running host's layer store now, so a later lease of them
        starts without waiting for the import (docs/task-images.md). Per host id: what it holds."""
        hosts = [h for h in self.hosts.values() if h.leasable]
        refs = [ImageRef.parse(r) for r in references]  # all refused before any host is asked

        async def prepare(host: PoolHost) -> list[ImageInfo]:
            infos = []
            for ref in refs:
                await self._ship_image(host, ref)
                infos.append(await host.guard(host.client.prepare_image(ref)))
                host.images.add(ref)
            return infos

        done = await asyncio.gather(*(prepare(h) for h in hosts))
        return {h.id: infos for h, infos in zip(hosts, done, strict=True)}

    async def template_from_lease(self, lease: Lease, name: str = "") -> PoolTemplate:
        """Snapshot a leased slot's workspace as a template (see ``TemplateShipper.template_from_lease``)."""
        return await self.templates.template_from_lease(lease, name)

    async def create_template(self, source: str, *, name: str = "", **fields: Any) -> PoolTemplate:
        """A template from a host-side source ("dir": path=, "git": url=, ref=, depth=) on one host."""
        return await self.templates.create_template(source, name=name, **fields)

    async def upload_template(self, data: bytes | AsyncIterable[bytes], *, name: str = "",
                              gzip: bool = False) -> PoolTemplate:
        """A template from a tar archive, unpacked on one host (shipped to others on use)."""
        return await self.templates.upload_template(data, name=name, gzip=gzip)

    async def image_on(self, reference: ImageRef, host: PoolHost) -> None:
        """Give ``host`` the task image ``reference`` if it cannot get it itself (the backend ships
        it: a Docker or Nomad host), once however many leases wait for it."""
        await self._ship_image(host, reference)

    async def template_on(self, template: PoolTemplate, host: PoolHost) -> str:
        """The template's id on ``host``, shipping it there first (once) if needed."""
        return await self.templates.template_on(template, host)

    async def fork(self, lease: Lease, template: PoolTemplate) -> None:
        """Reset a lease to a fresh copy-on-write fork of ``template`` (the lease is kept)."""
        await lease.reset(template)

    async def delete_template(self, template: PoolTemplate) -> None:
        """Delete every host's copy; copies still in use stay and are logged."""
        await self.templates.delete_template(template)
