"""The web tools' settings on the ToolServer, the provider they describe, and one call of a web
tool: arguments validated, the provider asked, the answer formatted for the model."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from atropos.errors import ConfigError, ToolInputError, validation_message
from atropos.tools.web.http_api import HttpSearchProvider
from atropos.tools.web.models import SearchProvider, WebExtractArgs, WebSearchArgs
from atropos.tools.web.offline import OfflineCorpusProvider
from atropos.tools.web.text import DEFAULT_SNIPPET_CHARS, format_extract, format_search


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



WEB_TOOLS: dict[str, type[BaseModel]] = {"web_search": WebSearchArgs, "web_extract": WebExtractArgs}

_A = TypeVar("_A", bound=BaseModel)


def parse_args(model: type[_A], tool: str, arguments: Mapping[str, Any]) -> _A:
    try:
        return model.model_validate(dict(arguments))
    except ValidationError as exc:
        raise ToolInputError(f"invalid arguments for {tool}: {validation_message(exc)}") from None


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
