"""Wire models of the sandbox host's HTTP API (version 1).

Every request carries ``Authorization: Bearer <host token>``. Calls on a slot also carry the
slot's lease token, which the host issued and rotates on every reset.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from atropos.sandbox.contract.imageref import ImageRef

API_VERSION = "v1"
LEASE_HEADER = "X-Atropos-Lease"

SlotState = Literal["free", "leased", "resetting", "quarantined"]
WorkspaceKind = Literal["plain", "overlay", "copy", "image"]


class Wire(BaseModel):
    """Base of every message parsed from JSON on the hot path. pydantic-core caches the short
    strings it parses in one process-wide table of 16,384 entries; our values (trajectory ids,
    lease tokens, command output) are unique per call, so caching them only churns that table:
    each process grew ~1 MB over its first few thousand trajectories before it filled (a
    tracemalloc diff of a soak). Field names, the few strings worth caching, stay cached."""

    model_config = ConfigDict(cache_strings="keys")


# The per-call time limits of a host, declared once: the host's config and flags, the launch
# command line, every backend config and the client take their type, bounds and default from here.
DEFAULT_MAX_TIMEOUT_S = 600.0
MaxTimeoutS = Annotated[float, Field(gt=0, description="largest per-call timeout (s); a longer one is clamped")]
DefaultTimeoutS = Annotated[float, Field(gt=0, description="timeout (s) of a call that names none (lowered to "
                                                           "max_timeout_s when above it)")]


class CallTimeouts(Wire):
    """A host's per-call time limits, as the host declares them in every health reply: the pool's
    client waits as long as the host may run a call (a client that assumed its own default cut
    every longer call and reported a healthy host unavailable)."""

    max_timeout_s: MaxTimeoutS = DEFAULT_MAX_TIMEOUT_S
    default_timeout_s: DefaultTimeoutS = 60.0


class ErrorInfo(Wire):
    code: str = Field(description="stable machine-readable code, e.g. lease_invalid, not_found, too_large")
    message: str
    status: int = Field(400, description="the HTTP status this error maps to")


class LeaseRequest(Wire):
    trajectory_id: str = Field(min_length=1, max_length=256)
    network: bool = Field(False, description="let the slot's commands reach the network")
    slot: int | None = Field(None, ge=0, description="a specific slot; default: any free slot")
    template: str | None = Field(None, max_length=64,
                                 description="start the slot as a copy-on-write fork of this template")


class LeaseInfo(Wire):
    slot: int
    lease: str = Field(description="secret lease token; every call on the slot must carry it")
    generation: int = Field(description="increases on every reset of the slot")
    trajectory_id: str
    network: bool


class LeaseRef(Wire):
    lease: str = Field(min_length=1, max_length=256)


class ResetRequest(LeaseRef):
    trajectory_id: str | None = Field(None, max_length=256, description="new owner after the reset")
    network: bool | None = None
    template: str | None = Field(None, max_length=64,
                                 description="reset to a fork of this template instead of an empty workspace")
    image: ImageRef | None = Field(None, description="reset to a fresh root of this task image (a Docker "
                                                     "engine reference, oci:DIR[:TAG] of an OCI layout on the host, "
                                                     "derived:..., docker://REGISTRY/REPO[:TAG]): see "
                                                     "docs/task-images.md")
    keep_if_fresh: bool | None = Field(None, description="with image: a slot whose root is an unused, fresh root of "
                                                   "the image the reference names now is kept as it is (a new "
                                                   "lease token, no reset); any other is reset to that image")


class ResetResult(Wire):
    slot: int
    ok: bool
    quarantined: bool
    duration_ms: float
    detail: str = ""
    lease: LeaseInfo | None = Field(None, description="the fresh lease when the slot stays leased")
    template: str | None = Field(None, description="the template the workspace now is a fork of")
    verified: str = Field("", description="what the host checked before declaring the reset done")
    kept: bool = Field(False, description="keep_if_fresh found the slot's root fresh and current: nothing was reset")


MAX_VERIFY_PROGRAM = 1 << 20
MAX_VERIFY_SECRETS = 16 << 20


class FreshRoot(Wire):
    """Verify on a new root (docs/verification.md, "A fresh root"): the image's layers, plus only the
    agent's changes under ``repo_dir`` (caches and ``.git`` left out), plus ``from_image`` exactly as
    the image has them. Nothing else the agent changed exists there."""

    model_config = ConfigDict(extra="forbid")

    repo_dir: str = Field(pattern=r"^/[^\x00]*[^/\x00]$", max_length=4096,
                          description="the repository, absolute (e.g. /testbed)")
    from_image: list[Annotated[str, Field(min_length=1, max_length=4096)]] = Field(
        default_factory=list, max_length=4096,
        description="paths relative to repo_dir taken from the image (the task's test files and test settings); "
                    "a path the image lacks is absent")

    def model_post_init(self, _: Any) -> None:
        for path in [self.repo_dir.strip("/"), *self.from_image]:
            parts = path.split("/")
            if path.startswith("/") or any(p in ("", ".", "..") or "\0" in p for p in parts):
                raise ValueError(f"fresh_root: {path!r} is not a plain path (no '..', '.', empty or absolute part)")


class VerifySpec(Wire):
    """What a verification runs: every field ``Lease.verify`` takes, declared once for the host's
    request (``VerifyRequest``) and the ToolServer's REST body (``atropos.api.server``)."""

    program: str = Field(min_length=1, max_length=MAX_VERIFY_PROGRAM,
                         description="Python source defining verify(workspace, secrets, args) -> number | dict "
                                     "with a numeric 'score'")
    secrets: dict[str, str] = Field(default_factory=dict,
                                    description="hidden tests, expected answers, keys: reach only the verifier "
                                                "process, in memory (never a file, argv or environment)")
    args: Any = Field(None, description="any JSON value, passed to verify() as `args`")
    timeout_s: float = Field(60.0, gt=0, le=3600)
    restore: list[str] = Field(default_factory=list, max_length=4096,
                               description="on an image root: absolute paths (files or directories) put back exactly "
                                           "as the image has them before the program runs (test files, their "
                                           "configuration: the agent's edits there do not count)")
    fresh_root: FreshRoot | None = Field(None, description="on an image root: run the program on a new root of the "
                                                           "image plus only the agent's changes to one repository")

    def secrets_size(self) -> int:
        return sum(len(k) + len(v.encode()) for k, v in self.secrets.items())


