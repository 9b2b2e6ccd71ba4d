"""The ray backend against real Ray: a head and two worker nodes (``ray.cluster_utils.Cluster``, as
Ray's own tests use it), every node and the driver on 127.0.0.1 only, no dashboard.

The hosts are real ``python -m atropos.sandbox`` processes with bubblewrap, started by Ray actors
placed on the nodes that offer the ``atropos_sandbox`` resource (the head offers none). A node
removed is a host lost: its actor fails, the pool fails the host's calls and places a
replacement on the surviving node.

In CI (``CI=true``) a missing Ray is a failure, not a skip: ``dev`` installs it.
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import wait_until

from atropos.errors import ConfigError, HostUnavailable
from atropos.slots.audit import double_leases
from atropos.slots.config import PoolConfig
from atropos.slots.pool import SlotPool
from tests import test_image_roots as image_roots
from tests import token_theft
from tests.pool_backends import pool_cfg as shared_pool_cfg
from tests.task_images import docker_run

REPO = Path(__file__).resolve().parent.parent
RESOURCE = "atropos_sandbox"
DATA_ROOT = Path("/tmp/atropos-sandbox-tests/ray")

os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"  # keep Ray on 127.0.0.1 (atropos/backends/ray.py)
try:
    import ray
    from ray.cluster_utils import Cluster
except ImportError:  # pragma: no cover - depends on the install
    if os.environ.get("CI") == "true":
        raise
    pytest.skip("ray is not installed (pip install 'atropos-sandbox[ray]')", allow_module_level=True)

pytestmark = pytest.mark.timeout(600)


class RayCluster:
    def __init__(self) -> None:
        self.cluster = Cluster(initialize_head=True, head_node_args={
            "num_cpus": 1, "node_ip_address": "127.0.0.1", "include_dashboard": False})
        try:
            self.workers = [self.add_worker() for _ in range(2)]
            ray.init(address=self.cluster.address, _node_ip_address="127.0.0.1", include_dashboard=False,
                     log_to_driver=False, namespace="atropos-tests")
            self.cluster.wait_for_nodes()
        except BaseException:
            self.shutdown()  # no head or raylet of a half-started cluster left behind
            raise

    @classmethod
    def start(cls, attempts: int = 3) -> RayCluster:
        """A cluster, started again when a node misses Ray's own 30 s start deadline ("The current
        node timed out during startup": the GCS answers late on a loaded machine; not a product
        failure)."""
        for attempt in range(1, attempts + 1):
            try:
                return cls()
            except Exception as exc:
                if attempt == attempts or "timed out during startup" not in str(exc):
                    raise
        raise AssertionError("unreachable")

    def add_worker(self) -> Any:
        return self.cluster.add_node(num_cpus=4, resources={RESOURCE: 8}, node_ip_address="127.0.0.1")

    @property
    def address(self) -> str:
        return str(self.cluster.address)

    def worker_ids(self) -> set[str]:
        return {w.node_id for w in self.workers}

    def shutdown(self) -> None:
        ray.shutdown()
        self.cluster.shutdown()


@pytest.fixture(scope="module")
def cluster() -> Iterator[RayCluster]:
    c = RayCluster.start()
    yield c
    c.shutdown()


def make_backend(cluster: RayCluster, slots: int, pool_id: str | None = None, **kw: Any) -> Any:
    from atropos.backends.config import BackendSettings, build_backend

    settings = BackendSettings(kind="ray", pool_id=pool_id or f"r{secrets.token_hex(4)}", slots_per_host=slots,
                               max_timeout_s=120, ray_address=cluster.address)
    return build_backend(settings, environ={}, data_root=DATA_ROOT, **{"num_cpus": 0.5, **kw})


def pool_cfg(**kw: Any) -> PoolConfig:
    # Generous probes: on a busy 2-core machine running a Ray cluster, a loaded host may answer its
    # health probe late; a lost node is noticed through its actor, not through probes.
    return shared_pool_cfg(**{"health_timeout_s": 30, "health_failures": 3, **kw})


def processes_naming(needle: str) -> list[int]:
    """Pids of processes whose command line contains ``needle``."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if needle.encode() in (entry / "cmdline").read_bytes():
                    found.append(int(entry.name))
            except OSError:
                pass
    return found


async def poll(check: Any, what: str, timeout: float = 90) -> None:
    """Ray's state API answers slowly under load: a long limit, a slower poll."""
    await wait_until(check, timeout, 0.2, what=what)


