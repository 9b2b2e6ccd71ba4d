"""The Nomad HTTP API as this backend uses it (``httpx.AsyncClient``; contract: ``docs/nomad-api.md``).

Every request carries the namespace (and region); a transport failure is ``NomadUnreachable``, an ACL
refusal (403) or an unknown region a ``ConfigError`` naming the setting to fix, any other unexpected
status ``NomadAPIError`` with Nomad's own text.
"""

from __future__ import annotations

import asyncio
import logging
import ssl
from typing import Any
from urllib.parse import quote

import httpx

from atropos import __version__
from atropos.backends.nomad.allocs import Alloc
from atropos.backends.nomad.config import NomadBackendConfig
from atropos.backends.nomad.job import GROUP, META_INSTANCE
from atropos.errors import ConfigError, NomadAPIError, NomadUnreachable

log = logging.getLogger(__name__)

NO_REGION = "No path to region"


class JobGone(Exception):
    """The job is not registered (any more), or stopped."""


class NomadAPI:
    """One Nomad agent, one job: the requests the backend makes, and whether the agent answers."""

    def __init__(self, cfg: NomadBackendConfig, instance: str) -> None:
        self.cfg = cfg
        self.instance = instance  # names this backend in the Meta of its scale requests
        self.reachable: bool | None = None
        self.back_online = asyncio.Event()  # set when an answer follows a failure (wakes the watcher)
        self._http: httpx.AsyncClient | None = None

    # -- transport ----------------------------------------------------------------------------
    def _client(self) -> httpx.AsyncClient:
        if self._http is None:
            c = self.cfg
            headers = {"User-Agent": f"atropos-sandbox/{__version__}"}
            if c.token:
                headers["X-Nomad-Token"] = c.token
            self._http = httpx.AsyncClient(
                base_url=c.address.rstrip("/"), headers=headers, verify=self._tls(),
                timeout=httpx.Timeout(c.request_timeout_s, connect=c.connect_timeout_s),
            )
        return self._http

    def _tls(self) -> ssl.SSLContext | bool:
        c = self.cfg
        if not c.address.startswith("https://"):
            return True
        try:
            ctx = ssl.create_default_context(cafile=c.ca_cert)
            if not c.verify:
                ctx.check_hostname = False
                ctx.verify_mode = ssl.CERT_NONE
            if c.client_cert:
                ctx.load_cert_chain(c.client_cert, c.client_key)
        except (OSError, ssl.SSLError) as exc:
            raise ConfigError(f"Nomad TLS settings unusable (ca_cert/client_cert/client_key): {exc}") from exc
        return ctx

    async def request(self, method: str, path: str, *, json: Any = None, params: dict[str, str] | None = None,
                      timeout: float | None = None) -> httpx.Response:
        query = {"namespace": self.cfg.namespace}
        if self.cfg.region:
            query["region"] = self.cfg.region
        query.update(params or {})
        kw: dict[str, Any] = {}
        if timeout is not None:
            kw["timeout"] = httpx.Timeout(timeout, connect=self.cfg.connect_timeout_s)
        try:
            resp = await self._client().request(method, path, json=json, params=query, **kw)
        except httpx.TransportError as exc:
            self.reachable = False
            raise self._unreachable(exc, method, path, timeout) from exc
        if self.reachable is False:
            self.back_online.set()
        self.reachable = True
        if resp.status_code == 403:
            raise ConfigError(self._acl_message(method, path, resp.text))
        if resp.status_code == 500 and NO_REGION in resp.text:
            raise ConfigError(f"Nomad at {self.cfg.address} has no path to region {self.cfg.region!r} "
                              "(NomadBackendConfig.region / NOMAD_REGION): a typo, or the regions are not federated")
        return resp

    def _unreachable(self, exc: httpx.TransportError, method: str, path: str, timeout: float | None
                     ) -> NomadUnreachable:
        detail = f"{type(exc).__name__}: {exc or 'no detail'}"
        if isinstance(exc, httpx.TimeoutException) and not isinstance(exc, httpx.ConnectTimeout):
            # Connected, but no answer: a wedged agent, or something else listening on that port.
            spent = timeout if timeout is not None else self.cfg.request_timeout_s
            return NomadUnreachable(
                f"Nomad at {self.cfg.address} accepted the connection but did not answer {method} {path} "
                f"within {spent:g}s ({detail}); is NomadBackendConfig.address (NOMAD_ADDR) a Nomad agent, "
                "and is it healthy?")
        return NomadUnreachable(
            f"cannot reach Nomad at {self.cfg.address} ({detail}); "
            "is the agent running and NomadBackendConfig.address (NOMAD_ADDR) right?")

    def _acl_message(self, method: str, path: str, body: str) -> str:
        c = self.cfg
        who = ("no ACL token is configured (NomadBackendConfig.token / NOMAD_TOKEN)" if not c.token
               else "the ACL token in NomadBackendConfig.token (NOMAD_TOKEN) was refused: unknown, expired or "
                    "without the permission")
        need = "submit-job, read-job, scale-job, alloc-lifecycle"
        if c.token_delivery == "variable":
            need += f", and variables write on nomad/jobs/{c.job_id}"
        return (f"Nomad at {c.address} denied {method} {path} (403 {body.strip()!r}): {who}. The pool's token "
                f"needs, in namespace {c.namespace!r}: {need}.")

    async def json(self, method: str, path: str, **kw: Any) -> Any:
        resp = await self.request(method, path, **kw)
        if resp.status_code != 200:
            raise NomadAPIError(method, path, resp.status_code, resp.text)
        return resp.json()

    async def aclose(self) -> None:
        if self._http is not None:
            await self._http.aclose()
        self._http = None

    # -- the job --------------------------------------------------------------------------------
    @property
    def job_path(self) -> str:
        return f"/v1/job/{quote(self.cfg.job_id, safe='')}"

    @property
    def var_path(self) -> str:
        return f"/v1/var/nomad/jobs/{quote(self.cfg.job_id, safe='')}"

    async def purge_job(self) -> httpx.Response:
        return await self.request("DELETE", self.job_path, params={"purge": "true"})

    async def read_job(self) -> dict[str, Any] | None:
        resp = await self.request("GET", self.job_path)
        if resp.status_code == 404:
            return None
        if resp.status_code != 200:
            raise NomadAPIError("GET", self.job_path, resp.status_code, resp.text)
        job: dict[str, Any] = resp.json()
        return job

    async def allocations(self, params: dict[str, str] | None = None, timeout: float | None = None
                          ) -> tuple[list[Alloc], int]:
        """The job's allocations of our group and the index of that answer (``X-Nomad-Index``)."""
        path = f"{self.job_path}/allocations"
        resp = await self.request("GET", path, params=params, timeout=timeout)
        if resp.status_code != 200:
            raise NomadAPIError("GET", path, resp.status_code, resp.text)
        allocs = [a for a in resp.json() if a.get("TaskGroup", GROUP) == GROUP]
        return allocs, int(resp.headers.get("X-Nomad-Index", "0") or 0)

    async def scale_to(self, count: int, why: str) -> httpx.Response:
        """Set the group's count (200: done; other statuses are the caller's to judge); JobGone on 404."""
        body = {"Count": count, "Target": {"Group": GROUP}, "Message": f"atropos-sandbox: {why}",
                "Meta": {META_INSTANCE: self.instance}}
        resp = await self.request("POST", f"{self.job_path}/scale", json=body)
        if resp.status_code == 404:
            raise JobGone
        if resp.status_code == 200:
            log.info("scaled Nomad job %s to %d (%s)", self.cfg.job_id, count, why)
        return resp

    async def stop_alloc(self, alloc_id: str) -> httpx.Response:
        return await self.request("POST", f"/v1/allocation/{alloc_id}/stop")

    async def evaluations(self) -> list[dict[str, Any]]:
        evals: list[dict[str, Any]] = await self.json("GET", f"{self.job_path}/evaluations")
        return evals


def group_count(job: dict[str, Any]) -> int:
    """The count of our task group in a job read."""
    for g in job.get("TaskGroups") or []:
        if g.get("Name") == GROUP:
            return int(g.get("Count") or 0)
    raise ConfigError(f"Nomad job {job.get('ID')!r} has no task group {GROUP!r}")
