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
import functools
import logging
import os
import signal
import sys
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

from atroposlib.envs.base import APIServerConfig, BaseEnv, ScoredDataGroup
from pydantic import BaseModel, ValidationError

from atropos.agent.errors import TokenTrackingError, inference_failure, is_infrastructure
from atropos.agent.loop import (
    AgentConfig,
    AgentResult,
    ChatReply,
    Finish,
    ToolsFn,
    assistant_turns,
    hermes_system_prompt,
    run_agent,
)
from atropos.agent.managed import ManagedSession, TrackedSequence, servers_give_token_ids
from atropos.agent.tokens import IGNORE, count_prompt_tokens, template_wraps_tool_responses, tokenize_conversation
from atropos.backends.base import Backend
from atropos.backends.config import BackendSettings
from atropos.envs.config import (
    AgentEnvConfig,
    backend_settings,
    default_server_configs,
    settings_problem,
    wandb_requested,
)
from atropos.envs.verifier_check import (
    VerifierCheck,
    VerifierCheckResult,
    append_to_html,
    run_checks,
    summary_lines,
)
from atropos.errors import AtroposSandboxError, ConfigError, InfrastructureError, exit_code
from atropos.progress import GroupProgress
from atropos.slots.config import PoolConfig
from atropos.slots.lease import Lease, PoolTemplate
from atropos.slots.pool import PoolStatus, SlotPool
from atropos.tools.executor import AgentToolCall, ExecutorConfig, ToolExecutor, ToolOutcome
from atropos.tools.registry import ToolRegistry

__all__ = ["AgentEnv", "AgentEnvConfig", "ExecTool", "Rollout"]

log = logging.getLogger(__name__)

ExecTool = Callable[[AgentToolCall], Awaitable[ToolOutcome]]

# process mode: a group lost to infrastructure is retried in place (BaseEnv drops a returned backlog
# there); after this many lost in a row the platform is down and the run stops with the last error.
PROCESS_MAX_LOST_GROUPS = 5


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


