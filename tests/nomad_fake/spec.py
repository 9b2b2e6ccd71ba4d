"""Job-spec decoding, canonicalization and validation, as Nomad's HTTP agent and server do it.

What this reproduces (see ``docs/nomad-api.md`` sections 1.2, 2 and 4):

* Go's ``encoding/json`` decodes field names case-insensitively and silently drops
  unknown fields. We do the same for the levels we know (Job, TaskGroup, Task, Network,
  Port, Resources, RestartPolicy, ReschedulePolicy, Update, EphemeralDisk). Maps the user
  owns (``Config``, ``Env``, ``Meta``) and blocks we do not model (``Services``,
  ``Constraints`` ...) are passed through untouched. ``strict=True`` turns a dropped
  field into a 400 so misspellings surface in tests (real Nomad has no such mode).
* Type mismatches are 400 with Go's ``json: cannot unmarshal ...`` wording (approximate:
  the struct/path naming follows Go's format, but we only type-check the fields above).
* Defaults the agent fills in (``api.Job.Canonicalize``): service jobs get
  ``DefaultUpdateStrategy`` (MaxParallel 1, MinHealthyTime 10s ...), restart/reschedule
  policies per job type, ``Count`` 1, ``EphemeralDisk.SizeMB`` 300, task ``Resources``
  CPU 100 / MemoryMB 300, ``KillTimeout`` 5s, ``Datacenters`` ``["*"]``.
* Validation failures (``Job.Validate``) are returned as go-multierror text, which the
  HTTP layer sends as **500** plain text.
"""

from __future__ import annotations

import copy
from typing import Any

S = 1_000_000_000  # nanoseconds per second
MINUTE = 60 * S
HOUR = 60 * MINUTE


class SpecError(Exception):
    """A request-decoding problem: the agent answers 400 with this text."""


# ---------------------------------------------------------------------------------------------
# Field schemas: name -> (go type, nested schema name or None)
# go types: "string" "int" "bool" "[]" (list) "{}" (object) "any"
# ---------------------------------------------------------------------------------------------

_Schema = dict[str, tuple[str, str | None]]

