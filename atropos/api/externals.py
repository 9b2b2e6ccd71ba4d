"""External tools the ToolServer runs itself (secrets and internet stay on the server)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from atropos.api.server import InvokeResponse
from atropos.tools.web import SearchProvider, run_web_tool

Handler = Callable[[dict[str, Any]], Awaitable[InvokeResponse]]


def web_externals(provider: SearchProvider) -> dict[str, Handler]:
    def handler(tool: str) -> Handler:
        async def invoke(args: dict[str, Any]) -> InvokeResponse:
            return InvokeResponse(ok=True, content=await run_web_tool(provider, tool, args))

        return invoke

    return {name: handler(name) for name in ("web_search", "web_extract")}
