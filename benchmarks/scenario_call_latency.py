"""call_latency: one tool call end to end through the host's HTTP API, next to its floors.

Variants (timed in alternating chunks, so load changes hit all alike):
- ``bash: true`` / ``bash: echo hello`` / ``read_file 4 KiB``: ``HostClient.call`` against a real
  ``python -m atropos.sandbox`` host (bubblewrap on), one leased slot, its warm supervisor.
- ``fork+exec /bin/true`` [baseline]: ``subprocess.run(['/bin/true'])`` from this process; and
  ``bash -c true`` the same way (what the bash tool forks inside the sandbox).
- ``GET /v1/slots``: an authenticated API request that touches no sandbox (the HTTP floor).
- ``of which host-side`` / ``of which in-sandbox exec``: the host's ``CallResult.duration_ms`` and
  the supervisor's own ``duration_ms`` of the same ``true`` calls (where the end-to-end time goes).
- ``fresh hardened bwrap``: a new sandbox per call, argv from ``atropos.sandbox.host.isolation.bwrap.bwrap_argv``
  with the product's seccomp filter (``--seccomp FD``), ``env={}``, as an unprivileged uid when
  root, running ``/bin/true`` (the design of the reference implementation: one bwrap per call).
- ``docker exec`` (CLI, into a running container) and ``docker run --rm`` (``--entrypoint true``),
  image atropos-sandbox:dev; only when ``docker info`` works.
- ``bash: true (DockerBackend host)``: the same ``HostClient.call`` against a container a SlotPool
  started with the Docker backend (its default isolation options: non-root, no capabilities,
  custom seccomp, port on 127.0.0.1 through docker-proxy), one leased slot. Timed in the same
  interleaved rounds as the two docker CLI rows; only with an engine, the image and the docker SDK.

- ``cpu/call: ...``: CPU time per ``true`` call through the host API, by process, from /proc (load
  inflates it less than wall time): this process (the client), the host process, the slot's
  supervisor, and the bash interpreters it reaped (one started per call).

- ``bash: true (lease.bash)`` / ``(ToolExecutor.execute)``: the routes users take, on one local
  SlotPool host (``benchmarks.routes``): the Python lease API and the executor every AgentEnv
  rollout uses (default config); ``bash: true (REST, ...)``: the ToolServer's
  ``POST /v1/slots/{lease_id}/call`` (``atropos.cli serve``, default settings, own process) with a
  keep-alive ``httpx.AsyncClient`` and with the lean keep-alive client of ``atropos.sandbox.contract.http1``.

- ``... [baseline tree]``: with $ATROPOS_BENCH_BASELINE_TREE set to another revision's source tree
  (``git archive <rev> | tar -x -C DIR``), ``true`` through the host API and the REST routes of a
  host and a ToolServer run from that tree, in the same interleaved rounds: a change's before/after.

Targets (docs/targets.md): ``true`` p50 <= 2x the fork+exec floor measured in the same run, and
>= 5x faster than ``docker exec``; issue 19: direct lease <= 1.0x the floor, executor <= 1.25x the
direct lease, REST <= 2.5x the floor (keep-alive client).
"""

from __future__ import annotations

import asyncio
import os
import secrets
import shutil
import subprocess
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

from benchmarks.common import (
    BASELINE_TREE_ENV,
    BENCH_LABEL,
    DOCKER_IMAGE,
    Row,
    ScenarioResult,
    Target,
    baseline_tree,
    bench_dir,
    docker_pool,
    docker_problem,
    scenario_main,
    start_host,
    time_interleaved,
)
from benchmarks.routes import pool_routes, rest_routes

NAME = "call_latency"
UNPRIVILEGED_UID = 65534


