"""The Nomad backend against the stateful Nomad fake (tests/nomad_fake) running REAL sandbox hosts, and
against a real agent when ``NOMAD_ADDR`` is set.

The fake's ProcessDriver starts ``python -m atropos.sandbox`` with the args of the job the backend
registered, on the host port Nomad allocated, with the token from the task's environment; so every
tool call below goes through an address the pool found through the Nomad API.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import json
import os
import re
import secrets
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from conftest import wait_until
from nomad_fake import FakeNomad, NullDriver, ProcessDriver

from atropos.backends.nomad import (
    GROUP,
    META_BOOT,
    META_MANAGED,
    META_OWNER_HOST,
    META_OWNER_PID,
    META_OWNER_START,
    NomadBackend,
    NomadBackendConfig,
    name_index,
    render_job,
)
from atropos.errors import ConfigError, HostUnavailable
from atropos.slots.audit import double_leases
from atropos.slots.config import PoolConfig
from atropos.slots.pool import SlotPool
from tests.pool_backends import kill_host, nomad_host_pid, nomad_test_config, start_nomad_fake

ROOT = Path(__file__).resolve().parent.parent
HCL = ROOT / "nomad" / "sandbox.hcl"
REAL_NOMAD = {k: v for k, v in os.environ.items() if k.startswith("NOMAD_")}  # before the fixture clears them


@pytest.fixture(autouse=True)
def _no_nomad_env(monkeypatch: pytest.MonkeyPatch) -> None:
    # NomadBackendConfig.from_env and python-nomad read NOMAD_ADDR/TOKEN/NAMESPACE/REGION/CACERT/
    # CLIENT_CERT/CLIENT_KEY/SKIP_VERIFY...: none may leak into a test (REAL_NOMAD keeps them).
    for var in [v for v in os.environ if v.startswith("NOMAD_")]:
        monkeypatch.delenv(var, raising=False)


@contextlib.contextmanager
def running_fake(nodes: int) -> Iterator[FakeNomad]:
    """A fake cluster of ``nodes`` nodes for one test, which fails if the fake's monitor saw an error."""
    f = start_nomad_fake(nodes=nodes)
    try:
        yield f
        assert f.monitor_errors == []
    finally:
        f.stop()
        shutil.rmtree(Path(f.driver.log_dir), ignore_errors=True)


@pytest.fixture
def fake() -> Iterator[FakeNomad]:
    with running_fake(nodes=1) as f:
        yield f


@pytest.fixture
def fake2() -> Iterator[FakeNomad]:
    with running_fake(nodes=2) as f:
        yield f


HEALTH_STUB = (
    "import http.server, sys\n"
    "class H(http.server.BaseHTTPRequestHandler):\n"
    "    def do_GET(self):\n"
    "        self.send_response(200); self.send_header('Content-Length', '2'); self.end_headers()\n"
    "        self.wfile.write(b'{}')\n"
    "    def log_message(self, *a): pass\n"
    "http.server.HTTPServer(('127.0.0.1', int(sys.argv[1])), H).serve_forever()\n"
)


@pytest.fixture
def stubbed() -> Iterator[FakeNomad]:
    """A fake whose tasks are tiny health-only HTTP servers on the allocated port (fast to start)."""
    driver = ProcessDriver(lambda a: [sys.executable, "-c", HEALTH_STUB, str(a.ports["http"])], kill_timeout=0.2)
    with FakeNomad(driver=driver, time_scale=0.02) as f:
        yield f
        assert f.monitor_errors == []


@pytest.fixture
def bare() -> Iterator[FakeNomad]:
    """A fake that runs no processes (for registration, reaping and ACL tests)."""
    with FakeNomad(driver=NullDriver(), time_scale=0.02) as f:
        yield f


def pool_cfg(**kw: Any) -> PoolConfig:
    base: dict[str, Any] = {"min_hosts": 1, "max_hosts": 1, "health_interval_s": 0.3, "acquire_timeout_s": 30,
                            "start_retry_s": 0.2, "pool_id": f"n{secrets.token_hex(3)}"}
    base.update(kw)
    return PoolConfig.model_validate(base)


def backend_on(fake: FakeNomad, *, slots: int = 2, **kw: Any) -> NomadBackend:
    return NomadBackend(nomad_test_config(fake.address, slots=slots, start_timeout_s=20, **kw))


@pytest.fixture
async def closing() -> AsyncIterator[list[NomadBackend]]:
    """Backends to close even when a test fails before its pool owns them."""
    made: list[NomadBackend] = []
    yield made
    for b in made:
        await b.close()


def live(fake: FakeNomad, job_id: str) -> list[dict[str, Any]]:
    return [a for a in fake.allocations(job_id) if a["DesiredStatus"] == "run"]


def job_count(fake: FakeNomad, job_id: str) -> int:
    r = httpx.get(f"{fake.address}/v1/job/{job_id}")
    r.raise_for_status()
    return int(next(g["Count"] for g in r.json()["TaskGroups"] if g["Name"] == GROUP))


# ---------------------------------------------------------------------------------------------
# The pool on Nomad: start, lease, run tool calls
# ---------------------------------------------------------------------------------------------


async def test_pool_on_nomad_runs_tool_calls_on_discovered_hosts(fake: FakeNomad) -> None:
    backend = backend_on(fake, slots=2)
    job_id = backend.cfg.job_id
    async with SlotPool(backend, pool_cfg(min_hosts=2, max_hosts=2)) as pool:
        assert len(pool.hosts) == 2
        job = httpx.get(f"{fake.address}/v1/job/{job_id}").json()
        assert job["Meta"][META_OWNER_PID] == str(os.getpid()) and job["Meta"][META_MANAGED] == "true"
        assert job["TaskGroups"][0]["Update"]["MaxParallel"] == 0
        assert job_count(fake, job_id) == 2
        for host in pool.hosts.values():
            # The address is HostIP:port of the allocation's dynamic port (single-alloc read only).
            [port] = fake.allocation(host.id)["AllocatedResources"]["Shared"]["Ports"]
            assert host.info.address == f"http://{port['HostIP']}:{port['Value']}"
            assert host.info.labels["alloc_name"].startswith(f"{job_id}.{GROUP}[")
        leases = await pool.lease_many(["a", "b", "c", "d"])
        assert len({x.key for x in leases}) == 4 and len({x.host.id for x in leases}) == 2
        a = leases[0]
        out = await a.bash("echo hello > f.txt && cat f.txt && pwd")
        assert out["stdout"] == "hello\n/workspace\n"
        assert (await a.read_file("f.txt")) == "hello\n"
        # The host token reached the server but no slot: not in its environment, not in PID 1's.
        token = a.host.info.token
        env = await a.bash("env; cat /proc/1/environ 2>/dev/null | tr '\\0' '\\n'; true")
        assert token not in env["stdout"] and "ATROPOS_SANDBOX_TOKEN" not in env["stdout"]
        for x in leases:
            await x.release()
        assert double_leases(pool.audit.events) == []
    # close() purged the job and Nomad stopped every host process.
    assert httpx.get(f"{fake.address}/v1/job/{job_id}").status_code == 404
    await wait_until(lambda: fake.driver.running_pids() == [], what="host processes to stop")  # type: ignore[attr-defined]


# ---------------------------------------------------------------------------------------------
# Scaling: which allocation goes away
# ---------------------------------------------------------------------------------------------


async def test_stop_host_removes_exactly_that_allocation(stubbed: FakeNomad, closing: list[NomadBackend]) -> None:
    fake = stubbed
    backend = backend_on(fake, slots=1, spare_grace_s=0.3)
    closing.append(backend)
    job_id = backend.cfg.job_id
    hosts = await asyncio.gather(*(backend.start_host() for _ in range(3)))
    assert job_count(fake, job_id) == 3
    by_index = {name_index(h.labels["alloc_name"]): h.id for h in hosts}
    assert sorted(by_index) == [0, 1, 2]
    assert backend.removal_order([h.id for h in hosts]) == [by_index[2], by_index[1], by_index[0]]

    # The highest index: lowering the count stops exactly it, nothing is replaced.
    await backend.stop_host(by_index[2])
    assert job_count(fake, job_id) == 2
    await wait_until(lambda: by_index[2] not in {a["ID"] for a in live(fake, job_id)}, what="[2] stopped")
    assert {a["ID"] for a in live(fake, job_id)} == {by_index[0], by_index[1]}

    # A lower index: Nomad cannot lower the count on it; the allocation is stopped, the pool's
    # other host is untouched, and Nomad's replacement (same name) is a spare.
    await backend.stop_host(by_index[0])
    assert job_count(fake, job_id) == 2 and backend.stats["alloc_stop"] == 1
    spare = await wait_until(lambda: backend.spare_ids(), what="a spare")
    info = fake.allocation(spare[0])
    assert info.get("PreviousAllocation") == by_index[0], (
        f"spare {spare[0]} is not by_index[0]'s replacement: {info.get('Name')} {info.get('ClientStatus')} "
        f"prev={info.get('PreviousAllocation')}; allocs: "
        f"{[(a['ID'][:8], a['Name'], a['DesiredStatus'], a['ClientStatus']) for a in fake.allocations(job_id)]}; "
        f"hosts: {[h[:8] for h in by_index.values()]}")
    assert fake.allocation(by_index[1])["DesiredStatus"] == "run"

    # The next start adopts the spare: no scale call, a fresh host on the same name.
    scale_ups = backend.stats["scale_up"]
    again = await backend.start_host()
    assert again.id == spare[0] and backend.stats["scale_up"] == scale_ups and backend.stats["adopted"] == 1
    async with httpx.AsyncClient(headers={"Authorization": f"Bearer {again.token}"}) as h:
        assert (await h.get(f"{again.address}/v1/health")).status_code == 200

    # Give back in removal order: every stop lowers the count, no spare is left behind.
    for host_id in backend.removal_order([again.id, by_index[1]]):
        await backend.stop_host(host_id)
    assert job_count(fake, job_id) == 0
    await wait_until(lambda: not live(fake, job_id), what="no live allocations")
    assert backend.stats["alloc_stop"] == 1

    # A spare left below a host in use is trimmed once it is on top and its grace ran out.
    a, b = await asyncio.gather(backend.start_host(), backend.start_host())
    low, high = sorted((a, b), key=lambda h: name_index(h.labels["alloc_name"]))
    await backend.stop_host(low.id)  # -> spare on [0] below [1]
    await wait_until(lambda: backend.spare_ids(), what="a spare")
    await backend.stop_host(high.id)  # [1] goes at once, the spare once its grace is over
    await wait_until(lambda: job_count(fake, job_id) == 0 and not live(fake, job_id), what="spare trimmed")


