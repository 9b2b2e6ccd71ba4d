"""``serve`` of an AgentEnv against atroposlib's run-api (issue 28, item 2): SIGTERM ends it cleanly
(every group's slots released before the pool stops), it stops by itself once the trainer has taken
``total_steps`` batches, it runs only the groups one trainer batch needs at once, it warns when model
turns are too slow for ``worker_timeout``, and a run-api left over from an earlier run is said and
cannot feed the guide's trainer its groups. Real run-api, real local pool, a fake model server."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from conftest import free_port, wait_for_http

pytest.importorskip("atroposlib")

from test_write_an_environment import blocks  # the guide's own trainer

from atropos.envs.serve_pace import TurnPace, default_max_workers
from atropos.testing import FakeChatServer

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

REPO = Path(__file__).resolve().parent.parent
RUN_API = Path(sys.executable).parent / "run-api"
STALE = 0.25  # the score of an earlier run's groups: no rollout here scores it


@pytest.fixture
def api(tmp_path: Path) -> Iterator[str]:
    """A fresh run-api on a free port."""
    port = free_port()
    proc = subprocess.Popen([str(RUN_API), "--host", "127.0.0.1", "--port", str(port)],
                            stdout=subprocess.DEVNULL, stderr=open(tmp_path / "run-api.log", "w"))
    base = f"http://127.0.0.1:{port}"
    try:
        wait_for_http(base + "/status", proc)
        yield base
    finally:
        proc.terminate()
        proc.wait(30)


def register_trainer(api: str, batch_size: int, steps: int) -> None:
    """A trainer's HTTP side, as in the guide: register, then ask for a batch (which lets envs register)."""
    httpx.post(api + "/register", json={
        "wandb_group": "t", "wandb_project": "t", "batch_size": batch_size, "max_token_len": 8192,
        "checkpoint_dir": "checkpoints", "save_checkpoint_interval": 100, "starting_step": 0, "num_steps": steps,
    }, timeout=10).raise_for_status()
    assert httpx.get(api + "/batch", timeout=10).json()["batch"] is None


def wait_for_batch(api: str, env: subprocess.Popen[str], log: Path) -> list[dict[str, Any]]:
    deadline = time.monotonic() + 600
    while True:
        batch = httpx.get(api + "/batch", timeout=10).json()["batch"]
        if batch is not None:
            return list(batch)
        assert env.poll() is None, "the env exited before a batch arrived:\n" + log.read_text()[-4000:]
        assert time.monotonic() < deadline, "no batch within 10 minutes:\n" + log.read_text()[-4000:]
        time.sleep(0.3)