SCHEMAS: dict[str, _Schema] = {
    "JobRegisterRequest": {
        "Job": ("{}", "Job"),
        "EnforceIndex": ("bool", None),
        "JobModifyIndex": ("int", None),
        "PreserveCounts": ("bool", None),
        "PreserveResources": ("bool", None),
        "PolicyOverride": ("bool", None),
        "EvalPriority": ("int", None),
        "Submission": ("any", None),
        "Region": ("string", None),
        "Namespace": ("string", None),
        "SecretID": ("string", None),
    },
    "Job": {
        "Region": ("string", None),
        "Namespace": ("string", None),
        "ID": ("string", None),
        "Name": ("string", None),
        "Type": ("string", None),
        "Priority": ("int", None),
        "AllAtOnce": ("bool", None),
        "Datacenters": ("[]", None),
        "NodePool": ("string", None),
        "Constraints": ("any", None),
        "Affinities": ("any", None),
        "TaskGroups": ("[]", "TaskGroup"),
        "Update": ("{}", "UpdateStrategy"),
        "Multiregion": ("any", None),
        "Spreads": ("any", None),
        "Periodic": ("any", None),
        "ParameterizedJob": ("any", None),
        "Reschedule": ("{}", "ReschedulePolicy"),
        "Migrate": ("any", None),
        "Meta": ("{}", None),
        "UI": ("any", None),
        "ConsulToken": ("string", None),
        "VaultToken": ("string", None),
        "ConsulNamespace": ("string", None),
        "VaultNamespace": ("string", None),
        "NomadTokenID": ("string", None),
        "Stop": ("bool", None),
        "ParentID": ("string", None),
        "Dispatched": ("bool", None),
        "DispatchIdempotencyToken": ("string", None),
        "Payload": ("any", None),
        "Stable": ("bool", None),
        "Status": ("string", None),
        "StatusDescription": ("string", None),
        "Version": ("int", None),
        "VersionTag": ("any", None),
        "SubmitTime": ("int", None),
        "CreateIndex": ("int", None),
        "ModifyIndex": ("int", None),
        "JobModifyIndex": ("int", None),
    },
    "TaskGroup": {
        "Name": ("string", None),
        "Count": ("int", None),
        "Constraints": ("any", None),
        "Affinities": ("any", None),
        "Tasks": ("[]", "Task"),
        "Spreads": ("any", None),
        "Volumes": ("any", None),
        "RestartPolicy": ("{}", "RestartPolicy"),
        "Disconnect": ("any", None),
        "ReschedulePolicy": ("{}", "ReschedulePolicy"),
        "EphemeralDisk": ("{}", "EphemeralDisk"),
        "Update": ("{}", "UpdateStrategy"),
        "Migrate": ("any", None),
        "Networks": ("[]", "NetworkResource"),
        "Meta": ("{}", None),
        "Services": ("any", None),
        "ShutdownDelay": ("int", None),
        "StopAfterClientDisconnect": ("int", None),
        "MaxClientDisconnect": ("int", None),
        "PreventRescheduleOnLost": ("bool", None),
        "Scaling": ("any", None),
        "Consul": ("any", None),
    },
    "Task": {
        "Name": ("string", None),
        "Driver": ("string", None),
        "User": ("string", None),
        "Lifecycle": ("any", None),
        "Config": ("{}", None),
        "Constraints": ("any", None),
        "Affinities": ("any", None),
        "Env": ("{}", None),
        "Services": ("any", None),
        "Resources": ("{}", "Resources"),
        "RestartPolicy": ("{}", "RestartPolicy"),
        "Meta": ("{}", None),
        "KillTimeout": ("int", None),
        "LogConfig": ("any", None),
        "Artifacts": ("any", None),
        "Vault": ("any", None),
        "Consul": ("any", None),
        "Templates": ("any", None),
        "DispatchPayload": ("any", None),
        "VolumeMounts": ("any", None),
        "CSIPluginConfig": ("any", None),
        "Leader": ("bool", None),
        "ShutdownDelay": ("int", None),
        "KillSignal": ("string", None),
        "Kind": ("string", None),
        "ScalingPolicies": ("any", None),
        "Identity": ("any", None),
        "Identities": ("any", None),
        "Actions": ("any", None),
        "Schedule": ("any", None),
    },
    "NetworkResource": {
        "Mode": ("string", None),
        "Device": ("string", None),
        "CIDR": ("string", None),
        "IP": ("string", None),
        "Hostname": ("string", None),
        "DNS": ("any", None),
        "ReservedPorts": ("[]", "Port"),
        "DynamicPorts": ("[]", "Port"),
        "MBits": ("int", None),
        "CNI": ("any", None),
    },
    "Port": {
        "Label": ("string", None),
        "Value": ("int", None),
        "To": ("int", None),
        "HostNetwork": ("string", None),
        "IgnoreCollision": ("bool", None),
    },
    "Resources": {
        "CPU": ("int", None),
        "Cores": ("int", None),
        "MemoryMB": ("int", None),
        "MemoryMaxMB": ("int", None),
        "DiskMB": ("int", None),
        "Networks": ("any", None),
        "Devices": ("any", None),
        "IOPS": ("int", None),
        "NUMA": ("any", None),
        "SecretsMB": ("int", None),
    },
    "RestartPolicy": {
        "Interval": ("int", None),
        "Attempts": ("int", None),
        "Delay": ("int", None),
        "Mode": ("string", None),
        "RenderTemplates": ("bool", None),
    },
    "ReschedulePolicy": {
        "Attempts": ("int", None),
        "Interval": ("int", None),
        "Delay": ("int", None),
        "DelayFunction": ("string", None),
        "MaxDelay": ("int", None),
        "Unlimited": ("bool", None),
    },
    "UpdateStrategy": {
        "Stagger": ("int", None),
        "MaxParallel": ("int", None),
        "HealthCheck": ("string", None),
        "MinHealthyTime": ("int", None),
        "HealthyDeadline": ("int", None),
        "ProgressDeadline": ("int", None),
        "Canary": ("int", None),
        "AutoRevert": ("bool", None),
        "AutoPromote": ("bool", None),
    },
    "EphemeralDisk": {
        "Sticky": ("bool", None),
        "Migrate": ("bool", None),
        "SizeMB": ("int", None),
    },
    "ScalingRequest": {
        "Count": ("int", None),
        "Target": ("{}", None),
        "Message": ("string", None),
        "Error": ("bool", None),
        "Meta": ("{}", None),
        "PolicyOverride": ("bool", None),
        "JobModifyIndex": ("int", None),
        "Region": ("string", None),
        "Namespace": ("string", None),
        "SecretID": ("string", None),
    },
}

