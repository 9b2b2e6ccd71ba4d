"""Web tools (``web_search``, ``web_extract``) behind a provider interface.

These are *external* tools: they need secrets or the internet, so they run on the ToolServer and
never inside a sandbox slot. Two providers implement :class:`SearchProvider`:

* :class:`OfflineCorpusProvider` ranks a local corpus of documents with BM25 (the ``bm25s``
  package). With no corpus given it uses the small built-in corpus shipped in
  ``atropos/tools/corpus/``. It needs no network and no key, which makes it the default for
  tests and offline training.
* :class:`HttpSearchProvider` talks to a search API of the Tavily shape over HTTP, with
  timeouts, retries with exponential backoff (honouring ``Retry-After``), a client-side token
  bucket rate limit, and error messages that never contain the API key.

Errors follow :mod:`atropos.errors`: something the model asked for wrongly is a ``ToolError``
(shown to the model); a provider outage is an ``InfrastructureError`` (the item is retried);
bad settings are a ``ConfigError``.
"""

from __future__ import annotations

import abc
import asyncio
import email.utils
import json
import logging
import os
import random
import re
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Literal, TypeVar

import httpx
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from atropos.errors import ConfigError, InfrastructureError, ToolInputError

log = logging.getLogger(__name__)

BUILTIN_CORPUS = Path(__file__).with_name("corpus")
"""The small corpus shipped with the package (``docs.jsonl``)."""

DEFAULT_SNIPPET_CHARS = 300
PASSAGE_CHARS = 500


# --------------------------------------------------------------------------- tool arguments


class _Args(BaseModel):
    model_config = ConfigDict(extra="forbid")


class WebSearchArgs(_Args):
    """Search the web: numbered results with title, URL and snippet. Read a full page with web_extract."""

    query: str = Field(min_length=1, max_length=500, description="what to search for, in plain words")
    max_results: int = Field(5, ge=1, le=20, description="how many results to return")


class WebExtractArgs(_Args):
    """Read web pages: the text content of each URL (up to 5 at once), e.g. URLs found by web_search."""

    urls: list[str] = Field(min_length=1, max_length=5, description="URLs of the pages to read")
    max_chars: int = Field(8000, ge=100, le=100_000, description="maximum characters of text returned per page")


class SearchHit(BaseModel):
    title: str
    url: str
    snippet: str


class ExtractedPage(BaseModel):
    url: str
    title: str = ""
    content: str = ""
    error: str | None = None


# --------------------------------------------------------------------------- provider interface


class SearchProvider(abc.ABC):
    """Where ``web_search`` and ``web_extract`` get their answers."""

    name: str = "provider"

    @abc.abstractmethod
    async def search(self, query: str, max_results: int) -> list[SearchHit]:
        """The best ``max_results`` hits for ``query``, best first (fewer when fewer match)."""

    @abc.abstractmethod
    async def extract(self, urls: Sequence[str], max_chars: int) -> list[ExtractedPage]:
        """One page per URL, in the order given; a URL that cannot be read gets ``error`` set."""

    async def aclose(self) -> None:  # noqa: B027 - optional hook, most providers hold nothing
        """Release connections and other resources."""

    async def __aenter__(self) -> SearchProvider:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


# --------------------------------------------------------------------------- text helpers

_TOKEN_RE = re.compile(r"[^\W_]+")

STOPWORDS: frozenset[str] = frozenset("""
a about above after again against all am an and any are as at be because been before being below between
both but by can could did do does doing down during each few for from further had has have having he her
here hers herself him himself his how i if in into is it its itself just me more most my myself no nor not
now of off on once only or other our ours ourselves out over own same she should so some such than that the
their theirs them themselves then there these they this those through to too under until up very was we were
what when where which while who whom why will with would you your yours yourself yourselves
""".split())


def tokenize(text: str, *, stopwords: frozenset[str] = STOPWORDS) -> list[str]:
    """Lowercase words and numbers, punctuation stripped, English stopwords removed."""
    return [t for t in _TOKEN_RE.findall(text.lower()) if t not in stopwords]


