"""The fake's HTTP API: a plain ASGI app (served by uvicorn from ``server.py``).

Faithful to ``command/agent/http.go`` where the contract says so:

* errors are ``text/plain`` bodies with Nomad's exact messages; unknown paths get Go's
  ``404 page not found``; a wrong verb gets 405 ``Invalid method``;
* reads carry ``X-Nomad-Index``, ``X-Nomad-KnownLeader`` and ``X-Nomad-LastContact``,
  writes only ``X-Nomad-Index``;
* blocking queries: ``?index=N&wait=D`` re-run the read until its index is greater than
  ``N`` or ``wait`` (default 5 min, capped at 10 min, plus up to wait/16 jitter) expires;
  ``Invalid wait time`` / ``Invalid index`` are 400;
* ``?namespace=`` (default ``default``, ``*`` on lists), ``?region=`` (another region is
  500 ``No path to region``), ``?pretty``, ``?prefix=``, ``?filter=`` (go-bexpr subset);
* ACLs: with ACLs on, a missing or unknown ``X-Nomad-Token`` (or ``Authorization:
  Bearer``) is 403 ``Permission denied``. ACL checks run before body decoding (Nomad
  decodes first, so a bad body without a token is 400 there, 403 here).
* Variables: ``/v1/var/:path`` and ``/v1/vars`` (see ``variables.py``).

Every request is recorded in :attr:`NomadApp.log` (time, method, path, query, token) so tests
can count what a client sent, e.g. that it uses blocking queries instead of polling.
"""

from __future__ import annotations

import asyncio
import functools
import json
import random
import re
import time
import traceback
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qs, unquote

from .bexpr import FilterError, compile_filter
from .encode import rfc3339nano
from .spec import SpecError, canonicalize_job, multierror, normalize, validate_job
from .state import Cluster, NomadError
from .variables import VariableConflict
from .views import (
    alloc_full,
    alloc_stub,
    deployment_json,
    eval_json,
    job_stub,
    job_summary,
    node_full,
    node_stub,
    scale_status,
)

ASGIReceive = Callable[[], Awaitable[dict[str, Any]]]
ASGISend = Callable[[dict[str, Any]], Awaitable[None]]

INVALID_METHOD = "Invalid method"
PERMISSION_DENIED = "Permission denied"


class _Query:
    query: dict[str, str]

    @property
    def blocking(self) -> bool:
        """A blocking query: ``?index=N`` with N other than 0."""
        return self.query.get("index", "0") not in ("", "0")


@dataclass
class Request(_Query):
    method: str
    path: str
    query: dict[str, str]
    headers: dict[str, str]
    body: bytes

    @property
    def namespace(self) -> str:
        return self.query.get("namespace") or "default"

    @functools.cached_property
    def token(self) -> str:
        """``X-Nomad-Token``, else ``Authorization: Bearer`` ("" when none)."""
        secret = self.headers.get("x-nomad-token", "")
        if not secret:
            auth = self.headers.get("authorization", "")
            if auth.lower().startswith("bearer "):
                secret = auth[7:].strip()
        return secret

    def has(self, name: str) -> bool:
        return name in self.query


@dataclass
class Response:
    status: int
    body: bytes
    headers: list[tuple[str, str]] = field(default_factory=list)


@dataclass
class ErrorRule:
    prefix: str
    status: int
    remaining: int
    body: str
    method: str | None
    blocking: bool | None = None  # True: only blocking queries (?index=N>0); False: only others


@dataclass(frozen=True)
class RequestRecord(_Query):
    """One request as the fake received it (before any fault rule)."""

    time: float  # time.monotonic()
    method: str
    path: str
    query: dict[str, str]
    token: str  # X-Nomad-Token or Authorization: Bearer ("" when none)


class _Reply(Exception):
    """A handler's answer that is neither 200 JSON nor a plain-text error (409 JSON, 204)."""

    def __init__(self, response: Response) -> None:
        super().__init__(response.status)
        self.response = response


@dataclass
class Token:
    accessor_id: str
    secret_id: str
    name: str
    type: str
    namespaces: list[str] | None
    create_index: int
    create_time: int

    def to_json(self) -> dict[str, Any]:
        return {
            "AccessorID": self.accessor_id,
            "SecretID": self.secret_id,
            "Name": self.name,
            "Type": self.type,
            "Policies": None if self.type == "management" else ["fake-namespaces"],
            "Roles": None,
            "Global": self.type == "management",
            "CreateTime": rfc3339nano(self.create_time),
            "ExpirationTime": None,
            "ExpirationTTL": 0,
            "CreateIndex": self.create_index,
            "ModifyIndex": self.create_index,
        }


class Faults:
    """HTTP-level fault injection state (mutated from the test thread)."""

    def __init__(self) -> None:
        self.error_rules: list[ErrorRule] = []
        self.latency: list[tuple[str, float]] = []
        self.unreachable = False
        self.leader = True

    def take_error(self, req: Request) -> ErrorRule | None:
        for rule in self.error_rules:
            if rule.remaining <= 0:
                continue
            if not req.path.startswith(rule.prefix):
                continue
            if rule.method and rule.method.upper() != req.method:
                continue
            if rule.blocking is not None and rule.blocking != req.blocking:
                continue
            rule.remaining -= 1
            return rule
        return None

    def delay_for(self, req: Request) -> float:
        return max([secs for prefix, secs in self.latency if req.path.startswith(prefix)] + [0.0])