def _bwrap_setup(root: Path) -> tuple[list[str], str, dict[str, Any]]:
    """argv (with a {fd} placeholder), seccomp path and subprocess ids for a fresh-bwrap call."""
    from atropos.sandbox.host.config import HostConfig, Limits
    from atropos.sandbox.host.isolation.bwrap import SandboxPaths, bwrap_argv
    from atropos.sandbox.host.isolation.seccomp import write_filter

    cfg = HostConfig()
    paths = SandboxPaths(workspace=root / "ws", run_dir=root / "run", lib_dir=root / "lib", etc_dir=root / "etc")
    for d in (paths.workspace, paths.run_dir, paths.lib_dir, paths.etc_dir):
        d.mkdir(parents=True, exist_ok=True)
    (paths.etc_dir / "passwd").write_text("sandbox:x:1000:1000:sandbox:/workspace:/bin/bash\n")
    (paths.etc_dir / "group").write_text("sandbox:x:1000:\n")
    (paths.etc_dir / "hosts").write_text("127.0.0.1 localhost sandbox\n")
    ids: dict[str, Any] = {}
    if os.geteuid() == 0:
        for d in (paths.workspace, paths.run_dir):
            os.chown(d, UNPRIVILEGED_UID, UNPRIVILEGED_UID)
        ids = {"user": UNPRIVILEGED_UID, "group": UNPRIVILEGED_UID, "extra_groups": []}
    for d in (root, paths.lib_dir, paths.etc_dir):
        os.chmod(d, 0o755)
    for f in paths.etc_dir.iterdir():
        os.chmod(f, 0o644)
    seccomp_path = str(write_filter(root / "seccomp.bpf"))
    argv = bwrap_argv(cfg.bwrap, paths, Limits(), network=False, seccomp_fd=-1)
    argv[argv.index("-1")] = "{fd}"
    return [*argv, "/bin/true"], seccomp_path, ids


def _fresh_bwrap(argv: list[str], seccomp_path: str, ids: dict[str, Any]) -> None:
    fd = os.open(seccomp_path, os.O_RDONLY)  # bwrap consumes the offset: a fresh fd per call
    try:
        subprocess.run([str(fd) if a == "{fd}" else a for a in argv], pass_fds=(fd,), env={}, check=True, **ids)
    finally:
        os.close(fd)


def _fork_exec() -> None:
    subprocess.run(["/bin/true"], check=True)


def _fork_exec_bash() -> None:
    subprocess.run(["/bin/bash", "-c", "true"], check=True)


async def _start_docker_pool() -> tuple[Any, str]:
    """A started one-container SlotPool on the Docker backend, or (None, why not)."""
    try:
        pool = docker_pool(f"bench-latency-{os.getpid()}", hosts=1, slots_per_host=2)
    except Exception as exc:  # no docker SDK (ConfigError), bad settings
        return None, str(exc)
    try:
        await pool.start()
    except Exception as exc:
        return None, f"the pool container did not start: {exc}"[:300]
    return pool, ""


