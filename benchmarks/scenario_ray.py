"""ray: Ray-placed hosts beside the local backend: cold start of 4 hosts x 16 slots, warm lease
latency and the latency of a ``true`` call.

Ray runs as a head and two worker nodes on this machine (``ray.cluster_utils.Cluster``, all on
127.0.0.1, no dashboard); the workers offer the ``atropos_sandbox`` resource. The same
SlotPool measurements run on the local backend, in the same run, as the baseline.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import time
from typing import Any

from benchmarks.common import BENCH_ROOT, Row, ScenarioResult, backend_pool, scenario_main

NAME = "ray"
HOSTS, SLOTS = 4, 16


async def _measure(pool: Any, n_leases: int, n_calls: int) -> tuple[float, list[float], list[float]]:
    t0 = time.perf_counter()
    await pool.start()
    cold = time.perf_counter() - t0
    lease_ms: list[float] = []
    for r in range(max(1, n_leases // SLOTS)):
        held = []
        for k in range(SLOTS):
            t = time.perf_counter()
            held.append(await pool.lease(f"r{r}-{k}"))
            lease_ms.append((time.perf_counter() - t) * 1e3)
        await asyncio.gather(*(pool.release(lease) for lease in held))
    call_ms: list[float] = []
    async with pool.leased("calls") as lease:
        await lease.bash("true")
        for _ in range(n_calls):
            t = time.perf_counter()
            await lease.bash("true")
            call_ms.append((time.perf_counter() - t) * 1e3)
    return cold, lease_ms, call_ms


async def run(quick: bool) -> ScenarioResult:
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"  # keep Ray on 127.0.0.1 (atropos/backends/ray.py)
    try:
        import ray
        from ray.cluster_utils import Cluster
    except ImportError:
        res = ScenarioResult(NAME, "Ray-placed hosts")
        res.skipped = "ray is not installed (pip install 'atropos-sandbox[ray]')"
        return res
    n_leases, n_calls = (64, 100) if quick else (320, 500)
    res = ScenarioResult(NAME, f"Ray-placed hosts vs local: cold start {HOSTS}x{SLOTS}, warm lease, `true` call",
                         params={"hosts": HOSTS, "slots_per_host": SLOTS, "leases": n_leases, "calls": n_calls,
                                 "cluster": "head + 2 workers on 127.0.0.1 (ray.cluster_utils.Cluster)"})
    t0 = time.perf_counter()
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "node_ip_address": "127.0.0.1",
                                                            "include_dashboard": False})
    workers = [cluster.add_node(num_cpus=4, resources={"atropos_sandbox": 8}, node_ip_address="127.0.0.1")
               for _ in range(2)]
    ray.init(address=cluster.address, _node_ip_address="127.0.0.1", include_dashboard=False, log_to_driver=False)
    res.notes.append(f"Ray cluster (head + 2 workers) up in {time.perf_counter() - t0:.1f} s, not counted")
    results: dict[str, tuple[float, list[float], list[float]]] = {}
    try:
        for kind, kw in (("local", {"data_root": BENCH_ROOT / "local"}),
                         ("ray", {"address": cluster.address, "num_cpus": 0.5, "data_root": BENCH_ROOT / "ray"})):
            pool_id = f"bench-{kind}-{os.getpid()}"
            pool = backend_pool(kind, pool_id, HOSTS, SLOTS, {"max_timeout_s": 120, **kw})
            try:
                results[kind] = await _measure(pool, n_leases, n_calls)
            finally:
                await pool.stop()
                shutil.rmtree(BENCH_ROOT / kind / pool_id, ignore_errors=True)
        loss = await _node_loss(cluster, workers)
    finally:
        ray.shutdown()
        cluster.shutdown()
    for kind in ("local", "ray"):
        cold, lease_ms, call_ms = results[kind]
        base = kind == "local"
        res.rows += [
            Row(f"{kind}: cold start {HOSTS}x{SLOTS} (prewarmed)", value=cold, unit="s", baseline=base),
            Row(f"{kind}: pool.lease() warm", lease_ms, baseline=base),
            Row(f"{kind}: bash `true` call", call_ms, baseline=base),
        ]
    res.rows.append(Row("ray: node removed -> in-flight call fails (HostUnavailable)", value=loss[0], unit="s",
                        note="a `sleep 30` running on the removed node's host"))
    res.rows.append(Row("ray: node removed -> pool has declared the host lost", value=loss[1], unit="s"))
    return res


async def _node_loss(cluster: Any, workers: list[Any]) -> tuple[float, float]:
    """Seconds from removing a worker node to (the call on its host failing, the pool counting the host lost)."""
    from atropos.errors import HostUnavailable

    pool = backend_pool("ray", f"bench-loss-{os.getpid()}", 2, 1,
                        {"address": cluster.address, "num_cpus": 0.5, "data_root": BENCH_ROOT / "ray",
                         "prewarm": False})
    await pool.start()
    try:
        lease = await pool.lease("victim")
        node = lease.host.info.labels["node"]
        victim = next(w for w in workers if w.node_id == node)
        call = asyncio.ensure_future(lease.bash("sleep 30", timeout_s=60))
        await asyncio.sleep(1.0)
        lost_before = pool.status().lost_hosts
        t0 = time.perf_counter()
        await asyncio.to_thread(cluster.remove_node, victim)
        try:
            await call
        except HostUnavailable:
            pass
        failed = time.perf_counter() - t0
        while pool.status().lost_hosts == lost_before:
            await asyncio.sleep(0.01)
        declared = time.perf_counter() - t0
        await lease.release()
    finally:
        await pool.stop()
    return failed, declared


if __name__ == "__main__":
    scenario_main(NAME, run)