class AgentEnv(BaseEnv):
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

    @classmethod
    def config_init(cls) -> tuple[AgentEnvConfig, list[APIServerConfig]]:
        """Defaults for the CLI. A subclass that does not override this still gets a LIST of
        ``APIServerConfig`` (BaseEnv's ``ServerBaseline`` default makes ``--openai.*`` a no-op) and a
        ``wandb_name``. ``tokenizer_name`` stays BaseEnv's hub default: set a local path offline."""
        cfg_cls = cls.env_config_cls if issubclass(cls.env_config_cls, AgentEnvConfig) else AgentEnvConfig
        return cfg_cls(wandb_name=cls.name, use_wandb=False), default_server_configs()

    @classmethod
    def cli(cls) -> None:
        """``python your_env.py process|serve|evaluate [--env.* --openai.*]``: BaseEnv's CLI, with
        wandb off unless asked and SIGTERM stopping the run as Ctrl-C does (pool down, summary)."""
        # process and evaluate force use_wandb=True; offline with no API key wandb.init then
        # crashes the run. Unless wandb was asked for, make it a no-op (an explicit WANDB_MODE wins).
        try:
            default = bool(cls.config_init()[0].use_wandb)
        except Exception:
            default = False  # BaseEnv.cli calls config_init again and reports the error
        if not wandb_requested(sys.argv[1:], default):
            os.environ.setdefault("WANDB_MODE", "disabled")
            if sys.argv[1:2] in (["process"], ["evaluate"]) and "--env.use_wandb" not in sys.argv:
                # those commands force use_wandb=True over config_init (the config they print said
                # True while the env had said False): say what the run really does
                sys.argv += ["--env.use_wandb", "false"]
        if "-h" in sys.argv[1:] or "--help" in sys.argv[1:]:
            cls.print_defaults()
        stopped: list[int] = []

        def on_sigterm(signum: int, _frame: Any) -> None:
            # as Ctrl-C: asyncio.run cancels the run, whose finally stops the pool and prints the summary
            stopped.append(signum)
            signal.raise_signal(signal.SIGINT)

        signal.signal(signal.SIGTERM, on_sigterm)
        try:
            super().cli()
        except AtroposSandboxError as exc:
            # one line that says what failed (e.g. "cannot reach Nomad at ..."), not the chained
            # tracebacks of the HTTP client under it; a bug (any other exception) keeps its traceback
            print(f"error: {exc}", file=sys.stderr, flush=True)
            sys.exit(exit_code(exc))
        except ValidationError as exc:  # a bad --env.* / --openai.* value: one line too (exit 2, usage)
            if (problem := settings_problem(exc, cls.env_config_cls)) is None:
                raise
            print(f"error: {problem}", file=sys.stderr, flush=True)
            sys.exit(2)
        except KeyboardInterrupt:
            name = "SIGTERM" if stopped else "interrupt"
            print(f"[atropos-sandbox] stopped by {name}; the sandbox pool is down", file=sys.stderr, flush=True)
            sys.exit(128 + (signal.SIGTERM if stopped else signal.SIGINT))

    @classmethod
    def print_defaults(cls) -> None:
        """What this env's ``config_init`` sets: ``--help`` below lists atroposlib's class defaults,
        not these, and these are what a run uses unless a flag or ``--config`` overrides them."""
        try:
            cfg, servers = cls.config_init()
        except Exception as exc:  # the help must still print
            print(f"[atropos-sandbox] config_init failed ({type(exc).__name__}: {exc})", flush=True)
            return
        lines = [f"  --env.{k} {' '.join(map(str, v)) if isinstance(v, list) else v}"
                 for k, v in cfg.model_dump(exclude_defaults=True, mode="json").items()]
        if isinstance(servers, list) and servers:
            lines += [f"  --openai.{k} {getattr(servers[0], k)}" for k in ("base_url", "model_name", "server_type")]
        print(f"[atropos-sandbox] {cls.__name__} sets (the defaults shown by --help below are atroposlib's):\n"
              + "\n".join(lines) + "\n", flush=True)

    # -- hooks for subclasses --------------------------------------------------------------
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
        return type(self).setup_group_workspace is not AgentEnv.setup_group_workspace

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

    def build_backend(self) -> Backend:
        from atropos.backends.config import build_backend

        return build_backend(self.backend_settings())

    def backend_settings(self) -> BackendSettings:
        """What this env's fields say about the backend (kind, pool id, slots, image, cluster
        addresses), mapped exactly as the CLI maps its settings; ``build_backend`` builds from it."""
        return backend_settings(self.config, self.build_backend_pool_id())

    # -- lifecycle -------------------------------------------------------------------------
    async def setup(self) -> None:
        """BaseEnv's hook: start the slot pool, then ``setup_agent_env``. Call it first when overriding."""
        await self.setup_sandbox()
        await self.setup_agent_env()
        if self._process_mode and self.config.verifier_check:
            await self.check_verifier()

    def verifier_checks(self) -> list[VerifierCheck]:
        """One item per task family with its reference solution (a scripted policy, see
        ``atropos.testing``): a process run first shows the verifier scoring each reference 1 and
        each untouched starting state 0, in a slot. Default: none (no check)."""
        return []

    async def check_verifier(self) -> list[VerifierCheckResult]:
        """Run ``verifier_checks()`` now (reference and stub of each, in slots) and print the table."""
        checks = self.verifier_checks()
        if not checks:
            return []
        await self.setup_sandbox()
        self.verifier_results = await run_checks(self, checks)
        for line in summary_lines(self.verifier_results):
            print(f"[atropos-sandbox] {line}", flush=True)
        return self.verifier_results

    async def setup_sandbox(self) -> None:
        """Start the slot pool and the tool executor (once; later calls do nothing)."""
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
        """Stop the executor and the pool (every sandbox host goes). Safe to call twice."""
        if self.executor is not None:
            await self.executor.close()
            self.executor = None
        if self.pool is not None:
            await self.pool.stop()
            self.pool = None

    async def process_manager(self) -> Any:
        """``process`` mode: BaseEnv's loop, then the pool is stopped and the summary printed."""
        self._process_mode = True
        try:
            return await super().process_manager()
        finally:
            status = self.pool.status() if self.pool is not None else None
            await self.shutdown_sandbox()
            self.print_summary(status)
            path = getattr(self.config, "data_path_to_save_groups", None)
            if path:
                append_to_html(Path(str(path).rsplit(".", 1)[0] + ".html"), self.verifier_results)

    async def env_manager(self) -> Any:
        """``serve`` mode: BaseEnv's loop, then the pool is stopped and the summary printed."""
        try:
            return await super().env_manager()
        finally:
            status = self.pool.status() if self.pool is not None else None
            await self.shutdown_sandbox()
            self.print_summary(status)

    async def _run_evaluate(self) -> None:
        # BaseEnv's `evaluate` command runs setup() + evaluate() and returns: nothing stops the pool.
        try:
            await super()._run_evaluate()
        finally:
            await self.shutdown_sandbox()

    def print_summary(self, status: PoolStatus | None = None) -> None:
        """The run's ``[atropos-sandbox]`` lines: pool, rollouts, mean score, dropped groups, files."""
        s = self.stats
        rollouts = int(s["rollouts"])
        mean = s["score_sum"] / rollouts if rollouts else 0.0
        per_call = 1000 * s["tool_seconds"] / s["tool_calls"] if s["tool_calls"] else 0.0
        path = getattr(self.config, "data_path_to_save_groups", None)
        if status is not None:  # what the pool really ran, not what was asked for
            slots = sorted({h.slots for h in status.hosts})
            print(f"[atropos-sandbox] pool: backend {status.backend}, {len(status.hosts)} host(s) with "
                  f"{'/'.join(map(str, slots)) or '-'} slots, {status.leases_total} leases, "
                  f"{status.lost_hosts} host(s) lost", flush=True)
        print(f"[atropos-sandbox] rollouts: {rollouts}  tool calls run: {int(s['tool_calls'])}  "
              f"mean score: {mean:.3f}  sandbox time per call: {per_call:.1f} ms  "
              f"infra retries: {int(s['infra_retries'])}  tokens: "
              f"{'ManagedServer' if self.managed_tokens else 'chat template'}", flush=True)
        for line in summary_lines(self.verifier_results):
            print(f"[atropos-sandbox] {line}", flush=True)
        if s["groups_dropped_same_scores"]:
            print(f"[atropos-sandbox] {int(s['groups_dropped_same_scores'])} group(s) dropped, not saved or sent: "
                  "all scores equal and ensure_scores_are_not_same=True", flush=True)
        if path:
            print(f"[atropos-sandbox] data: {path}  html: {str(path).rsplit('.', 1)[0]}.html", flush=True)

    async def handle_send_to_api(self, scored_data: Any, item: Any = None, do_send_to_api: bool = True,
                                 abort_on_any_max_length_exceeded: bool = True) -> None:
        """BaseEnv's, after counting the groups it will drop for equal scores (it only logs them)."""
        if self.config.ensure_scores_are_not_same:
            groups = scored_data if isinstance(scored_data, list) else [scored_data]
            same = sum(1 for g in groups if g is not None and g.get("scores") and len(set(g["scores"])) == 1)
            if same:
                self.stats["groups_dropped_same_scores"] += same
                log.warning("%d group(s) with all scores equal dropped (ensure_scores_are_not_same=True): "
                            "not written to the jsonl, not sent to the trainer", same)
        await super().handle_send_to_api(scored_data, item, do_send_to_api, abort_on_any_max_length_exceeded)

    # -- rollouts --------------------------------------------------------------------------
    def system_prompt(self) -> str:
        """``system_preamble`` plus the tool schemas in Hermes format; override to change the prompt."""
        return hermes_system_prompt(self.tools.schemas(), self.system_preamble)

    async def chat(self, messages: list[dict[str, Any]], session: ManagedSession | None = None) -> ChatReply:
        """One model turn: through the rollout's ManagedServer session when there is one, else
        through atroposlib's ServerManager (OpenAI-compatible servers). A failure of the server is
        raised as ``InferenceUnavailable`` (infrastructure: the rollout is retried, never scored)."""
        c = self.config
        kwargs: dict[str, Any] = {"max_tokens": c.agent_max_tokens, "temperature": c.agent_temperature}
        try:
            if session is not None:
                # no grammar here: extra_body would reach vllm's /generate as an unknown field
                return await session.chat(messages, **kwargs)
            grammar = self.turn_grammar(messages) if c.tool_call_grammar else None
            if grammar is not None:
                kwargs["extra_body"] = {"grammar": grammar}
            completion = await self.server.chat_completion(messages=messages, n=1, **kwargs)
        except Exception as exc:
            failure = inference_failure(exc)
            if failure is None:
                raise
            raise failure from exc
        choice = completion.choices[0]
        message = choice.message
        calls = None
        if getattr(message, "tool_calls", None):
            calls = [tc.model_dump() if hasattr(tc, "model_dump") else dict(tc) for tc in message.tool_calls]
        return ChatReply(text=message.content or "", tool_calls=calls, finish_reason=choice.finish_reason or "stop")

    def turn_grammar(self, messages: list[dict[str, Any]]) -> str | None:
        """The GBNF grammar for the next turn (with ``tool_call_grammar``): any tool call with
        schema-valid arguments, and after ``grammar_forced_tool_turns`` turns also a plain answer."""
        from atropos.agent.grammars import schema_grammar

        allow_answer = assistant_turns(messages) >= self.config.grammar_forced_tool_turns
        if allow_answer not in self._grammars:
            self._grammars[allow_answer] = schema_grammar(self.tools.schemas(), allow_answer=allow_answer)
        return self._grammars[allow_answer]

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
        try:
            try:
                leases = await self.pool.lease_many(ids, self.config.acquire_timeout_s,
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
            await asyncio.gather(*(self.pool.release(lease) for lease in leases), return_exceptions=True)
            if template is not None:
                try:
                    await self.pool.delete_template(template)
                except Exception as exc:  # never let cleanup mask the group's outcome
                    log.warning("could not delete group template %s: %s", template.id, exc)
        rollouts, lost = self._split_results(results)
        if lost:
            return self._backlog(item, f"a rollout was lost to infrastructure after {self.config.infra_retries} "
                                       f"retries ({type(lost[-1]).__name__}: {lost[-1]})")
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
        return group, []

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

    async def _prepare_group(self, item: Any, leases: list[Lease],
                             stats: dict[str, float] | None = None) -> PoolTemplate:
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
        stats = self.stats if stats is None else stats
        stats["group_setups"] += 1
        stats["group_setup_seconds"] += time.perf_counter() - t0
        log.debug("group %s: setup + template + %d forks in %.2fs", tid, len(leases) - 1, time.perf_counter() - t0)
        return template

    async def _rollout_with_retries(self, item: Any, lease: Lease, template: PoolTemplate | None,
                                    stats: dict[str, float]) -> Rollout:
        """``rollout`` in ``lease``; after an infrastructure failure again from scratch in a fresh slot
        (the old one's workspace is half-done or gone), up to ``infra_retries`` times."""
        assert self.pool is not None
        current = lease
        try:
            for attempt in range(self.config.infra_retries + 1):
                try:
                    return await self.rollout(item, current)
                except Exception as exc:
                    if not is_infrastructure(exc) or attempt == self.config.infra_retries:
                        raise
                    stats["infra_retries"] += 1
                    log.warning("rollout %s hit an infrastructure failure (%s: %s); retrying on a fresh slot",
                                current.trajectory_id, type(exc).__name__, exc)
                    if current is not lease:
                        await self.pool.release(current)
                    current = await self.pool.lease(f"{lease.trajectory_id}-r{attempt + 1}",
                                                    self.config.acquire_timeout_s, network=self.config.allow_network,
                                                    template=template)
            raise AssertionError("unreachable")
        finally:
            if current is not lease:
                await self.pool.release(current)

    async def rollout(self, item: Any, lease: Lease) -> Rollout:
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
                              max_tokens=self.config.agent_max_tokens,
                              max_context_tokens=self.config.max_token_length,
                              wrap_tool_responses=self.wrap_tool_responses)
            t0 = time.perf_counter()
            result, tracked, fallback = await self._run_policy(tid, messages, cfg, run_tools)
            log.debug("rollout %s: %d steps in %.1fs (%s)", tid, len(result.steps), time.perf_counter() - t0,
                      result.finish)
            if result.finish == "context_budget":
                log.info("rollout %s stopped at the context budget (%d tokens)", tid, self.config.max_token_length)
            # The verification phase: every process of the agent dies here and nothing runs in the
            # slot again (reading it and lease.verify remain), so no leftover of the rollout can
            # watch, race or rewrite what the verification reads.
            await lease.seal()
            score, _meta = await self.verify_and_score_trajectory(
                item, result.final_response, trajectory_id=tid, exec_tool=exec_tool, lease=lease, agent_result=result)
        finally:
            executor.unbind(tid)
        if tracked is not None:
            tokens, masks, logprobs = tracked.tokens, tracked.masks, tracked.logprobs
        else:
            tokenized = tokenize_conversation(self.tokenizer, result.messages)
            tokens, masks, logprobs = tokenized.tokens, tokenized.masks, None
        if all(m == IGNORE for m in masks):
            log.warning("rollout %s has no trainable token", tid)
        return Rollout(tokens=tokens, masks=masks, score=float(score), messages=result.messages, logprobs=logprobs,
                       finish=result.finish, tool_calls=result.tool_calls, sandbox_seconds=result.sandbox_seconds,
                       tracking_fallback=fallback)

    async def _run_policy(self, tid: str, messages: list[dict[str, Any]], cfg: AgentConfig, run_tools: ToolsFn,
                          ) -> tuple[AgentResult, TrackedSequence | None, bool]:
        """The agent loop, in a ManagedServer context of its own when the server gives token ids.
        Returns the result, the tracked sequence (None on the chat-template path) and whether
        ManagedServer's tracking broke and the chat template had to be used instead."""
        count = functools.partial(count_prompt_tokens, self.tokenizer)
        if not self.managed_tokens:
            return await run_agent(self.chat, run_tools, messages, cfg, count), None, False
        # One context per rollout with n=1 per turn: the rollout ends as one node, and extension
        # can never match another rollout's prefix (reference §3.2).
        async with self.server.managed_server(tokenizer=self.tokenizer) as managed:
            session = ManagedSession(managed, self.tokenizer)
            result = await run_agent(functools.partial(self.chat, session=session), run_tools, messages, cfg, count)
            try:
                return result, session.tracked(), False  # inside the block: the state resets on exit
            except TokenTrackingError as exc:
                log.warning("rollout %s: %s; using chat-template tokens without logprobs", tid, exc)
                return result, None, True

    def eval_items(self) -> list[Any]:
        """Held-out items for ``evaluate`` (default: none; override to enable evaluation)."""
        return []

    async def evaluate(self, *args: Any, **kwargs: Any) -> None:
        """One rollout per eval item, each in its own slot; logs the mean score. A rollout lost to
        infrastructure is left out (and counted), never scored 0 and never the end of the eval."""
        items = self.eval_items()
        if not items:
            return
        await self.setup_sandbox()
        assert self.pool is not None
        start = time.time()

        async def one(i: int, item: Any) -> Rollout:
            assert self.pool is not None
            lease = await self.pool.lease(f"eval-{uuid.uuid4().hex[:8]}-{i}", self.config.acquire_timeout_s,
                                          network=self.config.allow_network)
            template: PoolTemplate | None = None
            try:
                # the same start as a training rollout: the group step too (its template also
                # serves a retry on a fresh slot)
                if self.has_group_setup():
                    template = await self._prepare_group(item, [lease], self.eval_stats)
                return await self._rollout_with_retries(item, lease, template, self.eval_stats)
            finally:
                await self.pool.release(lease)
                if template is not None:  # after the release: a template in use cannot go
                    try:
                        await self.pool.delete_template(template)
                    except Exception as exc:  # never let cleanup mask the rollout's outcome
                        log.warning("could not delete eval template %s: %s", template.id, exc)

        results = await asyncio.gather(*(one(i, item) for i, item in enumerate(items)), return_exceptions=True)
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
