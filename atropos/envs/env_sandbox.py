"""AgentEnv's sandbox side (``env.sandbox``): the slot pool and the tool executor, started once by
``setup_sandbox`` and stopped once when the run ends in every mode (BaseEnv has no teardown hook);
it alone sets them."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from atropos.backends.base import Backend
from atropos.envs.config import AgentEnvConfig
from atropos.slots.config import PoolConfig
from atropos.slots.pool import SlotPool
from atropos.tools.executor import ExecutorConfig, ToolExecutor
from atropos.tools.registry import ToolRegistry


class EnvSandbox:
    """Owns the env's pool and executor: ``start`` sets them, ``stop`` clears them."""

    def __init__(self) -> None:
        self.pool: SlotPool | None = None
        self.executor: ToolExecutor | None = None

    async def start(self, build_backend: Callable[[], Backend], pool_id: str, c: AgentEnvConfig,
                    tools: ToolRegistry) -> None:
        """Start the slot pool and the tool executor (once; later calls do nothing)."""
        if self.pool is not None:
            return
        self.pool = SlotPool(build_backend(), PoolConfig(
            pool_id=pool_id, min_hosts=c.min_hosts, max_hosts=c.max_hosts,
            acquire_timeout_s=c.acquire_timeout_s))
        await self.pool.start()
        url, token, transport = c.tool_server_url, c.tool_server_token, None
        if url == "inprocess":
            url, token, transport = self._inprocess_tool_server()
        self.executor = ToolExecutor(self.pool, tools, ExecutorConfig(
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

    async def stop(self) -> None:
        """Stop the executor and the pool (every sandbox host goes). Safe to call twice."""
        if self.executor is not None:
            await self.executor.close()
            self.executor = None
        if self.pool is not None:
            await self.pool.stop()
            self.pool = None