# -- placement, token, isolation ------------------------------------------------------------------
async def test_hosts_spread_over_nodes_and_the_token_stays_private(cluster: RayCluster) -> None:
    backend = make_backend(cluster, slots=2)
    async with SlotPool(backend, pool_cfg(min_hosts=2, max_hosts=2)) as pool:
        hosts = list(pool.hosts.values())
        nodes = {h.info.labels["node"] for h in hosts}
        assert nodes == cluster.worker_ids(), "one host per worker node; none on the head (no resource)"
        assert all(h.info.address.startswith("http://127.0.0.1:") for h in hosts)
        # Ray's own records of the actors (what its state API and dashboard show) never hold a token
        records = json.dumps(ray._private.state.actors(), default=str)  # type: ignore[attr-defined]
        named = json.dumps(ray.util.list_named_actors(all_namespaces=True))
        for h in hosts:
            assert h.info.token not in records and h.info.token not in named
            # ... nor the host's command line (readable by every process)
            pid = int(h.info.labels["pid"])
            assert h.info.token.encode() not in Path(f"/proc/{pid}/cmdline").read_bytes()
        async with pool.leased("probe") as lease:
            env = (await lease.bash("env; cat /proc/1/environ 2>/dev/null | tr '\\0' '\\n'"))["stdout"]
            assert all(h.info.token not in env for h in hosts) and "ATROPOS_SANDBOX_TOKEN" not in env
    await poll(lambda: not backend.actor_names(), "the pool's actors to be gone after stop")


