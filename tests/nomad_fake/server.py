"""``FakeNomad``: a stateful fake of the Nomad HTTP API on a real loopback socket.

Usage::

    with FakeNomad(driver=NullDriver(), time_scale=0.1) as fake:
        n = nomad.Nomad(address=fake.address)          # sync python-nomad
        async with httpx.AsyncClient(base_url=fake.address) as h:  # or async httpx
            ...
        fake.crash_alloc(alloc_id)                      # Python-only fault injection

The HTTP server is uvicorn running our ASGI app (``api.py``) in a background thread with
its own event loop; the client simulation is a monitor thread (``client.py``); all state
lives in a :class:`~.state.Cluster` guarded by one lock.
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import socket
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from types import TracebackType
from typing import Any

import uvicorn

from .api import Acl, ErrorRule, Faults, NomadApp, RequestRecord
from .client import Monitor
from .drivers import NullDriver, TaskDriver
from .state import Cluster
from .views import alloc_full, alloc_stub


class FakeNomad:
    """A fake Nomad agent (server + clients) for tests.

    Parameters:
        driver: runs the tasks (default :class:`NullDriver`).
        nodes: number of client nodes (all on 127.0.0.1, datacenter ``datacenter``).
        time_scale: real seconds per Nomad second for every Nomad duration (restart and
            reschedule delays, ``MinHealthyTime``, deadlines). 1.0 is real time; tests
            usually want 0.01-0.1. Blocking-query ``wait`` is always real time.
        acl_enabled: require ``X-Nomad-Token``; a management token is created and exposed
            as :attr:`management_token` (the fake counts as bootstrapped).
        start_delay: Nomad seconds between placement and the driver start.
        max_allocs_per_node: capacity per node; over it, evaluations get
            ``FailedTGAllocs`` and a ``blocked`` evaluation.
        strict: reject unknown job-spec fields with 400 instead of dropping them.
        tick: monitor period in real seconds.
        tls: ``(certfile, keyfile)`` PEM paths: serve HTTPS (``address`` is then ``https://``),
            as an agent with ``tls { http = true }`` does.
    """

    def __init__(
        self,
        *,
        driver: TaskDriver | None = None,
        nodes: int = 1,
        region: str = "global",
        datacenter: str = "dc1",
        time_scale: float = 1.0,
        acl_enabled: bool = False,
        start_delay: float = 0.0,
        max_allocs_per_node: int | None = None,
        strict: bool = False,
        tick: float = 0.02,
        host: str = "127.0.0.1",
        port: int = 0,
        tls: tuple[str, str] | None = None,
        node_ip: str = "127.0.0.1",
        data_dir: str | None = None,
    ) -> None:
        self.driver: TaskDriver = driver if driver is not None else NullDriver()
        # the client's data dir (task directories, rendered templates): a temporary one unless given,
        # removed by stop()
        self._own_data_dir = data_dir is None
        self.data_dir = data_dir if data_dir is not None else tempfile.mkdtemp(prefix="fake-nomad-data-")
        self.cluster = Cluster(
            nodes=nodes,
            region=region,
            datacenter=datacenter,
            time_scale=time_scale,
            start_delay=start_delay,
            max_allocs_per_node=max_allocs_per_node,
            node_ip=node_ip,
            data_dir=self.data_dir,
        )
        self.faults = Faults()
        self.acl = Acl(self.cluster, acl_enabled)
        self.tls = tls
        self.management_token: str | None = None
        if acl_enabled:
            tok = self.acl.create(name="Bootstrap Token", type_="management", namespaces=None)
            self.acl.bootstrapped_index = tok.create_index
            self.management_token = tok.secret_id
        self.app = NomadApp(self.cluster, faults=self.faults, acl=self.acl, strict=strict)
        self.cluster.listeners.append(self.app.notify)
        self.monitor = Monitor(self.cluster, self.driver, tick=tick)
        self.cluster.kick = self.monitor.kick
        self._host = host
        self._port = port
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._server: uvicorn.Server | None = None
        self._serve_future: Future[None] | None = None
        self._started = False

    # ------------------------------------------------------------------ lifecycle

    @property
    def address(self) -> str:
        """``http://127.0.0.1:PORT`` (``https://`` with ``tls``)."""
        return f"{'https' if self.tls else 'http'}://{self._host}:{self._port}"

    @property
    def port(self) -> int:
        return self._port

    def start(self) -> FakeNomad:
        if self._started:
            return self
        ready = threading.Event()

        def run() -> None:
            loop = asyncio.new_event_loop()
            asyncio.set_event_loop(loop)
            self._loop = loop
            self.app.bind_loop(loop)
            ready.set()
            try:
                loop.run_forever()
            finally:
                tasks = asyncio.all_tasks(loop)
                for t in tasks:
                    t.cancel()
                with contextlib.suppress(Exception):
                    loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))
                loop.close()

        self._thread = threading.Thread(target=run, name="fake-nomad-http", daemon=True)
        self._thread.start()
        ready.wait()
        self._serve()
        self.cluster.http_addr = f"{self._host}:{self._port}"
        for node in self.cluster.nodes.values():
            node.http_addr = self.cluster.http_addr
        self.monitor.start()
        self._started = True
        return self

    def stop(self) -> None:
        if not self._started:
            return
        self._started = False
        self.monitor.stop()
        self._unserve()
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._loop.stop)
        if self._thread is not None:
            self._thread.join(timeout=10)
        if self._own_data_dir:
            shutil.rmtree(self.data_dir, ignore_errors=True)

    def __enter__(self) -> FakeNomad:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    def _bind(self) -> socket.socket:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((self._host, self._port))
        sock.listen(128)
        sock.setblocking(False)
        self._port = int(sock.getsockname()[1])
        return sock

    def _serve(self) -> None:
        assert self._loop is not None
        sock = self._bind()
        config = uvicorn.Config(
            self.app,
            lifespan="off",
            log_level="critical",
            log_config=None,
            access_log=False,
            timeout_graceful_shutdown=1,
            timeout_keep_alive=30,
            ssl_certfile=self.tls[0] if self.tls else None,
            ssl_keyfile=self.tls[1] if self.tls else None,
        )
        server = uvicorn.Server(config)
        self._server = server
        self._serve_future = asyncio.run_coroutine_threadsafe(server.serve(sockets=[sock]), self._loop)
        deadline = time.monotonic() + 10
        while not server.started:
            if self._serve_future.done():
                self._serve_future.result()
                raise RuntimeError("fake nomad HTTP server exited during startup")
            if time.monotonic() > deadline:
                raise RuntimeError("fake nomad HTTP server did not start")
            time.sleep(0.005)

    def _unserve(self) -> None:
        server, fut = self._server, self._serve_future
        if server is None or fut is None or self._loop is None:
            return
        server.should_exit = True
        server.force_exit = True

        def abort_connections() -> None:
            for conn in list(server.server_state.connections):
                transport = getattr(conn, "transport", None)
                if transport is not None:
                    transport.abort()

        self._loop.call_soon_threadsafe(abort_connections)
        self.app.notify()  # wake blocking queries so they notice
        with contextlib.suppress(Exception):
            fut.result(timeout=10)
        self._server = None
        self._serve_future = None

    # ------------------------------------------------------------------ inspection helpers

    def allocations(self, job_id: str | None = None, namespace: str = "default") -> list[dict[str, Any]]:
        """List stubs (as ``/v1/job/:id/allocations`` returns them) of the job's allocations."""
        with self.cluster.lock:
            return [
                alloc_stub(a)
                for a in sorted(self.cluster.allocs.values(), key=lambda a: a.create_index)
                if (job_id is None or a.job_id == job_id) and a.namespace == namespace
            ]

    def allocation(self, alloc_id: str) -> dict[str, Any]:
        """The full allocation JSON, as ``/v1/allocation/:id`` returns it."""
        with self.cluster.lock:
            return alloc_full(self.cluster, self.cluster.allocs[alloc_id])

    def running(self, job_id: str, namespace: str = "default") -> list[dict[str, Any]]:
        """Stubs of the job's allocations that are ``run``/``running``, sorted by name index."""
        allocs = [
            a
            for a in self.allocations(job_id, namespace)
            if a["DesiredStatus"] == "run" and a["ClientStatus"] == "running"
        ]
        return sorted(allocs, key=lambda a: _name_index(a["Name"]))

    def wait_for(
        self, predicate: Callable[[], Any], *, timeout: float = 10.0, interval: float = 0.02, message: str = "condition"
    ) -> Any:
        """Poll ``predicate`` until it returns something truthy; return that value."""
        deadline = time.monotonic() + timeout
        while True:
            value = predicate()
            if value:
                return value
            if time.monotonic() > deadline:
                errors = "\n".join(self.monitor_errors[-3:])
                raise TimeoutError(f"timed out after {timeout}s waiting for {message}\n{errors}")
            time.sleep(interval)

    def wait_running(
        self, job_id: str, count: int, *, namespace: str = "default", timeout: float = 10.0
    ) -> list[dict[str, Any]]:
        """Wait until exactly ``count`` allocations of the job are desired-run and running."""

        def ok() -> list[dict[str, Any]] | None:
            live = [a for a in self.allocations(job_id, namespace) if a["DesiredStatus"] == "run"]
            running = [a for a in live if a["ClientStatus"] == "running"]
            return running if len(running) == count and len(live) == count else None

        if count == 0:
            self.wait_for(
                lambda: not [a for a in self.allocations(job_id, namespace) if a["DesiredStatus"] == "run"],
                timeout=timeout,
                message=f"{job_id} to have no allocations",
            )
            return []
        return sorted(
            self.wait_for(ok, timeout=timeout, message=f"{count} running allocations of {job_id}"),
            key=lambda a: _name_index(a["Name"]),
        )

    def requests(
        self, path: str | None = None, *, method: str | None = None, since: float = 0.0
    ) -> list[RequestRecord]:
        """Requests received (oldest first) whose path is ``path`` (exactly), by ``method``, at or
        after ``since`` (a ``time.monotonic()`` value)."""
        return [
            r
            for r in list(self.app.log)
            if (path is None or r.path == path) and (method is None or r.method == method) and r.time >= since
        ]

    def variable(self, path: str, namespace: str = "default") -> dict[str, Any] | None:
        """The stored variable (with ``Items``), as ``GET /v1/var/:path`` returns it, or None."""
        with self.cluster.lock:
            v = self.cluster.variables.get(namespace, path)
            return dict(v) if v is not None else None

    @property
    def node_ids(self) -> list[str]:
        with self.cluster.lock:
            return list(self.cluster.nodes)

    @property
    def monitor_errors(self) -> list[str]:
        """Tracebacks from the monitor thread and HTTP handlers (should stay empty)."""
        return list(self.monitor.errors) + list(self.app.errors)

    def advance(self, seconds: float) -> None:
        """Jump the fake Nomad clock forward (restart/reschedule delays, health timers)."""
        self.cluster.advance(seconds)

    # ------------------------------------------------------------------ fault injection

    def crash_alloc(
        self, alloc_id: str, exit_code: int = 1, *, signal: int = 0, oom: bool = False, task: str | None = None
    ) -> None:
        """Kill the allocation's running task(s) as a crash with ``exit_code``.

        The driver's ``stop`` is called, a ``Terminated`` event is recorded and the job's
        restart policy decides: restart in place (same ID, ``Restarts`` + 1) or fail the
        allocation, after which the reschedule policy places a replacement with a new ID and
        the same name. Asynchronous: happens on the next monitor tick.
        """
        self.cluster.request_crash(alloc_id, exit_code=exit_code, signal=signal, oom=oom, task=task)

    def fail_driver(self, next_n: int = 1, message: str = "failed to start task: injected driver failure") -> None:
        """Make the next ``next_n`` task starts fail as unrecoverable driver failures."""
        with self.cluster.lock:
            self.cluster.driver_failures.extend([message] * next_n)

    def node_down(self, node_id: str) -> None:
        """Mark the node ``down``: its running allocations become ``lost`` (their processes
        are killed silently) and the scheduler places replacements elsewhere; with no
        other node they stay queued behind a ``blocked`` evaluation until :meth:`node_up`."""
        self.cluster.set_node_status(node_id, "down")

    def node_up(self, node_id: str) -> None:
        self.cluster.set_node_status(node_id, "ready")

    def add_node(self, name: str | None = None) -> str:
        return self.cluster.add_node(name)

    def http_errors(
        self,
        path_prefix: str,
        status: int,
        count: int = 1,
        *,
        body: str | None = None,
        method: str | None = None,
        blocking: bool | None = None,
    ) -> ErrorRule:
        """Answer the next ``count`` requests whose path starts with ``path_prefix`` with
        ``status`` and a plain-text ``body`` (default: a Nomad-like RPC error). ``blocking=True``
        only hits blocking queries (``?index=N``, N > 0), ``False`` only the others. Returns the
        rule (``rule.remaining`` tells how many are left)."""
        if body is None:
            body = "rpc error: injected failure" if status >= 500 else "injected error"
        rule = ErrorRule(path_prefix, status, count, body, method, blocking)
        self.faults.error_rules.append(rule)
        return rule

    def set_latency(self, seconds: float, path_prefix: str = "/v1/") -> None:
        """Delay every request under ``path_prefix`` by ``seconds`` (0 removes it)."""
        self.faults.latency = [(p, s) for p, s in self.faults.latency if p != path_prefix]
        if seconds > 0:
            self.faults.latency.append((path_prefix, seconds))

    def set_unreachable(self, unreachable: bool = True) -> None:
        """Close the listener and drop open connections (clients get connection refused /
        reset); ``False`` listens again on the same port. State and tasks keep running."""
        if unreachable == self.faults.unreachable:
            return
        self.faults.unreachable = unreachable
        if unreachable:
            self._unserve()
        else:
            self._serve()

    def set_leader(self, known: bool) -> None:
        """``False``: every non-stale API call answers 500 ``No cluster leader``."""
        self.faults.leader = known
        self.app.notify()

    def start_deployment_blocking(self, job_id: str, namespace: str = "default") -> str:
        """Open (or hold) an active deployment for the job that will not complete on its own,
        so ``POST /v1/job/:id/scale`` answers 400 ``job scaling blocked due to active
        deployment``. Returns the deployment ID; see :meth:`finish_deployment`."""
        return self.cluster.hold_deployment(namespace, job_id)

    def finish_deployment(self, job_id: str, namespace: str = "default", *, success: bool = True) -> None:
        """Complete the job's active deployment now (``successful`` or ``failed``)."""
        self.cluster.release_deployment(namespace, job_id, success=success)

    # ------------------------------------------------------------------ ACL / namespaces

    def create_token(self, namespaces: list[str] | None = None, *, name: str = "fake-client-token") -> str:
        """A client token allowed in ``namespaces`` (``["*"]`` for all); returns its SecretID."""
        tok = self.acl.create(name=name, type_="client", namespaces=list(namespaces or []))
        return tok.secret_id

    def add_namespace(self, name: str, description: str = "") -> None:
        self.cluster.add_namespace(name, description)


def _name_index(name: str) -> int:
    try:
        return int(name.rsplit("[", 1)[1].rstrip("]"))
    except (IndexError, ValueError):
        return -1