async def test_pool_scales_up_and_down(fake: FakeNomad) -> None:
    backend = backend_on(fake, slots=1, spare_grace_s=60)
    job_id = backend.cfg.job_id
    cfg = pool_cfg(min_hosts=1, max_hosts=3, scale_down_idle_s=0.3)
    async with SlotPool(backend, cfg) as pool:
        assert len(pool.hosts) == 1
        leases = await pool.lease_many(["g0", "g1", "g2"], timeout=30)
        assert len(pool.hosts) == 3 and len({x.host.id for x in leases}) == 3
        assert job_count(fake, job_id) == 3
        outs = await asyncio.gather(*(x.bash(f"echo {x.trajectory_id}") for x in leases))
        assert [o["stdout"] for o in outs] == ["g0\n", "g1\n", "g2\n"]
        first_hosts = set(pool.hosts)
        for x in leases:
            await x.release()
        await wait_until(lambda: len(pool.hosts) == 1, timeout=20, what="scale down to 1 host")
        dropped = first_hosts - set(pool.hosts)

        def settled() -> bool:
            allocs = {a["ID"]: a for a in live(fake, job_id)}
            # Every host the pool dropped is really gone, and what still runs is the pool's host
            # plus spares (replacements nobody uses yet), which the count accounts for exactly.
            return (not dropped & set(allocs) and len(allocs) == job_count(fake, job_id)
                    and set(allocs) == set(pool.hosts) | set(backend.spare_ids()))

        await wait_until(settled, what="dropped hosts stopped")
        # a stopped allocation's process takes a moment to exit (SIGTERM, then the kill timeout)
        await wait_until(lambda: len(fake.driver.running_pids()) == job_count(fake, job_id),  # type: ignore[attr-defined]
                         timeout=20, what="stopped hosts' processes to exit")
        spares = len(backend.spare_ids())

        # Demand again: spares are adopted first (warm, no scale call), then the group scales.
        ups = backend.stats["scale_up"]
        leases = await pool.lease_many(["h0", "h1", "h2"], timeout=30)
        assert len(pool.hosts) == 3
        assert backend.stats["adopted"] >= spares and backend.stats["scale_up"] - ups == 2 - spares
        for x in leases:
            assert (await x.bash("true"))["exit_code"] == 0
            await x.release()
        assert double_leases(pool.audit.events) == []


# ---------------------------------------------------------------------------------------------
# Faults
# ---------------------------------------------------------------------------------------------


async def test_allocation_crash_mid_call_is_an_infrastructure_error_and_replaced(fake: FakeNomad) -> None:
    backend = backend_on(fake, slots=2)
    job_id = backend.cfg.job_id
    async with SlotPool(backend, pool_cfg()) as pool:
        lease = await pool.lease("victim")
        old = lease.host.id
        old_name = lease.host.info.labels["alloc_name"]
        await lease.write_file("mine.txt", "victim's data")
        call = asyncio.create_task(lease.bash("sleep 30"))
        await asyncio.sleep(0.5)
        t0 = time.monotonic()
        kill_host(backend, old)  # SIGKILL the allocation's server, as the OOM killer would
        with pytest.raises(HostUnavailable):
            await call
        assert time.monotonic() - t0 < 5
        with pytest.raises(HostUnavailable):
            await lease.bash("true")
        await lease.release()
        after = await pool.lease("after", timeout=30)
        # Nomad's rescheduled replacement (same name, PreviousAllocation = the crashed one), adopted
        # without a scale call: the backend never lowers the count over a host that merely stopped
        # answering while Nomad still called it running (it gives Nomad SUSPECT_GRACE_S to notice).
        assert after.host.id != old
        new_alloc = fake.allocation(after.host.id)
        assert new_alloc["Name"] == old_name and new_alloc["PreviousAllocation"] == old
        gone = fake.allocation(old)
        assert gone["ClientStatus"] == "failed" and gone["NextAllocation"] == after.host.id
        # No count change for it: the one scale-up is the pool's first host.
        assert job_count(fake, job_id) == 1 and backend.stats["scale_down"] == 0 and backend.stats["scale_up"] == 1
        assert (await after.bash("ls -A | wc -l"))["stdout"].strip() == "0"  # nothing of the victim's
        await after.release()
        assert old not in pool.hosts
        events = [e.event for e in pool.audit.events if e.host == old]
        assert events[0] == "lease" and events[-1] == "release" and set(events) <= {"lease", "lost", "release"}
        assert double_leases(pool.audit.events) == []
        await wait_until(lambda: [a["ID"] for a in live(fake, job_id)] == [after.host.id], what="one live allocation")


async def test_crashed_allocation_is_rescheduled_and_adopted(stubbed: FakeNomad,
                                                            closing: list[NomadBackend]) -> None:
    backend = backend_on(stubbed, slots=1)
    closing.append(backend)
    host = await backend.start_host()
    stubbed.crash_alloc(host.id, exit_code=137, signal=9)

    async def dead() -> None:
        while await backend.alive(host.id):
            await asyncio.sleep(0.02)

    await asyncio.wait_for(dead(), 10)
    # The pool starts a replacement host (maybe before it gives the dead one back): the backend
    # waits for Nomad's rescheduled allocation (new ID, same name) instead of scaling up.
    new = await backend.start_host()
    alloc = stubbed.allocation(new.id)
    assert new.id != host.id and alloc["PreviousAllocation"] == host.id
    assert alloc["Name"] == stubbed.allocation(host.id)["Name"]
    assert backend.stats["scale_up"] == 1 and await backend.alive(new.id)
    await backend.stop_host(host.id)  # the dead one: Nomad already replaced it, nothing to undo
    assert job_count(stubbed, backend.cfg.job_id) == 1
    assert [a["ID"] for a in live(stubbed, backend.cfg.job_id)] == [new.id]


async def test_lost_node_host_is_replaced_on_another_node(fake2: FakeNomad) -> None:
    backend = backend_on(fake2, slots=1)
    async with SlotPool(backend, pool_cfg(min_hosts=2, max_hosts=2)) as pool:
        nodes = {h.id: fake2.allocation(h.id)["NodeID"] for h in pool.hosts.values()}
        assert len(set(nodes.values())) == 2
        lease = await pool.lease("on-lost-node")
        lost_host, lost_node = lease.host.id, nodes[lease.host.id]
        survivor = next(h for h in pool.hosts if h != lost_host)
        fake2.node_down(lost_node)
        assert fake2.allocation(lost_host)["ClientStatus"] == "lost"
        # Nomad says "lost" (the process may even run on behind a partition): the pool drops it.
        await wait_until(lambda: lease.lost is not None, what="the lease on the lost node to be failed")
        with pytest.raises(HostUnavailable):
            await lease.bash("true")
        await lease.release()
        await wait_until(lambda: len(pool.hosts) == 2 and lost_host not in pool.hosts, what="replacement host")
        new = next(h for h in pool.hosts if h != survivor)
        alloc = fake2.allocation(new)
        assert alloc["PreviousAllocation"] == lost_host and alloc["NodeID"] != lost_node
        leases = await pool.lease_many(["x", "y"])
        for x in leases:
            assert (await x.bash("echo ok"))["stdout"] == "ok\n"
            await x.release()
        assert double_leases(pool.audit.events) == []


