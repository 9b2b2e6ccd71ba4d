"""The fake cluster's state: jobs, evaluations, deployments, allocations, nodes, and the
scheduler and client simulation that move them.

Everything here runs under ``Cluster.lock`` (an ``RLock``); nothing here calls a task driver.
The monitor (``client.py``) asks :meth:`Cluster.plan_client` for driver work, runs it
without the lock, and hands the results to :meth:`Cluster.apply_client`.

Modelling notes (where ``nomad-api.md`` is silent we do the simplest plausible thing):

* One Raft-like global index; every write bumps the tables it touches (``jobs``,
  ``job_summary``, ``job_version``, ``evals``, ``allocs``, ``deployment``, ``nodes``,
  ``scaling_event``, ``namespaces``, ``acl_token``). One public operation is one write
  index, except register/scale/deregister which write the job + eval first and then the
  scheduler's plan at the next index (as Raft would).
* Evaluations are processed synchronously when created (status ``complete``), except
  delayed follow-ups (``WaitUntil``, processed by the monitor when due) and ``blocked``
  evaluations (retried by the monitor until they place everything).
* The scheduler reconciles one task group at a time: lost allocations (node down) and
  migrating ones (``/stop``) are replaced at once with the same name; failed ones follow
  the reschedule policy (delay, attempts, ``PreviousAllocation``/``NextAllocation``,
  ``RescheduleTracker``); counts above ``Count`` stop the highest name indexes;
  missing names are placed at the lowest free index; destructive spec changes are
  rolled ``MaxParallel`` at a time inside a deployment (or all at once with
  ``MaxParallel=0``); other changes are in-place (``JobVersion`` bumps, same ID).
* Deployments follow ``createDeployment`` (first version, or a version that changed
  allocations). Health = all tasks running for ``MinHealthyTime`` (``HealthCheck``
  ``checks`` is treated like ``task_states``: service checks are not run). A deployment
  succeeds when every group has ``HealthyAllocs >= DesiredTotal``; an unhealthy
  allocation or the progress deadline fails it. Canaries/auto-revert/promotion are not
  modelled.
* Time: Nomad durations run on a fake clock: ``time_scale`` real seconds per Nomad second
  (default 1.0), plus :meth:`Cluster.advance`. Timestamps in JSON use the same clock.
"""

from __future__ import annotations

import contextlib
import copy
import fnmatch
import random
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from . import taskdir
from .drivers import AllocHandle, RecoverableDriverError
from .encode import env_key, interpolate, interpolate_tree, omit_empty, rfc3339nano
from .spec import destructive_change, find_group, go_duration, spec_changed
from .templates import MissingVariable, TemplateError, parse_env, render
from .variables import Variables

TERMINAL_CLIENT = frozenset({"complete", "failed", "lost"})
ACTIVE_DEPLOYMENT = frozenset({"running", "paused", "pending", "blocked", "unblocking", "initializing"})

ALLOC_NOT_NEEDED = "alloc not needed due to job update"
ALLOC_MIGRATING = "alloc is being migrated"
ALLOC_UPDATING = "alloc is being updated due to job update"
ALLOC_RESCHEDULED = "alloc was rescheduled because it failed"
ALLOC_LOST = "alloc is lost since its node is down"


