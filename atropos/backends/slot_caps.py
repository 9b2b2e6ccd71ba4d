"""What one slot of a host may use, as the fields every backend's config shares.

Each field is a flag of the host (``HostLaunch``: ``--slot-memory-bytes`` ...), enforced by the slot's
own cgroup and tmpfs. The defaults differ with where a host runs:

* ``SlotCaps`` itself (local, ray): the host is a process beside others on the machine, so a slot may
  hold a large share of it (4 GiB, 1024 pids, no CPU quota: equal shares) and its workspace may be
  uncapped (0: the data disk).
* ``ContainerSlotCaps``, the same fields with other defaults (docker, nomad): the host is a container
  with its own budget, which its slots split (1 GiB, 512 pids, 1 CPU each); the workspace is always
  a tmpfs inside the container's.

Each field is a field of ``SlotLimits`` (atropos/sandbox/contract/launch.py), which declares its type,
bounds, unit and process default once; ``slot_limits()`` is what a host is launched with. The
largest per-call timeout is one of them: the host enforces it and declares it to the pool itself.

Every backend's config inherits one of them (so each is a ``SlotCaps``) and may change a default by
redeclaring the field with its type alias (as Nomad does for the workspace). Unknown fields are
refused (``extra="forbid"``).
"""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field

from atropos.sandbox.contract.launch import (
    SlotCpus,
    SlotLimits,
    SlotMemoryBytes,
    SlotPids,
    SlotWorkspaceBytes,
)
from atropos.sandbox.contract.protocol import MaxTimeoutS

SlotsPerHost = Annotated[int, Field(ge=1, le=1023)]
ContainerWorkspaceBytes = Annotated[int, Field(ge=1 << 20, description="what one slot can write (its own tmpfs)")]
_HOST = SlotLimits()  # a host's own defaults: the process backends' (local, ray)


class SlotCaps(BaseModel):
    """Slot caps of hosts that run as processes on a machine (local, ray); the base of every backend's config."""

    # A typo'd setting must fail loudly, not fall back to a default silently.
    model_config = ConfigDict(extra="forbid")

    slots_per_host: SlotsPerHost = 16
    slot_workspace_bytes: SlotWorkspaceBytes = _HOST.workspace_bytes
    slot_memory_bytes: SlotMemoryBytes = _HOST.memory_bytes
    slot_pids: SlotPids = _HOST.pids
    slot_cpus: SlotCpus = _HOST.cpus
    max_timeout_s: MaxTimeoutS = _HOST.max_timeout_s

    def slot_limits(self) -> SlotLimits:
        """What each of this backend's hosts is launched with (``HostLaunch.limits``)."""
        return SlotLimits(**{name: getattr(self, setting_name(name)) for name in SlotLimits.model_fields})


def setting_name(limit: str) -> str:
    """A backend config's name of a ``SlotLimits`` field (what a config file, ``ATROPOS_NOMAD_<NAME>``
    and ``nomad/sandbox.hcl`` say): ``slot_<field>``, the call timeout as is."""
    return limit if limit == "max_timeout_s" else f"slot_{limit}"


class ContainerSlotCaps(SlotCaps):
    """Slot caps of hosts that run as containers with a budget of their own (docker, nomad)."""

    slot_workspace_bytes: ContainerWorkspaceBytes = 256 << 20
    slot_memory_bytes: SlotMemoryBytes = 1 << 30
    slot_pids: SlotPids = 512
    slot_cpus: SlotCpus = 1.0
