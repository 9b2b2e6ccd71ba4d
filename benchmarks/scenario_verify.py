"""verify: the SWE example's verification (gold patch) before and after the fresh root (issue 35),
beside a container per grade as SWE-bench's harness does it.

One task of the SWE example (``strkit-1``; its image built by ``atropos/envs/examples/swe_tasks.py``),
the gold fix applied with ``edit_file`` in a leased slot (not timed), then timed, interleaved round by
round:

- **after: fresh root**: ``lease.seal()`` + ``run_repo_tests`` as it is now (a new root of the image
  plus the agent's repository diff, the tests as the task's command runs them);
- **before: restore on the agent's root**: ``lease.seal()`` + the ``run_repo_tests`` of the commit
  before issue 35 (``BEFORE_REV``, loaded from git): the tests, their settings and the env's
  start-up paths restored in the agent's own root, pytest under ``-I``;
- **container** (the baseline row, what the official harness pays per grade): ``docker run --rm`` of
  the task image, the gold patch applied with ``git apply``, the same tests with ``python -m pytest``;
- the verification root alone: a trivial verifier program on the agent's root vs on a fresh root
  (the difference is what building and dropping the root costs).

``python -m benchmarks.scenario_verify [--quick]``
"""

from __future__ import annotations

import ast
import asyncio
import difflib
import importlib.util
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.common import (
    BENCH_ROOT,
    REPO,
    Row,
    ScenarioResult,
    docker_problem,
    local_pool,
    scenario_main,
    time_interleaved,
)

NAME = "verify"
BEFORE_REV = "1a4b656"  # main before issue 35
INSTANCE = "strkit-1"
TRIVIAL = "def verify(workspace, secrets, args):\n    return 1.0\n"


def _old_module(path: str) -> str:
    return subprocess.run(["git", "-C", str(REPO), "show", f"{BEFORE_REV}:{path}"], capture_output=True, text=True,
                          check=True).stdout