async def run(quick: bool) -> ScenarioResult:
    from atropos.sandbox.contract.protocol import ToolCall

    n_api = 100 if quick else 600
    n_fork = 100 if quick else 600
    n_bwrap = 40 if quick else 200
    n_dexec = 10 if quick else 60
    n_drun = 3 if quick else 12
    res = ScenarioResult(NAME, "one tool call end to end through the host API vs its floors",
                         params={"n_api": n_api, "n_fork": n_fork, "n_bwrap": n_bwrap, "n_docker_exec": n_dexec,
                                 "n_docker_run": n_drun})
    root = bench_dir(NAME)
    try:
        host = await asyncio.to_thread(start_host, root / "host", 2)
    except BaseException:
        shutil.rmtree(root, ignore_errors=True)
        raise
    client = host.client()
    container_id: str | None = None
    docker_pool: Any = None
    routes = AsyncExitStack()
    try:
        lease = await client.lease("bench-call-latency")

        host_ms: list[float] = []  # CallResult.duration_ms of `true` (inside the host process)
        exec_ms: list[float] = []  # result["duration_ms"] of `true` (fork..wait inside the sandbox)

        def tool(name: str, args: dict[str, Any], record: bool = False) -> Any:
            async def call() -> None:
                result = await client.call(ToolCall(id=secrets.token_hex(4), slot=lease.slot, lease=lease.lease,
                                                    tool=name, args=args))
                if not result.ok:
                    raise RuntimeError(f"{name} failed: {result.error}")
                if record:
                    host_ms.append(result.duration_ms)
                    exec_ms.append(float((result.result or {}).get("duration_ms", float("nan"))))
            return call

        content = ("x" * 63 + "\n") * 64  # 4 KiB
        await tool("write_file", {"path": "four_k.txt", "content": content})()
        argv, seccomp_path, ids = await asyncio.to_thread(_bwrap_setup, root / "bwrap")
        user_routes = {**await pool_routes(routes), **await rest_routes(routes, root)}
        user_routes.update(await _baseline_routes(routes, root))

        variants: dict[str, tuple[Any, int]] = {
            "fork+exec /bin/true": (_fork_exec, n_fork),
            "bash -c true (fork+exec)": (_fork_exec_bash, n_fork),
            "bash: true (host API)": (tool("bash", {"command": "true"}, record=True), n_api),
            "bash: echo hello (host API)": (tool("bash", {"command": "echo hello"}), n_api),
            "read_file 4 KiB (host API)": (tool("read_file", {"path": "four_k.txt"}), n_api),
            "GET /v1/slots (HTTP, no sandbox)": (client.slots, n_api),
            "fresh hardened bwrap /bin/true": (lambda: _fresh_bwrap(argv, seccomp_path, ids), n_bwrap),
            **{name: (fn, n_api) for name, fn in user_routes.items()},
        }
        problem = await asyncio.to_thread(docker_problem)
        if problem is None:
            out = await asyncio.to_thread(subprocess.run, [
                "docker", "run", "-d", "--rm", "--label", f"{BENCH_LABEL}=1", "--entrypoint", "sleep",
                DOCKER_IMAGE, "infinity"], capture_output=True, text=True, timeout=60)
            if out.returncode != 0:
                problem = f"could not start a container: {out.stderr.strip()[:200]}"
            else:
                container_id = out.stdout.strip()
                cid = container_id
                variants["docker exec true (CLI)"] = (
                    lambda: subprocess.run(["docker", "exec", cid, "true"], check=True), n_dexec)
                variants["docker run --rm true (CLI)"] = (
                    lambda: subprocess.run(["docker", "run", "--rm", "--label", f"{BENCH_LABEL}=1",
                                            "--entrypoint", "true", DOCKER_IMAGE], check=True), n_drun)
            docker_pool, docker_problem_ = await _start_docker_pool()
            if docker_pool is None:
                res.notes.append(f"bash: true (DockerBackend host): skipped: {docker_problem_}")
            else:
                dlease = await docker_pool.lease("bench-call-latency-docker")
                dclient = dlease.host.client

                async def docker_true() -> None:
                    result = await dclient.call(dlease.tool_call("bash", {"command": "true"}))
                    if not result.ok:
                        raise RuntimeError(f"bash true in the container failed: {result.error}")

                variants["bash: true (DockerBackend host)"] = (docker_true, n_api)
        samples = await time_interleaved(variants, warmup=3 if quick else 5, rounds=5 if quick else 10)
        cpu_rows = await _cpu_breakdown(host.proc.pid, tool("bash", {"command": "true"}), n_api * 2)
        if f"bash: true (host API){BASELINE}" in variants:
            host_call = tool("bash", {"command": "true"})
            host_call.pid = host.proc.pid  # type: ignore[attr-defined]
            lean = "bash: true (REST, lean keep-alive)"
            cpu_rows += await _route_cpu_rows({
                "host process per /v1/call": (host_call, variants[f"bash: true (host API){BASELINE}"][0]),
                "ToolServer process per REST call": (variants[lean][0], variants[lean + BASELINE][0])}, n_api * 2)
        await client.release(lease.slot, lease.lease)
    finally:
        await routes.aclose()
        await client.aclose()
        await asyncio.to_thread(host.stop)
        if docker_pool is not None:
            await docker_pool.stop()  # removes its container
        if container_id:
            await asyncio.to_thread(subprocess.run, ["docker", "rm", "-f", container_id], capture_output=True)
        shutil.rmtree(root, ignore_errors=True)

    floor = Row("fork+exec /bin/true", samples["fork+exec /bin/true"], baseline=True)
    true_row = Row("bash: true (host API)", samples["bash: true (host API)"])
    warm = (3 if quick else 5)
    res.rows = [floor, Row("bash -c true (fork+exec)", samples["bash -c true (fork+exec)"]), true_row,
                Row("  of which host-side", host_ms[warm:],
                    note="CallResult.duration_ms: lease check, slot lock, supervisor round trip"),
                Row("  of which in-sandbox exec", exec_ms[warm:],
                    note="the supervisor's own duration_ms: Popen of bash .. wait, pipes drained"),
                Row("bash: echo hello (host API)", samples["bash: echo hello (host API)"]),
                Row("read_file 4 KiB (host API)", samples["read_file 4 KiB (host API)"]),
                Row("GET /v1/slots (HTTP, no sandbox)", samples["GET /v1/slots (HTTP, no sandbox)"],
                    note="httpx client + uvicorn/FastAPI + auth + JSON, nothing run in a slot"),
                Row("fresh hardened bwrap /bin/true", samples["fresh hardened bwrap /bin/true"],
                    note="bwrap_argv + product seccomp filter, env={}, "
                         + (f"uid {UNPRIVILEGED_UID}" if os.geteuid() == 0 else "own uid"))]
    res.rows += _route_rows(res, samples, floor)
    res.rows += [Row(name, samples[name], base=name.removesuffix(BASELINE),
                     note=f"the same route served by {tree} (${BASELINE_TREE_ENV}); x base = / this tree's p50")
                 for name in samples if name.endswith(BASELINE) and (tree := baseline_tree())]
    res.rows += _breakdown(res)
    res.rows += cpu_rows
    true_row.target = "p50 <= 2x floor"
    true_row.passed = true_row.p50 <= 2 * floor.p50
    res.targets.append(Target("`true` p50 <= 2x fork+exec floor",
                              f"{true_row.p50:.2f} ms vs 2 x {floor.p50:.2f} = {2 * floor.p50:.2f} ms "
                              f"({true_row.p50 / floor.p50:.2f}x)", true_row.passed))
    if problem is None:
        dexec = Row("docker exec true (CLI)", samples["docker exec true (CLI)"])
        drun = Row("docker run --rm true (CLI)", samples["docker run --rm true (CLI)"])
        res.rows += [dexec, drun]
        if "bash: true (DockerBackend host)" in samples:
            res.rows.append(Row("bash: true (DockerBackend host)", samples["bash: true (DockerBackend host)"],
                                note="HostClient -> docker-proxy on 127.0.0.1 -> host in a pool container"))
        speedup = dexec.p50 / true_row.p50
        res.targets.append(Target("`true` >= 5x faster than docker exec (p50)",
                                  f"{true_row.p50:.2f} ms vs {dexec.p50:.2f} ms ({speedup:.1f}x)", speedup >= 5))
        true_row.target += ", >= 5x docker exec"
        true_row.passed = bool(true_row.passed and speedup >= 5)
    else:
        res.notes.append(f"docker exec / docker run / DockerBackend host: skipped: {problem}")
        res.targets.append(Target("`true` >= 5x faster than docker exec (p50)", f"skipped: {problem}", None))
    return res


