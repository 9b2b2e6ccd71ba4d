"""AgentEnv: an atroposlib ``BaseEnv`` where every rollout of a group gets its own sandbox slot.

Subclass it and implement ``build_task`` and ``score_trajectory`` (or, to check the work inside
the slot, ``verify_and_score_trajectory``); optionally ``setup_group_workspace`` (once per item,
then every rollout gets a copy-on-write fork of its result), ``setup_trajectory_workspace``
(once per rollout, in its own slot) and ``setup_agent_env`` (once, after the pool is up). Then run
``python -m your_env process|serve|evaluate`` as with any Atropos environment.

What this class does for you (see docs/atroposlib.md for the traps it avoids):

* starts the slot pool in ``setup`` and stops it when the run ends, in every mode (BaseEnv has no
  teardown hook);
* leases the whole group at once, releases every slot in ``finally`` (also on cancellation);
* treats a failure of the platform (pool, sandbox host, inference server) as infrastructure: the
  rollout is retried on a fresh slot, and the item goes back to the backlog when retries run out,
  instead of training on a fake score of 0;
* seals the slot when the agent is done (the verification phase: every process of the agent
  killed, no command runs in the slot again) before ``verify_and_score_trajectory``;
* runs the agent loop (Hermes ``<tool_call>`` text or OpenAI ``tool_calls``) within the context
  budget (``max_token_length``);
* builds tokens and masks: with inference servers that return token ids (``server_type`` vllm or
  sglang) each rollout runs in its own ``ManagedServer`` context and the group carries the sampled
  ids and their ``inference_logprobs``; otherwise the conversation is re-rendered with the
  tokenizer's chat template (no logprobs).
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any

from atroposlib.envs.base import ScoredDataGroup

from atropos.agent.errors import is_infrastructure
from atropos.agent.loop import ChatReply
from atropos.agent.managed import ManagedSession
from atropos.envs.config import AgentEnvConfig
from atropos.envs.env_base import ExecTool, Rollout
from atropos.envs.env_rollout import RolloutEnv
from atropos.errors import InfrastructureError
from atropos.slots.lease import Lease, PoolTemplate

__all__ = ["AgentEnv", "AgentEnvConfig", "ExecTool", "Rollout"]

log = logging.getLogger(__name__)

# process mode: a group lost to infrastructure is retried in place (BaseEnv drops a returned backlog
# there); after this many lost in a row the platform is down and the run stops with the last error.
PROCESS_MAX_LOST_GROUPS = 5


class AgentEnv(RolloutEnv):
    """Subclass it (see the module docstring); its parts are listed in env_base.py."""

    async def chat(self, messages: list[dict[str, Any]], session: ManagedSession | None = None) -> ChatReply:
        """One model turn (RolloutEnv's), timed: serve mode warns when turns this slow make a
        rollout outlive ``worker_timeout`` (env_sandbox.py)."""
        t0 = time.monotonic()
        reply = await super().chat(messages, session)
        self._turn_done(time.monotonic() - t0)
        return reply

    async def collect_trajectories(self, item: Any) -> tuple[ScoredDataGroup | None, list[Any]]:
        """BaseEnv's hook: one group of ``group_size`` rollouts of ``item``, each in its own slot.
        ``(None, [item])`` when infrastructure lost it (the item is retried, never scored 0)."""
        while True:
            group, backlog = await self._collect_group(item)
            if group is not None or not backlog:
                self._lost_in_a_row = 0
                return group, backlog
            self._lost_in_a_row += 1
            if not self._process_mode:
                return None, backlog  # serve mode: BaseEnv puts the item back in its backlog
            # process mode drops a returned backlog (it just asks get_next_item again): retry here
            if self._lost_in_a_row >= PROCESS_MAX_LOST_GROUPS:
                raise InfrastructureError(f"{self._lost_in_a_row} groups in a row lost to infrastructure; "
                                          "the sandbox pool or the inference server is down")
            log.warning("process mode: retrying the item (%d group(s) in a row lost to infrastructure)",
                        self._lost_in_a_row)

    def _backlog(self, item: Any, why: str) -> tuple[None, list[Any]]:
        log.warning("%s; the item goes back to the backlog (not scored)", why)
        self.stats["items_backlogged"] += 1
        return None, [item]

    async def _collect_group(self, item: Any) -> tuple[ScoredDataGroup | None, list[Any]]:
        await self.setup_sandbox()
        assert self.pool is not None
        group_id = uuid.uuid4().hex[:10]
        ids = [f"{group_id}-{i}" for i in range(self.config.group_size)]
        group_setup = self.has_group_setup()
        leases: list[Lease] = []
        template: PoolTemplate | None = None
        pool = self.pool  # the finally releases into this pool even if the run is ending
        try:
            try:
                leases = await pool.lease_many(ids, self.config.acquire_timeout_s,
                                               network=self.config.allow_network,
                                               colocate=True if group_setup else None)
                if group_setup:
                    template = await self._prepare_group(item, leases)
            except Exception as exc:
                if not is_infrastructure(exc):
                    raise
                what = "group setup failed" if leases else f"could not lease a group of {len(ids)}"
                return self._backlog(item, f"{what} ({type(exc).__name__}: {exc})")
            results = await asyncio.gather(
                *(self._rollout_with_retries(item, lease, template, self.stats) for lease in leases),
                return_exceptions=True)
        finally:
            await asyncio.gather(*(pool.release(lease) for lease in leases), return_exceptions=True)
            await self._drop_template(template, "group")
        rollouts, lost = self._split_results(results)
        if lost:
            return self._backlog(item, f"a rollout was lost to infrastructure after {self.config.infra_retries} "
                                       f"retries ({type(lost[-1]).__name__}: {lost[-1]})")
        return self._scored_group(rollouts), []

    async def _drop_template(self, template: PoolTemplate | None, what: str) -> None:
        """Delete a group's template after its slots are released (a template in use cannot go)."""
        if template is None or self.pool is None:
            return
        try:
            await self.pool.delete_template(template)
        except Exception as exc:  # never let cleanup mask the outcome
            log.warning("could not delete %s template %s: %s", what, template.id, exc)

    def _scored_group(self, rollouts: list[Rollout]) -> ScoredDataGroup:
        """The group as BaseEnv sends it; the rollouts are counted in the run's stats."""
        group: ScoredDataGroup = ScoredDataGroup(tokens=[], masks=[], scores=[], messages=[])
        for rollout in rollouts:
            self._record(rollout, self.stats)
            group["tokens"].append(rollout.tokens)
            group["masks"].append(rollout.masks)
            group["scores"].append(rollout.score)
            group["messages"].append(rollout.messages)
        if rollouts and all(r.logprobs is not None for r in rollouts):
            group["inference_logprobs"] = [r.logprobs for r in rollouts]
        self.progress.group_done(rollouts=int(self.stats["rollouts"]), tool_calls=int(self.stats["tool_calls"]),
                                 total_groups=getattr(self, "n_groups_to_process", None))
        return group

    @staticmethod
    def _split_results(results: Sequence[Rollout | BaseException],
                       on_lost: Callable[[Exception], None] | None = None) -> tuple[list[Rollout], list[Exception]]:
        """The rollouts and the infrastructure failures among ``gather(..., return_exceptions=True)``
        results (``on_lost`` is told of each failure as it is met); anything else is a bug (in a hook,
        a config) and is raised: seen, not trained on."""
        rollouts: list[Rollout] = []
        lost: list[Exception] = []
        for r in results:
            if isinstance(r, Rollout):
                rollouts.append(r)
            elif isinstance(r, Exception) and is_infrastructure(r):
                lost.append(r)
                if on_lost is not None:
                    on_lost(r)
            else:
                raise r
        return rollouts, lost

    @staticmethod
    def _record(rollout: Rollout, stats: dict[str, float]) -> None:
        stats["rollouts"] += 1
        stats["tool_calls"] += rollout.tool_calls
        stats["tool_seconds"] += rollout.sandbox_seconds
        stats["score_sum"] += rollout.score
        stats["context_budget_stops"] += rollout.finish == "context_budget"
        stats["token_tracking_fallbacks"] += rollout.tracking_fallback

    async def evaluate(self, *args: Any, **kwargs: Any) -> None:
        """One rollout per eval item, each in its own slot; logs the mean score. A rollout lost to
        infrastructure is left out (and counted), never scored 0 and never the end of the eval."""
        items = self.eval_items()
        if not items:
            return
        await self.setup_sandbox()
        assert self.pool is not None
        start = time.time()

        results = await asyncio.gather(*(self._eval_rollout(i, item) for i, item in enumerate(items)),
                                       return_exceptions=True)
        done, lost = self._split_results(results, on_lost=lambda exc: log.warning(
            "eval rollout lost to infrastructure (%s: %s); left out of the metrics", type(exc).__name__, exc))
        for rollout in done:
            self._record(rollout, self.eval_stats)
        metrics: dict[str, float] = {"eval/n": len(done), "eval/infra_failures": len(lost)}
        if done:
            metrics["eval/mean_score"] = sum(r.score for r in done) / len(done)
        # evaluate_log writes files only with data_dir_to_save_evals: the result is always printed
        print("[atropos-sandbox] eval: " + "  ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}"
                                                     for k, v in metrics.items()), flush=True)
        await self.evaluate_log(metrics=metrics, start_time=start, end_time=time.time(),
                                samples=[{"messages": r.messages, "score": r.score} for r in done])

    async def _eval_rollout(self, i: int, item: Any) -> Rollout:
        """One eval rollout in its own slot, started as a training rollout is: the group step too
        (its template also serves a retry on a fresh slot)."""
        assert self.pool is not None
        lease = await self.pool.lease(f"eval-{uuid.uuid4().hex[:8]}-{i}", self.config.acquire_timeout_s,
                                      network=self.config.allow_network)
        template: PoolTemplate | None = None
        try:
            if self.has_group_setup():
                template = await self._prepare_group(item, [lease], self.eval_stats)
            return await self._rollout_with_retries(item, lease, template, self.eval_stats)
        finally:
            await self.pool.release(lease)
            await self._drop_template(template, "eval")
