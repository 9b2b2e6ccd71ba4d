"""The atropos-sandbox CLI against a real local pool: exit codes and output scripts rely on."""

from __future__ import annotations

import argparse
import json
import os
import pwd
import re
import signal
import socket
import stat
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from conftest import free_port

from atropos import cli as cli_module
from atropos.cli import EXIT_INFRA, EXIT_USAGE, ServeSettings, load_settings, parser

POOL = "clitest"


def cli(*args: str, env: dict[str, str] | None = None, timeout: float = 180) -> subprocess.CompletedProcess[str]:
    # ATROPOS_SANDBOX_* of the test run itself must not leak into the CLI's settings
    base = {k: v for k, v in os.environ.items() if not k.startswith("ATROPOS_SANDBOX_")}
    return subprocess.run([sys.executable, "-m", "atropos.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env={**base, **(env or {})})


def run_main(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    """``main()`` in-process (no interpreter start): the exit code and what it printed."""
    with pytest.raises(SystemExit) as exit_info:
        cli_module.main(argv)
    out = capsys.readouterr()
    return int(exit_info.value.code or 0), out.out, out.err


@pytest.fixture
def cache(tmp_path: Path) -> dict[str, str]:
    return {"XDG_CACHE_HOME": str(tmp_path / "cache")}


def run_dir(env: dict[str, str]) -> Path:
    return Path(env["XDG_CACHE_HOME"]) / "atropos-sandbox" / "run"


@pytest.fixture
def pool_up(cache: dict[str, str], tmp_path: Path) -> Iterator[dict[str, str]]:
    """A background pool whose id comes from the environment and whose settings partly from a
    config file: both must reach the child (`pool up` used to drop what it did not copy)."""
    config = tmp_path / "pool.yaml"
    config.write_text("slots_per_host: 2\nmax_hosts: 1\nlog_json: true\nlog_level: info\n")
    env = {**cache, "ATROPOS_SANDBOX_POOL_ID": POOL}
    up = cli("pool", "up", "--config", str(config), "--port", str(free_port()), env=env)
    assert up.returncode == 0, up.stderr
    yield env
    pid = json.loads((run_dir(env) / f"pool-{POOL}.json").read_text())["pid"]
    host_logs = list(host_log_dir(POOL).glob(f"{POOL}-{pid}-*.log"))
    assert host_logs and (run_dir(env) / f"pool-{POOL}.log").exists()  # what `pool down` must remove
    down = cli("pool", "down", env=env)
    assert down.returncode == 0, down.stderr
    assert not list(run_dir(env).glob(f"pool-{POOL}.*json")) and not (run_dir(env) / f"pool-{POOL}.token").exists()
    # its help says it removes the pool's state: the pool's log and its hosts' logs too
    assert not (run_dir(env) / f"pool-{POOL}.log").exists()
    assert not any(log.exists() for log in host_logs), host_logs


def host_log_dir(pool_id: str) -> Path:
    from atropos.backends.local import LocalBackendConfig

    return LocalBackendConfig().data_root / pool_id


def test_pool_up_status_exec_down(pool_up: dict[str, str]) -> None:
    files = run_dir(pool_up)
    state = json.loads((files / f"pool-{POOL}.json").read_text())
    token = (files / f"pool-{POOL}.token").read_text()
    settings = json.loads((files / f"pool-{POOL}.settings.json").read_text())
    for name in (f"pool-{POOL}.token", f"pool-{POOL}.settings.json", f"pool-{POOL}.json"):
        assert stat.S_IMODE((files / name).stat().st_mode) == 0o600, name
    assert settings["log_json"] is True and settings["max_hosts"] == 1 and settings["pool_id"] == POOL
    argv = Path(f"/proc/{state['pid']}/cmdline").read_bytes().split(b"\0")
    assert b"--config" in argv and token.encode() not in b" ".join(argv)  # the token is on no command line

    status = cli("pool", "status", env=pool_up)  # the pool id from ATROPOS_SANDBOX_POOL_ID
    assert status.returncode == 0, status.stderr
    assert "2 free, 0 leased" in status.stdout and "HEALTH" in status.stdout
    as_json = json.loads(cli("pool", "status", "--json", env=pool_up).stdout)
    assert as_json["free"] == 2 and as_json["backend"] == "local" and as_json["pool_id"] == POOL

    ran = cli("exec", "--", "echo hi; echo err >&2; exit 7", env=pool_up)  # one word: a command line
    assert ran.returncode == 7, ran.stderr  # the command's own exit status
    assert ran.stdout == "hi\n" and ran.stderr == "err\n"
    search = cli("exec", "--tool", "web_search", "--args", '{"query": "tar archive"}', env=pool_up)
    assert search.returncode == 0 and "corpus://" in search.stdout
    missing = cli("exec", "--tool", "read_file", "--args", '{"path": "nope.txt"}', env=pool_up)
    assert missing.returncode == 1 and "not_found" in missing.stderr and missing.stdout == ""
    unknown = cli("exec", "--tool", "no_such_tool", "--args", "{}", env=pool_up)
    assert unknown.returncode == EXIT_USAGE and "unknown_tool" in unknown.stderr, unknown.stderr
    after = json.loads(cli("pool", "status", "--json", env=pool_up).stdout)
    assert after["leases_total"] == 3 and after["leased"] == 0 and after["calls_total"] >= 2

    headers = {"Authorization": f"Bearer {token}"}
    with httpx.Client(base_url=state["url"], headers=headers, timeout=60) as http:
        held = [http.post("/v1/slots", json={"trajectory_id": f"held-{i}"}).json()["lease_id"] for i in range(2)]
        time.sleep(1.1)
        table = cli("pool", "status", env=pool_up)
        assert "0 free, 2 leased" in table.stdout, table.stdout
        row = next(line for line in table.stdout.splitlines() if line.startswith(f"{POOL}-"))
        health, free, leased, _quarantined, oldest = row.split()[1:6]
        assert (health, free, leased) == ("ok", "0", "2") and re.fullmatch(r"[1-9]\d*s", oldest), row
        full = cli("exec", "--lease-timeout", "0.5", "--", "true", env=pool_up)  # max_hosts 1: no slot comes
        assert full.returncode == EXIT_INFRA and "503 (no_free_slot)" in full.stderr, full.stderr
        http.delete(f"/v1/slots/{held.pop()}")
        one = cli("pool", "status", "--json", env=pool_up)
        assert json.loads(one.stdout)["leased"] == 1
        for lid in held:
            http.delete(f"/v1/slots/{lid}")

    (files / f"pool-{POOL}.token").write_text("not-the-token")
    refused = cli("pool", "status", env=pool_up)
    assert refused.returncode == EXIT_INFRA and "refused our token (401)" in refused.stderr
    assert "Traceback" not in refused.stderr
    (files / f"pool-{POOL}.token").write_text(token)
    log_lines = (files / f"pool-{POOL}.log").read_text().splitlines()
    assert log_lines and all(json.loads(line)["level"] for line in log_lines if line.startswith("{"))
    assert token not in "\n".join(log_lines)


def test_exec_without_a_pool_uses_an_ephemeral_one(cache: dict[str, str]) -> None:
    ran = cli("exec", "--", "cat /etc/hostname 2>/dev/null; hostname; pwd", env=cache)
    assert ran.returncode == 0
    assert ran.stdout.split() == ["sandbox", "/workspace"]


def test_usage_and_infrastructure_errors_have_distinct_exit_codes(cache: dict[str, str], tmp_path: Path) -> None:
    assert cli("nonsense", env=cache).returncode == 2
    no_pool = cli("pool", "status", "--pool-id", "missing", env=cache)
    assert no_pool.returncode == 3 and "no pool 'missing' is up" in no_pool.stderr
    named = cli("exec", "--", "true", env={**cache, "ATROPOS_SANDBOX_POOL_ID": "missing"})
    assert named.returncode == 3 and "no pool 'missing' is up" in named.stderr  # never silently ephemeral
    no_token = cli("serve", "--port", str(free_port()), env={**cache, "ATROPOS_TOOLSERVER_TOKEN": ""})
    assert no_token.returncode == 2 and "ATROPOS_TOOLSERVER_TOKEN" in no_token.stderr
    public = cli("serve", "--allow-no-auth", "--listen-host", "0.0.0.0", env=cache)
    assert public.returncode == 2 and "loopback" in public.stderr
    assert cli("pool", "down", "--pool-id", "missing", env=cache).returncode == 0


def test_config_and_argument_errors_exit_2_with_a_message(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    bad_json, bad_yaml, typo = tmp_path / "bad.json", tmp_path / "bad.yaml", tmp_path / "typo.json"
    bad_json.write_text('{"port": 1')
    bad_yaml.write_text("port: [1\n")
    typo.write_text('{"max_host": 3}')
    cases = [
        (["serve", "--config", str(tmp_path / "absent.json")], "cannot read the config file"),
        (["pool", "status", "--config", str(bad_json)], "not valid JSON"),
        (["pool", "up", "--config", str(bad_yaml)], "not valid YAML"),
        (["nomad", "render", "--config", str(typo)], "max_host: Extra inputs are not permitted"),
        (["exec", "--args", "{oops", "--", "x"], "--args is not valid JSON"),
        (["exec", "--args", "[1, 2]"], "--args must be a JSON object"),
        (["pool", "status", "--pool-id", "../etc"], "pool_id"),
        (["pool", "status", "--bogus"], "unrecognized arguments: --bogus"),
    ]
    for argv, message in cases:
        code, _out, err = run_main(argv, capsys)
        assert code == EXIT_USAGE and message in err and "Traceback" not in err, (argv, err)


def test_an_unexpected_failure_is_one_line_and_debug_shows_its_traceback(tmp_path: Path) -> None:
    # XDG_CACHE_HOME naming a file: the state dir cannot be made, a failure no error of ours names
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("")
    env = {"XDG_CACHE_HOME": str(not_a_dir)}
    plain = cli("pool", "status", env=env, timeout=120)
    lines = plain.stderr.strip().splitlines()
    assert plain.returncode != 0 and len(lines) == 1, plain.stderr
    assert lines[0].startswith("error: ") and str(not_a_dir) in lines[0] and "--debug" in lines[0], plain.stderr
    debug = cli("--debug", "pool", "status", env=env, timeout=120)
    assert debug.returncode != 0 and "Traceback" in debug.stderr and "NotADirectoryError" in debug.stderr


def test_dead_stale_and_foreign_pools_exit_3(cache: dict[str, str], tmp_path: Path) -> None:
    files = run_dir(cache)
    files.mkdir(parents=True)
    (files / "pool-ghost.token").write_text("t")

    def state(pool_id: str, pid: int, url: str) -> None:
        (files / f"pool-{pool_id}.json").write_text(json.dumps({
            "pool_id": pool_id, "pid": pid, "url": url, "token_file": str(files / "pool-ghost.token"),
            "log": str(files / "ghost.log")}))

    # A process that passes for a pool (its argv names atropos.cli serve, as the CLI checks against
    # pid reuse) but serves static HTML: first reached at a dead port, then at its HTML.
    (tmp_path / "v1").mkdir()
    (tmp_path / "v1" / "status").write_text("<html>not a pool</html>")
    web_port = free_port()
    code = ("import functools, http.server, sys; "
            "h = functools.partial(http.server.SimpleHTTPRequestHandler, directory=sys.argv[1]); "
            "http.server.ThreadingHTTPServer(('127.0.0.1', int(sys.argv[2])), h).serve_forever()")
    fake = subprocess.Popen([sys.executable, "-c", code, str(tmp_path), str(web_port), "atropos.cli", "serve"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        state("gone", 2**22 + 7, "http://127.0.0.1:9")
        gone = cli("pool", "status", "--pool-id", "gone", env=cache)
        assert gone.returncode == 3 and "is not running" in gone.stderr, gone.stderr
        state("dead", fake.pid, f"http://127.0.0.1:{free_port()}")
        for argv in (["pool", "status", "--pool-id", "dead"], ["exec", "--pool-id", "dead", "--", "true"]):
            dead = cli(*argv, env=cache)
            assert dead.returncode == 3 and "does not answer" in dead.stderr and "Traceback" not in dead.stderr
        (files / "pool-bad.json").write_text("{not json")
        corrupt = cli("pool", "status", "--pool-id", "bad", env=cache)
        assert corrupt.returncode == 3 and "corrupt" in corrupt.stderr
        assert cli("pool", "down", "--pool-id", "bad", env=cache).returncode == 0
        assert not (files / "pool-bad.json").exists()
        _wait_for_port(web_port)
        state("html", fake.pid, f"http://127.0.0.1:{web_port}")
        html = cli("pool", "status", "--pool-id", "html", env=cache)
        assert html.returncode == 3 and "no JSON object" in html.stderr, html.stderr
    finally:
        fake.kill()
        fake.wait()


def _wait_for_port(port: int) -> None:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.1)
    raise AssertionError(f"nothing listens on {port}")


def test_pool_up_that_never_becomes_healthy_is_stopped_and_cleaned_up(cache: dict[str, str]) -> None:
    up = cli("pool", "up", "--pool-id", "slow", "--port", str(free_port()), "--timeout", "0.2", env=cache)
    assert up.returncode == EXIT_INFRA and "did not become healthy within 0.2s" in up.stderr, up.stderr
    pid = int(re.search(r"stopped it \(pid (\d+)\)", up.stderr).group(1))  # type: ignore[union-attr]
    assert not Path(f"/proc/{pid}").exists()
    leftovers = sorted(p.name for p in run_dir(cache).iterdir())
    assert leftovers == ["pool-slow.log"], leftovers  # state, token and settings gone; the log stays


def test_serve_starts_answers_and_stops_on_sigterm(cache: dict[str, str]) -> None:
    token = "serve-test-token-0123456789"
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("ATROPOS_SANDBOX_")}
    env.update(cache, ATROPOS_TOOLSERVER_TOKEN=token, ATROPOS_SANDBOX_SLOTS_PER_HOST="1")
    proc = subprocess.Popen([sys.executable, "-m", "atropos.cli", "serve", "--port", str(port), "--log-json",
                             "--pool-id", "servetest"], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    try:
        deadline = time.monotonic() + 120
        health: dict[str, Any] = {}
        while time.monotonic() < deadline and not health.get("ok"):
            assert proc.poll() is None, proc.communicate()[1]
            try:
                health = httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=2).json()
            except httpx.HTTPError:
                time.sleep(0.3)
        assert health.get("ok") and health["hosts"] == 1
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30) as http:
            assert http.get("/v1/status").status_code == 401
            status = http.get("/v1/status", headers={"Authorization": f"Bearer {token}"}).json()
            assert status["pool_id"] == "servetest" and status["free"] == 1  # the env var reached the pool
            assert "atropos_pool_host_up" in http.get("/metrics").text
        busy = cli("serve", "--port", str(port), env={**cache, "ATROPOS_TOOLSERVER_TOKEN": token})
        assert busy.returncode == EXIT_INFRA and f"port {port} on 127.0.0.1 is already in use" in busy.stderr
        assert "Traceback" not in busy.stderr
    finally:
        proc.send_signal(signal.SIGTERM)
        _out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    lines = [json.loads(line) for line in err.splitlines() if line.strip()]
    assert any("ToolServer on http://127.0.0.1" in line["msg"] for line in lines)
    # where the docs, the status page (token in the fragment) and the metrics are, as served
    url = f"http://127.0.0.1:{port}"
    assert any(line["msg"] == f"API docs {url}/docs (OpenAPI {url}/openapi.json); status page "
               f"{url}/status#token=<token>; metrics {url}/metrics" for line in lines), lines
    assert token not in err


@pytest.mark.parametrize("delivery", ["job", "variable"])
def test_nomad_render_is_what_serve_registers(delivery: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from atropos.backends.nomad import NomadBackend

    config = tmp_path / "render.json"
    config.write_text(json.dumps({"image": "registry.example/sandbox:7", "slots_per_host": 3}))
    env = {"ATROPOS_SANDBOX_POOL_ID": "render1", "ATROPOS_NOMAD_TOKEN_DELIVERY": delivery, "ATROPOS_NOMAD_CPU": "1500"}
    out = cli("nomad", "render", "--config", str(config), "--slots-per-host", "5", env=env)
    assert out.returncode == 0, out.stderr
    rendered = json.loads(out.stdout)["Job"]

    for key, value in env.items():
        monkeypatch.setenv(key, value)
    settings = ServeSettings(image="registry.example/sandbox:7", slots_per_host=5, pool_id="render1")
    backend = NomadBackend(cli_module.nomad_config(settings))  # what `serve --backend nomad` builds
    registered = backend.render_job(0)
    registered.pop("Meta")  # the owner record (pid, boot id) exists per running pool
    task = registered["TaskGroups"][0]["Tasks"][0]
    [template] = task["Templates"]
    if delivery == "job":
        assert template["EmbeddedTmpl"] == f"{backend._token}\n"
        template["EmbeddedTmpl"] = "<generated per pool>\n"  # never a live secret in rendered output
    assert backend._token not in out.stdout
    assert rendered == registered
    assert rendered["ID"] == "atropos-render1" and "--slots=5" in task["Config"]["args"]
    assert task["Resources"]["CPU"] == 1500 and task["Config"]["image"] == "registry.example/sandbox:7"


def test_settings_precedence_flags_over_env_over_config_file(tmp_path: Path) -> None:
    config = tmp_path / "settings.yaml"
    config.write_text("port: 7001\nmax_hosts: 2\nmin_hosts: 2\nimage: from-file\nlog_json: false\n")
    args = parser().parse_args(["serve", "--config", str(config), "--port", "7003"])
    env = {"ATROPOS_SANDBOX_PORT": "7002", "ATROPOS_SANDBOX_MAX_HOSTS": "6", "ATROPOS_SANDBOX_LOG_JSON": "true"}
    s = load_settings(args, env)
    assert (s.port, s.max_hosts, s.min_hosts, s.image, s.log_json) == (7003, 6, 2, "from-file", True)
    # the config file may come from the environment too; a flag still names another one
    s = load_settings(parser().parse_args(["pool", "status"]), {"ATROPOS_SANDBOX_CONFIG": str(config)})
    assert s.port == 7001 and s.pool_id == f"cli-{pwd.getpwuid(os.getuid()).pw_name}"
    assert "pool_id" not in s.model_fields_set
    other = tmp_path / "other.json"
    other.write_text('{"pool_id": "from-json"}')
    s = load_settings(parser().parse_args(["pool", "status", "--config", str(other)]),
                      {"ATROPOS_SANDBOX_CONFIG": str(config)})
    assert s.pool_id == "from-json" and s.port == 8600


def test_help_of_every_command(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run_main(["--help"], capsys)
    assert code == 0
    for text in ("exit codes", "2  bad usage", "3  infrastructure", "ATROPOS_SANDBOX_<SETTING>",
                 "ATROPOS_TOOLSERVER_TOKEN", "--config FILE", "ATROPOS_SANDBOX_CONFIG", "pool_id"):
        assert text in out, text
    commands = {("serve",): "--max-hosts", ("pool",): "status", ("pool", "up"): "--timeout",
                ("pool", "status"): "--json", ("pool", "down"): "--pool-id", ("exec",): "--lease-timeout",
                ("image",): "build", ("image", "build"): "--tag", ("nomad",): "render",
                ("nomad", "render"): "atropos-<pool_id>", ("bench",): "--quick"}
    for argv, text in commands.items():
        code, out, _ = run_main([*argv, "--help"], capsys)
        assert code == 0 and text in out and f"usage: atropos-sandbox {' '.join(argv)}" in out, argv
        assert max(len(line) for line in out.splitlines()) <= 100, argv


@pytest.mark.parametrize(("argv", "forwarded"), [
    (["bench", "--quick"], ["--quick"]),
    (["bench", "--", "--quick"], ["--quick"]),
    (["bench", "--quick", "--scenario", "lease", "-v"], ["--quick", "--scenario", "lease", "-v"]),
    (["bench", "--", "--help"], ["--help"]),
    (["bench"], []),
])
def test_bench_forwards_its_arguments(argv: list[str], forwarded: list[str], capsys: pytest.CaptureFixture[str],
                                      monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[list[str]] = []

    def fake_call(cmd: list[str], **_kw: object) -> int:
        seen.append(cmd)
        return 0

    monkeypatch.setattr(subprocess, "call", fake_call)
    code, _out, err = run_main(argv, capsys)
    assert code == 0, err
    assert seen == [[sys.executable, "-m", "benchmarks.run", *forwarded]]


def test_bench_runs_in_the_working_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    """Its results/ (and any relative path given) land where the user is, not in the checkout."""
    calls: list[dict[str, Any]] = []
    monkeypatch.setattr(subprocess, "call", lambda cmd, **kw: calls.append(kw) or 0)
    monkeypatch.chdir(tmp_path)
    code, _out, err = run_main(["bench", "--quick"], capsys)
    assert code == 0, err
    assert Path(calls[0]["cwd"]) == tmp_path
    # and benchmarks.run is found from there (the checkout is on its PYTHONPATH)
    real = subprocess.run([sys.executable, "-m", "benchmarks.run", "--help"], cwd=tmp_path, env=calls[0]["env"],
                          capture_output=True, text=True, timeout=120)
    assert real.returncode == 0 and "results/bench.json" in real.stdout, real.stderr


def test_the_default_pool_id_is_per_user(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two users of one machine get two pools (state, hosts, containers, logs) unless they ask for one."""
    mine = load_settings(parser().parse_args(["pool", "status"]), {}).pool_id
    assert mine == f"cli-{pwd.getpwuid(os.getuid()).pw_name}"
    # another uid (the interpreter here is not readable by another user: its uid is swapped in)
    nobody = pwd.getpwnam("nobody")
    monkeypatch.setattr(os, "getuid", lambda: nobody.pw_uid)
    monkeypatch.setenv("USER", pwd.getpwuid(0).pw_name)  # the name comes from the uid, not from $USER
    other = load_settings(parser().parse_args(["pool", "status"]), {}).pool_id
    assert other == "cli-nobody" != mine


def test_render_status_shows_lease_ages_and_scaling_events() -> None:
    status = {"pool_id": "p", "backend": "local", "free": 1, "leased": 1, "quarantined": 0, "waiting": 0,
              "calls_per_s": 2.5, "calls_total": 9, "leases_total": 4, "lost_hosts": 0, "starting_hosts": 0,
              "scale_ups": 2, "scale_downs": 1, "quarantines": 0,
              "hosts": [{"id": "p-1", "healthy": True, "free": 1, "leased": 1, "quarantined": 0,
                         "oldest_lease_s": 42.4, "health_ms": 3.25}]}
    table = cli_module.render_status(status)
    assert "1 free, 1 leased" in table and "2 scale-ups, 1 scale-downs, 0 quarantines, 0 lost hosts" in table
    assert re.search(r"^p-1\s+ok\s+1\s+1\s+0\s+42s\s+3.2", table, re.M), table


def test_pool_reply_errors_map_to_documented_exit_codes() -> None:
    cases = {401: EXIT_INFRA, 404: EXIT_USAGE, 409: EXIT_INFRA, 422: EXIT_USAGE, 429: EXIT_INFRA,
             500: EXIT_INFRA, 501: EXIT_USAGE, 503: EXIT_INFRA}
    for status, code in cases.items():
        assert cli_module.PoolReplyError(status, "c", "m").exit_code == code, status
    assert isinstance(parser().parse_args(["pool", "down"]), argparse.Namespace)


def test_default_ports_leave_run_api_its_port() -> None:
    """``run-api``'s default port (and an env's rollout_server_url) is 8000: with ``pool up`` or
    ``serve`` running on defaults, run-api must still start, and an env must not mistake the
    ToolServer or run-api for its model server."""
    from urllib.parse import urlparse

    from atroposlib.envs.base import BaseEnvConfig

    from atropos.envs.config import default_server_configs

    run_api_port = urlparse(BaseEnvConfig().rollout_server_url).port
    assert run_api_port == 8000
    assert ServeSettings().port not in (run_api_port, 0)
    model_port = urlparse(default_server_configs()[0].base_url).port
    assert model_port not in (run_api_port, ServeSettings().port)


SCRIPTS = Path(__file__).resolve().parent.parent / "scripts"


@pytest.mark.parametrize("script", sorted(p.name for p in SCRIPTS.glob("*.py")))
def test_every_script_starts_outside_pytest(script: str, tmp_path: Path) -> None:
    """The operator scripts (soak, chaos soak, model server, ...) import test helpers; run as
    ``python scripts/x.py`` they have none of pytest's path set-up, and must still start."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run([sys.executable, str(SCRIPTS / script), "--help"], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "usage" in proc.stdout.lower()


def test_an_image_reference_that_does_not_exist_is_a_usage_error_not_infrastructure(cache: dict[str, str]) -> None:
    """``exec --task-image oci:DIR:TAG`` of a layout that is not there: image_rejected, exit 2 (the
    request is wrong; 3 would tell a script the platform is down), the message naming the layout."""
    missing = cli("exec", "--task-image", "oci:/nonexistent/layout:v1", "--", "true", env=cache)
    assert missing.returncode == EXIT_USAGE, missing.stderr
    assert "no OCI image layout at '/nonexistent/layout'" in missing.stderr and "Traceback" not in missing.stderr


def test_a_refused_request_exits_2_without_a_pool_too(cache: dict[str, str]) -> None:
    """The ephemeral exec (no pool up) answers as the help says: a request refused as wrong is 2, a tool
    call that ran and failed is 1."""
    escape = cli("exec", "--tool", "read_file", "--args", '{"path": "../../etc/passwd"}', env=cache)
    assert escape.returncode == EXIT_USAGE, (escape.returncode, escape.stderr)
    assert escape.stderr.startswith("error (path_escape): ") and "Traceback" not in escape.stderr
    missing = cli("exec", "--tool", "read_file", "--args", '{"path": "nope.txt"}', env=cache)
    assert missing.returncode == 1, (missing.returncode, missing.stderr)


def test_exec_task_image_flag_and_the_old_spelling(cache: dict[str, str], tmp_path: Path) -> None:
    """`exec --task-image` is the task image (`--image` names the sandbox image in serve/pool up); the old
    `exec --image` still works, with a warning naming the new flag."""
    help_text = cli("exec", "--help", env=cache).stdout
    assert "--task-image" in help_text and "--image " not in help_text
    bogus = f"oci:{tmp_path / 'no-such-layout'}"
    new = cli("exec", "--task-image", bogus, "--", "true", env=cache)
    old = cli("exec", "--image", bogus, "--", "true", env=cache)
    assert new.returncode == old.returncode != 0, (new.stderr, old.stderr)
    assert "--task-image" in old.stderr and "--task-image" not in new.stderr
    # a layout that is not there is the request's fault (image_rejected), named, not a host failure
    for run in (new, old):
        assert run.returncode == EXIT_USAGE and "no OCI image layout at" in run.stderr, run.stderr
    both = cli("exec", "--image", bogus, "--task-image", bogus + "x", "--", "true", env=cache)
    assert both.returncode == EXIT_USAGE and "disagree" in both.stderr


def test_the_python_api_default_pool_id_is_per_user() -> None:
    import pwd

    from atropos.backends.local import LocalBackendConfig
    from atropos.cli.settings import default_pool_id
    from atropos.slots.config import PoolConfig

    user = pwd.getpwuid(os.getuid()).pw_name
    assert PoolConfig().pool_id == LocalBackendConfig().pool_id == f"py-{user}"
    assert default_pool_id() == f"cli-{user}"


def test_no_framework_warning_on_import() -> None:
    r = subprocess.run([sys.executable, "-c", "import atropos.envs, transformers"], capture_output=True, text=True,
                       env={k: v for k, v in os.environ.items() if k != "TRANSFORMERS_NO_ADVISORY_WARNINGS"},
                       timeout=120)
    assert r.returncode == 0 and "None of PyTorch" not in r.stderr, r.stderr