def truncate(text: str, limit: int) -> str:
    """``text`` cut to at most ``limit`` characters, at a word boundary when one is near, with an ellipsis."""
    if len(text) <= limit:
        return text
    if limit <= 1:
        return text[:limit]
    cut = text[: limit - 1]
    space = cut.rfind(" ")
    if space >= limit // 2:
        cut = cut[:space]
    return cut.rstrip() + "…"


def _squash(text: str) -> str:
    return " ".join(text.split())


_SENTENCE_END = re.compile(r"(?<=[.!?])\s+")


def split_passages(text: str, target: int = PASSAGE_CHARS) -> list[str]:
    """Whitespace-normalised passages of about ``target`` characters, cut at paragraph, then sentence,
    then word boundaries."""
    pieces: list[str] = []
    for para in re.split(r"\n\s*\n", text):
        para = _squash(para)
        if not para:
            continue
        if len(para) <= target:
            pieces.append(para)
            continue
        for sentence in _SENTENCE_END.split(para):
            while len(sentence) > target:
                cut = sentence.rfind(" ", 0, target)
                cut = cut if cut > 0 else target
                pieces.append(sentence[:cut])
                sentence = sentence[cut:].lstrip()
            if sentence:
                pieces.append(sentence)
    passages: list[str] = []
    for piece in pieces:
        if passages and len(passages[-1]) + 1 + len(piece) <= target:
            passages[-1] += " " + piece
        else:
            passages.append(piece)
    return passages


# --------------------------------------------------------------------------- output for the model


def format_search(hits: Sequence[SearchHit], query: str | None = None) -> str:
    """The text the model reads for a ``web_search`` call."""
    if not hits:
        return f"No results for {query!r}." if query else "No results."
    lines = [f"Results for {query!r}:\n" if query else ""]
    for i, hit in enumerate(hits, 1):
        lines.append(f"[{i}] {hit.title or hit.url}\nURL: {hit.url}\n{hit.snippet}\n")
    return "\n".join(line for line in lines if line).rstrip() + "\n"


def format_extract(pages: Sequence[ExtractedPage]) -> str:
    """The text the model reads for a ``web_extract`` call."""
    blocks: list[str] = []
    for i, page in enumerate(pages, 1):
        if page.error is not None:
            blocks.append(f"[{i}] {page.url}\nError: {page.error}")
        else:
            head = f"[{i}] {page.title}\nURL: {page.url}" if page.title else f"[{i}] {page.url}"
            blocks.append(f"{head}\n\n{page.content}")
    return "\n\n---\n\n".join(blocks) + "\n"


# --------------------------------------------------------------------------- offline provider


@dataclass(frozen=True)
class Document:
    url: str
    title: str
    text: str


@dataclass
class _Index:
    documents: list[Document]
    passages: list[str]
    passage_doc: list[int]
    bm25: Any  # bm25s.BM25, or None for an empty corpus
    by_url: dict[str, int]


def _title_of(text: str, fallback: str) -> str:
    for line in text.splitlines():
        line = line.strip()
        if line:
            return line.lstrip("#").strip() or fallback
    return fallback


def load_corpus(root: Path) -> list[Document]:
    """Documents of every ``.jsonl`` (``{"url", "title", "text"}`` per line), ``.md`` and ``.txt`` file under
    ``root``, in path order. Markdown and text files get ``corpus://<relative path>`` URLs and their first
    heading (or first line) as title."""
    if not root.is_dir():
        raise ConfigError(f"web corpus directory {root} does not exist")
    documents: list[Document] = []
    seen: dict[str, str] = {}

    def add(doc: Document, where: str) -> None:
        if doc.url in seen:
            raise ConfigError(f"web corpus: URL {doc.url!r} appears twice ({seen[doc.url]} and {where})")
        seen[doc.url] = where
        documents.append(doc)

    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        rel = path.relative_to(root).as_posix()
        suffix = path.suffix.lower()
        if suffix == ".jsonl":
            with path.open(encoding="utf-8") as fh:
                for lineno, line in enumerate(fh, 1):
                    if not line.strip():
                        continue
                    where = f"{rel}:{lineno}"
                    try:
                        row = json.loads(line)
                        url, text = str(row["url"]), str(row["text"])
                        title = str(row.get("title") or "") or _title_of(text, url)
                    except (ValueError, KeyError, TypeError) as exc:
                        raise ConfigError(f"web corpus {where}: expected a JSON object with url, title, text "
                                          f"({type(exc).__name__}: {exc})") from None
                    add(Document(url=url, title=title, text=text), where)
        elif suffix in (".md", ".txt"):
            text = path.read_text(encoding="utf-8")
            url = f"corpus://{rel}"
            add(Document(url=url, title=_title_of(text, rel), text=text), rel)
    return documents


