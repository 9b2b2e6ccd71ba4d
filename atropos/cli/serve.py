"""``serve``: the ToolServer with a pool in the foreground, and the pieces it is built from.

``backend_settings`` hands the backend part of the settings to ``atropos.backends.config``, the
mapping AgentEnv, the tests and the benchmarks use too; ``nomad render`` prints what ``nomad_config``
makes, so what it shows is what serve registers.
"""

from __future__ import annotations

import argparse
import errno
import logging
import os
import signal
import socket
import sys
from typing import Any

from atropos.backends.base import BackendKind
from atropos.cli.exit_codes import EXIT_INFRA, EXIT_OK
from atropos.cli.settings import TOKEN_ENV, ServeSettings, load_settings, read_private_token, setup_logging
from atropos.errors import ConfigError, InfrastructureError
from atropos.sandbox.contract.launch import make_undumpable

log = logging.getLogger("atropos.cli")


def backend_settings(s: ServeSettings, kind: BackendKind | None = None) -> Any:
    """What these settings say about the backend (atropos.backends.config maps it the same way
    for AgentEnv, tests and benchmarks)."""
    from atropos.backends.config import BackendSettings

    return BackendSettings(kind=kind or s.backend, pool_id=s.pool_id, slots_per_host=s.slots_per_host,
                           image=s.image, nomad_address=s.nomad_address, ray_address=s.ray_address)


def nomad_config(s: ServeSettings) -> Any:
    """The Nomad backend's config for these settings: ``serve`` and ``nomad render`` both use it,
    so what render prints is what serve registers (NOMAD_*/ATROPOS_NOMAD_* apply to both)."""
    from atropos.backends.config import backend_config

    return backend_config(backend_settings(s, "nomad"))


def build_pool(s: ServeSettings) -> Any:
    from atropos.backends.config import build_backend
    from atropos.slots.config import PoolConfig
    from atropos.slots.pool import SlotPool

    return SlotPool(build_backend(backend_settings(s)),
                    PoolConfig(pool_id=s.pool_id, min_hosts=s.min_hosts, max_hosts=s.max_hosts))


def build_app(s: ServeSettings, token: str | None, pool: Any = None) -> Any:
    """The ToolServer app; it starts and stops its pool in its lifespan unless ``pool`` is given
    (then the caller does: ``cmd_serve``, before it serves)."""
    from atropos.api.externals import web_externals
    from atropos.api.server import ToolServerSettings, create_tool_server
    from atropos.tools.registry import ToolRegistry

    externals: dict[str, Any] = {}
    with_web = s.web_provider != "none"
    if with_web:
        from atropos.tools.web import WebToolsConfig, make_provider

        provider = make_provider(WebToolsConfig(provider=s.web_provider, corpus_dir=s.corpus_dir,
                                                base_url=s.web_base_url))
        externals = web_externals(provider)
    return create_tool_server(
        pool or build_pool(s), ToolServerSettings(token=token, allow_no_auth=s.allow_no_auth,
                                                  public_metrics=not s.metrics_need_token),
        registry=ToolRegistry.default(with_web=with_web), externals=externals, manage_pool=pool is None,
    )


def resolve_token(s: ServeSettings) -> str | None:
    """--token-file, else $ATROPOS_TOOLSERVER_TOKEN."""
    token = os.environ.get(TOKEN_ENV)
    if s.token_file is not None:
        token = read_private_token(s.token_file)
    if s.allow_no_auth:
        if s.listen_host not in ("127.0.0.1", "::1", "localhost"):
            raise ConfigError("--allow-no-auth is only allowed on a loopback address")
        return token
    if not token:
        raise ConfigError(f"give --token-file (or set ${TOKEN_ENV}): the bearer token clients must send; or use "
                          "--allow-no-auth on loopback for development")
    return token


