"""Every error atropos-sandbox raises on purpose, with its stable code and HTTP status.

Two families matter to callers:

* ``ToolError`` subclasses describe something the *model* did (bad arguments, a path that
  escapes the slot). They become tool results the model reads.
* ``InfrastructureError`` subclasses describe something the *platform* did (a host died, a
  sandbox could not start). They are never shown to the model as an observation and never
  scored as 0: the environment retries the item.

One rule gives every error its HTTP status: it says who has to act. 4xx: the caller, whose request
cannot be served as asked (401 its credentials, 404 a thing it named does not exist, 409 the
state of a lease, slot or template forbids it, 422 its arguments fail validation, 499 it left);
502/503: the platform, retry later or elsewhere, never a verdict on the model; 500: a bug or a
misconfigured server. ``ERRORS`` (at the end) answers the rule for each class, with the class's
stable ``code`` for programs; both become the class attributes ``status`` and ``code``, which
every HTTP app of the package answers with (``atropos.asgi.ErrorMap``), never a code searched for
in a message. A ``ToolError`` carries the host's code and status per instance.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, Protocol


class AtroposSandboxError(Exception):
    """Base class of every error this package raises on purpose."""

    status: int  # both set from ERRORS below
    code: str


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

    def __init__(self, message: str = "", *, code: str | None = None, status: int | None = None) -> None:
        super().__init__(message)
        self.code = code or type(self).code
        self.status = status or type(self).status


class SandboxRestarted(ToolError):
    """The sandbox serving a call failed while it served it (it exited, was killed or stopped
    answering): something the slot's own code can cause (a supervisor it stopped or killed, memory
    it filled, a hand-over that could then not start). The call fails for the agent and the slot's
    next call gets a fresh sandbox (files kept); never an infrastructure retry."""


class ToolInputError(ToolError):
    """Unknown tool or arguments that fail validation."""


class PathEscapeError(ToolError):
    """A file path resolves outside the slot's workspace."""


# -- defined here, raised by one module each -----------------------------------------------------
class AuthenticationError(AtroposSandboxError):
    """A sandbox host refused our token (it answered 401): this server is misconfigured, which is
    not the fault of whoever called it (so 502, not 401)."""


class TransportError(InfrastructureError):
    """The connection to a host failed, closed early, sent something that is not HTTP, or timed
    out (``atropos.sandbox.contract.http1``; the host client turns it into ``HostUnavailable``)."""


class SandboxDied(InfrastructureError):
    """The sandbox process exited or stopped answering; the slot's sandbox must be restarted."""


class NetworkSetupFailed(InfrastructureError):
    """The slot's private network could not be configured."""


class WorkspaceError(InfrastructureError):
    """Mounting, unmounting or copying a workspace failed (the slot is quarantined)."""


class TemplateError(AtroposSandboxError):
    """A template request that cannot be served."""


class UnknownTemplate(TemplateError):
    """No template with that id (or name) on this host."""


class TemplateInUse(TemplateError):
    """The template cannot be deleted while a slot is built on it."""


class TemplateSourceError(TemplateError):
    """The template request names no usable source (missing fields, a directory not allowed)."""


class TemplateBuildFailed(TemplateError):
    """The source could not be turned into a tree (git clone failed, corrupt archive, ...)."""


class ImageRejected(AtroposSandboxError):
    """An image or one of its layers is refused: malformed, or hostile (a path that climbs out, a
    write through a symlink, a hard link out of its layer, a content digest that does not match)."""


class ImageOverBudget(ImageRejected):
    """An image does not fit its host's image store now: unpacking it would pass the store's disk
    budget less what images in use hold. Unlike its base, not a property of the image: the host
    does not remember it, and another host (or this one, later) may take the image."""


class SeccompUnavailable(IsolationUnavailable):
    """libseccomp is missing or refused to build our filter; we do not start sandboxes without it."""


class CgroupUnavailable(IsolationUnavailable):
    """No writable cgroup for per-slot limits here (the host refuses to start without one)."""


class DockerCgroupUnavailable(IsolationUnavailable):
    """The Docker backend cannot prepare a slot cgroup subtree for a container here."""


class GroupTooLarge(SlotUnavailable):
    """A group asks for more slots than the pool can ever hold (max_hosts x slots per host).

    Raised at once: waiting could only end in a timeout, and meanwhile the group would sit at
    the head of the FIFO queue holding up every request behind it."""


class InferenceUnavailable(InfrastructureError):
    """The inference server failed: unreachable, timed out, 5xx/429, or atroposlib's retries ran out."""


class TokenTrackingError(AtroposSandboxError):
    """ManagedServer did not track a rollout as one sequence (the chat template re-renders earlier
    turns differently from what the model generated), so its tokens and masks cannot be trusted."""


class ClientGone(AtroposSandboxError):
    """The HTTP client disconnected before the answer was ready; the work was cancelled (or undone)."""