class OfflineCorpusProvider(SearchProvider):
    """BM25 search over a local corpus (default: the built-in one). The index is built once, lazily, in a
    worker thread, and reused."""

    name = "offline"

    def __init__(self, corpus: Path | None = None, *, snippet_chars: int = DEFAULT_SNIPPET_CHARS,
                 passage_chars: int = PASSAGE_CHARS) -> None:
        if snippet_chars < 1:
            raise ConfigError("snippet_chars must be at least 1")
        self.corpus = Path(corpus) if corpus is not None else BUILTIN_CORPUS
        self.snippet_chars = snippet_chars
        self.passage_chars = passage_chars
        self._index: _Index | None = None
        self._build_lock = threading.Lock()

    # The index -----------------------------------------------------------------------------

    def _build_index(self) -> _Index:
        documents = load_corpus(self.corpus)
        passages: list[str] = []
        passage_doc: list[int] = []
        tokens: list[list[str]] = []
        for i, doc in enumerate(documents):
            title_tokens = tokenize(doc.title)
            for passage in split_passages(doc.text, self.passage_chars) or [_squash(doc.title)]:
                passages.append(passage)
                passage_doc.append(i)
                tokens.append(title_tokens + tokenize(passage))
        bm25 = None
        if passages:
            try:
                import bm25s
            except ImportError:  # pragma: no cover - bm25s is a dependency
                raise ConfigError("the offline web search provider needs the 'bm25s' package") from None
            bm25 = bm25s.BM25()
            bm25.index(tokens, show_progress=False)
        log.info("web corpus %s: %d documents, %d passages", self.corpus, len(documents), len(passages))
        return _Index(documents=documents, passages=passages, passage_doc=passage_doc, bm25=bm25,
                      by_url={doc.url: i for i, doc in enumerate(documents)})

    def _ensure_index(self) -> _Index:
        with self._build_lock:
            if self._index is None:
                self._index = self._build_index()
            return self._index

    async def index(self) -> _Index:
        """The index, built on first use in a worker thread (so the event loop keeps running)."""
        if self._index is not None:
            return self._index
        return await asyncio.to_thread(self._ensure_index)

    @property
    def documents(self) -> list[Document]:
        return self._ensure_index().documents

    # Search --------------------------------------------------------------------------------

    def _search_sync(self, index: _Index, query: str, max_results: int) -> list[SearchHit]:
        if index.bm25 is None or max_results < 1:
            return []
        query_tokens = tokenize(query) or tokenize(query, stopwords=frozenset())
        if not query_tokens:
            return []
        scores = index.bm25.get_scores(query_tokens)
        hits: list[SearchHit] = []
        seen: set[int] = set()
        for p in (-scores).argsort(kind="stable"):
            if scores[p] <= 0:
                break
            d = index.passage_doc[p]
            if d in seen:
                continue
            seen.add(d)
            doc = index.documents[d]
            hits.append(SearchHit(title=doc.title, url=doc.url,
                                  snippet=truncate(index.passages[p], self.snippet_chars)))
            if len(hits) >= max_results:
                break
        return hits

    async def search(self, query: str, max_results: int = 5) -> list[SearchHit]:
        index = await self.index()
        return await asyncio.to_thread(self._search_sync, index, query, max_results)

    async def extract(self, urls: Sequence[str], max_chars: int = 8000) -> list[ExtractedPage]:
        index = await self.index()
        pages: list[ExtractedPage] = []
        for url in urls:
            d = index.by_url.get(url.strip())
            if d is None and url.startswith(("http://", "https://")):
                d = index.by_url.get(url.strip().rstrip("/"))
                if d is None:
                    d = index.by_url.get(url.strip().rstrip("/") + "/")
            if d is None:
                pages.append(ExtractedPage(url=url, error="not found: this URL is not in the offline corpus "
                                                          "(use URLs returned by web_search)"))
                continue
            doc = index.documents[d]
            pages.append(ExtractedPage(url=doc.url, title=doc.title, content=truncate(doc.text.strip(), max_chars)))
        return pages


