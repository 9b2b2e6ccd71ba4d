"""AgentEnv's state and the hooks a subclass implements (``build_task``, ``score_trajectory`` or
``verify_and_score_trajectory``, the workspace setup steps, ``verifier_checks``, ``eval_items``).
The parts of AgentEnv build on each other in a line: ``AgentEnvCli`` (env_cli.py) ->
``AgentEnvBase`` (here) -> ``SandboxEnv`` (env_sandbox.py: pool, run lifecycle, summary) ->
``RolloutEnv`` (env_rollout.py: one rollout) -> ``AgentEnv`` (agent_env.py: groups, evaluation)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from pydantic import BaseModel

from atropos.agent.loop import (
    AgentResult,
    Finish,
    hermes_system_prompt,
)
from atropos.agent.managed import servers_give_token_ids
from atropos.agent.tokens import template_wraps_tool_responses
from atropos.backends.base import Backend
from atropos.backends.config import BackendSettings
from atropos.envs.config import AgentEnvConfig, backend_settings
from atropos.envs.env_cli import AgentEnvCli
from atropos.envs.serve_pace import TurnPace
from atropos.envs.verifier_check import (
    VerifierCheck,
    VerifierCheckResult,
)
from atropos.errors import ConfigError
from atropos.progress import GroupProgress
from atropos.slots.lease import Lease
from atropos.slots.pool import SlotPool
from atropos.tools.executor import AgentToolCall, ToolExecutor, ToolOutcome
from atropos.tools.registry import ToolRegistry

log = logging.getLogger("atropos.envs.agent_env")


ExecTool = Callable[[AgentToolCall], Awaitable[ToolOutcome]]


class Rollout(BaseModel):
    """One scored trajectory, ready to go into a ``ScoredDataGroup``."""

    tokens: list[int]
    masks: list[int]
    score: float
    messages: list[dict[str, Any]]
    logprobs: list[float] | None = None  # only with sampled ids (ManagedServer); never placeholders
    finish: Finish = "final"
    tool_calls: int = 0
    sandbox_seconds: float = 0.0
    tracking_fallback: bool = False


def _new_stats() -> dict[str, float]:
    return {"rollouts": 0, "tool_calls": 0, "tool_seconds": 0.0, "score_sum": 0.0, "infra_retries": 0,
            "items_backlogged": 0, "group_setups": 0, "group_setup_seconds": 0.0, "context_budget_stops": 0,
            "token_tracking_fallbacks": 0, "groups_dropped_same_scores": 0}


class AgentEnvBase(AgentEnvCli):
    env_config_cls = AgentEnvConfig
    system_preamble: str = "You are an agent working in a Linux sandbox. Your workspace is /workspace."

    def __init__(self, config: AgentEnvConfig, server_configs: Any, slurm: bool = False, testing: bool = False):
        super().__init__(config, server_configs, slurm, testing)
        self.config: AgentEnvConfig = config
        if not config.wandb_name and self.name:
            config.wandb_name = self.name  # serve mode's /register-env refuses a missing name (422)
        # BaseEnv never hands tool_parser to its ServerManager; ManagedServer reads it from there.
        self.server.tool_parser = config.tool_parser
        self.tools = ToolRegistry.default(with_web=bool(config.tool_server_url)).select(
            config.enabled_toolsets + (["web"] if config.tool_server_url else []), config.disabled_toolsets)
        self.managed_tokens = self._decide_token_source()
        self.wrap_tool_responses = not template_wraps_tool_responses(self.tokenizer)
        self.pool: SlotPool | None = None
        self.executor: ToolExecutor | None = None
        self.stats = _new_stats()
        self.eval_stats = _new_stats()  # kept apart: eval rollouts must not move training metrics
        self._process_mode = False
        self._serve_mode = False
        self._rollout_tasks: set[asyncio.Task[Any]] = set()  # serve: BaseEnv's group workers still running
        self.pace = TurnPace()  # serve: model turn latencies vs worker_timeout
        self._lost_in_a_row = 0
        self._grammars: dict[bool, str] = {}  # turn_grammar's two grammars, by allow_answer
        self.progress = GroupProgress()  # one stderr line per scored group (long runs show they move)
        self.verifier_results: list[VerifierCheckResult] = []

    def _decide_token_source(self) -> bool:
        source = self.config.token_source
        if source == "chat_template":
            return False
        able = servers_give_token_ids(getattr(self.server, "servers", []))
        if source == "managed" and not able:
            raise ConfigError("token_source='managed' needs inference servers that return token ids "
                              "(APIServerConfig.server_type 'vllm' or 'sglang')")
        if able and self.config.tool_call_grammar:
            log.warning("tool_call_grammar is a llama.cpp feature; ignored with ManagedServer (vllm/sglang)")
        return able

    def build_task(self, item: Any) -> str:
        """The user message that states the task."""
        raise NotImplementedError

    async def score_trajectory(self, item: Any, final_response: str) -> float:
        """Score from the final answer alone (override ``verify_and_score_trajectory`` to look at the slot)."""
        raise NotImplementedError

    async def setup_agent_env(self) -> None:
        """Env-specific setup, once, after the pool is up (the reference AgentEnv's hook). Default: nothing."""

    async def setup_group_workspace(self, item: Any, *, trajectory_id: str, exec_tool: ExecTool,
                                    lease: Lease) -> dict[str, Any]:
        """Prepare the workspace once per item (clone a repo, install dependencies) in one slot of
        the group; every rollout of the group then starts from a copy-on-write fork of the result
        (a template made from that slot). Override it to use it; by default there is no group step.
        ``setup_trajectory_workspace`` still runs afterwards in each rollout's own slot."""
        return {}

    def has_group_setup(self) -> bool:
        """Whether the subclass overrides ``setup_group_workspace`` (then groups fork a template)."""
        return type(self).setup_group_workspace is not AgentEnvBase.setup_group_workspace

    async def setup_trajectory_workspace(self, item: Any, *, trajectory_id: str, exec_tool: ExecTool,
                                         lease: Lease) -> dict[str, Any]:
        """Prepare the slot before the agent starts (write fixtures, clone a repo). Default: nothing."""
        return {}

    async def verify_and_score_trajectory(self, item: Any, final_response: str, *, trajectory_id: str,
                                          exec_tool: ExecTool, lease: Lease,
                                          agent_result: AgentResult) -> tuple[float, dict[str, Any]]:
        """Verify the slot's final workspace and score. Default: ``score_trajectory``.

        It runs in the slot's verification phase: the lease is sealed (every process of the agent
        killed; commands and writes refused). Read the workspace with ``lease.read_file`` or, to
        run anything (hidden tests, a checker), use ``lease.verify(program, secrets=...)``: a
        fresh read-only sandbox whose verdict the agent's code cannot forge (docs/verification.md)."""
        return await self.score_trajectory(item, final_response), {}

    def verifier_checks(self) -> list[VerifierCheck]:
        """One item per task family with its reference solution (a scripted policy, see
        ``atropos.testing``): a process run first shows the verifier scoring each reference 1 and
        each untouched starting state 0, in a slot. Default: none (no check)."""
        return []

    def eval_items(self) -> list[Any]:
        """Held-out items for ``evaluate`` (default: none; override to enable evaluation)."""
        return []

    def system_prompt(self) -> str:
        """``system_preamble`` plus the tool schemas in Hermes format; override to change the prompt."""
        return hermes_system_prompt(self.tools.schemas(), self.system_preamble)

    def build_backend(self) -> Backend:
        from atropos.backends.config import build_backend

        return build_backend(self.backend_settings())

    def backend_settings(self) -> BackendSettings:
        """What this env's fields say about the backend (kind, pool id, slots, image, cluster
        addresses), mapped exactly as the CLI maps its settings; ``build_backend`` builds from it."""
        return backend_settings(self.config, self.build_backend_pool_id())

    def build_backend_pool_id(self) -> str:
        return "".join(ch if ch.isalnum() or ch in "_.-" else "-" for ch in
                       f"env-{self.config.wandb_name or type(self).__name__}")[:60]
