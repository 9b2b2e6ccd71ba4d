"""Reading Nomad's allocation JSON: is it live, usable, why did it die, where does it listen.

Pure functions of one allocation (a list stub or a single read); the ledger
(``atropos/backends/nomad/ledger.py``) decides what they mean for the pool.
"""

from __future__ import annotations

from typing import Any

from atropos.backends.nomad.job import PORT_LABEL, TASK
from atropos.errors import HostUnavailable

START_FAILURES = ("Driver Failure", "Failed Validation", "Setup Failure")  # task events: the start itself failed
LIVE_CLIENT = ("pending", "running")
GONE_CLIENT = ("complete", "lost")

Alloc = dict[str, Any]  # an allocation as Nomad's API returns it


class AllocDied(Exception):
    """The allocation a start waits for failed, stopped or vanished."""

    def __init__(self, description: str, start_error: str | None = None) -> None:
        super().__init__(description)
        self.start_error = start_error  # the driver could not start the task at all (see start_error)

    @classmethod
    def of(cls, alloc: Alloc) -> AllocDied:
        return cls(describe_alloc(alloc), start_error(alloc))


def name_index(name: str) -> int:
    """``job.group[3]`` -> 3 (-1 when the name has no index)."""
    try:
        return int(name.rsplit("[", 1)[1].rstrip("]"))
    except (IndexError, ValueError):
        return -1


def index_of(alloc: Alloc) -> int:
    return name_index(alloc.get("Name", ""))


def restarts(alloc: Alloc) -> int:
    state = (alloc.get("TaskStates") or {}).get(TASK) or {}
    return int(state.get("Restarts") or 0)


def is_live(alloc: Alloc) -> bool:
    """Holds a name in Nomad's reconciler: desired run and not finished (failed ones too)."""
    return alloc.get("DesiredStatus") == "run" and alloc.get("ClientStatus") not in GONE_CLIENT


def is_usable(alloc: Alloc) -> bool:
    return alloc.get("DesiredStatus") == "run" and alloc.get("ClientStatus") in LIVE_CLIENT


def is_running(alloc: Alloc) -> bool:
    return alloc.get("DesiredStatus") == "run" and alloc.get("ClientStatus") == "running"


def awaits_reschedule(alloc: Alloc) -> bool:
    """Failed, and Nomad has not placed its replacement yet."""
    return (alloc.get("DesiredStatus") == "run" and alloc.get("ClientStatus") == "failed"
            and not alloc.get("NextAllocation"))


def task_events(alloc: Alloc) -> list[dict[str, Any]]:
    events: list[dict[str, Any]] = ((alloc.get("TaskStates") or {}).get(TASK) or {}).get("Events") or []
    return events


def event_detail(ev: dict[str, Any]) -> str:
    """What a task event says went wrong ("" if nothing)."""
    return str(ev.get("DriverError") or ev.get("SetupError") or ev.get("ValidationError")
               or ev.get("DisplayMessage") or "")


def start_error(alloc: Alloc) -> str | None:
    """The task event saying the container could not even be started (driver failure, bad driver
    config, setup failure), or None. Nomad reschedules such an allocation like any crash, but the
    next one almost always fails the same way (privileged mode off, a missing runtime or image)."""
    for ev in reversed(task_events(alloc)):
        if ev.get("Type") in START_FAILURES:
            detail = event_detail(ev)
            return f"{ev['Type']}: {detail}" if detail else str(ev["Type"])
    return None


def describe_alloc(alloc: Alloc) -> str:
    """One line on why an allocation is where it is, with its last task events."""
    parts = [f"{alloc.get('Name', '?')} ({str(alloc.get('ID', ''))[:8]}) is "
             f"{alloc.get('ClientStatus', '?')}/{alloc.get('DesiredStatus', '?')}"]
    why = alloc.get("DesiredDescription") or alloc.get("ClientDescription")
    if why:
        parts.append(f": {why}")
    msgs = []
    for ev in task_events(alloc)[-4:]:
        detail = event_detail(ev) or ev.get("RestartReason") or ""
        msgs.append(f"{ev.get('Type', '?')}" + (f" ({detail})" if detail else ""))
    if msgs:
        parts.append("; events: " + ", ".join(msgs))
    return "".join(parts)


def alloc_address(alloc: Alloc, label: str = PORT_LABEL) -> str:
    """``http://HostIP:port`` of a dynamic port, from a *single* allocation read."""
    res = alloc.get("AllocatedResources") or {}
    shared = res.get("Shared") or {}
    ip, port = None, None
    for p in shared.get("Ports") or []:
        if p.get("Label") == label:
            ip, port = p.get("HostIP"), p.get("Value")
    if not (ip and port):
        ip, port = _network_port(res, label)
    if not (ip and port):
        raise HostUnavailable(f"allocation {alloc.get('ID')} has no address for port {label!r}")
    host = f"[{ip}]" if ":" in str(ip) else str(ip)
    return f"http://{host}:{int(port)}"


def _network_port(res: dict[str, Any], label: str) -> tuple[Any, Any]:
    """(ip, port) of ``label`` in the older per-network layout of AllocatedResources."""
    ip, port = None, None
    networks = list((res.get("Shared") or {}).get("Networks") or [])
    for task_res in (res.get("Tasks") or {}).values():
        networks += (task_res or {}).get("Networks") or []
    for net in networks:
        for p in (net.get("DynamicPorts") or []) + (net.get("ReservedPorts") or []):
            if p.get("Label") == label:
                ip, port = net.get("IP"), p.get("Value")
    return ip, port
