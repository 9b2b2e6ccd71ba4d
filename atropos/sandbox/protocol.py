"""Wire models of the sandbox host's HTTP API (version 1).

Every request carries ``Authorization: Bearer <host token>``. Calls on a slot also carry the
slot's lease token, which the host issued and rotates on every reset.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field

API_VERSION = "v1"
LEASE_HEADER = "X-Atropos-Lease"

SlotState = Literal["free", "leased", "resetting", "quarantined"]


class ErrorInfo(BaseModel):
    code: str = Field(description="stable machine-readable code, e.g. lease_invalid, not_found, too_large")
    message: str
    status: int = Field(400, description="the HTTP status this error maps to")


class ErrorResponse(BaseModel):
    error: ErrorInfo


class LeaseRequest(BaseModel):
    trajectory_id: str = Field(min_length=1, max_length=256)
    network: bool = Field(False, description="let the slot's commands reach the network")
    slot: int | None = Field(None, ge=0, description="a specific slot; default: any free slot")


class LeaseInfo(BaseModel):
    slot: int
    lease: str = Field(description="secret lease token; every call on the slot must carry it")
    generation: int = Field(description="increases on every reset of the slot")
    trajectory_id: str
    network: bool


class LeaseRef(BaseModel):
    lease: str = Field(min_length=1, max_length=256)


class ResetRequest(LeaseRef):
    trajectory_id: str | None = Field(None, max_length=256, description="new owner after the reset")
    network: bool | None = None


class ResetResult(BaseModel):
    slot: int
    ok: bool
    quarantined: bool
    duration_ms: float
    detail: str = ""
    lease: LeaseInfo | None = Field(None, description="the fresh lease when the slot stays leased")


class ToolCall(BaseModel):
    id: str = Field(min_length=1, max_length=256)
    slot: int = Field(ge=0)
    lease: str = Field(min_length=1, max_length=256)
    tool: str = Field(min_length=1, max_length=128)
    args: dict[str, Any] = Field(default_factory=dict)
    timeout_s: float | None = Field(None, gt=0)
    trajectory_id: str | None = Field(None, max_length=256)


class CallBatch(BaseModel):
    calls: list[ToolCall] = Field(min_length=1, max_length=10_000)


class CallResult(BaseModel):
    id: str
    slot: int
    ok: bool = Field(description="False when the call could not run as asked (see error)")
    result: dict[str, Any] | None = None
    error: ErrorInfo | None = None
    notes: list[str] = Field(default_factory=list)
    duration_ms: float = 0.0


class SlotInfo(BaseModel):
    slot: int
    state: SlotState
    generation: int
    trajectory_id: str | None = None
    network: bool = False
    leased_for_s: float | None = None
    calls: int = 0
    sandbox_running: bool = False
    detail: str = ""


class HealthInfo(BaseModel):
    ok: bool
    version: str
    slots: int
    free: int
    leased: int
    quarantined: int
    exec_ms: float = Field(description="round trip of `true` through the real exec path")
    isolation: Literal["bubblewrap", "none"]
    detail: str = ""
