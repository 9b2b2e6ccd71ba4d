"""The lean HTTP/1.1 client of the hot path, against a raw asyncio server that answers exactly
what each test scripts (content-length and chunked bodies, early closes, garbage, silence)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest

from atropos.sandbox.contract.http1 import ConnectionPool, TransportError

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


async def _read_request(reader: asyncio.StreamReader) -> tuple[bytes, bytes]:
    head = await reader.readuntil(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            length = int(line.split(b":")[1])
    return head, await reader.readexactly(length)


class Server:
    def __init__(self, handler: Handler) -> None:
        self.handler = handler
        self.connections = 0
        self.heads: list[bytes] = []

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            await self.handler(reader, writer)
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    async def __aenter__(self) -> str:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        port = self.server.sockets[0].getsockname()[1]
        return f"http://127.0.0.1:{port}"

    async def __aexit__(self, *exc: object) -> None:
        self.server.close()


def echo_server(server_log: list[bytes] | None = None, close_after: int = 0) -> Handler:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        served = 0
        while True:
            head, body = await _read_request(reader)
            if server_log is not None:
                server_log.append(head)
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                         b"content-length: %d\r\n\r\n%s" % (len(body), body))
            await writer.drain()
            served += 1
            if close_after and served >= close_after:
                return
    return handler


@pytest.fixture
async def pool_factory() -> AsyncIterator[Callable[[str], ConnectionPool]]:
    pools: list[ConnectionPool] = []

    def make(url: str) -> ConnectionPool:
        pools.append(ConnectionPool(url, {"authorization": "Bearer t"}, connect_timeout_s=2))
        return pools[-1]

    yield make
    for pool in pools:
        await pool.aclose()


async def test_keep_alive_reuses_one_connection_and_sends_the_headers(pool_factory) -> None:  # type: ignore[no-untyped-def]
    heads: list[bytes] = []
    srv = Server(echo_server(heads))
    async with srv as url:
        pool = pool_factory(url)
        for i in range(5):
            resp = await pool.request("POST", "/v1/call", b'{"n":%d}' % i, timeout=5)
            assert (resp.status, resp.body) == (200, b'{"n":%d}' % i)
            assert resp.headers["content-type"] == "application/json"
        assert srv.connections == 1
        assert heads[0].startswith(b"POST /v1/call HTTP/1.1\r\n")
        assert b"authorization: Bearer t\r\n" in heads[0] and b"host: 127.0.0.1:" in heads[0]


async def test_concurrent_requests_use_separate_connections(pool_factory) -> None:  # type: ignore[no-untyped-def]
    srv = Server(echo_server())
    async with srv as url:
        pool = pool_factory(url)
        bodies = [b"%d" % i for i in range(8)]
        results = await asyncio.gather(*(pool.request("POST", "/", b, timeout=5) for b in bodies))
        assert [r.body for r in results] == bodies
        assert srv.connections <= 8


async def test_a_connection_the_server_closed_is_not_reused(pool_factory) -> None:  # type: ignore[no-untyped-def]
    srv = Server(echo_server(close_after=1))
    async with srv as url:
        pool = pool_factory(url)
        assert (await pool.request("POST", "/", b"a", timeout=5)).body == b"a"
        await asyncio.sleep(0.05)  # the close reaches us while the connection is idle
        assert (await pool.request("POST", "/", b"b", timeout=5)).body == b"b"
        assert srv.connections == 2


async def test_chunked_stream_arrives_chunk_by_chunk(pool_factory) -> None:  # type: ignore[no-untyped-def]
    release = asyncio.Event()

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n6\r\nfirst\n\r\n")
        await writer.drain()
        await release.wait()
        writer.write(b"7\r\nsecond\n\r\n0\r\n\r\n")
        await writer.drain()
        await reader.read()

    async with Server(handler) as url:
        pool = pool_factory(url)
        async with pool.stream("POST", "/v1/calls", b"{}", timeout=5) as stream:
            assert stream.status == 200
            chunks = stream.chunks()
            assert await chunks.__anext__() == b"first\n"  # before the server sent the rest
            release.set()
            assert [c async for c in chunks] == [b"second\n"]
            assert stream.reusable


async def test_a_stream_left_early_closes_its_connection(pool_factory) -> None:  # type: ignore[no-untyped-def]
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            _, body = await _read_request(reader)
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n" % len(body))
            await writer.drain()
            await asyncio.sleep(0.05)  # the body comes after the caller has left
            writer.write(body)
            await writer.drain()

    srv = Server(handler)
    async with srv as url:
        pool = pool_factory(url)
        async with pool.stream("POST", "/", b"0123456789", timeout=5) as stream:
            assert stream.status == 200  # body never read
        assert (await pool.request("POST", "/", b"next", timeout=5)).body == b"next"
        assert srv.connections == 2  # the unread body never reached the next request


@pytest.mark.parametrize("answer", [
    b"",  # closed without a word
    b"HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\nabc",  # closed mid-body
    b"SSH-2.0-OpenSSH\r\n\r\n",  # not HTTP
])
async def test_broken_answers_are_transport_errors(pool_factory, answer: bytes) -> None:  # type: ignore[no-untyped-def]
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_request(reader)
        writer.write(answer)
        await writer.drain()

    async with Server(handler) as url:
        with pytest.raises(TransportError):
            await pool_factory(url).request("POST", "/", b"x", timeout=5)


async def test_silence_times_out_and_refused_connect_fails_fast(pool_factory) -> None:  # type: ignore[no-untyped-def]
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read()

    async with Server(handler) as url:
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        with pytest.raises(TransportError, match="timed out"):
            await pool_factory(url).request("POST", "/", b"x", timeout=0.3)
        assert loop.time() - t0 < 3
    with pytest.raises(TransportError, match="connect"):
        await pool_factory(url).request("POST", "/", b"x", timeout=5)


async def test_only_plain_http_base_urls() -> None:
    with pytest.raises(ValueError, match="plain http"):
        ConnectionPool("https://example.invalid", {})


async def test_connections_are_opened_a_few_at_a_time(pool_factory, monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    """100 requests sent at once (a trainer's trajectories' first calls to one host) open their
    connections at most MAX_CONNECTING at a time, the rest waiting within their own deadline: every
    connect deadline then covers its own connect, not a storm of them (http1.MAX_CONNECTING)."""
    from atropos.sandbox.contract import http1

    connecting = most = 0
    real_open = asyncio.open_connection

    async def counted(*args: object, **kw: object) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        nonlocal connecting, most
        connecting += 1
        most = max(most, connecting)
        try:
            await asyncio.sleep(0.01)  # a connect that takes a moment, as on a busy machine
            return await real_open(*args, **kw)  # type: ignore[arg-type]
        finally:
            connecting -= 1

    monkeypatch.setattr(http1.asyncio, "open_connection", counted)
    srv = Server(echo_server())
    async with srv as url:
        pool = pool_factory(url)
        bodies = [b"%d" % i for i in range(100)]
        results = await asyncio.gather(*(pool.request("POST", "/", b, timeout=30) for b in bodies))
        assert [r.body for r in results] == bodies
        assert most == http1.MAX_CONNECTING
        assert srv.connections == pool.opened <= 100
