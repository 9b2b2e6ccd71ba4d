"""The atropos-sandbox CLI against a real local pool: exit codes and output scripts rely on."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest


def cli(*args: str, env: dict[str, str] | None = None, timeout: float = 180) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "atropos.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, **(env or {})})


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def cache(tmp_path: Path) -> dict[str, str]:
    return {"XDG_CACHE_HOME": str(tmp_path / "cache")}


@pytest.fixture
def pool_up(cache: dict[str, str]) -> Iterator[dict[str, str]]:
    env = {**cache}
    up = cli("pool", "up", "--slots-per-host", "2", "--port", str(free_port()), "--pool-id", "clitest", env=env)
    assert up.returncode == 0, up.stderr
    yield env
    down = cli("pool", "down", "--pool-id", "clitest", env=env)
    assert down.returncode == 0


def test_pool_up_status_exec_down(pool_up: dict[str, str]) -> None:
    status = cli("pool", "status", "--pool-id", "clitest", env=pool_up)
    assert status.returncode == 0
    assert "2 free, 0 leased" in status.stdout and "HEALTH" in status.stdout
    as_json = json.loads(cli("pool", "status", "--pool-id", "clitest", "--json", env=pool_up).stdout)
    assert as_json["free"] == 2 and as_json["backend"] == "local"

    ran = cli("exec", "--pool-id", "clitest", "--", "echo", "hi; echo err >&2; exit 7", env=pool_up)
    assert ran.returncode == 7  # the command's own exit status
    assert ran.stdout == "hi\n" and ran.stderr == "err\n"
    search = cli("exec", "--pool-id", "clitest", "--tool", "web_search", "--args", '{"query": "tar archive"}',
                 env=pool_up)
    assert search.returncode == 0 and "corpus://" in search.stdout
    after = json.loads(cli("pool", "status", "--pool-id", "clitest", "--json", env=pool_up).stdout)
    assert after["leases_total"] == 1 and after["leased"] == 0 and after["calls_total"] >= 1


def test_exec_without_a_pool_uses_an_ephemeral_one(cache: dict[str, str]) -> None:
    ran = cli("exec", "--", "cat /etc/hostname 2>/dev/null; hostname; pwd", env=cache)
    assert ran.returncode == 0
    assert ran.stdout.split() == ["sandbox", "/workspace"]


def test_usage_and_infrastructure_errors_have_distinct_exit_codes(cache: dict[str, str]) -> None:
    assert cli("nonsense", env=cache).returncode == 2
    no_pool = cli("pool", "status", "--pool-id", "missing", env=cache)
    assert no_pool.returncode == 3 and "no pool 'missing' is up" in no_pool.stderr
    no_token = cli("serve", "--port", str(free_port()), env={**cache, "ATROPOS_TOOLSERVER_TOKEN": ""})
    assert no_token.returncode == 2 and "ATROPOS_TOOLSERVER_TOKEN" in no_token.stderr
    public = cli("serve", "--allow-no-auth", "--host", "0.0.0.0", env=cache)
    assert public.returncode == 2 and "loopback" in public.stderr
    assert cli("pool", "down", "--pool-id", "missing", env=cache).returncode == 0