_GO_TYPE = {"string": "string", "int": "int", "bool": "bool", "[]": "[]", "{}": "map"}
_GO_STRUCT_TYPE = {
    "Job": "*api.Job",
    "TaskGroup": "*api.TaskGroup",
    "Task": "*api.Task",
    "NetworkResource": "*api.NetworkResource",
    "Port": "api.Port",
    "Resources": "*api.Resources",
    "RestartPolicy": "*api.RestartPolicy",
    "ReschedulePolicy": "*api.ReschedulePolicy",
    "UpdateStrategy": "*api.UpdateStrategy",
    "EphemeralDisk": "*api.EphemeralDisk",
}


def _json_kind(v: Any) -> str:
    if isinstance(v, bool):
        return "bool"
    if isinstance(v, (int, float)):
        return "number"
    if isinstance(v, str):
        return "string"
    if isinstance(v, list):
        return "array"
    if isinstance(v, dict):
        return "object"
    return "null"


def _type_ok(gotype: str, v: Any) -> bool:
    if v is None:
        return True
    if gotype == "any":
        return True
    if gotype == "string":
        return isinstance(v, str)
    if gotype == "int":
        return isinstance(v, int) and not isinstance(v, bool)
    if gotype == "bool":
        return isinstance(v, bool)
    if gotype == "[]":
        return isinstance(v, list)
    if gotype == "{}":
        return isinstance(v, dict)
    return True


def normalize(obj: Any, schema: str, *, path: str, strict: bool, struct: str | None = None) -> dict[str, Any]:
    """Decode ``obj`` as Go would into the struct ``schema``.

    Keys are matched case-insensitively (exact match first), unknown keys are dropped
    (or rejected in strict mode) and known keys are type-checked.
    """
    fields = SCHEMAS[schema]
    struct_name = struct or schema
    if not isinstance(obj, dict):
        raise SpecError(
            f"json: cannot unmarshal {_json_kind(obj)} into Go value of type {_GO_STRUCT_TYPE.get(schema, schema)}"
        )
    lower = {k.lower(): k for k in fields}
    out: dict[str, Any] = {}
    for key, value in obj.items():
        canon = key if key in fields else lower.get(key.lower())
        if canon is None:
            if strict:
                raise SpecError(f"fake-nomad strict mode: unknown field {path}.{key}")
            continue
        gotype, nested = fields[canon]
        field_path = f"{path}.{canon}" if path else canon
        if not _type_ok(gotype, value):
            want = _GO_STRUCT_TYPE.get(nested or "", _GO_TYPE.get(gotype, gotype))
            if gotype == "[]" and nested:
                want = "[]" + _GO_STRUCT_TYPE.get(nested, nested)
            raise SpecError(
                f"json: cannot unmarshal {_json_kind(value)} into Go struct field "
                f"{struct_name}.{field_path} of type {want}"
            )
        if nested and value is not None:
            if gotype == "[]":
                value = [normalize(item, nested, path=field_path, strict=strict, struct=nested) for item in value]
            else:
                value = normalize(value, nested, path=field_path, strict=strict, struct=nested)
        out[canon] = value
    return out


# ---------------------------------------------------------------------------------------------
# Defaults
# ---------------------------------------------------------------------------------------------


def default_update() -> dict[str, Any]:
    return {
        "Stagger": 30 * S,
        "MaxParallel": 1,
        "HealthCheck": "checks",
        "MinHealthyTime": 10 * S,
        "HealthyDeadline": 5 * MINUTE,
        "ProgressDeadline": 10 * MINUTE,
        "Canary": 0,
        "AutoRevert": False,
        "AutoPromote": False,
    }


def default_restart(job_type: str) -> dict[str, Any]:
    if job_type == "batch":
        return {"Interval": 24 * HOUR, "Attempts": 3, "Delay": 15 * S, "Mode": "fail", "RenderTemplates": False}
    return {"Interval": 30 * MINUTE, "Attempts": 2, "Delay": 15 * S, "Mode": "fail", "RenderTemplates": False}


def default_reschedule(job_type: str) -> dict[str, Any] | None:
    if job_type == "batch":
        return {
            "Attempts": 1,
            "Interval": 24 * HOUR,
            "Delay": 5 * S,
            "DelayFunction": "constant",
            "MaxDelay": 0,
            "Unlimited": False,
        }
    if job_type == "service":
        return {
            "Attempts": 0,
            "Interval": 0,
            "Delay": 30 * S,
            "DelayFunction": "exponential",
            "MaxDelay": HOUR,
            "Unlimited": True,
        }
    return None