class NomadAPIError(HostUnavailable):
    """Nomad answered with an unexpected status (``body`` is Nomad's plain-text error,
    ``nomad_status`` its status; ``status`` stays this error's own, as for every class here)."""

    def __init__(self, method: str, path: str, nomad_status: int, body: str) -> None:
        super().__init__(f"Nomad {method} {path} answered {nomad_status}: {body.strip()}")
        self.nomad_status = nomad_status
        self.body = body


class NomadUnreachable(HostUnavailable):
    """No answer from the Nomad agent (connection refused, timeout, TLS failure)."""


class PoolReplyError(AtroposSandboxError):
    """A background pool answered a CLI request with an error: ``status`` and ``code`` are the pool's
    own answer (the ToolServer's, from this table), passed on unchanged."""

    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(f"the pool answered {status} ({code}): {message}")
        self.status = status
        self.code = code

    @property
    def exit_code(self) -> int:
        # The request itself was wrong (unknown tool, bad arguments, provider not configured): usage (2).
        # A refused lease, no free slot, an overloaded or failing pool: infrastructure (3).
        return 3 if self.status in (401, 409, 429) or (self.status >= 500 and self.status != 501) else 2


# The rule of the module docstring, answered per class: (HTTP status, stable code). A subclass not
# listed answers as its nearest listed base.
ERRORS: dict[type[AtroposSandboxError], tuple[int, str]] = {
    AtroposSandboxError: (500, "internal_error"),
    ConfigError: (500, "config_error"),
    TokenTrackingError: (500, "token_tracking"),
    # the caller's
    ToolError: (400, "tool_error"),
    ToolInputError: (422, "invalid_arguments"),
    SandboxRestarted: (409, "sandbox_restarted"),
    PathEscapeError: (403, "path_escape"),
    TemplateError: (400, "template_error"),
    TemplateSourceError: (400, "template_source_invalid"),
    TemplateBuildFailed: (400, "template_failed"),
    UnknownTemplate: (404, "unknown_template"),
    TemplateInUse: (409, "template_in_use"),
    ImageRejected: (400, "image_rejected"),
    ImageOverBudget: (400, "image_over_budget"),
    LeaseError: (409, "lease_invalid"),
    SlotSealed: (409, "verification_phase"),
    GroupTooLarge: (400, "group_too_large"),
    ClientGone: (499, "client_gone"),
    # the platform's
    AuthenticationError: (502, "host_refused_token"),
    SlotUnavailable: (503, "no_free_slot"),
    IsolationUnavailable: (503, "isolation_unavailable"),
    SeccompUnavailable: (503, "seccomp_unavailable"),
    CgroupUnavailable: (503, "cgroup_unavailable"),
    DockerCgroupUnavailable: (503, "docker_cgroup_unavailable"),
    InfrastructureError: (503, "infrastructure"),
    HostUnavailable: (503, "host_unavailable"),
    TransportError: (503, "transport_failed"),
    SandboxDied: (503, "sandbox_failed"),
    NetworkSetupFailed: (503, "network_failed"),
    WorkspaceError: (503, "workspace_failed"),
    ResetFailed: (503, "reset_failed"),
    InferenceUnavailable: (503, "inference_unavailable"),
    NomadAPIError: (503, "nomad_error"),
    NomadUnreachable: (503, "nomad_unreachable"),
    PoolReplyError: (502, "pool_error"),
}
for _error, (_status, _code) in ERRORS.items():
    _error.status, _error.code = _status, _code


def exit_code(exc: AtroposSandboxError) -> int:
    """The exit status of a command this error ended: 2 bad configuration or a request that cannot
    be served as asked (an image refused: as a background pool's 4xx answer exits), 3 infrastructure
    (host, isolation, cluster), 1 anything else (the CLI's EXIT_* codes)."""
    if isinstance(exc, (ConfigError, ImageRejected)):
        return 2
    if isinstance(exc, (InfrastructureError, IsolationUnavailable)):
        return 3
    return 1


class _Problems(Protocol):
    """pydantic's ``ValidationError`` and FastAPI's ``RequestValidationError`` alike."""

    def errors(self) -> Any: ...


def validation_message(exc: _Problems, whole: str = "arguments", *, prefix: Iterable[str] = (),
                       given: bool = False, first: bool = False) -> str:
    """What failed validation, as one line: ``loc: message`` per problem, joined by ``; ``. The
    location is ``prefix`` then pydantic's ``loc`` joined by dots, or ``whole`` when both are empty
    (the input itself is wrong); ``given`` adds each offending input, ``first`` keeps only the first
    problem and counts the rest. Every boundary that turns a validation failure into words uses it."""
    lead = tuple(prefix)
    problems: list[Mapping[str, Any]] = list(exc.errors())
    lines = [f"{'.'.join(str(p) for p in (*lead, *err.get('loc', ()))) or whole}: {err.get('msg', '')}"
             + (f" (given {err.get('input')!r})" if given else "") for err in problems]
    if first and len(lines) > 1:
        return f"{lines[0]} (and {len(lines) - 1} more)"
    return "; ".join(lines)
