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
from pathlib import Path
from typing import Any

from atroposlib.envs.base import APIServerConfig, BaseEnv, ScoredDataGroup

from atropos.agent.errors import inference_failure, is_infrastructure
from atropos.agent.loop import AgentResult, ChatReply, assistant_turns, hermes_system_prompt
from atropos.agent.managed import ManagedSession, servers_give_token_ids
from atropos.agent.tokens import template_wraps_tool_responses
from atropos.backends.base import Backend
from atropos.backends.config import BackendSettings
from atropos.envs import env_cli, score_info
from atropos.envs.config import AgentEnvConfig, backend_settings
from atropos.envs.env_base import ExecTool, Rollout, _new_stats
from atropos.envs.env_rollout import RolloutRunner
from atropos.envs.env_sandbox import EnvSandbox
from atropos.envs.score_info import ERROR_KEY, INFO_KEY, error_shares, rollout_info
from atropos.envs.serve_pace import ServeMode, TrainerDone, say
from atropos.envs.verifier_check import VerifierCheck, VerifierCheckResult, append_to_html, run_checks, summary_lines
from atropos.errors import ConfigError, ImageRejected, InfrastructureError
from atropos.progress import GroupProgress
from atropos.slots.lease import Lease, PoolTemplate
from atropos.slots.pool import PoolStatus, SlotPool
from atropos.tools.executor import ToolExecutor
from atropos.tools.registry import ToolRegistry

__all__ = ["AgentEnv", "AgentEnvConfig", "ExecTool", "Rollout"]

log = logging.getLogger(__name__)

# process mode: a group lost to infrastructure is retried in place (BaseEnv drops a returned backlog
# there); after this many lost in a row the platform is down and the run stops with the last error.
PROCESS_MAX_LOST_GROUPS = 5