class VerifyRequest(LeaseRef, VerifySpec):
    """Run a verifier program against the slot's final workspace (the verification phase: see
    docs/verification.md). Starting it ends the agent's part of the lease for good."""


class VerifyResult(Wire):
    slot: int
    ok: bool = Field(description="the program ran and returned a valid verdict")
    score: float | None = Field(None, description="the verdict's score; None when ok is False")
    verdict: dict[str, Any] | None = Field(None, description="everything verify() returned (plain JSON)")
    error: ErrorInfo | None = Field(None, description="why there is no verdict: timed_out, program_failed, "
                                                      "bad_verdict, bad_program, verifier_died")
    log: str = Field("", description="tail of the program's stdout/stderr; for reading, never for scoring")
    duration_ms: float = 0.0
    separation: str = Field("", description="what the host established before the verifier started")
    fresh_root: dict[str, Any] | None = Field(None, description="with fresh_root: what went into the verification "
                                                                "root (files, bytes, whiteouts, dropped links)")


class SealResult(Wire):
    slot: int
    separation: str = Field(description="what the host established about the agent's processes")
    duration_ms: float = 0.0


class ToolCall(Wire):
    id: str = Field(min_length=1, max_length=256)
    slot: int = Field(ge=0)
    lease: str = Field(min_length=1, max_length=256)
    tool: str = Field(min_length=1, max_length=128)
    args: dict[str, Any] = Field(default_factory=dict)
    timeout_s: float | None = Field(None, gt=0)
    trajectory_id: str | None = Field(None, max_length=256)


class CallBatch(Wire):
    calls: list[ToolCall] = Field(min_length=1, max_length=10_000)


class CallResult(Wire):
    id: str
    slot: int
    ok: bool = Field(description="False when the call could not run as asked (see error)")
    result: dict[str, Any] | None = None
    error: ErrorInfo | None = None
    notes: list[str] = Field(default_factory=list)
    duration_ms: float = 0.0


