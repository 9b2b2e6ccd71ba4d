"""atropos-sandbox: run the ToolServer with a pool, manage a background pool, debug with one call."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import errno
import json
import logging
import os
import secrets
import shlex
import signal
import socket
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from atropos.backends.base import BACKEND_KINDS, BackendKind
from atropos.errors import AtroposSandboxError, ConfigError, InfrastructureError, IsolationUnavailable

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_INFRA = 0, 1, 2, 3
EXIT_TIMED_OUT = 124  # exec: the command ran out of time (as timeout(1) reports it)
# The bearer token of the ToolServer `serve` runs: not the sandbox hosts' token (HOST_TOKEN_ENV of
# atropos/sandbox/launch.py), which the pool makes per host and no user ever handles.
TOOLSERVER_TOKEN_ENV = TOKEN_ENV = "ATROPOS_TOOLSERVER_TOKEN"
SETTINGS_ENV_PREFIX = "ATROPOS_SANDBOX_"
CONFIG_ENV = "ATROPOS_SANDBOX_CONFIG"
REPO = Path(__file__).resolve().parent.parent
log = logging.getLogger("atropos.cli")


class ServeSettings(BaseModel):
    """What ``serve`` (and ``pool up``, ``nomad render``) run with; every field is a flag, an
    ``ATROPOS_SANDBOX_<FIELD>`` variable and a key of the ``--config`` file."""

    # A typo'd key in a config file must fail loudly, not fall back to a default silently.
    model_config = ConfigDict(extra="forbid")

    backend: BackendKind = "local"
    host: str = "127.0.0.1"
    # not 8000: that is the default of atroposlib's run-api (and of an env's rollout_server_url)
    port: int = Field(8600, ge=0, le=65535)
    slots_per_host: int = Field(16, ge=1)
    min_hosts: int = Field(1, ge=0)
    max_hosts: int = Field(4, ge=1)
    image: str = "atropos-sandbox:dev"
    nomad_address: str | None = None  # default: $NOMAD_ADDR, else http://127.0.0.1:4646
    ray_address: str | None = None  # default: $RAY_ADDRESS, else a Ray started by serve on 127.0.0.1
    # names files in the state dir and Nomad job ids: no path separators
    pool_id: str = Field("cli", pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    allow_no_auth: bool = False
    metrics_need_token: bool = False
    web_provider: Literal["offline", "http", "none"] = "offline"
    corpus_dir: Path | None = None
    web_base_url: str | None = None
    log_json: bool = False
    log_level: str = "INFO"
    request_read_timeout_s: float = Field(60.0, gt=0)  # a request's head and body must arrive within it

    @field_validator("log_level")
    @classmethod
    def _known_level(cls, value: str) -> str:
        if value.upper() not in ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"):
            raise ValueError("one of DEBUG, INFO, WARNING, ERROR, CRITICAL")
        return value.upper()


class PoolReplyError(AtroposSandboxError):
    """A background pool answered a request with an error status (the message is the pool's)."""

    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(f"the pool answered {status} ({code}): {message}")
        self.status = status
        self.code = code

    @property
    def exit_code(self) -> int:
        # The request itself was wrong (unknown tool, bad arguments, provider not configured): usage.
        # A refused lease, no free slot, an overloaded or failing pool: infrastructure.
        return EXIT_INFRA if self.status in (401, 409, 429) or (self.status >= 500 and self.status != 501) \
            else EXIT_USAGE


def _wrap(text: str, indent: str = "") -> str:
    # RawDescriptionHelpFormatter keeps the epilog's layout but wraps nothing: wrap paragraphs here
    return textwrap.fill(text, 100, subsequent_indent=indent, break_on_hyphens=False)


def _settings_names() -> str:
    return ", ".join(ServeSettings.model_fields)


def _settings_epilog() -> str:
    return _wrap(f"settings (flags win over ${SETTINGS_ENV_PREFIX}<SETTING> variables, which win over the --config "
            f"file, a YAML or JSON object with these keys; ${CONFIG_ENV} names the file when --config is not "
            f"given): {_settings_names()}")


EPILOG = f"""\
exit codes (stable, for scripts):
  0  success
  1  the command ran but failed (exec: the tool call failed; for bash, exec exits with the
     command's own status, 124 when --timeout killed it, 128+N when signal N did)
  2  bad usage or configuration: unknown flag, invalid setting, missing or malformed --config
     file, bad --args JSON, no token, a request the pool refused as malformed
  3  infrastructure unavailable: no isolation on this machine, no Docker/Nomad, a pool that is
     not up, not answering, refusing its token or out of slots, a port already in use

configuration: flags, then environment variables, then the --config file (flags win)
  --config FILE                YAML (.yaml/.yml) or JSON object, keys as below, e.g.
                               {{"backend": "docker", "max_hosts": 8, "pool_id": "train"}}
  {CONFIG_ENV:<28} the config file when --config is not given
  {SETTINGS_ENV_PREFIX}<SETTING>    any setting, e.g. ATROPOS_SANDBOX_POOL_ID=train,
                               ATROPOS_SANDBOX_MAX_HOSTS=8, ATROPOS_SANDBOX_LOG_JSON=true
  {_wrap("settings: " + _settings_names(), "            ")}

environment:
  {TOKEN_ENV:<28} bearer token `serve` requires of clients (`pool up` makes one
                               and keeps it in a 0600 file in the state dir)
  NOMAD_ADDR, NOMAD_TOKEN, ... the nomad backend's cluster (and ATROPOS_NOMAD_<FIELD>, e.g.
                               ATROPOS_NOMAD_TOKEN_DELIVERY=env); see nomad/README.md
  DOCKER_HOST, ...             the docker backend's engine, as for the docker CLI
  RAY_ADDRESS                  the ray backend's cluster (and ATROPOS_RAY_<FIELD>, e.g.
                               ATROPOS_RAY_NUM_CPUS=2); see docs/ray.md
  XDG_CACHE_HOME               state of background pools: $XDG_CACHE_HOME/atropos-sandbox/run
                               (default ~/.cache/atropos-sandbox/run)
"""


def state_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    path = Path(base) / "atropos-sandbox" / "run"
    path.mkdir(parents=True, exist_ok=True)
    os.chmod(path, 0o700)
    return path


# -- settings ---------------------------------------------------------------------------------
def read_config_file(path: str) -> dict[str, Any]:
    file = Path(path)
    try:
        text = file.read_text()
    except OSError as exc:
        raise ConfigError(f"cannot read the config file {path}: {exc.strerror or exc}") from None
    if file.suffix in (".yaml", ".yml"):
        try:
            import yaml
        except ImportError:
            raise ConfigError(f"{path}: YAML config files need PyYAML (pip install pyyaml), or use JSON") from None
        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            raise ConfigError(f"the config file {path} is not valid YAML: {exc}") from None
    else:
        try:
            data = json.loads(text)
        except ValueError as exc:
            raise ConfigError(f"the config file {path} is not valid JSON: {exc}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"the config file {path} must hold an object of settings, not {type(data).__name__}")
    return data


def load_settings(args: argparse.Namespace, environ: dict[str, str] | None = None) -> ServeSettings:
    """Flags over ``ATROPOS_SANDBOX_<FIELD>`` over the config file; every command resolves here."""
    env = os.environ if environ is None else environ
    data: dict[str, Any] = {}
    config = getattr(args, "config", None) or env.get(CONFIG_ENV)
    if config:
        data.update(read_config_file(config))
    for name in ServeSettings.model_fields:
        value = env.get(f"{SETTINGS_ENV_PREFIX}{name.upper()}")
        if value is not None:
            data[name] = value
    for name in ServeSettings.model_fields:
        value = getattr(args, name, None)
        if value is not None:
            data[name] = value
    try:
        return ServeSettings.model_validate(data)
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(str(p) for p in e['loc']) or 'settings'}: {e['msg']}" for e in exc.errors())
        where = f" (config file {config})" if config else ""
        raise ConfigError(f"invalid settings{where}: {problems}") from None


def _setting_flag(p: argparse.ArgumentParser, name: str, help_text: str, **kw: Any) -> None:
    """``--<name>`` (dashes) into ``args.<name>``: the one spelling of a setting's flag (``config`` too)
    in every command; load_settings reads the settings back by field name."""
    p.add_argument(f"--{name.replace('_', '-')}", dest=name, help=help_text, **kw)


def add_settings_flags(p: argparse.ArgumentParser) -> None:
    _setting_flag(p, "config", f"YAML or JSON file with settings (flags override it; default ${CONFIG_ENV})")
    _setting_flag(p, "backend", "where sandbox hosts run (default local)", choices=list(BACKEND_KINDS))
    _setting_flag(p, "host", "address to listen on (default 127.0.0.1)")
    _setting_flag(p, "port", "port (default 8600; pool up: 0 picks a free one)", type=int)
    _setting_flag(p, "slots_per_host", "slots per host (default 16)", type=int)
    _setting_flag(p, "min_hosts", "hosts kept running (default 1)", type=int)
    _setting_flag(p, "max_hosts", "most hosts (default 4)", type=int)
    _setting_flag(p, "image", "docker/nomad: sandbox image (default atropos-sandbox:dev)")
    _setting_flag(p, "nomad_address", "nomad: agent address (default $NOMAD_ADDR)")
    _setting_flag(p, "ray_address", "ray: cluster address (default $RAY_ADDRESS, else a Ray started here)")
    _setting_flag(p, "pool_id", "names this pool's hosts and state (default cli)")
    _setting_flag(p, "web_provider", "web_search/web_extract provider (default offline corpus)",
                  choices=["offline", "http", "none"])
    _setting_flag(p, "corpus_dir", "offline search corpus (default: built-in)", type=Path)
    _setting_flag(p, "web_base_url", "http provider: the API base URL")
    _setting_flag(p, "allow_no_auth", "DEVELOPMENT: no token (only on a loopback address)",
                  action="store_true", default=None)
    _setting_flag(p, "metrics_need_token",
                  "/metrics requires the bearer token too (default: public; it holds no secret or id)",
                  action="store_true", default=None)
    _setting_flag(p, "log_json", "JSON log lines", action="store_true", default=None)
    _setting_flag(p, "log_level", "log level (default INFO)")
    _setting_flag(p, "request_read_timeout_s", "a request's head and body must arrive within this many "
                  "seconds, else 408 and the connection closes (default 60)", type=float)


def add_pool_flags(p: argparse.ArgumentParser) -> None:
    """The flags commands talking to a background pool need: which pool (same resolution as serve)."""
    _setting_flag(p, "pool_id", "which pool (default: $ATROPOS_SANDBOX_POOL_ID, the config file's pool_id, else cli)")
    _setting_flag(p, "config", f"YAML or JSON settings file to take pool_id from (default ${CONFIG_ENV})")


def setup_logging(settings: ServeSettings) -> None:
    from atropos.logs import configure

    configure(level=settings.log_level, json_lines=settings.log_json)


# -- building the pieces ----------------------------------------------------------------------
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


def build_app(s: ServeSettings, token: str | None) -> Any:
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
        build_pool(s), ToolServerSettings(token=token, allow_no_auth=s.allow_no_auth,
                                          public_metrics=not s.metrics_need_token),
        registry=ToolRegistry.default(with_web=with_web), externals=externals, manage_pool=True,
    )


