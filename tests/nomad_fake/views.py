"""JSON views of the cluster state, shaped like Nomad's structs.

* Single ``Allocation`` and ``Evaluation`` objects omit empty fields (``_struct``
  omitempty), list stubs (``AllocListStub``) keep every field with ``null``.
* ``AllocatedResources`` (and so the ports) only appear on ``GET /v1/allocation/:id`` and on
  ``GET /v1/allocations?resources=true``, never on ``/v1/job/:id/allocations``.
* Times are RFC3339Nano strings (``null`` when zero) except ``CreateTime``/``ModifyTime``/
  event ``Time`` (int64 ns), durations are int64 ns.
"""

from __future__ import annotations

from typing import Any

from .encode import omit_empty, rfc3339nano
from .spec import find_group
from .state import Alloc, Cluster, Deployment, Node, TaskRun


def task_state(tr: TaskRun) -> dict[str, Any]:
    return {
        "State": tr.state,
        "Failed": tr.failed,
        "Restarts": tr.restarts,
        "LastRestart": rfc3339nano(tr.last_restart_ns),
        "StartedAt": rfc3339nano(tr.started_at_ns),
        "FinishedAt": rfc3339nano(tr.finished_at_ns),
        "Events": [dict(e) for e in tr.events],
        "TaskHandle": None,
        "Paused": "",
    }


def desired_transition(a: Alloc) -> dict[str, Any]:
    return {
        "Migrate": a.desired_transition.get("Migrate"),
        "Reschedule": a.desired_transition.get("Reschedule"),
        "ForceReschedule": a.desired_transition.get("ForceReschedule"),
        "NoShutdownDelay": a.desired_transition.get("NoShutdownDelay"),
        "MigrateDisablePlacement": a.desired_transition.get("MigrateDisablePlacement"),
    }


def reschedule_tracker(a: Alloc) -> dict[str, Any] | None:
    if not a.reschedule_events:
        return None
    return {"Events": [dict(e) for e in a.reschedule_events], "LastReschedule": "ok"}


def allocated_resources(a: Alloc) -> dict[str, Any]:
    tg = find_group(a.job, a.task_group) or {}
    tasks: dict[str, Any] = {}
    lifecycles: dict[str, Any] = {}
    for t in tg.get("Tasks") or []:
        res = t.get("Resources") or {}
        tasks[t["Name"]] = {
            "Cpu": {"CpuShares": int(res.get("CPU", 100)), "ReservedCores": None},
            "Memory": {"MemoryMB": int(res.get("MemoryMB", 300)), "MemoryMaxMB": int(res.get("MemoryMaxMB") or 0)},
            "Networks": None,
            "Devices": None,
        }
        lifecycles[t["Name"]] = t.get("Lifecycle")
    disk = (tg.get("EphemeralDisk") or {}).get("SizeMB", 300)
    return {
        "Tasks": tasks,
        "TaskLifecycles": lifecycles,
        "Shared": {
            "DiskMB": disk,
            "Networks": [dict(n) for n in a.networks] or None,
            "Ports": [dict(p) for p in a.ports] or None,
        },
    }


