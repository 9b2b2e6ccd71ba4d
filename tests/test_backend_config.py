"""One backend model: the CLI, AgentEnv, tests and benchmarks map their settings onto the same
backend config (atropos/backends/config.py), so a setting or an environment variable means the
same thing whichever of them starts the pool."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any, get_args

import pytest

from atropos.backends.base import BACKEND_KINDS
from atropos.backends.config import (
    BackendConfig,
    BackendSettings,
    backend_config,
    build_backend,
    parse_backend_config,
)
from atropos.cli import ServeSettings, backend_settings, nomad_config
from atropos.envs.config import AgentEnvConfig
from atropos.envs.config import backend_settings as env_backend_settings
from atropos.errors import ConfigError, HostUnavailable
from atropos.sandbox.contract.launch import HOST_TOKEN_ENV, HostLaunch, SlotLimits

REPO = Path(__file__).resolve().parent.parent


def closed_port() -> int:
    """A port on 127.0.0.1 nothing listens on (bound, then closed)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_every_kind_has_one_config_class_and_unknown_fields_are_refused() -> None:
    classes = get_args(get_args(BackendConfig)[0])
    assert sorted(c.model_fields["kind"].default for c in classes) == sorted(BACKEND_KINDS)
    for kind in BACKEND_KINDS:
        cfg = backend_config(BackendSettings(kind=kind, pool_id="p", slots_per_host=3), environ={})
        assert cfg.kind == kind and cfg.slots_per_host == 3
        assert parse_backend_config(cfg.model_dump()) == cfg  # what a config file holds comes back the same
    with pytest.raises(ConfigError, match="imag"):
        parse_backend_config({"kind": "docker", "imag": "typo:latest"})
    with pytest.raises(ConfigError, match="kind"):
        parse_backend_config({"kind": "kubernetes"})
    with pytest.raises(ConfigError, match="slot_count"):
        backend_config(BackendSettings(kind="local", pool_id="p"), slot_count=3)


def test_agent_env_honours_nomad_addr_like_the_cli(monkeypatch: pytest.MonkeyPatch) -> None:
    address = f"http://127.0.0.1:{closed_port()}"
    monkeypatch.setenv("NOMAD_ADDR", address)
    monkeypatch.setenv("NOMAD_NAMESPACE", "rl")
    env_cfg = backend_config(env_backend_settings(AgentEnvConfig(sandbox_backend="nomad"), "train"))
    cli_cfg = nomad_config(ServeSettings(backend="nomad", pool_id="train"))
    assert (env_cfg.address, env_cfg.namespace) == (cli_cfg.address, cli_cfg.namespace) == (address, "rl")
    # an explicit address still wins over the environment, in both
    explicit = backend_config(env_backend_settings(
        AgentEnvConfig(sandbox_backend="nomad", nomad_address="http://127.0.0.1:1"), "train"))
    assert explicit.address == nomad_config(ServeSettings(pool_id="train", nomad_address="http://127.0.0.1:1")).address
    assert explicit.address == "http://127.0.0.1:1"


def test_nomad_job_id_derives_from_the_pool_id_the_same_way() -> None:
    env_cfg = backend_config(env_backend_settings(AgentEnvConfig(sandbox_backend="nomad"), "train"), environ={})
    cli_cfg = nomad_config(ServeSettings(backend="nomad", pool_id="train"))
    assert env_cfg.job_id == cli_cfg.job_id == "atropos-train"
    # two pools never share a job; the reference name sandbox_job_id still pins one
    other = backend_config(env_backend_settings(AgentEnvConfig(sandbox_backend="nomad"), "eval"), environ={})
    assert other.job_id != env_cfg.job_id
    pinned = AgentEnvConfig(sandbox_backend="nomad", sandbox_job_id="sandbox-agent")
    assert backend_config(env_backend_settings(pinned, "train"), environ={}).job_id == "sandbox-agent"


@pytest.mark.parametrize("kind", BACKEND_KINDS)
def test_max_timeout_reaches_every_backend(kind: str) -> None:
    cfg = AgentEnvConfig(sandbox_backend=kind, tool_timeout_s=77, slots_per_host=5)
    built = backend_config(env_backend_settings(cfg, "train"), environ={})
    assert (built.kind, built.max_timeout_s, built.slots_per_host) == (kind, 77, 5)


def test_docker_host_is_honoured_and_named_when_unreachable(monkeypatch: pytest.MonkeyPatch,
                                                            tmp_path: Path) -> None:
    pytest.importorskip("docker", reason="the docker SDK is not installed (pip install 'atropos-sandbox[docker]')")
    missing = f"unix://{tmp_path}/no-engine.sock"
    monkeypatch.setenv("DOCKER_HOST", missing)
    for settings in (backend_settings(ServeSettings(backend="docker", pool_id="p")),
                     env_backend_settings(AgentEnvConfig(sandbox_backend="docker"), "p")):
        backend: Any = build_backend(settings)
        with pytest.raises(HostUnavailable, match=f"Docker engine at {missing}"):
            backend.client  # noqa: B018 - connecting is the point


