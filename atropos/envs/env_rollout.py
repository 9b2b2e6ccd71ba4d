"""One rollout of an AgentEnv in one slot: workspace setup, the agent loop within the context
budget, the slot sealed before verification, tokens and masks; retried on a fresh slot after an
infrastructure failure; and the group step that makes a template every rollout forks. A collaborator
of AgentEnv (``env.rollouts``): it owns no state of its own and calls the env's hooks, so a subclass's
overrides (``rollout``, ``chat``, the workspace and scoring hooks) are the ones that run."""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from typing import TYPE_CHECKING, Any

from atropos.agent.errors import TokenTrackingError, is_infrastructure
from atropos.agent.loop import (
    AgentConfig,
    AgentResult,
    ToolsFn,
    run_agent,
)
from atropos.agent.managed import ManagedSession, TrackedSequence
from atropos.agent.tokens import IGNORE, count_prompt_tokens, tokenize_conversation
from atropos.envs.env_base import Rollout
from atropos.envs.score_info import json_safe
from atropos.slots.lease import Lease, PoolTemplate
from atropos.tools.executor import AgentToolCall, ToolOutcome

if TYPE_CHECKING:
    from atropos.envs.agent_env import AgentEnv

log = logging.getLogger("atropos.envs.agent_env")


class RolloutRunner:
    """Runs rollouts for ``env``: reads its config, pool and executor, calls its hooks."""

    def __init__(self, env: AgentEnv) -> None:
        self.env = env

    async def prepare_group(self, item: Any, leases: list[Lease],
                            stats: dict[str, float] | None = None) -> PoolTemplate | str:
        """Run ``setup_group_workspace`` in the group's first slot, make a template of it (that slot
        continues as a fork of it) and fork the other slots from it. On an image root the whole
        root is the group's start: an image derived from the first slot (a reference, str), the
        root of the others."""
        assert self.env.pool is not None and self.env.executor is not None
        executor, setup = self.env.executor, leases[0]
        tid = setup.trajectory_id
        t0 = time.perf_counter()
        executor.bind(tid, setup)
        try:
            async def exec_tool(call: AgentToolCall) -> ToolOutcome:
                return await executor.execute(tid, call)

            await self.env.setup_group_workspace(item, trajectory_id=tid, exec_tool=exec_tool, lease=setup)
        finally:
            executor.unbind(tid)
        if setup.image is not None:
            derived = await setup.derive_image()
            try:
                await asyncio.gather(*(lease.reset(image=derived) for lease in leases[1:]))
            except BaseException:
                await asyncio.gather(*(self.env.pool.release(lease) for lease in leases), return_exceptions=True)
                raise
            self._count_group(stats, t0)
            return derived
        template = await self.env.pool.template_from_lease(setup, name=f"group-{tid.rsplit('-', 1)[0]}")
        try:
            await asyncio.gather(*(self.env.pool.fork(lease, template) for lease in leases[1:]))
        except BaseException:
            await asyncio.gather(*(self.env.pool.release(lease) for lease in leases), return_exceptions=True)
            await self.env.pool.delete_template(template)
            raise
        self._count_group(stats, t0)
        log.debug("group %s: setup + template + %d forks in %.2fs", tid, len(leases) - 1, time.perf_counter() - t0)
        return template

    def _count_group(self, stats: dict[str, float] | None, t0: float) -> None:
        stats = self.env.stats if stats is None else stats
        stats["group_setups"] += 1
        stats["group_setup_seconds"] += time.perf_counter() - t0

    async def with_retries(self, item: Any, lease: Lease, template: PoolTemplate | str | None,
                          stats: dict[str, float]) -> Rollout:
        """``rollout`` in ``lease``; after an infrastructure failure again from scratch in a fresh slot
        (the old one's workspace is half-done or gone), up to ``infra_retries`` times."""
        assert self.env.pool is not None
        current = lease
        try:
            for attempt in range(self.env.config.infra_retries + 1):
                try:
                    return await self.env.rollout(item, current)
                except Exception as exc:
                    if not is_infrastructure(exc) or attempt == self.env.config.infra_retries:
                        raise
                    stats["infra_retries"] += 1
                    log.warning("rollout %s hit an infrastructure failure (%s: %s); retrying on a fresh slot",
                                current.trajectory_id, type(exc).__name__, exc)
                    if current is not lease:
                        await self.env.pool.release(current)
                    current = await self.env.pool.lease(f"{lease.trajectory_id}-r{attempt + 1}",
                                                        self.env.config.acquire_timeout_s,
                                                        network=self.env.config.allow_network,
                                                        template=None if isinstance(template, str) else template,
                                                        image=template if isinstance(template, str)
                                                        else self.env.item_image(item))
            raise AssertionError("unreachable")
        finally:
            if current is not lease:
                await self.env.pool.release(current)

    async def rollout(self, item: Any, lease: Lease) -> Rollout:
        """One trajectory in one slot: setup, agent loop, in-slot verification, tokens and masks."""
        assert self.env.executor is not None
        executor = self.env.executor
        tid = lease.trajectory_id
        executor.bind(tid, lease)
        try:
            async def exec_tool(call: AgentToolCall) -> ToolOutcome:
                return await executor.execute(tid, call)

            async def run_tools(calls: list[AgentToolCall]) -> list[ToolOutcome]:
                return await executor.execute_many(tid, calls)

            await self.env.setup_trajectory_workspace(item, trajectory_id=tid, exec_tool=exec_tool, lease=lease)
            messages = [{"role": "system", "content": self.env.system_prompt()},
                        {"role": "user", "content": self.env.build_task(item)}]
            cfg = AgentConfig(max_steps=self.env.config.agent_max_steps, temperature=self.env.config.agent_temperature,
                              max_tokens=self.env.config.agent_max_tokens,
                              max_context_tokens=self.env.config.max_token_length,
                              wrap_tool_responses=self.env.wrap_tool_responses)
            t0 = time.perf_counter()
            result, tracked, fallback = await self._run_policy(tid, messages, cfg, run_tools)
            log.debug("rollout %s: %d steps in %.1fs (%s)", tid, len(result.steps), time.perf_counter() - t0,
                      result.finish)
            if result.finish == "context_budget":
                log.info("rollout %s stopped at the context budget (%d tokens)", tid, self.env.config.max_token_length)
            # The verification phase: every process of the agent dies here and nothing runs in the
            # slot again (reading it and lease.verify remain), so no leftover of the rollout can
            # watch, race or rewrite what the verification reads.
            await lease.seal()
            score, meta = await self.env.verify_and_score_trajectory(
                item, result.final_response, trajectory_id=tid, exec_tool=exec_tool, lease=lease, agent_result=result)
        finally:
            executor.unbind(tid)
        tokens, masks, logprobs = self._training_tokens(tid, result, tracked)
        return Rollout(tokens=tokens, masks=masks, score=float(score), messages=result.messages, logprobs=logprobs,
                       finish=result.finish, tool_calls=result.tool_calls, sandbox_seconds=result.sandbox_seconds,
                       tracking_fallback=fallback, info=json_safe(meta))

    def _training_tokens(self, tid: str, result: AgentResult, tracked: TrackedSequence | None,
                         ) -> tuple[list[int], list[int], list[float] | None]:
        """Tokens, masks and logprobs: ManagedServer's sampled ids when tracked, else the
        conversation re-rendered with the chat template (no logprobs)."""
        if tracked is not None:
            tokens, masks, logprobs = tracked.tokens, tracked.masks, tracked.logprobs
        else:
            tokenized = tokenize_conversation(self.env.tokenizer, result.messages)
            tokens, masks, logprobs = tokenized.tokens, tokenized.masks, None
        if all(m == IGNORE for m in masks):
            log.warning("rollout %s has no trainable token", tid)
        return tokens, masks, logprobs

    async def _run_policy(self, tid: str, messages: list[dict[str, Any]], cfg: AgentConfig, run_tools: ToolsFn,
                          ) -> tuple[AgentResult, TrackedSequence | None, bool]:
        """The agent loop, in a ManagedServer context of its own when the server gives token ids.
        Returns the result, the tracked sequence (None on the chat-template path) and whether
        ManagedServer's tracking broke and the chat template had to be used instead."""
        count = functools.partial(count_prompt_tokens, self.env.tokenizer)
        if not self.env.managed_tokens:
            return await run_agent(self.env.chat, run_tools, messages, cfg, count), None, False
        # One context per rollout with n=1 per turn: the rollout ends as one node, and extension
        # can never match another rollout's prefix (reference §3.2).
        async with self.env.server.managed_server(tokenizer=self.env.tokenizer) as managed:
            session = ManagedSession(managed, self.env.tokenizer)
            result = await run_agent(functools.partial(self.env.chat, session=session), run_tools, messages, cfg, count)
            try:
                return result, session.tracked(), False  # inside the block: the state resets on exit
            except TokenTrackingError as exc:
                log.warning("rollout %s: %s; using chat-template tokens without logprobs", tid, exc)
                return result, None, True