def _merge(base: dict[str, Any] | None, override: dict[str, Any] | None) -> dict[str, Any] | None:
    """Overlay the non-null fields of ``override`` on ``base`` (api ``Merge`` semantics)."""
    if base is None and override is None:
        return None
    out = dict(base or {})
    for k, v in (override or {}).items():
        if v is not None:
            out[k] = v
    return out


JOB_NULL_FIELDS = (
    "Constraints",
    "Affinities",
    "Spreads",
    "Multiregion",
    "Periodic",
    "ParameterizedJob",
    "Payload",
    "Meta",
    "UI",
    "VersionTag",
)


def canonicalize_job(job: dict[str, Any], *, agent_region: str) -> dict[str, Any]:
    """Fill in what ``api.Job.Canonicalize`` + ``ApiJobToStructJob`` would."""
    j = copy.deepcopy(job)
    j.setdefault("ID", "")
    if not j.get("Name"):
        j["Name"] = j["ID"]
    if not j.get("Namespace"):
        j["Namespace"] = "default"
    region = j.get("Region") or "global"
    if region == "global":
        region = agent_region
    j["Region"] = region
    if not j.get("Type"):
        j["Type"] = "service"
    if j.get("Priority") is None:
        j["Priority"] = 50
    j.setdefault("AllAtOnce", False)
    if j.get("AllAtOnce") is None:
        j["AllAtOnce"] = False
    if j.get("Datacenters") is None:
        j["Datacenters"] = ["*"]
    if not j.get("NodePool"):
        j["NodePool"] = "default"
    for key in JOB_NULL_FIELDS:
        j.setdefault(key, None)
    if j.get("Meta") == {}:
        j["Meta"] = None
    j["Stop"] = bool(j.get("Stop") or False)
    for key in ("ParentID", "ConsulToken", "VaultToken", "ConsulNamespace", "VaultNamespace", "NomadTokenID"):
        j[key] = j.get(key) or ""
    j["ConsulToken"] = ""
    j["VaultToken"] = ""
    j["Dispatched"] = bool(j.get("Dispatched") or False)
    j["DispatchIdempotencyToken"] = j.get("DispatchIdempotencyToken") or ""

    job_type = j["Type"]
    job_update = j.get("Update")
    if job_update is not None:
        job_update = _merge(default_update(), job_update)
    elif job_type == "service":
        job_update = default_update()
    # structs.Job.Update is a value type: only Stagger and MaxParallel are carried over.
    j["Update"] = {
        "Stagger": (job_update or {}).get("Stagger", 0),
        "MaxParallel": (job_update or {}).get("MaxParallel", 0),
        "HealthCheck": "",
        "MinHealthyTime": 0,
        "HealthyDeadline": 0,
        "ProgressDeadline": 0,
        "Canary": 0,
        "AutoRevert": False,
        "AutoPromote": False,
    }
    job_reschedule = j.pop("Reschedule", None)
    job_migrate = j.pop("Migrate", None)

    groups = j.get("TaskGroups")
    j["TaskGroups"] = (
        None
        if groups is None
        else [_canonicalize_group(g, job_type, job_update, job_reschedule, job_migrate) for g in groups]
    )
    return j