def test_bad_settings_are_one_config_error() -> None:
    with pytest.raises(ConfigError, match="slots_per_host"):
        backend_config(BackendSettings(kind="docker", pool_id="p", slots_per_host=5000))
    with pytest.raises(ConfigError, match="NOMAD_"):
        backend_config(BackendSettings(kind="nomad", pool_id="p"), environ={"ATROPOS_NOMAD_CPU": "many"})


def test_every_backend_launches_the_same_host_command_line() -> None:
    """Nomad's job args, Docker's container command and a local host's argv are one HostLaunch's."""
    from atropos.backends.nomad import render_job
    from atropos.backends.nomad.job import NODE_ADDRESS_ARG

    nomad = backend_config(BackendSettings(kind="nomad", pool_id="p", slots_per_host=7, max_timeout_s=9), environ={})
    args = render_job(nomad)["TaskGroups"][0]["Tasks"][0]["Config"]["args"]
    limits = SlotLimits(max_timeout_s=9, workspace_bytes=nomad.slot_workspace_bytes,
                        memory_bytes=nomad.slot_memory_bytes, pids=nomad.slot_pids, cpus=nomad.slot_cpus)
    # the token: a file in the task's secrets dir, wherever Nomad mounts it
    launch = HostLaunch(host="0.0.0.0", port=8080, slots=7, data_dir="/slots/data", limits=limits,
                        cgroup_dir="/run/atropos/cgroup", token_file="${NOMAD_SECRETS_DIR}/token")
    assert args == [*launch.args(), NODE_ADDRESS_ARG]  # the node's address: Nomad fills it in
    assert "--slots=7" in args and "--max-timeout=9" in args
    assert HostLaunch(slots=1, data_dir="/d").argv()[:3] == [
        sys.executable, "-m", "atropos.sandbox"]
    assert HOST_TOKEN_ENV == "ATROPOS_SANDBOX_TOKEN"  # what a host run by hand takes (sandbox_image/README.md)


@pytest.mark.timeout(300)
def test_agent_env_cluster_failure_is_one_clear_line(tmp_path: Path) -> None:
    """Under an AgentEnv on the nomad backend: NOMAD_ADDR is the address dialled, and a cluster that
    does not answer ends the run with one ``error:`` line (exit 3), not chained tracebacks."""
    from atropos.agent.model import default_gguf_path, ensure_tokenizer_dir

    if not default_gguf_path().exists():
        pytest.skip("the model file is missing: run `python3 scripts/model_server.py ensure --model-only`")
    address = f"http://127.0.0.1:{closed_port()}"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("NOMAD_", "ATROPOS_NOMAD_"))}
    env.update(HF_HUB_OFFLINE="1", WANDB_MODE="disabled", ATROPOS_TOKENIZER_DIR=str(ensure_tokenizer_dir()),
               PYTHONPATH=str(REPO), NOMAD_ADDR=address)
    proc = subprocess.run(
        [sys.executable, "-m", "tests.scripted_env", "process", "--env.total_steps", "1", "--env.group_size", "2",
         "--env.sandbox_backend", "nomad", "--env.data_path_to_save_groups", str(tmp_path / "g.jsonl")],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=280)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert proc.returncode == 3, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert len(errors) == 1 and f"cannot reach Nomad at {address}" in errors[0], proc.stderr[-3000:]


def test_ray_settings_come_from_the_environment_and_settings_win() -> None:
    environ = {"ATROPOS_RAY_NUM_CPUS": "2", "ATROPOS_RAY_RESOURCE": "sandbox_nodes", "ATROPOS_RAY_ADDRESS": "h:1"}
    cfg = backend_config(BackendSettings(kind="ray", pool_id="p"), environ=environ)
    assert (cfg.num_cpus, cfg.resource, cfg.address, cfg.pool_id) == (2.0, "sandbox_nodes", "h:1", "p")
    cli_cfg = backend_config(backend_settings(ServeSettings(backend="ray", pool_id="p", ray_address="127.0.0.1:6379")),
                             environ=environ)
    assert cli_cfg.address == "127.0.0.1:6379"  # a setting wins over the environment
    with pytest.raises(ConfigError, match="ATROPOS_RAY_"):
        backend_config(BackendSettings(kind="ray", pool_id="p"), environ={"ATROPOS_RAY_NUM_CPUS": "lots"})