async def test_a_task_on_the_hosts_node_cannot_find_the_host_token(cluster: RayCluster) -> None:
    """An unrelated Ray task pinned to a host's node (Ray runs it as the host's user) scans every
    /proc/*/environ, /proc/*/cmdline and the pool's files for the token and calls the host API
    with whatever it found: nothing it found is accepted."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    backend = make_backend(cluster, slots=1, prewarm=False)
    async with SlotPool(backend, pool_cfg(min_hosts=1, max_hosts=1)) as pool:
        host = next(iter(pool.hosts.values()))
        pid = int(host.info.labels["pid"])
        assert host.info.token.encode() not in Path(f"/proc/{pid}/cmdline").read_bytes()
        ray.cloudpickle.register_pickle_by_value(token_theft)  # the node's workers do not import tests/
        attack = ray.remote(num_cpus=0)(token_theft.steal_host_token).options(
            scheduling_strategy=NodeAffinitySchedulingStrategy(host.info.labels["node"], soft=False))
        report = await asyncio.wrap_future(attack.remote([str(DATA_ROOT)], host.info.address).future())
        assert report["read"]["environ"] > 5 and report["read"]["cmdline"] > 5 and report["read"]["files"] > 0, report
        assert report["accepted"] == [] and host.info.token not in report["candidates"], report["accepted"]
        async with pool.leased("probe") as lease:  # the host still serves with its token
            assert (await lease.bash("echo ok"))["stdout"] == "ok\n"


async def test_a_second_job_running_code_inside_a_host_actor_finds_no_usable_token(cluster: RayCluster) -> None:
    """Another job of the cluster (its own driver process, its own namespace) lists the named
    actors, runs code inside the pool's host actor with ``__ray_call__`` and takes every
    secret-shaped string from the actor's attributes, live objects and whole writable memory, and
    what it can open of its host child (/proc, its memory, the pipes): none of it is accepted by the
    host. The actor was only ever given the token's verifier (atropos/sandbox/contract/hosttoken.py);
    the host holds only that, is non-dumpable and has its stdin closed. What such a job can still do (stop the host) is
    said in docs/ray.md."""
    from atropos.sandbox.contract.hosttoken import token_verifier

    backend = make_backend(cluster, slots=1, prewarm=False)
    async with SlotPool(backend, pool_cfg(min_hosts=1, max_hosts=1)) as pool:
        host = next(iter(pool.hosts.values()))
        job = await asyncio.to_thread(
            subprocess.run, [sys.executable, str(REPO / "tests" / "ray_second_job.py"), cluster.address,
                             f"{backend.cfg.pool_id}/", host.info.address],
            capture_output=True, text=True, timeout=500, cwd=REPO)
        assert job.returncode == 0, job.stderr[-3000:]
        report = json.loads(job.stdout.strip().splitlines()[-1])
        assert host.info.id in [a["name"] for a in report["named"]], report["named"]  # found by its name
        (inside,) = report["inside"]
        seen = inside["seen"]
        # the attack reached the actor's memory: a token-shaped string it held was found there...
        assert seen["canary_found"] and seen["memory_bytes"] > 1 << 20, seen
        # ...and the host child behind it: non-dumpable, its memory is read only by a worker with
        # CAP_SYS_PTRACE (root's, as here), which finds the token in the requests the host received
        # (docs/ray.md: root on the node is in the trust domain); its stdin closed
        ptrace = (int(Path("/proc/self/status").read_text().split("CapEff:")[1].split()[0], 16) >> 19) & 1
        assert seen["host_proc"]["mem"].startswith("READ" if ptrace else "DENIED"), seen
        assert seen["host_proc"]["stdin"] == "closed", seen
        assert host.info.token not in inside["found"] and report["accepted"] == [], report["accepted"]
        # what the actor held (the verifier, if still in its memory) is not accepted either
        assert not any(v in report["accepted"] for v in (token_verifier(host.info.token),))
        async with pool.leased("probe") as lease:  # the host still serves with its token
            assert (await lease.bash("echo ok"))["stdout"] == "ok\n"


async def test_isolation_smoke_rows_on_a_ray_placed_host(cluster: RayCluster) -> None:
    """A few rows of tests/test_isolation.py through a Ray-placed host: the same confinement."""
    async with SlotPool(make_backend(cluster, slots=2), pool_cfg()) as pool:
        a, b = await pool.lease_many(["a", "b"])
        try:
            host = a.host
            assert host.info.labels["node"] in cluster.worker_ids()
            await a.write_file("secret.txt", "only-a")
            ws_a = (await a.bash("readlink -f secret.txt"))["stdout"].strip()
            # r01: the host's shadow file; r04: the other slot's file; r13: egress; r14: the host API
            shadow = await b.bash("cat /etc/shadow; echo rc=$?")
            assert "rc=0" not in shadow["stdout"] and "root:" not in shadow["stdout"]
            cross = await b.bash(f"cat {ws_a} 2>&1; cat /slots/*/secret.txt 2>&1; echo done")
            assert "only-a" not in cross["stdout"]
            uid_a = (await a.bash("id -u"))["stdout"].strip()
            uid_b = (await b.bash("id -u"))["stdout"].strip()
            assert uid_a != "0" and uid_b != "0"
            port = host.info.address.rsplit(":", 1)[1]
            api = await b.bash(f"python3 -c \"import socket; s=socket.socket(); s.settimeout(3); "
                               f"s.connect(('127.0.0.1', {port}))\" 2>&1; echo rc=$?")
            assert "rc=0" not in api["stdout"], "the host API must be unreachable from an offline slot"
            egress = await b.bash("python3 -c \"import socket; s=socket.socket(); s.settimeout(3); "
                                  "s.connect(('10.255.255.1', 9))\" 2>&1; echo rc=$?")
            assert "rc=0" not in egress["stdout"]
        finally:
            for lease in (a, b):
                await lease.release()


# -- load ------------------------------------------------------------------------------------------
async def test_200_concurrent_trajectories_never_share_a_slot(cluster: RayCluster) -> None:
    backend = make_backend(cluster, slots=16, prewarm=False)
    async with SlotPool(backend, pool_cfg(min_hosts=4, max_hosts=4)) as pool:
        assert sum(h.info.slots for h in pool.hosts.values()) == 64
        assert {h.info.labels["node"] for h in pool.hosts.values()} == cluster.worker_ids()

        async def trajectory(i: int) -> str:
            async with pool.leased(f"traj-{i}", timeout=300) as lease:
                await lease.write_file("owner", f"traj-{i}")
                listing = await lease.ok("list_dir", {"path": "."})
                assert [e["name"] for e in listing["entries"]] == ["owner"]
                return (await lease.read_file("owner")).strip()

        results = await asyncio.gather(*(trajectory(i) for i in range(200)))
        assert results == [f"traj-{i}" for i in range(200)]
        assert double_leases(pool.audit.events) == []
        assert len([e for e in pool.audit.events if e.event == "lease"]) == 200


async def test_scales_up_under_demand_and_down_when_idle(cluster: RayCluster) -> None:
    backend = make_backend(cluster, slots=2, prewarm=False)
    cfg = pool_cfg(min_hosts=1, max_hosts=3, scale_down_idle_s=0.5)
    async with SlotPool(backend, cfg) as pool:
        leases = await pool.lease_many([f"s{i}" for i in range(6)], timeout=180)
        assert len(pool.hosts) == 3 and len(backend.actor_names()) == 3
        for lease in leases:
            await lease.release()
        await poll(lambda: len(pool.hosts) == 1, "the pool to scale back down to min_hosts")
        await poll(lambda: len(backend.actor_names()) == 1, "the stopped hosts' actors to be gone")


# -- failures --------------------------------------------------------------------------------------
ORPHAN_SCRIPT = """
import asyncio, json, os, sys
sys.path.insert(0, {root!r})
from atropos.backends.config import BackendSettings, build_backend
from atropos.slots.config import PoolConfig
from atropos.slots.pool import SlotPool