def _canonicalize_group(
    g: dict[str, Any],
    job_type: str,
    job_update: dict[str, Any] | None,
    job_reschedule: dict[str, Any] | None,
    job_migrate: Any,
) -> dict[str, Any]:
    g = dict(g)
    g.setdefault("Name", "")
    if g.get("Name") is None:
        g["Name"] = ""
    if g.get("Count") is None:
        scaling = g.get("Scaling")
        g["Count"] = int(scaling.get("Min", 1)) if isinstance(scaling, dict) and scaling.get("Min") else 1
    for key in ("Constraints", "Affinities", "Spreads", "Volumes", "Services", "Scaling", "Meta", "Consul"):
        g.setdefault(key, None)
    if g.get("Meta") == {}:
        g["Meta"] = None
    g["EphemeralDisk"] = _merge({"Sticky": False, "Migrate": False, "SizeMB": 300}, g.get("EphemeralDisk"))
    # Update: merge job-level then group-level (api TaskGroup.Canonicalize)
    update = g.get("Update")
    if job_update is not None and update is not None:
        update = _merge(job_update, update)
    elif job_update is not None:
        update = dict(job_update)
    if update is not None:
        update = _merge(default_update(), update)
    if job_type not in ("service", "system"):
        update = g.get("Update") and _merge(default_update(), g.get("Update"))
    g["Update"] = update
    g["RestartPolicy"] = _merge(default_restart(job_type), g.get("RestartPolicy"))
    resched = default_reschedule(job_type)
    if resched is not None:
        resched = _merge(_merge(resched, job_reschedule), g.get("ReschedulePolicy"))
    g["ReschedulePolicy"] = resched
    if job_type == "service":
        g["Migrate"] = _merge(
            {"MaxParallel": 1, "HealthCheck": "checks", "MinHealthyTime": 10 * S, "HealthyDeadline": 5 * MINUTE},
            _merge(job_migrate if isinstance(job_migrate, dict) else None, g.get("Migrate")),
        )
    else:
        g.setdefault("Migrate", None)
    nets = []
    for n in g.get("Networks") or []:
        n = dict(n)
        if not n.get("Mode"):
            n["Mode"] = "host"
        for kind in ("DynamicPorts", "ReservedPorts"):
            ports = []
            for p in n.get(kind) or []:
                p = dict(p)
                p.setdefault("Label", "")
                p["Value"] = int(p.get("Value") or 0)
                p["To"] = int(p.get("To") or 0)
                if not p.get("HostNetwork"):
                    p["HostNetwork"] = "default"
                ports.append(p)
            n[kind] = ports or None
        nets.append(n)
    g["Networks"] = nets or None
    g["Tasks"] = [_canonicalize_task(t, g) for t in g.get("Tasks") or []]
    for key in ("ShutdownDelay", "StopAfterClientDisconnect", "MaxClientDisconnect"):
        g.setdefault(key, None)
    return g


def _canonicalize_task(t: dict[str, Any], group: dict[str, Any]) -> dict[str, Any]:
    t = dict(t)
    t.setdefault("Name", "")
    t.setdefault("Driver", "")
    t["User"] = t.get("User") or ""
    for key in (
        "Config",
        "Env",
        "Meta",
        "Constraints",
        "Affinities",
        "Services",
        "Lifecycle",
        "Templates",
        "Artifacts",
        "Vault",
        "VolumeMounts",
        "Identity",
    ):
        t.setdefault(key, None)
    if t.get("Meta") == {}:
        t["Meta"] = None
    t["Resources"] = _merge(
        {"CPU": 100, "Cores": 0, "MemoryMB": 300, "MemoryMaxMB": 0, "DiskMB": 0, "Networks": None, "Devices": None},
        t.get("Resources"),
    )
    if t.get("KillTimeout") is None:
        t["KillTimeout"] = 5 * S
    t["RestartPolicy"] = _merge(group.get("RestartPolicy"), t.get("RestartPolicy"))
    t["LogConfig"] = t.get("LogConfig") or {"MaxFiles": 10, "MaxFileSizeMB": 10, "Disabled": False}
    t["Leader"] = bool(t.get("Leader") or False)
    t["ShutdownDelay"] = t.get("ShutdownDelay") or 0
    t["KillSignal"] = t.get("KillSignal") or ""
    t["Kind"] = t.get("Kind") or ""
    return t


# ---------------------------------------------------------------------------------------------
# Validation (structs.Job.Validate subset), go-multierror formatting
# ---------------------------------------------------------------------------------------------


def multierror(errors: list[str]) -> str:
    """go-multierror's ListFormatFunc."""
    if len(errors) == 1:
        return f"1 error occurred:\n\t* {errors[0]}\n\n"
    points = "\n\t".join(f"* {e}" for e in errors)
    return f"{len(errors)} errors occurred:\n\t{points}\n\n"


def go_duration(ns: int) -> str:
    """Format nanoseconds like Go's time.Duration.String()."""
    if ns == 0:
        return "0s"
    neg = ns < 0
    ns = abs(ns)
    if ns < S:
        if ns < 1000:
            out = f"{ns}ns"
        elif ns < 1_000_000:
            out = f"{_trim(ns / 1000)}µs"
        else:
            out = f"{_trim(ns / 1_000_000)}ms"
        return ("-" if neg else "") + out
    hours, rem = divmod(ns, HOUR)
    minutes, rem = divmod(rem, MINUTE)
    seconds = rem / S
    out = ""
    if hours:
        out += f"{hours}h"
    if hours or minutes:
        out += f"{minutes}m"
    out += f"{_trim(seconds)}s"
    return ("-" if neg else "") + out


