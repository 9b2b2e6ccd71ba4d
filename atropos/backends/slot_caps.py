"""What one slot of a host may use, as the fields every backend's config shares.

Each field is a flag of the host (``HostLaunch``: ``--slot-memory-bytes`` ...), enforced by the slot's
own cgroup and tmpfs. The constraints live here once; the defaults differ with where a host runs:

* ``SlotCaps`` itself (local, ray): the host is a process beside others on the machine, so a slot may
  hold a large share of it (4 GiB, 1024 pids, no CPU quota: equal shares) and its workspace may be
  uncapped (0: the data disk).
* ``ContainerSlotCaps``, the same fields with other defaults (docker, nomad): the host is a container
  with its own budget, which its slots split (1 GiB, 512 pids, 1 CPU each); the workspace is always
  a tmpfs inside the container's.

Every backend's config inherits one of them (so each is a ``SlotCaps``) and may change a default by
redeclaring the field with its type alias (as Nomad does for the workspace). Unknown fields are
refused (``extra="forbid"``).
"""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field

SlotsPerHost = Annotated[int, Field(ge=1, le=1023)]
SlotMemoryBytes = Annotated[int, Field(ge=64 << 20, description="memory one slot may hold as a whole (processes, "
                                       "tmpfs and memfd pages): its own cgroup")]
SlotPids = Annotated[int, Field(ge=16, description="processes and threads per slot")]
SlotCpus = Annotated[float, Field(ge=0, description="hard CPU quota per slot (CPUs); 0 = equal shares only")]
ProcessWorkspaceBytes = Annotated[int, Field(ge=0, description="what one slot can write to its workspace: its own "
                                             "tmpfs (RAM); 0 = uncapped (the data disk)")]
ContainerWorkspaceBytes = Annotated[int, Field(ge=1 << 20, description="what one slot can write (its own tmpfs)")]


class SlotCaps(BaseModel):
    """Slot caps of hosts that run as processes on a machine (local, ray); the base of every backend's config."""

    # A typo'd setting must fail loudly, not fall back to a default silently.
    model_config = ConfigDict(extra="forbid")

    slots_per_host: SlotsPerHost = 16
    slot_workspace_bytes: ProcessWorkspaceBytes = 1 << 30
    slot_memory_bytes: SlotMemoryBytes = 4 << 30
    slot_pids: SlotPids = 1024
    slot_cpus: SlotCpus = 0.0


class ContainerSlotCaps(SlotCaps):
    """Slot caps of hosts that run as containers with a budget of their own (docker, nomad)."""

    slot_workspace_bytes: ContainerWorkspaceBytes = 256 << 20
    slot_memory_bytes: SlotMemoryBytes = 1 << 30
    slot_pids: SlotPids = 512
    slot_cpus: SlotCpus = 1.0
