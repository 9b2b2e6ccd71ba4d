"""AgentEnv's sandbox and run lifecycle: the slot pool and tool executor started in ``setup`` and
stopped when the run ends in every mode (BaseEnv has no teardown hook), the verifier check, and
the run summary; in serve mode also how many groups run at once, the stop once the trainer has
taken ``total_steps`` batches, and the check for a run-api left over from an earlier run."""

from __future__ import annotations

import asyncio
import logging
import sys
from pathlib import Path
from typing import Any

import httpx

from atropos.envs.env_base import AgentEnvBase
from atropos.envs.serve_pace import default_max_workers
from atropos.envs.verifier_check import (
    VerifierCheckResult,
    append_to_html,
    run_checks,
    summary_lines,
)
from atropos.slots.config import PoolConfig
from atropos.slots.pool import PoolStatus, SlotPool
from atropos.tools.executor import ExecutorConfig, ToolExecutor
from atropos.tools.registry import ToolRegistry

log = logging.getLogger("atropos.envs.agent_env")


class _TrainerDone(Exception):
    """Serve mode: the trainer has taken ``total_steps`` batches (ends BaseEnv's loop, not an error)."""


def _say(line: str) -> None:
    print(f"[atropos-sandbox] {line}", file=sys.stderr, flush=True)


class SandboxEnv(AgentEnvBase):
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

    async def setup_sandbox(self) -> None:
        """Start the slot pool and the tool executor (once; later calls do nothing)."""
        if self.pool is not None:
            return
        c = self.config
        self.pool = SlotPool(self.build_backend(), PoolConfig(
            pool_id=self.build_backend_pool_id(), min_hosts=c.min_hosts, max_hosts=c.max_hosts,
            acquire_timeout_s=c.acquire_timeout_s))
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
            await self._end_run()
            path = getattr(self.config, "data_path_to_save_groups", None)
            if path:
                append_to_html(Path(str(path).rsplit(".", 1)[0] + ".html"), self.verifier_results)

    async def env_manager(self) -> Any:
        """``serve`` mode: BaseEnv's loop until the trainer has taken ``total_steps`` batches; then
        every running group is cancelled and waited for (its slots released) before the pool stops
        and the summary is printed, also when the run is stopped by SIGTERM or Ctrl-C."""
        self._serve_mode = True
        try:
            return await super().env_manager()
        except _TrainerDone:
            _say(f"the trainer has taken {self.config.total_steps} batch(es) (total_steps): stopping")
            return None
        finally:
            await self._stop_rollouts()
            await self._end_run()

    async def handle_env(self, item_uuid: str) -> Any:
        """BaseEnv's worker for one group, tracked until it has ended: BaseEnv cancels workers
        (total_steps, queue full, worker_timeout) without waiting for them, and a group's slots
        must be released before the pool stops."""
        task = asyncio.current_task()
        if task is not None:
            self._rollout_tasks.add(task)
        try:
            return await super().handle_env(item_uuid)
        finally:
            if task is not None:
                self._rollout_tasks.discard(task)

    async def _stop_rollouts(self) -> None:
        tasks = [t for t in self._rollout_tasks if t is not asyncio.current_task()]
        for task in tasks:
            task.cancel()
        # each releases its slots in its finally; nothing they raise matters once the run is over
        await asyncio.gather(*tasks, return_exceptions=True)

    async def get_status(self) -> None:
        """BaseEnv's, then the end of the run as soon as the trainer has taken ``total_steps``
        batches (BaseEnv waits for one more batch in the queue, which nobody will take)."""
        await super().get_status()
        if self.status_dict["current_step"] >= self.config.total_steps > 0:
            raise _TrainerDone

    async def register_env(self) -> None:
        """BaseEnv's, then a warning if run-api already holds groups or steps this env did not
        make: a run-api left running by an earlier run hands its groups to the new trainer first."""
        await super().register_env()
        try:
            async with httpx.AsyncClient(timeout=10) as client:
                status = (await client.get(f"{self.config.rollout_server_url}/status")).json()
            queued, step = int(status["queue_size"]), int(status["current_step"])
        except (httpx.HTTPError, ValueError, KeyError, TypeError) as exc:
            log.debug("run-api /status unreadable (%s); no leftover check", exc)
            return
        if queued or step:
            _say(f"warning: run-api at {self.config.rollout_server_url} already holds {queued} group(s) and is at "
                 f"step {step} before this env sent anything: left over from an earlier run, unless another env "
                 "sent them or the trainer resumed at that step. A trainer gets those groups first, and a step "
                 "at total_steps ends this env at once. Start a fresh run-api for each run, or have the trainer "
                 "GET /reset_data before it registers (docs/write-an-environment.md, section 5).")

    async def get_server_info(self) -> None:
        """BaseEnv's (the trainer's batch size), then ``max_num_workers`` when left at -1: the
        groups of one batch (serve_pace.py says why not atroposlib's 8 per server)."""
        await super().get_server_info()
        c = self.config
        if c.max_num_workers == -1:
            c.max_num_workers = default_max_workers(
                batch_size=c.batch_size, group_size=c.group_size,
                atroposlib_default=c.max_num_workers_per_node * len(self.server.servers),
                pool_slots=c.max_hosts * c.slots_per_host)
            self.max_num_workers = c.max_num_workers
        _say(f"serve: up to {c.max_num_workers} group(s) of {c.group_size} at once (--env.max_num_workers; "
             f"the trainer's batch is {c.batch_size}), each cancelled after {c.worker_timeout:.0f} s "
             "(--env.worker_timeout)")

    def _turn_done(self, seconds: float) -> None:
        """A model turn took ``seconds``: in serve mode, warn once if rollouts at this pace outlive
        ``worker_timeout``."""
        if not self._serve_mode:
            return
        self.pace.add(seconds)
        c = self.config
        warning = self.pace.warning(max_steps=c.agent_max_steps, worker_timeout=c.worker_timeout,
                                    groups_running=max(1, len(self.running_items)), group_size=c.group_size,
                                    max_workers=self.max_num_workers)
        if warning:
            _say(warning)

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
