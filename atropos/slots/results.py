"""Typed results of the ``Lease`` helpers. Fields are attributes (``out.stdout``); indexing
(``out["stdout"]``) and ``get`` keep working for code written against the plain dicts."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

__all__ = ["BashResult", "SessionResult", "WriteResult"]


class _Result(BaseModel):
    # a newer host may add fields: kept (reachable by index), never an error
    model_config = ConfigDict(extra="allow", frozen=True)

    def __getitem__(self, key: str) -> Any:
        try:
            return getattr(self, key)
        except AttributeError:
            raise KeyError(key) from None

    def __contains__(self, key: object) -> bool:
        return isinstance(key, str) and key in self.model_dump()

    def get(self, key: str, default: Any = None) -> Any:
        return getattr(self, key, default)


class BashResult(_Result):
    """What a ``bash`` call did. A command that fails is a result (``exit_code`` != 0), not an error."""

    exit_code: int | None = Field(description="the command's exit status; None when a signal ended it")
    signal: int | None = Field(None, description="the signal that ended it, if one did")
    timed_out: bool = Field(False, description="killed at its timeout")
    stdout: str = Field("", description="standard output (head and tail kept when over the cap)")
    stderr: str = Field("", description="standard error (same cap)")
    stdout_bytes: int = Field(0, description="bytes written to stdout, including any cut")
    stderr_bytes: int = Field(0, description="bytes written to stderr, including any cut")
    stdout_truncated: bool = False
    stderr_truncated: bool = False
    duration_ms: float = 0.0


class WriteResult(_Result):
    """Where ``write_file`` wrote: ``path`` as bash in the slot sees it (``/workspace/...``)."""

    path: str
    bytes_written: int
    size: int = Field(description="the file's size after the write")


class SessionResult(_Result):
    """What a ``python_session`` cell did. A cell that raises is a result with ``error`` set; a
    session that was lost (it ignored its interrupt, crashed, ran out of memory) is one with
    ``restarted`` set: the next call starts an empty interpreter."""

    stdout: str = ""
    stderr: str = ""
    value: str | None = Field(None, description="repr of the cell's last expression, if any")
    error: dict[str, Any] | None = Field(None, description="``type``, ``message`` and ``traceback`` of what it raised")
    timed_out: bool = Field(False, description="interrupted at its timeout")
    output_limited: bool = Field(False, description="interrupted at the output limit")
    restarted: bool = Field(False, description="the session was lost during the call and restarted empty")
    session_started: bool = Field(False, description="this call started a new interpreter")
    duration_ms: float = 0.0
