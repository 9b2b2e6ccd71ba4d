"""The HTTP provider: a search API of the Tavily shape, with timeouts, retries with exponential
backoff (honouring ``Retry-After``), a client-side token bucket, and error messages that never
contain the API key."""

from __future__ import annotations

import asyncio
import email.utils
import json
import logging
import os
import random
import threading
import time
from collections.abc import Mapping, Sequence
from datetime import datetime, timezone
from typing import Any

import httpx

from atropos.errors import ConfigError, InfrastructureError, ToolInputError
from atropos.tools.web.models import ExtractedPage, SearchHit, SearchProvider
from atropos.tools.web.text import DEFAULT_SNIPPET_CHARS, squash, truncate

log = logging.getLogger(__name__)


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
        return self._redact(squash(text))[:300]

    async def _post(self, path: str, payload: Mapping[str, Any]) -> dict[str, Any]:
        """POST with rate limiting and retries; the decoded JSON object of a 2xx answer."""
        what = f"{self.name} provider {path}"
        last = ""
        for attempt in range(self.max_retries + 1):
            await self._bucket.acquire()
            body, last, wait = await self._attempt(what, path, payload)
            if body is not None:
                return body
            if attempt == self.max_retries:
                break
            delay = wait if wait is not None else self._backoff(attempt)
            log.warning("%s failed (%s); retry %d/%d in %.2fs", what, last, attempt + 1, self.max_retries, delay)
            await asyncio.sleep(delay)
        raise InfrastructureError(f"{what} failed after {self.max_retries + 1} attempt(s): {last}")

    async def _attempt(self, what: str, path: str, payload: Mapping[str, Any],
                       ) -> tuple[dict[str, Any] | None, str, float | None]:
        """One POST: the answer's JSON object, or (None, why it failed, the Retry-After wait) when
        it may be retried; a failure no retry can mend is raised."""
        try:
            resp = await self._client.post(path, json=payload)
        except httpx.TransportError as exc:
            return None, f"{type(exc).__name__}: {self._redact(str(exc)) or 'transport error'}", None
        if resp.is_success:
            return self._json_object(what, resp), "", None
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
        return None, last, wait

    @staticmethod
    def _json_object(what: str, resp: httpx.Response) -> dict[str, Any]:
        try:
            body = resp.json()
        except ValueError:
            raise InfrastructureError(f"{what}: answer is not JSON") from None
        if not isinstance(body, dict):
            raise InfrastructureError(f"{what}: answer is not a JSON object")
        return body

    async def search(self, query: str, max_results: int = 5) -> list[SearchHit]:
        body = await self._post("/search", {"query": query, "max_results": max_results, "search_depth": "basic"})
        results = body.get("results")
        if not isinstance(results, list):
            raise InfrastructureError(f"{self.name} provider /search: answer has no 'results' list")
        hits: list[SearchHit] = []
        for r in results[:max_results]:
            if not isinstance(r, dict) or not r.get("url"):
                continue
            hits.append(SearchHit(title=squash(str(r.get("title") or "")), url=str(r["url"]),
                                  snippet=truncate(squash(str(r.get("content") or "")), self.snippet_chars)))
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
                pages.append(ExtractedPage(url=url, title=squash(str(r.get("title") or "")),
                                           content=truncate(str(r["raw_content"]).strip(), max_chars)))
            else:
                pages.append(ExtractedPage(url=url, error=failed.get(key, "no content returned for this URL")))
        return pages

    async def aclose(self) -> None:
        await self._client.aclose()