class Acl:
    def __init__(self, cluster: Cluster, enabled: bool) -> None:
        self.c = cluster
        cluster.acl_enabled = enabled  # the one flag: the cluster's templates check it too
        self.tokens: dict[str, Token] = {}
        self.bootstrapped_index = 0

    @property
    def enabled(self) -> bool:
        return self.c.acl_enabled

    def create(self, *, name: str, type_: str, namespaces: list[str] | None, secret: str | None = None) -> Token:
        cluster = self.c
        with cluster.op():
            idx = cluster._idx("acl_token")
            tok = Token(
                accessor_id=str(uuid.uuid4()),
                secret_id=secret or str(uuid.uuid4()),
                name=name,
                type=type_,
                namespaces=namespaces,
                create_index=idx,
                create_time=cluster.wall(),
            )
            self.tokens[tok.secret_id] = tok
            return tok


_GO_DURATION = re.compile(r"^([0-9]*(\.[0-9]*)?(ns|us|µs|ms|s|m|h))+$")
_UNITS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}


def parse_go_duration(text: str) -> float:
    """``time.ParseDuration`` -> seconds. Raises ValueError."""
    sign = 1.0
    if text[:1] in "+-":
        sign = -1.0 if text[0] == "-" else 1.0
        text = text[1:]
    if text == "0":
        return 0.0
    if not text or not _GO_DURATION.match(text):
        raise ValueError(text)
    total = 0.0
    for num, _frac, unit in re.findall(r"([0-9]*(\.[0-9]*)?)(ns|us|µs|ms|s|m|h)", text):
        if num in ("", "."):
            raise ValueError(text)
        total += float(num) * _UNITS[unit]
    return sign * total


_TRUE = {"1", "t", "T", "TRUE", "true", "True"}
_FALSE = {"0", "f", "F", "FALSE", "false", "False"}


def parse_bool(value: str) -> bool:
    """Go's ``strconv.ParseBool``."""
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ValueError(f'strconv.ParseBool: parsing "{value}": invalid syntax')


ReadFn = Callable[..., tuple[Any, int]]
WriteFn = Callable[..., tuple[Any, int]]


@dataclass
class Route:
    methods: frozenset[str]
    kind: str  # read (blocking-capable, read headers) | write (X-Nomad-Index) | plain (no headers)
    fn: Callable[..., tuple[Any, int]]
    scope: str = "namespace"  # namespace | cluster | open