def alloc_full(c: Cluster, a: Alloc) -> dict[str, Any]:
    """``GET /v1/allocation/:id``: every empty field omitted."""
    ready = sum(1 for n in c.nodes.values() if n.status == "ready")
    d: dict[str, Any] = {
        "ID": a.id,
        "Namespace": a.namespace,
        "EvalID": a.eval_id,
        "Name": a.name,
        "NodeID": a.node_id,
        "NodeName": a.node_name,
        "JobID": a.job_id,
        "Job": a.job,
        "TaskGroup": a.task_group,
        "AllocatedResources": allocated_resources(a),
        "Metrics": {
            "NodesEvaluated": ready,
            "NodesFiltered": 0,
            "NodesInPool": len(c.nodes),
            "NodesAvailable": {c.datacenter: ready},
            "ClassFiltered": None,
            "ConstraintFiltered": None,
            "NodesExhausted": 0,
            "ClassExhausted": None,
            "DimensionExhausted": None,
            "QuotaExhausted": None,
            "ResourcesExhausted": None,
            "Scores": None,
            "ScoreMetaData": None,
            "AllocationTime": 1000,
            "CoalescedFailures": 0,
        },
        "DesiredStatus": a.desired_status,
        "DesiredDescription": a.desired_description,
        "DesiredTransition": {k: v for k, v in desired_transition(a).items() if v is not None},
        "ClientStatus": a.client_status,
        "ClientDescription": a.client_description,
        "TaskStates": {name: task_state(tr) for name, tr in a.tasks.items()},
        "PreviousAllocation": a.previous_allocation,
        "NextAllocation": a.next_allocation,
        "DeploymentID": a.deployment_id,
        "DeploymentStatus": a.deployment_status,
        "RescheduleTracker": reschedule_tracker(a),
        "FollowupEvalID": a.followup_eval_id,
        "PreemptedAllocations": None,
        "PreemptedByAllocation": "",
        "CreateIndex": a.create_index,
        "ModifyIndex": a.modify_index,
        "AllocModifyIndex": a.alloc_modify_index,
        "CreateTime": a.create_time_ns,
        "ModifyTime": a.modify_time_ns,
    }
    return omit_empty(d)


def alloc_stub(a: Alloc, *, resources: bool = False, task_states: bool = True) -> dict[str, Any]:
    """``AllocListStub``: all fields present, ``null`` when empty."""
    d: dict[str, Any] = {
        "ID": a.id,
        "EvalID": a.eval_id,
        "Name": a.name,
        "Namespace": a.namespace,
        "NodeID": a.node_id,
        "NodeName": a.node_name,
        "JobID": a.job_id,
        "JobType": a.job.get("Type", "service"),
        "JobVersion": a.job_version,
        "TaskGroup": a.task_group,
    }
    if resources:
        d["AllocatedResources"] = allocated_resources(a)
    d.update(
        {
            "DesiredStatus": a.desired_status,
            "DesiredDescription": a.desired_description,
            "ClientStatus": a.client_status,
            "ClientDescription": a.client_description,
            "DesiredTransition": desired_transition(a),
            "TaskStates": {name: task_state(tr) for name, tr in a.tasks.items()} if task_states else None,
            "DeploymentStatus": a.deployment_status,
            "FollowupEvalID": a.followup_eval_id,
            "NextAllocation": a.next_allocation,
            "RescheduleTracker": reschedule_tracker(a),
            "PreemptedAllocations": None,
            "PreemptedByAllocation": "",
            "CreateIndex": a.create_index,
            "ModifyIndex": a.modify_index,
            "CreateTime": a.create_time_ns,
            "ModifyTime": a.modify_time_ns,
        }
    )
    return d


def eval_json(ev: dict[str, Any]) -> dict[str, Any]:
    return omit_empty(dict(ev))


def deployment_json(c: Cluster, d: Deployment) -> dict[str, Any]:
    groups: dict[str, Any] = {}
    members = [a for a in c.allocs.values() if a.deployment_id == d.id]
    for gname, grp in d.groups.items():
        g = dict(grp)
        mine = [a for a in members if a.task_group == gname]
        g["PlacedAllocs"] = len(mine)
        g["HealthyAllocs"] = sum(1 for a in mine if (a.deployment_status or {}).get("Healthy") is True)
        g["UnhealthyAllocs"] = sum(1 for a in mine if (a.deployment_status or {}).get("Healthy") is False)
        by = d.require_progress_by.get(gname)
        g["RequireProgressBy"] = rfc3339nano(c.clock.wall_ns(by)) if by is not None else None
        groups[gname] = g
    return {
        "ID": d.id,
        "Namespace": d.namespace,
        "JobID": d.job_id,
        "JobVersion": d.job_version,
        "JobModifyIndex": d.job_modify_index,
        "JobSpecModifyIndex": d.job_spec_modify_index,
        "JobCreateIndex": d.job_create_index,
        "IsMultiregion": False,
        "TaskGroups": groups,
        "Status": d.status,
        "StatusDescription": d.status_description,
        "EvalPriority": d.eval_priority,
        "CreateIndex": d.create_index,
        "ModifyIndex": d.modify_index,
        "CreateTime": d.create_time_ns,
        "ModifyTime": d.modify_time_ns,
    }