BASELINE = " [baseline tree]"


async def _baseline_routes(stack: AsyncExitStack, root: Path) -> dict[str, Any]:
    """With $ATROPOS_BENCH_BASELINE_TREE: ``true`` through the host API and the REST routes of a host
    and a ToolServer run from that tree, timed in the same interleaved rounds as this tree's."""
    from atropos.sandbox.contract.protocol import ToolCall

    tree = baseline_tree()
    if tree is None:
        return {}
    host = await asyncio.to_thread(start_host, root / "host-baseline", 2, None, tree)
    stack.callback(host.stop)
    client = host.client()
    stack.push_async_callback(client.aclose)
    lease = await client.lease("bench-call-latency-baseline")

    async def host_true() -> None:
        result = await client.call(ToolCall(id=secrets.token_hex(4), slot=lease.slot, lease=lease.lease,
                                            tool="bash", args={"command": "true"}))
        if not result.ok:
            raise RuntimeError(f"baseline tree: true failed: {result.error}")

    host_true.pid = host.proc.pid  # type: ignore[attr-defined]
    return {f"bash: true (host API){BASELINE}": host_true, **await rest_routes(stack, root, tree, BASELINE)}


async def _cpu_per_call(pid: int, call: Any, n: int) -> float:
    """CPU time (us) of process ``pid`` itself per call, over ``n`` back-to-back calls: unlike wall
    time, barely moved by the load of a shared machine."""
    for _ in range(5):
        await call()
    before = _cpu_of(pid)[0]
    for _ in range(n):
        await call()
    return (_cpu_of(pid)[0] - before) / n * 1e6