class NomadApp:
    """ASGI application implementing the subset of Nomad's HTTP API listed in README.md."""

    def __init__(self, cluster: Cluster, *, faults: Faults, acl: Acl, strict: bool = False) -> None:
        self.c = cluster
        self.faults = faults
        self.acl = acl
        self.strict = strict
        self._loop: asyncio.AbstractEventLoop | None = None
        self._change: asyncio.Future[None] | None = None
        self.errors: list[str] = []
        self.log: list[RequestRecord] = []

    # ------------------------------------------------------------------ change notification

    def bind_loop(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._change = loop.create_future()

    def notify(self) -> None:
        """Called (from any thread) whenever the cluster state changed."""
        loop = self._loop
        if loop is not None and not loop.is_closed():
            try:
                loop.call_soon_threadsafe(self._wake)
            except RuntimeError:
                pass

    def _wake(self) -> None:
        assert self._loop is not None
        fut, self._change = self._change, self._loop.create_future()
        if fut is not None and not fut.done():
            fut.set_result(None)

    # ------------------------------------------------------------------ ASGI

    async def __call__(self, scope: dict[str, Any], receive: ASGIReceive, send: ASGISend) -> None:
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                elif message["type"] == "lifespan.shutdown":
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        if scope["type"] != "http":
            return
        chunks = []
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunks.append(message.get("body", b""))
            if not message.get("more_body"):
                break
        qs = parse_qs(scope.get("query_string", b"").decode("latin-1"), keep_blank_values=True)
        req = Request(
            method=scope["method"].upper(),
            path=unquote(scope.get("raw_path", b"").decode("latin-1").split("?")[0]) or scope["path"],
            query={k: v[0] for k, v in qs.items()},
            headers={k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])},
            body=b"".join(chunks),
        )
        resp = await self.handle(req)
        await send(
            {
                "type": "http.response.start",
                "status": resp.status,
                "headers": [(k.encode("latin-1"), v.encode("latin-1")) for k, v in resp.headers],
            }
        )
        await send({"type": "http.response.body", "body": resp.body})

    # ------------------------------------------------------------------ dispatch

    @staticmethod
    def _encode(req: Request, body: Any) -> bytes:
        pretty = "pretty" in req.query and req.query["pretty"] != "0"
        text = json.dumps(body, indent=4) + "\n" if pretty else json.dumps(body, separators=(",", ":"))
        return text.encode()

    @staticmethod
    def _json(payload: bytes, headers: list[tuple[str, str]] | None = None, status: int = 200) -> Response:
        return Response(status, payload, [("Content-Type", "application/json")] + (headers or []))

    @staticmethod
    def _text(status: int, message: str, headers: list[tuple[str, str]] | None = None) -> Response:
        return Response(status, message.encode(), [("Content-Type", "text/plain; charset=utf-8")] + (headers or []))

    def _meta_headers(self, index: int, *, stale: bool) -> list[tuple[str, str]]:
        known = self.faults.leader
        return [
            ("X-Nomad-Index", str(max(index, 1))),
            ("X-Nomad-KnownLeader", "true" if known else "false"),
            ("X-Nomad-LastContact", "0"),
        ]

    async def handle(self, req: Request) -> Response:
        self.log.append(RequestRecord(time.monotonic(), req.method, req.path, dict(req.query), req.token))
        rule = self.faults.take_error(req)
        if rule is not None:
            return self._text(rule.status, rule.body)
        delay = self.faults.delay_for(req)
        if delay:
            await asyncio.sleep(delay)
        route = self._route(req)
        if isinstance(route, Response):
            return route
        rt, params = route
        if req.method not in rt.methods:
            return self._text(405, INVALID_METHOD)
        try:
            region = req.query.get("region")
            if region and region != self.c.region and rt.scope != "open":
                raise NomadError(500, "No path to region")
            stale = req.has("stale")
            if not self.faults.leader and rt.scope != "open" and not (rt.kind == "read" and stale):
                raise NomadError(500, "No cluster leader")
            self._authorize(req, rt)
            if rt.kind == "read":
                return await self._blocking(req, rt.fn, params)
            with self.c.lock:  # encode under the lock: bodies may reference live state
                body, index = rt.fn(req, **params)
                payload = self._encode(req, body)
            if rt.kind == "plain":
                return self._json(payload)
            return self._json(payload, headers=[("X-Nomad-Index", str(index))])
        except _Reply as r:
            return r.response
        except NomadError as e:
            headers = self._meta_headers(e.index, stale=False) if e.index is not None else []
            return self._text(e.status, e.message, headers)
        except SpecError as e:
            return self._text(400, str(e))
        except Exception as e:  # a bug in the fake: make it visible
            self.errors.append(traceback.format_exc())
            return self._text(500, f"fake-nomad internal error: {e!r}")

    def _authorize(self, req: Request, rt: Route) -> None:
        if not self.acl.enabled or rt.scope in ("open", "self"):
            return
        tok = self.acl.tokens.get(req.token)
        if tok is None:
            raise NomadError(403, PERMISSION_DENIED)
        if tok.type == "management":
            return
        allowed = tok.namespaces or []
        if rt.scope != "namespace":
            raise NomadError(403, PERMISSION_DENIED)
        ns = req.namespace
        if "*" in allowed:
            return
        if ns == "*" or ns not in allowed:
            raise NomadError(403, PERMISSION_DENIED)

    async def _blocking(self, req: Request, fn: ReadFn, params: dict[str, str]) -> Response:
        min_index = 0
        wait = 0.0
        if "wait" in req.query and req.query["wait"] != "":
            try:
                wait = parse_go_duration(req.query["wait"])
            except ValueError:
                return self._text(400, "Invalid wait time")
        if "index" in req.query and req.query["index"] != "":
            try:
                min_index = int(req.query["index"])
                if min_index < 0:
                    raise ValueError
            except ValueError:
                return self._text(400, "Invalid index")
        assert self._loop is not None
        deadline = 0.0
        if min_index > 0:
            if wait <= 0:
                wait = 300.0
            wait = min(wait, 600.0)
            wait += random.uniform(0, wait / 16)
            deadline = time.monotonic() + wait
        stale = req.has("stale")
        while True:
            fut = self._change
            error: NomadError | None = None
            payload = b""
            with self.c.lock:
                try:
                    body, index = fn(req, **params)
                    payload = self._encode(req, body)
                except NomadError as e:
                    if e.index is None:
                        raise
                    error, index = e, e.index
            if min_index == 0 or index > min_index or time.monotonic() >= deadline or self.faults.unreachable:
                break
            try:
                assert fut is not None
                await asyncio.wait_for(asyncio.shield(fut), timeout=max(deadline - time.monotonic(), 0))
            except asyncio.TimeoutError:
                pass
        headers = self._meta_headers(index, stale=stale)
        if error is not None:
            return self._text(error.status, error.message, headers)
        return self._json(payload, headers=headers)

    # ------------------------------------------------------------------ routing

    def _route(self, req: Request) -> tuple[Route, dict[str, str]] | Response:
        p = req.path
        R, W = frozenset({"GET"}), frozenset({"PUT", "POST"})
        RW = frozenset({"GET", "PUT", "POST"})
        exact: dict[str, Route] = {
            "/v1/jobs": Route(frozenset({"GET", "PUT", "POST"}), "dispatch", self.list_jobs),
            "/v1/jobs/parse": Route(W, "write", self.jobs_parse),
            "/v1/validate/job": Route(W, "write", self.validate_job),
            "/v1/allocations": Route(R, "read", self.list_allocs),
            "/v1/evaluations": Route(R, "read", self.list_evals),
            "/v1/deployments": Route(R, "read", self.list_deployments),
            "/v1/nodes": Route(R, "read", self.list_nodes, scope="cluster"),
            "/v1/namespaces": Route(R, "read", self.list_namespaces, scope="cluster"),
            "/v1/agent/health": Route(R, "plain", self.agent_health, scope="open"),
            "/v1/agent/self": Route(R, "plain", self.agent_self, scope="cluster"),
            "/v1/status/leader": Route(R, "plain", self.status_leader, scope="open"),
            "/v1/status/peers": Route(R, "plain", self.status_peers, scope="open"),
            "/v1/regions": Route(R, "plain", self.regions, scope="open"),
            "/v1/acl/bootstrap": Route(W, "write", self.acl_bootstrap, scope="open"),
            "/v1/acl/token/self": Route(R, "plain", self.acl_token_self, scope="self"),
        }
        if p in exact:
            rt = exact[p]
            if rt.kind == "dispatch":
                if req.method == "GET":
                    return Route(R, "read", self.list_jobs), {}
                return Route(W, "write", self.register_job), {"job_id": ""}
            return rt, {}
        if p.startswith("/v1/job/"):
            rest = p[len("/v1/job/") :]
            suffixes: list[tuple[str, Route]] = [
                ("/evaluate", Route(W, "write", self.evaluate_job)),
                ("/allocations", Route(R, "read", self.job_allocs)),
                ("/evaluations", Route(R, "read", self.job_evals)),
                ("/summary", Route(R, "read", self.job_summary)),
                ("/versions", Route(R, "read", self.job_versions)),
                ("/deployments", Route(R, "read", self.job_deployments)),
                ("/deployment", Route(R, "read", self.job_latest_deployment)),
                ("/plan", Route(W, "write", self.not_implemented)),
                ("/dispatch", Route(W, "write", self.not_implemented)),
                ("/revert", Route(W, "write", self.not_implemented)),
                ("/stable", Route(W, "write", self.not_implemented)),
                ("/periodic/force", Route(W, "write", self.not_implemented)),
            ]
            for suffix, rt in suffixes:
                if rest.endswith(suffix):
                    return rt, {"job_id": rest[: -len(suffix)]}
            if rest.endswith("/scale"):
                job_id = rest[: -len("/scale")]
                if req.method == "GET":
                    return Route(RW, "read", self.job_scale_status), {"job_id": job_id}
                return Route(RW, "write", self.job_scale), {"job_id": job_id}
            all_m = frozenset({"GET", "PUT", "POST", "DELETE"})
            if req.method == "GET":
                return Route(all_m, "read", self.read_job), {"job_id": rest}
            if req.method == "DELETE":
                return Route(all_m, "write", self.deregister_job), {"job_id": rest}
            return Route(all_m, "write", self.register_job), {"job_id": rest}
        if p.startswith("/v1/allocation/"):
            parts = p[len("/v1/allocation/") :].split("/")
            if len(parts) == 1:
                return Route(R, "read", self.read_alloc), {"alloc_id": parts[0]}
            if len(parts) == 2:
                if parts[1] == "stop":
                    return Route(W, "write", self.stop_alloc), {"alloc_id": parts[0]}
                if parts[1] == "checks":
                    return Route(R, "read", self.alloc_checks), {"alloc_id": parts[0]}
            return self._text(404, "resource not found")
        m = re.fullmatch(r"/v1/client/allocation/([^/]+)/restart", p)
        if m:
            return Route(W, "write", self.restart_alloc), {"alloc_id": m.group(1)}
        m = re.fullmatch(r"/v1/evaluation/([^/]+)(/allocations)?", p)
        if m:
            if m.group(2):
                return Route(R, "read", self.eval_allocs), {"eval_id": m.group(1)}
            return Route(R, "read", self.read_eval), {"eval_id": m.group(1)}
        m = re.fullmatch(r"/v1/deployment/fail/([^/]+)", p)
        if m:
            return Route(W, "write", self.fail_deployment), {"deployment_id": m.group(1)}
        m = re.fullmatch(r"/v1/deployment/allocations/([^/]+)", p)
        if m:
            return Route(R, "read", self.deployment_allocs), {"deployment_id": m.group(1)}
        m = re.fullmatch(r"/v1/deployment/([^/]+)", p)
        if m:
            return Route(R, "read", self.read_deployment), {"deployment_id": m.group(1)}
        m = re.fullmatch(r"/v1/node/([^/]+)(/allocations)?", p)
        if m:
            if m.group(2):
                return Route(R, "read", self.node_allocs, scope="cluster"), {"node_id": m.group(1)}
            return Route(R, "read", self.read_node, scope="cluster"), {"node_id": m.group(1)}
        if p == "/v1/vars":
            return Route(R, "read", self.list_variables), {}
        if p.startswith("/v1/var/") or p == "/v1/var":
            var_path = p[len("/v1/var/") :]
            all_m = frozenset({"GET", "PUT", "POST", "DELETE"})
            if not var_path:
                return self._text(400, "missing variable path")
            if req.method == "GET":
                return Route(all_m, "read", self.read_variable), {"path": var_path}
            if req.method == "DELETE":
                return Route(all_m, "write", self.delete_variable), {"path": var_path}
            if req.method in ("PUT", "POST"):
                return Route(all_m, "write", self.upsert_variable), {"path": var_path}
            return self._text(400, INVALID_METHOD)  # VariableSpecificRequest: 400, not 405
        m = re.fullmatch(r"/v1/namespace/([^/]+)", p)
        if m:
            if req.method == "GET":
                return Route(RW, "read", self.read_namespace, scope="cluster"), {"name": m.group(1)}
            return Route(RW, "write", self.upsert_namespace, scope="cluster"), {"name": m.group(1)}
        return self._text(404, "404 page not found\n")

    # ------------------------------------------------------------------ helpers

    def _decode(self, req: Request) -> Any:
        if not req.body.strip():
            raise SpecError("Request body is empty")
        try:
            return json.loads(req.body)
        except json.JSONDecodeError as e:
            doc = req.body.decode("utf-8", "replace")
            if e.pos >= len(doc.rstrip()):
                raise SpecError("unexpected EOF") from e
            ch = doc[e.pos]
            raise SpecError(f"invalid character {ch!r} looking for beginning of value") from e

    def _decode_object(self, req: Request, go_type: str) -> dict[str, Any]:
        """The body, which must be a JSON object (Go decodes it into ``go_type``)."""
        raw = self._decode(req)
        if not isinstance(raw, dict):
            raise NomadError(400, f"json: cannot unmarshal into Go value of type {go_type}")
        return raw

    def _filter(self, req: Request, items: list[dict[str, Any]]) -> list[dict[str, Any]]:
        text = req.query.get("filter")
        if not text:
            return items
        try:
            pred = compile_filter(text)
        except FilterError as e:
            raise NomadError(400, f"failed to read filter expression: {e}") from e
        return [i for i in items if pred(i)]

    @staticmethod
    def _bool_param(req: Request, name: str, default: bool = False) -> bool:
        if name not in req.query or req.query[name] == "":
            return default
        try:
            return parse_bool(req.query[name])
        except ValueError as e:
            raise NomadError(400, f'Failed to parse value of "{name}" ({req.query[name]}) as a bool: {e}') from e

    def _job(self, req: Request, job_id: str) -> dict[str, Any] | None:
        return self.c.jobs.get((req.namespace, job_id))

    # ------------------------------------------------------------------ jobs

    def list_jobs(self, req: Request) -> tuple[Any, int]:
        ns = req.namespace
        prefix = req.query.get("prefix", "")
        meta = self._bool_param(req, "meta")
        jobs = [j for (jns, jid), j in self.c.jobs.items() if (ns == "*" or jns == ns) and jid.startswith(prefix)]
        jobs.sort(key=lambda j: (j["ID"], j["Namespace"]))
        body = self._filter(req, [job_stub(self.c, j, meta=meta) for j in jobs])
        return body, self.c.tindex("jobs", "job_summary")

    def register_job(self, req: Request, job_id: str) -> tuple[Any, int]:
        raw = self._decode(req)
        args = normalize(raw, "JobRegisterRequest", path="", strict=self.strict)
        job = args.get("Job")
        if job is None:
            raise NomadError(400, "Job must be specified")
        if job.get("ID") is None:
            raise NomadError(400, "Job ID hasn't been provided")
        if job_id and job["ID"] != job_id:
            raise NomadError(400, "Job ID does not match name")
        if job.get("Type") == "system":
            for tg in job.get("TaskGroups") or []:
                if tg.get("Scaling") is not None:
                    raise NomadError(400, "Task groups with job type system do not support scaling blocks")
        eval_priority = int(args.get("EvalPriority") or 0)
        if eval_priority and not 1 <= eval_priority <= 100:
            raise NomadError(400, "Eval priority must be between 1 and 100 inclusively")
        if req.query.get("namespace"):
            job["Namespace"] = req.query["namespace"]
        elif not job.get("Namespace"):
            job["Namespace"] = "default"
        if req.query.get("region"):
            job["Region"] = req.query["region"]
        region = job.get("Region") or "global"
        if region not in ("global", self.c.region):
            raise NomadError(500, "No path to region")
        canon = canonicalize_job(job, agent_region=self.c.region)
        errors = validate_job(canon)
        if errors:
            raise NomadError(500, multierror(errors))
        reply = self.c.register_job(
            canon,
            enforce_index=bool(args.get("EnforceIndex")),
            job_modify_index=int(args.get("JobModifyIndex") or 0),
            preserve_counts=bool(args.get("PreserveCounts")),
            eval_priority=eval_priority,
        )
        return reply, reply["Index"]

    def jobs_parse(self, req: Request) -> tuple[Any, int]:
        raise NomadError(500, "fake-nomad: /v1/jobs/parse is not implemented (no HCL parser)")

    def not_implemented(self, req: Request, **_: str) -> tuple[Any, int]:
        raise NomadError(500, f"fake-nomad: {req.method} {req.path} is not implemented")

    def validate_job(self, req: Request) -> tuple[Any, int]:
        raw = self._decode(req)
        args = normalize(raw, "JobRegisterRequest", path="", strict=self.strict)
        job = args.get("Job")
        if job is None:
            raise NomadError(400, "Job must be specified")
        job = dict(job)
        job.setdefault("ID", "")
        canon = canonicalize_job(job, agent_region=self.c.region)
        errors = validate_job(canon)
        return (
            {
                "DriverConfigValidated": True,
                "ValidationErrors": errors or None,
                "Error": multierror(errors) if errors else "",
                "Warnings": "",
            },
            self.c.index,
        )

    def read_job(self, req: Request, job_id: str) -> tuple[Any, int]:
        job = self._job(req, job_id)
        if job is None:
            raise NomadError(404, "job not found", index=self.c.tindex("jobs"))
        return job, job["ModifyIndex"]

    def deregister_job(self, req: Request, job_id: str) -> tuple[Any, int]:
        purge = False
        for name in ("purge", "global", "no_shutdown_delay"):
            value = req.query.get(name, "")
            if value:
                try:
                    parsed = parse_bool(value)
                except ValueError as e:
                    raise NomadError(500, f'Failed to parse value of "{name}" ({value}) as a bool: {e}') from e
                if name == "purge":
                    purge = parsed
        eval_priority = 0
        if req.query.get("eval_priority"):
            try:
                eval_priority = int(req.query["eval_priority"])
            except ValueError as e:
                raise NomadError(
                    400, f'Failed to parse value of "eval_priority" ({req.query["eval_priority"]}) as an int: {e}'
                ) from e
            if not 1 <= eval_priority <= 100:
                raise NomadError(400, "Eval priority must be between 1 and 100 inclusively")
        reply = self.c.deregister_job(req.namespace, job_id, purge=purge, eval_priority=eval_priority)
        return reply, reply["Index"]

    def evaluate_job(self, req: Request, job_id: str) -> tuple[Any, int]:
        if req.body.strip():
            raw = self._decode(req)
            if not isinstance(raw, dict) or not raw.get("JobID"):
                raise NomadError(400, "Job ID must be specified")
            if raw["JobID"] != job_id:
                raise NomadError(400, "JobID not same as job name")
        reply = self.c.evaluate_job(req.namespace, job_id)
        return reply, reply["Index"]

    def job_allocs(self, req: Request, job_id: str) -> tuple[Any, int]:
        try:
            all_ = parse_bool(req.query.get("all", "false") or "false")
        except ValueError:
            all_ = False
        job = self._job(req, job_id)
        allocs = [a for a in self.c.allocs.values() if a.job_id == job_id and a.namespace == req.namespace]
        if job is not None and not all_:
            allocs = [a for a in allocs if a.job_create_index == job["CreateIndex"]]
        allocs.sort(key=lambda a: a.id)
        return [alloc_stub(a) for a in allocs], self.c.tindex("allocs")

    def job_evals(self, req: Request, job_id: str) -> tuple[Any, int]:
        evals = [
            eval_json(e) for e in self.c.evals.values() if e["JobID"] == job_id and e["Namespace"] == req.namespace
        ]
        return evals, self.c.tindex("evals")

    def job_deployments(self, req: Request, job_id: str) -> tuple[Any, int]:
        ds = [d for d in self.c.deployments.values() if d.job_id == job_id and d.namespace == req.namespace]
        ds.sort(key=lambda d: -d.create_index)
        return [deployment_json(self.c, d) for d in ds], self.c.tindex("deployment")

    def job_latest_deployment(self, req: Request, job_id: str) -> tuple[Any, int]:
        d = self.c._latest_deployment((req.namespace, job_id))
        return (deployment_json(self.c, d) if d else None), self.c.tindex("deployment")

    def job_summary(self, req: Request, job_id: str) -> tuple[Any, int]:
        job = self._job(req, job_id)
        if job is None:
            raise NomadError(404, "job not found", index=self.c.tindex("job_summary"))
        s = job_summary(self.c, job)
        return s, s["ModifyIndex"]

    def job_versions(self, req: Request, job_id: str) -> tuple[Any, int]:
        versions = self.c.job_versions.get((req.namespace, job_id), [])
        if not versions:
            raise NomadError(404, "job versions not found", index=self.c.tindex("job_version"))
        index = max(v["ModifyIndex"] for v in versions)
        return (
            {
                "Versions": versions,
                "Diffs": None,
                "Index": index,
                "LastContact": 0,
                "KnownLeader": self.faults.leader,
                "NextToken": "",
            },
            index,
        )

    def job_scale_status(self, req: Request, job_id: str) -> tuple[Any, int]:
        job = self._job(req, job_id)
        if job is None:
            raise NomadError(404, "job not found", index=self.c.tindex("jobs"))
        return scale_status(self.c, job)

    def job_scale(self, req: Request, job_id: str) -> tuple[Any, int]:
        raw = self._decode(req)
        args = normalize(raw, "ScalingRequest", path="", strict=self.strict)
        target = args.get("Target") or {}
        target_job = target.get("Job") or ""
        if target_job and target_job != job_id:
            raise NomadError(400, "job ID in payload did not match URL")
        count = args.get("Count")
        reply = self.c.scale_job(
            req.namespace,
            job_id,
            group=str(target.get("Group") or ""),
            count=int(count) if count is not None else None,
            message=str(args.get("Message") or ""),
            error=bool(args.get("Error")),
            meta=args.get("Meta"),
            job_modify_index=int(args.get("JobModifyIndex") or 0),
        )
        return reply, reply["Index"]

    # ------------------------------------------------------------------ allocations

    def list_allocs(self, req: Request) -> tuple[Any, int]:
        ns = req.namespace
        prefix = req.query.get("prefix", "")
        resources = self._bool_param(req, "resources")
        task_states = self._bool_param(req, "task_states", default=True)
        allocs = [a for a in self.c.allocs.values() if (ns == "*" or a.namespace == ns) and a.id.startswith(prefix)]
        allocs.sort(key=lambda a: a.id)
        body = self._filter(req, [alloc_stub(a, resources=resources, task_states=task_states) for a in allocs])
        return body, self.c.tindex("allocs")

    def read_alloc(self, req: Request, alloc_id: str) -> tuple[Any, int]:
        a = self.c.allocs.get(alloc_id)
        if a is None:
            raise NomadError(404, "alloc not found", index=self.c.tindex("allocs"))
        return alloc_full(self.c, a), a.modify_index

    def alloc_checks(self, req: Request, alloc_id: str) -> tuple[Any, int]:
        if alloc_id not in self.c.allocs:
            raise NomadError(404, "alloc not found")
        return {}, self.c.tindex("allocs")

    def stop_alloc(self, req: Request, alloc_id: str) -> tuple[Any, int]:
        reply = self.c.stop_alloc(alloc_id)
        return reply, reply["Index"]

    def restart_alloc(self, req: Request, alloc_id: str) -> tuple[Any, int]:
        task, all_tasks = "", False
        if req.body.strip():
            raw = self._decode(req)
            if isinstance(raw, dict):
                task = str(raw.get("TaskName") or "")
                all_tasks = bool(raw.get("AllTasks"))
        self.c.restart_alloc(alloc_id, task, all_tasks)
        return {}, self.c.index

    # ------------------------------------------------------------------ evaluations

    def list_evals(self, req: Request) -> tuple[Any, int]:
        ns = req.namespace
        prefix = req.query.get("prefix", "")
        job = req.query.get("job", "")
        status = req.query.get("status", "")
        evals = [
            eval_json(e)
            for e in self.c.evals.values()
            if (ns == "*" or e["Namespace"] == ns)
            and e["ID"].startswith(prefix)
            and (not job or e["JobID"] == job)
            and (not status or e["Status"] == status)
        ]
        return self._filter(req, evals), self.c.tindex("evals")

    def read_eval(self, req: Request, eval_id: str) -> tuple[Any, int]:
        ev = self.c.evals.get(eval_id)
        if ev is None:
            raise NomadError(404, "eval not found", index=self.c.tindex("evals"))
        body = eval_json(ev)
        if self._bool_param(req, "related"):
            related = []
            seen = {eval_id}
            queue = [ev]
            while queue:
                cur = queue.pop()
                for key in ("NextEval", "PreviousEval", "BlockedEval"):
                    other = self.c.evals.get(cur.get(key) or "")
                    if other is not None and other["ID"] not in seen:
                        seen.add(other["ID"])
                        queue.append(other)
                        related.append(
                            {
                                k: other.get(k)
                                for k in (
                                    "ID",
                                    "Namespace",
                                    "Priority",
                                    "Type",
                                    "TriggeredBy",
                                    "JobID",
                                    "NodeID",
                                    "DeploymentID",
                                    "Status",
                                    "StatusDescription",
                                    "WaitUntil",
                                    "NextEval",
                                    "PreviousEval",
                                    "BlockedEval",
                                    "CreateIndex",
                                    "ModifyIndex",
                                    "CreateTime",
                                    "ModifyTime",
                                )
                            }
                        )
            body["RelatedEvals"] = related
        return body, ev["ModifyIndex"]

    def eval_allocs(self, req: Request, eval_id: str) -> tuple[Any, int]:
        allocs = [alloc_stub(a) for a in self.c.allocs.values() if a.eval_id == eval_id]
        return allocs, self.c.tindex("allocs")

    # ------------------------------------------------------------------ deployments

    def list_deployments(self, req: Request) -> tuple[Any, int]:
        ns = req.namespace
        ds = [deployment_json(self.c, d) for d in self.c.deployments.values() if ns == "*" or d.namespace == ns]
        return self._filter(req, ds), self.c.tindex("deployment")

    def read_deployment(self, req: Request, deployment_id: str) -> tuple[Any, int]:
        d = self.c.deployments.get(deployment_id)
        if d is None:
            raise NomadError(404, "deployment not found", index=self.c.tindex("deployment"))
        return deployment_json(self.c, d), d.modify_index

    def deployment_allocs(self, req: Request, deployment_id: str) -> tuple[Any, int]:
        allocs = [alloc_stub(a) for a in self.c.allocs.values() if a.deployment_id == deployment_id]
        return allocs, self.c.tindex("allocs")

    def fail_deployment(self, req: Request, deployment_id: str) -> tuple[Any, int]:
        reply = self.c.fail_deployment(deployment_id)
        return reply, reply["Index"]

    # ------------------------------------------------------------------ variables

    @staticmethod
    def _cas(req: Request) -> int | None:
        value = req.query.get("cas", "")
        if value == "":
            return None
        try:
            cas = int(value)
            if cas < 0:
                raise ValueError
        except ValueError as e:
            raise NomadError(400, f'can not parse cas: strconv.ParseUint: parsing "{value}": invalid syntax') from e
        return cas

    def _conflict(self, current: dict[str, Any] | None) -> _Reply:
        # Nomad answers the conflicting variable as JSON (an absent one as an empty variable).
        body = current or {"Namespace": "", "Path": "", "Lock": None, "CreateIndex": 0, "CreateTime": 0,
                           "ModifyIndex": 0, "ModifyTime": 0, "Items": None}
        payload = json.dumps(body, separators=(",", ":")).encode()
        return _Reply(self._json(payload, [("X-Nomad-Index", str(max(body["ModifyIndex"], 1)))], status=409))

    def list_variables(self, req: Request) -> tuple[Any, int]:
        found = self.c.variables.list(req.namespace, req.query.get("prefix", ""))
        return self._filter(req, found), self.c.tindex("variables")

    def read_variable(self, req: Request, path: str) -> tuple[Any, int]:
        v = self.c.variables.get(req.namespace, path)
        if v is None:
            raise NomadError(404, "variable not found", index=self.c.tindex("variables"))
        return v, v["ModifyIndex"]

    def upsert_variable(self, req: Request, path: str) -> tuple[Any, int]:
        raw = self._decode_object(req, "structs.VariableDecrypted")
        items = raw.get("Items")
        if not isinstance(items, dict) or not items:
            raise NomadError(400, "variable missing required Items object")
        if not all(isinstance(v, str) for v in items.values()):
            raise NomadError(400, "json: cannot unmarshal number into Go struct field "
                                  "VariableDecrypted.Items of type string")
        namespace = req.query.get("namespace") or str(raw.get("Namespace") or "") or "default"
        cas = self._cas(req)
        try:
            v = self.c.variables.upsert(namespace, path, {str(k): v for k, v in items.items()}, cas)
        except VariableConflict as e:
            raise self._conflict(e.current) from None
        except ValueError as e:
            raise NomadError(500, str(e)) from e
        return v, v["ModifyIndex"]

    def delete_variable(self, req: Request, path: str) -> tuple[Any, int]:
        cas = self._cas(req)
        try:
            index = self.c.variables.delete(req.namespace, path, cas)
        except VariableConflict as e:
            raise self._conflict(e.current) from None
        raise _Reply(Response(204, b"", [("X-Nomad-Index", str(index))]))

    # ------------------------------------------------------------------ nodes / namespaces / agent

    def list_nodes(self, req: Request) -> tuple[Any, int]:
        prefix = req.query.get("prefix", "")
        resources = self._bool_param(req, "resources")
        os_attrs = self._bool_param(req, "os")
        nodes = [
            node_stub(self.c, n, resources=resources, os_attrs=os_attrs)
            for n in self.c.nodes.values()
            if n.id.startswith(prefix)
        ]
        return self._filter(req, nodes), self.c.tindex("nodes")

    def read_node(self, req: Request, node_id: str) -> tuple[Any, int]:
        n = self.c.nodes.get(node_id)
        if n is None:
            matches = [x for x in self.c.nodes.values() if x.id.startswith(node_id)] if len(node_id) >= 1 else []
            if len(matches) == 1 and len(node_id) < 36:
                n = matches[0]
        if n is None:
            raise NomadError(404, "node not found", index=self.c.tindex("nodes"))
        return node_full(self.c, n), n.modify_index

    def node_allocs(self, req: Request, node_id: str) -> tuple[Any, int]:
        allocs = [alloc_full(self.c, a) for a in self.c.allocs.values() if a.node_id == node_id]
        return allocs, self.c.tindex("allocs")

    def list_namespaces(self, req: Request) -> tuple[Any, int]:
        return sorted(self.c.namespaces.values(), key=lambda n: n["Name"]), self.c.tindex("namespaces")

    def read_namespace(self, req: Request, name: str) -> tuple[Any, int]:
        ns = self.c.namespaces.get(name)
        if ns is None:
            raise NomadError(404, "Namespace not found", index=self.c.tindex("namespaces"))
        return ns, ns["ModifyIndex"]

    def upsert_namespace(self, req: Request, name: str) -> tuple[Any, int]:
        raw = self._decode_object(req, "structs.Namespace")
        if raw.get("Name") and raw["Name"] != name:
            raise NomadError(400, "Namespace name does not match request path")
        self.c.add_namespace(name, str(raw.get("Description") or ""))
        return None, self.c.index

    def agent_health(self, req: Request) -> tuple[Any, int]:
        ok = {"ok": True, "message": "ok"}
        return {"client": ok, "server": ok}, self.c.index

    def agent_self(self, req: Request) -> tuple[Any, int]:
        return (
            {
                "config": {
                    "Region": self.c.region,
                    "Datacenter": self.c.datacenter,
                    "ACL": {"Enabled": self.acl.enabled},
                    "Version": {"Version": "2.0.6"},
                },
                "member": {
                    "Name": "fake-nomad.global",
                    "Addr": "127.0.0.1",
                    "Port": 4648,
                    "Tags": {"region": self.c.region, "dc": self.c.datacenter, "role": "nomad"},
                    "Status": "alive",
                },
                "stats": {},
            },
            self.c.index,
        )

    def status_leader(self, req: Request) -> tuple[Any, int]:
        return ("127.0.0.1:4647" if self.faults.leader else ""), self.c.index

    def status_peers(self, req: Request) -> tuple[Any, int]:
        return ["127.0.0.1:4647"], self.c.index

    def regions(self, req: Request) -> tuple[Any, int]:
        return [self.c.region], self.c.index

    def acl_bootstrap(self, req: Request) -> tuple[Any, int]:
        if not self.acl.enabled:
            raise NomadError(400, "ACL support disabled")
        if self.acl.bootstrapped_index:
            raise NomadError(400, f"ACL bootstrap already done (reset index: {self.acl.bootstrapped_index})")
        tok = self.acl.create(name="Bootstrap Token", type_="management", namespaces=None)
        self.acl.bootstrapped_index = tok.create_index
        return tok.to_json(), tok.create_index

    def acl_token_self(self, req: Request) -> tuple[Any, int]:
        if not self.acl.enabled:
            raise NomadError(400, "ACL support disabled")
        secret = req.headers.get("x-nomad-token", "")
        tok = self.acl.tokens.get(secret)
        if tok is None:
            raise NomadError(403, PERMISSION_DENIED)
        return tok.to_json(), tok.create_index
