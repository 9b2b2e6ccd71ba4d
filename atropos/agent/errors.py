"""Which failures of a rollout are the platform's (retry the rollout, never score it) and which are bugs.

A rollout touches three outside parties: the slot pool (leasing), the sandbox host (tool calls,
verification) and the inference server. A failure of any of them says nothing about the policy,
so it must never become a reward of 0; it is retried on a fresh slot, and the item goes back to
the backlog when retries run out. Everything else (a bug in an env's hook, a bad config) is
raised so it is seen.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import aiohttp  # the vllm/sglang server classes talk to /generate with aiohttp
import httpx
import openai
import tenacity

from atropos.errors import (
    InferenceUnavailable,
    InfrastructureError,
    LeaseError,
    SlotUnavailable,
    TokenTrackingError,
)

__all__ = ["InferenceUnavailable", "TokenTrackingError", "inference_failure", "is_infrastructure"]


# Client errors that retrying cannot fix (bad request, auth, unknown model): raised, not retried.
_CLIENT_STATUSES = frozenset({400, 401, 403, 404, 413, 422})

# Per client library, in order: its HTTP status error and how to read the status (server-side unless a
# client status), then its transport errors (always server-side). A status error may subclass a
# transport error (aiohttp), so the status check comes first.
_HTTP_ERRORS: tuple[tuple[type[BaseException], Callable[[Any], int], tuple[type[BaseException], ...]], ...] = (
    (openai.APIStatusError, lambda e: e.status_code, (openai.APIConnectionError, openai.APITimeoutError)),
    (httpx.HTTPStatusError, lambda e: e.response.status_code, (httpx.TransportError,)),
    (aiohttp.ClientResponseError, lambda e: e.status, (aiohttp.ClientError,)),
)


def is_infrastructure(exc: BaseException) -> bool:
    """True when ``exc`` is the platform's fault: sandbox infrastructure, a lease that could not be
    had or went stale, or the inference server."""
    if isinstance(exc, (InfrastructureError, SlotUnavailable, LeaseError)):
        return True
    inner = _unwrap_retry(exc)
    return isinstance(inner, InferenceUnavailable) or _is_server_side(inner)


def inference_failure(exc: BaseException) -> InferenceUnavailable | None:
    """``exc`` raised by an inference call, as an ``InferenceUnavailable`` when the server is at fault.

    atroposlib wraps its calls in tenacity retries without ``reraise``, so after the last attempt
    the caller sees ``tenacity.RetryError``; what matters is the exception of that last attempt.
    """
    inner = _unwrap_retry(exc)
    if isinstance(inner, InferenceUnavailable):
        return inner
    if _is_server_side(inner):
        detail = f"{type(inner).__name__}: {inner}"
        if inner is not exc:
            detail = f"retries exhausted; last error {detail}"
        return InferenceUnavailable(detail)
    return None


def _unwrap_retry(exc: BaseException) -> BaseException:
    seen = 0
    while isinstance(exc, tenacity.RetryError) and seen < 8:
        inner = exc.last_attempt.exception() if exc.last_attempt.failed else None
        if inner is None:
            return exc
        exc, seen = inner, seen + 1
    return exc


def _is_server_side(exc: BaseException) -> bool:
    if isinstance(exc, (asyncio.TimeoutError, TimeoutError, ConnectionError)):
        return True
    for status_error, status, transport_errors in _HTTP_ERRORS:
        if isinstance(exc, status_error):
            return status(exc) not in _CLIENT_STATUSES
        if isinstance(exc, transport_errors):
            return True
    return False
