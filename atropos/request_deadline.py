"""A deadline on reading each HTTP request, for the ToolServer and the sandbox host.

uvicorn times out only idle keep-alive connections: a client that opens a connection and sends
nothing, or sends half a request head, or announces a body and never finishes it, holds the
connection (and for a body, the handler waiting on it) for as long as it likes. With a few
thousand such connections a server runs out of descriptors. Here every request must arrive whole
(head and body) within ``read_timeout_s`` of its first byte (or of the connection, for the first
one); otherwise the server answers 408 if nothing was answered yet, and closes the connection,
which the handler reading the body sees as a disconnect. The time a handler takes to answer is
not limited here (calls carry their own timeouts).

A body still arriving at ``MIN_BODY_RATE`` or more is not cut: each ``read_timeout_s`` window
that brought at least ``read_timeout_s * MIN_BODY_RATE`` bytes of it extends the deadline by
another window. An image or template upload of gigabytes takes minutes on a loaded machine (a
1 GB image archive was cut at 466 MiB by the 60 s deadline); a client trickling a body still loses
the connection within a window.
"""

from __future__ import annotations

import asyncio
from typing import Any

import uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

DEFAULT_READ_TIMEOUT_S = 60.0
MIN_BODY_RATE = 1 << 20  # bytes/s: a body arriving at least this fast keeps its request's connection
_TIMEOUT_RESPONSE = b"HTTP/1.1 408 Request Timeout\r\ncontent-length: 0\r\nconnection: close\r\n\r\n"


class DeadlineHttpToolsProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with a per-request read deadline (see the module)."""

    read_timeout_s = DEFAULT_READ_TIMEOUT_S
    _deadline: asyncio.TimerHandle | None = None
    _head_done = False  # the current request's head was read (the app runs and owns the answer)
    _window_bytes = 0  # body bytes since the deadline was (re)armed

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()

    def on_message_begin(self) -> None:
        super().on_message_begin()
        if self._deadline is None:
            self._arm()

    def on_headers_complete(self) -> None:
        self._head_done = True
        super().on_headers_complete()

    def on_body(self, body: bytes) -> None:
        self._window_bytes += len(body)
        super().on_body(body)

    def on_message_complete(self) -> None:
        super().on_message_complete()
        self._disarm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _arm(self) -> None:
        self._head_done = False
        self._window_bytes = 0
        self._deadline = asyncio.get_running_loop().call_later(self.read_timeout_s, self._expired)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _expired(self) -> None:
        self._deadline = None
        if self.transport.is_closing():
            return
        if self._head_done and self._window_bytes >= self.read_timeout_s * MIN_BODY_RATE:
            self._window_bytes = 0  # a body still coming at the minimum rate: one more window
            self._deadline = asyncio.get_running_loop().call_later(self.read_timeout_s, self._expired)
            return
        if not self._head_done:
            self.transport.write(_TIMEOUT_RESPONSE)
        self.transport.close()


def protocol_class(read_timeout_s: float) -> type[DeadlineHttpToolsProtocol]:
    return type("DeadlineHttpToolsProtocol", (DeadlineHttpToolsProtocol,), {"read_timeout_s": read_timeout_s})


def server_config(app: Any, read_timeout_s: float = DEFAULT_READ_TIMEOUT_S, **kw: Any) -> uvicorn.Config:
    """uvicorn's config with the request read deadline (``kw``: uvicorn.Config's own options)."""
    return uvicorn.Config(app, http=protocol_class(read_timeout_s), **kw)
