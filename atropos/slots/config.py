"""Pool settings."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from pydantic import BaseModel, Field, model_validator

from atropos.backends.base import user_pool_id
from atropos.renamed import accept_renamed

DUMPABLE_ENV = "ATROPOS_POOL_DUMPABLE"  # =1: the opt-out of PoolConfig.dumpable's default, for a whole trainer

# old name -> name (one setting had two names: the wait for a free slot)
RENAMED = {"lease_timeout_s": "acquire_timeout_s"}


class PoolConfig(BaseModel):
    pool_id: str = Field(default_factory=user_pool_id, pattern=r"^[A-Za-z0-9_.-]{1,64}$",
                         description="names this pool's hosts (default py-<user>: per user, as the CLI's cli-<user>)")
    min_hosts: int = Field(1, ge=0)
    max_hosts: int = Field(4, ge=1)
    acquire_timeout_s: float = Field(300.0, gt=0, description="default wait for a free slot (lease_timeout_s "
                                                              "is its deprecated old name)")
    health_interval_s: float = Field(2.0, gt=0)
    health_timeout_s: float = Field(5.0, gt=0, description="a host slower than this fails the probe")
    health_failures: int = Field(2, ge=1, description="consecutive failed probes before a host is declared dead")
    scale_down_idle_s: float = Field(120.0, ge=0, description="an idle host above min_hosts is stopped after this")
    start_retry_s: float = Field(5.0, gt=0, description="pause before retrying a failed host start")
    control_requests: int = Field(
        32, ge=1, description="at most this many requests in flight at once to the pool's hosts besides tool calls "
                              "and releases: a starting host's health check and a lease per slot, health probes. "
                              "A fleet started or probed at once opens this many connections, not one per slot "
                              "or host (100 hosts x 100 slots opened 10,000 together, and on a busy machine they "
                              "timed out connecting; benchmarks/README.md, pool shards)")
    connect_timeout_s: float = Field(
        5.0, gt=0, description="a new connection to a host must be made within this. The timer runs on the pool's "
                               "event loop: a trainer process starved of CPU (thousands of trajectories in one "
                               "process on a loaded machine) lags past it on connections the host accepted at once")
    audit_path: Path | None = Field(None, description="append one JSON line per lease and release here")
    malloc_trim_interval_s: float | None = Field(
        60.0, gt=0, description="return glibc's free pages to the kernel this often (malloc_trim), so the "
                                "process's RSS follows its live heap over millions of leases; None: never")
    dumpable: bool = Field(
        default_factory=lambda: os.environ.get(DUMPABLE_ENV) == "1",
        description="leave the pool's process dumpable. By default start() makes it non-dumpable "
                    "(prctl PR_SET_DUMPABLE 0) before it makes any host token: no other process of its user "
                    "may read its memory, fds or environ. That also stops ptrace, py-spy and core dumps of the "
                    f"trainer; set True (or ${DUMPABLE_ENV}=1) where they are needed and the user runs nothing else")

    @model_validator(mode="before")
    @classmethod
    def _renamed(cls, data: Any) -> Any:
        return accept_renamed(data, RENAMED, "PoolConfig")

    @model_validator(mode="after")
    def _bounds(self) -> PoolConfig:
        if self.min_hosts > self.max_hosts:
            raise ValueError(f"min_hosts ({self.min_hosts}) > max_hosts ({self.max_hosts})")
        return self
