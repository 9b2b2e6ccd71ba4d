"""AgentEnv: an atroposlib ``BaseEnv`` where every rollout of a group gets its own sandbox slot.

Subclass it and implement ``build_task`` and ``score_trajectory`` (or, to check the work inside
the slot, ``verify_and_score_trajectory``); optionally ``setup_group_workspace`` (once per item,
then every rollout gets a copy-on-write fork of its result) and ``setup_trajectory_workspace``
(once per rollout, in its own slot). Then run
``python -m your_env process|serve|evaluate`` as with any Atropos environment.

What this class does for you (see shared/reference/atroposlib.md for the traps it avoids):

* starts the slot pool in ``setup`` and stops it when the run ends (BaseEnv has no teardown hook);
* leases the whole group at once, releases every slot in ``finally`` (also on cancellation);
* retries a rollout that failed for an infrastructure reason on a fresh slot, and sends the item
  back to the backlog when retries run out, instead of training on a fake score of 0;
* runs the agent loop (Hermes ``<tool_call>`` text or OpenAI ``tool_calls``), and builds tokens and
  masks (ManagedServer when the server returns token ids, else the tokenizer's chat template).
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any, Literal

from atroposlib.envs.base import BaseEnv, BaseEnvConfig, ScoredDataGroup
from pydantic import Field

from atropos.agent.loop import AgentConfig, AgentResult, ChatReply, hermes_system_prompt, run_agent
from atropos.agent.tokens import IGNORE, tokenize_conversation
from atropos.backends.base import Backend
from atropos.errors import InfrastructureError
from atropos.slots.config import PoolConfig
from atropos.slots.lease import Lease, PoolTemplate
from atropos.slots.pool import SlotPool
from atropos.tools.executor import AgentToolCall, ExecutorConfig, ToolExecutor, ToolOutcome
from atropos.tools.registry import DEFAULT_TOOLSETS, ToolRegistry

log = logging.getLogger(__name__)

ExecTool = Callable[[AgentToolCall], Awaitable[ToolOutcome]]


class AgentEnvConfig(BaseEnvConfig):
    # where sandboxes run
    sandbox_backend: Literal["local", "docker", "nomad"] = Field("local", description="local | docker | nomad")
    slots_per_host: int = Field(16, ge=1, description="slots per sandbox host (process or container)")
    min_hosts: int = Field(1, ge=0, description="hosts kept running")
    max_hosts: int = Field(4, ge=1, description="most hosts the pool scales to")
    sandbox_image: str = Field("atropos-sandbox:dev", description="docker/nomad: sandbox image")
    nomad_address: str = Field("http://127.0.0.1:4646", description="nomad: agent address")
    nomad_job_id: str = Field("atropos-sandbox", description="nomad: job id")
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
    # tools
    enabled_toolsets: list[str] = Field(default_factory=lambda: list(DEFAULT_TOOLSETS))
    disabled_toolsets: list[str] = Field(default_factory=list)
    tool_server_url: str | None = Field(
        None, description="ToolServer for external tools; 'inprocess' runs one in this process (offline corpus)")
    tool_server_token: str | None = Field(None, description="bearer token of the ToolServer")


class AgentEnv(BaseEnv):
    env_config_cls = AgentEnvConfig
    system_preamble: str = "You are an agent working in a Linux sandbox. Your workspace is /workspace."

    def __init__(self, config: AgentEnvConfig, server_configs: Any, slurm: bool = False, testing: bool = False):
        super().__init__(config, server_configs, slurm, testing)
        self.config: AgentEnvConfig = config
        self.tools = ToolRegistry.default(with_web=bool(config.tool_server_url)).select(
            config.enabled_toolsets + (["web"] if config.tool_server_url else []), config.disabled_toolsets)
        self.pool: SlotPool | None = None
        self.executor: ToolExecutor | None = None
        self.stats: dict[str, float] = {"rollouts": 0, "tool_calls": 0, "tool_seconds": 0.0, "score_sum": 0.0,
                                        "infra_retries": 0, "items_backlogged": 0, "group_setups": 0,
                                        "group_setup_seconds": 0.0}

    # -- hooks for subclasses --------------------------------------------------------------
    def build_task(self, item: Any) -> str:
        """The user message that states the task."""
        raise NotImplementedError

    async def score_trajectory(self, item: Any, final_response: str) -> float:
        """Score from the final answer alone (override ``verify_and_score_trajectory`` to look at the slot)."""
        raise NotImplementedError

    async def setup_group_workspace(self, item: Any, *, trajectory_id: str, exec_tool: ExecTool,
                                    lease: Lease) -> dict[str, Any]:
        """Prepare the workspace once per item (clone a repo, install dependencies) in one slot of
        the group; every rollout of the group then starts from a copy-on-write fork of the result
        (a template made from that slot). Override it to use it; by default there is no group step.
        ``setup_trajectory_workspace`` still runs afterwards in each rollout's own slot."""
        return {}

    def has_group_setup(self) -> bool:
        return type(self).setup_group_workspace is not AgentEnv.setup_group_workspace

    async def setup_trajectory_workspace(self, item: Any, *, trajectory_id: str, exec_tool: ExecTool,
                                         lease: Lease) -> dict[str, Any]:
        """Prepare the slot before the agent starts (write fixtures, clone a repo). Default: nothing."""
        return {}

    async def verify_and_score_trajectory(self, item: Any, final_response: str, *, trajectory_id: str,
                                          exec_tool: ExecTool, lease: Lease,
                                          agent_result: AgentResult) -> tuple[float, dict[str, Any]]:
        """Verify inside the same slot (run hidden tests) and score. Default: ``score_trajectory``."""
        return await self.score_trajectory(item, final_response), {}

    def build_backend(self) -> Backend:
        c = self.config
        pool_id = self.build_backend_pool_id()
        if c.sandbox_backend == "docker":
            from atropos.backends.docker import DockerBackend, DockerBackendConfig

            return DockerBackend(DockerBackendConfig(image=c.sandbox_image, slots_per_host=c.slots_per_host,
                                                     pool_id=pool_id, max_timeout_s=c.tool_timeout_s))
        if c.sandbox_backend == "nomad":
            from atropos.backends.nomad import NomadBackend, NomadBackendConfig

            # NOMAD_TOKEN, namespace, region and TLS come from the environment, as with the nomad CLI
            return NomadBackend(NomadBackendConfig.from_env(address=c.nomad_address, job_id=c.nomad_job_id,
                                                            image=c.sandbox_image, slots_per_host=c.slots_per_host))
        from atropos.backends.local import LocalBackend, LocalBackendConfig

        return LocalBackend(LocalBackendConfig(slots_per_host=c.slots_per_host, pool_id=pool_id,
                                               max_timeout_s=c.tool_timeout_s))

    # -- lifecycle -------------------------------------------------------------------------
    async def setup(self) -> None:
        await self.setup_sandbox()

    async def setup_sandbox(self) -> None:
        if self.pool is not None:
            return
        c = self.config
        self.pool = SlotPool(self.build_backend(), PoolConfig(
            pool_id=self.build_backend_pool_id(), min_hosts=c.min_hosts, max_hosts=c.max_hosts,
            lease_timeout_s=c.acquire_timeout_s))
        await self.pool.start()
        url, token, transport = c.tool_server_url, c.tool_server_token, None
        if url == "inprocess":
            url, token, transport = self._inprocess_tool_server()
        self.executor = ToolExecutor(self.pool, self.tools, ExecutorConfig(
            tool_batch_window_ms=c.tool_batch_window_ms, tool_max_batch_size=c.tool_max_batch_size,
            max_timeout_s=c.tool_timeout_s, tool_server_url=url, tool_server_token=token,
            network=c.allow_network), tool_server_transport=transport)

    def _inprocess_tool_server(self) -> tuple[str, str, Any]:
        """A ToolServer in this process (ASGI transport) serving web tools from the offline corpus."""
        import secrets

        import httpx

        from atropos.api.externals import web_externals
        from atropos.api.server import ToolServerSettings, create_tool_server
        from atropos.tools.web import OfflineCorpusProvider

        assert self.pool is not None
        token = secrets.token_urlsafe(24)
        app = create_tool_server(self.pool, ToolServerSettings(token=token),
                                 registry=ToolRegistry.default(with_web=True),
                                 externals=web_externals(OfflineCorpusProvider()))
        return "http://toolserver", token, httpx.ASGITransport(app=app)

    def build_backend_pool_id(self) -> str:
        return "".join(ch if ch.isalnum() or ch in "_.-" else "-" for ch in
                       f"env-{self.config.wandb_name or type(self).__name__}")[:60]

    async def shutdown_sandbox(self) -> None:
        if self.executor is not None:
            await self.executor.close()
            self.executor = None
        if self.pool is not None:
            await self.pool.stop()
            self.pool = None

    async def process_manager(self) -> Any:
        try:
            return await super().process_manager()
        finally:
            await self.shutdown_sandbox()
            self.print_summary()

    async def env_manager(self) -> Any:
        try:
            return await super().env_manager()
        finally:
            await self.shutdown_sandbox()

    def print_summary(self) -> None:
        s = self.stats
        rollouts = int(s["rollouts"])
        mean = s["score_sum"] / rollouts if rollouts else 0.0
        per_call = 1000 * s["tool_seconds"] / s["tool_calls"] if s["tool_calls"] else 0.0
        path = getattr(self.config, "data_path_to_save_groups", None)
        c = self.config
        print(f"[atropos-sandbox] pool: backend {c.sandbox_backend}, {c.slots_per_host} slots/host, "
              f"hosts {c.min_hosts}..{c.max_hosts}", flush=True)
        print(f"[atropos-sandbox] rollouts: {rollouts}  tool calls run: {int(s['tool_calls'])}  "
              f"mean score: {mean:.3f}  sandbox time per call: {per_call:.1f} ms  "
              f"infra retries: {int(s['infra_retries'])}", flush=True)
        if path:
            print(f"[atropos-sandbox] data: {path}  html: {str(path).rsplit('.', 1)[0]}.html", flush=True)

    # -- rollouts --------------------------------------------------------------------------
    def system_prompt(self) -> str:
        return hermes_system_prompt(self.tools.schemas(), self.system_preamble)

    async def chat(self, messages: list[dict[str, Any]]) -> ChatReply:
        """One model turn through atroposlib's ServerManager (OpenAI-compatible servers)."""
        c = self.config
        kwargs: dict[str, Any] = {"messages": messages, "n": 1, "max_tokens": c.agent_max_tokens,
                                  "temperature": c.agent_temperature}
        if c.tool_call_grammar:
            from atropos.agent.grammars import schema_grammar

            turns = sum(1 for m in messages if m.get("role") == "assistant")
            kwargs["extra_body"] = {"grammar": schema_grammar(
                self.tools.schemas(), allow_answer=turns >= c.grammar_forced_tool_turns)}
        completion = await self.server.chat_completion(**kwargs)
        choice = completion.choices[0]
        message = choice.message
        calls = None
        if getattr(message, "tool_calls", None):
            calls = [tc.model_dump() if hasattr(tc, "model_dump") else dict(tc) for tc in message.tool_calls]
        return ChatReply(text=message.content or "", tool_calls=calls, finish_reason=choice.finish_reason or "stop")

    async def collect_trajectories(self, item: Any) -> tuple[ScoredDataGroup | None, list[Any]]:
        await self.setup_sandbox()
        assert self.pool is not None
        group_id = uuid.uuid4().hex[:10]
        ids = [f"{group_id}-{i}" for i in range(self.config.group_size)]
        group_setup = self.has_group_setup()
        try:
            leases = await self.pool.lease_many(ids, self.config.acquire_timeout_s, network=self.config.allow_network,
                                                colocate=True if group_setup else None)
        except InfrastructureError as exc:
            log.error("could not lease a group of %d: %s; item goes back to the backlog", len(ids), exc)
            self.stats["items_backlogged"] += 1
            return None, [item]
        template: PoolTemplate | None = None
        try:
            if group_setup:
                try:
                    template = await self._prepare_group(item, leases)
                except InfrastructureError as exc:
                    log.error("group setup failed for an infrastructure reason (%s); item goes back to the backlog",
                              exc)
                    self.stats["items_backlogged"] += 1
                    return None, [item]
            results = await asyncio.gather(*(self._rollout_with_retries(item, lease, template) for lease in leases),
                                           return_exceptions=True)
        finally:
            await asyncio.gather(*(self.pool.release(lease) for lease in leases), return_exceptions=True)
            if template is not None:
                try:
                    await self.pool.delete_template(template)
                except Exception as exc:  # never let cleanup mask the group's outcome
                    log.warning("could not delete group template %s: %s", template.id, exc)
        rollouts = []
        for r in results:
            if isinstance(r, InfrastructureError):
                log.error("rollout lost to infrastructure after retries (%s); item goes back to the backlog", r)
                self.stats["items_backlogged"] += 1
                return None, [item]
            if isinstance(r, BaseException):
                raise r
            rollouts.append(r)
        group: ScoredDataGroup = ScoredDataGroup(tokens=[], masks=[], scores=[], messages=[])
        for tokens, masks, score, messages in rollouts:
            group["tokens"].append(tokens)
            group["masks"].append(masks)
            group["scores"].append(score)
            group["messages"].append(messages)
        return group, []

    async def _prepare_group(self, item: Any, leases: list[Lease]) -> PoolTemplate:
        """Run ``setup_group_workspace`` in the group's first slot, make a template of it (that slot
        continues as a fork of it) and fork the other slots from it."""
        assert self.pool is not None and self.executor is not None
        executor, setup = self.executor, leases[0]
        tid = setup.trajectory_id
        t0 = time.perf_counter()
        executor.bind(tid, setup)
        try:
            async def exec_tool(call: AgentToolCall) -> ToolOutcome:
                return await executor.execute(tid, call)

            await self.setup_group_workspace(item, trajectory_id=tid, exec_tool=exec_tool, lease=setup)
        finally:
            executor.unbind(tid)
        template = await self.pool.template_from_lease(setup, name=f"group-{tid.rsplit('-', 1)[0]}")
        try:
            await asyncio.gather(*(self.pool.fork(lease, template) for lease in leases[1:]))
        except BaseException:
            await asyncio.gather(*(self.pool.release(lease) for lease in leases), return_exceptions=True)
            await self.pool.delete_template(template)
            raise
        self.stats["group_setups"] += 1
        self.stats["group_setup_seconds"] += time.perf_counter() - t0
        log.debug("group %s: setup + template + %d forks in %.2fs", tid, len(leases) - 1, time.perf_counter() - t0)
        return template

    async def _rollout_with_retries(self, item: Any, lease: Lease, template: PoolTemplate | None = None
                                    ) -> tuple[list[int], list[int], float, list[dict[str, Any]]]:
        assert self.pool is not None
        current = lease
        try:
            for attempt in range(self.config.infra_retries + 1):
                try:
                    return await self.rollout(item, current)
                except InfrastructureError as exc:
                    if attempt == self.config.infra_retries:
                        raise
                    self.stats["infra_retries"] += 1
                    log.warning("rollout %s hit an infrastructure failure (%s); retrying on a fresh slot",
                                current.trajectory_id, exc)
                    if current is not lease:
                        await self.pool.release(current)
                    current = await self.pool.lease(f"{lease.trajectory_id}-r{attempt + 1}",
                                                    self.config.acquire_timeout_s, network=self.config.allow_network,
                                                    template=template)
            raise AssertionError("unreachable")
        finally:
            if current is not lease:
                await self.pool.release(current)

    async def rollout(self, item: Any, lease: Lease) -> tuple[list[int], list[int], float, list[dict[str, Any]]]:
        """One trajectory in one slot: setup, agent loop, in-slot verification, tokens and masks."""
        assert self.executor is not None
        executor = self.executor
        tid = lease.trajectory_id
        executor.bind(tid, lease)
        try:
            async def exec_tool(call: AgentToolCall) -> ToolOutcome:
                return await executor.execute(tid, call)

            async def run_tools(calls: list[AgentToolCall]) -> list[ToolOutcome]:
                return await executor.execute_many(tid, calls)

            await self.setup_trajectory_workspace(item, trajectory_id=tid, exec_tool=exec_tool, lease=lease)
            messages = [{"role": "system", "content": self.system_prompt()},
                        {"role": "user", "content": self.build_task(item)}]
            cfg = AgentConfig(max_steps=self.config.agent_max_steps, temperature=self.config.agent_temperature,
                              max_tokens=self.config.agent_max_tokens)
            t0 = time.perf_counter()
            result = await run_agent(self.chat, run_tools, messages, cfg)
            log.debug("rollout %s: %d steps in %.1fs", tid, len(result.steps), time.perf_counter() - t0)
            score, _meta = await self.verify_and_score_trajectory(
                item, result.final_response, trajectory_id=tid, exec_tool=exec_tool, lease=lease, agent_result=result)
        finally:
            executor.unbind(tid)
        tokenized = tokenize_conversation(self.tokenizer, result.messages)
        self.stats["rollouts"] += 1
        self.stats["tool_calls"] += result.tool_calls
        self.stats["tool_seconds"] += result.sandbox_seconds
        self.stats["score_sum"] += float(score)
        if all(m == IGNORE for m in tokenized.masks):
            log.warning("rollout %s has no trainable token", tid)
        return tokenized.tokens, tokenized.masks, float(score), result.messages

    def eval_items(self) -> list[Any]:
        """Held-out items for ``evaluate`` (default: none; override to enable evaluation)."""
        return []

    async def evaluate(self, *args: Any, **kwargs: Any) -> None:
        """One rollout per eval item, each in its own slot; logs the mean score."""
        items = self.eval_items()
        if not items:
            return
        await self.setup_sandbox()
        assert self.pool is not None
        start = time.time()

        async def one(i: int, item: Any) -> tuple[float, list[dict[str, Any]]]:
            assert self.pool is not None
            async with self.pool.leased(f"eval-{uuid.uuid4().hex[:8]}-{i}", self.config.acquire_timeout_s,
                                        network=self.config.allow_network) as lease:
                _tokens, _masks, score, messages = await self._rollout_with_retries(item, lease)
                return score, messages

        results = await asyncio.gather(*(one(i, item) for i, item in enumerate(items)))
        scores = [s for s, _ in results]
        await self.evaluate_log(
            metrics={"eval/mean_score": sum(scores) / len(scores), "eval/n": len(scores)},
            start_time=start, end_time=time.time(),
            samples=[{"messages": m, "score": s} for s, m in results],
        )
