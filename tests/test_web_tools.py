"""Web tools: the offline BM25 corpus provider and the HTTP provider against a local stub server."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
import traceback
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from atropos.errors import ConfigError, InfrastructureError, ToolInputError
from atropos.tools import web
from atropos.tools.registry import ToolRegistry
from atropos.tools.web import (
    ExtractedPage,
    HttpSearchProvider,
    OfflineCorpusProvider,
    SearchHit,
    TokenBucket,
    WebExtractArgs,
    WebSearchArgs,
    WebToolsConfig,
    format_extract,
    format_search,
    load_corpus,
    make_provider,
    run_web_tool,
    split_passages,
    tokenize,
    truncate,
)

KEY = "tvly-test-SECRET-0123456789abcdef"
KEY_ENV = "ATROPOS_TEST_WEB_KEY"


# --------------------------------------------------------------------------- helpers and arguments


def test_tokenize_lowercases_strips_punctuation_and_stopwords() -> None:
    assert tokenize("What is the Capital of France?!") == ["capital", "france"]
    assert tokenize("os.path.join(a_b)") == ["os", "path", "join", "b"]


def test_truncate_caps_length_at_word_boundary() -> None:
    text = "alpha beta gamma delta epsilon " * 20
    for limit in (1, 10, 37, 100):
        out = truncate(text, limit)
        assert len(out) <= limit
    assert truncate("short", 10) == "short"
    assert truncate(text, 37).endswith("…")
    assert not truncate(text, 37)[:-1].endswith(" ")


def test_split_passages_respects_target() -> None:
    text = "\n\n".join([f"Sentence number {i} is here. " * 6 for i in range(10)])
    passages = split_passages(text, 200)
    assert passages and all(len(p) <= 200 for p in passages)
    assert " ".join(passages).split() == text.split()


def test_arg_models_are_model_facing_schemas() -> None:
    schema = WebSearchArgs.model_json_schema()
    assert "web_extract" in (schema["description"])
    assert schema["properties"]["query"]["minLength"] == 1
    assert schema["properties"]["query"]["maxLength"] == 500
    assert schema["properties"]["max_results"]["maximum"] == 20
    assert schema["required"] == ["query"]
    ex = WebExtractArgs.model_json_schema()
    assert ex["properties"]["urls"]["maxItems"] == 5
    assert ex["properties"]["max_chars"]["default"] == 8000
    with pytest.raises(ValidationError):
        WebSearchArgs(query="")
    with pytest.raises(ValidationError):
        WebSearchArgs(query="x" * 501)
    with pytest.raises(ValidationError):
        WebSearchArgs(query="x", max_results=21)
    with pytest.raises(ValidationError):
        WebExtractArgs(urls=[])
    with pytest.raises(ValidationError):
        WebExtractArgs(urls=["corpus://a"] * 6)


def test_registry_exposes_web_tools() -> None:
    reg = ToolRegistry.default(with_web=True)
    assert {"web_search", "web_extract"} <= set(reg.names())
    tool = reg.get("web_search")
    assert tool is not None and tool.kind == "external" and tool.description.startswith("Search the web")


def test_format_search_and_extract() -> None:
    hits = [SearchHit(title="Nile", url="corpus://geography/nile", snippet="The Nile is long."),
            SearchHit(title="", url="https://x.test/a", snippet="no title")]
    text = format_search(hits, "longest river")
    assert "[1] Nile\nURL: corpus://geography/nile\nThe Nile is long." in text
    assert "[2] https://x.test/a\nURL: https://x.test/a" in text
    assert format_search([], "nothing") == "No results for 'nothing'."
    pages = [ExtractedPage(url="corpus://a", title="A", content="body of a"),
             ExtractedPage(url="corpus://b", error="not found")]
    out = format_extract(pages)
    assert "[1] A\nURL: corpus://a\n\nbody of a" in out
    assert "[2] corpus://b\nError: not found" in out


# --------------------------------------------------------------------------- offline provider


@pytest.fixture(scope="module")
def builtin() -> OfflineCorpusProvider:
    return OfflineCorpusProvider()


def test_builtin_corpus_is_shipped(builtin: OfflineCorpusProvider) -> None:
    docs = builtin.documents
    assert 35 <= len(docs) <= 60
    assert len({d.url for d in docs}) == len(docs)
    assert all(d.url.startswith("corpus://") and d.title and len(d.text.split()) >= 150 for d in docs)


@pytest.mark.parametrize(("query", "expected"), [
    ("chain iterables lazily, combinations and permutations", "corpus://python/itertools"),
    ("highest mountain above sea level", "corpus://geography/mount-everest"),
    ("change file permissions of a script", "corpus://linux/chmod"),
    ("how do plants convert sunlight and carbon dioxide into glucose", "corpus://science/photosynthesis"),
    ("What is the capital of France?", "corpus://geography/france"),
    ("longest river in Africa", "corpus://geography/nile"),
    ("capital of Australia", "corpus://geography/australia"),
    ("kill a process that ignores SIGTERM", "corpus://linux/processes"),
    ("memoize a function with a cache decorator", "corpus://python/functools"),
    ("who discovered the double helix structure of DNA", "corpus://science/dna"),
    ("extract a tar.gz archive", "corpus://linux/tar"),
    ("deepest point in the ocean", "corpus://geography/pacific-ocean"),
])
async def test_offline_ranks_the_right_document_first(builtin: OfflineCorpusProvider, query: str,
                                                      expected: str) -> None:
    hits = await builtin.search(query, 5)
    assert hits, query
    assert hits[0].url == expected, [h.url for h in hits]


async def test_offline_snippets_are_capped_best_passages(builtin: OfflineCorpusProvider) -> None:
    hits = await builtin.search("boiling point of water at high altitude", 5)
    assert hits[0].url == "corpus://science/water"
    assert all(len(h.snippet) <= 300 for h in hits)
    assert "altitude" in hits[0].snippet  # the matching passage, not the start of the document
    small = OfflineCorpusProvider(snippet_chars=60)
    for query in ("python", "river", "speed of light", "systemd services"):
        for hit in await small.search(query, 10):
            assert 0 < len(hit.snippet) <= 60


async def test_offline_dedupes_documents_and_honours_max_results(builtin: OfflineCorpusProvider) -> None:
    hits = await builtin.search("python module standard library", 20)
    urls = [h.url for h in hits]
    assert len(urls) == len(set(urls))
    assert 1 <= len(hits) <= 20
    assert len(await builtin.search("python module standard library", 2)) == 2
    assert await builtin.search("zzqqxx nonsenseword", 5) == []


async def test_offline_extract(builtin: OfflineCorpusProvider) -> None:
    pages = await builtin.extract(["corpus://python/itertools", "corpus://nope/missing", "https://x.test/"], 8000)
    assert [p.url for p in pages] == ["corpus://python/itertools", "corpus://nope/missing", "https://x.test/"]
    assert pages[0].error is None and pages[0].title.startswith("itertools")
    assert "combinations" in pages[0].content
    assert pages[1].error and "not in the offline corpus" in pages[1].error and not pages[1].content
    assert pages[2].error
    capped = await builtin.extract(["corpus://geography/canada"], 200)
    assert len(capped[0].content) <= 200 and capped[0].content.startswith("Canada is a country")


async def test_run_web_tool_validates_and_formats(builtin: OfflineCorpusProvider) -> None:
    text = await run_web_tool(builtin, "web_search", {"query": "Mount Everest first ascent", "max_results": 2})
    assert text.startswith("Results for") and "corpus://geography/mount-everest" in text
    text = await run_web_tool(builtin, "web_extract", {"urls": ["corpus://linux/grep"], "max_chars": 500})
    assert "grep" in text and "URL: corpus://linux/grep" in text
    with pytest.raises(ToolInputError, match="max_results"):
        await run_web_tool(builtin, "web_search", {"query": "x", "max_results": 99})
    with pytest.raises(ToolInputError, match="Extra inputs"):
        await run_web_tool(builtin, "web_search", {"query": "x", "bogus": 1})
    with pytest.raises(ToolInputError, match="unknown web tool"):
        await run_web_tool(builtin, "web_browse", {})


def _write_custom_corpus(root: Path) -> None:
    (root / "notes").mkdir(parents=True)
    (root / "notes" / "alpha.md").write_text(
        "# Alpha Centauri\n\nAlpha Centauri is the closest star system to the Sun, about 4.37 light-years away.\n\n"
        "It has three stars: Alpha Centauri A, Alpha Centauri B and Proxima Centauri.\n", encoding="utf-8")
    (root / "notes" / "bread.md").write_text(
        "## Sourdough bread\n\nSourdough is leavened with a starter of wild yeast and lactic acid bacteria. "
        "Bakers feed the starter with flour and water.\n", encoding="utf-8")
    (root / "volcano.txt").write_text(
        "Volcanoes\nA volcano is an opening in the crust where magma erupts as lava.\n", encoding="utf-8")
    (root / "kb.jsonl").write_text(json.dumps(
        {"url": "https://kb.test/zebra", "title": "Zebras", "text": "Zebras are African equines with stripes."}
    ) + "\n\n", encoding="utf-8")
    (root / "ignored.bin").write_bytes(b"\x00\x01zebra")


async def test_custom_corpus_dir(tmp_path: Path) -> None:
    _write_custom_corpus(tmp_path)
    provider = OfflineCorpusProvider(tmp_path)
    docs = {d.url: d for d in provider.documents}
    assert set(docs) == {"corpus://notes/alpha.md", "corpus://notes/bread.md", "corpus://volcano.txt",
                         "https://kb.test/zebra"}
    assert docs["corpus://notes/alpha.md"].title == "Alpha Centauri"
    assert docs["corpus://notes/bread.md"].title == "Sourdough bread"
    assert docs["corpus://volcano.txt"].title == "Volcanoes"
    assert (await provider.search("closest star to the sun", 3))[0].url == "corpus://notes/alpha.md"
    assert (await provider.search("wild yeast starter", 3))[0].url == "corpus://notes/bread.md"
    assert (await provider.search("magma lava eruption", 3))[0].url == "corpus://volcano.txt"
    assert (await provider.search("striped african animals zebras", 3))[0].url == "https://kb.test/zebra"
    pages = await provider.extract(["https://kb.test/zebra", "corpus://notes/alpha.md"], 8000)
    assert pages[0].content.startswith("Zebras are") and pages[0].title == "Zebras"
    assert "Proxima Centauri" in pages[1].content


async def test_custom_corpus_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        await OfflineCorpusProvider(tmp_path / "missing").search("x", 1)
    (tmp_path / "a.jsonl").write_text('{"url": "corpus://x", "title": "X", "text": "x"}\n{not json}\n')
    with pytest.raises(ConfigError, match=r"a\.jsonl:2"):
        load_corpus(tmp_path)
    (tmp_path / "a.jsonl").write_text('{"url": "corpus://b.md", "title": "X", "text": "x"}\n')
    (tmp_path / "b.md").write_text("# B\n")
    with pytest.raises(ConfigError, match="appears twice"):
        load_corpus(tmp_path)
    empty = tmp_path / "empty"
    empty.mkdir()
    assert await OfflineCorpusProvider(empty).search("anything", 3) == []


async def test_index_is_built_once_in_a_worker_thread(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _write_custom_corpus(tmp_path)
    builds: list[int] = []
    original = OfflineCorpusProvider._build_index

    def counting(self: OfflineCorpusProvider) -> Any:
        builds.append(threading.get_ident())
        time.sleep(0.2)  # while this runs, the event loop must stay responsive
        return original(self)

    monkeypatch.setattr(OfflineCorpusProvider, "_build_index", counting)
    provider = OfflineCorpusProvider(tmp_path)
    ticks = 0

    async def ticker() -> None:
        nonlocal ticks
        while True:
            ticks += 1
            await asyncio.sleep(0.01)

    tick_task = asyncio.create_task(ticker())
    results = await asyncio.gather(*(provider.search("zebras", 2) for _ in range(5)))
    tick_task.cancel()
    assert all(r and r[0].url == "https://kb.test/zebra" for r in results)
    assert len(builds) == 1 and builds[0] != threading.get_ident()
    assert ticks >= 5
    await provider.search("lava", 1)
    assert len(builds) == 1


# --------------------------------------------------------------------------- HTTP provider against a stub


@dataclass
class Seen:
    t: float
    path: str
    headers: dict[str, str]
    body: Any


@dataclass
class Stub:
    """A tiny server of the documented search API shapes; ``script`` answers go first, then ``always``."""

    url: str = ""
    requests: list[Seen] = field(default_factory=list)
    script: list[tuple[int, dict[str, str], Any]] = field(default_factory=list)
    always: tuple[int, dict[str, str], Any] | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)

    def answer(self, path: str, headers: dict[str, str], body: Any) -> tuple[int, dict[str, str], Any]:
        with self.lock:
            self.requests.append(Seen(time.monotonic(), path, headers, body))
            if self.script:
                return self.script.pop(0)
            if self.always is not None:
                status, extra, payload = self.always
                if payload == "ECHO-AUTH":  # a hostile server that echoes the key back
                    payload = {"detail": f"overloaded, your header was {headers.get('authorization')}"}
                return status, extra, payload
        if path.endswith("/search"):
            n = int(body["max_results"])
            return 200, {}, {"query": body["query"], "results": [
                {"title": f"Result {i} for {body['query']}", "url": f"https://site{i}.test/page",
                 "content": f"snippet {i} " + "lorem ipsum dolor " * 60, "score": 1.0 - i / 100}
                for i in range(n + 2)  # more than asked: the client must cut
            ]}
        if path.endswith("/extract"):
            urls = body["urls"]
            return 200, {}, {
                "results": [{"url": u, "raw_content": f"Full text of {u}. " + "content " * 500}
                            for u in urls if "bad" not in u],
                "failed_results": [{"url": u, "error": "fetch timed out"} for u in urls if "bad" in u],
            }
        return 404, {}, {"detail": "not found"}


@pytest.fixture
def stub(monkeypatch: pytest.MonkeyPatch) -> Iterator[Stub]:
    for var in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy", "all_proxy"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv(KEY_ENV, KEY)
    state = Stub()

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            raw = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            status, extra, payload = state.answer(self.path, {k.lower(): v for k, v in self.headers.items()},
                                                  json.loads(raw or b"null"))
            data = payload.encode() if isinstance(payload, str) else json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            for k, v in extra.items():
                self.send_header(k, v)
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, format: str, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    state.url = f"http://127.0.0.1:{server.server_address[1]}/v1"
    try:
        yield state
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


def _provider(stub: Stub, **kw: Any) -> HttpSearchProvider:
    kw.setdefault("backoff_base_s", 0.01)
    kw.setdefault("rate_limit_per_s", 1000.0)
    return HttpSearchProvider(stub.url, api_key_env=KEY_ENV, **kw)


def _assert_no_key(exc: BaseException) -> None:
    text = "".join(traceback.format_exception(exc)) + repr(exc)
    assert KEY not in text


async def test_http_search_success_shape_and_bearer(stub: Stub) -> None:
    async with _provider(stub, snippet_chars=120) as provider:
        hits = await provider.search("rust borrow checker", 3)
    assert [h.url for h in hits] == ["https://site0.test/page", "https://site1.test/page", "https://site2.test/page"]
    assert hits[0].title == "Result 0 for rust borrow checker"
    assert all(len(h.snippet) <= 120 and h.snippet.startswith("snippet") for h in hits)
    (req,) = stub.requests
    assert req.path == "/v1/search"
    assert req.headers["authorization"] == f"Bearer {KEY}"
    assert req.body == {"query": "rust borrow checker", "max_results": 3, "search_depth": "basic"}
    assert KEY not in repr(provider)


async def test_http_extract_shape(stub: Stub) -> None:
    async with _provider(stub) as provider:
        pages = await provider.extract(["https://good.test/a", "https://bad.test/b", "ftp://files.test/c"], 300)
    assert [p.url for p in pages] == ["https://good.test/a", "https://bad.test/b", "ftp://files.test/c"]
    assert pages[0].error is None and pages[0].content.startswith("Full text of https://good.test/a")
    assert len(pages[0].content) <= 300
    assert pages[1].error == "fetch timed out"
    assert pages[2].error and "http" in pages[2].error
    (req,) = stub.requests
    assert req.path == "/v1/extract" and req.body == {"urls": ["https://good.test/a", "https://bad.test/b"]}
    assert req.headers["authorization"] == f"Bearer {KEY}"


async def test_http_retries_after_429_honouring_retry_after(stub: Stub) -> None:
    stub.script.append((429, {"Retry-After": "1"}, {"detail": "slow down"}))
    async with _provider(stub) as provider:
        hits = await provider.search("q", 1)
    assert len(hits) == 1
    assert len(stub.requests) == 2
    gap = stub.requests[1].t - stub.requests[0].t
    assert gap >= 0.9, gap  # the backoff alone would be ~10 ms


async def test_http_retries_after_503(stub: Stub) -> None:
    stub.script.append((503, {}, {"detail": "try again"}))
    async with _provider(stub) as provider:
        pages = await provider.extract(["https://good.test/x"], 1000)
    assert pages[0].error is None
    assert len(stub.requests) == 2


async def test_http_gives_up_after_max_retries_without_leaking_key(stub: Stub) -> None:
    stub.always = (503, {}, "ECHO-AUTH")
    async with _provider(stub, max_retries=3) as provider:
        with pytest.raises(InfrastructureError) as info:
            await provider.search("q", 5)
    assert len(stub.requests) == 4  # one try and three retries
    assert "503" in str(info.value) and "4 attempt" in str(info.value)
    assert "[redacted]" in str(info.value)  # the echoed header was scrubbed
    _assert_no_key(info.value)


async def test_http_long_retry_after_gives_up_at_once(stub: Stub) -> None:
    stub.always = (429, {"Retry-After": "3600"}, {"detail": "quota exhausted"})
    async with _provider(stub, max_retry_wait_s=5) as provider:
        with pytest.raises(InfrastructureError, match="Retry-After"):
            await provider.search("q", 5)
    assert len(stub.requests) == 1


async def test_http_auth_and_bad_request_errors(stub: Stub) -> None:
    stub.script.append((401, {}, {"detail": f"invalid key {KEY}"}))
    stub.script.append((400, {}, {"detail": f"query too long (key {KEY})"}))
    async with _provider(stub) as provider:
        with pytest.raises(InfrastructureError, match=KEY_ENV) as auth:
            await provider.search("q", 1)
        with pytest.raises(ToolInputError, match="query too long") as bad:
            await provider.search("q", 1)
    _assert_no_key(auth.value)
    _assert_no_key(bad.value)
    assert len(stub.requests) == 2  # neither is retried


async def test_http_transport_errors_are_retried_then_infrastructure(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(KEY_ENV, KEY)
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    provider = HttpSearchProvider(f"http://127.0.0.1:{port}", api_key_env=KEY_ENV, max_retries=2,
                                  backoff_base_s=0.01, timeout_s=2)
    with pytest.raises(InfrastructureError, match="3 attempt") as info:
        await provider.search("q", 1)
    await provider.aclose()
    _assert_no_key(info.value)


async def test_http_rate_limit_spaces_requests(stub: Stub) -> None:
    rate, n = 10.0, 12
    async with _provider(stub, rate_limit_per_s=rate, rate_limit_burst=1) as provider:
        t0 = time.monotonic()
        await asyncio.gather(*(provider.search(f"q{i}", 1) for i in range(n)))
        elapsed = time.monotonic() - t0
    times = sorted(r.t for r in stub.requests)
    assert len(times) == n
    assert times[-1] - times[0] >= 0.7 * (n - 1) / rate  # ~1.1 s if spaced; ~0 s if not
    window = 0.5
    busiest = max(sum(1 for u in times if t <= u < t + window) for t in times)
    assert busiest <= window * rate + 3, busiest  # ~5 per half second, generous margin
    assert elapsed < 15


def test_token_bucket_reservations() -> None:
    bucket = TokenBucket(rate=4.0, burst=2)
    delays = [bucket.reserve() for _ in range(6)]
    assert delays[0] == 0 and delays[1] == 0
    assert delays[2:] == pytest.approx([0.25, 0.5, 0.75, 1.0], abs=0.05)
    with pytest.raises(ConfigError):
        TokenBucket(rate=0)


def test_missing_key_is_a_config_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(KEY_ENV, raising=False)
    with pytest.raises(ConfigError, match=KEY_ENV):
        HttpSearchProvider("http://127.0.0.1:9", api_key_env=KEY_ENV)
    monkeypatch.setenv(KEY_ENV, "   ")
    with pytest.raises(ConfigError, match=KEY_ENV):
        HttpSearchProvider("http://127.0.0.1:9", api_key_env=KEY_ENV)
    monkeypatch.setenv(KEY_ENV, KEY)
    with pytest.raises(ConfigError, match="base_url"):
        HttpSearchProvider("", api_key_env=KEY_ENV)


async def test_make_provider(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    offline = make_provider(WebToolsConfig())
    assert isinstance(offline, OfflineCorpusProvider) and offline.corpus == web.BUILTIN_CORPUS
    custom = make_provider(WebToolsConfig(corpus_dir=tmp_path, snippet_chars=50))
    assert isinstance(custom, OfflineCorpusProvider) and custom.corpus == tmp_path and custom.snippet_chars == 50
    with pytest.raises(ConfigError, match="base_url"):
        make_provider(WebToolsConfig(provider="http"))
    monkeypatch.delenv("TAVILY_API_KEY", raising=False)
    with pytest.raises(ConfigError, match="TAVILY_API_KEY"):
        make_provider(WebToolsConfig(provider="http", base_url="http://127.0.0.1:9"))
    monkeypatch.setenv(KEY_ENV, KEY)
    http = make_provider(WebToolsConfig(provider="http", base_url="http://127.0.0.1:9/", api_key_env=KEY_ENV,
                                        rate_limit_per_s=2))
    assert isinstance(http, HttpSearchProvider) and http.base_url == "http://127.0.0.1:9"
    await http.aclose()
    with pytest.raises(ValidationError):
        WebToolsConfig.model_validate({"provider": "bing"})
