"""Talking to a background pool: where it is (its state file), its token, and requests whose every
failure is a named error with one clear line (no tracebacks)."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, Field

from atropos.cli.pool_state import PoolState, is_pool_process
from atropos.errors import InfrastructureError, PoolReplyError


class PoolConnection(BaseModel):
    pool_id: str
    url: str
    token: str = Field(repr=False)


def connection(pool_id: str, state: PoolState | None) -> PoolConnection:
    """How to reach the pool whose state (``read_state(pool_id)``) this is."""
    if state is None:
        raise InfrastructureError(f"no pool {pool_id!r} is up (start one with `atropos-sandbox pool up`)")
    if not is_pool_process(state.pid):
        raise InfrastructureError(f"pool {pool_id!r} is not running (pid {state.pid} is gone); its log: {state.log}; "
                                  f"`atropos-sandbox pool down --pool-id {pool_id}` clears its state")
    try:
        token = state.token_file.read_text().strip()
    except OSError as exc:
        raise InfrastructureError(f"cannot read the token of pool {pool_id!r} ({state.token_file}): "
                                  f"{exc.strerror or exc}") from None
    return PoolConnection(pool_id=pool_id, url=state.url, token=token)


class PoolHttp:
    """Requests to a background pool with every failure mapped to a named error (no tracebacks)."""

    def __init__(self, conn: PoolConnection) -> None:
        import httpx

        self.conn = conn
        self._http = httpx.Client(base_url=conn.url, headers={"Authorization": f"Bearer {conn.token}"},
                                  timeout=httpx.Timeout(None, connect=10))

    def __enter__(self) -> PoolHttp:
        return self

    def __exit__(self, *exc: object) -> None:
        self._http.close()

    def request(self, method: str, path: str, **kw: Any) -> dict[str, Any]:
        import httpx

        where = f"pool {self.conn.pool_id!r} at {self.conn.url}"
        try:
            resp = self._http.request(method, path, **kw)
        except httpx.TransportError as exc:
            raise InfrastructureError(f"{where} does not answer ({exc.__class__.__name__}: {exc}); "
                                      "is it up? `atropos-sandbox pool status`") from None
        try:
            body = resp.json()
        except ValueError:
            body = None
        if resp.status_code == 401:
            raise InfrastructureError(f"{where} refused our token (401): it is not the pool this state belongs to; "
                                      "`pool down` and `pool up` again")
        err = body.get("error") if isinstance(body, dict) else None
        if resp.status_code >= 400 and isinstance(err, dict):
            raise PoolReplyError(resp.status_code, str(err.get("code", "error")), str(err.get("message", "")))
        if resp.status_code >= 400 or not isinstance(body, dict):  # not our error shape: not our pool
            raise InfrastructureError(f"{where} answered {method} {path} with {resp.status_code} and no JSON object "
                                      f"({resp.headers.get('content-type', 'no content type')}): is that port "
                                      "another service?")
        return body