async def main():
    backend = build_backend(BackendSettings(kind="ray", pool_id={pool_id!r}, slots_per_host=1, ray_address={address!r}),
                            environ={{}}, num_cpus=0.5, data_root={data_root!r}, prewarm=False)
    pool = SlotPool(backend, PoolConfig(pool_id={pool_id!r}, min_hosts=2, max_hosts=2))
    await pool.start()
    print(json.dumps({{"hosts": list(pool.hosts), "pids": [h.info.labels["pid"] for h in pool.hosts.values()]}}),
          flush=True)
    await asyncio.sleep(3600)

asyncio.run(main())
"""


async def test_killed_pool_process_leaves_no_actors_and_a_restart_reaps(cluster: RayCluster) -> None:
    pool_id = f"orph{os.getpid()}"
    script = ORPHAN_SCRIPT.format(root=str(REPO), pool_id=pool_id, address=cluster.address, data_root=str(DATA_ROOT))
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, cwd=REPO)
    assert proc.stdout is not None
    line = await asyncio.wait_for(asyncio.to_thread(proc.stdout.readline), 180)
    first = json.loads(line)
    assert len(first["hosts"]) == 2
    slot_cgroups = [d for p in first["pids"] for d in host_slot_cgroups(int(p))]
    assert slot_cgroups, "premise: the hosts' slot cgroups exist"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    left = [DATA_ROOT / pool_id / h.replace("/", "-") for h in first["hosts"]]
    assert all(d.with_suffix(".log").exists() for d in left), "premise: the killed pool's hosts had logs"
    backend = make_backend(cluster, slots=1, pool_id=pool_id, prewarm=False)
    async with SlotPool(backend, pool_cfg(pool_id=pool_id)) as pool:
        # the dead pool's actors are gone (Ray's owner fate-sharing, else reap_orphans at start)
        await poll(lambda: set(backend.actor_names()) == set(pool.hosts), "only the new pool's actors to remain")
        assert set(first["hosts"]).isdisjoint(backend.actor_names())
        await poll(lambda: not any(_alive(int(p)) for p in first["pids"]), "the dead pool's host processes to exit")
        # ... and what its hosts left on the node (no stop ran for them) is removed by the new
        # pool's actors there, while the new hosts' own data stays
        await poll(lambda: not any(d.exists() or d.with_suffix(".log").exists() for d in left),
                   "the dead pool's host data dirs and logs to be removed")
        assert all((DATA_ROOT / pool_id / h.replace("/", "-")).with_suffix(".log").exists() for h in pool.hosts)
        await poll(lambda: not any(d.exists() for d in slot_cgroups), "the dead hosts' slot cgroups to be removed")


def host_slot_cgroups(pid: int) -> list[Path]:
    """Where a host nests its slots' cgroups (``atropos/sandbox/host/isolation/cgroups.py``): ``atropos-<pid>`` in
    its own cgroup of each v1 controller or of v2 (a v2 host sits in the leaf ``atropos-<pid>-host``)."""
    from atropos.sandbox.contract.cgroupfs import mountinfo, own_cgroups

    found = []
    for controller, path in own_cgroups(str(pid)).items():
        for m in mountinfo():
            if (m.fstype == "cgroup2" and controller == "") or (m.fstype == "cgroup" and controller in m.super_options):
                base = Path(m.mountpoint) / path.lstrip("/")
                if base.name == f"atropos-{pid}-host":
                    base = base.parent
                if (base / f"atropos-{pid}").is_dir():
                    found.append(base / f"atropos-{pid}")
    return found


async def test_a_resource_no_node_offers_is_said_at_once(cluster: RayCluster) -> None:
    """Neither a resource no node has nor more of it than any node has waits for the start
    timeout: the pool's start fails with what the cluster's nodes do offer."""
    for kw in ({"resource": "atropos_gpu_sandbox"}, {"resource_per_host": 64.0}):
        backend = make_backend(cluster, slots=1, prewarm=False, **kw)
        with pytest.raises(ConfigError) as err:
            async with SlotPool(backend, pool_cfg(min_hosts=1, max_hosts=1)):
                pass
        msg = str(err.value)
        assert "no live node of the Ray cluster can run a sandbox host" in msg, msg
        assert f"{RESOURCE}=8" in msg and "CPU=4" in msg, msg  # what the worker nodes offer
        assert not backend.actor_names()


async def test_a_host_that_fails_to_start_shows_its_log_and_a_missing_interpreter_its_path(
        cluster: RayCluster, tmp_path: Path) -> None:
    """A worker Python without the project (the host dies at import) is reported with the end of the
    host's log (read before the actor removes it), and one that does not exist by its path."""
    missing = str(tmp_path / "no-such-python")
    backend = make_backend(cluster, slots=1, prewarm=False, python=missing)
    with pytest.raises(HostUnavailable) as err:
        async with SlotPool(backend, pool_cfg(min_hosts=1, max_hosts=1)):
            pass
    assert missing in str(err.value) and "cannot be run" in str(err.value), str(err.value)

    bare = tmp_path / "bare-python"  # an interpreter that cannot import atropos: the host dies at once
    bare.write_text("#!/bin/sh\necho 'ModuleNotFoundError: No module named atropos (bare python)' >&2\nexit 1\n")
    bare.chmod(0o755)
    backend = make_backend(cluster, slots=1, prewarm=False, python=str(bare))
    with pytest.raises(HostUnavailable) as err:
        async with SlotPool(backend, pool_cfg(min_hosts=1, max_hosts=1)):
            pass
    msg = str(err.value)
    assert "No module named atropos (bare python)" in msg and "(no log)" not in msg, msg
    assert "host log on node" in msg, msg