def resolve_token(s: ServeSettings) -> str | None:
    token = os.environ.get(TOKEN_ENV)
    if s.allow_no_auth:
        if s.host not in ("127.0.0.1", "::1", "localhost"):
            raise ConfigError("--allow-no-auth is only allowed on a loopback address")
        return token
    if not token:
        raise ConfigError(f"set ${TOKEN_ENV} (the bearer token clients must send), or use --allow-no-auth "
                          "on loopback for development")
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


# -- serve ------------------------------------------------------------------------------------
def cmd_serve(args: argparse.Namespace) -> int:
    import uvicorn

    from atropos.request_deadline import server_config

    s = load_settings(args)
    setup_logging(s)
    token = resolve_token(s)
    app = build_app(s, token)
    sock = bind_socket(s.host, s.port)
    port = sock.getsockname()[1]
    log.info("ToolServer on %s (backend %s, pool %s)", client_url(s.host, port), s.backend, s.pool_id)
    log.info("%s", where_to_look(client_url(s.host, port)))
    # log_config=None: uvicorn's records go through our (redacting, maybe JSON) root handler
    config = server_config(app, s.request_read_timeout_s, log_level="warning", log_config=None, lifespan="on",
                           timeout_keep_alive=120)
    server = uvicorn.Server(config)
    # uvicorn shuts down gracefully on SIGTERM (the pool stops its hosts), then re-raises the signal
    # with the handler it found: make that a clean exit 0, not death by signal (-15) for scripts.
    signal.signal(signal.SIGTERM, _exit_cleanly)
    try:
        server.run(sockets=[sock])
    finally:
        sock.close()
    if not server.started:
        print("error: the ToolServer did not start (the pool failed to start; see the log above)", file=sys.stderr)
        return EXIT_INFRA
    return EXIT_OK


