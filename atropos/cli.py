"""``atropos-sandbox``: run the ToolServer with a pool, manage a background pool, debug with one call.

Exit codes (stable, for scripts): 0 success, 1 the command ran but failed (e.g. the tool call's own
exit status for ``exec``), 2 bad usage or configuration, 3 infrastructure unavailable (no
isolation, no engine, pool unreachable).

Settings come from flags, then ``ATROPOS_SANDBOX_<FIELD>`` environment variables, then a
``--config`` file (YAML or JSON) — flags win.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import secrets
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, Field, ValidationError

from atropos.errors import AtroposSandboxError, ConfigError, InfrastructureError, IsolationUnavailable

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_INFRA = 0, 1, 2, 3
TOKEN_ENV = "ATROPOS_TOOLSERVER_TOKEN"
REPO = Path(__file__).resolve().parent.parent


class ServeSettings(BaseModel):
    backend: Literal["local", "docker", "nomad"] = "local"
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)
    slots_per_host: int = Field(16, ge=1)
    min_hosts: int = Field(1, ge=0)
    max_hosts: int = Field(4, ge=1)
    image: str = "atropos-sandbox:dev"
    nomad_address: str | None = None  # default: $NOMAD_ADDR, else http://127.0.0.1:4646
    pool_id: str = "cli"
    allow_no_auth: bool = False
    web_provider: Literal["offline", "http", "none"] = "offline"
    corpus_dir: Path | None = None
    web_base_url: str | None = None
    log_json: bool = False
    log_level: str = "INFO"


def state_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    path = Path(base) / "atropos-sandbox" / "run"
    path.mkdir(parents=True, exist_ok=True)
    os.chmod(path, 0o700)
    return path


# -- settings ---------------------------------------------------------------------------------
def load_settings(args: argparse.Namespace) -> ServeSettings:
    data: dict[str, Any] = {}
    if getattr(args, "config", None):
        text = Path(args.config).read_text()
        if args.config.endswith((".yaml", ".yml")):
            import yaml

            data.update(yaml.safe_load(text) or {})
        else:
            data.update(json.loads(text))
    for name in ServeSettings.model_fields:
        env = os.environ.get(f"ATROPOS_SANDBOX_{name.upper()}")
        if env is not None:
            data[name] = env
    for name in ServeSettings.model_fields:
        value = getattr(args, name, None)
        if value is not None:
            data[name] = value
    return ServeSettings.model_validate(data)


def add_settings_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", help="YAML or JSON file with settings (flags override it)")
    p.add_argument("--backend", choices=["local", "docker", "nomad"], help="where sandbox hosts run (default local)")
    p.add_argument("--host", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, help="port (default 8000)")
    p.add_argument("--slots-per-host", dest="slots_per_host", type=int, help="slots per host (default 16)")
    p.add_argument("--min-hosts", dest="min_hosts", type=int, help="hosts kept running (default 1)")
    p.add_argument("--max-hosts", dest="max_hosts", type=int, help="most hosts (default 4)")
    p.add_argument("--image", help="docker/nomad: sandbox image (default atropos-sandbox:dev)")
    p.add_argument("--nomad-address", dest="nomad_address", help="nomad: agent address")
    p.add_argument("--pool-id", dest="pool_id", help="names this pool's hosts (default cli)")
    p.add_argument("--web-provider", dest="web_provider", choices=["offline", "http", "none"],
                   help="web_search/web_extract provider (default offline corpus)")
    p.add_argument("--corpus-dir", dest="corpus_dir", type=Path, help="offline search corpus (default: built-in)")
    p.add_argument("--web-base-url", dest="web_base_url", help="http provider: the API base URL")
    p.add_argument("--allow-no-auth", dest="allow_no_auth", action="store_true", default=None,
                   help="DEVELOPMENT: no token (only on a loopback address)")
    p.add_argument("--log-json", dest="log_json", action="store_true", default=None, help="JSON log lines")
    p.add_argument("--log-level", dest="log_level", help="log level (default INFO)")


def setup_logging(settings: ServeSettings) -> None:
    from atropos.logs import configure

    configure(level=settings.log_level, json_lines=settings.log_json)


# -- building the pieces ----------------------------------------------------------------------
def build_pool(s: ServeSettings) -> Any:
    from atropos.backends.base import Backend
    from atropos.slots.config import PoolConfig
    from atropos.slots.pool import SlotPool

    backend: Backend
    if s.backend == "docker":
        from atropos.backends.docker import DockerBackend, DockerBackendConfig

        backend = DockerBackend(DockerBackendConfig(image=s.image, slots_per_host=s.slots_per_host, pool_id=s.pool_id))
    elif s.backend == "nomad":
        from atropos.backends.nomad import NomadBackend, NomadBackendConfig

        overrides: dict[str, Any] = {"image": s.image, "slots_per_host": s.slots_per_host,
                                     "job_id": f"atropos-{s.pool_id}"}
        if s.nomad_address:
            overrides["address"] = s.nomad_address
        backend = NomadBackend(NomadBackendConfig.from_env(**overrides))  # NOMAD_ADDR/TOKEN/namespace/TLS
    else:
        from atropos.backends.local import LocalBackend, LocalBackendConfig

        backend = LocalBackend(LocalBackendConfig(slots_per_host=s.slots_per_host, pool_id=s.pool_id))
    return SlotPool(backend, PoolConfig(pool_id=s.pool_id, min_hosts=s.min_hosts, max_hosts=s.max_hosts))


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
        build_pool(s), ToolServerSettings(token=token, allow_no_auth=s.allow_no_auth),
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


# -- commands ---------------------------------------------------------------------------------
def cmd_serve(args: argparse.Namespace) -> int:
    import uvicorn

    s = load_settings(args)
    setup_logging(s)
    token = resolve_token(s)
    app = build_app(s, token)
    logging.getLogger("atropos.cli").info("ToolServer on http://%s:%d (backend %s)", s.host, s.port, s.backend)
    config = uvicorn.Config(app, host=s.host, port=s.port, log_level="warning", lifespan="on",
                            timeout_keep_alive=120)
    server = uvicorn.Server(config)
    server.run()
    return EXIT_OK if server.started else EXIT_INFRA


def _state_file(pool_id: str) -> Path:
    return state_dir() / f"pool-{pool_id}.json"


def cmd_pool_up(args: argparse.Namespace) -> int:
    s = load_settings(args)
    state = _state_file(s.pool_id)
    if state.exists() and _alive(json.loads(state.read_text()).get("pid", -1)):
        print(f"pool {s.pool_id} is already up ({state})", file=sys.stderr)
        return EXIT_OK
    token = secrets.token_urlsafe(32)
    port = s.port or 8000
    log_path = state_dir() / f"pool-{s.pool_id}.log"
    argv = [sys.executable, "-m", "atropos.cli", "serve", "--backend", s.backend, "--host", s.host,
            "--port", str(port), "--slots-per-host", str(s.slots_per_host), "--min-hosts", str(s.min_hosts),
            "--max-hosts", str(s.max_hosts), "--pool-id", s.pool_id, "--image", s.image,
            "--web-provider", s.web_provider]
    with open(log_path, "ab") as log_file:
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log_file, stderr=log_file,
                                env={**os.environ, TOKEN_ENV: token}, start_new_session=True)
    url = f"http://{s.host}:{port}"
    token_file = state_dir() / f"pool-{s.pool_id}.token"
    token_file.write_text(token)
    os.chmod(token_file, 0o600)
    state.write_text(json.dumps({"pid": proc.pid, "url": url, "token_file": str(token_file), "log": str(log_path)}))
    deadline = time.monotonic() + 120
    import httpx

    while time.monotonic() < deadline:
        if proc.poll() is not None:
            print(f"pool failed to start; log: {log_path}\n{_tail(log_path)}", file=sys.stderr)
            state.unlink(missing_ok=True)
            return EXIT_INFRA
        try:
            if httpx.get(f"{url}/healthz", timeout=2).json().get("ok"):
                print(f"pool {s.pool_id} up at {url} (pid {proc.pid}); token in {token_file}")
                return EXIT_OK
        except (httpx.HTTPError, ValueError):
            pass
        time.sleep(0.3)
    print(f"pool did not become healthy in time; log: {log_path}", file=sys.stderr)
    return EXIT_INFRA


def _connection(pool_id: str) -> tuple[str, str]:
    state = _state_file(pool_id)
    if not state.exists():
        raise InfrastructureError(f"no pool {pool_id!r} is up (start one with `atropos-sandbox pool up`)")
    info = json.loads(state.read_text())
    return info["url"], Path(info["token_file"]).read_text().strip()


def cmd_pool_status(args: argparse.Namespace) -> int:
    import httpx

    url, token = _connection(args.pool_id or "cli")
    try:
        status = httpx.get(f"{url}/v1/status", headers={"Authorization": f"Bearer {token}"}, timeout=10).json()
    except httpx.HTTPError as exc:
        raise InfrastructureError(f"pool at {url} does not answer: {exc}") from exc
    if args.json:
        print(json.dumps(status, indent=2))
        return EXIT_OK
    print(render_status(status))
    return EXIT_OK


def render_status(status: dict[str, Any]) -> str:
    lines = [f"pool {status['pool_id']} ({status['backend']}): {status['free']} free, {status['leased']} leased, "
             f"{status['quarantined']} quarantined, {status['waiting']} waiting, "
             f"{status['calls_per_s']:.1f} calls/s, {status['calls_total']} calls, {status['leases_total']} leases",
             f"{'HOST':<34} {'HEALTH':<8} {'FREE':>5} {'LEASED':>6} {'QUAR':>5} {'OLDEST LEASE':>13} {'PROBE ms':>9}"]
    for h in status["hosts"]:
        oldest = "-" if h["oldest_lease_s"] is None else f"{h['oldest_lease_s']:.0f}s"
        probe = "-" if h["health_ms"] is None else f"{h['health_ms']:.1f}"
        lines.append(f"{h['id'][:34]:<34} {'ok' if h['healthy'] else 'FAIL':<8} {h['free']:>5} {h['leased']:>6} "
                     f"{h['quarantined']:>5} {oldest:>13} {probe:>9}")
    if status.get("starting_hosts"):
        lines.append(f"({status['starting_hosts']} host(s) starting)")
    return "\n".join(lines)


def cmd_pool_down(args: argparse.Namespace) -> int:
    pool_id = args.pool_id or "cli"
    state = _state_file(pool_id)
    if not state.exists():
        print(f"no pool {pool_id!r} is up", file=sys.stderr)
        return EXIT_OK
    info = json.loads(state.read_text())
    pid = int(info["pid"])
    if _alive(pid):
        os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + 60
        while _alive(pid) and time.monotonic() < deadline:
            time.sleep(0.2)
        if _alive(pid):
            os.kill(pid, signal.SIGKILL)
    state.unlink(missing_ok=True)
    Path(info["token_file"]).unlink(missing_ok=True)
    print(f"pool {pool_id} is down")
    return EXIT_OK


def cmd_exec(args: argparse.Namespace) -> int:
    """One tool call in a fresh lease: through a running pool if one is up, else an ephemeral one."""
    command = " ".join(args.command)
    tool_args = json.loads(args.args) if args.args else {"command": command} if args.tool == "bash" else {}
    if _state_file(args.pool_id or "cli").exists():
        import httpx

        url, token = _connection(args.pool_id or "cli")
        with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {token}"}, timeout=None) as http:
            if args.tool.startswith("web_"):
                resp = http.post(f"/v1/tools/{args.tool}/invoke", json={"args": tool_args})
                body = resp.json()
                if resp.status_code >= 400:
                    print(f"error: {body.get('error', {}).get('message', resp.text)}", file=sys.stderr)
                    return EXIT_FAILED
                return _print_call(body.get("content", ""), None, bool(body.get("ok")))
            lease = http.post("/v1/slots", json={"trajectory_id": "cli-exec", "network": args.network}).json()
            try:
                out = http.post(f"/v1/slots/{lease['lease_id']}/call",
                                json={"tool": args.tool, "args": tool_args, "timeout_s": args.timeout}).json()
            finally:
                http.delete(f"/v1/slots/{lease['lease_id']}")
        return _print_call(out.get("content", ""), out.get("result"), out.get("ok", False))
    return asyncio.run(_exec_ephemeral(args.tool, tool_args, args.timeout, args.network))


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
        return int(code) if isinstance(code, int) else EXIT_FAILED
    print(text)
    return EXIT_OK if ok else EXIT_FAILED


def cmd_image_build(args: argparse.Namespace) -> int:
    script = REPO / "scripts" / "build_image.sh"
    if not script.exists():
        print("image build needs a source checkout (scripts/build_image.sh)", file=sys.stderr)
        return EXIT_USAGE
    env = {**os.environ, **({"IMAGE_TAG": args.tag} if args.tag else {})}
    return subprocess.call(["bash", str(script)], env=env)


def cmd_nomad_render(args: argparse.Namespace) -> int:
    from atropos.backends.nomad import NomadBackendConfig, render_job

    cfg = NomadBackendConfig(image=args.image or "atropos-sandbox:dev",
                             **({"slots_per_host": args.slots_per_host} if args.slots_per_host else {}))
    print(json.dumps({"Job": render_job(cfg)}, indent=2))
    return EXIT_OK


def cmd_bench(args: argparse.Namespace) -> int:
    if not (REPO / "benchmarks" / "run.py").exists():
        print("bench needs a source checkout (benchmarks/)", file=sys.stderr)
        return EXIT_USAGE
    return subprocess.call([sys.executable, "-m", "benchmarks.run", *args.rest], cwd=REPO)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, ValueError):
        return False
    except PermissionError:
        return True
    return True


def _tail(path: Path, n: int = 1500) -> str:
    try:
        return path.read_text(errors="replace")[-n:]
    except OSError:
        return ""


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="atropos-sandbox", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    serve = sub.add_parser("serve", help="run the ToolServer (external tools + REST slot API) with a pool")
    add_settings_flags(serve)
    serve.set_defaults(func=cmd_serve)

    pool = sub.add_parser("pool", help="a pool (with its ToolServer) in the background")
    pool_sub = pool.add_subparsers(dest="pool_cmd", required=True)
    up = pool_sub.add_parser("up", help="start a pool in the background")
    add_settings_flags(up)
    up.set_defaults(func=cmd_pool_up)
    for name, func, help_text in (("status", cmd_pool_status, "hosts, health, slots, lease ages, calls/s"),
                                  ("down", cmd_pool_down, "stop the background pool and everything it made")):
        sp = pool_sub.add_parser(name, help=help_text)
        sp.add_argument("--pool-id", dest="pool_id", help="which pool (default cli)")
        if name == "status":
            sp.add_argument("--json", action="store_true", help="machine-readable output")
        sp.set_defaults(func=func)

    ex = sub.add_parser("exec", help="run one tool call in a fresh lease (debugging)")
    ex.add_argument("--tool", default="bash", help="tool name (default bash)")
    ex.add_argument("--args", help="tool arguments as JSON (default: the command for bash)")
    ex.add_argument("--timeout", type=float, help="call timeout in seconds")
    ex.add_argument("--network", action="store_true", help="let the call reach the network")
    ex.add_argument("--pool-id", dest="pool_id", help="use this background pool (default cli, if up)")
    ex.add_argument("command", nargs="*", help="the bash command")
    ex.set_defaults(func=cmd_exec)

    image = sub.add_parser("image", help="sandbox image")
    image_sub = image.add_subparsers(dest="image_cmd", required=True)
    build = image_sub.add_parser("build", help="build the sandbox image (local base without a registry)")
    build.add_argument("--tag", help="image tag (default atropos-sandbox:dev)")
    build.set_defaults(func=cmd_image_build)

    nomad = sub.add_parser("nomad", help="Nomad helpers")
    nomad_sub = nomad.add_subparsers(dest="nomad_cmd", required=True)
    render = nomad_sub.add_parser("render", help="print the job JSON the backend registers")
    render.add_argument("--image")
    render.add_argument("--slots-per-host", dest="slots_per_host", type=int)
    render.set_defaults(func=cmd_nomad_render)

    bench = sub.add_parser("bench", help="run the benchmarks (arguments go to benchmarks.run)")
    bench.add_argument("rest", nargs=argparse.REMAINDER)
    bench.set_defaults(func=cmd_bench)
    return p


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    try:
        code = args.func(args)
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
