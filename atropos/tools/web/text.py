"""Text handling shared by the providers (tokens, passages, truncation) and the text the model
reads for each web tool's result."""

from __future__ import annotations

import re
from collections.abc import Sequence

from atropos.tools.web.models import ExtractedPage, SearchHit

DEFAULT_SNIPPET_CHARS = 300
PASSAGE_CHARS = 500

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


def squash(text: str) -> str:
    return " ".join(text.split())


_SENTENCE_END = re.compile(r"(?<=[.!?])\s+")


def split_passages(text: str, target: int = PASSAGE_CHARS) -> list[str]:
    """Whitespace-normalised passages of about ``target`` characters, cut at paragraph, then sentence,
    then word boundaries."""
    pieces: list[str] = []
    for para in re.split(r"\n\s*\n", text):
        para = squash(para)
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