def test_the_address_probe_lets_a_real_gcs_through(cluster: RayCluster) -> None:
    from atropos.backends.ray import _probe_address

    _probe_address(cluster.address)  # a gRPC server: no HTTP/1 answer, no error


def test_serve_with_an_http_server_at_the_ray_address_says_what_answered(tmp_path: Path) -> None:
    """The dashboard's port (an HTTP server) given as the cluster's address: refused at once, naming what
    answered, instead of ray.init waiting on it for minutes."""
    import http.server
    import threading

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), http.server.SimpleHTTPRequestHandler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    port = httpd.server_address[1]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ATROPOS_", "RAY_ADDRESS"))}
    env.update(XDG_CACHE_HOME=str(tmp_path / "cache"), PYTHONPATH=str(REPO), ATROPOS_TOOLSERVER_TOKEN="t" * 32)
    try:
        out = subprocess.run([sys.executable, "-m", "atropos.cli", "serve", "--backend", "ray", "--ray-address",
                              f"127.0.0.1:{port}", "--port", "0"], capture_output=True, text=True, timeout=120,
                             env=env, cwd=REPO)
    finally:
        httpd.shutdown()
    assert out.returncode == 3, (out.returncode, out.stderr[-3000:])
    assert f"127.0.0.1:{port} is not Ray's control service (GCS): an HTTP/1 server answered" in out.stderr, \
        out.stderr[-3000:]
    assert "SimpleHTTP" in out.stderr and "Traceback" not in out.stderr, out.stderr[-3000:]


def test_serve_with_an_unreachable_ray_address_fails_at_once_and_announces_nothing(tmp_path: Path) -> None:
    import socket

    with socket.socket() as s:  # a port on loopback where nothing listens
        s.bind(("127.0.0.1", 0))
        dead = s.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ATROPOS_", "RAY_ADDRESS"))}
    env.update(XDG_CACHE_HOME=str(tmp_path / "cache"), PYTHONPATH=str(REPO), ATROPOS_TOOLSERVER_TOKEN="t" * 32)
    # the timeout only guards against the hang this test is about (Ray retries for ten minutes)
    out = subprocess.run([sys.executable, "-m", "atropos.cli", "serve", "--backend", "ray", "--ray-address",
                          f"127.0.0.1:{dead}", "--port", "0"], capture_output=True, text=True, timeout=120,
                         env=env, cwd=REPO)
    assert out.returncode == 3, (out.returncode, out.stderr[-3000:])
    assert f"error: the pool did not start: cannot reach the Ray cluster at 127.0.0.1:{dead}" in out.stderr, \
        out.stderr[-3000:]
    assert "Traceback" not in out.stderr, "one error, not a stack"
    assert "ToolServer on" not in out.stderr + out.stdout


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is gone for our purpose
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