class NomadError(Exception):
    """An error answered as plain text with ``status``.

    ``index`` is set for read errors that Nomad answers after ``setMeta`` (e.g. 404 ``job
    not found``): the response then carries the read headers and the blocking query
    machinery can wait on that index.
    """

    def __init__(self, status: int, message: str, *, index: int | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.index = index


def new_id() -> str:
    return str(uuid.uuid4())


class Clock:
    """Fake Nomad time: ``now()`` is seconds since start, scaled, plus manual advances."""

    def __init__(self, time_scale: float) -> None:
        if time_scale <= 0:
            raise ValueError("time_scale must be > 0")
        self.time_scale = time_scale
        self._t0 = time.monotonic()
        self._w0 = time.time_ns()
        self._offset = 0.0

    def now(self) -> float:
        return (time.monotonic() - self._t0) / self.time_scale + self._offset

    def wall_ns(self, at: float | None = None) -> int:
        return self._w0 + int((self.now() if at is None else at) * 1e9)

    def advance(self, seconds: float) -> None:
        self._offset += seconds


# ---------------------------------------------------------------------------------------------
# Records
# ---------------------------------------------------------------------------------------------


@dataclass
class Node:
    id: str
    name: str
    datacenter: str
    ip: str
    http_addr: str
    create_index: int
    modify_index: int
    status: str = "ready"
    eligibility: str = "eligible"
    status_updated_at: int = 0
    events: list[dict[str, Any]] = field(default_factory=list)


@dataclass
class TaskRun:
    """Client-side runtime state of one task (``TaskState`` + restart tracker)."""

    name: str
    handle: AllocHandle
    spec: dict[str, Any]
    state: str = "pending"
    failed: bool = False
    restarts: int = 0
    last_restart_ns: int | None = None
    started_at_ns: int | None = None
    finished_at_ns: int | None = None
    events: list[dict[str, Any]] = field(default_factory=list)
    # init | running | restart_wait | dead
    phase: str = "init"
    next_at: float = 0.0
    busy: bool = False
    has_process: bool = False
    rt_start: float | None = None
    rt_count: int = 0
    crash: tuple[int, int, bool] | None = None
    user_restart: bool = False
    template_missing: str = ""  # the variable a template waits for (reported once)


@dataclass
class Alloc:
    id: str
    eval_id: str
    name: str
    index: int
    namespace: str
    job_id: str
    job: dict[str, Any]
    job_create_index: int
    task_group: str
    node_id: str
    node_name: str
    ports: list[dict[str, Any]]
    networks: list[dict[str, Any]]
    tasks: dict[str, TaskRun]
    create_index: int
    modify_index: int
    alloc_modify_index: int
    create_time_ns: int
    modify_time_ns: int
    desired_status: str = "run"
    desired_description: str = ""
    desired_transition: dict[str, Any] = field(default_factory=dict)
    client_status: str = "pending"
    client_description: str = "No tasks have started"
    previous_allocation: str = ""
    next_allocation: str = ""
    followup_eval_id: str = ""
    reschedule_events: list[dict[str, Any]] = field(default_factory=list)
    deployment_id: str = ""
    deployment_status: dict[str, Any] | None = None
    # internal
    health_start: float | None = None
    deploy_assigned_at: float | None = None
    fail_time: float | None = None
    reschedule_at: float | None = None
    reschedule_delay_ns: int = 0
    reschedule_ineligible: bool = False

    @property
    def job_version(self) -> int:
        return int(self.job.get("Version", 0))

    @property
    def terminal(self) -> bool:
        return self.desired_status in ("stop", "evict") or self.client_status in TERMINAL_CLIENT

    @property
    def client_done(self) -> bool:
        return all(t.phase == "dead" and not t.has_process and not t.busy for t in self.tasks.values())


@dataclass
class Deployment:
    id: str
    namespace: str
    job_id: str
    job_version: int
    job_modify_index: int
    job_spec_modify_index: int
    job_create_index: int
    groups: dict[str, dict[str, Any]]
    status: str
    status_description: str
    eval_priority: int
    create_index: int
    modify_index: int
    create_time_ns: int
    modify_time_ns: int
    require_progress_by: dict[str, float] = field(default_factory=dict)
    held: bool = False

    @property
    def active(self) -> bool:
        return self.status in ACTIVE_DEPLOYMENT


@dataclass
class ClientAction:
    """One piece of driver work planned by :meth:`Cluster.plan_client`."""

    kind: str  # start | check | kill | crash | restart | silent_stop
    alloc: Alloc
    task: TaskRun
    inject_failure: str | None = None
    alive: bool = True
    error: BaseException | None = None


JobKey = tuple[str, str]


def _task_event(type_: str, wall_ns: int, **fields: Any) -> dict[str, Any]:
    ev: dict[str, Any] = {
        "Type": type_,
        "Time": wall_ns,
        "DisplayMessage": "",
        "Details": {},
        "Message": "",
        "FailsTask": False,
        "RestartReason": "",
        "SetupError": "",
        "DriverError": "",
        "ExitCode": 0,
        "Signal": 0,
        "KillTimeout": 0,
        "KillError": "",
        "KillReason": "",
        "StartDelay": 0,
        "DownloadError": "",
        "ValidationError": "",
        "DiskLimit": 0,
        "FailedSibling": "",
        "VaultError": "",
        "TaskSignalReason": "",
        "TaskSignal": "",
        "DriverMessage": "",
        "GenericSource": "",
    }
    ev.update(fields)
    details: dict[str, str] = {}
    for key, dkey in (
        ("ExitCode", "exit_code"),
        ("Signal", "signal"),
        ("RestartReason", "restart_reason"),
        ("DriverError", "driver_error"),
        ("StartDelay", "start_delay"),
        ("KillTimeout", "kill_timeout"),
        ("FailedSibling", "failed_sibling"),
    ):
        if ev[key]:
            details[dkey] = str(ev[key])
    if ev["FailsTask"]:
        details["fails_task"] = "true"
    if type_ == "Terminated":
        details.setdefault("exit_code", str(ev["ExitCode"]))
        details.setdefault("signal", str(ev["Signal"]))
    ev["Details"] = {**details, **ev["Details"]}
    return ev


def _free_port(taken: set[int]) -> int:
    """A bindable loopback port, preferring Nomad's dynamic range 20000-32000."""
    for _ in range(64):
        port = random.randint(20000, 32000)
        if port in taken:
            continue
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Cluster:
    """All fake Nomad state plus the scheduler. Thread-safe through ``lock``."""

    def __init__(
        self,
        *,
        nodes: int = 1,
        region: str = "global",
        datacenter: str = "dc1",
        time_scale: float = 1.0,
        start_delay: float = 0.0,
        max_allocs_per_node: int | None = None,
        node_ip: str = "127.0.0.1",
        data_dir: str | None = None,
    ) -> None:
        self.lock = threading.RLock()
        # the client's data dir: task directories and rendered templates (taskdir.py); None: none on disk
        self.data_dir = Path(data_dir) if data_dir is not None else None
        self.clock = Clock(time_scale)
        self.region = region
        self.datacenter = datacenter
        self.start_delay = start_delay
        self.max_allocs_per_node = max_allocs_per_node
        self.node_ip = node_ip
        self.http_addr = "127.0.0.1:4646"
        self.index = 1
        self.table_index: dict[str, int] = {}
        self._cur: int | None = None
        self._changed = False
        self.listeners: list[Callable[[], None]] = []
        self.kick: Callable[[], None] = lambda: None

        self.jobs: dict[JobKey, dict[str, Any]] = {}
        self.job_versions: dict[JobKey, list[dict[str, Any]]] = {}
        self.allocs: dict[str, Alloc] = {}
        self.evals: dict[str, dict[str, Any]] = {}
        self.eval_due: dict[str, float] = {}
        self.deployments: dict[str, Deployment] = {}
        self.nodes: dict[str, Node] = {}
        self.namespaces: dict[str, dict[str, Any]] = {}
        self.scaling_events: dict[JobKey, dict[str, list[dict[str, Any]]]] = {}
        self.scaling_index: dict[JobKey, int] = {}
        self.driver_failures: list[str] = []
        self._pending_watch_evals: set[JobKey] = set()
        self.variables = Variables(self)
        # With ACLs on, a task's workload identity may read only nomad/jobs/<its job>[/...].
        self.acl_enabled = False
        self._failure_evals: set[JobKey] = set()

        with self._op():
            idx = self._idx("namespaces", "nodes")
            self.namespaces["default"] = self._namespace_obj("default", "Default shared namespace", idx)
            for i in range(nodes):
                self._add_node(f"fake-client-{i + 1}")

    # ------------------------------------------------------------------ index / notification

    @contextlib.contextmanager
    def _op(self) -> Iterator[None]:
        """One public operation: hold the lock, then wake blocking queries if anything changed."""
        with self.lock:
            self._cur = None
            try:
                yield
            finally:
                self._cur = None
                changed, self._changed = self._changed, False
        if changed:
            for cb in list(self.listeners):
                cb()
            self.kick()

    def op(self) -> contextlib.AbstractContextManager[None]:
        """Public wrapper of :meth:`_op` for the HTTP layer and the fault API."""
        return self._op()

    def _idx(self, *tables: str) -> int:
        if self._cur is None:
            self.index += 1
            self._cur = self.index
        for t in tables:
            self.table_index[t] = self._cur
        self._changed = True
        return self._cur

    def _next_txn(self) -> None:
        self._cur = None

    def tindex(self, *tables: str) -> int:
        return max([self.table_index.get(t, 1) for t in tables] + [1])

    def wall(self) -> int:
        return self.clock.wall_ns()

    # ------------------------------------------------------------------ nodes / namespaces

    def _namespace_obj(self, name: str, desc: str, idx: int) -> dict[str, Any]:
        return {
            "Name": name,
            "Description": desc,
            "Quota": "",
            "Capabilities": None,
            "NodePoolConfiguration": None,
            "VaultConfiguration": None,
            "ConsulConfiguration": None,
            "Meta": None,
            "CreateIndex": idx,
            "ModifyIndex": idx,
        }

    def add_namespace(self, name: str, description: str = "") -> None:
        with self._op():
            idx = self._idx("namespaces")
            self.namespaces[name] = self._namespace_obj(name, description, idx)

    def _add_node(self, name: str) -> Node:
        idx = self._idx("nodes")
        node = Node(
            id=new_id(),
            name=name,
            datacenter=self.datacenter,
            ip=self.node_ip,
            http_addr=self.http_addr,
            create_index=idx,
            modify_index=idx,
            status_updated_at=self.wall() // 1_000_000_000,
        )
        node.events.append(
            {
                "Message": "Node registered",
                "Subsystem": "Cluster",
                "Details": None,
                "Timestamp": rfc3339nano(self.wall()),
                "CreateIndex": 0,
            }
        )
        self.nodes[node.id] = node
        return node

    def add_node(self, name: str | None = None) -> str:
        with self._op():
            node = self._add_node(name or f"fake-client-{len(self.nodes) + 1}")
            for key, job in self.jobs.items():
                if not job["Stop"]:
                    self._create_and_process_eval(key, "node-update", node_id=node.id)
            return node.id

    def set_node_status(self, node_id: str, status: str) -> None:
        with self._op():
            node = self.nodes.get(node_id)
            if node is None:
                raise KeyError(node_id)
            if node.status == status:
                return
            idx = self._idx("nodes")
            node.status = status
            node.modify_index = idx
            node.status_updated_at = self.wall() // 1_000_000_000
            node.events.append(
                {
                    "Message": "Node heartbeat missed" if status == "down" else "Node reregistered by heartbeat",
                    "Subsystem": "Cluster",
                    "Details": None,
                    "Timestamp": rfc3339nano(self.wall()),
                    "CreateIndex": idx,
                }
            )
            node.events = node.events[-10:]
            self._next_txn()
            affected = sorted(
                {(a.namespace, a.job_id) for a in self.allocs.values() if a.node_id == node_id}
                if status == "down"
                else set(self.jobs)
            )
            for key in affected:
                job = self.jobs.get(key)
                if job is not None and not job["Stop"]:
                    self._create_and_process_eval(key, "node-update", node_id=node_id)
            self._refresh_jobs()

    # ------------------------------------------------------------------ evaluations

    def _new_eval(
        self,
        key: JobKey,
        triggered_by: str,
        *,
        status: str = "pending",
        node_id: str = "",
        previous_eval: str = "",
        wait_until: float | None = None,
        deployment_id: str = "",
        priority: int | None = None,
    ) -> dict[str, Any]:
        idx = self._idx("evals")
        job = self.jobs.get(key)
        now = self.wall()
        ev: dict[str, Any] = {
            "ID": new_id(),
            "Namespace": key[0],
            "Priority": priority if priority is not None else (job or {}).get("Priority", 50),
            "Type": (job or {}).get("Type", "service"),
            "TriggeredBy": triggered_by,
            "JobID": key[1],
            "JobModifyIndex": (job or {}).get("JobModifyIndex", 0),
            "NodeID": node_id,
            "NodeModifyIndex": self.nodes[node_id].modify_index if node_id in self.nodes else 0,
            "DeploymentID": deployment_id,
            "Status": status,
            "StatusDescription": "",
            "Wait": 0,
            "WaitUntil": rfc3339nano(self.clock.wall_ns(wait_until)) if wait_until is not None else None,
            "NextEval": "",
            "PreviousEval": previous_eval,
            "BlockedEval": "",
            "RelatedEvals": None,
            "FailedTGAllocs": None,
            "ClassEligibility": None,
            "EscapedComputedClass": False,
            "QuotaLimitReached": "",
            "QueuedAllocations": None,
            "SnapshotIndex": idx,
            "CreateIndex": idx,
            "ModifyIndex": idx,
            "CreateTime": now,
            "ModifyTime": now,
        }
        self.evals[ev["ID"]] = ev
        if wait_until is not None:
            self.eval_due[ev["ID"]] = wait_until
        return ev

    def _update_eval(self, ev: dict[str, Any], **fields: Any) -> None:
        changed = any(ev.get(k) != v for k, v in fields.items())
        if not changed:
            return
        ev.update(fields)
        idx = self._idx("evals")
        ev["ModifyIndex"] = idx
        ev["ModifyTime"] = self.wall()

    def _create_and_process_eval(self, key: JobKey, triggered_by: str, **kw: Any) -> dict[str, Any]:
        ev = self._new_eval(key, triggered_by, **kw)
        self._next_txn()
        self._process_eval(ev)
        return ev

    def _process_eval(self, ev: dict[str, Any]) -> None:
        key = (ev["Namespace"], ev["JobID"])
        self.eval_due.pop(ev["ID"], None)
        self._reconcile(key, ev)

    def _blocked_eval(self, key: JobKey) -> dict[str, Any] | None:
        for ev in self.evals.values():
            if ev["Status"] == "blocked" and (ev["Namespace"], ev["JobID"]) == key:
                return ev
        return None

    # ------------------------------------------------------------------ jobs

    def _job_for(self, key: JobKey) -> dict[str, Any] | None:
        return self.jobs.get(key)

    def register_job(
        self,
        job: dict[str, Any],
        *,
        enforce_index: bool,
        job_modify_index: int,
        preserve_counts: bool,
        eval_priority: int,
    ) -> dict[str, Any]:
        """``Job.Register``. ``job`` is canonical and validated; namespace already resolved."""
        with self._op():
            key = (job["Namespace"], job["ID"])
            if job["Namespace"] not in self.namespaces:
                raise NomadError(500, f'job "{job["ID"]}" is in nonexistent namespace "{job["Namespace"]}"')
            existing = self.jobs.get(key)
            if enforce_index:
                prefix = "Enforcing job modify index"
                if existing is not None:
                    if job_modify_index == 0:
                        raise NomadError(500, f"{prefix} 0: job already exists")
                    if job_modify_index != existing["JobModifyIndex"]:
                        raise NomadError(
                            500,
                            f"{prefix} {job_modify_index}: job exists with conflicting job modify index: "
                            f"{existing['JobModifyIndex']}",
                        )
                elif job_modify_index != 0:
                    raise NomadError(500, f"{prefix} {job_modify_index}: job does not exist")
            new = copy.deepcopy(job)
            if existing is not None and preserve_counts:
                prev = {g["Name"]: g["Count"] for g in existing["TaskGroups"]}
                for g in new["TaskGroups"]:
                    if g["Name"] in prev:
                        g["Count"] = prev[g["Name"]]
            new["SubmitTime"] = self.wall()
            for k in (
                "Status",
                "StatusDescription",
                "Stable",
                "Version",
                "CreateIndex",
                "ModifyIndex",
                "JobModifyIndex",
            ):
                new.pop(k, None)
            if existing is not None:
                for k in (
                    "Status",
                    "StatusDescription",
                    "Stable",
                    "Version",
                    "CreateIndex",
                    "ModifyIndex",
                    "JobModifyIndex",
                ):
                    new[k] = existing[k]
            changed = existing is None or spec_changed(existing, new)
            priority = eval_priority if eval_priority > 0 else new["Priority"]
            if changed:
                idx = self._idx("jobs", "job_version", "job_summary")
                self._write_job(key, new, existing, idx)
            ev = self._new_eval(key, "job-register", priority=priority)
            job_now = self.jobs[key]
            ev["JobModifyIndex"] = job_now["JobModifyIndex"]
            reply = self._write_reply(ev, job_now["JobModifyIndex"])
            self._next_txn()
            self._process_eval(ev)
            self._refresh_jobs()
            return reply

    def _write_job(self, key: JobKey, new: dict[str, Any], existing: dict[str, Any] | None, idx: int) -> None:
        if existing is None:
            new["Version"] = 0
            new["CreateIndex"] = idx
            new["Status"] = "pending"
            new["StatusDescription"] = ""
            new["Stable"] = False
        else:
            new["Version"] = existing["Version"] + 1
            new["CreateIndex"] = existing["CreateIndex"]
            new["Stable"] = False
        new["ModifyIndex"] = idx
        new["JobModifyIndex"] = idx
        self.jobs[key] = new
        versions = self.job_versions.setdefault(key, [])
        versions.insert(0, copy.deepcopy(new))
        del versions[6:]  # JobTrackedVersions

    def _write_reply(self, ev: dict[str, Any] | None, job_modify_index: int) -> dict[str, Any]:
        return {
            "EvalID": ev["ID"] if ev else "",
            "EvalCreateIndex": ev["CreateIndex"] if ev else 0,
            "JobModifyIndex": job_modify_index,
            "Warnings": "",
            "Index": ev["CreateIndex"] if ev else job_modify_index,
            "LastContact": 0,
            "KnownLeader": False,
            "NextToken": "",
        }

    def deregister_job(self, namespace: str, job_id: str, *, purge: bool, eval_priority: int) -> dict[str, Any]:
        with self._op():
            key = (namespace, job_id)
            job = self.jobs.get(key)
            empty = {
                "EvalID": "",
                "EvalCreateIndex": 0,
                "JobModifyIndex": 0,
                "VolumeEvalID": "",
                "VolumeEvalIndex": 0,
                "Index": 0,
                "LastContact": 0,
                "KnownLeader": False,
                "NextToken": "",
            }
            if job is None:
                return empty
            idx = self._idx("jobs", "job_summary", "job_version")
            if purge:
                del self.jobs[key]
                self.job_versions.pop(key, None)
                self.scaling_events.pop(key, None)
                jmi = idx
            else:
                stopped = copy.deepcopy(job)
                stopped["Stop"] = True
                stopped["SubmitTime"] = self.wall()
                self._write_job(key, stopped, job, idx)
                jmi = idx
            ev = self._new_eval(key, "job-deregister", priority=eval_priority or job["Priority"])
            ev["JobModifyIndex"] = jmi
            reply = dict(empty, EvalID=ev["ID"], EvalCreateIndex=ev["CreateIndex"], JobModifyIndex=jmi, Index=idx)
            self._next_txn()
            self._process_eval(ev)
            self._refresh_jobs()
            return reply

    def evaluate_job(self, namespace: str, job_id: str) -> dict[str, Any]:
        with self._op():
            key = (namespace, job_id)
            job = self.jobs.get(key)
            if job is None:
                raise NomadError(500, "job not found")
            ev = self._new_eval(key, "job-register")
            reply = self._write_reply(ev, job["JobModifyIndex"])
            self._next_txn()
            self._process_eval(ev)
            self._refresh_jobs()
            return reply

    def scale_job(
        self,
        namespace: str,
        job_id: str,
        *,
        group: str,
        count: int | None,
        message: str,
        error: bool,
        meta: dict[str, Any] | None,
        job_modify_index: int,
    ) -> dict[str, Any]:
        """``Job.Scale`` (validation order follows ``nomad/job_endpoint.go``)."""
        with self._op():
            key = (namespace, job_id)
            if count is not None and count < 0:
                raise NomadError(400, "scaling action count can't be negative")
            if error and count is not None:
                raise NomadError(400, "scaling action should not contain count if error is true")
            if not group:
                raise NomadError(400, "missing task group name for scaling action")
            job = self.jobs.get(key)
            if job is None:
                raise NomadError(404, f'job "{job_id}" not found')
            if job["Type"] == "system" and count is not None and count > 1:
                raise NomadError(400, 'jobs of type "system" can only be scaled to 1 or 0')
            tg = find_group(job, group)
            if tg is None:
                raise NomadError(400, f'task group "{group}" specified for scaling does not exist in job')
            prev_count = tg["Count"]
            event: dict[str, Any] = {
                "Time": self.wall(),
                "Count": count,
                "PreviousCount": prev_count,
                "Message": message,
                "Error": error,
                "Meta": meta,
                "EvalID": None,
                "CreateIndex": 0,
            }
            reply = self._write_reply(None, job["ModifyIndex"])
            if count is not None:
                scaling = tg.get("Scaling")
                if isinstance(scaling, dict):
                    smin, smax = scaling.get("Min"), scaling.get("Max")
                    if smin is not None and count < smin:
                        raise NomadError(400, f"group count was less than scaling policy minimum: {count} < {smin}")
                    if smax is not None and smax < count:
                        raise NomadError(400, f"group count was greater than scaling policy maximum: {count} > {smax}")
                latest = self._latest_deployment(key)
                if latest is not None and latest.active and latest.job_create_index == job["CreateIndex"]:
                    raise NomadError(400, "job scaling blocked due to active deployment")
                if job_modify_index > 0 and job_modify_index != job["JobModifyIndex"]:
                    raise NomadError(
                        500,
                        f"Enforcing job modify index {job_modify_index}: job exists with conflicting job "
                        f"modify index: {job['JobModifyIndex']}",
                    )
                new = copy.deepcopy(job)
                ntg = find_group(new, group)
                assert ntg is not None
                ntg["Count"] = count
                new["SubmitTime"] = self.wall()
                idx = self._idx("jobs", "job_version", "job_summary")
                self._write_job(key, new, job, idx)
                ev = self._new_eval(key, "job-scaling")
                ev["JobModifyIndex"] = idx
                reply = self._write_reply(ev, idx)
                event["EvalID"] = ev["ID"]
                self._next_txn()
                self._process_eval(ev)
                self._next_txn()
            sidx = self._idx("scaling_event")
            event["CreateIndex"] = sidx
            events = self.scaling_events.setdefault(key, {}).setdefault(group, [])
            events.insert(0, event)
            del events[20:]
            self.scaling_index[key] = sidx
            reply["Index"] = sidx
            self._refresh_jobs()
            return reply

    # ------------------------------------------------------------------ allocations (HTTP ops)

    def stop_alloc(self, alloc_id: str) -> dict[str, Any]:
        with self._op():
            a = self.allocs.get(alloc_id)
            if a is None:
                raise NomadError(404, "allocation not found")
            idx = self._idx("allocs", "job_summary")
            a.desired_transition = dict(a.desired_transition, Migrate=True)
            a.modify_index = idx
            a.modify_time_ns = self.wall()
            key = (a.namespace, a.job_id)
            ev = self._new_eval(key, "alloc-stop")
            reply = {"EvalID": ev["ID"], "Index": idx}
            self._next_txn()
            self._process_eval(ev)
            self._refresh_jobs()
            return reply

    def restart_alloc(self, alloc_id: str, task_name: str, all_tasks: bool) -> None:
        with self._op():
            a = self.allocs.get(alloc_id)
            if a is None:
                raise NomadError(404, f'Unknown allocation "{alloc_id}"')
            if a.terminal:
                raise NomadError(500, "Task not running")
            if task_name and task_name not in a.tasks:
                raise NomadError(500, f'Failed to restart task "{task_name}": task not found')
            targets = [a.tasks[task_name]] if task_name else list(a.tasks.values())
            if not any(t.phase == "running" for t in targets):
                raise NomadError(500, "Task not running")
            for t in targets:
                if t.phase == "running":
                    t.user_restart = True
            self._changed = True

    # ------------------------------------------------------------------ deployments (HTTP / fault)

    def _latest_deployment(self, key: JobKey) -> Deployment | None:
        ds = [d for d in self.deployments.values() if (d.namespace, d.job_id) == key]
        return max(ds, key=lambda d: d.create_index) if ds else None

    def _set_deployment_status(self, d: Deployment, status: str, desc: str) -> None:
        if d.status == status and d.status_description == desc:
            return
        idx = self._idx("deployment")
        d.status = status
        d.status_description = desc
        d.modify_index = idx
        d.modify_time_ns = self.wall()

    def fail_deployment(self, deployment_id: str) -> dict[str, Any]:
        with self._op():
            d = self.deployments.get(deployment_id)
            if d is None:
                raise NomadError(500, "deployment not found")
            if not d.active:
                raise NomadError(500, "can't fail terminal deployment")
            d.held = False
            self._set_deployment_status(d, "failed", "Deployment marked as failed")
            key = (d.namespace, d.job_id)
            ev = self._new_eval(key, "deployment-watcher", deployment_id=d.id)
            reply = {
                "EvalID": ev["ID"],
                "EvalCreateIndex": ev["CreateIndex"],
                "DeploymentModifyIndex": d.modify_index,
                "RevertedJobVersion": None,
                "Index": d.modify_index,
            }
            self._next_txn()
            self._process_eval(ev)
            self._refresh_jobs()
            return reply

    def hold_deployment(self, namespace: str, job_id: str) -> str:
        """Fault: make (or keep) an active deployment for the job that never completes."""
        with self._op():
            key = (namespace, job_id)
            job = self.jobs.get(key)
            if job is None:
                raise KeyError(job_id)
            d = self._latest_deployment(key)
            if d is None or not d.active or d.job_version != job["Version"]:
                d = self._create_deployment(job)
                for tg in job["TaskGroups"]:
                    d.groups[tg["Name"]] = self._deployment_group_state(tg)
            d.held = True
            return d.id

    def release_deployment(self, namespace: str, job_id: str, *, success: bool = True) -> None:
        """Fault: finish the job's active deployment now (successful or failed)."""
        with self._op():
            d = self._latest_deployment((namespace, job_id))
            if d is None or not d.active:
                return
            d.held = False
            if success:
                self._set_deployment_status(d, "successful", "Deployment completed successfully")
                self._mark_stable(d)
            else:
                self._set_deployment_status(d, "failed", "Failed due to unhealthy allocations")
            self._pending_watch_evals.add((namespace, job_id))

    def _create_deployment(self, job: dict[str, Any]) -> Deployment:
        idx = self._idx("deployment")
        now = self.wall()
        d = Deployment(
            id=new_id(),
            namespace=job["Namespace"],
            job_id=job["ID"],
            job_version=job["Version"],
            job_modify_index=job["JobModifyIndex"],
            job_spec_modify_index=job["JobModifyIndex"],
            job_create_index=job["CreateIndex"],
            groups={},
            status="running",
            status_description="Deployment is running",
            eval_priority=job["Priority"],
            create_index=idx,
            modify_index=idx,
            create_time_ns=now,
            modify_time_ns=now,
        )
        self.deployments[d.id] = d
        return d

    def _deployment_group_state(self, tg: dict[str, Any]) -> dict[str, Any]:
        u = tg.get("Update") or {}
        return {
            "AutoRevert": bool(u.get("AutoRevert", False)),
            "AutoPromote": bool(u.get("AutoPromote", False)),
            "ProgressDeadline": int(u.get("ProgressDeadline", 0)),
            "RequireProgressBy": None,
            "Promoted": False,
            "PlacedCanaries": None,
            "DesiredCanaries": 0,
            "DesiredTotal": int(tg["Count"]),
        }

    def _mark_stable(self, d: Deployment) -> None:
        job = self.jobs.get((d.namespace, d.job_id))
        if job is not None and job["Version"] == d.job_version and not job["Stable"]:
            idx = self._idx("jobs", "job_version")
            job["Stable"] = True
            job["ModifyIndex"] = idx
            for v in self.job_versions.get((d.namespace, d.job_id), []):
                if v["Version"] == d.job_version:
                    v["Stable"] = True

    # ------------------------------------------------------------------ scheduler

    def _reconcile(self, key: JobKey, ev: dict[str, Any]) -> None:
        job = self.jobs.get(key)
        allocs = [a for a in self.allocs.values() if (a.namespace, a.job_id) == key]
        if job is None or job["Stop"]:
            for a in allocs:
                if a.desired_status == "run":
                    self._stop(a, ALLOC_NOT_NEEDED)
            for d in self.deployments.values():
                if (d.namespace, d.job_id) == key and d.active:
                    d.held = False
                    self._set_deployment_status(d, "cancelled", "Cancelled because job is stopped")
            blocked = self._blocked_eval(key)
            if blocked is not None and blocked is not ev:
                self._update_eval(blocked, Status="canceled", StatusDescription="evaluation is for a stopped job")
            self._update_eval(ev, Status="complete", QueuedAllocations=None)
            return

        for a in allocs:
            if a.job_create_index != job["CreateIndex"] and a.desired_status == "run":
                self._stop(a, ALLOC_NOT_NEEDED)
        allocs = [a for a in allocs if a.job_create_index == job["CreateIndex"]]
        names = {g["Name"] for g in job["TaskGroups"]}
        for a in allocs:
            if a.task_group not in names and a.desired_status == "run":
                self._stop(a, ALLOC_NOT_NEEDED)

        # cancelUnneededDeployments
        deployment = self._latest_deployment(key)
        if deployment is not None:
            if deployment.job_create_index != job["CreateIndex"] or deployment.job_version != job["Version"]:
                if deployment.active:
                    deployment.held = False
                    self._set_deployment_status(deployment, "cancelled", "Cancelled due to newer version of job")
                deployment = None
            elif deployment.status in ("successful", "cancelled"):
                deployment = None
        ctx: dict[str, Any] = {"deployment": deployment, "existing": deployment is not None}

        queued: dict[str, int] = {}
        failed_tg: dict[str, dict[str, Any]] = {}
        for tg in job["TaskGroups"]:
            unplaced = self._reconcile_group(job, tg, allocs, ev, ctx)
            queued[tg["Name"]] = unplaced
            if unplaced:
                failed_tg[tg["Name"]] = self._alloc_metric(job, unplaced)

        fields: dict[str, Any] = {"QueuedAllocations": queued}
        if failed_tg:
            fields["FailedTGAllocs"] = failed_tg
            if ev["Status"] == "blocked":
                return  # still blocked: leave it as it is
            blocked = self._blocked_eval(key)
            if blocked is None:
                blocked = self._new_eval(key, ev["TriggeredBy"], status="blocked", previous_eval=ev["ID"])
                blocked["StatusDescription"] = "created to place remaining allocations"
                blocked["ClassEligibility"] = {}
            fields["BlockedEval"] = blocked["ID"]
            fields["Status"] = "complete"
        else:
            fields["Status"] = "complete"
            if ev["Status"] == "blocked":
                fields["StatusDescription"] = ""
            else:
                blocked = self._blocked_eval(key)
                if blocked is not None:
                    # Everything is placed now: the blocked eval has nothing left to do.
                    self._update_eval(blocked, Status="complete", StatusDescription="")
        if ev.get("DeploymentID") == "" and ctx["deployment"] is not None:
            fields["DeploymentID"] = ctx["deployment"].id
        self._update_eval(ev, **fields)

    def _alloc_metric(self, job: dict[str, Any], unplaced: int) -> dict[str, Any]:
        ready = [n for n in self.nodes.values() if n.status == "ready" and n.eligibility == "eligible"]
        available: dict[str, int] = {self.datacenter: len(ready)}
        exhausted = len(ready)
        return {
            "NodesEvaluated": len(ready),
            "NodesFiltered": 0,
            "NodesInPool": len(self.nodes),
            "NodesAvailable": available,
            "ClassFiltered": None,
            "ConstraintFiltered": None,
            "NodesExhausted": exhausted,
            "ClassExhausted": None,
            "DimensionExhausted": {"memory": exhausted} if exhausted else None,
            "QuotaExhausted": None,
            "ResourcesExhausted": None,
            "Scores": None,
            "ScoreMetaData": None,
            "AllocationTime": 1000,
            "CoalescedFailures": max(unplaced - 1, 0),
        }

    def _reconcile_group(
        self,
        job: dict[str, Any],
        tg: dict[str, Any],
        allocs: list[Alloc],
        ev: dict[str, Any],
        ctx: dict[str, Any],
    ) -> int:
        """Reconcile one task group; returns the number of placements that did not fit."""
        now = self.clock.now()
        gname = tg["Name"]
        count = int(tg["Count"])
        update = tg.get("Update") or None
        rolling = job["Type"] == "service" and update is not None and int(update.get("MaxParallel", 0)) > 0
        group_all = [a for a in allocs if a.task_group == gname]
        had_running = any(a.job_version == job["Version"] for a in group_all)
        live = sorted((a for a in group_all if a.desired_status == "run"), key=lambda a: (a.index, a.create_index))

        # (index, prev alloc, stop description for prev, is reschedule)
        Replacement = tuple[int, Alloc | None, str, bool]
        replacements: list[Replacement] = []
        keep: list[Alloc] = []
        for a in live:
            node = self.nodes.get(a.node_id)
            if (node is None or node.status == "down") and a.client_status in ("pending", "running"):
                self._mark_lost(a)
                replacements.append((a.index, a, "", False))
                continue
            if a.desired_transition.get("Migrate"):
                replacements.append((a.index, a, ALLOC_MIGRATING, False))
                continue
            if a.client_status == "failed":
                due = self._reschedule_time(a, tg)
                if due is None:
                    keep.append(a)
                elif due <= now:
                    replacements.append((a.index, a, ALLOC_RESCHEDULED, True))
                else:
                    self._ensure_followup(a, ev, due)
                    keep.append(a)
                continue
            keep.append(a)

        # Names: drop duplicates, then the highest indexes above count.
        slots: list[tuple[int, Alloc | None, Replacement | None]] = [(a.index, a, None) for a in keep]
        slots += [(r[0], None, r) for r in replacements]

        def rank(s: tuple[int, Alloc | None, Replacement | None]) -> tuple[int, int]:
            alloc = s[1]
            if alloc is None:
                return (s[0], 1)
            return (s[0], 0 if alloc.client_status == "running" else 2)

        slots.sort(key=rank)
        seen: set[int] = set()
        chosen: list[tuple[int, Alloc | None, Replacement | None]] = []
        for s in slots:
            if s[0] in seen:
                self._drop_slot(s)
                continue
            seen.add(s[0])
            chosen.append(s)
        chosen.sort(key=lambda s: s[0])
        while len(chosen) > count:
            self._drop_slot(chosen.pop())
        used = {s[0] for s in chosen}
        fresh: list[int] = []
        i = 0
        while len(chosen) + len(fresh) < count:
            if i not in used:
                fresh.append(i)
            i += 1

        kept = [s[1] for s in chosen if s[1] is not None]
        outdated = [a for a in kept if a.job_version != job["Version"]]
        destructive = [a for a in outdated if destructive_change(a.job, job, gname)]
        inplace = [a for a in outdated if a not in destructive]
        reps = [s[2] for s in chosen if s[2] is not None]

        # createDeployment
        deployment: Deployment | None = ctx["deployment"]
        if rolling and count != 0 and not ctx["existing"]:
            updating_spec = bool(destructive or inplace)
            if not had_running or updating_spec:
                if deployment is None:
                    deployment = self._create_deployment(job)
                    ctx["deployment"] = deployment
                deployment.groups[gname] = self._deployment_group_state(tg)
        in_deployment = deployment is not None and gname in deployment.groups

        # computeLimit for destructive updates
        if not rolling:
            limit = len(destructive)
        elif deployment is None:
            limit = len(destructive)
        elif deployment.status == "failed":
            limit = 0
        else:
            limit = int(update["MaxParallel"]) if update else len(destructive)
            for a in kept:
                if a.deployment_id == deployment.id:
                    if a.deployment_status is not None and a.deployment_status.get("Healthy") is False:
                        limit = 0
                        break
                    if not (a.deployment_status or {}).get("Healthy"):
                        limit -= 1
            limit = max(limit, 0)
        to_replace = sorted(destructive, key=lambda a: a.index)[:limit]

        for a in inplace:
            idx = self._idx("allocs", "job_summary")
            a.job = self._job_snapshot(job)
            a.alloc_modify_index = idx
            a.modify_index = idx
            a.modify_time_ns = self.wall()
            if in_deployment and deployment is not None:
                a.deployment_id = deployment.id
                a.deployment_status = None
                a.health_start = None
                a.deploy_assigned_at = now

        unplaced = 0
        dep_id = deployment.id if in_deployment and deployment is not None else ""
        for index, prev, desc, resched in reps:
            avoid = {prev.node_id} if prev is not None and resched else set()
            new = self._place(job, tg, index, ev, dep_id, prev, resched, avoid)
            if new is None:
                unplaced += 1
                continue
            if prev is not None and desc:
                self._stop(prev, desc)
        for index in fresh:
            if self._place(job, tg, index, ev, dep_id, None, False, set()) is None:
                unplaced += 1
        for a in to_replace:
            new = self._place(job, tg, a.index, ev, dep_id, a, False, set())
            if new is None:
                unplaced += 1
                continue
            self._stop(a, ALLOC_UPDATING)
        return unplaced

    def _drop_slot(self, slot: tuple[int, Alloc | None, tuple[int, Alloc | None, str, bool] | None]) -> None:
        """A name the group no longer needs: stop its allocation (or the one a dropped
        replacement was going to replace)."""
        _index, alloc, repl = slot
        target = alloc if alloc is not None else (repl[1] if repl is not None else None)
        if target is not None and target.desired_status == "run":
            self._stop(target, ALLOC_NOT_NEEDED)

    def _job_snapshot(self, job: dict[str, Any]) -> dict[str, Any]:
        for v in self.job_versions.get((job["Namespace"], job["ID"]), []):
            if v["Version"] == job["Version"]:
                return v
        return copy.deepcopy(job)

    def _stop(self, a: Alloc, desc: str) -> None:
        if a.desired_status == "stop" and a.desired_description == desc:
            return
        idx = self._idx("allocs", "job_summary")
        a.desired_status = "stop"
        a.desired_description = desc
        a.modify_index = idx
        a.alloc_modify_index = idx
        a.modify_time_ns = self.wall()
        if a.followup_eval_id:
            ev = self.evals.get(a.followup_eval_id)
            if ev is not None and ev["Status"] == "pending" and desc != ALLOC_RESCHEDULED:
                self._update_eval(ev, Status="canceled", StatusDescription="alloc was stopped")
                self.eval_due.pop(ev["ID"], None)

    def _mark_lost(self, a: Alloc) -> None:
        idx = self._idx("allocs", "job_summary")
        a.client_status = "lost"
        a.desired_status = "stop"
        a.desired_description = ALLOC_LOST
        a.modify_index = idx
        a.alloc_modify_index = idx
        a.modify_time_ns = self.wall()

    def _reschedule_time(self, a: Alloc, tg: dict[str, Any]) -> float | None:
        """When the failed allocation ``a`` may be replaced (fake clock), or None if never."""
        if a.reschedule_at is not None:
            return a.reschedule_at
        if a.reschedule_ineligible:
            return None
        policy = tg.get("ReschedulePolicy")
        fail_time = a.fail_time if a.fail_time is not None else self.clock.now()
        if not policy or not self._reschedule_eligible(policy, a.reschedule_events, fail_time):
            a.reschedule_ineligible = True
            return None
        delay = self._next_delay(policy, a.reschedule_events, fail_time)
        a.reschedule_delay_ns = delay
        a.reschedule_at = fail_time + delay / 1e9
        return a.reschedule_at

    def _reschedule_eligible(self, policy: dict[str, Any], events: list[dict[str, Any]], fail_time: float) -> bool:
        if policy.get("Unlimited"):
            return True
        attempts = int(policy.get("Attempts") or 0)
        if attempts == 0:
            return False
        window_start = self.clock.wall_ns(fail_time) - int(policy.get("Interval") or 0)
        recent = [e for e in events if e["RescheduleTime"] >= window_start]
        return attempts > len(recent)

    def _next_delay(self, policy: dict[str, Any], events: list[dict[str, Any]], fail_time: float) -> int:
        """``Allocation.NextDelay``."""
        base = int(policy.get("Delay") or 0)
        max_delay = int(policy.get("MaxDelay") or 0)
        if not events:
            return base
        fn = policy.get("DelayFunction")
        if fn == "exponential":
            delay = int(events[-1]["Delay"]) * 2
        elif fn == "fibonacci":
            if len(events) >= 2:
                n1, n2 = int(events[-1]["Delay"]), int(events[-2]["Delay"])
                delay = n1 if (n2 == max_delay and n1 == base) else n1 + n2
            else:
                delay = base
        else:
            return base
        if max_delay > 0 and delay > max_delay:
            delay = max_delay
            since = self.clock.wall_ns(fail_time) - int(events[-1]["RescheduleTime"])
            if since > delay:
                delay = base
        return delay

    def _ensure_followup(self, a: Alloc, ev: dict[str, Any], due: float) -> None:
        if a.followup_eval_id and a.followup_eval_id in self.evals:
            return
        fe = self._new_eval(
            (a.namespace, a.job_id), "alloc-failure", status="pending", previous_eval=ev["ID"], wait_until=due
        )
        fe["Wait"] = 0
        idx = self._idx("allocs", "job_summary")
        a.followup_eval_id = fe["ID"]
        a.modify_index = idx
        a.modify_time_ns = self.wall()

    def _pick_node(self, job: dict[str, Any], tg: dict[str, Any], avoid: set[str]) -> Node | None:
        dcs = job.get("Datacenters") or ["*"]
        static = {
            int(p["Value"]) for n in tg.get("Networks") or [] for p in n.get("ReservedPorts") or [] if p.get("Value")
        }
        live_by_node: dict[str, list[Alloc]] = {}
        for a in self.allocs.values():
            if not (a.terminal and a.client_done):
                live_by_node.setdefault(a.node_id, []).append(a)
        candidates: list[tuple[tuple[int, int, int], Node]] = []
        for order, n in enumerate(self.nodes.values()):
            if n.status != "ready" or n.eligibility != "eligible":
                continue
            if not any(fnmatch.fnmatchcase(n.datacenter, pat) for pat in dcs):
                continue
            on_node = live_by_node.get(n.id, [])
            if self.max_allocs_per_node is not None and len(on_node) >= self.max_allocs_per_node:
                continue
            if static:
                taken = {int(p["Value"]) for a in on_node for p in a.ports}
                if static & taken:
                    continue
            candidates.append(((1 if n.id in avoid else 0, len(on_node), order), n))
        if not candidates:
            return None
        return min(candidates, key=lambda c: c[0])[1]

    def _place(
        self,
        job: dict[str, Any],
        tg: dict[str, Any],
        index: int,
        ev: dict[str, Any],
        deployment_id: str,
        prev: Alloc | None,
        reschedule: bool,
        avoid: set[str],
    ) -> Alloc | None:
        node = self._pick_node(job, tg, avoid)
        if node is None:
            return None
        idx = self._idx("allocs", "job_summary")
        now_ns = self.wall()
        alloc_id = new_id()
        name = f"{job['ID']}.{tg['Name']}[{index}]"
        taken = {int(p["Value"]) for a in self.allocs.values() if not a.client_done for p in a.ports}
        ports: list[dict[str, Any]] = []
        networks: list[dict[str, Any]] = []
        for net in tg.get("Networks") or []:
            dyn: list[dict[str, Any]] = []
            res: list[dict[str, Any]] = []
            for kind, out in (("ReservedPorts", res), ("DynamicPorts", dyn)):
                for p in net.get(kind) or []:
                    value = int(p["Value"]) if kind == "ReservedPorts" else _free_port(taken)
                    taken.add(value)
                    to = int(p.get("To") or 0)
                    if to == -1:
                        to = value
                    out.append(
                        omit_empty({"Label": p["Label"], "Value": value, "To": to, "HostNetwork": p.get("HostNetwork")})
                    )
                    ports.append(omit_empty({"Label": p["Label"], "Value": value, "To": to, "HostIP": node.ip}))
            networks.append(
                omit_empty(
                    {
                        "Mode": net.get("Mode") or "host",
                        "Device": "lo",
                        "IP": node.ip,
                        "ReservedPorts": res,
                        "DynamicPorts": dyn,
                    }
                )
            )
        snapshot = self._job_snapshot(job)
        a = Alloc(
            id=alloc_id,
            eval_id=ev["ID"],
            name=name,
            index=index,
            namespace=job["Namespace"],
            job_id=job["ID"],
            job=snapshot,
            job_create_index=job["CreateIndex"],
            task_group=tg["Name"],
            node_id=node.id,
            node_name=node.name,
            ports=ports,
            networks=networks,
            tasks={},
            create_index=idx,
            modify_index=idx,
            alloc_modify_index=idx,
            create_time_ns=now_ns,
            modify_time_ns=now_ns,
            deployment_id=deployment_id,
        )
        if deployment_id:
            a.deploy_assigned_at = self.clock.now()
        if prev is not None:
            a.previous_allocation = prev.id
            prev.next_allocation = alloc_id
            prev.modify_index = idx
            prev.modify_time_ns = now_ns
            if reschedule:
                policy = tg.get("ReschedulePolicy") or {}
                events = list(prev.reschedule_events)
                if not policy.get("Unlimited") and policy.get("Interval"):
                    window = now_ns - int(policy["Interval"])
                    events = [e for e in events if e["RescheduleTime"] >= window]
                events.append(
                    {
                        "RescheduleTime": now_ns,
                        "PrevAllocID": prev.id,
                        "PrevNodeID": prev.node_id,
                        "Delay": prev.reschedule_delay_ns,
                    }
                )
                a.reschedule_events = events
        for task in tg.get("Tasks") or []:
            handle = AllocHandle(
                id=alloc_id,
                name=name,
                index=index,
                job_id=job["ID"],
                namespace=job["Namespace"],
                task_group=tg["Name"],
                task=task["Name"],
                node_id=node.id,
                host_ip=node.ip,
                ports={p["Label"]: int(p["Value"]) for p in ports},
                env=(env := self._task_env(job, tg, task, a, node)),
                # the driver sees its config interpolated (node attributes, NOMAD_* and the task env)
                task_spec={**task, "Config": interpolate_tree(task.get("Config") or {}, env,
                                                              self._interp_extra(job, tg, task, node))},
                job=snapshot,
            )
            tr = TaskRun(name=task["Name"], handle=handle, spec=task)
            tr.next_at = self.clock.now() + self.start_delay
            tr.events.append(_task_event("Received", now_ns, DisplayMessage="Task received by client"))
            tr.events.append(
                _task_event(
                    "Task Setup", now_ns, Message="Building Task Directory", DisplayMessage="Building Task Directory"
                )
            )
            a.tasks[task["Name"]] = tr
        self.allocs[alloc_id] = a
        return a

    def _task_env(
        self, job: dict[str, Any], tg: dict[str, Any], task: dict[str, Any], a: Alloc, node: Node
    ) -> dict[str, str]:
        res = task.get("Resources") or {}
        env: dict[str, str] = {
            "NOMAD_ALLOC_ID": a.id,
            "NOMAD_SHORT_ALLOC_ID": a.id[:8],
            "NOMAD_ALLOC_NAME": a.name,
            "NOMAD_ALLOC_INDEX": str(a.index),
            "NOMAD_JOB_ID": job["ID"],
            "NOMAD_JOB_NAME": job["Name"],
            "NOMAD_JOB_PARENT_ID": job.get("ParentID") or "",
            "NOMAD_GROUP_NAME": tg["Name"],
            "NOMAD_TASK_NAME": task["Name"],
            "NOMAD_NAMESPACE": job["Namespace"],
            "NOMAD_REGION": job["Region"],
            "NOMAD_DC": node.datacenter,
            "NOMAD_CPU_LIMIT": str(res.get("CPU", 100)),
            "NOMAD_MEMORY_LIMIT": str(res.get("MemoryMB", 300)),
        }
        if res.get("MemoryMaxMB"):
            env["NOMAD_MEMORY_MAX_LIMIT"] = str(res["MemoryMaxMB"])
        if self.data_dir is not None:
            env.update(taskdir.task_env(self.data_dir, a.id, task["Name"]))
        for p in a.ports:
            label = env_key(p["Label"])
            host_port = str(p["Value"])
            inner = str(p.get("To") or p["Value"])
            env[f"NOMAD_IP_{label}"] = p["HostIP"]
            env[f"NOMAD_HOST_IP_{label}"] = p["HostIP"]
            env[f"NOMAD_PORT_{label}"] = inner
            env[f"NOMAD_HOST_PORT_{label}"] = host_port
            env[f"NOMAD_ALLOC_PORT_{label}"] = inner
            env[f"NOMAD_ADDR_{label}"] = f"{p['HostIP']}:{host_port}"
            env[f"NOMAD_HOST_ADDR_{label}"] = f"{p['HostIP']}:{host_port}"
        for k, v in _merged_meta(job, tg, task).items():
            env[f"NOMAD_META_{env_key(str(k))}"] = str(v)
        extra = self._interp_extra(job, tg, task, node)
        for k, v in (task.get("Env") or {}).items():
            env[str(k)] = interpolate(str(v), env, extra)
        return env

    def _interp_extra(self, job: dict[str, Any], tg: dict[str, Any], task: dict[str, Any],
                      node: Node) -> dict[str, str]:
        """The ``${node.*}``, ``${attr.*}`` and ``${meta.*}`` names a task's Env and Config see."""
        meta = _merged_meta(job, tg, task)
        extra = {
            "node.unique.id": node.id,
            "node.unique.name": node.name,
            "node.datacenter": node.datacenter,
            "node.region": self.region,
            "node.pool": "default",
            "attr.unique.network.ip-address": node.ip,
            "attr.kernel.name": "linux",
        }
        for k, v in meta.items():
            extra[f"meta.{k}"] = str(v)
        return extra

    # ------------------------------------------------------------------ client simulation

    def plan_client(self) -> list[ClientAction]:
        """Decide the driver calls of this tick (takes the lock)."""
        acts: list[ClientAction] = []
        with self._op():
            now = self.clock.now()
            for a in self.allocs.values():
                if a.client_done:
                    continue
                node = self.nodes.get(a.node_id)
                lost = node is None or node.status == "down" or a.client_status == "lost"
                sibling_failed = next((t.name for t in a.tasks.values() if t.state == "dead" and t.failed), None)
                for tr in a.tasks.values():
                    if tr.busy:
                        continue
                    if lost:
                        if tr.has_process:
                            tr.busy = True
                            acts.append(ClientAction("silent_stop", a, tr))
                        else:
                            tr.phase = "dead"
                        continue
                    if a.desired_status != "run" or sibling_failed:
                        if tr.phase == "running":
                            if sibling_failed and a.desired_status == "run":
                                self._append_event(
                                    a,
                                    tr,
                                    _task_event(
                                        "Sibling Task Failed",
                                        self.wall(),
                                        FailedSibling=sibling_failed,
                                        DisplayMessage=f"Task's sibling {sibling_failed!r} failed",
                                    ),
                                )
                            kt = int(tr.spec.get("KillTimeout") or 0)
                            self._append_event(
                                a,
                                tr,
                                _task_event(
                                    "Killing",
                                    self.wall(),
                                    KillTimeout=kt,
                                    DisplayMessage=f"Sent interrupt. Waiting {go_duration(kt)} before force killing",
                                ),
                            )
                            tr.busy = True
                            acts.append(ClientAction("kill", a, tr))
                        elif tr.phase in ("init", "restart_wait"):
                            tr.phase = "dead"
                            tr.state = "dead"
                            tr.finished_at_ns = self.wall()
                            self._client_changed(a)
                        continue
                    if tr.phase in ("init", "restart_wait") and now >= tr.next_at:
                        if not self._render_templates(a, tr):
                            continue
                        inject = self.driver_failures.pop(0) if self.driver_failures else None
                        if tr.phase == "init":
                            self._append_event(
                                a, tr, _task_event("Driver", self.wall(), DisplayMessage="Starting task")
                            )
                        tr.busy = True
                        acts.append(ClientAction("start", a, tr, inject_failure=inject))
                    elif tr.phase == "running":
                        tr.busy = True
                        if tr.crash is not None:
                            acts.append(ClientAction("crash", a, tr))
                        elif tr.user_restart:
                            self._append_event(
                                a,
                                tr,
                                _task_event(
                                    "Restart Signaled",
                                    self.wall(),
                                    RestartReason="User requested restart",
                                    DisplayMessage="User requested restart",
                                ),
                            )
                            acts.append(ClientAction("restart", a, tr))
                        else:
                            acts.append(ClientAction("check", a, tr))
        return acts

    def _template_var(self, a: Alloc, path: str) -> dict[str, str] | None:
        if self.acl_enabled and not (path == f"nomad/jobs/{a.job_id}" or path.startswith(f"nomad/jobs/{a.job_id}/")):
            return None  # the workload identity's implicit policy does not cover it: never renders
        return self.variables.items(a.namespace, path)

    def _render_templates(self, a: Alloc, tr: TaskRun) -> bool:
        """Render the task's templates before a (re)start; False while one waits for a variable
        (or failed the task). ``env = true`` output goes into the task's environment; every output is
        written into the task directory (taskdir.py) once all have rendered."""
        env: dict[str, str] = {}
        files: dict[str, str] = {}
        rendered: list[tuple[dict[str, Any], str]] = []
        for t in tr.spec.get("Templates") or []:
            try:
                text = render(str(t.get("EmbeddedTmpl") or ""), lambda path: self._template_var(a, path))
                if t.get("Envvars"):
                    env.update(parse_env(text))
            except MissingVariable as e:
                if tr.template_missing != e.path:
                    tr.template_missing = e.path
                    msg = f"Missing: nomad.var.block({e.path}@{a.namespace}.{self.region})"
                    self._append_event(a, tr, _task_event("Template", self.wall(), DisplayMessage=msg))
                return False  # retried on the next tick (a variable write kicks the monitor)
            except TemplateError as e:
                msg = f"Template failed: {e}"
                self._append_event(a, tr, _task_event("Template", self.wall(), DisplayMessage=msg, FailsTask=True))
                self._not_restarting(a, tr, "Error was unrecoverable")
                return False
            files[str(t.get("DestPath") or "")] = text
            rendered.append((t, text))
        if self.data_dir is not None:
            try:
                tdir = taskdir.build(self.data_dir, a.id, tr.name)
                for t, text in rendered:
                    taskdir.write_template(tdir, t, text, tr.spec)
            except taskdir.TaskDirError as e:
                msg = f"Template failed: {e}"
                self._append_event(a, tr, _task_event("Template", self.wall(), DisplayMessage=msg, FailsTask=True))
                self._not_restarting(a, tr, "Error was unrecoverable")
                return False
            tr.handle.task_dir = str(tdir)
        tr.template_missing = ""
        tr.handle.env.update(env)
        tr.handle.files.update(files)
        return True

    def apply_client(self, acts: list[ClientAction]) -> None:
        """Record the outcome of the driver calls, then run the server-side reactions."""
        with self._op():
            for act in acts:
                a, tr = act.alloc, act.task
                tr.busy = False
                h = tr.handle
                if act.kind == "start":
                    if act.error is None:
                        tr.has_process = True
                        tr.phase = "running"
                        tr.state = "running"
                        tr.started_at_ns = self.wall()
                        tr.finished_at_ns = None
                        self._append_event(
                            a, tr, _task_event("Started", self.wall(), DisplayMessage="Task started by client")
                        )
                    else:
                        msg = str(act.error) or type(act.error).__name__
                        self._append_event(
                            a,
                            tr,
                            _task_event("Driver Failure", self.wall(), DriverError=msg, DisplayMessage=msg),
                        )
                        tr.has_process = False
                        if isinstance(act.error, RecoverableDriverError):
                            self._after_exit(a, tr, exit_code=0, signal=0, oom=False, start_error=True)
                        else:
                            self._not_restarting(a, tr, "Error was unrecoverable")
                elif act.kind == "check":
                    if act.alive and act.error is None:
                        continue
                    tr.has_process = False
                    code = h.exit_code if h.exit_code is not None else -1
                    self._terminated(a, tr, code, h.signal, h.oom_killed)
                    self._after_exit(a, tr, exit_code=code, signal=h.signal, oom=h.oom_killed)
                elif act.kind == "crash":
                    code, sig, oom = tr.crash or (1, 0, False)
                    tr.crash = None
                    tr.has_process = False
                    self._terminated(a, tr, code, sig, oom)
                    self._after_exit(a, tr, exit_code=code, signal=sig, oom=oom)
                elif act.kind == "kill":
                    tr.has_process = False
                    tr.phase = "dead"
                    tr.state = "dead"
                    tr.finished_at_ns = self.wall()
                    self._append_event(
                        a, tr, _task_event("Killed", self.wall(), DisplayMessage="Task successfully killed")
                    )
                elif act.kind == "silent_stop":
                    tr.has_process = False
                    tr.phase = "dead"
                    self._changed = True
                elif act.kind == "restart":
                    tr.user_restart = False
                    tr.has_process = False
                    self._terminated(a, tr, h.exit_code or 0, h.signal, False)
                    self._restarting(a, tr, 0, "User requested restart")
                self._client_changed(a)
            self._server_tick()

    def _append_event(self, a: Alloc, tr: TaskRun, ev: dict[str, Any]) -> None:
        tr.events.append(ev)
        del tr.events[:-10]
        self._client_changed(a)

    def _terminated(self, a: Alloc, tr: TaskRun, code: int, sig: int, oom: bool) -> None:
        msg = f"Exit Code: {code}"
        if sig:
            msg += f", Signal: {sig}"
        if oom:
            msg += ", OOM Killed"
        self._append_event(
            a,
            tr,
            _task_event(
                "Terminated",
                self.wall(),
                ExitCode=code,
                Signal=sig,
                Details={"oom_killed": "true" if oom else "false"},
                DisplayMessage=msg,
            ),
        )

    def _after_exit(
        self, a: Alloc, tr: TaskRun, *, exit_code: int, signal: int, oom: bool, start_error: bool = False
    ) -> None:
        """Nomad's ``RestartTracker.GetState`` after a task exit or recoverable start error."""
        job_type = a.job.get("Type", "service")
        policy = tr.spec.get("RestartPolicy") or {}
        attempts = int(policy.get("Attempts") or 0)
        interval = int(policy.get("Interval") or 0)
        successful = exit_code == 0 and signal == 0 and not oom and not start_error
        on_success = job_type != "batch"
        now = self.clock.now()
        if attempts == 0:
            if successful and not on_success:
                self._task_dead(a, tr, failed=False)
            else:
                self._not_restarting(a, tr, "Policy allows no restarts")
            return
        if tr.rt_start is None or now > tr.rt_start + interval / 1e9:
            tr.rt_count = 0
            tr.rt_start = now
        tr.rt_count += 1
        if successful and not on_success:
            self._task_dead(a, tr, failed=False)
            return
        if tr.rt_count > attempts:
            if policy.get("Mode") == "fail":
                self._not_restarting(
                    a,
                    tr,
                    f'Exceeded allowed attempts {attempts} in interval {go_duration(interval)} and mode is "fail"',
                )
            else:
                delay_ns = max(int((tr.rt_start + interval / 1e9 - now) * 1e9), 0)
                self._restarting(a, tr, delay_ns, "Exceeded allowed attempts, applying a delay")
            return
        delay = int(policy.get("Delay") or 0)
        delay_ns = delay + int(random.uniform(0, 0.25) * delay)
        self._restarting(a, tr, delay_ns, "Restart within policy")

    def _restarting(self, a: Alloc, tr: TaskRun, delay_ns: int, reason: str) -> None:
        tr.restarts += 1
        tr.last_restart_ns = self.wall()
        tr.state = "pending"
        tr.phase = "restart_wait"
        tr.next_at = self.clock.now() + delay_ns / 1e9
        self._append_event(
            a,
            tr,
            _task_event(
                "Restarting",
                self.wall(),
                RestartReason=reason,
                StartDelay=delay_ns,
                DisplayMessage=f"Task restarting in {go_duration(delay_ns)}",
            ),
        )

    def _not_restarting(self, a: Alloc, tr: TaskRun, reason: str) -> None:
        self._append_event(
            a,
            tr,
            _task_event("Not Restarting", self.wall(), RestartReason=reason, FailsTask=True, DisplayMessage=reason),
        )
        self._task_dead(a, tr, failed=True)

    def _task_dead(self, a: Alloc, tr: TaskRun, *, failed: bool) -> None:
        tr.phase = "dead"
        tr.state = "dead"
        tr.failed = failed
        tr.finished_at_ns = self.wall()
        self._client_changed(a)

    def _client_changed(self, a: Alloc) -> None:
        """A client update of ``a``: recompute ClientStatus and bump the alloc's index."""
        idx = self._idx("allocs", "job_summary")
        a.modify_index = idx
        a.modify_time_ns = self.wall()
        if a.client_status == "lost":
            return
        states = [t.state for t in a.tasks.values()]
        failed = any(t.state == "dead" and t.failed for t in a.tasks.values())
        if failed:
            status, desc = "failed", "Failed tasks"
        elif "running" in states:
            status, desc = "running", "Tasks are running"
        elif "pending" in states:
            status, desc = "pending", "No tasks have started"
        else:
            status, desc = "complete", "All tasks have completed"
        old = a.client_status
        a.client_status, a.client_description = status, desc
        if status == "failed" and old != "failed":
            a.fail_time = self.clock.now()
            if a.deployment_id and a.deployment_status is None:
                self._set_health(a, False)
            key = (a.namespace, a.job_id)
            job = self.jobs.get(key)
            if job is not None and not job["Stop"] and a.desired_status == "run":
                self._pending_watch_evals.add(key)
                self._failure_evals.add(key)

    def _set_health(self, a: Alloc, healthy: bool) -> None:
        idx = self._idx("allocs", "job_summary")
        a.deployment_status = {
            "Healthy": healthy,
            "Timestamp": rfc3339nano(self.wall()),
            "Canary": False,
            "ModifyIndex": idx,
        }
        a.modify_index = idx
        a.modify_time_ns = self.wall()
        d = self.deployments.get(a.deployment_id)
        if d is not None and healthy:
            grp = d.groups.get(a.task_group)
            if grp is not None:
                pd = int(grp.get("ProgressDeadline") or 0)
                if pd:
                    d.require_progress_by[a.task_group] = self.clock.now() + pd / 1e9
        self._pending_watch_evals.add((a.namespace, a.job_id))

    # ------------------------------------------------------------------ server-side tick

    def _server_tick(self) -> None:
        now = self.clock.now()
        # alloc-failure evaluations for allocations that just failed
        failures, self._failure_evals = self._failure_evals, set()
        for key in sorted(failures):
            self._pending_watch_evals.discard(key)
            self._next_txn()
            self._create_and_process_eval(key, "alloc-failure")
        # deployment health
        for a in list(self.allocs.values()):
            if not a.deployment_id or a.deployment_status is not None or a.desired_status != "run":
                continue
            d = self.deployments.get(a.deployment_id)
            if d is None or not d.active:
                continue
            tg = find_group(a.job, a.task_group) or {}
            u = tg.get("Update") or {}
            mht = int(u.get("MinHealthyTime") or 0) / 1e9
            deadline = int(u.get("HealthyDeadline") or 0) / 1e9
            all_running = bool(a.tasks) and all(t.state == "running" for t in a.tasks.values())
            if a.client_status == "running" and all_running:
                if a.health_start is None:
                    a.health_start = now
                if now - a.health_start >= mht:
                    self._set_health(a, True)
                    continue
            else:
                a.health_start = None
            if deadline and a.deploy_assigned_at is not None and now - a.deploy_assigned_at > deadline:
                self._set_health(a, False)
        # deployment progress
        for d in list(self.deployments.values()):
            if not d.active or d.held:
                continue
            members = [a for a in self.allocs.values() if a.deployment_id == d.id]
            if any((a.deployment_status or {}).get("Healthy") is False for a in members):
                self._set_deployment_status(d, "failed", "Failed due to unhealthy allocations")
                continue
            done = True
            for gname, grp in d.groups.items():
                healthy = sum(
                    1 for a in members if a.task_group == gname and (a.deployment_status or {}).get("Healthy")
                )
                if healthy < int(grp["DesiredTotal"]):
                    done = False
                pd = int(grp.get("ProgressDeadline") or 0)
                if pd:
                    by = d.require_progress_by.setdefault(gname, now + pd / 1e9)
                    if now > by and healthy < int(grp["DesiredTotal"]):
                        self._set_deployment_status(d, "failed", "Failed due to progress deadline")
                        done = False
                        break
            if done and d.active:
                self._set_deployment_status(d, "successful", "Deployment completed successfully")
                self._mark_stable(d)
        # deployment watcher evaluations (continue rolling updates)
        watch, self._pending_watch_evals = self._pending_watch_evals, set()
        for key in sorted(watch):
            job = self.jobs.get(key)
            if job is None or job["Stop"]:
                continue
            d = self._latest_deployment(key)
            self._next_txn()
            self._create_and_process_eval(key, "deployment-watcher", deployment_id=d.id if d else "")
        # delayed evaluations that are due
        for eid, due in sorted(self.eval_due.items(), key=lambda kv: kv[1]):
            if due <= now:
                ev = self.evals.get(eid)
                self.eval_due.pop(eid, None)
                if ev is not None and ev["Status"] == "pending":
                    self._next_txn()
                    self._process_eval(ev)
        # blocked evaluations: retry placement
        for ev in [e for e in self.evals.values() if e["Status"] == "blocked"]:
            self._next_txn()
            self._process_eval(ev)
        self._refresh_jobs()

    def server_tick(self) -> None:
        with self._op():
            self._server_tick()

    def _refresh_jobs(self) -> None:
        """``getJobStatus`` for every job; a status change bumps the job's ModifyIndex."""
        for key, job in self.jobs.items():
            allocs = [a for a in self.allocs.values() if (a.namespace, a.job_id) == key]
            status = None
            for a in allocs:
                if not a.terminal:
                    status = "running"
                    break
            if status is None:
                evals = [e for e in self.evals.values() if (e["Namespace"], e["JobID"]) == key]
                if any(e["Status"] not in ("complete", "failed", "canceled") for e in evals):
                    status = "pending"
                elif evals or allocs:
                    status = "dead"
                else:
                    status = "pending"
            if job["Status"] != status:
                idx = self._idx("jobs", "job_summary")
                job["Status"] = status
                job["ModifyIndex"] = idx

    # ------------------------------------------------------------------ fault helpers

    def request_crash(self, alloc_id: str, *, exit_code: int, signal: int, oom: bool, task: str | None) -> None:
        with self._op():
            a = self.allocs.get(alloc_id)
            if a is None:
                raise KeyError(alloc_id)
            targets = [a.tasks[task]] if task else list(a.tasks.values())
            running = [t for t in targets if t.phase == "running"]
            if not running:
                raise ValueError(f"allocation {alloc_id} has no running task to crash")
            for t in running:
                t.crash = (exit_code, signal, oom)
            self._changed = True

    def advance(self, seconds: float) -> None:
        with self._op():
            self.clock.advance(seconds)
            self._changed = True


def _merged_meta(job: dict[str, Any], tg: dict[str, Any], task: dict[str, Any]) -> dict[str, Any]:
    """Job, group and task Meta, the innermost winning."""
    meta: dict[str, Any] = {}
    for m in (job.get("Meta"), tg.get("Meta"), task.get("Meta")):
        if isinstance(m, dict):
            meta.update(m)
    return meta
