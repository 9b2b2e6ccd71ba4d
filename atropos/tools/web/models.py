"""The web tools' argument models (the single source of their JSON schemas), their results, and
the interface every search provider implements."""

from __future__ import annotations

import abc
from collections.abc import Sequence

from pydantic import BaseModel, ConfigDict, Field


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
