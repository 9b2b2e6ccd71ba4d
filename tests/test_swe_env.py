"""The SWE-style example (atropos/envs/examples/swe.py): its task images (real images, the real
Docker engine), its verifier and the env on image-rooted slots of a real local pool, and a
process-mode run with the project's model server.

The forgery rows themselves are in tests/test_reward_forgery.py (``SWE_ROWS``, each scored 0 through
a real pool); here each row is shown to be a real attack: run in a container of the task image, it
makes `pytest` in the root the agent left (what an env grading the agent's own root would run) say every
test passed.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio

from atropos.envs.examples.swe_repos import REPOS
from atropos.envs.examples.swe_tasks import SweTask, task_images
from atropos.slots.pool import SlotPool
from tests.pool_backends import local_pool
from tests.test_reward_forgery import SWE_ROWS, swe_rollout

pytestmark = pytest.mark.docker
REPO = Path(__file__).resolve().parent.parent
in_module_loop = pytest.mark.asyncio(loop_scope="module")  # the pool fixture's loop

def docker(*args: str, input: bytes | None = None, check: bool = True) -> subprocess.CompletedProcess[bytes]:
    done = subprocess.run(["docker", *args], input=input, capture_output=True, timeout=300)
    if check and done.returncode != 0:
        raise AssertionError(f"docker {' '.join(args[:3])}: {done.stderr.decode(errors='replace')}")
    return done


@pytest.fixture(scope="module")
def tasks() -> list[SweTask]:
    from tests.pool_backends import require_docker

    require_docker()
    if docker("image", "inspect", "atropos-sandbox-base:bookworm", check=False).returncode != 0:
        pytest.fail("atropos-sandbox-base:bookworm is missing: scripts/build_image.sh builds it")
    return task_images()


class Root:
    """A container of a task image: the agent's side of a rollout (uid 0, the image's Env and
    WorkingDir, no network)."""

    def __init__(self, image: str) -> None:
        self.id = docker("run", "-d", "--network", "none", image, "sleep", "infinity").stdout.decode().strip()

    def bash(self, script: str) -> subprocess.CompletedProcess[bytes]:
        return docker("exec", "-i", self.id, "bash", "-c", script, check=False)

    def changes(self) -> list[tuple[str, str]]:
        out = docker("diff", self.id).stdout.decode().splitlines()
        return [(line[0], line[2:]) for line in out if line]

    def remove(self) -> None:
        docker("rm", "-f", self.id, check=False)


@pytest.fixture
def roots() -> Iterator[list[Root]]:
    made: list[Root] = []
    yield made
    for root in made:
        root.remove()


def by_id(tasks: list[SweTask], instance_id: str) -> SweTask:
    return next(t for t in tasks if t.instance_id == instance_id)


# -- the images ------------------------------------------------------------------------------------
def test_each_task_image_is_a_swe_bench_style_instance(tasks: list[SweTask]) -> None:
    """/testbed root-owned and a clean git repository at its base commit, the task env's interpreter
    and pytest first on PATH, WORKDIR /testbed; the failing tests fail and the passing ones pass."""
    assert [t.instance_id for t in tasks] == [r.instance_id for r in REPOS]
    for task in tasks:
        ids = " ".join(f"'{i}'" for i in task.tests.ids)
        out = docker("run", "--rm", "--network", "none", task.image, "bash", "-c",
                     "pwd; stat -c '%U %a' /testbed; command -v python pytest; git status --porcelain | wc -l; "
                     "git log --format=%s; python -c 'import sys; print(sys.prefix)'; "
                     f"pytest -p no:cacheprovider -q -rA {ids} 2>&1 | grep -E '^(PASSED|FAILED|ERROR) '",
                     check=False).stdout.decode().splitlines()
        assert out[:7] == ["/testbed", "root 755", "/opt/miniconda3/envs/testbed/bin/python",
                           "/opt/miniconda3/envs/testbed/bin/pytest", "0", "base commit",
                           "/opt/miniconda3/envs/testbed"], out
        outcome = {line.split(" ", 1)[1].split(" - ")[0]: line.split(" ", 1)[0] for line in out[7:]}
        assert outcome == {**dict.fromkeys(task.tests.fail_to_pass, "FAILED"),
                           **dict.fromkeys(task.tests.pass_to_pass, "PASSED")}, out


def test_the_images_share_the_env_layer_and_a_cached_build_builds_nothing(tasks: list[SweTask]) -> None:
    layers = [json.loads(docker("image", "inspect", "--format", "{{json .RootFS.Layers}}", t.image).stdout)
              for t in tasks]
    shared = set(layers[0]).intersection(*layers[1:])
    assert all(set(ls) - shared for ls in layers)  # each has its own repository layer
    assert len(shared) >= len(layers[0]) - 2  # and everything under it in common (base and env)
    ids = {t.image: docker("image", "inspect", "--format", "{{.Id}}", t.image).stdout for t in tasks}
    t0 = time.monotonic()
    again = task_images()
    took = time.monotonic() - t0
    assert [t.image for t in again] == [t.image for t in tasks]
    assert {t.image: docker("image", "inspect", "--format", "{{.Id}}", t.image).stdout for t in again} == ids
    print(f"cached task_images(): {took:.2f}s")


# -- the forgery rows ------------------------------------------------------------------------------
@pytest.mark.parametrize("row", sorted(SWE_ROWS))
def test_a_swe_forgery_wins_against_pytest_run_in_the_agents_root(tasks: list[SweTask], roots: list[Root],
                                                                  row: str) -> None:
    """Each row is a real attack: `pytest <the task's tests>` in the root the agent left (what an
    env grading the agent's own root would run) says every test passed."""
    task = by_id(tasks, "strkit-1")
    agent = Root(task.image)
    roots.append(agent)
    assert agent.bash(SWE_ROWS[row](task)).returncode == 0
    ids = " ".join(f"'{i}'" for i in task.tests.ids)
    before = Root(task.image)
    roots.append(before)
    assert before.bash(f"pytest -p no:cacheprovider -q {ids}").returncode != 0  # the task is not done
    naive = agent.bash(f"pytest -p no:cacheprovider -q {ids}")
    assert naive.returncode == 0, (naive.stdout + naive.stderr).decode(errors="replace")[-2000:]




# -- the verifier and the env on image-rooted slots of a real pool -------------------------------------
@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def pool(tasks: list[SweTask]) -> AsyncIterator[SlotPool]:
    async with local_pool(2, "swe-env") as p:
        await p.prepare_images([t.image for t in tasks])
        yield p


@in_module_loop
async def test_a_patch_that_breaks_a_passing_test_scores_zero_and_says_which(pool: SlotPool,
                                                                             tasks: list[SweTask]) -> None:
    task = by_id(tasks, "strkit-1")
    breaks_wrap = "sed -i 's/lines.append(line)$/pass/' strkit/text.py"
    score, info = await swe_rollout(pool, task, breaks_wrap, gold=True)
    assert score == 0.0 and info["fail_to_pass_failed"] == [], info
    assert info["pass_to_pass_failed"] == ["tests/test_text.py::test_wrap"], info
    assert info["why"]["tests/test_text.py::test_wrap"].startswith("failed: call: AssertionError: assert "), info


@in_module_loop
async def test_code_that_exits_or_lies_in_the_test_process_fails_every_test(pool: SlotPool,
                                                                           tasks: list[SweTask]) -> None:
    """The outcome comes from the program's pytest child with its nonce: not from its exit code, not
    from what the code under test writes on any descriptor."""
    task = by_id(tasks, "strkit-1")
    lie = ("cat >> strkit/__init__.py <<'EOF'\nimport os\nfor fd in range(1, 20):\n    try:\n"
           "        os.write(fd, b'{\"outcomes\": {}, \"nonce\": \"x\"}\\n9 passed\\n')\n    except OSError:\n"
           "        pass\nos._exit(0)\nEOF\n")
    score, info = await swe_rollout(pool, task, lie, gold=True)
    assert score == 0.0 and info["tests_passed"] == 0 and info["verifier_error"] == "no_report", info


def swe_env(policy: Any) -> Any:
    from atropos.agent.model import ensure_tokenizer_dir
    from atropos.envs.agent_env import AgentEnvConfig
    from atropos.envs.examples.swe import SweEnv
    from atropos.testing import scripted_server, server_configs

    class Scripted(SweEnv):
        server_cls = scripted_server(policy)

    cfg = AgentEnvConfig(tokenizer_name=str(ensure_tokenizer_dir()), group_size=2, use_wandb=False,
                         wandb_name="swe-test", slots_per_host=2, max_hosts=1, agent_max_steps=6,
                         enabled_toolsets=["shell", "files"], ensure_scores_are_not_same=False)
    return Scripted(cfg, server_configs(), slurm=False, testing=False)


@in_module_loop
async def test_the_env_scores_its_gold_policy_one_and_a_policy_that_does_nothing_zero(tasks: list[SweTask]) -> None:
    """A group of the env on the item's image: the gold fix applied with edit_file by a scripted
    policy scores 1 in both rollouts; a policy that answers at once scores 0 and the log says which
    tests failed; the verifier check (reference and stub of every task, in slots) is as expected."""
    from atropos.envs.examples.swe import gold_policy
    from atropos.testing import answer, by_turn

    task = by_id(tasks, "datewise-1")
    for policy, want in ((gold_policy(task), 1.0), (by_turn(answer("Nothing to do.")), 0.0)):
        env = swe_env(policy)
        await env.setup()
        try:
            env.index = [t.instance_id for t in env.tasks].index(task.instance_id)
            item = await env.get_next_item()
            assert item["image"] == task.image
            group, backlog = await env.collect_trajectories(item)
            if want == 1.0:
                checks = await env.check_verifier()
        finally:
            await env.shutdown_sandbox()
        assert backlog == [] and group is not None and group["scores"] == [want, want], group and group["overrides"]
        info = group["overrides"][0]["score_info"]["verifier"]
        if want == 0.0:
            assert info["fail_to_pass_failed"] == task.tests.fail_to_pass and info["pass_to_pass_failed"] == [], info
            assert set(info["why"]) == set(task.tests.fail_to_pass), info
    assert [(c.family, c.reference_score, c.stub_score) for c in checks] == [
        (t.instance_id, 1.0, 0.0) for t in tasks], checks


# -- process mode with the project's model server --------------------------------------------------------
@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_process_mode_with_the_real_model(model_url: str, tmp_path: Path) -> None:
    """``python -m atropos.envs.examples.swe process`` with the real (tiny) model: the verifier
    check proves each task's gold patch scores 1 and its untouched image 0 in slots of the pool the
    run uses, the model's tool calls run in /testbed of the item's image, and every rollout's
    score comes from the verification (its log counts the task's tests)."""
    out = tmp_path / "swe.jsonl"
    proc = subprocess.run(
        [sys.executable, "-m", "atropos.envs.examples.swe", "process", "--env.total_steps", "1",
         "--env.group_size", "2", "--env.slots_per_host", "2", "--env.agent_max_steps", "3",
         "--env.data_path_to_save_groups", str(out), "--openai.base_url", model_url],
        cwd=REPO, capture_output=True, text=True, timeout=1500,
        env={**os.environ, "HF_HUB_OFFLINE": "1", "WANDB_MODE": "disabled"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "verifier check" in proc.stdout and "all as expected" in proc.stdout, proc.stdout[-3000:]
    for task in REPOS:
        assert re.search(rf"{task.instance_id}\s+reference 1\.000\s+stub 0\.000", proc.stdout), proc.stdout[-3000:]
    groups = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(groups) == 1 and len(groups[0]["scores"]) == 2
    task = next(r for r in REPOS if r.problem_statement in groups[0]["messages"][0][1]["content"])
    for score, override, messages in zip(groups[0]["scores"], groups[0]["overrides"], groups[0]["messages"],
                                         strict=True):
        info = override["score_info"]["verifier"]
        assert info["tests_total"] == len(task.fail_to_pass) + len(task.pass_to_pass), info
        assert score == (1.0 if info["tests_passed"] == info["tests_total"] else 0.0), info
        assert any(m["role"] == "tool" for m in messages)  # the grammar's first turns are tool calls
    assert (tmp_path / "swe.html").exists()
