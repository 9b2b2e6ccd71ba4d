"""The few named errors of atropos-sandbox.

Two families matter to callers:

* ``ToolError`` subclasses describe something the *model* did (bad arguments, a path that
  escapes the slot). They become tool results the model reads.
* ``InfrastructureError`` subclasses describe something the *platform* did (a host died, a
  sandbox could not start). They are never shown to the model as an observation and never
  scored as 0: the environment retries the item.
"""

from __future__ import annotations


class AtroposSandboxError(Exception):
    """Base class of every error this package raises on purpose."""


class ConfigError(AtroposSandboxError):
    """A configuration value is invalid or a required setting is missing."""


class IsolationUnavailable(AtroposSandboxError):
    """The sandbox cannot confine code on this machine; we fail closed instead of running unconfined."""


class InfrastructureError(AtroposSandboxError):
    """The platform failed (host dead or frozen, sandbox start failed, transport error)."""


class HostUnavailable(InfrastructureError):
    """A sandbox host cannot be reached or stopped answering its health checks."""


class LeaseError(AtroposSandboxError):
    """A lease is unknown, stale (the slot was reset since) or belongs to someone else."""


class SlotSealed(LeaseError):
    """The slot is in its verification phase: the agent's part of the lease is over, so nothing
    runs or writes in it any more (only reading the workspace and ``verify``) until its reset."""


class SlotUnavailable(AtroposSandboxError):
    """No slot could be leased within the timeout."""


class ResetFailed(InfrastructureError):
    """A slot could not be restored to its pristine state; it is quarantined."""


class ToolError(AtroposSandboxError):
    """A tool call the model made cannot run as asked; the message is shown to the model.

    ``code`` is the host's stable error code (``not_found``, ``too_large``, ``path_escape``, ...) and
    ``status`` the HTTP status it maps to, so a caller (the ToolServer's REST routes) answers by
    code, never by searching the message."""

    def __init__(self, message: str = "", *, code: str = "tool_error", status: int = 400) -> None:
        super().__init__(message)
        self.code = code
        self.status = status


class ToolInputError(ToolError):
    """Unknown tool or arguments that fail validation."""


class PathEscapeError(ToolError):
    """A file path resolves outside the slot's workspace."""


def exit_code(exc: AtroposSandboxError) -> int:
    """The exit status of a command this error ended: 2 bad configuration, 3 infrastructure
    (host, isolation, cluster), 1 anything else (the CLI's EXIT_* codes)."""
    if isinstance(exc, ConfigError):
        return 2
    if isinstance(exc, (InfrastructureError, IsolationUnavailable)):
        return 3
    return 1