async def test_scale_refused_during_deployment_is_retried(fake: FakeNomad) -> None:
    backend = backend_on(fake, slots=1)
    async with SlotPool(backend, pool_cfg(min_hosts=1, max_hosts=2)) as pool:
        held = await pool.lease("first")
        fake.start_deployment_blocking(backend.cfg.job_id)
        second = asyncio.create_task(pool.lease("second", timeout=30))
        await wait_until(lambda: backend.stats["scale_blocked"] >= 2, what="refused scale attempts")
        assert not second.done() and len(pool.hosts) == 1
        fake.finish_deployment(backend.cfg.job_id)
        lease = await second
        assert lease.host.id != held.host.id and len(pool.hosts) == 2
        assert (await lease.bash("echo scaled"))["stdout"] == "scaled\n"
        await lease.release()
        await held.release()


async def test_acl_denied_is_a_clear_config_error() -> None:
    with FakeNomad(driver=NullDriver(), time_scale=0.02, acl_enabled=True) as fake:
        for token, expect in ((None, "no ACL token is configured"), ("not-a-token", "was refused"),
                              (fake.create_token(["elsewhere"]), "without the permission")):
            backend = NomadBackend(nomad_test_config(fake.address, slots=1, token=token))
            try:
                with pytest.raises(ConfigError) as err:
                    await SlotPool(backend, pool_cfg()).start()
            finally:
                await backend.close()
            message = str(err.value)
            assert expect in message and "403" in message and "NOMAD_TOKEN" in message
            assert "namespace 'default'" in message and "scale-job" in message
        # With a token that may act in the namespace, the same calls go through.
        ok = NomadBackend(nomad_test_config(fake.address, slots=1, token=fake.create_token(["default"])))
        try:
            assert await ok.reap_orphans() == 0
        finally:
            await ok.close()


async def test_nomad_unreachable_at_start_fails_fast_and_clearly() -> None:
    with socket_closed_port() as port:
        backend = NomadBackend(NomadBackendConfig(address=f"http://127.0.0.1:{port}", token_delivery="job"))
        t0 = time.monotonic()
        try:
            with pytest.raises(HostUnavailable) as err:
                await SlotPool(backend, pool_cfg()).start()
            with pytest.raises(HostUnavailable):
                await backend.start_host()
        finally:
            await backend.close()
        assert time.monotonic() - t0 < 5
        assert f"127.0.0.1:{port}" in str(err.value) and "NOMAD_ADDR" in str(err.value)


async def test_nomad_unreachable_during_a_run(fake: FakeNomad) -> None:
    backend = backend_on(fake, slots=2)
    async with SlotPool(backend, pool_cfg(min_hosts=1, max_hosts=2)) as pool:
        a = await pool.lease("a")
        await asyncio.to_thread(fake.set_unreachable, True)
        try:
            # Known hosts keep working: calls, and leases of their free slots.
            assert (await a.bash("echo still"))["stdout"] == "still\n"
            b = await pool.lease("b", timeout=5)
            assert (await b.bash("echo too"))["stdout"] == "too\n"
            await asyncio.sleep(1.0)  # a few health rounds: nobody is declared dead
            assert pool.status().lost_hosts == 0 and len(pool.hosts) == 1
            assert backend.nomad_reachable is False
            await b.release()
            # More demand than slots: scaling waits for Nomad.
            more = asyncio.create_task(pool.lease_many(["c", "d"], timeout=30))
            await asyncio.sleep(1.0)
            assert not more.done()
        finally:
            await asyncio.to_thread(fake.set_unreachable, False)
        leases = await more
        assert len(pool.hosts) == 2
        for x in [*leases, a]:
            assert (await x.bash("true"))["exit_code"] == 0
            await x.release()
        assert double_leases(pool.audit.events) == []


# ---------------------------------------------------------------------------------------------
# Token delivery through a Nomad variable (the default), TLS + region + namespace + ACL
# ---------------------------------------------------------------------------------------------

SLOT_ENV_PROBE = ("env; echo ---; cat /proc/1/environ 2>/dev/null | tr '\\0' '\\n'; echo ---; "
                  "cat /proc/*/environ 2>/dev/null | tr '\\0' '\\n'; true")


async def assert_token_never_in_a_slot(lease: Any) -> None:
    token = lease.host.info.token
    out = await lease.bash(SLOT_ENV_PROBE)
    assert out["exit_code"] == 0 and "---" in out["stdout"]
    assert token not in out["stdout"] and "ATROPOS_SANDBOX_TOKEN" not in out["stdout"]
    assert token not in out["stderr"]


def host_environ_and_cmdline(alloc_id: str) -> bytes:
    """What any process of the host's uid can read of it: its environment block and command line."""
    pid = nomad_host_pid(alloc_id)
    assert pid is not None, f"no sandbox host process for allocation {alloc_id}"
    return Path(f"/proc/{pid}/environ").read_bytes() + b"\0" + Path(f"/proc/{pid}/cmdline").read_bytes()


async def test_pool_with_the_token_in_a_nomad_variable(fake: FakeNomad) -> None:
    """The default delivery end to end: the variable nomad/jobs/<job>, a template renders it into the
    task's secrets/token (0400, the task's uid), the host reads that file with --token-file and removes
    it; the token is in no environment block or command line, the host answers only with it, and no
    slot ever sees it."""
    backend = backend_on(fake, slots=2)
    assert backend.cfg.token_delivery == "variable"  # the default
    job_id = backend.cfg.job_id
    async with SlotPool(backend, pool_cfg()) as pool:
        job = httpx.get(f"{fake.address}/v1/job/{job_id}").json()
        task = job["TaskGroups"][0]["Tasks"][0]
        lease = await pool.lease("t")
        token = lease.host.info.token
        assert token not in json.dumps(job)  # not in the job: readable by every ACL token that can read it
        [tmpl] = task["Templates"]
        assert f'nomadVar "nomad/jobs/{job_id}"' in tmpl["EmbeddedTmpl"] and not tmpl.get("Envvars")
        # readable by the task's user alone (Nomad writes templates as its agent's user unless told)
        assert (tmpl["DestPath"], tmpl["Perms"]) == ("secrets/token", "0400")
        assert f"{tmpl['Uid']}:{tmpl['Gid']}" == task["User"]
        assert "--token-file=${NOMAD_SECRETS_DIR}/token" in task["Config"]["args"]
        variable = fake.variable(f"nomad/jobs/{job_id}")
        assert variable is not None and variable["Items"] == {"token": token}

        # The host took that token: it serves with it, and refuses without it or with another.
        assert (await lease.bash("echo via-variable"))["stdout"] == "via-variable\n"
        async with httpx.AsyncClient(base_url=lease.host.info.address) as h:
            assert (await h.get("/v1/health", headers={"Authorization": f"Bearer {token}"})).status_code == 200
            assert (await h.get("/v1/health")).status_code == 401
            assert (await h.get("/v1/health", headers={"Authorization": "Bearer x" + token})).status_code == 401
        # Not in the host's environment (/proc/<pid>/environ: any process of its uid reads it), nor argv.
        seen = host_environ_and_cmdline(lease.host.id)
        assert token.encode() not in seen and b"ATROPOS_SANDBOX_TOKEN" not in seen
        # The file was read once and removed: code that later reaches the task's filesystem finds nothing.
        secrets_dir = Path(fake.data_dir) / "alloc" / lease.host.id / "host" / "secrets"
        assert secrets_dir.is_dir() and list(secrets_dir.iterdir()) == []
        await assert_token_never_in_a_slot(lease)
        await lease.release()
    assert fake.variable(f"nomad/jobs/{job_id}") is None  # close() removes it with the job


async def test_a_process_beside_a_nomad_host_cannot_find_the_host_token(fake: FakeNomad) -> None:
    """A process of the host's uid that is no part of the pool (tests/token_theft.py) scans every
    /proc/*/environ and cmdline, the client's task directories and the hosts' data dirs, and calls the
    host API with every token-shaped string it found: none is accepted."""
    async with SlotPool(backend_on(fake, slots=1), pool_cfg()) as pool:
        host = next(iter(pool.hosts.values()))
        roots = [fake.data_dir, fake.driver.log_dir]  # type: ignore[attr-defined]
        thief = await asyncio.to_thread(
            subprocess.run, [sys.executable, "-m", "tests.token_theft", host.info.address, *roots],
            capture_output=True, text=True, timeout=300, cwd=ROOT, env={})
        report = json.loads(thief.stdout)
        assert report["read"]["environ"] > 0 and report["read"]["files"] > 0, report["read"]
        assert report["accepted"] == [] and host.info.token not in report["candidates"], report["accepted"]
        async with pool.leased("still-serves") as lease:
            assert (await lease.bash("echo ok"))["stdout"] == "ok\n"


async def test_token_in_the_job_spec_reaches_the_host_as_a_file_too(fake: FakeNomad) -> None:
    """token_delivery="job" (the weaker choice, for job IDs no variable path takes): the token is in
    the job spec, but the host still gets it as its 0400 file, never in its environment; "env", the
    old name, means the same and says so."""
    with pytest.warns(FutureWarning, match="token_delivery='env' is deprecated, use 'job'"):
        assert NomadBackendConfig(token_delivery="env").token_delivery == "job"
    backend = backend_on(fake, slots=1, token_delivery="job", job_id=f"atropos-t.{secrets.token_hex(3)}")
    async with SlotPool(backend, pool_cfg()) as pool:
        lease = await pool.lease("t")
        token = lease.host.info.token
        task = httpx.get(f"{fake.address}/v1/job/{backend.cfg.job_id}").json()["TaskGroups"][0]["Tasks"][0]
        assert not task.get("Env") and task["Templates"][0]["EmbeddedTmpl"] == f"{token}\n"
        assert (await lease.bash("echo via-job"))["stdout"] == "via-job\n"
        seen = host_environ_and_cmdline(lease.host.id)
        assert token.encode() not in seen and b"ATROPOS_SANDBOX_TOKEN" not in seen
        await lease.release()


