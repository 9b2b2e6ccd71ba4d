"""``NomadBackend``: the pool's calls (start, stop, alive, close) as moves on the Nomad job.

How each call maps onto Nomad is told in the package docstring (``atropos/backends/nomad/__init__.py``).
Here: the background tasks (the watch that keeps the allocation cache fresh, the janitor that gives
back what ``stop_host`` could not finish), scaling up, giving back, and the host's health wait. The
state lives in the ``AllocationLedger``; a start's own state in ``HostStart``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Any

import httpx

from atropos.backends.base import Backend, HostInfo, new_token
from atropos.backends.image_shipping import RegistryShipper, ship
from atropos.backends.nomad.allocs import Alloc, AllocDied, alloc_address, index_of, is_live, is_usable
from atropos.backends.nomad.api import JobGone, NomadAPI, group_count
from atropos.backends.nomad.config import NomadBackendConfig
from atropos.backends.nomad.ledger import AllocationLedger, NameRoles
from atropos.backends.nomad.owner import JobOwner
from atropos.backends.nomad.start import HostStart
from atropos.errors import ConfigError, HostUnavailable, ImageRejected, NomadAPIError, NomadUnreachable
from atropos.sandbox.contract.client import HostClient
from atropos.sandbox.contract.imageref import ImageRef

log = logging.getLogger(__name__)

SCALE_BLOCKED = "job scaling blocked due to active deployment"
SUSPECT_GRACE_S = 5.0  # a host that stopped answering: how long Nomad gets to report (and reschedule) it
STATS = ("scale_up", "scale_down", "scale_blocked", "alloc_stop", "adopted", "reaped", "unreachable")


class NomadBackend(Backend):
    name = "nomad"

    def __init__(self, cfg: NomadBackendConfig | None = None) -> None:
        self.cfg = cfg or NomadBackendConfig()
        self._token = new_token()  # one per pool; see the package docstring for how it travels
        self._instance = new_token()[:12]
        self.stats: dict[str, int] = dict.fromkeys(STATS, 0)
        self._docker_client: Any = None  # the engine task images are shipped from (ship_image), once asked
        self._registries = RegistryShipper()  # registry images shipped to the hosts (ship_image)
        self.api = NomadAPI(self.cfg, self._instance)
        self.owner = JobOwner(self.api, self._token, self._instance, self.stats)
        self.ledger = AllocationLedger(self.cfg.spare_grace_s)
        self.lock = asyncio.Lock()  # count changes, claims and stops
        self._setup_lock = asyncio.Lock()
        self._probe_http: httpx.AsyncClient | None = None  # stop_host's liveness probes, see _answers
        self._registered = False
        self._closed = False
        self._tidy_wanted = asyncio.Event()
        self._watcher: asyncio.Task[None] | None = None
        self._janitor: asyncio.Task[None] | None = None

    @property
    def nomad_reachable(self) -> bool | None:
        """Did the last request reach the agent (None: none made yet)?"""
        return self.api.reachable

    def owner_meta(self) -> dict[str, str]:
        return self.owner.meta()

    def render_job(self, count: int = 0) -> dict[str, Any]:
        """What this backend registers: ``render_job(cfg)`` with its token and owner ``Meta``."""
        return self.owner.render_job(count)

    # -- setup ----------------------------------------------------------------------------------
    async def _ensure_ready(self) -> None:
        if self._closed:
            raise HostUnavailable("the Nomad backend is closed")
        async with self._setup_lock:
            if not self._registered:
                await self._register()
            if self._watcher is None or self._watcher.done():
                self._watcher = asyncio.ensure_future(self._watch())
            if self._janitor is None or self._janitor.done():
                self._janitor = asyncio.ensure_future(self._janitor_loop())

    async def _register(self) -> None:
        if self.owner.is_mine(await self.api.read_job()):
            # ours, but stopped or lost track of: bring it back at zero
            log.warning("Nomad job %s was stopped from outside; registering it again", self.cfg.job_id)
            await self.api.purge_job()
        else:
            await self.owner.claim_job_id()
        await self.owner.register()
        self._registered = True

    # -- following the allocations ------------------------------------------------------------
    async def _watch(self) -> None:
        """Blocking queries on the job's allocations; the cache behind alive() and start_host()."""
        index, backoff = 0, 0.1
        while not self._closed:
            try:
                index = await self._watch_once(index)
                if backoff > 0.1:
                    log.info("Nomad at %s reachable again", self.cfg.address)
                backoff = 0.1
            except asyncio.CancelledError:
                raise
            except (HostUnavailable, ConfigError, ValueError) as exc:
                await self._watch_backoff(exc, backoff)
                backoff = min(backoff * 2, 5.0)
                index = 0

    async def _watch_once(self, index: int) -> int:
        """One (blocking) listing into the ledger; the index to wait on next (0: read afresh)."""
        wait = self.cfg.watch_wait_s
        params = {"index": str(index), "wait": f"{int(wait * 1000)}ms"} if index else {}
        allocs, new = await self.api.allocations(params, timeout=wait + wait / 16 + self.cfg.request_timeout_s)
        if not index:
            self.ledger.forget_index()  # a fresh read is the truth (even after an agent restart)
        self._apply(allocs, new)
        if new == 0:
            await asyncio.sleep(0.5)  # no index to block on: do not spin
        # An index that goes backwards (agent restart, new leader) restarts the watch.
        return new if new > index else (0 if new < index else index)

    async def _watch_backoff(self, exc: Exception, backoff: float) -> None:
        if backoff == 0.1:
            log.warning("watching Nomad allocations failed (%s); known hosts keep working, retrying", exc)
        if isinstance(exc, NomadUnreachable):
            self.stats["unreachable"] += 1
        self.api.back_online.clear()
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self.api.back_online.wait(), backoff)

    def _apply(self, allocs: list[Alloc], index: int) -> None:
        if self.ledger.apply(allocs, index) and self.ledger.has_retired():
            self._tidy_wanted.set()

    # -- start ----------------------------------------------------------------------------------
    async def start_host(self) -> HostInfo:
        await self._ensure_ready()
        with self.ledger.starting():
            return await HostStart(self, time.monotonic() + self.cfg.start_timeout_s).run()

    async def await_host(self, alloc_id: str, deadline: float) -> HostInfo:
        """The claimed allocation running, read, and its host answering: handed out. AllocDied if it
        fails meanwhile; TimeoutError past ``deadline``."""
        await self._until_running(alloc_id, deadline)
        full = await self.api.json("GET", f"/v1/allocation/{alloc_id}")
        if not is_usable(full):
            raise AllocDied.of(full)
        address = alloc_address(full)
        info = HostInfo(id=alloc_id, address=address, token=self._token, slots=self.cfg.slots_per_host,
                        labels={"backend": "nomad", "job": self.cfg.job_id, "alloc_name": full.get("Name", ""),
                                "node": full.get("NodeName") or full.get("NodeID", "")})
        await self._until_healthy(alloc_id, address, deadline)
        self.ledger.hand_out(full, info)
        log.info("nomad host %s (%s on %s) ready at %s", alloc_id[:8], info.labels["alloc_name"],
                 info.labels["node"], address)
        return info

    async def _until_running(self, alloc_id: str, deadline: float) -> None:
        while True:
            alloc = self.ledger.alloc(alloc_id)
            if alloc is None or not is_usable(alloc):
                raise AllocDied.of(alloc) if alloc else AllocDied(f"allocation {alloc_id} vanished")
            if alloc.get("ClientStatus") == "running":
                return
            await self.ledger.wait_change(deadline)

    async def _until_healthy(self, alloc_id: str, address: str, deadline: float) -> None:
        async with httpx.AsyncClient(headers={"Authorization": f"Bearer {self._token}"}) as http:
            while True:
                current = self.ledger.alloc(alloc_id)
                if current is not None and not is_usable(current):
                    raise AllocDied.of(current)
                if await self._healthy(http, alloc_id, address, deadline):
                    return
                if time.monotonic() >= deadline:
                    raise asyncio.TimeoutError
                await asyncio.sleep(0.1)

    async def _healthy(self, http: httpx.AsyncClient, alloc_id: str, address: str, deadline: float) -> bool:
        try:
            resp = await http.get(f"{address}/v1/health", timeout=min(5.0, max(deadline - time.monotonic(), 0.1)))
        except httpx.TransportError:
            return False
        if resp.status_code == 401:
            raise ConfigError(f"sandbox host {address} (allocation {alloc_id[:8]}) rejected the pool's "
                              f"token: the token variable nomad/jobs/{self.cfg.job_id} was changed by someone else")
        return resp.status_code == 200

    async def give_back_start(self, alloc_id: str | None, scaled: bool) -> None:
        """A failed start: return what it took (its allocation, or the unplaced count)."""
        if alloc_id is not None:
            self.ledger.abandon_start(alloc_id)
            async with self.lock:
                await self._tidy()
            return
        if scaled:
            async with self.lock:
                job, allocs = await self._snapshot()
                live = {index_of(a) for a in allocs if is_live(a)}
                count = group_count(job)
                if count > len(live):  # our placement never happened: cancel it, stops nothing
                    await self.api.scale_to(count - 1, "start failed")

    # -- scaling --------------------------------------------------------------------------------
    async def _snapshot(self) -> tuple[dict[str, Any], list[Alloc]]:
        """The job and its allocations, read now (not from the watch cache, which it refreshes)."""
        job = await self.api.read_job()
        if job is None:
            raise JobGone
        allocs, index = await self.api.allocations()
        self._apply(allocs, index)
        return job, allocs

    async def scale_up(self, deadline: float) -> None:
        """Count + 1, retrying while a deployment blocks scaling or Nomad is unreachable."""
        backoff = 0.2
        while True:
            try:
                problem = await self._try_scale_up(backoff)
                if problem is None:
                    return
            except NomadUnreachable as exc:
                problem = str(exc)
            except JobGone:
                log.warning("Nomad job %s is gone or stopped; registering it again", self.cfg.job_id)
                self._registered = False
                await self._ensure_ready()
                continue
            if time.monotonic() + backoff > deadline:
                raise HostUnavailable(f"could not scale Nomad job {self.cfg.job_id!r} up within "
                                      f"{self.cfg.start_timeout_s:g}s: {problem}")
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, 2.0)

    async def _try_scale_up(self, backoff: float) -> str | None:
        """One scale-up attempt: None when done, else why Nomad refused it for now."""
        async with self.lock:
            job = await self.api.read_job()
            if job is None or job.get("Stop"):
                raise JobGone
            resp = await self.api.scale_to(group_count(job) + 1, "host wanted")
        if resp.status_code == 200:
            self.stats["scale_up"] += 1
            return None
        if resp.status_code == 400 and SCALE_BLOCKED in resp.text:
            self.stats["scale_blocked"] += 1
            problem = resp.text.strip()
            log.info("Nomad refused to scale %s (%s); retrying in %.1fs", self.cfg.job_id, problem, backoff)
            return problem
        raise NomadAPIError("POST", f"{self.api.job_path}/scale", resp.status_code, resp.text)

    # -- stop -----------------------------------------------------------------------------------
    def removal_order(self, host_ids: list[str]) -> list[str]:
        """Hosts in the order they are cheapest to give back: highest name index first (a scale-down
        stops exactly those; others leave a spare behind until they are on top)."""
        return self.ledger.removal_order(host_ids)

    async def stop_host(self, host_id: str) -> None:
        host = self.ledger.release(host_id)
        if self._closed or not self.ledger.usable(host_id):
            return  # unknown, or already failed/lost: Nomad replaces it, the replacement is a spare
        # Until the probe below says otherwise it is a suspect: no spare a concurrent start could claim.
        self.ledger.suspect(host_id)
        if host is not None and not await self._answers(host.info):
            # Dead for the pool while Nomad still says running: most likely a crash Nomad has not
            # processed yet. Lowering the count now would stop it for good and place a new allocation;
            # left alone, Nomad fails it and reschedules a replacement under the same name
            # (PreviousAllocation = this one) that the next start adopts. Still "running" after the
            # grace (a hung host), it is given back like any other.
            log.info("nomad host %s does not answer; leaving it %gs for Nomad to reschedule", host_id[:8],
                     SUSPECT_GRACE_S)
            self.ledger.suspect_for(host_id, SUSPECT_GRACE_S)  # (unless the watch dropped it: Nomad noticed)
            self._tidy_wanted.set()
            return
        self.ledger.clear_suspect(host_id)
        if not self.ledger.retire(host_id):
            return  # Nomad stopped or replaces it meanwhile
        try:
            async with self.lock:
                await asyncio.wait_for(self._tidy(), self.cfg.request_timeout_s)
        except (HostUnavailable, asyncio.TimeoutError, JobGone) as exc:
            log.warning("could not stop Nomad allocation %s now (%s); retrying in the background", host_id[:8], exc)
            self._tidy_wanted.set()

    async def _answers(self, info: HostInfo) -> bool:
        """Does the host's server answer at all (any HTTP status)?

        Every host given back is probed, so the client is made once (its TLS context is the costly
        part); without keep-alive, no probe holds a connection open to a host being stopped."""
        if self._probe_http is None:
            self._probe_http = httpx.AsyncClient(limits=httpx.Limits(max_keepalive_connections=0))
        try:
            await self._probe_http.get(f"{info.address}/v1/health", timeout=1.0,
                                       headers={"Authorization": f"Bearer {info.token}"})
            return True
        except httpx.HTTPError:
            return False

    async def _tidy(self) -> None:
        """Give back retired allocations (and spares past their grace): lower the count when they hold
        the highest names, else stop them so that Nomad replaces them with spares. Hold the lock."""
        if not self.ledger.tidy_due():
            return
        self.ledger.retire_expired_suspects()
        job, allocs = await self._snapshot()
        view = self.ledger.name_roles(allocs)
        count = await self._cancel_unwaited(group_count(job), view)
        top = view.removable_top()
        # Only when every name the count asks for is placed: a placement still pending could land
        # above the names we mean, and Nomad would stop it instead.
        if top and count == view.placed:
            await self._scale_down(count, top, view)
        for alloc in self.ledger.retired_to_stop(allocs, view.highest_used()):
            await self._stop_alloc(alloc)

    async def _cancel_unwaited(self, count: int, view: NameRoles) -> int:
        """Placements nobody waits for (e.g. a blocked one of a start that gave up): cancelling them
        stops nothing, and lets the count come down onto the names below. Returns the count."""
        if count > view.placed and self.ledger.pending_starts == 0:
            resp = await self.api.scale_to(view.placed, "cancel placements nobody waits for")
            if resp.status_code == 200:
                return view.placed
        return count

    async def _scale_down(self, count: int, top: list[int], view: NameRoles) -> None:
        resp = await self.api.scale_to(count - len(top), f"{len(top)} host(s) given back")
        if resp.status_code == 200:
            self.stats["scale_down"] += 1
            self.ledger.scaled_away(view.allocs_at(top))
        else:
            log.info("scale-down of %s refused (%s); later", self.cfg.job_id, resp.text.strip())

    async def _stop_alloc(self, alloc: Alloc) -> None:
        """A host in use sits above it: stop it now; Nomad places a replacement, a spare."""
        alloc_id = alloc["ID"]
        resp = await self.api.stop_alloc(alloc_id)
        if resp.status_code in (200, 404):
            self.ledger.stopping(alloc_id)
            self.stats["alloc_stop"] += 1
            log.info("stopped Nomad allocation %s (%s); its replacement is a spare", alloc_id[:8], alloc.get("Name"))
        else:
            log.warning("stopping Nomad allocation %s failed: %s %s", alloc_id[:8], resp.status_code,
                        resp.text.strip())

    async def _janitor_loop(self) -> None:
        """Retries what stop_host could not finish and trims spares whose grace ran out."""
        while not self._closed:
            await self._janitor_wait()
            if not self.ledger.tidy_due():
                continue
            try:
                async with self.lock:
                    await self._tidy()
            except asyncio.CancelledError:
                raise
            except (HostUnavailable, ConfigError, JobGone) as exc:
                log.debug("background tidy failed: %s", exc)
                await asyncio.sleep(1.0)
            except Exception:
                log.exception("background tidy failed")
                await asyncio.sleep(1.0)
            await asyncio.sleep(0.2)

    async def _janitor_wait(self) -> None:
        """Until asked to tidy, a suspect's grace runs out, or half a spare's grace passed."""
        wait = max(self.cfg.spare_grace_s / 2, 0.5)
        suspect_in = self.ledger.next_suspect_in()
        if suspect_in is not None:
            wait = min(wait, max(suspect_in, 0.05))
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._tidy_wanted.wait(), wait)
        self._tidy_wanted.clear()

    # -- queries --------------------------------------------------------------------------------
    async def alive(self, host_id: str) -> bool:
        return self.ledger.alive(host_id)

    def allocations(self) -> list[dict[str, Any]]:
        """The cached allocation stubs of the job (from the blocking query)."""
        return self.ledger.allocations()

    def spare_ids(self) -> list[str]:
        return self.ledger.spare_ids()

    async def reap_orphans(self) -> int:
        """Purge a job with our ID left by a crashed pool (owner pid gone on this machine and boot)."""
        if self._closed:
            return 0
        async with self._setup_lock:
            if self._registered:
                return 0
            return await self.owner.claim_job_id()

    async def ship_image(self, client: HostClient, reference: ImageRef) -> None:
        """A Nomad task's host has no engine socket: the pool ships the image from its machine's
        engine, or (a ``docker://`` reference) fetched from the registry on the pool's machine
        (``image_shipping.ship``), as for a Docker container's host."""
        if not self.cfg.ship_images:
            return
        await ship(client, reference, lambda: asyncio.to_thread(self._engine), self._registries)

    def _engine(self) -> tuple[Any, type[Exception]]:
        """The docker SDK's low-level client of the engine images are shipped from, and its ImageNotFound."""
        try:
            import docker
        except ImportError:
            raise ImageRejected("shipping task images to Nomad hosts needs the docker package on the pool's "
                                "machine") from None
        if self._docker_client is None:
            try:
                client = (docker.DockerClient(base_url=self.cfg.docker_url) if self.cfg.docker_url
                          else docker.from_env())
                client.ping()
            except docker.errors.DockerException as exc:
                raise ImageRejected(f"no Docker engine to ship task images from (NomadBackendConfig.docker_url, "
                                    f"else DOCKER_HOST): {exc}") from None
            self._docker_client = client
        return self._docker_client.api, docker.errors.ImageNotFound

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        tasks = [t for t in (self._watcher, self._janitor) if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self._registered and self.cfg.purge_on_close:
            try:
                await self.owner.remove()
                log.info("purged Nomad job %s", self.cfg.job_id)
            except (HostUnavailable, ConfigError) as exc:
                log.warning("could not purge Nomad job %s (%s); the next pool with this job_id reaps it",
                            self.cfg.job_id, exc)
        self.ledger.forget_hosts()
        if self._probe_http is not None:
            await self._probe_http.aclose()
        self._probe_http = None
        await self.api.aclose()
