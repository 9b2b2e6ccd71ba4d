"""``AgentEnvConfig``: an atroposlib ``BaseEnvConfig`` plus where sandboxes run and how the agent behaves.

Every field is a ``--env.<name>`` flag of ``python -m your_env process|serve|evaluate``. The names
of the reference AgentEnv (hermes-agent's ``tool_pool_mode``, ``slots_per_container``, ...) are
accepted as aliases, so configs written for it keep working.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any, Literal

from atroposlib.envs.base import APIServerConfig, BaseEnvConfig
from pydantic import BaseModel, Field, ValidationError, model_validator

from atropos.backends.base import BACKEND_KINDS, BackendKind
from atropos.errors import validation_message
from atropos.tools.registry import DEFAULT_TOOLSETS

if TYPE_CHECKING:
    from atropos.backends.config import BackendSettings

MODEL_URL_ENV = "ATROPOS_MODEL_URL"
MODEL_NAME_ENV = "ATROPOS_MODEL_NAME"

# reference name -> our name
ALIASES: dict[str, str] = {
    "tool_pool_mode": "sandbox_backend",
    "slots_per_container": "slots_per_host",
    "min_containers": "min_hosts",
    "max_containers": "max_hosts",
    "sandbox_job_id": "nomad_job_id",
}


class AgentEnvConfig(BaseEnvConfig):
    # BaseEnvConfig's 2048 cannot hold a tool-using agent: the tool schemas alone take ~1-1.5k tokens.
    max_token_length: int = Field(4096, description="context budget of a trajectory (prompt + completions)")
    verifier_check: bool = Field(True, description="process mode: first verify each task family's reference "
                                                  "solution (must score 1) and starting stub (must score 0) "
                                                  "in a slot, shown in the summary and the HTML report")
    # BaseEnvConfig's True drops every group whose scores are all equal, so a weak model's all-zero
    # groups vanish from the jsonl and the trainer without a trace; an agent env keeps them unless asked.
    ensure_scores_are_not_same: bool = Field(
        False, description="drop groups whose scores are all equal (they carry no GRPO advantage); "
                           "dropped groups are counted in the run summary")
    # where sandboxes run
    sandbox_backend: BackendKind = Field("local", description=" | ".join(BACKEND_KINDS))
    slots_per_host: int = Field(16, ge=1, description="slots per sandbox host (process or container)")
    min_hosts: int = Field(1, ge=0, description="hosts kept running")
    max_hosts: int = Field(4, ge=1, description="most hosts the pool scales to")
    sandbox_image: str = Field("atropos-sandbox:dev", description="docker/nomad: sandbox image")
    nomad_address: str | None = Field(None, description="nomad: agent address (default $NOMAD_ADDR, else "
                                                        "http://127.0.0.1:4646)")
    nomad_job_id: str | None = Field(None, description="nomad: job id (default atropos-<pool id>, as the CLI)")
    ray_address: str | None = Field(None, description="ray: cluster address (default $RAY_ADDRESS, else a Ray "
                                                      "started in this process)")
    acquire_timeout_s: float = Field(600.0, gt=0, description="wait for a group's slots")
    # policy
    allow_network: bool = Field(False, description="let sandbox commands reach the network")
    tool_timeout_s: float = Field(120.0, gt=0, description="largest per-call timeout the model may choose")
    infra_retries: int = Field(2, ge=0, description="retries of a rollout that failed for an infrastructure reason")
    # batching
    tool_batch_window_ms: float = Field(20.0, ge=0, description="ToolExecutor batching window (ms)")
    tool_max_batch_size: int = Field(200, ge=1, description="ToolExecutor maximum batch size")
    # agent
    agent_max_steps: int = Field(20, ge=1, description="max model turns per trajectory")
    agent_temperature: float = Field(0.7, ge=0, description="sampling temperature")
    agent_max_tokens: int = Field(512, ge=1, description="max tokens per model turn")
    tool_call_grammar: bool = Field(
        False, description="send a GBNF grammar that forces well-formed <tool_call> JSON (llama.cpp servers)")
    grammar_forced_tool_turns: int = Field(
        0, ge=0, description="with the grammar: the first N turns must be tool calls (small models otherwise "
                             "answer at once)")
    # tokens for training
    token_source: Literal["auto", "managed", "chat_template"] = Field(
        "auto", description="managed: atroposlib ManagedServer (sampled ids + logprobs; vllm/sglang servers); "
                            "chat_template: re-render the conversation; auto: managed when every server can")
    tool_parser: str = Field("hermes", description="ManagedServer tool parser (BaseEnv never sets one)")
    # tools
    enabled_toolsets: list[str] = Field(default_factory=lambda: list(DEFAULT_TOOLSETS))
    disabled_toolsets: list[str] = Field(default_factory=list)
    tool_server_url: str | None = Field(
        None, description="ToolServer for external tools; 'inprocess' runs one in this process (offline corpus)")
    tool_server_token: str | None = Field(None, description="bearer token of the ToolServer")
    # the reference AgentEnv's names (see ALIASES); applied to our fields, then cleared
    tool_pool_mode: BackendKind | None = Field(None, description="alias of sandbox_backend")
    slots_per_container: int | None = Field(None, ge=1, description="alias of slots_per_host")
    min_containers: int | None = Field(None, ge=0, description="alias of min_hosts")
    max_containers: int | None = Field(None, ge=1, description="alias of max_hosts")
    sandbox_job_id: str | None = Field(None, description="alias of nomad_job_id")

    @model_validator(mode="after")
    def _apply_aliases(self) -> AgentEnvConfig:
        # atroposlib's CLI rebuilds the config from model_dump() plus the flags, so our own field
        # is always "set" there: an alias that is given wins. It is cleared afterwards so a dump
        # and re-validation (the CLI does both) cannot apply a stale alias over a later change.
        for alias, field in ALIASES.items():
            value = getattr(self, alias)
            if value is not None:
                setattr(self, field, value)
                setattr(self, alias, None)
        if self.min_hosts > self.max_hosts:
            raise ValueError(f"min_hosts ({self.min_hosts}) > max_hosts ({self.max_hosts})")
        return self


def backend_settings(cfg: AgentEnvConfig, pool_id: str) -> BackendSettings:
    """What an AgentEnv's fields say about the backend, mapped as the CLI maps its settings
    (atropos.backends.config): NOMAD_* apply, the Nomad job id derives from the pool id, the
    largest tool timeout reaches every backend."""
    from atropos.backends.config import BackendSettings

    return BackendSettings(kind=cfg.sandbox_backend, pool_id=pool_id, slots_per_host=cfg.slots_per_host,
                           max_timeout_s=cfg.tool_timeout_s, image=cfg.sandbox_image,
                           nomad_address=cfg.nomad_address, nomad_job_id=cfg.nomad_job_id,
                           ray_address=cfg.ray_address)


def default_server_configs(model_name: str = "default", base_url: str = "http://127.0.0.1:8090/v1",
                           **extra: Any) -> list[APIServerConfig]:
    """One OpenAI-compatible server, as a LIST: a bare config or a ``ServerBaseline`` makes atroposlib
    ignore ``--openai.*`` and talk to localhost:9004-9007 instead. ``$ATROPOS_MODEL_NAME`` and
    ``$ATROPOS_MODEL_URL`` override the given defaults; ``extra`` goes to ``APIServerConfig`` as is."""
    return [APIServerConfig(
        model_name=os.environ.get(MODEL_NAME_ENV, model_name),
        base_url=os.environ.get(MODEL_URL_ENV, base_url),
        api_key="local", server_type="openai", timeout=120, health_check=False, **extra,
    )]


def wandb_requested(argv: list[str], default: bool) -> bool:
    """Whether the command line (``--env.use_wandb true``) or its ``--config`` YAML (``env: {use_wandb:
    true}``) asks for wandb; else ``default`` (the env's ``config_init``). The flag wins over the YAML,
    as in atroposlib's own merge."""
    flag = _flag_value(argv, "--env.use_wandb")
    if flag is not None:
        return _truthy(flag)
    path = _flag_value(argv, "--config")
    if path:
        import yaml

        try:
            with open(path) as fh:
                env = (yaml.safe_load(fh) or {}).get("env") or {}
        except (OSError, yaml.YAMLError, AttributeError):
            env = {}  # atroposlib reports a bad config file itself
        if isinstance(env, dict) and "use_wandb" in env:
            return _truthy(env["use_wandb"])
    return default


def _flag_value(argv: list[str], flag: str) -> str | None:
    for i, arg in enumerate(argv):
        if arg == flag and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith(flag + "="):
            return arg.split("=", 1)[1]
    return None


def _truthy(value: Any) -> bool:
    return str(value).strip().lower() in ("1", "true", "yes", "on")


def settings_problem(exc: ValidationError, config_cls: type[BaseModel]) -> str | None:
    """A bad ``--env.*`` / ``--openai.*`` value as one line (what is wrong and what was given), or
    None when ``exc`` is not about the run's settings (a bug elsewhere keeps its traceback)."""
    if exc.title not in {config_cls.__name__, AgentEnvConfig.__name__, APIServerConfig.__name__, "ServerBaseline"}:
        return None
    return f"invalid settings ({exc.title}): {validation_message(exc, exc.title, given=True)}"