def old_repo_tests(task: Any) -> tuple[Any, Any]:
    """The commit's ``run_repo_tests`` and its ``RepoTests`` for ``task`` (its start-up paths read
    from the base image by the commit's own script, one container run)."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "old_repo_tests.py"
        path.write_text(_old_module("atropos/envs/repo_tests.py"))
        spec = importlib.util.spec_from_file_location("old_repo_tests", path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    tree = ast.parse(_old_module("atropos/envs/examples/swe_tasks.py"))
    script = next(n.value.value for n in tree.body if isinstance(n, ast.Assign)
                  and getattr(n.targets[0], "id", "") == "STARTUP_PATHS")
    from atropos.envs.examples.swe_repos import REPOS
    from atropos.envs.examples.swe_tasks import BASE_IMAGE, ENV_PREFIX, PYTHON

    startup = subprocess.run(["docker", "run", "--rm", "--network", "none", "--entrypoint", "/usr/bin/python3",
                              BASE_IMAGE, "-I", "-c", script], capture_output=True, text=True,
                             check=True).stdout.split()
    repo = next(r for r in REPOS if r.instance_id == task.instance_id)
    tests = module.RepoTests(repo_dir="/testbed", python=PYTHON, pytest_config=repo.pytest_config,
                             test_files=task.tests.test_files, fail_to_pass=repo.fail_to_pass,
                             pass_to_pass=repo.pass_to_pass, system_paths=[ENV_PREFIX, *startup])
    return module.run_repo_tests, tests


def gold_patch(task: Any) -> str:
    """The gold edits as a ``git apply`` patch (read from the image's files)."""
    out = []
    for e in task.gold:
        before = subprocess.run(["docker", "run", "--rm", "--network", "none", task.image, "cat", e.path],
                                capture_output=True, text=True, check=True).stdout
        after = before.replace(e.old, e.new, 1)
        out += difflib.unified_diff(before.splitlines(True), after.splitlines(True), f"a/{e.path}", f"b/{e.path}")
    return "".join(out)


async def run(quick: bool) -> ScenarioResult:
    n = 5 if quick else 20
    res = ScenarioResult(NAME, f"SWE example verification, gold patch ({INSTANCE}): seal + verify",
                         params={"n": n, "instance": INSTANCE, "before": BEFORE_REV, "hosts": 1, "slots": 2})
    problem = docker_problem(None)
    if problem is not None:
        res.skipped = problem
        return res
    from atropos.envs.examples.swe_tasks import task_images
    from atropos.envs.repo_tests import run_repo_tests

    task = next(t for t in await asyncio.to_thread(task_images) if t.instance_id == INSTANCE)
    old_run, old_tests = await asyncio.to_thread(old_repo_tests, task)
    patch = await asyncio.to_thread(gold_patch, task)
    ids = " ".join(f"'{i}'" for i in task.tests.ids)
    container_cmd = (f"git apply -v - <<'EOF_PATCH' >/dev/null\n{patch}EOF_PATCH\n"
                     f"python -m pytest -p no:cacheprovider -q {ids}")
    pool = local_pool(f"bench-verify-{time.monotonic_ns() % 10**6}", 1, 2)
    await pool.start()
    scores: dict[str, list[float]] = {}
    try:
        await pool.prepare_images([task.image])

        def graded(name: str, verify: Any) -> Any:
            async def once() -> None:
                async with pool.leased(f"bench-{name}", image=task.image) as lease:
                    for e in task.gold:
                        await lease.ok("edit_file", {"path": f"/testbed/{e.path}", "old_string": e.old,
                                                     "new_string": e.new})
                    t0 = time.perf_counter()
                    await lease.seal()
                    score = await verify(lease)
                    samples[name].append((time.perf_counter() - t0) * 1e3)
                    scores.setdefault(name, []).append(score)
            return once

        async def fresh(lease: Any) -> float:
            return (await run_repo_tests(lease, task.tests, timeout_s=60))[0]

        async def before(lease: Any) -> float:
            return float((await old_run(lease, old_tests, timeout_s=60))[0])

        async def trivial_agent_root(lease: Any) -> float:
            return float((await lease.verify(TRIVIAL)).score or 0)

        async def trivial_fresh_root(lease: Any) -> float:
            return float((await lease.verify(TRIVIAL, fresh_root=task.tests.fresh_root())).score or 0)

        def container() -> None:
            t0 = time.perf_counter()
            done = subprocess.run(["docker", "run", "--rm", "--network", "none", task.image, "bash", "-c",
                                   container_cmd], capture_output=True, timeout=300)
            samples["container"].append((time.perf_counter() - t0) * 1e3)
            scores.setdefault("container", []).append(1.0 if done.returncode == 0 else 0.0)

        samples: dict[str, list[float]] = {k: [] for k in ("fresh", "before", "container", "trivial_agent",
                                                           "trivial_fresh")}
        variants = {"fresh": graded("fresh", fresh), "before": graded("before", before),
                    "container": lambda: asyncio.to_thread(container),
                    "trivial_agent": graded("trivial_agent", trivial_agent_root),
                    "trivial_fresh": graded("trivial_fresh", trivial_fresh_root)}
        await time_interleaved({k: (fn, n) for k, fn in variants.items()}, warmup=1, rounds=n)
    finally:
        await pool.stop()
        shutil.rmtree(BENCH_ROOT / "local" / pool.cfg.pool_id, ignore_errors=True)
    for k in samples:  # the warm-up ran once untimed per variant; time_interleaved's own times include leases
        samples[k] = samples[k][1:]
    res.rows = [
        Row("container: docker run + git apply + pytest", samples["container"], baseline=True,
            note=f"scores {sorted(set(scores.get('container', [])))}"),
        Row("before: restore on the agent's root (seal + verify)", samples["before"],
            note=f"scores {sorted(set(scores.get('before', [])))}"),
        Row("after: fresh root (seal + verify)", samples["fresh"],
            note=f"scores {sorted(set(scores.get('fresh', [])))}"),
        Row("trivial program, agent's root (seal + verify)", samples["trivial_agent"]),
        Row("trivial program, fresh root (seal + verify)", samples["trivial_fresh"],
            base="trivial program, agent's root (seal + verify)"),
    ]
    after, before_row = res.rows[2], res.rows[1]
    res.notes.append(f"after / before p50: {after.p50 / before_row.p50:.2f}x; fresh root build + drop p50 "
                     f"~{res.rows[4].p50 - res.rows[3].p50:.0f} ms (trivial program rows)")
    return res


if __name__ == "__main__":
    sys.exit(scenario_main(NAME, run))