class AgentEnv(BaseEnv):
    """Subclass it (see the module docstring). It holds the hooks and BaseEnv's glue; the work is done by
    collaborators that each own their state: ``sandbox`` (the pool and the tool executor,
    env_sandbox.py), ``rollouts`` (one rollout in one slot, its retries, the group step; env_rollout.py)
    and the command line (env_cli.py)."""

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
        self.sandbox = EnvSandbox()  # the slot pool and the tool executor (env_sandbox.py)
        self.rollouts = RolloutRunner(self)  # one rollout, its retries, the group step (env_rollout.py)
        self.stats = _new_stats()
        self.eval_stats = _new_stats()  # kept apart: eval rollouts must not move training metrics
        self._process_mode = False
        self.serve = ServeMode()  # what serve mode does differently (serve_pace.py)
        self._lost_in_a_row = 0
        self.rejected_items: list[tuple[str, str]] = []  # (image, why) of items skipped: their image was refused
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

    # -- the hooks a subclass implements or overrides ---------------------------------------
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

    def item_image(self, item: Any) -> str | None:
        """The task image a rollout of ``item`` runs on (its slot's ``/``; docs/task-images.md):
        the item's ``image`` key by default (a Docker engine reference, or ``oci:PATH``); None: the
        default root. Override for datasets that name it otherwise."""
        image = item.get("image") if isinstance(item, dict) else getattr(item, "image", None)
        return image if isinstance(image, str) and image else None

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

    # -- the model turn and one rollout -------------------------------------------------------
    async def chat(self, messages: list[dict[str, Any]], session: ManagedSession | None = None) -> ChatReply:
        """One model turn: through the rollout's ManagedServer session when there is one, else
        through atroposlib's ServerManager (OpenAI-compatible servers). A failure of the server is
        raised as ``InferenceUnavailable`` (infrastructure: the rollout is retried, never scored).
        Timed: serve mode warns when turns this slow make a rollout outlive ``worker_timeout``."""
        t0 = time.monotonic()
        reply = await self._model_turn(messages, session)
        self.serve.turn_done(time.monotonic() - t0, self.config, len(self.running_items), self.max_num_workers)
        return reply

    async def _model_turn(self, messages: list[dict[str, Any]], session: ManagedSession | None) -> ChatReply:
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

    async def rollout(self, item: Any, lease: Lease) -> Rollout:
        """One trajectory in one slot: setup, agent loop, in-slot verification, tokens and masks
        (``RolloutRunner.rollout``)."""
        return await self.rollouts.rollout(item, lease)

    # -- the sandbox side (EnvSandbox) --------------------------------------------------------
    @property
    def pool(self) -> SlotPool | None:
        """The slot pool, from ``setup_sandbox`` until the run ends (None outside)."""
        return self.sandbox.pool

    @property
    def executor(self) -> ToolExecutor | None:
        """The tool executor over ``pool`` (None outside a run)."""
        return self.sandbox.executor

    async def setup_sandbox(self) -> None:
        """Start the slot pool and the tool executor (once; later calls do nothing), then import
        the task images ``images_to_prepare`` names into every host (a first rollout of each then
        starts without waiting for it; docs/task-images.md)."""
        started = self.pool is None
        await self.sandbox.start(self.build_backend, self.build_backend_pool_id(), self.config, self.tools)
        images = self.images_to_prepare() if started else []
        if images and self.pool is not None:
            await self.pool.prepare_images(images)

    def images_to_prepare(self) -> list[str]:
        """Task images the env's dataset names, imported into the hosts when the pool starts.
        Default: none (each is imported on its first lease); an env with a known set of task
        images returns them (e.g. ``sorted({row["image"] for row in self.dataset})``)."""
        return []

    async def shutdown_sandbox(self) -> None:
        """Stop the executor and the pool (every sandbox host goes). Safe to call twice."""
        await self.sandbox.stop()

    # -- the run's lifecycle (BaseEnv's hooks) ------------------------------------------------
    async def setup(self) -> None:
        """BaseEnv's hook: start the slot pool, then ``setup_agent_env``. Call it first when overriding."""
        await self.setup_sandbox()
        await self.setup_agent_env()
        if self._process_mode and self.config.verifier_check:
            await self.check_verifier()

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

    async def process_manager(self) -> Any:
        """``process`` mode: BaseEnv's loop, then the pool is stopped and the summary printed."""
        self._process_mode = True
        try:
            return await super().process_manager()
        finally:
            await self._end_run()
            path = getattr(self.config, "data_path_to_save_groups", None)
            if path:
                report = Path(str(path).rsplit(".", 1)[0] + ".html")
                append_to_html(report, self.verifier_results)
                score_info.append_to_html(report, Path(path))

    async def env_manager(self) -> Any:
        """``serve`` mode: BaseEnv's loop until the trainer has taken ``total_steps`` batches; then
        every running group is cancelled and waited for (its slots released) before the pool stops
        and the summary is printed, also when the run is stopped by SIGTERM or Ctrl-C."""
        self.serve.start()
        try:
            return await super().env_manager()
        except TrainerDone:
            say(f"the trainer has taken {self.config.total_steps} batch(es) (total_steps): stopping")
            return None
        finally:
            await self.serve.stop_rollouts()
            await self._end_run()

    async def handle_env(self, item_uuid: str) -> Any:
        """BaseEnv's worker for one group, tracked until it has ended (``ServeMode.tracked``)."""
        return await self.serve.tracked(super().handle_env(item_uuid))

    async def get_status(self) -> None:
        """BaseEnv's, then the end of the run once the trainer has taken ``total_steps`` batches."""
        await super().get_status()
        if self.serve.trainer_done(self.status_dict, self.config.total_steps):
            raise TrainerDone

    async def register_env(self) -> None:
        """BaseEnv's, then a warning if run-api already holds what an earlier run left."""
        await super().register_env()
        await self.serve.check_leftover(self.config.rollout_server_url)

    async def get_server_info(self) -> None:
        """BaseEnv's (the trainer's batch size), then ``max_num_workers`` when left at -1."""
        await super().get_server_info()
        self.config.max_num_workers = self.max_num_workers = self.serve.workers(self.config, len(self.server.servers))

    async def _end_run(self) -> None:
        """The pool's last status, then the pool down, then the summary (with what the pool ran)."""
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
        errors = {k.split("/", 1)[1]: int(v) for k, v in s.items() if k.startswith("verifier_error/")}
        if errors:
            print("[atropos-sandbox] verifier errors (rollouts): " + "  ".join(
                f"{code} {n}/{rollouts}" for code, n in sorted(errors.items())), flush=True)
        for line in summary_lines(self.verifier_results):
            print(f"[atropos-sandbox] {line}", flush=True)
        if s["groups_dropped_same_scores"]:
            print(f"[atropos-sandbox] {int(s['groups_dropped_same_scores'])} group(s) dropped, not saved or sent: "
                  "all scores equal and ensure_scores_are_not_same=True", flush=True)
        if path:
            print(f"[atropos-sandbox] data: {path}  html: {str(path).rsplit('.', 1)[0]}.html", flush=True)

    async def wandb_log(self, wandb_metrics: dict[str, Any] | None = None) -> None:
        """BaseEnv's, plus ``score_metrics()``."""
        await super().wandb_log({**(wandb_metrics or {}), **self.score_metrics()})

    def score_metrics(self) -> dict[str, float]:
        """``train/verifier_error/<code>``: the share of the rollouts since the last call whose
        verifier returned that ``verifier_error`` (0.0 for a code seen earlier in the run only)."""
        s, last = self.stats, getattr(self, "_stats_logged", {})
        self._stats_logged = dict(s)
        n = s["rollouts"] - last.get("rollouts", 0)
        if not n:
            return {}
        return {f"train/{k}": (v - last.get(k, 0)) / n for k, v in sorted(s.items()) if k.startswith("verifier_error/")}

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

    # -- the command line (env_cli.py) --------------------------------------------------------
    @classmethod
    def config_init(cls) -> tuple[AgentEnvConfig, list[APIServerConfig]]:
        """Defaults for the CLI (``env_cli.default_config``): a LIST of ``APIServerConfig`` and a
        ``wandb_name`` even when a subclass does not override this."""
        return env_cli.default_config(cls)

    @classmethod
    def cli(cls) -> None:
        """``python your_env.py process|serve|evaluate [--env.* --openai.*]``: BaseEnv's CLI, with
        wandb off unless asked and SIGTERM stopping the run as Ctrl-C does (``env_cli.run_cli``)."""
        env_cli.run_cli(cls, super().cli)

    @classmethod
    def print_defaults(cls) -> None:
        """What this env's ``config_init`` sets (``--help`` lists atroposlib's class defaults instead)."""
        env_cli.print_defaults(cls)

    # -- groups and evaluation ----------------------------------------------------------------
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

    def _rejected(self, item: Any, exc: ImageRejected) -> tuple[None, list[Any]]:
        """An item whose task image no host takes (docs/task-images.md, "Refused at the door"):
        skipped once with the reason, never retried (every lease of it would be refused alike)."""
        log.error("item skipped: its task image %r was refused (%s)", self.item_image(item), exc)
        self.stats["items_rejected"] += 1
        self.rejected_items.append((self.item_image(item) or "", str(exc)))
        return None, []

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
        image = self.item_image(item)
        leases: list[Lease] = []
        template: PoolTemplate | str | None = None  # str: an image derived from the group's setup
        pool = self.pool  # the finally releases into this pool even if the run is ending
        try:
            try:
                leases = await pool.lease_many(ids, self.config.acquire_timeout_s,
                                               network=self.config.allow_network,
                                               colocate=True if group_setup else None, image=image)
                if group_setup:
                    template = await self.rollouts.prepare_group(item, leases)
            except Exception as exc:
                if isinstance(exc, ImageRejected):  # its image, or the group's derived one (the finally releases)
                    return self._rejected(item, exc)
                if not is_infrastructure(exc):
                    raise
                what = "group setup failed" if leases else f"could not lease a group of {len(ids)}"
                return self._backlog(item, f"{what} ({type(exc).__name__}: {exc})")
            results = await asyncio.gather(
                *(self.rollouts.with_retries(item, lease, template, self.stats) for lease in leases),
                return_exceptions=True)
        finally:
            await asyncio.gather(*(pool.release(lease) for lease in leases), return_exceptions=True)
            await self._drop_template(template, "group")
        rollouts, lost = self._split_results(results)
        if lost:
            return self._backlog(item, f"a rollout was lost to infrastructure after {self.config.infra_retries} "
                                       f"retries ({type(lost[-1]).__name__}: {lost[-1]})")
        return self._scored_group(rollouts), []

    async def _drop_template(self, template: PoolTemplate | str | None, what: str) -> None:
        """Delete a group's template after its slots are released (a template in use cannot go).
        A derived image (str) stays in the image store until its disk budget evicts it."""
        if template is None or isinstance(template, str) or self.pool is None:
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
        # why each rollout scored so: per-rollout overrides are the field atroposlib keeps in the
        # jsonl and passes through to the trainer's batch untouched
        group["overrides"] = [{INFO_KEY: rollout_info(r.finish, r.info)} for r in rollouts]
        if rollouts and all(r.logprobs is not None for r in rollouts):
            group["inference_logprobs"] = [r.logprobs for r in rollouts]
        self._hint_no_tool_calls(rollouts)
        self.progress.group_done(rollouts=int(self.stats["rollouts"]), tool_calls=int(self.stats["tool_calls"]),
                                 total_groups=getattr(self, "n_groups_to_process", None))
        return group

    def _hint_no_tool_calls(self, rollouts: list[Rollout]) -> None:
        """Once per run: a group where no rollout called a tool, without the tool-call grammar, is
        what a small model does (it answers at once); say which flags make it call tools."""
        if (not rollouts or any(r.tool_calls for r in rollouts) or self.config.tool_call_grammar
                or self.managed_tokens or getattr(self, "_hinted_no_tools", False)):
            return
        self._hinted_no_tools = True
        log.warning("no rollout of this group called a tool. A small model (e.g. the project's SmolLM2-135M on "
                    "llama.cpp) answers at once unless constrained: --env.tool_call_grammar true "
                    "--env.grammar_forced_tool_turns 2 make its first turns well-formed tool calls "
                    "(llama.cpp servers; docs/write-an-environment.md)")

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
        if (error := rollout.info.get(ERROR_KEY)) is not None:  # the run's share per verifier error
            key = f"verifier_error/{error}"
            stats[key] = stats.get(key, 0) + 1

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
        metrics.update(error_shares((rollout_info(r.finish, r.info) for r in done), "eval/"))
        # evaluate_log writes files only with data_dir_to_save_evals: the result is always printed
        print("[atropos-sandbox] eval: " + "  ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}"
                                                     for k, v in metrics.items()), flush=True)
        await self.evaluate_log(metrics=metrics, start_time=start, end_time=time.time(),
                                samples=[{"messages": r.messages, "score": r.score,
                                          INFO_KEY: rollout_info(r.finish, r.info)} for r in done])

    async def _eval_rollout(self, i: int, item: Any) -> Rollout:
        """One eval rollout in its own slot, started as a training rollout is: the group step too
        (its template also serves a retry on a fresh slot)."""
        assert self.pool is not None
        lease = await self.pool.lease(f"eval-{uuid.uuid4().hex[:8]}-{i}", self.config.acquire_timeout_s,
                                      network=self.config.allow_network, image=self.item_image(item))
        template: PoolTemplate | str | None = None
        try:
            if self.has_group_setup():
                template = await self.rollouts.prepare_group(item, [lease], self.eval_stats)
            return await self.rollouts.with_retries(item, lease, template, self.eval_stats)
        finally:
            await self.pool.release(lease)
            await self._drop_template(template, "eval")