def job_summary(c: Cluster, job: dict[str, Any]) -> dict[str, Any]:
    key = (job["Namespace"], job["ID"])
    allocs = [a for a in c.allocs.values() if (a.namespace, a.job_id) == key]
    summary: dict[str, Any] = {}
    queued: dict[str, int] = {}
    blocked = next(
        (e for e in c.evals.values() if e["Status"] == "blocked" and (e["Namespace"], e["JobID"]) == key), None
    )
    if blocked is not None:
        prev = c.evals.get(blocked.get("PreviousEval") or "")
        queued = dict((prev or {}).get("QueuedAllocations") or {})
    for tg in job.get("TaskGroups") or []:
        mine = [a for a in allocs if a.task_group == tg["Name"]]
        summary[tg["Name"]] = {
            "Queued": int(queued.get(tg["Name"], 0)),
            "Complete": sum(1 for a in mine if a.client_status == "complete"),
            "Failed": sum(1 for a in mine if a.client_status == "failed"),
            "Running": sum(1 for a in mine if a.client_status == "running"),
            "Starting": sum(1 for a in mine if a.client_status == "pending"),
            "Lost": sum(1 for a in mine if a.client_status == "lost"),
            "Unknown": sum(1 for a in mine if a.client_status == "unknown"),
        }
    modify = max([job["ModifyIndex"]] + [a.modify_index for a in allocs])
    return {
        "JobID": job["ID"],
        "Namespace": job["Namespace"],
        "Summary": summary,
        "Children": {"Pending": 0, "Running": 0, "Dead": 0},
        "CreateIndex": job["CreateIndex"],
        "ModifyIndex": modify,
    }


def job_stub(c: Cluster, job: dict[str, Any], *, meta: bool = False) -> dict[str, Any]:
    d = {
        "ID": job["ID"],
        "ParentID": job.get("ParentID", ""),
        "Name": job["Name"],
        "Namespace": job["Namespace"],
        "Datacenters": job.get("Datacenters"),
        "NodePool": job.get("NodePool", "default"),
        "Multiregion": job.get("Multiregion"),
        "Type": job["Type"],
        "Priority": job["Priority"],
        "Periodic": job.get("Periodic") is not None,
        "ParameterizedJob": job.get("ParameterizedJob") is not None,
        "Stop": job["Stop"],
        "Status": job["Status"],
        "StatusDescription": job.get("StatusDescription", ""),
        "JobSummary": job_summary(c, job),
        "CreateIndex": job["CreateIndex"],
        "ModifyIndex": job["ModifyIndex"],
        "JobModifyIndex": job["JobModifyIndex"],
        "SubmitTime": job["SubmitTime"],
    }
    if meta:
        d["Meta"] = job.get("Meta")
    return d


def scale_status(c: Cluster, job: dict[str, Any]) -> tuple[dict[str, Any], int]:
    key = (job["Namespace"], job["ID"])
    allocs = [a for a in c.allocs.values() if (a.namespace, a.job_id) == key]
    events = c.scaling_events.get(key, {})
    groups: dict[str, Any] = {}
    for tg in job.get("TaskGroups") or []:
        mine = [a for a in allocs if a.task_group == tg["Name"]]
        groups[tg["Name"]] = {
            "Desired": tg["Count"],
            "Placed": sum(1 for a in mine if not a.terminal),
            "Running": sum(1 for a in mine if a.client_status == "running" and not a.terminal),
            "Healthy": sum(1 for a in mine if not a.terminal and (a.deployment_status or {}).get("Healthy") is True),
            "Unhealthy": sum(1 for a in mine if not a.terminal and (a.deployment_status or {}).get("Healthy") is False),
            "Events": [dict(e) for e in events.get(tg["Name"], [])] or None,
        }
    latest = c._latest_deployment(key)
    index = max(
        [job["ModifyIndex"], c.scaling_index.get(key, 0), latest.modify_index if latest else 0]
        + [a.modify_index for a in allocs]
    )
    return (
        {
            "JobID": job["ID"],
            "Namespace": job["Namespace"],
            "JobCreateIndex": job["CreateIndex"],
            "JobModifyIndex": job["JobModifyIndex"],
            "JobStopped": job["Stop"],
            "TaskGroups": groups,
        },
        index,
    )


