"""Run an env's rollouts with a scripted policy: a unit test of its task, setup and verifier."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any, TypeVar

from atroposlib.envs.base import ScoredDataGroup

from atropos.testing.scripted import Policy, scripted_server, server_configs

if TYPE_CHECKING:  # agent_env imports this package (its verifier check): no import cycle at run time
    from atropos.envs.agent_env import AgentEnv

__all__ = ["make_env", "run_group"]

E = TypeVar("E", bound="AgentEnv")


def make_env(env_cls: type[E], policy: Policy, **config: Any) -> E:
    """``env_cls`` with its own ``config_init`` defaults (``config`` overrides them), whose model is
    ``policy``: every rollout's tool calls run in real slots of a local pool, nothing else is faked.
    Call ``await env.shutdown_sandbox()`` when done (or use :func:`run_group`)."""
    defaults, _ = env_cls.config_init()
    cfg = defaults.model_copy(update={"use_wandb": False, **config})
    cls = type(f"Scripted{env_cls.__name__}", (env_cls,), {"server_cls": scripted_server(policy)})
    return cls(cfg, server_configs(), slurm=False, testing=False)


def run_group(env_cls: type[AgentEnv], policy: Policy, item: Any, **config: Any) -> ScoredDataGroup:
    """One group of ``item`` (``group_size`` rollouts) under ``policy``; the pool is stopped after.
    Raises when the group was lost (an infrastructure failure sends an item back, never scores it)."""

    async def go() -> ScoredDataGroup:
        env = make_env(env_cls, policy, **config)
        try:
            group, backlog = await env.collect_trajectories(item)
        finally:
            await env.shutdown_sandbox()
        if group is None:
            raise RuntimeError(f"the group was not scored (sent back to the backlog: {backlog!r})")
        return group

    return asyncio.run(go())