async def test_worker_node_removed_with_64_calls_in_flight(cluster: RayCluster) -> None:
    """Every call ends with exactly one outcome (its result, or HostUnavailable for the lost
    node's calls), replacements come up on the surviving node, nothing of the lost hosts remains."""
    backend = make_backend(cluster, slots=16, prewarm=False)
    async with SlotPool(backend, pool_cfg(min_hosts=4, max_hosts=4)) as pool:
        by_node: dict[str, list[str]] = {}
        for h in pool.hosts.values():
            by_node.setdefault(h.info.labels["node"], []).append(h.id)
        assert set(by_node) == cluster.worker_ids()
        victim = next(w for w in cluster.workers if w.node_id in by_node)
        lost_hosts = set(by_node[victim.node_id])
        lost_pids = [int(pool.hosts[h].info.labels["pid"]) for h in lost_hosts]
        leases = await pool.lease_many([f"t{i}" for i in range(64)], timeout=300)
        started = asyncio.Event()
        running = 0

        async def call(lease: Any) -> str:
            nonlocal running
            running += 1
            if running == 64:
                started.set()
            try:
                out = await lease.bash("sleep 6; echo done", timeout_s=60)
                return "ok" if out["stdout"] == "done\n" else f"bad: {out}"
            except HostUnavailable:
                return "lost"

        calls = [asyncio.ensure_future(call(lease)) for lease in leases]
        await started.wait()
        await asyncio.sleep(1.0)  # the commands are running in the sandboxes
        await asyncio.to_thread(cluster.cluster.remove_node, victim)
        cluster.workers.remove(victim)
        outcomes = await asyncio.gather(*calls)
        assert len(outcomes) == 64 and set(outcomes) <= {"ok", "lost"}, outcomes
        on_victim = sum(1 for lease in leases if lease.host.id in lost_hosts)
        assert outcomes.count("lost") == on_victim and on_victim > 0
        for lease in leases:
            await lease.release()
        survivor = next(iter(cluster.worker_ids()))
        await poll(lambda: len(pool.hosts) == 4 and all(h.info.labels["node"] == survivor
                                                       for h in pool.hosts.values()),
                   "four hosts again, all on the surviving node", timeout=180)
        assert lost_hosts.isdisjoint(backend.actor_names())
        await poll(lambda: not any(_alive(p) for p in lost_pids), "the lost hosts' processes to exit")
        for host_id in lost_hosts:
            await poll(lambda h=host_id: not processes_naming(h.replace("/", "-")),
                       f"no process of {host_id} left")
        assert double_leases(pool.audit.events) == []
    cluster.workers.append(cluster.add_worker())  # later tests get two workers again


# -- task images ---------------------------------------------------------------------------------
async def test_an_image_rooted_slot_on_ray_hosts_behaves_as_docker_run(cluster: RayCluster, task_image: Any) -> None:
    """docs/task-images.md, "On the Ray and Docker backends": a host imports an image from its
    node's Docker engine into the node's layer store (``<data_root>/images``, shared by every host
    placed there), and a slot leased with ``image=`` through a Ray-backed pool shows what ``docker
    run`` of that image shows (here the image with whiteouts and opaque directories across layers)."""
    ref = task_image("layered")
    store = DATA_ROOT / "images"
    backend = make_backend(cluster, slots=1, prewarm=False)
    async with SlotPool(backend, pool_cfg(min_hosts=2, max_hosts=2)) as pool:
        hosts = list(pool.hosts.values())
        assert {h.info.labels["node"] for h in hosts} == cluster.worker_ids()
        # both hosts import at once into the one store of their machine
        held = await pool.prepare_images([ref])
        assert {h.id for h in hosts} == set(held)
        assert all(infos[0].reference == ref and infos[0].layers >= 2 for infos in held.values())
        assert len(list((store / "layers").iterdir())) >= held[hosts[0].id][0].layers
        # one store per node, not one per pool (which would import every image again per run)
        assert not (DATA_ROOT / backend.cfg.pool_id / "images").exists()
        a, b = await pool.lease_many(["img-a", "img-b"], image=ref, colocate=False)
        try:
            assert a.host is not b.host
            for command in image_roots.COMMON + image_roots.PER_IMAGE["layered"]:
                code, want, _ = docker_run(ref, command)
                for lease in (a, b):
                    result = await lease.bash(command)
                    assert (result["exit_code"], result["stdout"]) == (code, want), (lease.host.id, command)
            # each slot's writes are its own
            await a.bash("echo only-a > /work/kept")
            assert (await b.bash("cat /work/kept"))["stdout"] == "keep\n"
        finally:
            for lease in (a, b):
                await lease.release()
    # the store outlives the pool: the next pool's host finds the image's layers there (the same
    # directories, nothing unpacked again)
    unpacked = {p.name: p.stat().st_ino for p in (store / "layers").iterdir()}
    async with SlotPool(make_backend(cluster, slots=1, prewarm=False), pool_cfg(min_hosts=1, max_hosts=1)) as pool:
        host = next(iter(pool.hosts.values()))
        assert (await host.client.prepare_image(ref)).reference == ref
        assert {p.name: p.stat().st_ino for p in (store / "layers").iterdir()} == unpacked