class SlotInfo(Wire):
    slot: int
    state: SlotState
    generation: int
    trajectory_id: str | None = None
    network: bool = False
    leased_for_s: float | None = None
    calls: int = 0
    sandbox_running: bool = False
    session_running: bool = Field(False, description="a python_session interpreter is alive in the slot")
    detail: str = ""
    template: str | None = Field(None, description="the template this workspace is a fork of")
    image: str | None = Field(None, description="the task image the slot's root is (docs/task-images.md)")
    workspace: WorkspaceKind = Field("plain", description="plain dir | overlay fork | copy of a template | image root")
    sealed: bool = Field(False, description="in its verification phase: nothing runs in it until its reset")


class PrewarmResult(Wire):
    """What ``POST /v1/prewarm`` set going (202: the sandboxes start in the background)."""

    warming: int = Field(description="slots whose sandbox this request starts now, in the background")
    slots: list[int] = Field(default_factory=list, description="their indices")
    running: int = Field(0, description="slots whose sandbox already runs or is already being started")
    skipped: int = Field(0, description="slots left alone: leased with network, busy (a call, reset or seal "
                                        "holds them), resetting, quarantined or sealed")


class HealthInfo(Wire):
    ok: bool
    version: str
    slots: int
    free: int
    leased: int
    quarantined: int
    exec_ms: float = Field(description="round trip of `true` through the real exec path")
    isolation: Literal["bubblewrap", "none"]
    detail: str = ""
    workspace_mode: Literal["overlay", "copy"] = Field(
        "copy", description="how forks are made: overlayfs (copy-on-write) or full copies (fallback)")
    workspace_detail: str = Field("", description="why the host uses copies, when it does")
    templates: int = 0
    mounts: int | None = Field(None, description="workspace mounts of this host (a capped workspace and run "
                                                 "dir per slot, two more per forked slot); only when asked "
                                                 "for (GET /v1/health?mounts=true)")
    workspace_cap_bytes: int | None = Field(None, description="what each slot can write to its workspace "
                                                              "(None: uncapped, the data dir's disk)")
    workspace_cap_detail: str = ""
    timeouts: CallTimeouts | None = Field(None, description="this host's per-call time limits (None: an older "
                                                            "host, whose limits the client cannot know)")


class TemplateRequest(Wire):
    """Make a template. A tar upload instead posts the archive itself (Content-Type application/x-tar
    or application/gzip, ``?name=``) to the same path."""

    source: Literal["slot", "dir", "git"]
    name: str = Field("", max_length=128)
    slot: int | None = Field(None, ge=0, description="source=slot: the leased slot to snapshot")
    lease: str | None = Field(None, max_length=256, description="source=slot: its lease token")
    path: str | None = Field(None, max_length=4096,
                             description="source=dir: a host directory under an allowed source dir")
    url: str | None = Field(None, max_length=4096, description="source=git: repository URL (or allowed local path)")
    ref: str | None = Field(None, max_length=256, description="source=git: branch, tag or commit to check out")
    depth: int | None = Field(None, ge=1, description="source=git: shallow clone depth")


class ImageRequest(Wire):
    reference: ImageRef = Field(description="a Docker engine reference (repo/task:tag), oci:DIR[:TAG] of an OCI "
                                            "layout, derived:..., or docker://REGISTRY/REPO[:TAG]")


class ImageInfo(Wire):
    """A task image a host holds in its layer store (docs/task-images.md)."""

    reference: str
    id: str = Field(description="the image's id (the engine's, or the OCI index's digest)")
    layers: int
    slots: list[int] = Field(default_factory=list, description="slots whose root is this image now")
    duration_ms: float = Field(0.0, description="of the request that imported (or found) it")


class TemplateInfo(Wire):
    id: str
    name: str = ""
    source: str
    created_at: float
    files: int
    dirs: int
    others: int = Field(0, description="symlinks and special files")
    bytes: int
    tree_hash: str = Field(description="sha256 of the tree's manifest (paths, types, modes, sizes, mtimes, links)")
    prepare_ms: float = 0.0
    users: list[int] = Field(default_factory=list, description="slots whose workspace is built on it")
