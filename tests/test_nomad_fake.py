"""Tests of the fake Nomad HTTP API (``tests/nomad_fake``), driven exactly as real clients
would drive a Nomad agent: python-nomad (sync, ``requests``) and httpx (sync and async).

Contract: ``docs/nomad-api.md``. The checks that need no fault-injection hook (status
codes, plain-text errors, ports only on single-allocation reads, scaling refused during a deployment,
blocking queries, variables, namespaces) take the ``target`` fixture and run twice: against the fake,
and against a real agent when ``NOMAD_ADDR`` is set (skipped otherwise, saying so). Everything else
(crashes, driver failures, node loss, ACL tokens, injected HTTP errors) is fake-only.
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import nomad.api.exceptions as nomad_exc
import pytest
from nomad_fake import AllocHandle, FakeNomad, NullDriver, ProcessDriver, S

import nomad

GROUP = "slots"
JOB = "pool"  # the fake-only tests' job
REAL_NOMAD = {k: v for k, v in os.environ.items() if k.startswith("NOMAD_")}  # before the fixture clears them
REAL_IMAGE = os.environ.get("ATROPOS_SANDBOX_IMAGE", "atropos-sandbox:dev")
NO_REAL_AGENT = (
    "NOMAD_ADDR is not set: these contract checks ran against the fake only. To run them against a real "
    f"agent, set NOMAD_ADDR (and NOMAD_TOKEN with a management token, NOMAD_CACERT for TLS) to a Nomad "
    f">= 2.0.4 agent whose docker driver can run the image {REAL_IMAGE} (ATROPOS_SANDBOX_IMAGE)"
)


def job_spec(
    *,
    count: int = 2,
    max_parallel: int = 0,
    min_healthy: int = 10 * S,
    restart: dict[str, Any] | None = None,
    reschedule: dict[str, Any] | None = None,
    env: dict[str, str] | None = None,
    job_id: str = JOB,
) -> dict[str, Any]:
    """A JSON job like the one ``nomad job run -output`` would emit. Its docker task only sleeps, so
    it also runs on a real agent (the fake's NullDriver ignores the config)."""
    group: dict[str, Any] = {
        "Name": GROUP,
        "Count": count,
        "Update": {"MaxParallel": max_parallel, "MinHealthyTime": min_healthy},
        "Networks": [{"Mode": "host", "DynamicPorts": [{"Label": "http"}]}],
        "RestartPolicy": restart or {"Attempts": 2, "Interval": 300 * S, "Delay": 1 * S, "Mode": "fail"},
        "ReschedulePolicy": reschedule or {"Delay": 1 * S, "DelayFunction": "constant", "Unlimited": True},
        "Tasks": [
            {
                "Name": "sandbox",
                "Driver": "docker",
                "Config": {"image": REAL_IMAGE, "entrypoint": ["/bin/sleep"], "args": ["3600"], "ports": ["http"]},
                "Env": env or {"SANDBOX_ALLOC": "${NOMAD_ALLOC_ID}"},
                "Resources": {"CPU": 100, "MemoryMB": 64},
                "KillTimeout": 2 * S,
            }
        ],
    }
    return {"Job": {"ID": job_id, "Name": job_id, "Type": "service", "Datacenters": ["*"], "TaskGroups": [group]}}


@pytest.fixture(autouse=True)
def _no_nomad_env(monkeypatch: pytest.MonkeyPatch) -> None:
    # python-nomad silently picks up NOMAD_ADDR/TOKEN/NAMESPACE/REGION/CLIENT_CERT/... (nomad-api.md
    # section 4): none may leak into a test. A real agent is reached through REAL_NOMAD only.
    for var in [v for v in os.environ if v.startswith("NOMAD_")]:
        monkeypatch.delenv(var, raising=False)


@pytest.fixture
def fake() -> Iterator[FakeNomad]:
    with FakeNomad(driver=NullDriver(), time_scale=0.05) as f:
        yield f
        assert f.monitor_errors == []


@pytest.fixture
def client(fake: FakeNomad) -> nomad.Nomad:
    return nomad.Nomad(address=fake.address, timeout=10)


class Target:
    """A Nomad agent reached over HTTP only: the fake or a real one. Jobs, variables and namespaces
    a test makes through :meth:`job_id` / :meth:`var_path` / :meth:`namespace_name` are removed
    afterwards, so a real cluster is left as it was."""

    def __init__(self, address: str, *, token: str | None = None, namespace: str | None = None,
                 region: str | None = None, verify: bool | str = True, cert: tuple[str, str] | None = None,
                 fake: FakeNomad | None = None) -> None:
        self.address, self.token, self.namespace, self.region = address, token, namespace, region
        self.verify, self.cert, self.fake = verify, cert, fake
        self.wait_s = 10.0 if fake is not None else 180.0  # a real agent may pull the image first
        self.jobs: list[str] = []
        self.vars: list[str] = []
        self.namespaces: list[str] = []

    @classmethod
    def real(cls, env: dict[str, str]) -> Target:
        cert = (env["NOMAD_CLIENT_CERT"], env["NOMAD_CLIENT_KEY"]) if env.get("NOMAD_CLIENT_CERT") else None
        verify: bool | str = env.get("NOMAD_CACERT") or True
        if env.get("NOMAD_SKIP_VERIFY", "").lower() in ("1", "true"):
            verify = False
        return cls(env["NOMAD_ADDR"], token=env.get("NOMAD_TOKEN"), namespace=env.get("NOMAD_NAMESPACE"),
                   region=env.get("NOMAD_REGION"), verify=verify, cert=cert)

    @property
    def is_fake(self) -> bool:
        return self.fake is not None

    def job_id(self, base: str = "contract") -> str:
        self.jobs.append(f"{base}-{secrets.token_hex(3)}")
        return self.jobs[-1]

    def var_path(self) -> str:
        self.vars.append(f"atropos-contract/{secrets.token_hex(3)}")
        return self.vars[-1]

    def namespace_name(self) -> str:
        self.namespaces.append(f"atropos-contract-{secrets.token_hex(3)}")
        return self.namespaces[-1]

    def nomad(self) -> nomad.Nomad:
        kw: dict[str, Any] = {"address": self.address, "timeout": 30, "token": self.token,
                              "namespace": self.namespace, "region": self.region, "verify": self.verify}
        if self.cert:
            kw["cert"] = self.cert
        return nomad.Nomad(**kw)

    def _kw(self) -> dict[str, Any]:
        params = {k: v for k, v in (("namespace", self.namespace), ("region", self.region)) if v}
        headers = {"X-Nomad-Token": self.token} if self.token else {}
        return {"base_url": self.address, "params": params, "headers": headers, "timeout": 30,
                "verify": self.verify, "cert": self.cert}

    def http(self) -> httpx.Client:
        return httpx.Client(**self._kw())

    def async_http(self) -> httpx.AsyncClient:
        return httpx.AsyncClient(**self._kw())

    def allocations(self, job_id: str) -> list[dict[str, Any]]:
        with self.http() as h:
            r = h.get(f"/v1/job/{job_id}/allocations")
            r.raise_for_status()
            return list(r.json())

    def wait_for(self, predicate: Callable[[], Any], *, message: str, timeout: float | None = None) -> Any:
        deadline = time.monotonic() + (timeout or self.wait_s)
        while True:
            value = predicate()
            if value:
                return value
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out waiting for {message}")
            time.sleep(0.05 if self.is_fake else 0.5)

    def wait_running(self, job_id: str, count: int) -> list[dict[str, Any]]:
        """Exactly ``count`` allocations desired run and running, sorted by name index."""

        def ok() -> list[dict[str, Any]] | None:
            live = [a for a in self.allocations(job_id) if a["DesiredStatus"] == "run"]
            running = [a for a in live if a["ClientStatus"] == "running"]
            return running if len(running) == count == len(live) else None

        allocs = self.wait_for(ok, message=f"{count} running allocations of {job_id}")
        return sorted(allocs, key=lambda a: int(a["Name"].rsplit("[", 1)[1].rstrip("]")))

    def close(self) -> None:
        with self.http() as h:
            for job_id in self.jobs:
                h.delete(f"/v1/job/{job_id}", params={"purge": "true"})
            for path in self.vars:
                h.delete(f"/v1/var/{path}")
            for ns in self.namespaces:
                if not self.is_fake:  # the fake keeps namespaces (it is thrown away anyway)
                    for job_id in self.jobs:
                        h.delete(f"/v1/job/{job_id}", params={"purge": "true", "namespace": ns})
                    h.delete(f"/v1/namespace/{ns}")
        if self.fake is not None:
            errors = self.fake.monitor_errors
            self.fake.stop()
            assert errors == []


@pytest.fixture(params=["fake", "real"])
def target(request: pytest.FixtureRequest) -> Iterator[Target]:
    """The API contract's subject: the fake, and a real agent when NOMAD_ADDR is set."""
    if request.param == "real":
        if "NOMAD_ADDR" not in REAL_NOMAD:
            pytest.skip(NO_REAL_AGENT)
        t = Target.real(REAL_NOMAD)
    else:
        f = FakeNomad(driver=NullDriver(), time_scale=0.05).start()
        t = Target(f.address, fake=f)
    try:
        yield t
    finally:
        t.close()


def scale(n: nomad.Nomad, job_id: str, count: int) -> dict[str, Any]:
    # python-nomad 2.1.0 has no scale method: use the public requester (nomad-api.md section 4).
    resp = n.job.request(
        job_id, "scale", method="post", json={"Count": count, "Target": {"Group": GROUP}, "Message": "test"}
    )
    return dict(resp.json())


def by_name(allocs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {a["Name"]: a for a in allocs}


# ---------------------------------------------------------------------------------------------
# The contract: fake and real agent (python-nomad, sync)
# ---------------------------------------------------------------------------------------------


def test_register_places_allocations_that_go_running(target: Target) -> None:
    client, job = target.nomad(), target.job_id()
    reply = client.jobs.register_job(job_spec(count=3, job_id=job))
    assert set(reply) >= {"EvalID", "EvalCreateIndex", "JobModifyIndex", "Warnings", "Index"}
    assert reply["EvalID"]

    running = target.wait_running(job, 3)
    assert [a["Name"] for a in running] == [f"{job}.{GROUP}[0]", f"{job}.{GROUP}[1]", f"{job}.{GROUP}[2]"]

    target.wait_for(lambda: client.job.get_job(job)["Status"] == "running", message="job status running")
    got = client.job.get_job(job)
    assert got["Version"] == 0
    assert got["TaskGroups"][0]["Count"] == 3
    # server-side defaults (api Canonicalize)
    assert got["Priority"] == 50
    assert got["TaskGroups"][0]["EphemeralDisk"]["SizeMB"] == 300

    evaluation = client.evaluation.get_evaluation(reply["EvalID"])
    assert evaluation["Status"] == "complete"
    assert evaluation["TriggeredBy"] == "job-register"

    stubs = client.job.get_allocations(job)
    assert len(stubs) == 3
    stub = stubs[0]
    assert {"ID", "Name", "JobID", "TaskGroup", "ClientStatus", "DesiredStatus", "NodeID", "CreateIndex",
            "ModifyIndex", "JobVersion", "TaskStates"} <= set(stub)
    assert stub["TaskStates"]["sandbox"]["State"] == "running"
    events = [e["Type"] for e in stub["TaskStates"]["sandbox"]["Events"]]
    assert events[0] == "Received" and events[-1] == "Started"

    # re-registering the identical spec creates an evaluation but no new version
    again = client.job.register_job(job, job_spec(count=3, job_id=job))
    assert again["JobModifyIndex"] == reply["JobModifyIndex"]
    assert client.job.get_job(job)["Version"] == 0


def test_ports_only_on_single_allocation_reads(target: Target) -> None:
    client, job = target.nomad(), target.job_id()
    client.jobs.register_job(job_spec(count=1, job_id=job))
    [stub] = target.wait_running(job, 1)

    listed = client.job.get_allocations(job)[0]
    assert "AllocatedResources" not in listed
    # list stubs keep empty fields as null / ""
    assert listed["RescheduleTracker"] is None
    assert listed["NextAllocation"] == ""

    alloc = client.allocation.get_allocation(stub["ID"])
    shared = alloc["AllocatedResources"]["Shared"]
    [port] = shared["Ports"]
    assert port["Label"] == "http"
    assert port["HostIP"]
    if target.is_fake:
        assert port["HostIP"] == "127.0.0.1"
    assert 0 < port["Value"] <= 65535
    assert "To" not in port  # omitempty
    [net] = shared["Networks"]
    assert net["DynamicPorts"][0]["Value"] == port["Value"]
    # single objects omit empty fields
    assert "PreviousAllocation" not in alloc and "NextAllocation" not in alloc
    assert alloc["Job"]["ID"] == job

    # ?resources=true on the cluster-wide list does include them
    with_res = client.allocations.get_allocations(filter_=f'JobID == "{job}"', resources=True)
    assert with_res[0]["AllocatedResources"]["Shared"]["Ports"][0]["Value"] == port["Value"]


def test_scale_up_and_down_removes_highest_indexes(target: Target) -> None:
    client, job = target.nomad(), target.job_id()
    client.jobs.register_job(job_spec(count=2, job_id=job))
    before = by_name(target.wait_running(job, 2))

    reply = scale(client, job, 4)
    assert reply["EvalID"]
    up = by_name(target.wait_running(job, 4))
    assert set(up) == {f"{job}.{GROUP}[{i}]" for i in range(4)}
    for name, alloc in before.items():
        assert up[name]["ID"] == alloc["ID"]  # in-place: same allocations kept
    assert client.job.get_job(job)["Version"] == 1

    scale(client, job, 2)
    down = by_name(target.wait_running(job, 2))
    assert set(down) == {f"{job}.{GROUP}[0]", f"{job}.{GROUP}[1]"}
    assert {down[n]["ID"] for n in down} == {up[n]["ID"] for n in down}
    for i in (2, 3):
        gone = client.allocation.get_allocation(up[f"{job}.{GROUP}[{i}]"]["ID"])
        assert gone["DesiredStatus"] == "stop"
        assert gone["DesiredDescription"] == "alloc not needed due to job update"
    target.wait_for(
        lambda: all(
            client.allocation.get_allocation(up[f"{job}.{GROUP}[{i}]"]["ID"])["ClientStatus"] == "complete"
            for i in (2, 3)
        ),
        message="scaled-down allocations to complete",
    )
    status = client.job.request(job, "scale", method="get").json()
    assert status["TaskGroups"][GROUP]["Desired"] == 2
    assert status["TaskGroups"][GROUP]["Running"] == 2
    assert [e["Count"] for e in status["TaskGroups"][GROUP]["Events"]] == [2, 4]


def test_scale_refused_during_deployment_until_it_ends(target: Target) -> None:
    # A service job without max_parallel=0 gets a deployment for its first version; while it is
    # active (here: MinHealthyTime=2m at least) every scale is refused with Nomad's exact 400.
    client, job = target.nomad(), target.job_id()
    client.jobs.register_job(job_spec(count=1, max_parallel=1, min_healthy=120 * S, job_id=job))
    deployment = target.wait_for(lambda: client.job.get_deployment(job), message="a deployment")
    assert deployment["Status"] == "running"
    assert deployment["TaskGroups"][GROUP]["DesiredTotal"] == 1

    with pytest.raises(nomad_exc.BadRequestNomadException) as refused:
        scale(client, job, 2)
    assert refused.value.nomad_resp.status_code == 400
    assert refused.value.nomad_resp.headers["Content-Type"].startswith("text/plain")
    assert refused.value.nomad_resp.text == "job scaling blocked due to active deployment"

    # Once the deployment is over (failed here through the API, no clock needed), scaling works.
    with target.http() as h:
        r = h.post(f"/v1/deployment/fail/{deployment['ID']}")
        assert r.status_code == 200, r.text
    assert client.job.get_deployment(job)["Status"] == "failed"
    scale(client, job, 2)
    assert client.job.get_job(job)["TaskGroups"][0]["Count"] == 2


def test_alloc_stop_replaces_with_same_name_and_restart_keeps_id(target: Target) -> None:
    client, job = target.nomad(), target.job_id()
    client.jobs.register_job(job_spec(count=1, job_id=job))
    [alloc] = target.wait_running(job, 1)

    client.client.allocation.restart_allocation(alloc["ID"])
    target.wait_for(
        lambda: client.allocation.get_allocation(alloc["ID"])["TaskStates"]["sandbox"]["Restarts"] == 1,
        message="user restart",
    )

    reply = client.allocation.stop_allocation(alloc["ID"])
    assert set(reply) == {"EvalID", "Index"}
    target.wait_for(lambda: client.allocation.get_allocation(alloc["ID"]).get("NextAllocation"), message="migrate")
    [new] = target.wait_running(job, 1)
    assert new["Name"] == alloc["Name"] and new["ID"] != alloc["ID"]
    old = client.allocation.get_allocation(alloc["ID"])
    assert old["DesiredDescription"] == "alloc is being migrated"
    assert old["DesiredTransition"] == {"Migrate": True}
    assert client.allocation.get_allocation(new["ID"])["PreviousAllocation"] == alloc["ID"]


def test_delete_unknown_job_is_200_with_empty_eval(target: Target) -> None:
    client, unknown = target.nomad(), f"no-such-job-{secrets.token_hex(3)}"
    reply = client.job.deregister_job(unknown, purge=True)
    assert reply["EvalID"] == ""
    assert reply["JobModifyIndex"] == 0
    # and listing allocations/evaluations of an unknown job is 200 []
    assert client.job.get_allocations(unknown) == []
    assert client.job.get_evaluations(unknown) == []
    with pytest.raises(nomad_exc.URLNotFoundNomadException) as missing:
        client.job.get_job(unknown)
    assert missing.value.nomad_resp.text == "job not found"


def test_bad_job_spec_is_500_plain_text(target: Target) -> None:
    client = target.nomad()
    with pytest.raises(nomad_exc.BaseNomadException) as bad:
        client.jobs.register_job({"Job": {"ID": target.job_id("broken"), "TaskGroups": []}})
    resp = bad.value.nomad_resp
    assert resp.status_code == 500
    assert resp.headers["Content-Type"].startswith("text/plain")
    assert resp.text == "1 error occurred:\n\t* Missing job task groups\n\n"

    spec = job_spec(job_id=target.job_id())
    spec["Job"]["TaskGroups"][0]["Tasks"][0]["Driver"] = ""
    with pytest.raises(nomad_exc.BaseNomadException) as bad:
        client.jobs.register_job(spec)
    assert bad.value.nomad_resp.status_code == 500
    assert "Task sandbox validation failed" in bad.value.nomad_resp.text
    assert "Missing task driver" in bad.value.nomad_resp.text

    # request-level problems are 400
    with pytest.raises(nomad_exc.BadRequestNomadException) as bad_req:
        client.jobs.register_job({"Job": {"Name": "no-id"}})
    assert bad_req.value.nomad_resp.text == "Job ID hasn't been provided"
    with pytest.raises(nomad_exc.BadRequestNomadException):
        client.jobs.register_job({"Job": {"ID": target.job_id(), "TaskGroups": [{"Name": "g", "Count": "two"}]}})


def test_purge_and_stop(target: Target) -> None:
    client, job = target.nomad(), target.job_id()
    client.jobs.register_job(job_spec(count=1, job_id=job))
    target.wait_running(job, 1)
    reply = client.job.deregister_job(job)  # stop, no purge
    assert reply["EvalID"]
    target.wait_for(lambda: client.job.get_job(job)["Status"] == "dead", message="job dead")
    assert client.job.get_job(job)["Stop"] is True

    client.job.deregister_job(job, purge=True)
    with pytest.raises(nomad_exc.URLNotFoundNomadException):
        client.job.get_job(job)
    assert len(client.job.get_allocations(job)) == 1  # still listable after purge


# ---------------------------------------------------------------------------------------------
# The contract: fake and real agent (httpx)
# ---------------------------------------------------------------------------------------------


async def test_blocking_query_returns_on_change_and_times_out(target: Target) -> None:
    job = target.job_id()
    async with target.async_http() as h:
        r = await h.post("/v1/jobs", json=job_spec(count=1, job_id=job))
        assert r.status_code == 200
        await asyncio.to_thread(target.wait_running, job, 1)
        await asyncio.to_thread(target.wait_for, lambda: target.nomad().job.get_job(job)["Status"] == "running",
                                message="job running")

        r = await h.get(f"/v1/job/{job}")
        assert r.headers["X-Nomad-KnownLeader"] == "true"
        assert r.headers["X-Nomad-LastContact"] == "0"
        job_index = int(r.headers["X-Nomad-Index"])
        r = await h.get(f"/v1/job/{job}/allocations")
        alloc_index = int(r.headers["X-Nomad-Index"])

        # no change: the wait expires (plus at most wait/16 jitter) with the same index
        start = time.monotonic()
        r = await h.get(f"/v1/job/{job}", params={"index": job_index, "wait": "400ms"})
        elapsed = time.monotonic() - start
        assert r.status_code == 200
        assert 0.38 <= elapsed < 2.0
        assert int(r.headers["X-Nomad-Index"]) == job_index

        # a change wakes the query well before the wait expires
        start = time.monotonic()
        blocked = asyncio.create_task(h.get(f"/v1/job/{job}/allocations", params={"index": alloc_index, "wait": "20s"}))
        await asyncio.sleep(0.2)
        if target.is_fake:  # a real cluster's other jobs may wake it (any allocation change does)
            assert not blocked.done()
        r = await h.post(f"/v1/job/{job}/scale", json={"Count": 2, "Target": {"Group": GROUP}})
        assert r.status_code == 200, r.text
        woke = await blocked
        assert time.monotonic() - start < 10.0
        assert int(woke.headers["X-Nomad-Index"]) > alloc_index

        bad = await h.get(f"/v1/job/{job}", params={"index": 1, "wait": "5"})
        assert (bad.status_code, bad.text) == (400, "Invalid wait time")


async def test_httpx_errors_are_plain_text(target: Target) -> None:
    nope, job = f"nope-{secrets.token_hex(3)}", target.job_id()
    async with target.async_http() as h:
        r = await h.get("/v1/allocation/00000000-0000-0000-0000-000000000000")
        assert (r.status_code, r.text) == (404, "alloc not found")
        assert "X-Nomad-Index" in r.headers
        r = await h.post(f"/v1/job/{nope}/scale", json={"Count": 1, "Target": {"Group": GROUP}})
        assert (r.status_code, r.text) == (404, f'job "{nope}" not found')
        r = await h.post(f"/v1/job/{nope}/scale", json={"Count": 1, "Target": {}})
        assert (r.status_code, r.text) == (400, "missing task group name for scaling action")
        r = await h.delete("/v1/jobs")
        assert (r.status_code, r.text) == (405, "Invalid method")
        r = await h.get("/v1/jobs", params={"region": "no-such-region"})
        assert (r.status_code, r.text) == (500, "No path to region")
        r = await h.post("/v1/jobs", content=b"")
        assert (r.status_code, r.text) == (400, "Request body is empty")
        r = await h.put(f"/v1/job/{job}", json=job_spec(job_id="other"))
        assert (r.status_code, r.text) == (400, "Job ID does not match name")
        assert r.headers["Content-Type"].startswith("text/plain")


async def test_namespaces_are_separate(target: Target) -> None:
    ns, job = target.namespace_name(), target.job_id()
    async with target.async_http() as h:
        r = await h.post(f"/v1/namespace/{ns}", json={"Name": ns, "Description": "atropos contract test"})
        assert r.status_code == 200, r.text
        r = await h.post("/v1/jobs", params={"namespace": ns}, json=job_spec(count=1, job_id=job))
        assert r.status_code == 200, r.text
        assert (await h.get(f"/v1/job/{job}", params={"namespace": "default"})).status_code == 404
        got = (await h.get(f"/v1/job/{job}", params={"namespace": ns})).json()
        assert got["Namespace"] == ns
        everywhere = (await h.get("/v1/jobs", params={"namespace": "*"})).json()
        assert (job, ns) in [(j["ID"], j["Namespace"]) for j in everywhere]
        missing = f"no-such-ns-{secrets.token_hex(3)}"
        r = await h.post("/v1/jobs", params={"namespace": missing}, json=job_spec(count=1, job_id=job))
        assert (r.status_code, r.text) == (500, f'job "{job}" is in nonexistent namespace "{missing}"')


def test_variables_put_get_cas_delete(target: Target) -> None:
    path = target.var_path()
    with target.http() as h:
        r = h.get(f"/v1/var/{path}")
        assert (r.status_code, r.text) == (404, "variable not found")
        assert "X-Nomad-Index" in r.headers

        r = h.put(f"/v1/var/{path}", json={"Path": path, "Items": {"token": "s3cr3t"}})
        assert r.status_code == 200, r.text
        made = r.json()
        assert {"Namespace", "Path", "CreateIndex", "ModifyIndex", "CreateTime", "ModifyTime", "Items"} <= set(made)
        assert (made["Path"], made["Items"], made["CreateIndex"]) == (path, {"token": "s3cr3t"}, made["ModifyIndex"])
        assert made["Namespace"] == (target.namespace or "default")
        assert int(r.headers["X-Nomad-Index"]) == made["ModifyIndex"]

        r = h.get(f"/v1/var/{path}")
        assert r.status_code == 200 and r.json()["Items"] == {"token": "s3cr3t"}
        assert int(r.headers["X-Nomad-Index"]) == made["ModifyIndex"]

        # check-and-set: cas=0 means "only if absent"; a stale index gets 409 and the current variable
        r = h.put(f"/v1/var/{path}", params={"cas": 0}, json={"Items": {"token": "other"}})
        assert r.status_code == 409
        assert r.json()["Items"] == {"token": "s3cr3t"} and r.json()["ModifyIndex"] == made["ModifyIndex"]
        r = h.put(f"/v1/var/{path}", params={"cas": made["ModifyIndex"]}, json={"Items": {"token": "rotated"}})
        assert r.status_code == 200, r.text
        updated = r.json()
        assert updated["ModifyIndex"] > made["ModifyIndex"] and updated["CreateIndex"] == made["CreateIndex"]
        r = h.delete(f"/v1/var/{path}", params={"cas": made["ModifyIndex"]})
        assert r.status_code == 409 and r.json()["Items"] == {"token": "rotated"}

        listed = h.get("/v1/vars", params={"prefix": path}).json()
        assert [v["Path"] for v in listed] == [path] and "Items" not in listed[0]

        r = h.put(f"/v1/var/{path}", json={"Items": {}})
        assert (r.status_code, r.text) == (400, "variable missing required Items object")
        r = h.put("/v1/var/bad.path", json={"Items": {"a": "b"}})
        assert (r.status_code, r.text) == (500, 'invalid path "bad.path"')

        r = h.delete(f"/v1/var/{path}", params={"cas": updated["ModifyIndex"]})
        assert (r.status_code, r.content) == (204, b"")
        assert h.get(f"/v1/var/{path}").status_code == 404
        assert h.delete(f"/v1/var/{path}").status_code == 204  # deleting what is not there is fine


# ---------------------------------------------------------------------------------------------
# Fake only: its clock, fault injection, ACL tokens it mints
# ---------------------------------------------------------------------------------------------


def test_deployment_completes_after_min_healthy_time_then_scaling_works(fake: FakeNomad, client: nomad.Nomad) -> None:
    client.jobs.register_job(job_spec(count=1, max_parallel=1, min_healthy=60 * S))
    fake.wait_running(JOB, 1)
    with pytest.raises(nomad_exc.BadRequestNomadException):
        scale(client, JOB, 2)
    fake.advance(60)  # skip MinHealthyTime on the fake clock
    fake.wait_for(lambda: client.job.get_deployment(JOB)["Status"] == "successful", message="deployment")
    assert client.job.get_deployment(JOB)["TaskGroups"][GROUP]["HealthyAllocs"] == 1
    assert client.job.get_job(JOB)["Stable"] is True
    scale(client, JOB, 2)
    fake.wait_running(JOB, 2)
    # the scale made version 1, which has its own deployment again
    assert client.job.get_deployment(JOB)["JobVersion"] == 1


def test_blocking_deployment_fault(fake: FakeNomad, client: nomad.Nomad) -> None:
    client.jobs.register_job(job_spec(count=1, max_parallel=0))
    fake.wait_running(JOB, 1)
    assert client.job.get_deployment(JOB) is None  # max_parallel = 0: no deployment

    deployment_id = fake.start_deployment_blocking(JOB)
    with pytest.raises(nomad_exc.BadRequestNomadException) as refused:
        scale(client, JOB, 3)
    assert refused.value.nomad_resp.text == "job scaling blocked due to active deployment"
    time.sleep(0.3)  # it does not complete on its own
    assert client.job.get_deployment(JOB)["ID"] == deployment_id
    assert client.job.get_deployment(JOB)["Status"] == "running"

    fake.finish_deployment(JOB)
    scale(client, JOB, 3)
    fake.wait_running(JOB, 3)


def test_crash_beyond_restart_policy_reschedules_with_new_id_same_name(fake: FakeNomad, client: nomad.Nomad) -> None:
    client.jobs.register_job(job_spec(count=1, restart={"Attempts": 0, "Mode": "fail"}))
    [old] = fake.wait_running(JOB, 1)

    fake.crash_alloc(old["ID"], exit_code=137)
    fake.wait_for(lambda: client.allocation.get_allocation(old["ID"]).get("NextAllocation"), message="resched")
    [new] = fake.wait_running(JOB, 1)

    assert new["ID"] != old["ID"]
    assert new["Name"] == old["Name"] == f"{JOB}.{GROUP}[0]"
    failed = client.allocation.get_allocation(old["ID"])
    assert failed["ClientStatus"] == "failed"
    assert failed["DesiredStatus"] == "stop"
    assert failed["DesiredDescription"] == "alloc was rescheduled because it failed"
    assert failed["NextAllocation"] == new["ID"]
    types = [e["Type"] for e in failed["TaskStates"]["sandbox"]["Events"]]
    assert types[-2:] == ["Terminated", "Not Restarting"]
    terminated = failed["TaskStates"]["sandbox"]["Events"][-2]
    assert terminated["ExitCode"] == 137
    assert failed["TaskStates"]["sandbox"]["Failed"] is True

    replacement = client.allocation.get_allocation(new["ID"])
    assert replacement["PreviousAllocation"] == old["ID"]
    [event] = replacement["RescheduleTracker"]["Events"]
    assert event["PrevAllocID"] == old["ID"]
    assert event["Delay"] == 1 * S
    triggers = {e["TriggeredBy"] for e in client.job.get_evaluations(JOB)}
    assert "alloc-failure" in triggers


def test_crash_within_restart_policy_restarts_in_place(fake: FakeNomad, client: nomad.Nomad) -> None:
    client.jobs.register_job(job_spec(count=1))
    [alloc] = fake.wait_running(JOB, 1)
    fake.crash_alloc(alloc["ID"], exit_code=1)

    def restarted() -> dict[str, Any] | None:
        a = client.allocation.get_allocation(alloc["ID"])
        task = a["TaskStates"]["sandbox"]
        return a if task["Restarts"] == 1 and task["State"] == "running" else None

    after = fake.wait_for(restarted, message="in-place restart")
    assert after["ClientStatus"] == "running"
    types = [e["Type"] for e in after["TaskStates"]["sandbox"]["Events"]]
    assert types[-3:] == ["Terminated", "Restarting", "Started"]
    restarting = after["TaskStates"]["sandbox"]["Events"][-2]
    assert restarting["RestartReason"] == "Restart within policy"
    assert fake.running(JOB)[0]["ID"] == alloc["ID"]


def test_driver_failure_fails_then_reschedules(fake: FakeNomad, client: nomad.Nomad) -> None:
    fake.fail_driver(next_n=1, message="Docker privileged mode is disabled on this Nomad agent")
    client.jobs.register_job(job_spec(count=1))

    def failed_one() -> dict[str, Any] | None:
        return next((a for a in fake.allocations(JOB) if a["ClientStatus"] == "failed"), None)

    failed = fake.wait_for(failed_one, message="driver failure")
    [new] = fake.wait_running(JOB, 1)
    assert new["ID"] != failed["ID"] and new["Name"] == failed["Name"]
    events = client.allocation.get_allocation(failed["ID"])["TaskStates"]["sandbox"]["Events"]
    assert events[-2]["Type"] == "Driver Failure"
    assert events[-2]["DriverError"] == "Docker privileged mode is disabled on this Nomad agent"
    assert events[-1]["RestartReason"] == "Error was unrecoverable"


def test_node_down_marks_allocs_lost_and_replaces_them() -> None:
    with FakeNomad(nodes=2, time_scale=0.05) as fake:
        n = nomad.Nomad(address=fake.address, timeout=10)
        nodes = n.nodes.get_nodes()
        assert len(nodes) == 2 and all(x["Status"] == "ready" for x in nodes)
        n.jobs.register_job(job_spec(count=2))
        running = fake.wait_running(JOB, 2)
        assert len({a["NodeID"] for a in running}) == 2  # spread over both nodes
        victim = running[0]

        fake.node_down(victim["NodeID"])
        assert n.node.get_node(victim["NodeID"])["Status"] == "down"
        lost = n.allocation.get_allocation(victim["ID"])
        assert lost["ClientStatus"] == "lost"
        assert lost["DesiredStatus"] == "stop"
        assert lost["DesiredDescription"] == "alloc is lost since its node is down"

        after = by_name(fake.wait_running(JOB, 2))
        replacement = after[victim["Name"]]
        assert replacement["ID"] != victim["ID"]
        assert replacement["NodeID"] != victim["NodeID"]
        assert n.allocation.get_allocation(replacement["ID"])["PreviousAllocation"] == victim["ID"]
        assert "node-update" in {e["TriggeredBy"] for e in n.job.get_evaluations(JOB)}
        assert fake.monitor_errors == []


def test_acl_denies_missing_or_wrong_token() -> None:
    with FakeNomad(acl_enabled=True, time_scale=0.05) as fake:
        anon = nomad.Nomad(address=fake.address, timeout=10)
        with pytest.raises(nomad_exc.URLNotAuthorizedNomadException) as denied:
            anon.jobs.get_jobs()
        assert denied.value.nomad_resp.status_code == 403
        assert denied.value.nomad_resp.text == "Permission denied"

        wrong = nomad.Nomad(address=fake.address, token="00000000-0000-0000-0000-000000000000", timeout=10)
        with pytest.raises(nomad_exc.URLNotAuthorizedNomadException) as denied:
            wrong.jobs.register_job(job_spec())
        assert denied.value.nomad_resp.text == "Permission denied"

        assert fake.management_token
        admin = nomad.Nomad(address=fake.address, token=fake.management_token, timeout=10)
        admin.jobs.register_job(job_spec(count=1))
        assert [j["ID"] for j in admin.jobs.get_jobs()] == [JOB]

        fake.add_namespace("team-a")
        scoped = nomad.Nomad(address=fake.address, token=fake.create_token(["team-a"]), timeout=10)
        assert scoped.jobs.get_jobs(namespace="team-a") == []
        with pytest.raises(nomad_exc.URLNotAuthorizedNomadException):
            scoped.job.get_job(JOB)  # namespace "default"

        # liveness endpoints need no token
        assert httpx.get(f"{fake.address}/v1/agent/health").json()["server"]["ok"] is True


def test_http_error_injection_and_unreachable(fake: FakeNomad, client: nomad.Nomad) -> None:
    fake.http_errors("/v1/jobs", 500, count=1, body="rpc error: No cluster leader")
    with pytest.raises(nomad_exc.BaseNomadException) as err:
        client.jobs.get_jobs()
    assert err.value.nomad_resp.status_code == 500
    assert err.value.nomad_resp.text == "rpc error: No cluster leader"
    assert client.jobs.get_jobs() == []

    fake.set_unreachable(True)
    with pytest.raises(nomad_exc.BaseNomadException):
        client.jobs.get_jobs()
    fake.set_unreachable(False)
    assert client.jobs.get_jobs() == []


# ---------------------------------------------------------------------------------------------
# ProcessDriver: real processes on the allocated ports
# ---------------------------------------------------------------------------------------------


def _http_server_argv(alloc: AllocHandle) -> list[str]:
    return [sys.executable, "-m", "http.server", str(alloc.ports["http"]), "--bind", "127.0.0.1"]


def test_process_driver_runs_real_http_server_on_allocated_port(tmp_path: Path) -> None:
    driver = ProcessDriver(_http_server_argv, cwd=str(tmp_path), log_dir=str(tmp_path))
    (tmp_path / "hello.txt").write_text("hello from the sandbox")
    with FakeNomad(driver=driver, time_scale=0.05) as fake:
        n = nomad.Nomad(address=fake.address, timeout=10)
        n.jobs.register_job(job_spec(count=2))
        running = fake.wait_running(JOB, 2)
        ports = []
        for stub in running:
            alloc = n.allocation.get_allocation(stub["ID"])
            [port] = alloc["AllocatedResources"]["Shared"]["Ports"]
            ports.append(port["Value"])
            url = f"http://{port['HostIP']}:{port['Value']}/hello.txt"

            def reachable(url: str = url) -> str | None:
                try:
                    return httpx.get(url, timeout=1).text
                except httpx.HTTPError:
                    return None

            assert fake.wait_for(reachable, message=f"http.server on {url}") == "hello from the sandbox"
        assert len(set(ports)) == 2
        pids = driver.running_pids()
        assert len(pids) == 2

        n.job.deregister_job(JOB, purge=True)
        fake.wait_for(lambda: driver.running_pids() == [], message="processes to be stopped")
        for pid in pids:
            with pytest.raises(ProcessLookupError):
                os.kill(pid, 0)
        assert fake.monitor_errors == []


ENV_DUMP = (
    "import json, os, sys, time\n"
    "json.dump({k: v for k, v in os.environ.items() if k.startswith(('NOMAD_', 'SANDBOX_'))},"
    " open(sys.argv[1], 'w'))\n"
    "sys.exit(int(sys.argv[2]))\n"
)


def test_process_driver_env_and_exit_follows_restart_policy(tmp_path: Path) -> None:
    def argv(alloc: AllocHandle) -> list[str]:
        out = tmp_path / f"{alloc.id}.json"
        return [sys.executable, "-c", ENV_DUMP, str(out), "3"]

    driver = ProcessDriver(argv, log_dir=str(tmp_path))
    with FakeNomad(driver=driver, time_scale=0.05) as fake:
        n = nomad.Nomad(address=fake.address, timeout=10)
        spec = job_spec(
            count=1,
            restart={"Attempts": 1, "Interval": 300 * S, "Delay": 1 * S, "Mode": "fail"},
            reschedule={"Attempts": 0, "Unlimited": False},
            env={"SANDBOX_ALLOC": "${NOMAD_ALLOC_ID}", "SANDBOX_NAME": "${NOMAD_ALLOC_NAME}"},
        )
        n.jobs.register_job(spec)
        [stub] = fake.wait_for(lambda: fake.allocations(JOB), message="placement")

        def failed() -> dict[str, Any] | None:
            a = n.allocation.get_allocation(stub["ID"])
            return a if a["ClientStatus"] == "failed" else None

        alloc = fake.wait_for(failed, message="process exits to fail the allocation")
        task = alloc["TaskStates"]["sandbox"]
        assert task["Restarts"] == 1
        exits = [e["ExitCode"] for e in task["Events"] if e["Type"] == "Terminated"]
        assert exits == [3, 3]
        assert task["Events"][-1]["RestartReason"] == (
            'Exceeded allowed attempts 1 in interval 5m0s and mode is "fail"'
        )
        # reschedule policy allows no attempts: the failed allocation stays, nothing replaces it
        time.sleep(0.2)
        assert [a["ID"] for a in fake.allocations(JOB)] == [stub["ID"]]

        env = json.loads((tmp_path / f"{stub['ID']}.json").read_text())
        port = alloc["AllocatedResources"]["Shared"]["Ports"][0]["Value"]
        assert env["NOMAD_ALLOC_ID"] == stub["ID"] == env["SANDBOX_ALLOC"]
        assert env["NOMAD_ALLOC_NAME"] == f"{JOB}.{GROUP}[0]" == env["SANDBOX_NAME"]
        assert env["NOMAD_ALLOC_INDEX"] == "0"
        assert env["NOMAD_PORT_http"] == str(port)
        assert env["NOMAD_ADDR_http"] == f"127.0.0.1:{port}"
        assert env["NOMAD_JOB_ID"] == JOB and env["NOMAD_GROUP_NAME"] == GROUP
        assert fake.monitor_errors == []


ENV_DUMP_AND_WAIT = (
    "import json, os, sys, time\n"
    "json.dump(dict(os.environ), open(sys.argv[1], 'w'))\n"
    "time.sleep(60)\n"
)


def test_template_waits_for_its_variable_then_renders_into_the_env(tmp_path: Path) -> None:
    def argv(alloc: AllocHandle) -> list[str]:
        return [sys.executable, "-c", ENV_DUMP_AND_WAIT, str(tmp_path / f"{alloc.id}.json")]

    driver = ProcessDriver(argv, log_dir=str(tmp_path), kill_timeout=0.2)
    with FakeNomad(driver=driver, time_scale=0.05) as fake:
        spec = job_spec(count=1)
        spec["Job"]["TaskGroups"][0]["Tasks"][0]["Templates"] = [{
            "EmbeddedTmpl": '{{ with nomadVar "nomad/jobs/pool" -}}\nSECRET={{ .token }}\n{{- end }}\n',
            "DestPath": "secrets/app.env", "Envvars": True, "ChangeMode": "noop"}]
        n = nomad.Nomad(address=fake.address, timeout=10)
        n.jobs.register_job(spec)

        # No variable yet: the template blocks, the task does not start, Nomad says what it waits for.
        def waiting() -> dict[str, Any] | None:
            allocs = fake.allocations(JOB)
            events = allocs[0]["TaskStates"]["sandbox"]["Events"] if allocs else []
            return allocs[0] if any(e["Type"] == "Template" for e in events) else None

        alloc = fake.wait_for(waiting, message="the Template event")
        event = alloc["TaskStates"]["sandbox"]["Events"][-1]
        assert event["DisplayMessage"] == "Missing: nomad.var.block(nomad/jobs/pool@default.global)"
        time.sleep(0.3)
        assert fake.allocation(alloc["ID"])["ClientStatus"] == "pending" and driver.running_pids() == []

        r = httpx.put(f"{fake.address}/v1/var/nomad/jobs/pool", json={"Items": {"token": "t0k3n"}})
        assert r.status_code == 200, r.text
        fake.wait_running(JOB, 1)
        dump = tmp_path / f"{alloc['ID']}.json"
        env = fake.wait_for(lambda: dump.exists() and dump.stat().st_size and json.loads(dump.read_text()),
                            message="the task's environment")
        assert env["SECRET"] == "t0k3n" and env["NOMAD_ALLOC_ID"] == alloc["ID"]
        n.job.deregister_job(JOB, purge=True)
        fake.wait_for(lambda: driver.running_pids() == [], message="the task to stop")
        assert fake.monitor_errors == []


def test_templates_render_into_the_task_directory_with_their_perms_and_owner() -> None:
    """As a Nomad client: secrets/ and local/ per task (mode 0777, so the task may remove what is
    rendered there), NOMAD_SECRETS_DIR/NOMAD_TASK_DIR naming them and interpolated into the driver
    config, each template written with its Perms and Uid/Gid; a destination outside the task
    directory fails the task."""
    with FakeNomad(driver=NullDriver(), time_scale=0.05) as fake:
        spec = job_spec(count=1)
        task = spec["Job"]["TaskGroups"][0]["Tasks"][0]
        task["User"] = "1000:1000"
        task["Config"]["args"] = ["--token-file=${NOMAD_SECRETS_DIR}/token"]
        task["Templates"] = [
            # owned by the task's own user: in the fake, whose tasks run as its own user, that is ours
            {"EmbeddedTmpl": "s3cret\n", "DestPath": "secrets/token", "Perms": "0400", "Uid": 1000, "Gid": 1000},
            {"EmbeddedTmpl": "plain\n", "DestPath": "local/app.conf"},  # Nomad's defaults: 644, the agent's user
        ]
        httpx.post(f"{fake.address}/v1/jobs", json=spec).raise_for_status()
        [alloc] = fake.wait_running(JOB, 1)
        tdir = Path(fake.data_dir) / "alloc" / alloc["ID"] / "sandbox"
        token, conf = tdir / "secrets" / "token", tdir / "local" / "app.conf"
        assert token.read_text() == "s3cret\n" and conf.read_text() == "plain\n"
        assert oct(token.stat().st_mode & 0o7777) == "0o400" and oct(conf.stat().st_mode & 0o7777) == "0o644"
        assert (token.stat().st_uid, conf.stat().st_uid) == (os.geteuid(), os.geteuid())
        assert oct((tdir / "secrets").stat().st_mode & 0o777) == "0o777"
        handle = fake.cluster.allocs[alloc["ID"]].tasks["sandbox"].handle
        assert handle.env["NOMAD_SECRETS_DIR"] == str(tdir / "secrets") and handle.task_dir == str(tdir)
        assert handle.config["args"] == [f"--token-file={tdir / 'secrets'}/token"]

        escaping = job_spec(count=1, job_id="escape")
        escaping["Job"]["TaskGroups"][0]["Tasks"][0]["Templates"] = [
            {"EmbeddedTmpl": "x", "DestPath": "../../../escaped"}]
        httpx.post(f"{fake.address}/v1/jobs", json=escaping).raise_for_status()

        def template_failed() -> str | None:
            allocs = fake.allocations("escape")
            events = allocs[0]["TaskStates"]["sandbox"]["Events"] if allocs else []
            return next((e["DisplayMessage"] for e in events if e["Type"] == "Template"), None)

        message = fake.wait_for(template_failed, message="the Template event")
        assert message == "Template failed: template destination '../../../escaped' escapes the task directory"
        assert not (Path(fake.data_dir) / "escaped").exists()
        assert fake.monitor_errors == []


def test_template_rendering_subset() -> None:
    from nomad_fake.templates import MissingVariable, TemplateError, parse_env, render

    items = {"nomad/jobs/j": {"token": "x", "user": "u"}}
    text = '{{ with nomadVar "nomad/jobs/j" }}A={{ .token }}\nexport B="{{ .user }}"\n# c\nC={{ .nope }}{{ end }}\n'
    assert parse_env(render(text, items.get)) == {"A": "x", "B": "u", "C": "<no value>"}
    with pytest.raises(MissingVariable) as missing:
        render('{{ with nomadVar "nomad/jobs/other" }}{{ end }}', items.get)
    assert missing.value.path == "nomad/jobs/other"
    for bad in ('{{ range $k, $v := . }}{{ end }}', '{{ with nomadVar "nomad/jobs/j" }}', "{{ end }}"):
        with pytest.raises(TemplateError):
            render(bad, items.get)