class EngineWithoutImages:
    """What a node's Docker engine that lacks every image answers (Engine API: ``GET
    /images/{name}/json`` is 404 ``No such image``), on a unix socket: the engine of a node nobody
    ``docker load``-ed the image on. Every request it got is kept."""

    def __init__(self, path: Path) -> None:
        import http.server
        import socketserver
        import threading

        seen = self.requests = []  # type: list[str]

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                seen.append(self.path)
                name = self.path.split("/")[2] if self.path.startswith("/images/") else self.path
                body = json.dumps({"message": f"No such image: {name}"}).encode()
                self.send_response(404)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            do_POST = do_GET

            def address_string(self) -> str:
                return "unix"

            def log_message(self, *args: Any) -> None:
                pass

        class Server(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
            daemon_threads = True

        self.server = Server(str(path), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


async def test_a_node_without_the_image_is_named_and_its_leases_go_to_a_node_with_it(
        cluster: RayCluster, task_image: Any, tmp_path: Path) -> None:
    """docs/task-images.md, "On the Ray and Docker backends": two sandbox nodes, one whose engine
    (``DOCKER_HOST`` of that node) lacks the image. A lease of the image while only that node's host
    is free is refused there, the refusal naming the node; the lease then waits in its turn for the
    node that has the image (never failing for it), and gets a slot there; later leases of the image
    never go to the node that refused it, though its host is as free; the default root is still
    served there; nothing is quarantined."""
    ref = task_image("nopython")
    sock = tmp_path / "engine.sock"
    engine = EngineWithoutImages(sock)
    resource = "atropos_sandbox_img"
    good = cluster.cluster.add_node(num_cpus=1, resources={resource: 1}, node_ip_address="127.0.0.1")
    bare = cluster.cluster.add_node(num_cpus=1, resources={resource: 1}, node_ip_address="127.0.0.1",
                                    env_vars={"DOCKER_HOST": f"unix://{sock}"})
    try:
        cluster.cluster.wait_for_nodes()
        backend = make_backend(cluster, slots=1, prewarm=False, resource=resource, resource_per_host=1.0)
        async with SlotPool(backend, pool_cfg(min_hosts=2, max_hosts=2)) as pool:
            by_node = {h.info.labels["node"]: h for h in pool.hosts.values()}
            assert set(by_node) == {good.node_id, bare.node_id}
            on_good, on_bare = by_node[good.node_id], by_node[bare.node_id]
            held = [await pool.lease("hold-1"), await pool.lease("hold-2")]  # both hosts' one slot
            await next(lease for lease in held if lease.host is on_bare).release()
            holding_good = next(lease for lease in held if lease.host is on_good)
            first = asyncio.create_task(pool.lease("first", timeout=300, image=ref))
            await poll(lambda: on_bare.refusal(ref, 3600) is not None and pool.queue.waiting() == 1,
                       "the bare node's refusal, then the lease waiting")
            why = on_bare.refusal(ref, 3600)
            assert why is not None and bare.node_id in why and "has no image" in why, why
            assert any(ref.split(":")[0].replace("/", "%2F") in r for r in engine.requests)  # asked its engine
            assert not first.done()
            await holding_good.release()
            lease = await asyncio.wait_for(first, 300)
            assert lease.host is on_good
            assert (await lease.bash("busybox echo ok"))["stdout"] == "ok\n"
            await lease.release()
            for i in range(3):  # both free: the image only where it can be served
                async with pool.leased(f"again-{i}", image=ref) as again:
                    assert again.host is on_good
            # the default root is still served on the node that refused the image
            plain = [await pool.lease("plain-1", timeout=120), await pool.lease("plain-2", timeout=120)]
            assert {lease.host for lease in plain} == {on_good, on_bare}
            for lease in plain:
                assert (await lease.bash("echo ok"))["stdout"] == "ok\n"
                await lease.release()
            assert pool._quarantines == 0
    finally:
        engine.close()
        cluster.cluster.remove_node(bare)
        cluster.cluster.remove_node(good)


# -- beside a trainer ------------------------------------------------------------------------------
async def test_a_zero_cpu_sandbox_node_gets_hosts_but_no_trainer_tasks(cluster: RayCluster) -> None:
    """docs/ray.md's setting: a sandbox node started with ``--num-cpus=0`` and the pool with
    ``num_cpus=0``. Hosts are placed there; a trainer's tasks and actors (Ray's default: one CPU
    each) never are, while they do land on sandbox nodes that offer CPUs."""
    node = cluster.cluster.add_node(num_cpus=0, resources={"atropos_sandbox_only": 2}, node_ip_address="127.0.0.1")
    try:
        cluster.cluster.wait_for_nodes()
        backend = make_backend(cluster, slots=1, prewarm=False, resource="atropos_sandbox_only", num_cpus=0.0)
        async with SlotPool(backend, pool_cfg(min_hosts=2, max_hosts=2)) as pool:
            assert {h.info.labels["node"] for h in pool.hosts.values()} == {node.node_id}
            async with pool.leased("on-zero-cpu") as lease:
                assert (await lease.bash("echo ok"))["stdout"] == "ok\n"

            @ray.remote
            def where() -> str:
                return str(ray.get_runtime_context().get_node_id())

            @ray.remote
            class Worker:
                def where(self) -> str:
                    return str(ray.get_runtime_context().get_node_id())

            tasks = ray.get([where.options(scheduling_strategy="SPREAD").remote() for _ in range(24)])
            actors = [Worker.options(scheduling_strategy="SPREAD").remote() for _ in range(4)]  # type: ignore[attr-defined]
            placed = set(tasks) | set(ray.get([a.where.remote() for a in actors]))
            for a in actors:
                ray.kill(a)
            assert node.node_id not in placed
            assert placed & cluster.worker_ids(), "premise: the sandbox nodes with CPUs do get trainer tasks"
    finally:
        cluster.cluster.remove_node(node)


# -- the CLI -------------------------------------------------------------------------------------
def test_cli_pool_on_ray_shows_its_nodes(cluster: RayCluster, tmp_path: Path) -> None:
    import socket

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("ATROPOS_SANDBOX_", "RAY_ADDRESS"))}
        env.update(XDG_CACHE_HOME=str(tmp_path / "cache"), PYTHONPATH=str(REPO))
        return subprocess.run([sys.executable, "-m", "atropos.cli", *args], capture_output=True, text=True,
                              timeout=300, env=env, cwd=REPO)

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    pool_id = f"cliray{os.getpid()}"
    up = cli("pool", "up", "--backend", "ray", "--ray-address", cluster.address, "--pool-id", pool_id,
             "--slots-per-host", "1", "--min-hosts", "2", "--max-hosts", "2", "--port", str(port))
    try:
        assert up.returncode == 0, up.stderr
        status = cli("pool", "status", "--pool-id", pool_id)
        assert status.returncode == 0, status.stderr
        assert f"pool {pool_id} (ray)" in status.stdout and "nodes: 2 (" in status.stdout, status.stdout
        as_json = json.loads(cli("pool", "status", "--json", "--pool-id", pool_id).stdout)
        assert {h["node"] for h in as_json["hosts"]} == cluster.worker_ids()
        ran = cli("exec", "--pool-id", pool_id, "--", "echo", "from-ray")
        assert ran.returncode == 0 and ran.stdout == "from-ray\n", ran.stderr
    finally:
        down = cli("pool", "down", "--pool-id", pool_id)
    assert down.returncode == 0, down.stderr
    prefix = pool_id + "/"
    assert not [a for a in ray.util.list_named_actors(all_namespaces=True) if a["name"].startswith(prefix)]


async def test_reap_kills_the_actors_a_dead_pool_process_left(cluster: RayCluster) -> None:
    """An actor that outlived its owner (detached here, as a stand-in for one Ray has not killed yet)
    is reaped by the next pool with the same id on this machine; a live owner's actor is not."""
    import socket

    from atropos.backends.ray import NAME_SEP, HostActor

    pool_id = f"reap{os.getpid()}"
    gone = subprocess.Popen(["true"])
    gone.wait()
    names = {owner: NAME_SEP.join((pool_id, socket.gethostname(), str(pid), "1"))
             for owner, pid in (("dead", gone.pid), ("alive", os.getppid()))}
    actors = [ray.remote(HostActor).options(name=name, namespace="atropos-sandbox", num_cpus=0,
                                            lifetime="detached").remote({"data_dir": str(DATA_ROOT / pool_id / o)})
              for o, name in names.items()]
    backend = make_backend(cluster, slots=1, pool_id=pool_id)
    await poll(lambda: set(names.values()) <= set(backend.actor_names()), "both actors to be registered")
    assert await backend.reap_orphans() == 1
    await poll(lambda: backend.actor_names() == [names["alive"]], "only the live owner's actor to remain")
    ray.kill(actors[1])