async def test_a_token_file_others_can_read_is_refused_at_start(fake: FakeNomad) -> None:
    """A template rendered 0644 (a job edited by hand, say): the host refuses to start, says why in
    its log, and never serves."""
    cfg = nomad_test_config(fake.address, slots=1, token_delivery="job")
    job = render_job(cfg, 1, token="t0ken-" + secrets.token_hex(8))
    job["TaskGroups"][0]["Tasks"][0]["Templates"][0]["Perms"] = "0644"
    _register(fake, job)
    try:
        def failed() -> dict[str, Any] | None:
            return next((a for a in fake.allocations(cfg.job_id) if a["ClientStatus"] == "failed"), None)

        alloc = fake.wait_for(failed, timeout=60, message="the allocation to fail")
        _out, err = fake.driver.log_paths(alloc["ID"], "host")  # type: ignore[attr-defined]
        log = Path(err).read_text()
        assert re.search(r"error: --token-file \S+/secrets/token: mode 0644 gives group or others access; "
                         r"a token file must be 0400 or 0600", log), log
        assert "ready" not in Path(_out).read_text()  # it never announced itself
    finally:
        httpx.delete(f"{fake.address}/v1/job/{cfg.job_id}", params={"purge": "true"})


def make_tls(tmp: Path) -> tuple[str, str, str]:
    """A throwaway CA and a server certificate for 127.0.0.1/localhost: (ca, cert, key) paths."""
    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed: cannot make the test CA for the TLS test")
    ca_key, ca, key, csr, cert, ext = (str(tmp / n) for n in ("ca.key", "ca.pem", "srv.key", "srv.csr", "srv.pem",
                                                               "srv.ext"))
    Path(ext).write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\nbasicConstraints=critical,CA:FALSE\n"
                         "keyUsage=critical,digitalSignature,keyEncipherment\nextendedKeyUsage=serverAuth\n"
                         "subjectKeyIdentifier=hash\nauthorityKeyIdentifier=keyid,issuer\n")
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    for argv in (["req", "-x509", *ec, "-keyout", ca_key, "-out", ca, "-days", "2", "-subj", "/CN=atropos test CA",
                  "-addext", "basicConstraints=critical,CA:TRUE", "-addext", "keyUsage=critical,keyCertSign,cRLSign"],
                 ["req", *ec, "-keyout", key, "-out", csr, "-subj", "/CN=localhost"],
                 ["x509", "-req", "-in", csr, "-CA", ca, "-CAkey", ca_key, "-CAcreateserial", "-out", cert,
                  "-days", "2", "-extfile", ext]):
        subprocess.run(["openssl", *argv], check=True, capture_output=True, timeout=60)
    return ca, cert, key


async def test_pool_over_tls_with_region_namespace_and_acl_token(tmp_path: Path) -> None:
    from tests.pool_backends import nomad_data_dir, sandbox_host_argv

    ca, cert, key = make_tls(tmp_path)
    data = nomad_data_dir(secrets.token_hex(4))
    driver = ProcessDriver(sandbox_host_argv(data), log_dir=str(data), kill_timeout=0.5)
    with FakeNomad(driver=driver, time_scale=0.02, tls=(cert, key), region="eu-west", acl_enabled=True) as fake:
        assert fake.address.startswith("https://127.0.0.1:")
        fake.add_namespace("sandboxes")
        token = fake.create_token(["sandboxes"])  # may act in that namespace only
        settings = {"ca_cert": ca, "region": "eu-west", "namespace": "sandboxes", "token": token,
                    "token_delivery": "variable"}

        # Without the CA the agent's certificate is refused, and the error says so.
        untrusting = NomadBackend(nomad_test_config(fake.address, slots=1, **{**settings, "ca_cert": None}))
        with pytest.raises(HostUnavailable, match="CERTIFICATE_VERIFY_FAILED"):
            await untrusting.start_host()
        await untrusting.close()
        # A region the agent has no path to is a configuration error, not an outage.
        elsewhere = NomadBackend(nomad_test_config(fake.address, slots=1, **{**settings, "region": "mars"}))
        with pytest.raises(ConfigError, match="no path to region 'mars'"):
            await elsewhere.start_host()
        await elsewhere.close()

        t0 = time.monotonic()
        backend = NomadBackend(nomad_test_config(fake.address, slots=2, **settings))
        job_id = backend.cfg.job_id
        async with SlotPool(backend, pool_cfg()) as pool:
            lease = await pool.lease("tls")
            assert (await lease.bash("echo over-tls"))["stdout"] == "over-tls\n"
            await assert_token_never_in_a_slot(lease)
            # Every request the backend sent carried the region, the namespace and the ACL token.
            sent = fake.requests(since=t0)
            assert sent and all(r.query.get("region") == "eu-west" and r.query.get("namespace") == "sandboxes"
                                and r.token == token for r in sent), [(r.method, r.path, r.query) for r in sent]
            admin = {"X-Nomad-Token": fake.management_token or ""}
            async with httpx.AsyncClient(verify=ssl_context(ca), headers=admin) as h:
                job = (await h.get(f"{fake.address}/v1/job/{job_id}", params={"namespace": "sandboxes",
                                                                               "region": "eu-west"})).json()
            assert (job["Namespace"], job["Region"]) == ("sandboxes", "eu-west")
            # The template read the variable of the job's namespace (workload identity: its own path only).
            variable = fake.variable(f"nomad/jobs/{job_id}", namespace="sandboxes")
            assert variable is not None and variable["Items"]["token"] == lease.host.info.token
            assert fake.variable(f"nomad/jobs/{job_id}") is None  # nothing in "default"
            await lease.release()
            assert double_leases(pool.audit.events) == []
    shutil.rmtree(data, ignore_errors=True)


def ssl_context(ca: str) -> Any:
    import ssl

    return ssl.create_default_context(cafile=ca)


def test_variable_delivery_needs_a_job_id_nomad_accepts_as_a_variable_path() -> None:
    with pytest.raises(ValueError, match="cannot name the Nomad variable"):
        NomadBackendConfig(job_id="sandbox.v2")  # "." is legal in a job ID, not in a variable path
    assert NomadBackendConfig(job_id="sandbox.v2", token_delivery="job").job_id == "sandbox.v2"


# ---------------------------------------------------------------------------------------------
# Blocking queries, not polling; error paths
# ---------------------------------------------------------------------------------------------


async def test_idle_backend_follows_allocations_with_blocking_queries(stubbed: FakeNomad,
                                                                      closing: list[NomadBackend]) -> None:
    backend = backend_on(stubbed, slots=1)
    closing.append(backend)
    host = await backend.start_host()
    await asyncio.sleep(0.5)  # let the watch settle on the last index
    t0 = time.monotonic()
    await asyncio.sleep(2.0)
    path = f"/v1/job/{backend.cfg.job_id}/allocations"
    watch = stubbed.requests(path, method="GET", since=t0)
    # A blocking query (index + wait) parks at Nomad until something changes: at most the one that
    # was in flight and its successor, where a poller would have sent dozens.
    assert len(watch) <= 2, [(r.time - t0, r.query) for r in watch]
    assert all(r.blocking and r.query.get("wait") for r in watch)
    assert len(stubbed.requests(since=t0)) <= 3
    assert await backend.alive(host.id)
    # ... and it still sees a change at once: the crash wakes the parked query.
    stubbed.crash_alloc(host.id, exit_code=137, signal=9)
    t1 = time.monotonic()
    while await backend.alive(host.id):
        assert time.monotonic() - t1 < 3, "the watch did not notice the crash"
        await asyncio.sleep(0.02)


async def test_driver_failure_fails_start_host_naming_it(stubbed: FakeNomad, closing: list[NomadBackend]) -> None:
    message = "Docker privileged mode is disabled on this Nomad agent"
    stubbed.fail_driver(next_n=50, message=message)
    backend = backend_on(stubbed, slots=1)
    closing.append(backend)
    t0 = time.monotonic()
    with pytest.raises(HostUnavailable) as err:
        await backend.start_host()
    assert time.monotonic() - t0 < 10  # at once, not after start_timeout_s (20 s)
    assert f"Driver Failure: {message}" in str(err.value) and "nomad/client.hcl" in str(err.value)
    # Once the driver works again, a start gets a host, as the pool's retries would (a replacement
    # that already failed before the fix still fails the start it is handed to).
    with stubbed.cluster.lock:
        stubbed.cluster.driver_failures.clear()
    for _attempt in range(5):
        try:
            host = await backend.start_host()
            break
        except HostUnavailable as exc:
            assert "Driver Failure" in str(exc)
    else:
        raise AssertionError("no host after the driver was fixed")
    assert await backend.alive(host.id)