def _node_resources(n: Node) -> dict[str, Any]:
    return {
        "Cpu": {"CpuShares": 8000, "TotalCpuCores": 4, "ReservableCpuCores": [0, 1, 2, 3]},
        "Memory": {"MemoryMB": 16384},
        "Disk": {"DiskMB": 100000},
        "Networks": [{"Mode": "host", "Device": "lo", "CIDR": f"{n.ip}/32", "IP": n.ip, "MBits": 1000}],
        "NodeNetworks": [
            {
                "Mode": "host",
                "Device": "lo",
                "MacAddress": "",
                "Speed": 1000,
                "Addresses": [
                    {"Family": "ipv4", "Alias": "default", "Address": n.ip, "ReservedPorts": "", "Gateway": ""}
                ],
            }
        ],
        "Devices": None,
        "NodeHostNetworks": None,
        "MinDynamicPort": 20000,
        "MaxDynamicPort": 32000,
    }


def _drivers(c: Cluster) -> dict[str, Any]:
    now = rfc3339nano(c.wall())
    return {
        name: {"Attributes": {}, "Detected": True, "Healthy": True, "HealthDescription": "Healthy", "UpdateTime": now}
        for name in ("docker", "raw_exec", "exec", "mock_driver")
    }


def node_full(c: Cluster, n: Node) -> dict[str, Any]:
    return {
        "ID": n.id,
        "SecretID": "",
        "Datacenter": n.datacenter,
        "Name": n.name,
        "HTTPAddr": n.http_addr,
        "TLSEnabled": False,
        "Attributes": {
            "unique.network.ip-address": n.ip,
            "kernel.name": "linux",
            "os.name": "fake",
            "nomad.version": "2.0.6",
            "driver.docker": "1",
            "driver.raw_exec": "1",
            "unique.hostname": n.name,
        },
        "NodeResources": _node_resources(n),
        "ReservedResources": {
            "Cpu": {"CpuShares": 0},
            "Memory": {"MemoryMB": 0},
            "Disk": {"DiskMB": 0},
            "Networks": {"ReservedHostPorts": ""},
        },
        "Links": {},
        "Meta": {},
        "NodeClass": "",
        "NodePool": "default",
        "ComputedClass": "v1:fake",
        "Drain": False,
        "DrainStrategy": None,
        "SchedulingEligibility": n.eligibility,
        "Status": n.status,
        "StatusDescription": "",
        "StatusUpdatedAt": n.status_updated_at,
        "Events": [dict(e) for e in n.events],
        "Drivers": _drivers(c),
        "HostVolumes": None,
        "HostNetworks": None,
        "LastDrain": None,
        "CSIControllerPlugins": None,
        "CSINodePlugins": None,
        "CreateIndex": n.create_index,
        "ModifyIndex": n.modify_index,
    }


def node_stub(c: Cluster, n: Node, *, resources: bool = False, os_attrs: bool = False) -> dict[str, Any]:
    return {
        "Address": n.ip,
        "ID": n.id,
        "Attributes": {"os.name": "fake"} if os_attrs else None,
        "Datacenter": n.datacenter,
        "Name": n.name,
        "NodeClass": "",
        "NodePool": "default",
        "Version": "2.0.6",
        "Drain": False,
        "SchedulingEligibility": n.eligibility,
        "Status": n.status,
        "StatusDescription": "",
        "Drivers": _drivers(c),
        "HostVolumes": None,
        "NodeResources": _node_resources(n) if resources else None,
        "ReservedResources": None,
        "LastDrain": None,
        "CreateIndex": n.create_index,
        "ModifyIndex": n.modify_index,
    }
