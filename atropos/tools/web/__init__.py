"""Web tools (``web_search``, ``web_extract``) behind a provider interface.

These are *external* tools: they need secrets or the internet, so they run on the ToolServer and
never inside a sandbox slot. Two providers implement :class:`SearchProvider`:

* :class:`OfflineCorpusProvider` (``offline``) ranks a local corpus with BM25; no network, no key.
* :class:`HttpSearchProvider` (``http_api``) talks to a search API of the Tavily shape over HTTP.

The parts: ``models`` (arguments, results, the provider interface), ``text`` (tokens, passages,
what the model reads), ``offline``, ``http_api``, ``config`` (settings, ``make_provider``,
``run_web_tool``). Everything is importable from here.

Errors follow :mod:`atropos.errors`: something the model asked for wrongly is a ``ToolError``
(shown to the model); a provider outage is an ``InfrastructureError`` (the item is retried);
bad settings are a ``ConfigError``.
"""

from atropos.tools.web.config import WEB_TOOLS, WebToolsConfig, make_provider, parse_args, run_web_tool
from atropos.tools.web.http_api import HttpSearchProvider, TokenBucket
from atropos.tools.web.models import ExtractedPage, SearchHit, SearchProvider, WebExtractArgs, WebSearchArgs
from atropos.tools.web.offline import BUILTIN_CORPUS, Document, OfflineCorpusProvider, load_corpus
from atropos.tools.web.text import (
    DEFAULT_SNIPPET_CHARS,
    PASSAGE_CHARS,
    STOPWORDS,
    format_extract,
    format_search,
    split_passages,
    tokenize,
    truncate,
)

__all__ = [
    "BUILTIN_CORPUS", "DEFAULT_SNIPPET_CHARS", "PASSAGE_CHARS", "STOPWORDS", "WEB_TOOLS", "Document",
    "ExtractedPage", "HttpSearchProvider", "OfflineCorpusProvider", "SearchHit", "SearchProvider", "TokenBucket",
    "WebExtractArgs", "WebSearchArgs", "WebToolsConfig", "format_extract", "format_search", "load_corpus",
    "make_provider", "parse_args", "run_web_tool", "split_passages", "tokenize", "truncate",
]