async def _route_cpu_rows(pairs: dict[str, tuple[Any, Any]], n: int) -> list[Row]:
    """Per route, this tree's and the baseline tree's server CPU per ``true`` call, alternating in
    chunks (with $ATROPOS_BENCH_BASELINE_TREE)."""
    rows = []
    for label, (this, base) in pairs.items():
        ours, theirs = [], []
        for _ in range(4):
            ours.append(await _cpu_per_call(this.pid, this, n // 4))
            theirs.append(await _cpu_per_call(base.pid, base, n // 4))
        mine, other = sum(ours) / len(ours), sum(theirs) / len(theirs)
        rows.append(Row(f"cpu/call: {label}", value=round(mine), unit="us"))
        rows.append(Row(f"cpu/call: {label}{BASELINE}", value=round(other), unit="us",
                        note=f"this tree / baseline tree = {mine / other:.2f}x"))
    return rows


def _route_rows(res: ScenarioResult, samples: dict[str, list[float]], floor: Row) -> list[Row]:
    """The user routes' rows and their targets (issue 19), as ratios in this run."""
    direct = Row("bash: true (lease.bash)", samples["bash: true (lease.bash)"],
                 target="p50 <= 1.0x floor", note="SlotPool lease API, local pool host")
    direct.passed = direct.p50 <= floor.p50
    executor = Row("bash: true (ToolExecutor.execute)", samples["bash: true (ToolExecutor.execute)"],
                   base="bash: true (lease.bash)", target="p50 <= 1.25x lease.bash",
                   note="x base = / lease.bash p50; default ExecutorConfig, same host as lease.bash")
    executor.passed = executor.p50 <= 1.25 * direct.p50
    rows = [direct, executor]
    res.targets += [
        Target("lease.bash `true` p50 <= 1.0x fork+exec floor",
               f"{direct.p50:.2f} ms vs {floor.p50:.2f} ms ({direct.p50 / floor.p50:.2f}x)", direct.passed),
        Target("ToolExecutor.execute `true` p50 <= 1.25x lease.bash",
               f"{executor.p50:.2f} ms vs {direct.p50:.2f} ms ({executor.p50 / direct.p50:.2f}x)", executor.passed)]
    for client in ("httpx", "lean"):
        name = f"bash: true (REST, {client} keep-alive)"
        row = Row(name, samples[name], target="p50 <= 2.5x floor",
                  note="ToolServer POST /v1/slots/{id}/call, `atropos.cli serve` default settings")
        row.passed = row.p50 <= 2.5 * floor.p50
        rows.append(row)
        res.targets.append(Target(f"REST `true` p50 <= 2.5x fork+exec floor ({client} client)",
                                  f"{row.p50:.2f} ms vs 2.5 x {floor.p50:.2f} = {2.5 * floor.p50:.2f} ms "
                                  f"({row.p50 / floor.p50:.2f}x)", row.passed))
    return rows


def _cpu_of(pid: int) -> tuple[float, float]:
    """(own utime+stime, reaped children's cutime+cstime) of ``pid`` in seconds, or zeros."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_bytes().rsplit(b")", 1)[1].split()
    except OSError:
        return 0.0, 0.0
    tck = os.sysconf("SC_CLK_TCK")
    return (int(fields[11]) + int(fields[12])) / tck, (int(fields[13]) + int(fields[14])) / tck


async def _cpu_breakdown(host_pid: int, call: Any, n: int) -> list[Row]:
    """CPU per `true` call through the host API, by process: n calls back to back, /proc before and after."""
    from benchmarks.common import process_tree

    def supervisors() -> list[int]:
        """The slots' supervisors: slotd (the compiled one, docs/native-supervisor.md) or supervisor.py."""
        found = []
        for pid in process_tree([host_pid]):
            try:
                if (Path(f"/proc/{pid}/comm").read_bytes().strip() == b"slotd"
                        or b"supervisor.py" in Path(f"/proc/{pid}/cmdline").read_bytes()):
                    found.append(pid)
            except OSError:
                continue
        return found

    for _ in range(5):
        await call()
    sups = supervisors()

    def snap() -> tuple[float, float, float, float]:
        ru = os.times()
        per_sup = [_cpu_of(p) for p in sups]
        return (ru.user + ru.system, _cpu_of(host_pid)[0], sum(c[0] for c in per_sup), sum(c[1] for c in per_sup))

    before = snap()
    for _ in range(n):
        await call()
    after = snap()
    names = ("client: HostClient + event loop (this process)",
             "host process: HTTP route, lease check, slot lock, frames",
             "supervisor: request, go, wait, reap, next warm bash spawned",
             "bash interpreters (exec, start-up, run, exit)")
    return [Row(f"cpu/call: {name}", value=round((b - a) / n * 1e6), unit="us",
                note=f"CPU time per call over {n} back-to-back calls, from /proc" if i == 0 else "")
            for i, (name, a, b) in enumerate(zip(names, before, after, strict=True))]


def _breakdown(res: ScenarioResult) -> list[Row]:
    """Where a `true` call's time goes, layer by layer: differences of the p50s above (approximate:
    medians do not subtract exactly; the host API rows run on their own host, same code)."""
    p50 = {r.name: r.p50 for r in res.rows if r.samples_ms}
    layers = [
        ("bash in the sandbox (supervisor: go .. exit .. reaped)", p50["  of which in-sandbox exec"]),
        ("host: validation, lease check, slot lock, supervisor frames",
         p50["  of which host-side"] - p50["  of which in-sandbox exec"]),
        ("HTTP: lean client + uvicorn + raw /v1/call route",
         p50["bash: true (host API)"] - p50["  of which host-side"]),
        ("pool layer: Lease, host guard", p50["bash: true (lease.bash)"] - p50["bash: true (host API)"]),
        ("ToolExecutor: queue, batch, format",
         p50["bash: true (ToolExecutor.execute)"] - p50["bash: true (lease.bash)"]),
        ("ToolServer: 2nd HTTP hop + REST route (lean client)",
         p50["bash: true (REST, lean keep-alive)"] - p50["bash: true (lease.bash)"]),
    ]
    return [Row(f"breakdown: {name}", value=round(ms, 3), unit="ms",
                note="p50 differences of the rows above" if i == 0 else "") for i, (name, ms) in enumerate(layers)]


if __name__ == "__main__":
    scenario_main(NAME, run)
