"""``pool up|status|down``: a pool with its ToolServer in the background.

``pool up`` starts ``serve`` in its own session with exactly the settings it validated (from a 0600
file, with a generated token in another: nothing secret on a command line) and waits until it is
healthy; ``status`` asks it; ``down`` stops its process group and removes its state.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
import subprocess
import sys
import time
from typing import Any

from pydantic import ValidationError

from atropos.cli.exit_codes import EXIT_INFRA, EXIT_OK, EXIT_USAGE
from atropos.cli.pool_client import PoolHttp, connection
from atropos.cli.pool_state import (
    PoolState,
    is_pool_process,
    pool_files,
    read_state,
    remove_files,
    remove_host_logs,
    stop_process_group,
    tail,
    write_private,
)
from atropos.cli.serve import client_url, where_to_look
from atropos.cli.settings import SETTINGS_ENV_PREFIX, TOKEN_ENV, ServeSettings, load_settings, pool_id_of
from atropos.errors import InfrastructureError, validation_message


def cmd_pool_up(args: argparse.Namespace) -> int:
    s = load_settings(args)
    old = read_state(s.pool_id)
    if old is not None and is_pool_process(old.pid):
        print(f"pool {s.pool_id} is already up at {old.url} (pid {old.pid})", file=sys.stderr)
        return EXIT_OK
    remove_files(s.pool_id)  # leftovers of a pool that died without `pool down`
    if s.port == 0:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            s = s.model_copy(update={"port": probe.getsockname()[1]})
    proc = _spawn(s)
    try:
        code = _wait_healthy(s, proc, args.timeout)
    except BaseException:  # Ctrl-C while waiting: leave nothing running behind
        _stop(s, proc)
        raise
    if code is None:
        _stop(s, proc)
        log = pool_files(s.pool_id)["log"]
        print(f"error: pool {s.pool_id} did not become healthy within {args.timeout:g}s; stopped it (pid {proc.pid}); "
              f"log: {log}\n{tail(log)}", file=sys.stderr)
        return EXIT_INFRA
    return code


def _spawn(s: ServeSettings) -> subprocess.Popen[bytes]:
    """``serve`` in its own session, reading exactly the settings validated here (flags + env +
    --config) from a private file: nothing is dropped on the way, and the token is on no command
    line (argv is public)."""
    from atropos.backends.base import new_token

    files = pool_files(s.pool_id)
    token = new_token()
    write_private(files["settings"], s.model_dump_json(indent=2))
    write_private(files["token"], token)
    child_env = {k: v for k, v in os.environ.items() if not k.startswith(SETTINGS_ENV_PREFIX)}
    child_env.pop(TOKEN_ENV, None)
    # the token by its private file, never the environment (readable by our user's processes)
    argv = [sys.executable, "-m", "atropos.cli", "serve", "--config", str(files["settings"]),
            "--token-file", str(files["token"])]
    with open(files["log"], "ab") as log_file:
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log_file, stderr=log_file,
                                env=child_env, start_new_session=True)
    state = PoolState(pool_id=s.pool_id, pid=proc.pid, url=client_url(s.listen_host, s.port), token_file=files["token"],
                      settings_file=files["settings"], log=files["log"])
    write_private(files["state"], state.model_dump_json())
    return proc


def _wait_healthy(s: ServeSettings, proc: subprocess.Popen[bytes], timeout: float) -> int | None:
    """The exit code once the pool is healthy or has exited; None when ``timeout`` passed first."""
    import httpx

    files = pool_files(s.pool_id)
    url = client_url(s.listen_host, s.port)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        code = proc.poll()
        if code is not None:
            print(f"error: pool {s.pool_id} exited with status {code} while starting; log: {files['log']}\n"
                  f"{tail(files['log'])}", file=sys.stderr)
            remove_files(s.pool_id)
            return EXIT_USAGE if code == EXIT_USAGE else EXIT_INFRA
        with contextlib.suppress(httpx.HTTPError, ValueError):
            health = httpx.get(f"{url}/healthz", timeout=2).json()
            if isinstance(health, dict) and health.get("ok"):
                print(f"pool {s.pool_id} up at {url} (pid {proc.pid}); token in {files['token']}\n"
                      f"{where_to_look(url)}")
                return EXIT_OK
        time.sleep(0.3)
    return None


def _stop(s: ServeSettings, proc: subprocess.Popen[bytes]) -> None:
    stop_process_group(proc.pid, lambda: proc.poll() is None, 20)
    proc.wait()
    remove_files(s.pool_id)


def cmd_pool_status(args: argparse.Namespace) -> int:
    from atropos.slots.pool import PoolStatus

    pool_id, _ = pool_id_of(args)
    with PoolHttp(connection(pool_id, read_state(pool_id))) as http:
        body = http.request("GET", "/v1/status")
    try:
        PoolStatus.model_validate(body)
    except ValidationError as exc:
        raise InfrastructureError(f"pool {pool_id!r} answered /v1/status with an unexpected shape: "
                                  f"{validation_message(exc, 'body', first=True)}") from None
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
    lines += [_host_line(h) for h in status["hosts"]]
    if status.get("starting_hosts"):
        lines.append(f"({status['starting_hosts']} host(s) starting)")
    return "\n".join(lines)


def _host_line(h: dict[str, Any]) -> str:
    oldest = "-" if h["oldest_lease_s"] is None else f"{h['oldest_lease_s']:.0f}s"
    probe = "-" if h["health_ms"] is None else f"{h['health_ms']:.1f}"
    node = f"  node {h['node'][:12]}" if h.get("node") else ""
    return (f"{h['id'][:34]:<34} {'ok' if h['healthy'] else 'FAIL':<8} {h['free']:>5} {h['leased']:>6} "
            f"{h['quarantined']:>5} {oldest:>13} {probe:>9}{node}")


def cmd_pool_down(args: argparse.Namespace) -> int:
    pool_id, _ = pool_id_of(args)
    try:
        state = read_state(pool_id)
    except InfrastructureError as exc:  # corrupt state: nothing we can stop, clear it
        print(f"warning: {exc}; removing it", file=sys.stderr)
        state = None
        remove_files(pool_id)
    if state is None:
        print(f"no pool {pool_id!r} is up", file=sys.stderr)
    elif is_pool_process(state.pid):
        stop_process_group(state.pid, lambda: is_pool_process(state.pid), 60)
    # all the pool's state, its log and its hosts' logs too (`pool up` after it starts clean)
    remove_files(pool_id, keep_log=False)
    remove_host_logs(pool_id)
    if state is not None:
        print(f"pool {pool_id} is down")
    return EXIT_OK