def bind_socket(host: str, port: int) -> socket.socket:
    """Bind before anything starts: a busy port is a clear exit 3, not uvicorn's ``sys.exit(1)``
    after the pool already started its hosts."""
    from atropos.asgi import listening_socket

    try:
        family, _, _, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except socket.gaierror as exc:
        raise ConfigError(f"cannot listen on {host!r}: {exc.strerror}") from None
    try:
        return listening_socket(family, addr, 2048)
    except OSError as exc:
        if exc.errno == errno.EADDRINUSE:
            raise InfrastructureError(f"port {port} on {host} is already in use (another ToolServer or "
                                      "`pool up`?); choose another with --port") from None
        raise InfrastructureError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None


def where_to_look(url: str) -> str:
    """The ToolServer's pages a user needs, named where the address is printed (never the token:
    the status page takes it in the URL fragment, which the browser keeps to itself)."""
    return (f"API docs {url}/docs (OpenAPI {url}/openapi.json); status page {url}/status#token=<token>; "
            f"metrics {url}/metrics")


def client_url(host: str, port: int) -> str:
    """Where a client on this machine reaches a server bound to ``host`` (wildcards -> loopback)."""
    connect = {"0.0.0.0": "127.0.0.1", "": "127.0.0.1", "::": "::1"}.get(host, host)
    return f"http://[{connect}]:{port}" if ":" in connect else f"http://{connect}:{port}"


def cmd_serve(args: argparse.Namespace) -> int:
    from atropos.request_deadline import server_config

    # first: our environment may hold the ToolServer's token and our memory will hold every host's; no
    # process of our user (a Ray job, a slot's helper run as us) may read them (root still can)
    make_undumpable()
    s = load_settings(args)
    setup_logging(s)
    token = resolve_token(s)
    os.environ.pop(TOKEN_ENV, None)  # nothing we start inherits it
    pool = build_pool(s)
    app = build_app(s, token, pool)
    sock = bind_socket(s.listen_host, s.port)
    port = sock.getsockname()[1]
    # log_config=None: uvicorn's records go through our (redacting, maybe JSON) root handler
    config = server_config(app, s.request_read_timeout_s, log_level="warning", log_config=None, lifespan="on",
                           timeout_keep_alive=120)
    url = client_url(s.listen_host, port)
    server = pool_first_server(config, pool, f"ToolServer on {url} (backend {s.backend}, pool {s.pool_id})",
                               where_to_look(url))
    # uvicorn shuts down gracefully on SIGTERM (the pool stops its hosts), then re-raises the signal
    # with the handler it found: make that a clean exit 0, not death by signal (-15) for scripts.
    signal.signal(signal.SIGTERM, _exit_cleanly)
    try:
        server.run(sockets=[sock])
    finally:
        sock.close()
    if server.pool_error is not None:
        print(f"error: the pool did not start: {server.pool_error}", file=sys.stderr)
        return EXIT_INFRA
    if not server.started:
        print("error: the ToolServer did not start (see the log above)", file=sys.stderr)
        return EXIT_INFRA
    return EXIT_OK


def pool_first_server(config: Any, pool: Any, *lines: str) -> Any:
    """A uvicorn server that starts ``pool`` before it serves and stops it after, and logs
    ``lines`` (its address) only once it serves: a pool that cannot start (an unreachable cluster,
    a resource no node offers) ends it with that one error (``pool_error``), never preceded by an
    address that nothing answers."""
    import uvicorn

    from atropos.errors import AtroposSandboxError

    class Server(uvicorn.Server):
        pool_error: AtroposSandboxError | None = None

        async def startup(self, sockets: Any = None) -> None:
            try:
                await pool.start()
            except AtroposSandboxError as exc:
                self.pool_error = exc
                self.should_exit = True
                return
            await super().startup(sockets=sockets)
            if not self.started or self.should_exit:  # uvicorn skips shutdown() then
                await pool.stop()
                return
            for line in lines:
                log.info("%s", line)

        async def shutdown(self, sockets: Any = None) -> None:
            try:
                await super().shutdown(sockets=sockets)
            finally:
                await pool.stop()

    return Server(config)


def _exit_cleanly(signum: int, _frame: object) -> None:
    raise SystemExit(EXIT_OK)
