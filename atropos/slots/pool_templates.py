"""The SlotPool's workspace templates: made on one host, shipped to another on first use there,
deleted everywhere."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterable
from typing import Any

from atropos.errors import HostUnavailable, TemplateInUse, UnknownTemplate, WorkspaceError
from atropos.slots.lease import Lease, PoolHost, PoolTemplate
from atropos.slots.pool_hosts import HostFleet

log = logging.getLogger("atropos.slots.pool")


class TemplateShipper:
    """Makes templates on one host and ships them to others on first use; owns no hosts (it reads
    the fleet's) and keeps each template's copies on the ``PoolTemplate`` itself."""

    def __init__(self, fleet: HostFleet) -> None:
        self._fleet = fleet

    @property
    def hosts(self) -> dict[str, PoolHost]:
        return self._fleet.hosts

    async def template_from_lease(self, lease: Lease, name: str = "") -> PoolTemplate:
        """Snapshot a leased slot's workspace (e.g. after a group's setup ran in it) as a
        template. The lease stays valid; its workspace becomes a fresh fork of the template."""
        lease.check()
        try:
            info = await lease.host.guard(lease.host.client.template_from_slot(lease.slot, lease.token, name=name))
        except HostUnavailable:
            self._fleet.suspect(lease.host)
            raise
        template = PoolTemplate(name=name, info=info, copies={lease.host.id: info.id})
        lease.forked_from(template)
        log.info("template %s (%s) made from %r: %d files, %.1f MB", info.id, name, lease, info.files,
                 info.bytes / 1e6)
        return template

    async def create_template(self, source: str, *, name: str = "", **fields: Any) -> PoolTemplate:
        """A template from a host-side source ("dir": path=, "git": url=, ref=, depth=) on one host."""
        host = self._template_host()
        info = await host.guard(host.client.create_template(source, name=name, **fields))
        return PoolTemplate(name=name, info=info, copies={host.id: info.id})

    async def upload_template(self, data: bytes | AsyncIterable[bytes], *, name: str = "",
                              gzip: bool = False) -> PoolTemplate:
        """A template from a tar archive, unpacked on one host (shipped to others on use)."""
        host = self._template_host()
        info = await host.guard(host.client.upload_template(data, name=name, gzip=gzip))
        return PoolTemplate(name=name, info=info, copies={host.id: info.id})

    def _template_host(self) -> PoolHost:
        live = [h for h in self.hosts.values() if not h.dead.is_set()]
        if not live:
            raise HostUnavailable("the pool has no live host")
        return max(live, key=lambda h: len(h.free))

    async def template_on(self, template: PoolTemplate, host: PoolHost) -> str:
        """The template's id on ``host``, shipping it there first (once) if needed."""
        if template.deleted:
            raise UnknownTemplate(f"template {template.id} was deleted")
        if host.id in template.copies:
            return template.copies[host.id]
        pending = template.shipping.get(host.id)
        if pending is None:
            pending = asyncio.ensure_future(self._ship(template, host))
            template.shipping[host.id] = pending
            pending.add_done_callback(lambda _f: template.shipping.pop(host.id, None))
        return await asyncio.shield(pending)

    async def _ship(self, template: PoolTemplate, host: PoolHost) -> str:
        sources = [self.hosts[h] for h in template.copies if h in self.hosts and not self.hosts[h].dead.is_set()]
        if not sources:
            raise WorkspaceError(f"template {template.id}: no live host holds it any more")
        source = sources[0]
        t0 = time.perf_counter()
        async with contextlib.aclosing(source.client.template_archive(template.copies[source.id])) as stream:
            info = await host.guard(host.client.upload_template(stream, name=template.name))
        if info.tree_hash != template.tree_hash:
            await host.client.delete_template(info.id)
            raise WorkspaceError(f"template {template.id} shipped to {host.id} arrived different "
                                 f"({info.tree_hash[:12]} != {template.tree_hash[:12]})")
        template.copies[host.id] = info.id
        log.info("template %s shipped %s -> %s (%.1f MB) in %.0f ms", template.id, source.id, host.id,
                 info.bytes / 1e6, (time.perf_counter() - t0) * 1000)
        return info.id

    async def delete_template(self, template: PoolTemplate) -> None:
        """Delete every host's copy. Copies still in use (a slot built on them) stay and are
        logged; release or reset those slots first."""
        template.mark_deleted()
        for pending in list(template.shipping.values()):
            with contextlib.suppress(BaseException):
                await pending
        for host_id, template_id in list(template.copies.items()):
            host = self.hosts.get(host_id)
            if host is None or host.dead.is_set():
                template.copies.pop(host_id, None)
                continue
            try:
                await host.guard(host.client.delete_template(template_id))
                template.copies.pop(host_id, None)
            except UnknownTemplate:
                template.copies.pop(host_id, None)
            except (TemplateInUse, HostUnavailable) as exc:
                log.warning("template %s on %s not deleted: %s", template_id, host_id, exc)
