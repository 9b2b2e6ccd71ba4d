"""A lean HTTP/1.1 keep-alive client for the host's hot routes (one call, a batch of calls).

Measured on these 2-core machines, httpx spends ~1.7 ms of Python on each request: more than the
whole host side of a ``true`` call once a warm bash is waiting for it. This sends a prebuilt
request over a pooled keep-alive connection and parses the answer with httptools (C); it knows
exactly what the host speaks (plain HTTP/1.1, Content-Length or chunked bodies) and nothing more.
Every other route of ``HostClient`` stays on httpx.

A connection is reused only after a response was read to its end; a timeout, an error or a
caller that stops reading early closes it, so no stale bytes can reach the next request.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import httptools

from atropos.errors import TransportError
from atropos.sandbox.contract.timeouts import within

# Idle connections older than this are closed instead of reused: the host drops idle keep-alive
# connections after 120 s, and a request must never race that close (it may or may not have run).
IDLE_TTL_S = 50.0
READ_SIZE = 1 << 16
# New connections being opened to one host at once: a request beyond them waits (within its own
# deadline) for a connect slot or for a connection coming back idle. 100 trajectories' first calls to a
# host, opened together on a busy event loop, each ran a connect deadline through the whole storm
# and timed out connecting (benchmarks/README.md, pool shards).
MAX_CONNECTING = 8


@dataclass
class Response:
    status: int
    headers: dict[str, str]
    body: bytes


@dataclass
class _Exchange:
    """httptools callbacks for one response."""

    headers: dict[str, str] = field(default_factory=dict)
    chunks: deque[bytes] = field(default_factory=deque)
    headers_done: bool = False
    done: bool = False
    keep_alive: bool = False
    parser: httptools.HttpResponseParser | None = None

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers[name.decode("latin-1").lower()] = value.decode("latin-1")

    def on_headers_complete(self) -> None:
        self.headers_done = True

    def on_body(self, body: bytes) -> None:
        self.chunks.append(body)

    def on_message_complete(self) -> None:
        # asked here: once the parser moves past the message it answers False
        self.keep_alive = self.parser is not None and self.parser.should_keep_alive()
        self.done = True


class _Connection:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer
        self.idle_since = time.monotonic()

    def usable(self) -> bool:
        return (not self.writer.is_closing() and not self.reader.at_eof()
                and time.monotonic() - self.idle_since < IDLE_TTL_S)

    def close(self) -> None:
        self.writer.close()


class _Stream:
    """One response being read: status and headers first, then the body chunk by chunk."""

    def __init__(self, conn: _Connection, deadline: float) -> None:
        self.conn = conn
        self.deadline = deadline
        self.exchange = _Exchange()
        self.parser = httptools.HttpResponseParser(self.exchange)
        self.exchange.parser = self.parser
        self.status = 0

    async def _feed(self) -> None:
        remaining = self.deadline - time.monotonic()
        if remaining <= 0:
            raise TransportError("timed out")
        try:
            data = await within(self.conn.reader.read(READ_SIZE), remaining)
        except asyncio.TimeoutError:
            raise TransportError("timed out waiting for the host") from None
        except OSError as exc:
            raise TransportError(f"{type(exc).__name__}: {exc}") from None
        if not data:
            raise TransportError("the host closed the connection before the response ended")
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            raise TransportError(f"not an HTTP response: {exc}") from None

    async def head(self) -> None:
        while not self.exchange.headers_done:
            await self._feed()
        self.status = self.parser.get_status_code()

    async def chunks(self) -> AsyncIterator[bytes]:
        ex = self.exchange
        while True:
            while ex.chunks:
                yield ex.chunks.popleft()
            if ex.done:
                return
            await self._feed()

    async def read(self) -> bytes:
        return b"".join([chunk async for chunk in self.chunks()])

    @property
    def reusable(self) -> bool:
        return self.exchange.done and self.exchange.keep_alive


class ConnectionPool:
    """Keep-alive connections to one ``http://host:port`` base URL."""

    def __init__(self, base_url: str, headers: dict[str, str], *, connect_timeout_s: float = 5.0,
                 max_idle: int = 64, max_connecting: int = MAX_CONNECTING) -> None:
        url = urlsplit(base_url)
        if url.scheme != "http" or not url.hostname:
            raise ValueError(f"the lean client speaks plain http only, not {base_url!r}")
        self.host, self.port = url.hostname, url.port or 80
        host_header = url.netloc
        self._fixed = "".join(f"{k}: {v}\r\n" for k, v in {"host": host_header, **headers}.items())
        self.connect_timeout_s = connect_timeout_s
        self.max_idle = max_idle
        self._idle: list[_Connection] = []
        self._closed = False
        self._connecting = asyncio.Semaphore(max_connecting)
        self.opened = 0  # connections opened in this pool's life

    def _reuse(self) -> _Connection | None:
        while self._idle:
            conn = self._idle.pop()
            if conn.usable():
                return conn
            conn.close()
        return None

    async def _connect(self, deadline: float) -> _Connection:
        conn = self._reuse()
        if conn is not None:
            return conn
        where = f"{self.host}:{self.port}"
        if self._connecting.locked():  # others are connecting: wait for a turn, within the request's deadline
            try:
                await asyncio.wait_for(self._connecting.acquire(), max(deadline - time.monotonic(), 0.0))
            except asyncio.TimeoutError:
                raise TransportError(f"no connection to {where} within the request's deadline") from None
        else:
            await self._connecting.acquire()  # free: at once
        try:
            conn = self._reuse()  # one came back idle while this request waited
            if conn is not None:
                return conn
            try:
                reader, writer = await asyncio.wait_for(
                    asyncio.open_connection(self.host, self.port, limit=READ_SIZE), self.connect_timeout_s)
            except asyncio.TimeoutError:
                raise TransportError(f"connect to {where} timed out") from None
            except OSError as exc:
                raise TransportError(f"connect to {where}: {exc}") from None
        finally:
            self._connecting.release()
        self.opened += 1
        return _Connection(reader, writer)

    def _release(self, conn: _Connection, reusable: bool) -> None:
        if reusable and not self._closed and len(self._idle) < self.max_idle:
            conn.idle_since = time.monotonic()
            self._idle.append(conn)
        else:
            conn.close()

    @asynccontextmanager
    async def stream(self, method: str, path: str, body: bytes, *, timeout: float,
                     content_type: str = "application/json") -> AsyncIterator[_Stream]:
        """Send one request; the caller reads the response from the yielded stream."""
        if self._closed:
            raise TransportError("the client is closed")
        deadline = time.monotonic() + timeout
        conn = await self._connect(deadline)
        reusable = False
        try:
            head = (f"{method} {path} HTTP/1.1\r\n{self._fixed}content-type: {content_type}\r\n"
                    f"content-length: {len(body)}\r\n\r\n").encode("latin-1")
            try:
                conn.writer.write(head + body)  # one write: head and a small body in one segment
                await conn.writer.drain()
            except OSError as exc:
                raise TransportError(f"{type(exc).__name__}: {exc}") from None
            stream = _Stream(conn, deadline)
            await stream.head()
            yield stream
            reusable = stream.reusable
        finally:
            self._release(conn, reusable)

    async def request(self, method: str, path: str, body: bytes, *, timeout: float) -> Response:
        async with self.stream(method, path, body, timeout=timeout) as stream:
            data = await stream.read()
            return Response(stream.status, stream.exchange.headers, data)

    async def aclose(self) -> None:
        self._closed = True
        idle, self._idle = self._idle, []
        for conn in idle:
            conn.close()
