"""The SWE-style example (atropos/envs/examples/swe.py): its task images, its verifier and its
forgery rows, on the real images with the real Docker engine.

Here the agent's side and the verification run in containers of the task image: the row (a bash
script) runs in one container as uid 0; the verification runs the env's own verifier program
(``repo_tests.PROGRAM``, its pytest child, its restore list) in a second, fresh container of the
same image that holds every change of the first except those under a restored path: the root the
verifier sees after ``Lease.verify(..., restore=...)`` puts those paths back as the image has them.
tests/test_reward_forgery.py runs the same rows through a real slot pool.
"""

from __future__ import annotations

import json
import subprocess
import time
from collections.abc import Iterator
from typing import Any

import pytest

from atropos.envs.examples.swe_repos import REPOS
from atropos.envs.examples.swe_tasks import SweTask, task_images
from atropos.envs.repo_tests import CHILD, PROGRAM, score_verdict
from atropos.envs.verify_child import passed_flags
from atropos.sandbox.contract.protocol import VerifyResult
from tests.test_reward_forgery import SWE_ROWS, swe_gold_script

pytestmark = pytest.mark.docker

# Runs the verifier program as the host's runner does: its source defines verify(); the verdict
# comes back as one JSON line.
RUNNER = r'''
import json, sys
request = json.loads(sys.stdin.read())
namespace = {"__name__": "verifier"}
exec(compile(request["program"], "verifier", "exec"), namespace)
print(json.dumps(namespace["verify"]("/testbed", {}, request["args"])))
'''


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


def restored(path: str, restore: list[str]) -> bool:
    return any(path == r or path.startswith(r.rstrip("/") + "/") for r in restore)


def verify(task: SweTask, agent: Root, roots: list[Root]) -> tuple[float, dict[str, Any]]:
    """The env's verification of ``agent``'s final root: a fresh container of the image gets every
    change of the agent's root that is not under a restored path, then runs the env's program."""
    restore = task.tests.restore_paths()
    changes = [(kind, path) for kind, path in agent.changes() if not restored(path, restore)]
    verifier = Root(task.image)
    roots.append(verifier)
    kept = sorted(p for kind, p in changes if kind != "D")
    if kept:  # files, links and directory entries (not their contents: each changed child is listed)
        tar = docker("exec", agent.id, "tar", "-c", "--no-recursion", "-C", "/", *[p.lstrip("/") for p in kept]).stdout
        docker("exec", "-i", verifier.id, "tar", "-x", "-C", "/", input=tar)
    gone = [p for kind, p in changes if kind == "D"]
    if gone:
        docker("exec", verifier.id, "rm", "-rf", *gone)
    t = task.tests
    args = {"child": CHILD, "argv": t.pytest_argv(), "ids": t.ids, "cwd": t.repo_dir, "python": t.python,
            "env": t.child_env(), "timeout": 60, "must_be_real": t.must_be_real()}
    done = docker("exec", "-i", verifier.id, "/usr/bin/python3", "-I", "-c", RUNNER,
                  input=json.dumps({"program": PROGRAM, "args": args}).encode())
    verdict = json.loads(done.stdout.decode().strip().splitlines()[-1])
    result = VerifyResult(slot=0, ok=True, score=verdict["score"], verdict=verdict)
    return score_verdict(t, verdict, passed_flags(result, len(t.ids)))


def rollout(task: SweTask, script: str, roots: list[Root]) -> tuple[float, dict[str, Any]]:
    agent = Root(task.image)
    roots.append(agent)
    if script:
        done = agent.bash(script)
        assert done.returncode == 0, done.stderr.decode(errors="replace")
    return verify(task, agent, roots)


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


# -- the verifier ----------------------------------------------------------------------------------
@pytest.mark.parametrize("instance_id", [r.instance_id for r in REPOS])
def test_the_gold_patch_scores_one_and_no_patch_zero(tasks: list[SweTask], roots: list[Root],
                                                     instance_id: str) -> None:
    task = by_id(tasks, instance_id)
    score, info = rollout(task, swe_gold_script(task), roots)
    assert (score, info["tests_passed"]) == (1.0, len(task.tests.ids)), info
    score, info = rollout(task, "", roots)
    assert score == 0.0 and info["fail_to_pass_failed"] == task.tests.fail_to_pass, info
    assert info["pass_to_pass_failed"] == [] and set(info["why"]) == set(task.tests.fail_to_pass), info
    assert "verifier_error" not in info


def test_a_patch_that_breaks_a_passing_test_scores_zero_and_says_which(tasks: list[SweTask],
                                                                       roots: list[Root]) -> None:
    task = by_id(tasks, "strkit-1")
    breaks_wrap = swe_gold_script(task) + "sed -i 's/lines.append(line)$/pass/' strkit/text.py\n"
    score, info = rollout(task, breaks_wrap, roots)
    assert score == 0.0 and info["fail_to_pass_failed"] == [], info
    assert info["pass_to_pass_failed"] == ["tests/test_text.py::test_wrap"], info
    assert info["why"]["tests/test_text.py::test_wrap"].startswith("failed: "), info


def test_code_that_exits_or_lies_in_the_test_process_fails_every_test(tasks: list[SweTask],
                                                                     roots: list[Root]) -> None:
    """The outcome comes from the program's child with its nonce, not from exit codes or output."""
    task = by_id(tasks, "strkit-1")
    lie = ("cat >> strkit/__init__.py <<'EOF'\nimport os\nfor fd in range(1, 20):\n    try:\n"
           "        os.write(fd, b'{\"outcomes\": {}, \"nonce\": \"x\"}\\n9 passed\\n')\n    except OSError:\n"
           "        pass\nos._exit(0)\nEOF\n")
    score, info = rollout(task, swe_gold_script(task) + lie, roots)
    assert score == 0.0 and info["tests_passed"] == 0 and info["verifier_error"] == "no_report", info


# -- the forgery rows ------------------------------------------------------------------------------
@pytest.mark.parametrize("row", sorted(SWE_ROWS))
def test_a_swe_forgery_scores_zero(tasks: list[SweTask], roots: list[Root], row: str) -> None:
    task = by_id(tasks, "strkit-1")
    score, info = rollout(task, SWE_ROWS[row](task), roots)
    assert score == 0.0, info


@pytest.mark.parametrize("row", sorted(SWE_ROWS))
def test_a_swe_forgery_wins_against_pytest_run_in_the_agents_root(tasks: list[SweTask], roots: list[Root],
                                                                  row: str) -> None:
    """Each row is a real attack: `pytest <the task's tests>` in the root the agent left (what an
    env that does not restore would run) says every test passed."""
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


def test_the_gold_patch_still_scores_one_beside_every_forgery(tasks: list[SweTask], roots: list[Root]) -> None:
    """The restore takes back the forgeries, not the fix."""
    task = by_id(tasks, "strkit-1")
    last = "fake_interpreter"  # the other rows ask the env's python where its site-packages are
    rows = [*sorted(set(SWE_ROWS) - {last}), last]
    script = swe_gold_script(task) + "".join(SWE_ROWS[row](task) for row in rows)
    score, info = rollout(task, script, roots)
    assert score == 1.0, info