def _exit_cleanly(signum: int, _frame: object) -> None:
    raise SystemExit(EXIT_OK)


def client_url(host: str, port: int) -> str:
    """Where a client on this machine reaches a server bound to ``host`` (wildcards -> loopback)."""
    connect = {"0.0.0.0": "127.0.0.1", "": "127.0.0.1", "::": "::1"}.get(host, host)
    return f"http://[{connect}]:{port}" if ":" in connect else f"http://{connect}:{port}"


# -- background pools -------------------------------------------------------------------------
class PoolState(BaseModel):
    """``pool-<id>.json`` in the state dir: how to reach (and stop) a background pool."""

    pool_id: str
    pid: int
    url: str
    token_file: Path
    settings_file: Path | None = None
    log: Path


def _files(pool_id: str) -> dict[str, Path]:
    d = state_dir()
    return {"state": d / f"pool-{pool_id}.json", "token": d / f"pool-{pool_id}.token",
            "settings": d / f"pool-{pool_id}.settings.json", "log": d / f"pool-{pool_id}.log"}


def _write_private(path: Path, text: str) -> None:
    """Create ``path`` as 0600 from the start (no window where another user could read it)."""
    path.unlink(missing_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)


def _read_state(pool_id: str) -> PoolState | None:
    path = _files(pool_id)["state"]
    try:
        return PoolState.model_validate_json(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValidationError) as exc:
        raise InfrastructureError(f"the state file {path} is unreadable or corrupt ({exc.__class__.__name__}); "
                                  f"`atropos-sandbox pool down --pool-id {pool_id}` removes it") from None