def start_env(tmp_path: Path, api: str, model_url: str, tokenizer_dir: str, *flags: str) -> subprocess.Popen[str]:
    """The coding example in serve mode (stdout and stderr to files: a PIPE nobody reads fills up)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("WANDB", "ATROPOS_MODEL_"))}
    env.update(HF_HUB_OFFLINE="1", ATROPOS_TOKENIZER_DIR=tokenizer_dir, PYTHONPATH=str(REPO), WANDB_MODE="disabled")
    return subprocess.Popen(
        [sys.executable, "-m", "atropos.envs.examples.coding", "serve", "--openai.base_url", model_url,
         "--openai.model_name", "fake", "--env.rollout_server_url", api, "--env.group_size", "2",
         "--env.slots_per_host", "8", "--env.max_hosts", "1", "--env.worker_timeout", "600", *flags],
        cwd=tmp_path, env=env, stdout=open(tmp_path / "env.out", "w"), stderr=open(tmp_path / "env.err", "w"),
        text=True)


def stop(proc: subprocess.Popen[str]) -> None:
    if proc.poll() is None:
        proc.terminate()  # SIGTERM: the env stops its pool
        try:
            proc.wait(120)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def assert_clean(err: str) -> None:
    """No worker of the run failed after the pool went (``'NoneType' object has no attribute
    'release'`` before the fix) and no traceback."""
    assert "NoneType" not in err and "Error in collect_trajectories" not in err, err[-4000:]
    assert "Traceback" not in err, err[-4000:]


def test_sigterm_mid_run_releases_every_group_before_the_pool_stops(tokenizer_dir: str, api: str,
                                                                   tmp_path: Path) -> None:
    release = threading.Event()

    def stuck(messages: list[dict[str, Any]]) -> str:
        release.wait(300)  # every rollout is mid-turn when the env is stopped
        return "Done."

    register_trainer(api, batch_size=4, steps=2)
    with FakeChatServer(stuck) as server:
        env = start_env(tmp_path, api, server.base_url, tokenizer_dir)
        try:
            deadline = time.monotonic() + 300
            while len(server.requests) < 4:  # both groups' rollouts hold slots and wait for the model
                assert env.poll() is None, (tmp_path / "env.err").read_text()[-4000:]
                assert time.monotonic() < deadline, "the env never asked the model"
                time.sleep(0.2)
            env.send_signal(signal.SIGTERM)
            env.wait(120)
        finally:
            release.set()
            stop(env)
    err, out = (tmp_path / "env.err").read_text(), (tmp_path / "env.out").read_text()
    assert env.returncode == 128 + signal.SIGTERM, err[-4000:]
    assert "stopped by SIGTERM; the sandbox pool is down" in err
    assert_clean(err)
    assert "[atropos-sandbox] pool: backend local" in out and "0 host(s) lost" in out, out[-3000:]


def test_serve_stops_by_itself_once_the_trainer_has_its_steps(tokenizer_dir: str, api: str, tmp_path: Path) -> None:
    """Before the fix the env waited for one more batch in the queue that nobody takes: here the
    model answers only the first task until the trainer has its batch, then never again, so an env
    that keeps working after ``total_steps`` never ends."""
    taken, release = threading.Event(), threading.Event()

    def first_task_only(messages: list[dict[str, Any]]) -> str:
        if "`add(" not in messages[1]["content"] or taken.is_set():
            release.wait(300)
        return "Done."

    register_trainer(api, batch_size=2, steps=1)
    with FakeChatServer(first_task_only) as server:
        env = start_env(tmp_path, api, server.base_url, tokenizer_dir, "--env.total_steps", "1")
        try:
            batch = wait_for_batch(api, env, tmp_path / "env.err")
            taken.set()
            assert len(batch) == 1 and len(batch[0]["tokens"]) == 2
            try:
                env.wait(180)  # a bound for a loaded machine, not a timing assert: it never ends if broken
            except subprocess.TimeoutExpired:
                pytest.fail("serve kept running after the trainer took total_steps batches:\n"
                            + (tmp_path / "env.err").read_text()[-4000:])
        finally:
            release.set()
            stop(env)
    err, out = (tmp_path / "env.err").read_text(), (tmp_path / "env.out").read_text()
    assert env.returncode == 0, err[-4000:]
    assert "the trainer has taken 1 batch(es) (total_steps): stopping" in err
    assert_clean(err)
    assert "[atropos-sandbox] pool: backend local" in out


def test_serve_runs_the_groups_of_one_batch_at_once(tokenizer_dir: str, api: str, tmp_path: Path) -> None:
    """atroposlib's default ran 6 groups of 2 at once here (8 per server, capped by 3 batches
    off-policy), and on a model server that answers a few requests at a time none finished within
    worker_timeout. The default is now the groups of one trainer batch: 4 / 2 = 2 groups, so the
    model never has more than 4 rollouts asking at once."""
    lock = threading.Lock()
    asking = [0, 0]  # now, most ever

    def counting(messages: list[dict[str, Any]]) -> str:
        with lock:
            asking[0] += 1
            asking[1] = max(asking)
        time.sleep(0.5)  # long enough that every rollout the env started asks at the same time
        with lock:
            asking[0] -= 1
        return "Done."

    register_trainer(api, batch_size=4, steps=1)
    with FakeChatServer(counting) as server:
        env = start_env(tmp_path, api, server.base_url, tokenizer_dir, "--env.total_steps", "1")
        try:
            batch = wait_for_batch(api, env, tmp_path / "env.err")
            most = asking[1]
            env.wait(180)
        finally:
            stop(env)
    err = (tmp_path / "env.err").read_text()
    assert sum(len(g["tokens"]) for g in batch) == 4
    assert "serve: up to 2 group(s) of 2 at once" in err, err[-4000:]
    assert 2 <= most <= 4, f"{most} rollouts asked the model at once"
    assert "warning: a model turn takes" not in err  # 0.5 s turns are in time for 600 s


def test_serve_warns_when_model_turns_cannot_finish_within_worker_timeout(tokenizer_dir: str, api: str,
                                                                          tmp_path: Path) -> None:
    lock = threading.Lock()

    def one_at_a_time(messages: list[dict[str, Any]]) -> str:
        with lock:  # as llama.cpp's Python server: one request at a time
            time.sleep(0.5)
        return "Done."

    register_trainer(api, batch_size=4, steps=2)
    with FakeChatServer(one_at_a_time) as server:
        # 20 turns of >= 0.5 s each may need >= 10 s: more than a 5 s worker_timeout
        env = start_env(tmp_path, api, server.base_url, tokenizer_dir, "--env.worker_timeout", "5",
                        "--env.agent_max_steps", "20")
        try:
            deadline = time.monotonic() + 300
            while "warning: a model turn takes" not in (tmp_path / "env.err").read_text():
                assert env.poll() is None, (tmp_path / "env.err").read_text()[-4000:]
                assert time.monotonic() < deadline, "no warning:\n" + (tmp_path / "env.err").read_text()[-4000:]
                time.sleep(0.3)
            env.send_signal(signal.SIGTERM)
            env.wait(120)
        finally:
            stop(env)
    err = (tmp_path / "env.err").read_text()
    line = next(line for line in err.splitlines() if "warning: a model turn takes" in line)
    assert re.search(r"with [12] group\(s\) of 2 at once, so a rollout of up to 20 turns \(agent_max_steps\) "
                     r"needs up to \d+ s, more than worker_timeout \(5 s\)", line), line
    assert "Lower --env.max_num_workers (now 2)" in line and err.count("warning: a model turn takes") == 1


def test_the_default_groups_at_once_are_one_batch_capped_by_the_pool_and_atroposlib() -> None:
    one = {"group_size": 2, "atroposlib_default": 8, "pool_slots": 64}
    assert default_max_workers(batch_size=4, **one) == 2  # the guide: one batch of 4 is 2 groups of 2
    assert default_max_workers(batch_size=5, **one) == 3  # a partial group still needs a worker
    assert default_max_workers(batch_size=1024, **one) == 8  # a large batch: atroposlib's own default
    assert default_max_workers(batch_size=1024, group_size=16, atroposlib_default=8, pool_slots=32) == 2  # slots
    assert default_max_workers(batch_size=4, group_size=8, atroposlib_default=8, pool_slots=4) == 1  # never 0
    assert default_max_workers(batch_size=-1, **one) == 8  # no batch size from the trainer: atroposlib's


def test_the_pace_warning_needs_a_few_turns_and_is_said_once() -> None:
    pace = TurnPace()
    args = {"max_steps": 10, "worker_timeout": 600.0, "groups_running": 6, "group_size": 2, "max_workers": 8}
    pace.add(100.0)
    assert pace.warning(**args) is None  # one turn (a cold model server) proves nothing
    pace.add(50.0)
    assert pace.warning(**{**args, "worker_timeout": 0.0}) is None  # no timeout: nothing is cancelled
    said = pace.warning(**args)  # median 75 s x 10 turns = 750 s > 600 s
    assert said is not None and "needs up to 750 s, more than worker_timeout (600 s)" in said
    assert pace.warning(**args) is None
    fast = TurnPace()
    for _ in range(5):
        fast.add(59.0)
    assert fast.warning(**args) is None  # 590 s: in time


def _post_stale_groups(api: str, n: int) -> None:
    for _ in range(n):
        httpx.post(api + "/scored_data", json={"tokens": [[1, 2], [1, 2]], "masks": [[-100, 2], [-100, 2]],
                                               "scores": [STALE, STALE]}, timeout=10).raise_for_status()


def test_a_leftover_run_api_is_said_and_cannot_feed_the_guides_trainer(tokenizer_dir: str, api: str,
                                                                        tmp_path: Path) -> None:
    """An earlier run left groups in run-api (its env outlived its trainer). A trainer that just
    registers gets them first; the env says so. The guide's trainer says so too, and starts clean."""
    register_trainer(api, batch_size=4, steps=2)
    _post_stale_groups(api, 3)

    def done(messages: list[dict[str, Any]]) -> str:
        return "Done."  # the coding env scores this 0: never the stale score

    with FakeChatServer(done) as server:
        # 1. a trainer that only registers: the env warns (the trainer would get the stale groups)
        httpx.post(api + "/register", json={
            "wandb_group": "t", "wandb_project": "t", "batch_size": 4, "max_token_len": 8192, "checkpoint_dir": "c",
            "save_checkpoint_interval": 100, "starting_step": 0, "num_steps": 1}, timeout=10).raise_for_status()
        env = start_env(tmp_path, api, server.base_url, tokenizer_dir, "--env.total_steps", "1")
        try:
            deadline = time.monotonic() + 300
            while "already holds" not in (tmp_path / "env.err").read_text():
                assert env.poll() is None, (tmp_path / "env.err").read_text()[-4000:]
                assert time.monotonic() < deadline, "no warning:\n" + (tmp_path / "env.err").read_text()[-4000:]
                time.sleep(0.3)
        finally:
            stop(env)
        warning = next(line for line in (tmp_path / "env.err").read_text().splitlines() if "already holds" in line)
        assert "already holds 3 group(s) and is at step 0 before this env sent anything" in warning, warning
        assert "/reset_data" in warning
        # 2. the guide's trainer, against the same leftover run-api
        _post_stale_groups(api, 2)
        trainer_src = next(body for lang, info, body in blocks() if info == "file=trainer.py")
        (tmp_path / "trainer.py").write_text(trainer_src.replace("http://127.0.0.1:8000", api))
        trainer = subprocess.Popen([sys.executable, "trainer.py", "1"], cwd=tmp_path,
                                   stdout=open(tmp_path / "trainer.log", "w"), stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + 60
            while "reset" not in (tmp_path / "trainer.log").read_text():
                assert time.monotonic() < deadline, (tmp_path / "trainer.log").read_text()
                time.sleep(0.2)
            (tmp_path / "env.err").unlink()
            env = start_env(tmp_path, api, server.base_url, tokenizer_dir, "--env.total_steps", "1")
            trainer.wait(600)
            env.wait(180)
        finally:
            stop(env)
            if trainer.poll() is None:
                trainer.kill()
                trainer.wait()
    log = (tmp_path / "trainer.log").read_text()
    assert re.search(r"run-api held \d+ group\(s\) at step \d+ from an earlier run", log), log
    steps = [line for line in log.splitlines() if line.startswith("step ")]
    assert len(steps) == 1 and "2 groups" in steps[0] and str(STALE) not in steps[0], log
    err = (tmp_path / "env.err").read_text()
    assert "already holds" not in err and env.returncode == 0, err[-4000:]