def _trim(x: float) -> str:
    s = f"{x:.9f}".rstrip("0").rstrip(".")
    return s or "0"


def validate_job(j: dict[str, Any]) -> list[str]:
    errs: list[str] = []
    if not j.get("Region"):
        errs.append("Missing job region")
    if not j.get("ID"):
        errs.append("Missing job ID")
    elif " " in j["ID"]:
        errs.append("Job ID contains a space")
    if not j.get("Name"):
        errs.append("Missing job name")
    if not j.get("Namespace"):
        errs.append("Job must be in a namespace")
    jtype = j.get("Type")
    if jtype not in ("service", "batch", "system", "sysbatch", "_core"):
        errs.append(f'Invalid job type: "{jtype}"' if jtype else "Missing job type")
    prio = j.get("Priority", 50)
    if not 1 <= prio <= 100:
        errs.append("Job priority must be between [1, 100]")
    if not j.get("Datacenters"):
        errs.append("Missing job datacenters")
    groups = j.get("TaskGroups") or []
    if not groups:
        errs.append("Missing job task groups")
    seen: dict[str, int] = {}
    for idx, tg in enumerate(groups):
        name = tg.get("Name") or ""
        if not name:
            errs.append(f"Job task group {idx + 1} missing name")
        elif name in seen:
            errs.append(f"Job task group {idx + 1} redefines '{name}' from group {seen[name] + 1}")
        else:
            seen[name] = idx
        if jtype == "system" and tg.get("Count", 1) > 1:
            errs.append(
                f"Job task group {name} has count {tg.get('Count')}. Count cannot exceed 1 with system scheduler"
            )
    for tg in groups:
        gerrs = _validate_group(tg, j)
        if gerrs:
            errs.append(f"Task group {tg.get('Name')} validation failed: {multierror(gerrs)}")
    return errs


def _validate_group(tg: dict[str, Any], j: dict[str, Any]) -> list[str]:
    errs: list[str] = []
    if not tg.get("Name"):
        errs.append("Missing task group name")
    if (tg.get("Count") or 0) < 0:
        errs.append("Task group count can't be negative")
    tasks = tg.get("Tasks") or []
    if not tasks:
        errs.append("Missing tasks for task group")
    rp = tg.get("RestartPolicy") or {}
    if rp.get("Mode") not in ("delay", "fail"):
        errs.append(f'Unsupported restart mode: "{rp.get("Mode")}"')
    if rp.get("Attempts", 0) < 0:
        errs.append(f"Restart attempts must be non-negative: {rp.get('Attempts')}")
    rs = tg.get("ReschedulePolicy")
    if rs and rs.get("DelayFunction") not in ("constant", "exponential", "fibonacci"):
        errs.append(
            f'Invalid delay function "{rs.get("DelayFunction")}", must be one of [constant exponential fibonacci]'
        )
    u = tg.get("Update")
    if u is not None:
        if j.get("Type") not in ("service", "system"):
            errs.append(f'Job type "{j.get("Type")}" does not allow update block')
        uerrs = []
        if u.get("HealthCheck") not in ("checks", "task_states", "manual"):
            uerrs.append(f'Invalid health check given: "{u.get("HealthCheck")}"')
        if u.get("MaxParallel", 0) < 0:
            uerrs.append(f"Max parallel can not be less than zero: {u.get('MaxParallel')} < 0")
        if u.get("Canary", 0) < 0:
            uerrs.append(f"Canary count can not be less than zero: {u.get('Canary')} < 0")
        mht, hd, pd = u.get("MinHealthyTime", 0), u.get("HealthyDeadline", 0), u.get("ProgressDeadline", 0)
        if mht < 0:
            uerrs.append(f"Minimum healthy time may not be less than zero: {go_duration(mht)}")
        if hd <= 0:
            uerrs.append(f"Healthy deadline must be greater than zero: {go_duration(hd)}")
        if pd < 0:
            uerrs.append(f"Progress deadline must be zero or greater: {go_duration(pd)}")
        if mht >= hd:
            uerrs.append(
                f"Minimum healthy time must be less than healthy deadline: {go_duration(mht)} > {go_duration(hd)}"
            )
        if pd != 0 and hd >= pd:
            uerrs.append(f"Healthy deadline must be less than progress deadline: {go_duration(hd)} > {go_duration(pd)}")
        if u.get("Stagger", 0) <= 0:
            uerrs.append(f"Stagger must be greater than zero: {go_duration(u.get('Stagger', 0))}")
        errs.extend(uerrs)
    labels: set[str] = set()
    for net in tg.get("Networks") or []:
        for kind in ("ReservedPorts", "DynamicPorts"):
            for p in net.get(kind) or []:
                label = p.get("Label") or ""
                if label in labels:
                    errs.append(f"Port label {label} already in use")
                labels.add(label)
                if kind == "ReservedPorts" and not 0 < p.get("Value", 0) <= 65535:
                    errs.append(f"Port {label} has an invalid port number {p.get('Value')}")
    seen: dict[str, int] = {}
    for idx, t in enumerate(tasks):
        name = t.get("Name") or ""
        if not name:
            errs.append(f"Task {idx + 1} missing name")
        elif name in seen:
            errs.append(f"Task {idx + 1} redefines '{name}' from task {seen[name] + 1}")
        else:
            seen[name] = idx
    for t in tasks:
        terrs = _validate_task(t)
        if terrs:
            errs.append(f"Task {t.get('Name')} validation failed: {multierror(terrs)}")
    return errs