def _remove_files(pool_id: str, keep_log: bool = True) -> None:
    for name, path in _files(pool_id).items():
        if name != "log" or not keep_log:
            path.unlink(missing_ok=True)


def _is_pool_process(pid: int) -> bool:
    """Alive and still our ``serve`` (a pid can be reused after the pool died)."""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    return b"atropos.cli" in argv and b"serve" in argv


def _stop_process_group(pgid: int, running: Callable[[], bool], grace_s: float) -> None:
    """SIGTERM the pool's process group (it leads its own session), SIGKILL after ``grace_s``.
    SIGTERM first: the pool's shutdown stops its hosts and containers. ``running`` is not
    ``kill(pid, 0)``: that succeeds on a zombie, which a child of ours is until we wait for it."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while running() and time.monotonic() < deadline:
        time.sleep(0.2)
    if running():
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, signal.SIGKILL)


def cmd_pool_up(args: argparse.Namespace) -> int:
    import httpx

    from atropos.backends.base import new_token

    s = load_settings(args)
    files = _files(s.pool_id)
    old = _read_state(s.pool_id)
    if old is not None and _is_pool_process(old.pid):
        print(f"pool {s.pool_id} is already up at {old.url} (pid {old.pid})", file=sys.stderr)
        return EXIT_OK
    _remove_files(s.pool_id)  # leftovers of a pool that died without `pool down`
    if s.port == 0:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            s = s.model_copy(update={"port": probe.getsockname()[1]})
    token = new_token()
    # The child reads exactly the settings validated here (flags + env + --config), from a private
    # file: nothing is dropped on the way, and the token is on no command line (argv is public).
    _write_private(files["settings"], s.model_dump_json(indent=2))
    _write_private(files["token"], token)
    child_env = {k: v for k, v in os.environ.items() if not k.startswith(SETTINGS_ENV_PREFIX)}
    child_env[TOKEN_ENV] = token
    argv = [sys.executable, "-m", "atropos.cli", "serve", "--config", str(files["settings"])]
    with open(files["log"], "ab") as log_file:
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log_file, stderr=log_file,
                                env=child_env, start_new_session=True)
    url = client_url(s.host, s.port)
    state = PoolState(pool_id=s.pool_id, pid=proc.pid, url=url, token_file=files["token"],
                      settings_file=files["settings"], log=files["log"])
    _write_private(files["state"], state.model_dump_json())

    def stop() -> None:
        _stop_process_group(proc.pid, lambda: proc.poll() is None, 20)
        proc.wait()
        _remove_files(s.pool_id)

    deadline = time.monotonic() + args.timeout
    try:
        while time.monotonic() < deadline:
            code = proc.poll()
            if code is not None:
                print(f"error: pool {s.pool_id} exited with status {code} while starting; log: {files['log']}\n"
                      f"{_tail(files['log'])}", file=sys.stderr)
                _remove_files(s.pool_id)
                return EXIT_USAGE if code == EXIT_USAGE else EXIT_INFRA
            with contextlib.suppress(httpx.HTTPError, ValueError):
                health = httpx.get(f"{url}/healthz", timeout=2).json()
                if isinstance(health, dict) and health.get("ok"):
                    print(f"pool {s.pool_id} up at {url} (pid {proc.pid}); token in {files['token']}\n"
                          f"{where_to_look(url)}")
                    return EXIT_OK
            time.sleep(0.3)
    except BaseException:  # Ctrl-C while waiting: leave nothing running behind
        stop()
        raise
    stop()
    print(f"error: pool {s.pool_id} did not become healthy within {args.timeout:g}s; stopped it (pid {proc.pid}); "
          f"log: {files['log']}\n{_tail(files['log'])}", file=sys.stderr)
    return EXIT_INFRA


class PoolConnection(BaseModel):
    pool_id: str
    url: str
    token: str = Field(repr=False)


def _connection(pool_id: str, state: PoolState | None) -> PoolConnection:
    """How to reach the pool whose state (``_read_state(pool_id)``) this is."""
    if state is None:
        raise InfrastructureError(f"no pool {pool_id!r} is up (start one with `atropos-sandbox pool up`)")
    if not _is_pool_process(state.pid):
        raise InfrastructureError(f"pool {pool_id!r} is not running (pid {state.pid} is gone); its log: {state.log}; "
                                  f"`atropos-sandbox pool down --pool-id {pool_id}` clears its state")
    try:
        token = state.token_file.read_text().strip()
    except OSError as exc:
        raise InfrastructureError(f"cannot read the token of pool {pool_id!r} ({state.token_file}): "
                                  f"{exc.strerror or exc}") from None
    return PoolConnection(pool_id=pool_id, url=state.url, token=token)


class PoolHttp:
    """Requests to a background pool with every failure mapped to a named error (no tracebacks)."""

    def __init__(self, conn: PoolConnection) -> None:
        import httpx

        self.conn = conn
        self._http = httpx.Client(base_url=conn.url, headers={"Authorization": f"Bearer {conn.token}"},
                                  timeout=httpx.Timeout(None, connect=10))

    def __enter__(self) -> PoolHttp:
        return self

    def __exit__(self, *exc: object) -> None:
        self._http.close()

    def request(self, method: str, path: str, **kw: Any) -> dict[str, Any]:
        import httpx

        where = f"pool {self.conn.pool_id!r} at {self.conn.url}"
        try:
            resp = self._http.request(method, path, **kw)
        except httpx.TransportError as exc:
            raise InfrastructureError(f"{where} does not answer ({exc.__class__.__name__}: {exc}); "
                                      "is it up? `atropos-sandbox pool status`") from None
        try:
            body = resp.json()
        except ValueError:
            body = None
        if resp.status_code == 401:
            raise InfrastructureError(f"{where} refused our token (401): it is not the pool this state belongs to; "
                                      "`pool down` and `pool up` again")
        err = body.get("error") if isinstance(body, dict) else None
        if resp.status_code >= 400 and isinstance(err, dict):
            raise PoolReplyError(resp.status_code, str(err.get("code", "error")), str(err.get("message", "")))
        if resp.status_code >= 400 or not isinstance(body, dict):  # not our error shape: not our pool
            raise InfrastructureError(f"{where} answered {method} {path} with {resp.status_code} and no JSON object "
                                      f"({resp.headers.get('content-type', 'no content type')}): is that port "
                                      "another service?")
        return body


def _pool_id(args: argparse.Namespace) -> tuple[str, bool]:
    """(pool id, whether anyone asked for it) through the same resolution as ``serve``."""
    s = load_settings(args)
    return s.pool_id, "pool_id" in s.model_fields_set


def cmd_pool_status(args: argparse.Namespace) -> int:
    from atropos.slots.pool import PoolStatus

    pool_id, _ = _pool_id(args)
    with PoolHttp(_connection(pool_id, _read_state(pool_id))) as http:
        body = http.request("GET", "/v1/status")
    try:
        PoolStatus.model_validate(body)
    except ValidationError as exc:
        raise InfrastructureError(f"pool {pool_id!r} answered /v1/status with an unexpected shape: "
                                  f"{exc.error_count()} problem(s), e.g. {exc.errors()[0]['msg']}") from None
    print(json.dumps(body, indent=2) if args.json else render_status(body))
    return EXIT_OK


def render_status(status: dict[str, Any]) -> str:
    lines = [f"pool {status['pool_id']} ({status['backend']}): {status['free']} free, {status['leased']} leased, "
             f"{status['quarantined']} quarantined, {status['waiting']} waiting, "
             f"{status['calls_per_s']:.1f} calls/s, {status['calls_total']} calls, {status['leases_total']} leases"]
    events = [f"{status[k]} {label}" for k, label in (("scale_ups", "scale-ups"), ("scale_downs", "scale-downs"),
                                                      ("quarantines", "quarantines"), ("lost_hosts", "lost hosts"))
              if k in status]
    if events:
        lines.append("events: " + ", ".join(events))
    nodes: dict[str, int] = {}
    for h in status["hosts"]:
        if h.get("node"):
            nodes[h["node"]] = nodes.get(h["node"], 0) + 1
    if nodes:  # backends that place hosts on cluster nodes (ray)
        lines.append(f"nodes: {len(nodes)} (" + ", ".join(f"{n[:12]}: {k} host(s)" for n, k in nodes.items()) + ")")
    lines.append(f"{'HOST':<34} {'HEALTH':<8} {'FREE':>5} {'LEASED':>6} {'QUAR':>5} {'OLDEST LEASE':>13} "
                 f"{'PROBE ms':>9}")
    for h in status["hosts"]:
        oldest = "-" if h["oldest_lease_s"] is None else f"{h['oldest_lease_s']:.0f}s"
        probe = "-" if h["health_ms"] is None else f"{h['health_ms']:.1f}"
        node = f"  node {h['node'][:12]}" if h.get("node") else ""
        lines.append(f"{h['id'][:34]:<34} {'ok' if h['healthy'] else 'FAIL':<8} {h['free']:>5} {h['leased']:>6} "
                     f"{h['quarantined']:>5} {oldest:>13} {probe:>9}{node}")
    if status.get("starting_hosts"):
        lines.append(f"({status['starting_hosts']} host(s) starting)")
    return "\n".join(lines)


def cmd_pool_down(args: argparse.Namespace) -> int:
    pool_id, _ = _pool_id(args)
    try:
        state = _read_state(pool_id)
    except InfrastructureError as exc:  # corrupt state: nothing we can stop, clear it
        print(f"warning: {exc}; removing it", file=sys.stderr)
        state = None
        _remove_files(pool_id)
    if state is None:
        print(f"no pool {pool_id!r} is up", file=sys.stderr)
        return EXIT_OK
    if _is_pool_process(state.pid):
        _stop_process_group(state.pid, lambda: _is_pool_process(state.pid), 60)
    _remove_files(pool_id)
    print(f"pool {pool_id} is down")
    return EXIT_OK


# -- exec -------------------------------------------------------------------------------------
def _tool_args(args: argparse.Namespace) -> dict[str, Any]:
    if args.args:
        try:
            parsed = json.loads(args.args)
        except ValueError as exc:
            raise ConfigError(f"--args is not valid JSON: {exc}") from None
        if not isinstance(parsed, dict):
            raise ConfigError(f"--args must be a JSON object of the tool's arguments, not {type(parsed).__name__}")
        return parsed
    if args.tool == "bash":
        if not args.command:
            raise ConfigError("nothing to run: give the command (`exec -- 'python3 -V'`) or --args")
        # one word is a command line (`exec -- 'ls | wc -l'`); several are argv words, quoted as
        # given (`exec -- printf '%s\n' 'a b'` prints "a b", never "a" and "b")
        return {"command": args.command[0] if len(args.command) == 1 else shlex.join(args.command)}
    return {}


def cmd_exec(args: argparse.Namespace) -> int:
    """One tool call in a fresh lease: through a running pool if one is up, else an ephemeral one."""
    tool_args = _tool_args(args)
    pool_id, asked = _pool_id(args)
    state = _read_state(pool_id)
    if state is not None:
        with PoolHttp(_connection(pool_id, state)) as http:
            return _exec_in_pool(http, args, tool_args)
    if asked:  # a pool named by flag, env or config that is not up: never silently run elsewhere
        raise InfrastructureError(f"no pool {pool_id!r} is up (start one with `atropos-sandbox pool up`)")
    return asyncio.run(_exec_ephemeral(args.tool, tool_args, args.timeout, args.network))


def _exec_in_pool(http: PoolHttp, args: argparse.Namespace, tool_args: dict[str, Any]) -> int:
    if args.tool.startswith("web_"):
        body = http.request("POST", f"/v1/tools/{args.tool}/invoke", json={"args": tool_args})
        return _print_call(str(body.get("content", "")), None, bool(body.get("ok")))
    lease = http.request("POST", "/v1/slots", json={"trajectory_id": f"cli-exec-{secrets.token_hex(4)}",
                                                    "network": args.network, "timeout_s": args.lease_timeout})
    lease_id = str(lease["lease_id"])
    try:
        out = http.request("POST", f"/v1/slots/{lease_id}/call",
                           json={"tool": args.tool, "args": tool_args, "timeout_s": args.timeout})
    finally:
        try:
            http.request("DELETE", f"/v1/slots/{lease_id}")
        except AtroposSandboxError as exc:  # never mask the call's own outcome; the pool reaps idle leases
            print(f"warning: could not release the lease: {exc}", file=sys.stderr)
    return _print_call(str(out.get("content", "")), out.get("result"), bool(out.get("ok")))


async def _exec_ephemeral(tool: str, tool_args: dict[str, Any], timeout: float | None, network: bool) -> int:
    from atropos.backends.local import LocalBackend, LocalBackendConfig
    from atropos.slots.config import PoolConfig
    from atropos.slots.pool import SlotPool
    from atropos.tools.formatting import format_result

    async with SlotPool(LocalBackend(LocalBackendConfig(slots_per_host=1, pool_id="exec", prewarm=False)),
                        PoolConfig(pool_id="exec", min_hosts=1, max_hosts=1)) as pool:
        async with pool.leased("cli-exec", network=network) as lease:
            result = await lease.call(tool, tool_args, timeout_s=timeout)
    ok, text = format_result(tool, result)
    return _print_call(text, result.result, ok)


def _print_call(text: str, result: dict[str, Any] | None, ok: bool) -> int:
    if result and "stdout" in result:
        sys.stdout.write(result.get("stdout") or "")
        sys.stderr.write(result.get("stderr") or "")
        code = result.get("exit_code")
        if result.get("timed_out"):
            # as timeout(1): 124, and say so (a killed command prints nothing of its own)
            seconds = float(result.get("duration_ms") or 0) / 1000
            print(f"error: the command timed out after {seconds:.1f} s and was killed (--timeout)", file=sys.stderr)
            return EXIT_TIMED_OUT
        if not isinstance(code, int):
            sig = result.get("signal")
            print(f"error: the command was killed by signal {sig}", file=sys.stderr)
            return 128 + int(sig) if isinstance(sig, int) else EXIT_FAILED
        return code
    print(text, file=sys.stdout if ok else sys.stderr)
    return EXIT_OK if ok else EXIT_FAILED


# -- image, nomad, bench ----------------------------------------------------------------------
def cmd_image_build(args: argparse.Namespace) -> int:
    script = REPO / "scripts" / "build_image.sh"
    if not script.exists():
        print("error: image build needs a source checkout (scripts/build_image.sh)", file=sys.stderr)
        return EXIT_USAGE
    env = {**os.environ, **({"IMAGE_TAG": args.tag} if args.tag else {})}
    return subprocess.call(["bash", str(script)], env=env)


def render_nomad_job(s: ServeSettings) -> dict[str, Any]:
    """What ``serve --backend nomad`` registers for these settings, minus what exists only per
    running pool: the owner ``Meta`` (pid, boot id) and, with ``token_delivery=env``, the token
    (a placeholder here: a rendered file must never carry a live secret)."""
    from atropos.backends.nomad import render_job

    return {"Job": render_job(nomad_config(s), 0)}


def cmd_nomad_render(args: argparse.Namespace) -> int:
    print(json.dumps(render_nomad_job(load_settings(args)), indent=2))
    return EXIT_OK


def cmd_bench(args: argparse.Namespace) -> int:
    if not (REPO / "benchmarks" / "run.py").exists():
        print("error: bench needs a source checkout (benchmarks/)", file=sys.stderr)
        return EXIT_USAGE
    return subprocess.call([sys.executable, "-m", "benchmarks.run", *args.rest], cwd=REPO)


def bench_args(extra: list[str], rest: list[str]) -> list[str]:
    """``bench`` forwards everything after it: unknown options argparse set aside come first (they
    preceded the first positional), then the remainder; one leading ``--`` is ours, not theirs."""
    forwarded = [*extra, *rest]
    if forwarded[:1] == ["--"]:
        forwarded = forwarded[1:]
    return forwarded


# -- helpers ----------------------------------------------------------------------------------
def _tail(path: Path, n: int = 1500) -> str:
    from atropos.logs import redact

    try:
        return redact(path.read_text(errors="replace")[-n:])
    except OSError:
        return ""


def _command(parent: Any, name: str, help_text: str, description: str, epilog: str | None = None
             ) -> argparse.ArgumentParser:
    fmt = argparse.RawDescriptionHelpFormatter  # keeps the epilogs' layout; _wrap does the wrapping
    sub: argparse.ArgumentParser = parent.add_parser(name, help=help_text, description=_wrap(description),
                                                     epilog=epilog, formatter_class=fmt)
    return sub


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="atropos-sandbox", description=__doc__, epilog=EPILOG,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True, metavar="COMMAND")
    settings_epilog = _settings_epilog() + "\n\n" + _wrap(
        "exit codes: 0 ok, 1 failed, 2 usage/config, 3 infrastructure (atropos-sandbox --help has the details)")

    serve = _command(sub, "serve", "run the ToolServer (external tools + REST slot API) with a pool",
                     "Run the ToolServer with a pool in the foreground: REST slot API, web tools, /metrics, "
                     f"/status. Clients must send ${TOKEN_ENV} as a bearer token.", settings_epilog)
    add_settings_flags(serve)
    serve.set_defaults(func=cmd_serve)

    pool = _command(sub, "pool", "a pool (with its ToolServer) in the background",
                    "A pool with its ToolServer in the background; its state (0600 token and settings files, "
                    "the log) is kept in the state dir.")
    pool_sub = pool.add_subparsers(dest="pool_cmd", required=True, metavar="COMMAND")
    up = _command(pool_sub, "up", "start a pool in the background",
                  "Start `serve` in the background with these settings (a token is generated) and wait until "
                  "it is healthy.", settings_epilog)
    add_settings_flags(up)
    up.add_argument("--timeout", type=float, default=120.0,
                    help="seconds to wait for the pool to be healthy; past it the pool is stopped (default 120)")
    up.set_defaults(func=cmd_pool_up)
    status = _command(pool_sub, "status", "hosts, health, slots, lease ages, calls/s",
                      "The pool at a glance: hosts, health, slots free/leased/quarantined, the oldest lease per "
                      "host, calls/s, scaling events.")
    add_pool_flags(status)
    status.add_argument("--json", action="store_true", help="machine-readable output (the /v1/status body)")
    status.set_defaults(func=cmd_pool_status)
    down = _command(pool_sub, "down", "stop the background pool and everything it made",
                    "Stop the background pool (its hosts and containers go with it) and remove its state. A "
                    "pool that is not up is not an error.")
    add_pool_flags(down)
    down.set_defaults(func=cmd_pool_down)

    ex = _command(sub, "exec", "run one tool call in a fresh lease (debugging)",
                  "Run one tool call in a fresh lease: in the background pool if it is up, else in an "
                  "ephemeral local one. For bash, the exit status is the command's own.",
                  "examples:\n  atropos-sandbox exec -- 'python3 -V'\n"
                  "  atropos-sandbox exec --tool read_file --args '{\"path\": \"a.txt\"}'\n"
                  "  atropos-sandbox exec --tool web_search --args '{\"query\": \"tar\"}'   (needs a pool)")
    ex.add_argument("--tool", default="bash", help="tool name (default bash)")
    ex.add_argument("--args", help="tool arguments as a JSON object (default: the command, for bash)")
    ex.add_argument("--timeout", type=float, help="call timeout in seconds")
    ex.add_argument("--lease-timeout", dest="lease_timeout", type=float, default=60.0,
                    help="pool: seconds to wait for a free slot (default 60)")
    ex.add_argument("--network", action="store_true", help="let the call reach the network")
    add_pool_flags(ex)
    ex.add_argument("command", nargs="*", help="the bash command")
    ex.set_defaults(func=cmd_exec)

    image = _command(sub, "image", "sandbox image", "The sandbox image the docker and nomad backends run.")
    image_sub = image.add_subparsers(dest="image_cmd", required=True, metavar="COMMAND")
    build = _command(image_sub, "build", "build the sandbox image (local base without a registry)",
                     "Build the sandbox image with scripts/build_image.sh (a debootstrap base, no registry), "
                     "showing its progress.")
    build.add_argument("--tag", help="image tag (default atropos-sandbox:dev)")
    build.set_defaults(func=cmd_image_build)

    nomad = _command(sub, "nomad", "Nomad helpers", "Helpers for the nomad backend.")
    nomad_sub = nomad.add_subparsers(dest="nomad_cmd", required=True, metavar="COMMAND")
    render = _command(
        nomad_sub, "render", "print the job JSON the backend registers",
        "Print the job JSON ({\"Job\": ...}, for the HTTP API or `nomad job run -json`) that `serve --backend "
        "nomad` registers with the same settings: the job id is atropos-<pool_id>; NOMAD_* and "
        "ATROPOS_NOMAD_<FIELD> (e.g. ATROPOS_NOMAD_TOKEN_DELIVERY=env) apply. The owner Meta and, with "
        "token_delivery=env, the host token exist per running pool and are not printed.", settings_epilog)
    _setting_flag(render, "config", f"YAML or JSON settings file (default ${CONFIG_ENV})")
    _setting_flag(render, "image", "sandbox image (default atropos-sandbox:dev)")
    _setting_flag(render, "slots_per_host", "slots per host (default 16)", type=int)
    _setting_flag(render, "pool_id", "the pool; the job id is atropos-<pool_id> (default cli)")
    render.set_defaults(func=cmd_nomad_render)

    bench = _command(sub, "bench", "run the benchmarks (arguments go to benchmarks.run)",
                     "Run `python -m benchmarks.run` with every argument after `bench`, e.g. `atropos-sandbox "
                     "bench --quick`; `atropos-sandbox bench -- --help` shows its options.")
    bench.add_argument("rest", nargs=argparse.REMAINDER, help="arguments for benchmarks.run")
    bench.set_defaults(func=cmd_bench)
    return p


def main(argv: list[str] | None = None) -> None:
    p = parser()
    args, extra = p.parse_known_args(argv)
    if args.cmd == "bench":
        args.rest = bench_args(extra, args.rest)
    elif extra:
        p.parse_args(argv)  # the standard "unrecognized arguments" message and exit 2
    try:
        code = args.func(args)
    except PoolReplyError as exc:
        print(f"error: {exc}", file=sys.stderr)
        code = exc.exit_code
    except (ConfigError, ValidationError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        code = EXIT_USAGE
    except (InfrastructureError, IsolationUnavailable) as exc:
        print(f"error: {exc}", file=sys.stderr)
        code = EXIT_INFRA
    except AtroposSandboxError as exc:
        print(f"error: {exc}", file=sys.stderr)
        code = EXIT_FAILED
    except KeyboardInterrupt:
        code = 130
    except BrokenPipeError:  # e.g. `atropos-sandbox pool status --json | head`
        sys.stderr.close()
        code = EXIT_OK
    sys.exit(code)


if __name__ == "__main__":
    main()
