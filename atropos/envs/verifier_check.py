"""Proof that an env's verifier can tell right from wrong, shown beside a run's own scores.

For each task family the env names a reference solution (a scripted policy); each item is run
twice in real slots through the env's own setup and verifier: after the reference solution
(it must score 1) and left at its starting state (it must score 0). A newcomer whose run prints
``mean score: 0.000`` then sees whether the model failed or the verifier cannot say yes.
"""

from __future__ import annotations

import asyncio
import html
import json
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel

from atropos.agent.loop import AgentConfig, ChatReply, run_agent
from atropos.envs.html_report import append_table
from atropos.testing.scripted import Policy, answer, by_turn

if TYPE_CHECKING:
    from atropos.envs.agent_env import AgentEnv

__all__ = ["VerifierCheck", "VerifierCheckResult", "append_to_html", "run_checks", "summary_lines"]


@dataclass(frozen=True)
class VerifierCheck:
    """One task family: an item of it and the policy that solves it."""

    family: str
    item: Any
    reference: Policy


class VerifierCheckResult(BaseModel):
    family: str
    reference_score: float
    stub_score: float
    reference_saw: dict[str, Any] = {}  # what the verifier reported (its metadata) for each run
    stub_saw: dict[str, Any] = {}

    @property
    def ok(self) -> bool:
        return self.reference_score == 1.0 and self.stub_score == 0.0


STUB_POLICY: Policy = by_turn(answer("I am done."))  # touches nothing: the starting state is verified


async def _scripted_rollout(env: AgentEnv, item: Any, policy: Policy, tag: str) -> tuple[float, dict[str, Any]]:
    assert env.pool is not None and env.executor is not None
    executor = env.executor
    tid = f"verifier-check-{tag}-{uuid.uuid4().hex[:6]}"
    async with env.pool.leased(tid, env.config.acquire_timeout_s, network=env.config.allow_network,
                               image=env.item_image(item)) as lease:
        executor.bind(tid, lease)
        try:
            async def exec_tool(call: Any) -> Any:
                return await executor.execute(tid, call)

            async def run_tools(calls: Any) -> Any:
                return await executor.execute_many(tid, calls)

            async def chat(messages: list[dict[str, Any]]) -> ChatReply:
                out = policy(messages)
                return ChatReply(text=out if isinstance(out, str) else await out)

            if env.has_group_setup():
                await env.setup_group_workspace(item, trajectory_id=tid, exec_tool=exec_tool, lease=lease)
            await env.setup_trajectory_workspace(item, trajectory_id=tid, exec_tool=exec_tool, lease=lease)
            messages = [{"role": "system", "content": env.system_prompt()},
                        {"role": "user", "content": env.build_task(item)}]
            result = await run_agent(chat, run_tools, messages, AgentConfig(max_steps=env.config.agent_max_steps))
            score, saw = await env.verify_and_score_trajectory(item, result.final_response, trajectory_id=tid,
                                                               exec_tool=exec_tool, lease=lease, agent_result=result)
            return float(score), dict(saw or {})
        finally:
            executor.unbind(tid)


async def run_checks(env: AgentEnv, checks: list[VerifierCheck]) -> list[VerifierCheckResult]:
    """Every check's reference and stub run, concurrently, each in its own slot."""

    async def one(check: VerifierCheck) -> VerifierCheckResult:
        (ref, ref_saw), (stub, stub_saw) = await asyncio.gather(
            _scripted_rollout(env, check.item, check.reference, "reference"),
            _scripted_rollout(env, check.item, STUB_POLICY, "stub"))
        return VerifierCheckResult(family=check.family, reference_score=ref, stub_score=stub,
                                   reference_saw=ref_saw, stub_saw=stub_saw)

    return list(await asyncio.gather(*(one(c) for c in checks)))


def summary_lines(results: list[VerifierCheckResult]) -> list[str]:
    if not results:
        return []
    bad = [r.family for r in results if not r.ok]
    head = ("verifier check (in a slot: reference solution -> must score 1, starting stub -> must score 0): "
            + ("all as expected" if not bad else f"NOT AS EXPECTED for {', '.join(bad)}: fix the verifier "
               "or the reference before trusting this run's scores"))
    width = max(len(r.family) for r in results)
    rows = [f"  {r.family:<{width}}  reference {r.reference_score:.3f}  stub {r.stub_score:.3f}"
            f"{'' if r.ok else '  <-- unexpected'}" for r in results]
    return [head, *rows]


def append_to_html(path: Path, results: list[VerifierCheckResult]) -> None:
    """Add the check's table (with what the verifier saw in each run) to the run's HTML report."""
    if not results or not path.exists():
        return
    rows = [
        f"<tr><td>{html.escape(r.family)}</td><td>{r.reference_score:.3f}</td><td>{r.stub_score:.3f}</td>"
        f"<td>{'ok' if r.ok else 'UNEXPECTED'}</td>"
        f"<td><pre>{html.escape(json.dumps(r.reference_saw, indent=1, default=str)[:4000])}</pre></td>"
        f"<td><pre>{html.escape(json.dumps(r.stub_saw, indent=1, default=str)[:4000])}</pre></td></tr>"
        for r in results]
    append_table(path, "verifier-check", "Verifier check",
                 "Each task family verified in a slot after its reference solution (must score 1) and at its "
                 "starting state (must score 0).",
                 ["family", "reference", "stub", "", "verifier saw (reference)", "verifier saw (stub)"], rows)