async def test_bad_job_spec_500_is_a_config_error(bare: FakeNomad) -> None:
    body = "1 error occurred:\n\t* Task group hosts validation failed: 1 error occurred:\n\t* Missing tasks\n\n"
    bare.http_errors("/v1/jobs", 500, count=1, body=body, method="POST")
    backend = NomadBackend(nomad_test_config(bare.address, slots=1))
    try:
        with pytest.raises(ConfigError) as err:
            await backend.start_host()
    finally:
        await backend.close()
    assert "Nomad rejected the sandbox job" in str(err.value) and "Missing tasks" in str(err.value)

    nowhere = NomadBackend(nomad_test_config(bare.address, slots=1, namespace="no-such-ns"))
    try:
        with pytest.raises(ConfigError, match="no namespace 'no-such-ns'"):
            await nowhere.start_host()
    finally:
        await nowhere.close()


async def test_no_room_on_any_node_says_nomad_could_not_place_it() -> None:
    driver = ProcessDriver(lambda a: [sys.executable, "-c", HEALTH_STUB, str(a.ports["http"])], kill_timeout=0.2)
    with FakeNomad(driver=driver, time_scale=0.02, max_allocs_per_node=1) as fake:
        backend = NomadBackend(nomad_test_config(fake.address, slots=1, start_timeout_s=2))
        try:
            first = await backend.start_host()
            t0 = time.monotonic()
            with pytest.raises(HostUnavailable) as err:
                await backend.start_host()
            assert time.monotonic() - t0 < 6
            assert "Nomad could not place it" in str(err.value) and "NodesExhausted=1" in str(err.value)
            # The placement nobody waits for any more is cancelled: the count is back to the one host.
            await wait_until(lambda: job_count(fake, backend.cfg.job_id) == 1, what="the count to come back down")
            assert await backend.alive(first.id)
        finally:
            await backend.close()
        assert fake.monitor_errors == []


async def test_a_500_on_the_watch_is_retried(stubbed: FakeNomad, closing: list[NomadBackend]) -> None:
    backend = backend_on(stubbed, slots=1)
    closing.append(backend)
    host = await backend.start_host()
    path = f"/v1/job/{backend.cfg.job_id}/allocations"
    rule = stubbed.http_errors(path, 500, count=3, method="GET", blocking=True, body="rpc error: No cluster leader")
    stubbed.crash_alloc(host.id, exit_code=137, signal=9)  # wakes the parked query; the next ones fail

    def replaced() -> bool:
        allocs = backend.allocations()
        old = next((a for a in allocs if a["ID"] == host.id), None)
        new = [a for a in allocs if a["ID"] != host.id and a["ClientStatus"] == "running"]
        return old is not None and old["ClientStatus"] == "failed" and len(new) == 1

    # All three 500s are hit (each one resets the watch to a plain read, then it blocks again), and
    # the cache still ends up with the crash and Nomad's replacement.
    await wait_until(lambda: rule.remaining == 0 and replaced(), timeout=15,
                     what="the watch to get past the 500s and see the crash and the replacement")
    assert not await backend.alive(host.id)
    await asyncio.sleep(1.0)  # the plain read after the last 500's backoff
    t0 = time.monotonic()
    await asyncio.sleep(1.0)
    after = stubbed.requests(path, method="GET", since=t0)
    assert len(after) <= 2 and all(r.blocking for r in after)  # back to parked blocking queries


async def test_nomad_that_never_answers_fails_start_within_the_request_timeout() -> None:
    with socket.socket() as silent:  # accepts connections (the kernel's backlog), never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen(16)
        address = f"http://127.0.0.1:{silent.getsockname()[1]}"
        backend = NomadBackend(NomadBackendConfig(address=address, token_delivery="job", request_timeout_s=1,
                                                  connect_timeout_s=1))
        t0 = time.monotonic()
        try:
            with pytest.raises(HostUnavailable) as err:
                await SlotPool(backend, pool_cfg()).start()
        finally:
            await backend.close()
        assert time.monotonic() - t0 < 4
    message = str(err.value)
    assert address in message and "did not answer" in message and "within 1s" in message


# ---------------------------------------------------------------------------------------------
# Registration, ownership and reaping
# ---------------------------------------------------------------------------------------------


def _register(fake: FakeNomad, job: dict[str, Any]) -> None:
    r = httpx.post(f"{fake.address}/v1/jobs", json={"Job": job})
    assert r.status_code == 200, r.text


async def test_reap_orphans_only_when_the_owner_is_gone(bare: FakeNomad) -> None:
    cfg = nomad_test_config(bare.address, slots=1)
    mine = NomadBackend(cfg)
    dead = subprocess.Popen(["true"])
    dead.wait()
    owner = mine.owner_meta()
    cases: list[tuple[dict[str, str] | None, str | None]] = [
        ({**owner, "atropos_instance": "x", META_OWNER_PID: str(dead.pid)}, None),  # owner gone: reaped
        ({**owner, "atropos_instance": "x", META_OWNER_START: "1"}, None),  # our pid, reused: reaped
        ({**owner, "atropos_instance": "x", META_BOOT: "another-boot"}, None),  # rebooted since: reaped
        ({**owner, "atropos_instance": "x"}, "belongs to a running pool"),
        ({**owner, "atropos_instance": "x", META_OWNER_HOST: "elsewhere"}, "nomad job stop -purge"),
        (None, "was not registered by atropos-sandbox"),
    ]
    try:
        for meta, refusal in cases:
            _register(bare, render_job(cfg, 1, token="t", meta=meta))
            backend = NomadBackend(cfg)
            try:
                if refusal is None:
                    assert await backend.reap_orphans() == 1
                    assert httpx.get(f"{bare.address}/v1/job/{cfg.job_id}").status_code == 404
                else:
                    with pytest.raises(ConfigError, match=re.escape(refusal)):
                        await backend.reap_orphans()
                    httpx.delete(f"{bare.address}/v1/job/{cfg.job_id}", params={"purge": "true"})
            finally:
                await backend.close()
    finally:
        await mine.close()


async def test_default_token_delivery_needs_the_variables_api(bare: FakeNomad) -> None:
    # A Nomad older than 1.4 has no /v1/var/: Go's mux answers 404 "404 page not found".
    bare.http_errors("/v1/var/", 404, count=5, body="404 page not found\n")
    backend = NomadBackend(NomadBackendConfig(address=bare.address, job_id="needs-vars"))
    try:
        with pytest.raises(ConfigError, match="variables API"):
            await backend.start_host()
    finally:
        await backend.close()
    # The job registered first (EnforceIndex claims the ID) is purged again: no token, no host.
    assert httpx.get(f"{bare.address}/v1/job/needs-vars").status_code == 404


async def test_registered_job_keeps_the_container_options(bare: FakeNomad) -> None:
    backend = NomadBackend(nomad_test_config(bare.address, slots=3))
    try:
        await backend._ensure_ready()
        job = httpx.get(f"{bare.address}/v1/job/{backend.cfg.job_id}").json()
    finally:
        await backend.close()
    task = job["TaskGroups"][0]["Tasks"][0]
    sent = backend.render_job()["TaskGroups"][0]["Tasks"][0]
    assert task["Config"] == sent["Config"]  # Nomad stores the driver config untouched
    assert task["User"] == "1000:1000" and not task.get("Env") and task["Templates"] == sent["Templates"]
    assert job["TaskGroups"][0]["Count"] == 0 and job["Meta"] == backend.owner_meta()


def test_config_from_env() -> None:
    env = {"NOMAD_ADDR": "https://n:4646", "NOMAD_TOKEN": "s3cr3t-acl", "NOMAD_NAMESPACE": "ns",
           "NOMAD_SKIP_VERIFY": "1", "ATROPOS_NOMAD_DATACENTERS": "a, b", "ATROPOS_NOMAD_SLOTS_PER_HOST": "8"}
    cfg = NomadBackendConfig.from_env(env, job_id="j")
    assert (cfg.address, cfg.token, cfg.namespace, cfg.verify) == ("https://n:4646", "s3cr3t-acl", "ns", False)
    assert cfg.datacenters == ["a", "b"] and cfg.slots_per_host == 8 and cfg.job_id == "j"
    assert "s3cr3t-acl" not in repr(cfg)


# ---------------------------------------------------------------------------------------------
# nomad/sandbox.hcl == what the backend registers
# ---------------------------------------------------------------------------------------------

