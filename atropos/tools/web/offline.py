"""The offline provider: BM25 (the ``bm25s`` package) over a local corpus of documents; with no
corpus given, the small one shipped in ``atropos/tools/corpus/``. No network, no key: the
default for tests and offline training."""

from __future__ import annotations

import asyncio
import json
import logging
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from atropos.errors import ConfigError
from atropos.tools.web.models import ExtractedPage, SearchHit, SearchProvider
from atropos.tools.web.text import DEFAULT_SNIPPET_CHARS, PASSAGE_CHARS, split_passages, squash, tokenize, truncate

log = logging.getLogger(__name__)

BUILTIN_CORPUS = Path(__file__).parent.parent / "corpus"
"""The small corpus shipped with the package (``docs.jsonl``)."""


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
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        for doc, where in _documents_of(path, path.relative_to(root).as_posix()):
            if doc.url in seen:
                raise ConfigError(f"web corpus: URL {doc.url!r} appears twice ({seen[doc.url]} and {where})")
            seen[doc.url] = where
            documents.append(doc)
    return documents


def _documents_of(path: Path, rel: str) -> Iterator[tuple[Document, str]]:
    """The documents of one corpus file, each with where it stands (``rel`` or ``rel:line``)."""
    suffix = path.suffix.lower()
    if suffix in (".md", ".txt"):
        text = path.read_text(encoding="utf-8")
        yield Document(url=f"corpus://{rel}", title=_title_of(text, rel), text=text), rel
    if suffix != ".jsonl":
        return
    with path.open(encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, 1):
            if line.strip():
                yield _jsonl_document(line, f"{rel}:{lineno}"), f"{rel}:{lineno}"


def _jsonl_document(line: str, where: str) -> Document:
    try:
        row = json.loads(line)
        url, text = str(row["url"]), str(row["text"])
        title = str(row.get("title") or "") or _title_of(text, url)
    except (ValueError, KeyError, TypeError) as exc:
        raise ConfigError(f"web corpus {where}: expected a JSON object with url, title, text "
                          f"({type(exc).__name__}: {exc})") from None
    return Document(url=url, title=title, text=text)


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
            for passage in split_passages(doc.text, self.passage_chars) or [squash(doc.title)]:
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
