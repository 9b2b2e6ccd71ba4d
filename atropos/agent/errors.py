"""Which failures of a rollout are the platform's (retry the rollout, never score it) and which are bugs.

A rollout touches three outside parties: the slot pool (leasing), the sandbox host (tool calls,
verification) and the inference server. A failure of any of them says nothing about the policy,
so it must never become a reward of 0; it is retried on a fresh slot, and the item goes back to
the backlog when retries run out. Everything else (a bug in an env's hook, a bad config) is
raised so it is seen.
"""

from __future__ import annotations

import asyncio

from atropos.errors import AtroposSandboxError, InfrastructureError, LeaseError, SlotUnavailable


class InferenceUnavailable(InfrastructureError):
    """The inference server failed: unreachable, timed out, 5xx/429, or atroposlib's retries ran out."""


class TokenTrackingError(AtroposSandboxError):
    """ManagedServer did not track a rollout as one sequence (the chat template re-renders earlier
    turns differently from what the model generated), so its tokens and masks cannot be trusted."""


# Client errors that retrying cannot fix (bad request, auth, unknown model): raised, not retried.
_CLIENT_STATUSES = frozenset({400, 401, 403, 404, 413, 422})


def is_infrastructure(exc: BaseException) -> bool:
    """True when ``exc`` is the platform's fault: sandbox infrastructure, a lease that could not be
    had or went stale, or the inference server."""
    if isinstance(exc, (InfrastructureError, SlotUnavailable, LeaseError)):
        return True
    return inference_failure(exc) is not None


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
    try:
        import tenacity
    except ImportError:  # pragma: no cover - atroposlib depends on tenacity
        return exc
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
    try:
        import openai
    except ImportError:  # pragma: no cover
        openai = None  # type: ignore[assignment]
    if openai is not None:
        if isinstance(exc, openai.APIStatusError):
            return exc.status_code not in _CLIENT_STATUSES
        if isinstance(exc, (openai.APIConnectionError, openai.APITimeoutError)):
            return True
    try:
        import httpx
    except ImportError:  # pragma: no cover
        httpx = None  # type: ignore[assignment]
    if httpx is not None:
        if isinstance(exc, httpx.HTTPStatusError):
            return exc.response.status_code not in _CLIENT_STATUSES
        if isinstance(exc, httpx.TransportError):
            return True
    try:
        import aiohttp  # the vllm/sglang server classes talk to /generate with aiohttp
    except ImportError:  # pragma: no cover
        aiohttp = None  # type: ignore[assignment]
    if aiohttp is not None:
        if isinstance(exc, aiohttp.ClientResponseError):
            return exc.status not in _CLIENT_STATUSES
        if isinstance(exc, aiohttp.ClientError):
            return True
    return False