_DURATION = re.compile(r"(\d+(?:\.\d+)?)(ns|us|µs|ms|s|m|h)")
_UNIT_NS = {"ns": 1, "us": 1_000, "µs": 1_000, "ms": 1_000_000, "s": 10**9, "m": 60 * 10**9, "h": 3600 * 10**9}
_VAR = re.compile(r"\$\{var\.([A-Za-z_][A-Za-z0-9_]*)\}")
# Keys of the docker driver's task config (drivers/docker/config.go taskConfigSpec): Nomad does not
# validate them at submission, a misspelt key only fails on the client.
DOCKER_CONFIG_KEYS = {
    "image", "advertise_ipv6_address", "args", "auth", "auth_soft_fail", "cap_add", "cap_drop", "command",
    "cpuset_cpus", "cpu_hard_limit", "cpu_cfs_period", "devices", "dns_search_domains", "dns_options",
    "dns_servers", "entrypoint", "extra_hosts", "force_pull", "group_add", "healthchecks", "hostname", "init",
    "interactive", "ipc_mode", "ipv4_address", "ipv6_address", "isolation", "labels", "load", "logging",
    "mac_address", "memory_hard_limit", "mount", "mounts", "network_aliases", "network_mode", "runtime",
    "pids_limit", "pid_mode", "ports", "port_map", "privileged", "image_pull_timeout", "readonly_rootfs",
    "security_opt", "shm_size", "storage_opt", "sysctl", "tty", "ulimit", "uts_mode", "userns_mode", "volumes",
    "volume_driver", "work_dir", "cgroupns", "oom_score_adj",
}


def _duration(text: str) -> int:
    parts = _DURATION.findall(text)
    assert parts and "".join(n + u for n, u in parts) == text, f"not a Go duration: {text!r}"
    return int(sum(float(n) * _UNIT_NS[u] for n, u in parts))


def _unescape(text: str) -> str:
    """The $${ / %%{ template escapes (python-hcl2 8 decodes \\" and \\n itself but keeps these)."""
    return text.replace("$${", "${").replace("%%{", "%{")


def _resolve(value: Any, variables: dict[str, Any]) -> Any:
    if isinstance(value, dict):
        return {k: _resolve(v, variables) for k, v in value.items()}
    if isinstance(value, list):
        return [_resolve(v, variables) for v in value]
    if isinstance(value, str):
        whole = _VAR.fullmatch(value)
        if whole:
            return variables[whole.group(1)]
        return _unescape(_VAR.sub(lambda m: f"{variables[m.group(1)]:g}" if isinstance(variables[m.group(1)], float)
                                  else str(variables[m.group(1)]), value))
    return value


def _take(block: dict[str, Any], mapping: dict[str, tuple[str, Any]]) -> dict[str, Any]:
    """Map HCL keys to API fields; an HCL key the mapping does not know fails the test (so a new
    setting in sandbox.hcl cannot silently go missing from the comparison)."""
    unknown = set(block) - set(mapping)
    assert not unknown, f"sandbox.hcl keys not mapped to the API by this test: {sorted(unknown)}"
    return {field: conv(block[key]) for key, (field, conv) in mapping.items() if key in block}


def _ident(v: Any) -> Any:
    return v


def _one(blocks: list[dict[str, Any]]) -> dict[str, Any]:
    assert len(blocks) == 1
    return blocks[0]


