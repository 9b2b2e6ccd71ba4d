"""An ASGI app (a ToolServer, mostly) served by a real uvicorn on a loopback port the kernel picked, in
the test's own event loop: real HTTP, with no port race (the socket is bound before the server
starts) and no server left running after the test."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator
from typing import Any

import uvicorn


@contextlib.asynccontextmanager
async def serve_on_loopback(app: Any, config: uvicorn.Config | None = None
                            ) -> AsyncIterator[tuple[str, uvicorn.Server]]:
    """Serve ``app`` until the block ends; yields its base URL (``http://127.0.0.1:<port>``) and the
    server. ``config`` overrides the default one (quiet, with lifespan): it must serve ``app``. A
    server that fails to start raises its own error instead of waiting for ever."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(config or uvicorn.Config(app, log_level="warning", lifespan="on"))
    task = asyncio.create_task(server.serve(sockets=[sock]))
    try:
        while not server.started:
            await asyncio.sleep(0.05)
            if task.done():
                task.result()
                raise RuntimeError("the server stopped before it started")
        yield f"http://127.0.0.1:{sock.getsockname()[1]}", server
    finally:
        server.should_exit = True
        await task
        sock.close()
