"""Rough edges of running an env from the command line (issue 20, finding 9): what the run prints
is true (use_wandb), SIGTERM stops it cleanly (pool down, summary printed, no traceback), and the
log of a previous run's host survives the next start. Real subprocesses, a real local pool."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from conftest import LeasedSlot

pytest.importorskip("atroposlib")

from atropos.backends.local import KEPT_HOST_LOGS, LocalBackend, LocalBackendConfig
from atropos.testing import FakeChatServer

REPO = Path(__file__).resolve().parent.parent


def _env(tokenizer_dir: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("WANDB", "ATROPOS_MODEL_"))}
    env.update(HF_HUB_OFFLINE="1", ATROPOS_TOKENIZER_DIR=tokenizer_dir, PYTHONPATH=str(REPO))
    return env


def test_process_prints_the_wandb_setting_it_really_uses(tokenizer_dir: str, tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "tests.scripted_env", "process", "--env.total_steps", "1", "--env.group_size", "2",
         "--env.slots_per_host", "2", "--env.max_hosts", "1", "--env.data_path_to_save_groups",
         str(tmp_path / "g.jsonl")], cwd=tmp_path, env=_env(tokenizer_dir), capture_output=True, text=True,
        timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "use_wandb=True" not in proc.stdout
    # quiet by default (issue 28): no config dump, no atroposlib warning about the local server URL
    assert "AgentEnvConfig(" not in proc.stdout + proc.stderr and "local Base URL" not in proc.stderr
    assert "mean score: 1.000" in proc.stdout
    assert "Traceback" not in proc.stderr and not (tmp_path / "wandb").exists()
    # the verifier check ran before the groups and is in the summary and the HTML report
    assert proc.stdout.count("verifier check (in a slot: reference solution -> must score 1, starting stub "
                             "-> must score 0): all as expected") == 2
    report = (tmp_path / "g.html").read_text()
    assert "id='verifier-check'" in report and "is_palindrome" in report


def test_show_config_prints_the_config_a_run_really_uses(tokenizer_dir: str, tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "tests.scripted_env", "process", "--show-config", "--env.total_steps", "1",
         "--env.group_size", "2", "--env.slots_per_host", "2", "--env.max_hosts", "1", "--env.verifier_check",
         "false", "--env.data_path_to_save_groups", str(tmp_path / "g.jsonl")], cwd=tmp_path,
        env=_env(tokenizer_dir), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "AgentEnvConfig(" in proc.stdout and "APIServerConfig(" in proc.stdout
    assert "use_wandb=False" in proc.stdout and "use_wandb=True" not in proc.stdout  # what the run really uses
    assert "mean score: 1.000" in proc.stdout


def test_a_bad_setting_ends_the_run_in_one_clear_line(tokenizer_dir: str, tmp_path: Path) -> None:
    """Issue 18: every env failure ends in one line; a bad flag value was a pydantic traceback."""
    proc = subprocess.run(
        [sys.executable, "-m", "tests.scripted_env", "process", "--env.total_steps", "1", "--env.group_size", "2",
         "--env.slots_per_host", "0", "--env.data_path_to_save_groups", str(tmp_path / "g.jsonl")],
        cwd=tmp_path, env=_env(tokenizer_dir), capture_output=True, text=True, timeout=300)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert len(errors) == 1 and "slots_per_host" in errors[0] and "'0'" in errors[0], proc.stderr[-3000:]


def _hosts_of(pid: int) -> list[int]:
    """Sandbox host processes started for the env process ``pid`` (they carry --parent-pid PID)."""
    found = []
    needles = (f"--parent-pid\0{pid}\0".encode(), f"--parent-pid={pid}\0".encode())
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if any(n in (entry / "cmdline").read_bytes() for n in needles):
                    found.append(int(entry.name))
            except OSError:
                continue
    return found


@pytest.mark.parametrize("sigint", ["default", "ignored"])
def test_sigterm_stops_a_run_cleanly(tokenizer_dir: str, tmp_path: Path, sigint: str) -> None:
    # "ignored": as under `nohup python env.py process &` from a script, which starts the run with
    # SIGINT ignored (before the fix the run hung on SIGTERM there)
    release = threading.Event()

    def stuck(messages: list[dict[str, Any]]) -> str:
        release.wait(300)  # the model "thinks" until the test is done
        return "Done."

    with FakeChatServer(stuck) as server:
        proc = subprocess.Popen(
            [sys.executable, "-m", "atropos.envs.examples.coding", "process", "--openai.base_url", server.base_url,
             "--openai.model_name", "fake", "--env.total_steps", "1", "--env.group_size", "2",
             "--env.slots_per_host", "2", "--env.max_hosts", "1",
             "--env.data_path_to_save_groups", str(tmp_path / "g.jsonl")],
            cwd=tmp_path, env=_env(tokenizer_dir), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            preexec_fn=(lambda: signal.signal(signal.SIGINT, signal.SIG_IGN)) if sigint == "ignored" else None)
        try:
            deadline = time.monotonic() + 300
            while not server.requests:  # mid-rollout: slots leased, the model asked
                assert proc.poll() is None, proc.communicate()[1][-3000:]
                assert time.monotonic() < deadline, "the env never asked the model"
                time.sleep(0.2)
            assert _hosts_of(proc.pid), "no sandbox host runs for the env"
            proc.send_signal(signal.SIGTERM)
            out, err = proc.communicate(timeout=120)
        finally:
            release.set()
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    assert proc.returncode == 128 + signal.SIGTERM, err[-3000:]
    assert "stopped by SIGTERM; the sandbox pool is down" in err
    assert "Traceback" not in err, err[-3000:]
    assert "[atropos-sandbox] pool: backend local" in out and "[atropos-sandbox] rollouts: 0" in out
    assert _hosts_of(proc.pid) == []


async def test_logs_of_a_previous_runs_hosts_survive_the_next_start(tmp_path: Path) -> None:
    dead = subprocess.Popen(["true"])
    dead.wait()
    backend = LocalBackend(LocalBackendConfig(data_root=tmp_path / "local", pool_id="p"))
    backend.root.mkdir(parents=True)
    logs = []
    for i in range(KEPT_HOST_LOGS + 3):
        log = backend.root / f"p-{dead.pid}-{i}.log"
        log.write_text(f"host {i} died: why\n")
        os.utime(log, (1000 + i, 1000 + i))
        logs.append(log)
    orphan_dir = backend.root / f"p-{dead.pid}-1"
    orphan_dir.mkdir()
    assert await backend.reap_orphans() == 4  # the orphan's data dir and the 3 oldest logs
    assert not orphan_dir.exists()
    assert [p.exists() for p in logs] == [False] * 3 + [True] * KEPT_HOST_LOGS
    assert logs[-1].read_text() == f"host {KEPT_HOST_LOGS + 2} died: why\n"


def _cli(cache: Path, *argv: str) -> subprocess.CompletedProcess[str]:
    # a cache dir of its own: no background pool is up there, exec runs in an ephemeral local pool
    env = {k: v for k, v in os.environ.items() if not k.startswith("ATROPOS_SANDBOX_")}
    env.update(PYTHONPATH=str(REPO), XDG_CACHE_HOME=str(cache))
    return subprocess.run([sys.executable, "-m", "atropos.cli", "exec", *argv],
                          env=env, capture_output=True, text=True, timeout=300)


def test_exec_timeout_quoting_and_syntax_errors_are_plain(tmp_path: Path) -> None:
    from atropos.cli import EXIT_TIMED_OUT

    timed = _cli(tmp_path, "--timeout", "1", "--", "sleep 30")
    assert timed.returncode == EXIT_TIMED_OUT == 124
    assert "timed out after" in timed.stderr and "--timeout" in timed.stderr
    words = _cli(tmp_path, "--", "printf", "%s|", "a b", "c;d")
    assert words.returncode == 0 and words.stdout == "a b|c;d|", words
    line = _cli(tmp_path, "--", "echo one; echo two | tr a-z A-Z")
    assert line.stdout == "one\nTWO\n"
    for _ in range(2):  # the second call gets the slot's warm bash
        broken = _cli(tmp_path, "--", "echo (")
        assert broken.returncode == 2 and "syntax error" in broken.stderr
        assert "__atropos" not in broken.stderr and "unset" not in broken.stderr, broken.stderr


async def test_a_syntax_error_quotes_the_command_not_the_bootstrap(slot: LeasedSlot) -> None:
    await slot.sh("true")
    for _ in range(3):  # after the first call the slot's warm bash serves them
        await asyncio.sleep(0.1)
        out = await slot.sh("echo (")
        assert out["exit_code"] == 2 and "syntax error" in out["stderr"], out
        assert "`echo ('" in out["stderr"]
        assert "__atropos" not in out["stderr"] and "unset" not in out["stderr"], out["stderr"]


def test_help_names_the_values_the_env_sets(tokenizer_dir: str, tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "atropos.envs.examples.coding", "process", "--help"], cwd=tmp_path,
                          env=_env(tokenizer_dir), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    head, _, rest = proc.stdout.partition("usage:")
    assert "CodingEnv sets (the defaults shown by --help below are atroposlib's)" in head
    # the coding env's own values, where --help's Field defaults say 1000 and no grammar
    assert "  --env.total_steps 2\n" in head and "  --env.tool_call_grammar True\n" in head
    assert "  --env.enabled_toolsets shell files\n" in head
    assert "  --openai.base_url http://127.0.0.1:8090/v1\n" in head and "--env.total_steps" in rest


def test_a_slow_run_shows_a_rate_not_zero() -> None:
    import io

    from atropos.progress import GroupProgress

    now = [0.0]
    progress = GroupProgress(total_groups=2, clock=lambda: now[0], stream=io.StringIO())
    now[0] = 60.0
    assert "  2.0 calls/min  " in progress.group_done(rollouts=2, tool_calls=2).line()
    fast = GroupProgress(clock=lambda: now[0], stream=io.StringIO())
    now[0] = 61.0
    assert "  5.0 calls/s  " in fast.group_done(rollouts=1, tool_calls=5).line()