def _validate_task(t: dict[str, Any]) -> list[str]:
    errs: list[str] = []
    if not t.get("Name"):
        errs.append("Missing task name")
    elif "/" in t["Name"] or "\\" in t["Name"]:
        errs.append("Task name cannot include slashes")
    if not t.get("Driver"):
        errs.append("Missing task driver")
    if (t.get("KillTimeout") or 0) < 0:
        errs.append("KillTimeout must be a positive value")
    res = t.get("Resources") or {}
    if res.get("CPU", 100) < 1 and not res.get("Cores"):
        errs.append(f"minimum CPU value is 1; got {res.get('CPU')}")
    if res.get("MemoryMB", 300) < 10:
        errs.append(f"minimum MemoryMB value is 10; got {res.get('MemoryMB')}")
    return errs


# ---------------------------------------------------------------------------------------------
# Helpers used by the scheduler
# ---------------------------------------------------------------------------------------------

# Group fields whose change is applied in place (no new allocation), per the reconciler.
INPLACE_GROUP_KEYS = frozenset(
    {
        "Count",
        "Update",
        "Scaling",
        "ReschedulePolicy",
        "Migrate",
        "Constraints",
        "Affinities",
        "Spreads",
        "StopAfterClientDisconnect",
        "MaxClientDisconnect",
        "Disconnect",
        "PreventRescheduleOnLost",
        "ShutdownDelay",
    }
)


def find_group(job: dict[str, Any], name: str) -> dict[str, Any] | None:
    groups: list[dict[str, Any]] = job.get("TaskGroups") or []
    for g in groups:
        if g.get("Name") == name:
            return g
    return None


def destructive_change(old_job: dict[str, Any], new_job: dict[str, Any], group: str) -> bool:
    """True when moving an allocation from ``old_job`` to ``new_job`` needs a new allocation.

    Simplification of Nomad's ``tasksUpdated``: any change to the group's tasks, networks,
    services, volumes, disk, meta or restart policy (or the job's Meta) is destructive;
    count/update/scaling/reschedule/constraint changes are in place.
    """
    og, ng = find_group(old_job, group), find_group(new_job, group)
    if og is None or ng is None:
        return True

    def strip(g: dict[str, Any]) -> dict[str, Any]:
        return {k: v for k, v in g.items() if k not in INPLACE_GROUP_KEYS}

    return strip(og) != strip(ng) or old_job.get("Meta") != new_job.get("Meta")


SPEC_IGNORED_KEYS = frozenset(
    {"Status", "StatusDescription", "Stable", "Version", "CreateIndex", "ModifyIndex", "JobModifyIndex", "SubmitTime"}
)


def spec_changed(old: dict[str, Any] | None, new: dict[str, Any]) -> bool:
    """``structs.Job.SpecChanged``."""
    if old is None:
        return True

    def strip(j: dict[str, Any]) -> dict[str, Any]:
        return {k: v for k, v in j.items() if k not in SPEC_IGNORED_KEYS}

    return strip(old) != strip(new)