# --------------------------------------------------------------------------- HTTP provider


class TokenBucket:
    """Client-side rate limit: ``rate`` requests per second on average, at most ``burst`` at once.

    Each caller reserves the next free slot synchronously (no lock held across an await), then sleeps
    until it, so concurrent callers are spaced ``1 / rate`` seconds apart once the burst is spent.
    """

    def __init__(self, rate: float, burst: int = 1) -> None:
        if rate <= 0:
            raise ConfigError("rate limit must be positive")
        if burst < 1:
            raise ConfigError("rate limit burst must be at least 1")
        self.rate = rate
        self.burst = burst
        self._tokens = float(burst)
        self._updated = time.monotonic()
        self._lock = threading.Lock()

    def reserve(self) -> float:
        """Take a token; the seconds to wait before using it."""
        with self._lock:
            now = time.monotonic()
            self._tokens = min(float(self.burst), self._tokens + (now - self._updated) * self.rate)
            self._updated = now
            self._tokens -= 1.0
            return 0.0 if self._tokens >= 0 else -self._tokens / self.rate

    async def acquire(self) -> None:
        delay = self.reserve()
        if delay > 0:
            await asyncio.sleep(delay)


def _retry_after_s(value: str | None) -> float | None:
    """Seconds from a ``Retry-After`` header (delta-seconds or HTTP date), or None."""
    if not value:
        return None
    value = value.strip()
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    if when.tzinfo is None:
        when = when.replace(tzinfo=timezone.utc)
    return max(0.0, (when - datetime.now(timezone.utc)).total_seconds())


_RETRY_STATUS = frozenset({429, 500, 502, 503, 504})