def hcl_to_api(path: Path, overrides: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """A jobspec2 stand-in for the constructs sandbox.hcl uses: returns (job JSON, variable defaults)."""
    import hcl2
    from hcl2 import SerializationOptions

    opts = SerializationOptions(strip_string_quotes=True, explicit_blocks=False, with_comments=False)
    with open(path) as fh:
        doc = hcl2.load(fh, serialization_options=opts)
    defaults = {name: body["default"] for block in doc["variable"] for name, body in block.items()}
    doc = _resolve({k: v for k, v in doc.items() if k != "variable"}, {**defaults, **overrides})
    [(job_id, job)] = _one(doc["job"]).items()

    def port(block: dict[str, Any]) -> dict[str, Any]:
        [(label, body)] = block.items()
        return {"Label": label, **_take(body, {"to": ("To", _ident)})}

    def network(b: dict[str, Any]) -> dict[str, Any]:
        return _take(b, {"mode": ("Mode", _ident), "port": ("DynamicPorts", lambda ps: [port(p) for p in ps])})

    def template(b: dict[str, Any]) -> dict[str, Any]:
        return _take(b, {"data": ("EmbeddedTmpl", _ident), "destination": ("DestPath", _ident),
                         "env": ("Envvars", _ident), "change_mode": ("ChangeMode", _ident),
                         "perms": ("Perms", _ident), "uid": ("Uid", _ident), "gid": ("Gid", _ident)})

    def task(block: dict[str, Any]) -> dict[str, Any]:
        [(name, t)] = block.items()
        return {"Name": name, **_take(t, {
            "driver": ("Driver", _ident), "user": ("User", _ident), "config": ("Config", _one),
            "env": ("Env", _one), "template": ("Templates", lambda ts: [template(x) for x in ts]),
            "resources": ("Resources", lambda r: _take(_one(r), {"cpu": ("CPU", _ident),
                                                                  "memory": ("MemoryMB", _ident)})),
            "kill_timeout": ("KillTimeout", _duration),
        })}

    def group(block: dict[str, Any]) -> dict[str, Any]:
        [(name, g)] = block.items()
        return {"Name": name, **_take(g, {
            "count": ("Count", _ident),
            "update": ("Update", lambda u: _take(_one(u), {"max_parallel": ("MaxParallel", _ident)})),
            "network": ("Networks", lambda ns: [network(n) for n in ns]),
            "restart": ("RestartPolicy", lambda r: _take(_one(r), {
                "attempts": ("Attempts", _ident), "interval": ("Interval", _duration),
                "delay": ("Delay", _duration), "mode": ("Mode", _ident)})),
            "reschedule": ("ReschedulePolicy", lambda r: _take(_one(r), {
                "delay": ("Delay", _duration), "delay_function": ("DelayFunction", _ident),
                "max_delay": ("MaxDelay", _duration), "unlimited": ("Unlimited", _ident)})),
            "task": ("Tasks", lambda ts: [task(x) for x in ts]),
        })}

    def constraint(c: dict[str, Any]) -> dict[str, Any]:
        out = _take(c, {"attribute": ("LTarget", _ident), "value": ("RTarget", _ident),
                        "operator": ("Operand", _ident)})
        out.setdefault("Operand", "=")
        return out

    api = {"ID": job_id, "Name": job_id, **_take(job, {
        "type": ("Type", _ident), "datacenters": ("Datacenters", _ident),
        "constraint": ("Constraints", lambda cs: [constraint(c) for c in cs]),
        "group": ("TaskGroups", lambda gs: [group(g) for g in gs]),
    })}
    return api, defaults


def test_an_image_volume_holds_the_task_image_store() -> None:
    """With ``image_volume`` the group asks for that Nomad host volume and the host keeps its
    task-image layer store there (docs/task-images.md); without it the job asks for no volume (a
    client without one must still place it): the job nomad/sandbox.hcl renders is unchanged."""
    plain = NomadBackend(NomadBackendConfig()).render_job()
    assert "Volumes" not in plain["TaskGroups"][0] and "VolumeMounts" not in plain["TaskGroups"][0]["Tasks"][0]
    assert not any("--image-store" in a for a in plain["TaskGroups"][0]["Tasks"][0]["Config"]["args"])
    job = NomadBackend(NomadBackendConfig(image_volume="atropos-images")).render_job()
    group = job["TaskGroups"][0]
    assert group["Volumes"] == {"images": {"Name": "images", "Type": "host", "Source": "atropos-images",
                                           "ReadOnly": False}}
    mounts = group["Tasks"][0]["VolumeMounts"]
    assert mounts == [{"Volume": "images", "Destination": "/images", "ReadOnly": False}]
    assert "--image-store=/images" in group["Tasks"][0]["Config"]["args"]


def test_sandbox_hcl_is_the_job_the_backend_registers() -> None:
    cfg = NomadBackendConfig(image="registry.example/atropos-sandbox:1.2", slots_per_host=24, cpu=3000,
                             memory=6144, workspace_bytes=3 << 30, max_timeout_s=900, datacenters=["dc1", "dc2"])
    backend = NomadBackend(cfg)
    registered = backend.render_job(count=0)
    overrides = {"image": cfg.image, "host_count": 0, "slots_per_host": cfg.slots_per_host, "cpu": cfg.cpu,
                 "memory": cfg.memory, "workspace_bytes": cfg.workspace_bytes, "pids_limit": cfg.pids_limit,
                 "slot_workspace_bytes": cfg.slot_workspace_bytes, "slot_memory_bytes": cfg.slot_memory_bytes,
                 "slot_pids": cfg.slot_pids, "slot_cpus": cfg.slot_cpus,
                 "max_timeout_s": cfg.max_timeout_s, "datacenters": cfg.datacenters,
                 "seccomp_profile": cfg.seccomp_profile, "runtime": cfg.runtime}
    from_hcl, defaults = hcl_to_api(HCL, overrides)
    # Normalising: Meta is the owner record (pid, boot id) and Namespace comes from -namespace.
    expected = {k: v for k, v in registered.items() if k not in ("Meta", "Namespace")}
    assert from_hcl == expected
    assert registered["Meta"][META_MANAGED] == "true"

    # The HCL's defaults are the backend's defaults (one source of truth for both ways of running).
    d = NomadBackendConfig()
    assert defaults == {"image": d.image, "host_count": 1, "slots_per_host": d.slots_per_host, "cpu": d.cpu,
                        "memory": d.memory, "workspace_bytes": d.workspace_bytes, "pids_limit": d.pids_limit,
                        "slot_workspace_bytes": d.slot_workspace_bytes, "slot_memory_bytes": d.slot_memory_bytes,
                        "slot_pids": d.slot_pids, "slot_cpus": d.slot_cpus,
                        "max_timeout_s": d.max_timeout_s, "datacenters": d.datacenters,
                        "seccomp_profile": d.seccomp_profile, "runtime": d.runtime}
    plain, _ = hcl_to_api(HCL, {"host_count": 0})
    assert plain == {k: v for k, v in NomadBackend().render_job().items() if k not in ("Meta", "Namespace")}

    # Static checks Nomad itself does not do before a client tries to start the task.
    task_config = registered["TaskGroups"][0]["Tasks"][0]["Config"]
    assert set(task_config) <= DOCKER_CONFIG_KEYS
    assert "systempaths=unconfined" not in task_config["security_opt"]  # the Engine API rejects it
    assert {"no-new-privileges", f"seccomp={cfg.seccomp_profile}"} <= set(task_config["security_opt"])
    assert task_config["cap_drop"] == ["ALL"] and task_config.get("privileged") is not True
    # resources.cpu alone is a share; the docker driver's cpu_hard_limit makes it a CFS quota.
    assert task_config["cpu_hard_limit"] is True and registered["TaskGroups"][0]["Tasks"][0]["Resources"]["CPU"]
    assert all(m["tmpfs_options"][0]["mode"] == 0o1777 for m in task_config["mount"])
    assert registered["TaskGroups"][0]["Networks"][0]["DynamicPorts"][0]["Label"] in task_config["ports"]


def test_runtime_wrapper_unmasks_proc_only_for_unprivileged_containers(tmp_path: Path) -> None:
    if shutil.which("jq") is None:
        pytest.skip("jq is not installed (nomad/atropos-runc needs it)")
    stub = tmp_path / "runc"
    stub.write_text("#!/bin/sh\necho \"runc $*\"\n")
    stub.chmod(0o755)
    bundle = tmp_path / "bundle"
    bundle.mkdir()
    config = bundle / "config.json"

    def run(process: dict[str, Any], *args: str) -> subprocess.CompletedProcess[str]:
        config.write_text(json.dumps({"process": process, "linux": {"maskedPaths": ["/proc/kcore"],
                                                                    "readonlyPaths": ["/proc/sys"]}}))
        return subprocess.run([str(ROOT / "nomad" / "atropos-runc"), *args], capture_output=True, text=True,
                              env={**os.environ, "ATROPOS_REAL_RUNC": str(stub)}, timeout=30)

    sandbox = {"user": {"uid": 1000, "gid": 1000}, "noNewPrivileges": True,
               "capabilities": {"bounding": [], "effective": [], "permitted": []}}
    argv = ("--root", "/run/docker/runtime-runc/moby", "--log", "/x/log.json", "--log-format", "json",
            "create", "--bundle", str(bundle), "--pid-file", "/x/pid", "c0ffee")
    done = run(sandbox, *argv)
    assert done.returncode == 0 and done.stdout.strip() == "runc " + " ".join(argv)
    linux = json.loads(config.read_text())["linux"]
    assert linux == {"maskedPaths": [], "readonlyPaths": []}
    for bad in ({**sandbox, "user": {"uid": 0, "gid": 0}}, {**sandbox, "noNewPrivileges": False},
                {**sandbox, "capabilities": {"bounding": ["CAP_SYS_ADMIN"]}}):
        refused = run(bad, *argv)
        assert refused.returncode == 1 and "refusing" in refused.stderr and "runc" not in refused.stdout
        assert json.loads(config.read_text())["linux"]["maskedPaths"] == ["/proc/kcore"]
    other = run(sandbox, "state", "c0ffee")  # other commands pass straight through
    assert other.returncode == 0 and json.loads(config.read_text())["linux"]["maskedPaths"] == ["/proc/kcore"]


def test_runtime_wrapper_delegates_a_slot_cgroup_subtree_inside_the_container_budget(tmp_path: Path) -> None:
    """For a server started with --cgroup-dir=/run/atropos/cgroup the wrapper nests the container in
    its own budget cgroup and hands it a writable subtree beside it (on this machine's real cgroupfs;
    runc itself is a stub, it would only create <budget>/host and apply the same limits there)."""
    if shutil.which("jq") is None or os.geteuid() != 0:
        pytest.skip("needs jq and root (it writes /sys/fs/cgroup)")
    v2 = Path("/sys/fs/cgroup/cgroup.controllers").exists()
    if not v2 and not Path("/sys/fs/cgroup/memory/memory.limit_in_bytes").exists():
        pytest.skip("no cgroup hierarchy mounted at /sys/fs/cgroup")
    stub = tmp_path / "runc"
    stub.write_text("#!/bin/sh\necho \"runc $*\"\n")
    stub.chmod(0o755)
    bundle = tmp_path / "bundle"
    bundle.mkdir()
    config = bundle / "config.json"
    top = f"atropos-runc-test-{os.getpid()}"
    path = f"/{top}/c0ffee"
    spec = {"process": {"user": {"uid": 1000, "gid": 1000}, "noNewPrivileges": True, "capabilities": {},
                        "args": ["tini", "--", "python3", "-m", "atropos.sandbox", "--cgroup-dir=/run/atropos/cgroup"]},
            "mounts": [{"destination": "/proc", "type": "proc"}],
            "linux": {"cgroupsPath": path, "maskedPaths": [], "readonlyPaths": [],
                      "resources": {"memory": {"limit": 512 << 20}, "pids": {"limit": 300},
                                    "cpu": {"quota": 50000, "period": 100000}}}}
    config.write_text(json.dumps(spec))
    wrapper = str(ROOT / "nomad" / "atropos-runc")
    env = {**os.environ, "ATROPOS_REAL_RUNC": str(stub)}
    cg = Path("/sys/fs/cgroup")
    budgets = [cg / top] if v2 else [cg / c / top for c in ("memory", "pids", "cpu")]
    try:
        done = subprocess.run([wrapper, "create", "--bundle", str(bundle), "--pid-file", "/x/pid", "c0ffee"],
                              capture_output=True, text=True, env=env, timeout=30)
        assert done.returncode == 0, done.stderr
        out = json.loads(config.read_text())
        assert out["linux"]["cgroupsPath"] == f"{path}/host"  # the container inside its budget
        binds = [m for m in out["mounts"] if m["destination"].startswith("/run/atropos/cgroup")]
        assert binds and all(m["type"] == "bind" and "rw" in m["options"] and m["source"].endswith(f"{path}/slots")
                             for m in binds)
        for m in binds:
            slots = Path(m["source"])
            assert slots.stat().st_uid == 1000 and (slots / "cgroup.procs").stat().st_uid == 1000
            assert slots.parent.stat().st_uid == 0, "the budget stays root-owned"
        if v2:
            budget = Path(f"/sys/fs/cgroup{path}")
            assert (budget / "memory.max").read_text().strip() == str(512 << 20)
            assert (budget / "pids.max").read_text().strip() == "300"
        else:
            assert Path(f"/sys/fs/cgroup/memory{path}/memory.limit_in_bytes").read_text().strip() == str(512 << 20)
            assert Path(f"/sys/fs/cgroup/pids{path}/pids.max").read_text().strip() == "300"
            assert Path(f"/sys/fs/cgroup/cpu{path}/cpu.cfs_quota_us").read_text().strip() == "50000"
        # a container that does not ask keeps its spec
        plain = {**spec, "process": {**spec["process"], "args": ["sleep", "1"]}}
        config.write_text(json.dumps(plain))
        other = subprocess.run([wrapper, "create", "--bundle", str(bundle), "c0ffef"], capture_output=True,
                               text=True, env=env, timeout=30)
        assert other.returncode == 0 and json.loads(config.read_text())["linux"]["cgroupsPath"] == path
        gone = subprocess.run([wrapper, "delete", "--force", "c0ffee"], capture_output=True, text=True, env=env,
                              timeout=30)
        assert gone.returncode == 0 and gone.stdout.strip() == "runc delete --force c0ffee"
        assert all(not (b / "c0ffee").exists() for b in budgets)
    finally:
        for b in budgets:
            subprocess.run(["find", str(b), "-depth", "-type", "d", "-exec", "rmdir", "{}", "+"], capture_output=True)


def test_docker_compose_dev_stack() -> None:
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    services = compose["services"]
    assert set(services) == {"nomad", "job-runner", "toolserver"}

    nomad = services["nomad"]
    image, _, version = nomad["image"].partition(":")
    assert image == "hashicorp/nomad"
    assert tuple(int(x) for x in version.split(".")) >= (2, 0, 4)
    assert nomad["command"][:2] == ["agent", "-dev"] and "-config=/etc/nomad.d" in nomad["command"]
    assert nomad["network_mode"] == "host" and nomad["privileged"] is True
    # cgroup v2: the client manages cgroups, so it needs the host's cgroup namespace and a writable
    # /sys/fs/cgroup (nomad-api.md section 8, pitfall 3); the image's entrypoint otherwise warns and
    # sleeps 2 s before every agent or CLI command.
    assert nomad["cgroup"] == "host"
    assert nomad["environment"]["NOMAD_SKIP_DOCKER_IMAGE_WARN"] == "1"
    volumes = set(nomad["volumes"])
    assert "/sys/fs/cgroup:/sys/fs/cgroup:rw" in volumes
    assert {"/var/run/docker.sock:/var/run/docker.sock", "/tmp:/tmp"} <= volumes
    assert "./nomad/client.hcl:/etc/nomad.d/client.hcl:ro" in volumes
    assert f"./atropos/backends/docker_seccomp.json:{NomadBackendConfig().seccomp_profile}:ro" in volumes
    assert "4646" in " ".join(nomad["healthcheck"]["test"])

    runner = services["job-runner"]
    assert runner["image"] == nomad["image"] and runner["profiles"] == ["manual"]
    assert runner["environment"]["NOMAD_SKIP_DOCKER_IMAGE_WARN"] == "1"
    assert "./nomad/sandbox.hcl:/jobs/sandbox.hcl:ro" in runner["volumes"]
    script = " ".join(runner["command"])
    assert "nomad var put" in script and "nomad job run" in script and "/jobs/sandbox.hcl" in script

    ts = services["toolserver"]
    assert ts["command"] == ["serve", "--listen-host", "0.0.0.0", "--port", "8600"]
    assert ts["entrypoint"] == ["atropos-sandbox"] and "atropos-sandbox" in ts["image"]
    env = ts["environment"]
    assert env["ATROPOS_TOOLSERVER_TOKEN"].startswith("${ATROPOS_TOOLSERVER_TOKEN:?")
    assert env["ATROPOS_SANDBOX_BACKEND"] == "nomad"
    assert env["ATROPOS_SANDBOX_NOMAD_ADDRESS"] == env["NOMAD_ADDR"] == "http://127.0.0.1:4646"
    assert ts["network_mode"] == "host" and ts["depends_on"]["nomad"]["condition"] == "service_healthy"
    assert ts["cap_drop"] == ["ALL"] and "no-new-privileges" in ts["security_opt"] and ts["read_only"] is True
    assert ts["user"] == "1000:1000" and "8600" in " ".join(ts["healthcheck"]["test"])
    for svc in services.values():  # every local file a service mounts exists
        for vol in svc.get("volumes", []):
            src = vol.split(":")[0]
            if src.startswith("./"):
                assert (ROOT / src).exists(), src
        assert "ports" not in svc  # host networking: nothing is published

    # The pool's job (atropos-<pool id>) and the hand-run file's job are different jobs, with
    # different token variables: the header must not claim they collide.
    pool_job = f"atropos-{env['ATROPOS_SANDBOX_POOL_ID']}"
    hcl_job = re.search(r'^job "([^"]+)"', HCL.read_text(), re.M)
    assert hcl_job is not None and pool_job != hcl_job.group(1)
    assert f"nomad/jobs/{hcl_job.group(1)}" in script
    header = (ROOT / "docker-compose.yml").read_text().split("\nname:")[0]
    assert "same job ID" not in header and pool_job in header and hcl_job.group(1) in header


def test_docker_compose_matches_the_compose_spec_schema() -> None:
    # No registry at test time: the schema comes from an installed package that ships it
    # (check-jsonschema vendors compose-spec.json); without it this check cannot run offline.
    spec = importlib.util.find_spec("check_jsonschema")
    schema_file = None
    if spec is not None and spec.origin:
        schema_file = Path(spec.origin).parent / "builtin_schemas" / "vendor" / "compose-spec.json"
    if schema_file is None or not schema_file.exists():
        pytest.skip("the compose-spec JSON schema is not available offline: install check-jsonschema "
                    "(it ships builtin_schemas/vendor/compose-spec.json) to validate docker-compose.yml against it")
    import jsonschema_rs

    validator = jsonschema_rs.validator_for(json.loads(schema_file.read_text()))
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    errors = [str(e) for e in validator.iter_errors(compose)]
    assert errors == []
    broken = json.loads(json.dumps(compose))
    broken["services"]["nomad"]["cgroup"] = "hostt"  # the validator really looks at the options
    assert not validator.is_valid(broken)


# ---------------------------------------------------------------------------------------------
# Shared pool scenarios (tests/test_pool.py) on the fake, and a real agent
# ---------------------------------------------------------------------------------------------


async def test_shared_pool_scenario_on_nomad() -> None:
    """tests/test_pool.py's reuse scenario on make_backend("nomad") (the shared fake). Its crash
    scenario is covered above with more checks."""
    import tests.test_pool as shared

    await shared.test_lease_call_release_and_reuse_is_clean("nomad")


@pytest.mark.skipif("NOMAD_ADDR" not in REAL_NOMAD,
                    reason="NOMAD_ADDR is not set: no real Nomad agent to test against (needs Nomad >= 2.0.4 "
                           "with the docker driver, the sandbox image and nomad/client.hcl; see nomad/README.md)")
async def test_real_nomad_agent() -> None:
    cfg = NomadBackendConfig.from_env(REAL_NOMAD, job_id=f"atropos-test-{secrets.token_hex(3)}", slots_per_host=2,
                                      start_timeout_s=300, memory=1024, workspace_bytes=256 << 20,
                                      image=os.environ.get("ATROPOS_SANDBOX_IMAGE", "atropos-sandbox:dev"))
    backend = NomadBackend(cfg)
    async with SlotPool(backend, pool_cfg(min_hosts=1, max_hosts=2)) as pool:
        leases = await pool.lease_many(["r0", "r1", "r2"], timeout=300)
        for x in leases:
            assert (await x.bash("echo real && id -u"))["stdout"].split() == ["real", "1000"]
        for x in leases:
            await x.release()
        assert double_leases(pool.audit.events) == []


class socket_closed_port:
    """A loopback port nothing listens on."""

    def __enter__(self) -> int:
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        self.port = int(s.getsockname()[1])
        s.close()
        return self.port

    def __exit__(self, *exc: object) -> None:
        pass



class _ConfigSeen(NullDriver):
    """Runs nothing; keeps the driver config each task was started with (interpolated, as Nomad
    hands it to the docker driver)."""

    def __init__(self) -> None:
        self.configs: list[dict[str, Any]] = []

    def start(self, alloc: Any) -> None:
        self.configs.append(alloc.config)
        super().start(alloc)


def test_hosts_deny_network_slots_the_nodes_own_address() -> None:
    # A host in its container sees only the container's addresses; the job passes the node's, which
    # Nomad fills in per node, so the egress policy denies it like the host's own. The fake's node
    # address is a documentation address nothing here sends traffic to (the driver runs nothing).
    from atropos.sandbox.contract.egress import EgressPolicy, parse_addresses

    seen = _ConfigSeen()
    with FakeNomad(driver=seen, time_scale=0.02, node_ip="192.0.2.77") as fake:
        cfg = nomad_test_config(fake.address, slots=1, token_delivery="job")  # no variable to wait for
        _register(fake, render_job(cfg, 1, token="t"))
        fake.wait_for(lambda: seen.configs, message="the task started")
    args = [str(a) for a in seen.configs[0]["args"]]
    flag = "--egress-machine-address="
    machine = parse_addresses([a.removeprefix(flag) for a in args if a.startswith(flag)])
    assert [str(a) for a in machine] == ["192.0.2.77"], args
    routes = EgressPolicy(machine_addresses=machine).routes(host_addresses=[])
    assert routes[next(n for n in routes if n.network_address == machine[0])] is False


async def test_the_pool_ships_task_images_to_nomad_hosts(fake: FakeNomad, task_image: Any) -> None:
    """docs/task-images.md: a Nomad task's host has no engine of its own, so the pool ships the image
    from its machine's engine (as for a Docker container's host), once per host and image; a slot
    leased with ``image=`` runs on it. The fake's hosts are real hosts."""
    small = task_image("nopython")
    backend = backend_on(fake, slots=2)
    api, _ = backend._engine()
    exports: list[str] = []
    real_export = api.get_image

    def export(reference: str, *args: Any, **kw: Any) -> Any:  # the engine's real export, counted
        exports.append(reference)
        return real_export(reference, *args, **kw)

    api.get_image = export
    async with SlotPool(backend, pool_cfg(acquire_timeout_s=300)) as pool:
        a, b = await pool.lease_many(["n-a", "n-b"], image=small)
        try:
            for lease in (a, b):
                out = await lease.bash("busybox true && command -v python3; echo $?")
                assert out["stdout"] == "1\n", out  # the image's root: no python there
            # a group's setup made an image on the host (derive_image), the other rollout's root
            await a.bash("echo setup > /setup.txt")
            derived = await a.derive_image()
            await b.reset(image=derived)
            out = await b.bash("cat /setup.txt; command -v python3; echo $?")
            assert out["stdout"] == "setup\n1\n", out
        finally:
            for lease in (a, b):
                await lease.release()
        assert exports == [small], "one shipment for the group's host (a derived image is the host's own)"
        host = next(iter(pool.hosts.values()))
        assert small in [i.reference for i in await host.client.images()]
        async with pool.leased("n-c", image=small):
            pass
        assert exports == [small]  # held under the engine's current id: not shipped again
