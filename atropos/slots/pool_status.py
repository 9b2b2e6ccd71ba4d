"""What ``SlotPool.status()`` reports (also exported as Prometheus metrics by atropos/metrics.py)."""

from __future__ import annotations

from pydantic import BaseModel, Field


class HostStatus(BaseModel):
    id: str
    address: str
    slots: int
    free: int
    leased: int
    quarantined: int
    healthy: bool = Field(description="not declared dead or suspected, and its last health probe passed")
    health_ms: float | None
    oldest_lease_s: float | None
    node: str | None = Field(None, description="the cluster node the host runs on, for backends that place "
                                               "hosts on nodes (ray: the Ray node id)")
    images: list[str] = Field(default_factory=list, description="task images the host holds in its layer store "
                                                                "(prepared or leased through this pool)")


class PoolStatus(BaseModel):
    pool_id: str
    backend: str
    hosts: list[HostStatus]
    starting_hosts: int
    free: int
    leased: int
    quarantined: int
    waiting: int
    leases_total: int
    calls_total: int
    calls_per_s: float
    lost_hosts: int
    # Monotonic event counters for operators (atropos/metrics.py exports them as Prometheus counters).
    scale_ups: int = Field(0, description="hosts started by scaling (demand, replacing a dead host, below min)")
    scale_downs: int = Field(0, description="idle hosts stopped by scaling")
    quarantines: int = Field(0, description="slots quarantined after a failed or refused reset")
