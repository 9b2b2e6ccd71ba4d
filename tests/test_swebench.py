"""SWE-bench instances as published (atropos/envs/swebench_tasks.py): SWE-bench-format rows of the
SWE example's tasks on SWE-bench-shaped images built here (tests/swebench_rows.py) are graded on a
fresh root with the official package's own evaluation script and log parser, and the verdict is the
official harness's (``run_instance``: a container of the same image, the same prediction) for the
gold patch, no patch and the cheat patches it catches; where it grades a cheat as the patch leaves
the repository (a planted ``conftest.py``) the fresh root's verdict is 0 and the official one 1.
"""

from __future__ import annotations

import os
import secrets
import subprocess
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio

from atropos.envs.swebench_tasks import SweBenchTask, apply_patch_command, load_instances, run_swebench_eval
from atropos.slots.pool import SlotPool
from tests.pool_backends import local_pool
from tests.test_reward_forgery import SWE_ROWS

pytestmark = pytest.mark.docker
in_module_loop = pytest.mark.asyncio(loop_scope="module")
pytest.importorskip("swebench", reason="the official package is the swebench extra")


@pytest.fixture(scope="module")
def tasks() -> dict[str, SweBenchTask]:
    from tests.pool_backends import require_docker
    from tests.swebench_rows import rows

    require_docker()
    return {t.instance_id: t for t in load_instances(rows())}


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def pool(tasks: dict[str, SweBenchTask]) -> AsyncIterator[SlotPool]:
    async with local_pool(2, "swebench") as p:
        await p.prepare_images([t.image for t in tasks.values()])
        yield p


def cheat_patch(task: SweBenchTask, row: str) -> str:
    """The repository diff a forgery row leaves in a container of the image (what an agent
    submitting a patch would submit)."""
    from atropos.envs.examples.swe_tasks import task_images

    swe_task = next(t for t in task_images() if t.instance_id == task.instance_id)
    script = SWE_ROWS[row](swe_task) + "\ncd /testbed && git add -A && git diff --cached --binary HEAD\n"
    done = subprocess.run(["docker", "run", "--rm", "--network", "none", task.image, "bash", "-c", script],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return done.stdout


def official(task: SweBenchTask, patch: str, tmp: Path) -> bool:
    """The official harness's verdict: ``run_instance`` in a container of the image."""
    import docker
    from swebench.harness.run_evaluation import run_instance

    here = os.getcwd()
    os.chdir(tmp)  # it writes its logs under ./logs
    try:
        client = docker.from_env()
        out = run_instance(task.test_spec(), {"instance_id": task.instance_id, "model_name_or_path": "test",
                                              "model_patch": patch}, client, f"run{secrets.token_hex(3)}", timeout=300)
    finally:
        os.chdir(here)
    return bool(out and out[1][task.instance_id]["resolved"])


async def ours(pool: SlotPool, task: SweBenchTask, patch: str) -> tuple[float, dict[str, Any]]:
    async with pool.leased(f"swebench-{secrets.token_hex(3)}", image=task.image) as lease:
        if patch:
            done = await lease.bash(apply_patch_command(patch), timeout_s=120)
            assert done.exit_code == 0, done.stderr
        await lease.seal()
        return await run_swebench_eval(lease, task, timeout_s=120)


def test_rows_load_through_the_official_test_spec(tasks: dict[str, SweBenchTask]) -> None:
    task = tasks["strkit-1"]
    spec = task.test_spec()
    assert spec.log_parser == "parse_log_pytest" and spec.eval_script.startswith("#!/bin/bash\nset -uxo pipefail")
    assert "SWEBENCH_TEST_EXIT_CODE=$?" in spec.eval_script  # the package's own rewrite of the script
    assert "tests" in task.fresh_root().from_image  # the test directory, whole


@in_module_loop
@pytest.mark.parametrize("instance", ["strkit-1", "datewise-1", "inikit-1"])
async def test_gold_and_empty_match_the_official_harness(pool: SlotPool, tasks: dict[str, SweBenchTask],
                                                         instance: str, tmp_path: Path) -> None:
    task = tasks[instance]
    for patch, want in ((task.patch, 1.0), ("", 0.0)):
        score, info = await ours(pool, task, patch)
        assert score == want, info
        assert official(task, patch, tmp_path) == (want == 1.0)
    assert info["tests_status"]["FAIL_TO_PASS"]["failure"], info


@in_module_loop
@pytest.mark.parametrize("row", ["edit_tests", "symlink_test_file", "addopts_deselect"])
async def test_a_cheat_patch_gets_the_official_verdict(pool: SlotPool, tasks: dict[str, SweBenchTask], row: str,
                                                       tmp_path: Path) -> None:
    task = tasks["strkit-1"]
    patch = cheat_patch(task, row)
    assert patch.startswith("diff --git")
    score, info = await ours(pool, task, patch)
    assert score == 0.0, info
    assert official(task, patch, tmp_path) is False


@in_module_loop
async def test_a_planted_conftest_fools_the_official_harness_not_the_fresh_root(
        pool: SlotPool, tasks: dict[str, SweBenchTask], tmp_path: Path) -> None:
    """The one documented difference: the official harness grades the repository as the patch
    leaves it but for the test patch's files, so a conftest.py reporting every test passed wins
    there; the fresh root takes test settings from the image."""
    task = tasks["strkit-1"]
    patch = cheat_patch(task, "conftest_everywhere")
    assert official(task, patch, tmp_path) is True
    score, info = await ours(pool, task, patch)
    assert score == 0.0, info
