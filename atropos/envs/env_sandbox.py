"""AgentEnv's sandbox and run lifecycle: the slot pool and tool executor started in ``setup`` and
stopped when the run ends in every mode (BaseEnv has no teardown hook), the verifier check, and
the run summary."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from atropos.envs import score_info
from atropos.envs.env_base import AgentEnvBase
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
                report = Path(str(path).rsplit(".", 1)[0] + ".html")
                append_to_html(report, self.verifier_results)
                score_info.append_to_html(report, Path(path))

    async def env_manager(self) -> Any:
        """``serve`` mode: BaseEnv's loop, then the pool is stopped and the summary printed."""
        try:
            return await super().env_manager()
        finally:
            await self._end_run()

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
