"""What AgentEnv and its collaborators share: a rollout's result, the ``exec_tool`` a hook is given,
and the run's counters."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any

from pydantic import BaseModel

from atropos.agent.loop import (
    Finish,
)
from atropos.tools.executor import AgentToolCall, ToolOutcome

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
    # what verify_and_score_trajectory returned beside the score (JSON values): why it scored so
    info: dict[str, Any] = {}


def _new_stats() -> dict[str, float]:
    return {"rollouts": 0, "tool_calls": 0, "tool_seconds": 0.0, "score_sum": 0.0, "infra_retries": 0,
            "items_backlogged": 0, "items_rejected": 0, "group_setups": 0, "group_setup_seconds": 0.0,
            "context_budget_stops": 0, "token_tracking_fallbacks": 0, "groups_dropped_same_scores": 0}