class HttpSearchProvider(SearchProvider):
    """A search API of the Tavily shape over HTTP.

    ``POST {base_url}/search`` with ``{"query", "max_results", "search_depth": "basic"}`` answers
    ``{"results": [{"title", "url", "content"}]}``; ``POST {base_url}/extract`` with ``{"urls": [...]}``
    answers ``{"results": [{"url", "raw_content"}], "failed_results": [...]}``. The key is read from the
    environment variable ``api_key_env`` and sent as ``Authorization: Bearer <key>``.
    """

    name = "http"

    def __init__(
        self,
        base_url: str,
        *,
        api_key_env: str = "TAVILY_API_KEY",
        rate_limit_per_s: float = 5.0,
        rate_limit_burst: int = 1,
        snippet_chars: int = DEFAULT_SNIPPET_CHARS,
        timeout_s: float = 30.0,
        max_retries: int = 3,
        backoff_base_s: float = 0.5,
        backoff_max_s: float = 8.0,
        max_retry_wait_s: float = 60.0,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        if not base_url or not base_url.startswith(("http://", "https://")):
            raise ConfigError("web tools: base_url (your provider's API base URL, http:// or https://) is required")
        key = os.environ.get(api_key_env, "").strip()
        if not key:
            raise ConfigError(f"web tools: the API key environment variable {api_key_env} is not set or empty")
        if snippet_chars < 1 or max_retries < 0 or timeout_s <= 0:
            raise ConfigError("web tools: snippet_chars >= 1, max_retries >= 0 and timeout_s > 0 are required")
        self.base_url = base_url.rstrip("/")
        self.api_key_env = api_key_env
        self.snippet_chars = snippet_chars
        self.max_retries = max_retries
        self.backoff_base_s = backoff_base_s
        self.backoff_max_s = backoff_max_s
        self.max_retry_wait_s = max_retry_wait_s
        self._key = key
        self._bucket = TokenBucket(rate_limit_per_s, rate_limit_burst)
        self._client = httpx.AsyncClient(
            base_url=self.base_url,
            headers={"Authorization": f"Bearer {key}", "Accept": "application/json"},
            timeout=httpx.Timeout(timeout_s, connect=min(10.0, timeout_s)),
            transport=transport,
        )

    def __repr__(self) -> str:
        return f"HttpSearchProvider(base_url={self.base_url!r}, api_key_env={self.api_key_env!r})"

    def _redact(self, text: str) -> str:
        return text.replace(self._key, "[redacted]") if self._key else text

    def _backoff(self, attempt: int) -> float:
        delay: float = min(self.backoff_max_s, self.backoff_base_s * (2**attempt))
        return delay * (0.5 + random.random() / 2)  # jitter: never exceeds the exponential delay

    def _detail(self, resp: httpx.Response) -> str:
        try:
            body = resp.json()
            if isinstance(body, dict):
                body = body.get("detail") or body.get("error") or body.get("message") or body
            text = body if isinstance(body, str) else json.dumps(body)
        except ValueError:
            text = resp.text
        return self._redact(_squash(text))[:300]

    async def _post(self, path: str, payload: Mapping[str, Any]) -> dict[str, Any]:
        """POST with rate limiting and retries; the decoded JSON object of a 2xx answer."""
        what = f"{self.name} provider {path}"
        last = ""
        for attempt in range(self.max_retries + 1):
            await self._bucket.acquire()
            wait: float | None = None
            try:
                resp = await self._client.post(path, json=payload)
            except httpx.TransportError as exc:
                last = f"{type(exc).__name__}: {self._redact(str(exc)) or 'transport error'}"
            else:
                if resp.is_success:
                    try:
                        body = resp.json()
                    except ValueError:
                        raise InfrastructureError(f"{what}: answer is not JSON") from None
                    if not isinstance(body, dict):
                        raise InfrastructureError(f"{what}: answer is not a JSON object")
                    return body
                status = resp.status_code
                if status in (401, 403):
                    raise InfrastructureError(f"{what}: HTTP {status}, the provider rejected the API key "
                                              f"(check ${self.api_key_env})")
                if status in (400, 422):
                    raise ToolInputError(f"the search provider rejected the request: {self._detail(resp)}")
                last = f"HTTP {status}: {self._detail(resp)}"
                if status not in _RETRY_STATUS and status < 500:
                    raise InfrastructureError(f"{what}: {last}")
                wait = _retry_after_s(resp.headers.get("Retry-After"))
                if wait is not None and wait > self.max_retry_wait_s:
                    raise InfrastructureError(f"{what}: {last} (Retry-After {wait:.0f}s exceeds "
                                              f"{self.max_retry_wait_s:.0f}s, giving up)")
            if attempt == self.max_retries:
                break
            delay = wait if wait is not None else self._backoff(attempt)
            log.warning("%s failed (%s); retry %d/%d in %.2fs", what, last, attempt + 1, self.max_retries, delay)
            await asyncio.sleep(delay)
        raise InfrastructureError(f"{what} failed after {self.max_retries + 1} attempt(s): {last}")

    async def search(self, query: str, max_results: int = 5) -> list[SearchHit]:
        body = await self._post("/search", {"query": query, "max_results": max_results, "search_depth": "basic"})
        results = body.get("results")
        if not isinstance(results, list):
            raise InfrastructureError(f"{self.name} provider /search: answer has no 'results' list")
        hits: list[SearchHit] = []
        for r in results[:max_results]:
            if not isinstance(r, dict) or not r.get("url"):
                continue
            hits.append(SearchHit(title=_squash(str(r.get("title") or "")), url=str(r["url"]),
                                  snippet=truncate(_squash(str(r.get("content") or "")), self.snippet_chars)))
        return hits

    async def extract(self, urls: Sequence[str], max_chars: int = 8000) -> list[ExtractedPage]:
        valid = [u.strip() for u in urls if u.strip().startswith(("http://", "https://"))]
        found: dict[str, dict[str, Any]] = {}
        failed: dict[str, str] = {}
        if valid:
            body = await self._post("/extract", {"urls": list(dict.fromkeys(valid))})
            for r in body.get("results") or []:
                if isinstance(r, dict) and r.get("url"):
                    found.setdefault(str(r["url"]).rstrip("/"), r)
            for f in body.get("failed_results") or []:
                if isinstance(f, dict) and f.get("url"):
                    failed[str(f["url"]).rstrip("/")] = self._redact(str(f.get("error") or "could not be read"))
                elif isinstance(f, str):
                    failed[f.rstrip("/")] = "could not be read"
        pages: list[ExtractedPage] = []
        for url in urls:
            key = url.strip().rstrip("/")
            if not url.strip().startswith(("http://", "https://")):
                pages.append(ExtractedPage(url=url, error="not an http:// or https:// URL"))
            elif key in found and found[key].get("raw_content"):
                r = found[key]
                pages.append(ExtractedPage(url=url, title=_squash(str(r.get("title") or "")),
                                           content=truncate(str(r["raw_content"]).strip(), max_chars)))
            else:
                pages.append(ExtractedPage(url=url, error=failed.get(key, "no content returned for this URL")))
        return pages

    async def aclose(self) -> None:
        await self._client.aclose()


# --------------------------------------------------------------------------- configuration


class WebToolsConfig(BaseModel):
    """Settings of the web tools on the ToolServer."""

    model_config = ConfigDict(extra="forbid")

    provider: Literal["offline", "http"] = "offline"
    corpus_dir: Path | None = Field(None, description="offline: corpus directory (default: the built-in corpus)")
    base_url: str | None = Field(None, description="http: your provider's API base URL")
    api_key_env: str = Field("TAVILY_API_KEY", description="http: environment variable holding the API key")
    rate_limit_per_s: float = Field(5.0, gt=0, description="http: client-side requests per second")
    snippet_chars: int = Field(DEFAULT_SNIPPET_CHARS, ge=20, le=5000, description="maximum snippet length")
    timeout_s: float = Field(30.0, gt=0, description="http: per-request timeout")
    max_retries: int = Field(3, ge=0, le=10, description="http: retries on 429, 5xx and transport errors")


def make_provider(settings: WebToolsConfig) -> SearchProvider:
    """The provider ``settings`` describe. Raises ConfigError for missing base URL or key."""
    if settings.provider == "offline":
        return OfflineCorpusProvider(settings.corpus_dir, snippet_chars=settings.snippet_chars)
    if not settings.base_url:
        raise ConfigError("web tools: provider 'http' needs base_url (your provider's API base URL)")
    return HttpSearchProvider(settings.base_url, api_key_env=settings.api_key_env,
                              rate_limit_per_s=settings.rate_limit_per_s, snippet_chars=settings.snippet_chars,
                              timeout_s=settings.timeout_s, max_retries=settings.max_retries)


# --------------------------------------------------------------------------- invocation

WEB_TOOLS: dict[str, type[BaseModel]] = {"web_search": WebSearchArgs, "web_extract": WebExtractArgs}

_A = TypeVar("_A", bound=BaseModel)


def parse_args(model: type[_A], tool: str, arguments: Mapping[str, Any]) -> _A:
    try:
        return model.model_validate(dict(arguments))
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in err['loc']) or 'arguments'}: {err['msg']}" for err in exc.errors()
        )
        raise ToolInputError(f"invalid arguments for {tool}: {problems}") from None


async def run_web_tool(provider: SearchProvider, tool: str, arguments: Mapping[str, Any]) -> str:
    """Validate ``arguments``, call ``provider`` and format the result for the model.

    Raises ToolInputError for an unknown tool or bad arguments, InfrastructureError for provider outages.
    """
    if tool == "web_search":
        s = parse_args(WebSearchArgs, tool, arguments)
        return format_search(await provider.search(s.query, s.max_results), s.query)
    if tool == "web_extract":
        e = parse_args(WebExtractArgs, tool, arguments)
        return format_extract(await provider.extract(e.urls, e.max_chars))
    raise ToolInputError(f"unknown web tool {tool!r}; known: {sorted(WEB_TOOLS)}")


__all__ = [
    "BUILTIN_CORPUS", "WEB_TOOLS", "Document", "ExtractedPage", "HttpSearchProvider", "OfflineCorpusProvider",
    "SearchHit", "SearchProvider", "TokenBucket", "WebExtractArgs", "WebSearchArgs",
    "WebToolsConfig", "format_extract", "format_search", "load_corpus", "make_provider", "run_web_tool",
    "split_passages", "tokenize", "truncate",
]
