"""Repository verification on a fresh root (issue 35; docs/verification.md, "A fresh root"):
``run_repo_tests`` grades a new root of the task's image holding only the agent's changes to the
repository, run as the task's own test command runs.

On three layouts (tests/repo_layouts.py: a symlinked venv with the repository not installed, a
conda-style env with the repository installed in development mode, an image with ``LD_PRELOAD`` in
its ``Env``) gold scores 1 and no patch 0; each forgery row scores 0 through a real local pool
while, run in a container of the image, it makes ``pytest`` in the agent's root say every test
passed; the diff carries deletions and renamed directories and drops links out of the repository.
"""

from __future__ import annotations

import secrets
import subprocess
from collections.abc import AsyncIterator
from typing import Any

import pytest
import pytest_asyncio

from atropos.envs.repo_tests import RepoTests, run_repo_tests
from atropos.slots.pool import SlotPool
from tests.pool_backends import local_pool
from tests.repo_layouts import ROWS, Layout, layouts

pytestmark = pytest.mark.docker
in_module_loop = pytest.mark.asyncio(loop_scope="module")


@pytest.fixture(scope="module")
def images() -> dict[str, Layout]:
    from tests.pool_backends import require_docker

    require_docker()
    from atropos.envs.examples.swe_tasks import task_images

    swe = next(t for t in task_images() if t.instance_id == "strkit-1")  # the SWE example itself
    return {**{layout.name: layout for layout in layouts()},
            "swe-example": Layout("swe-example", swe.image, swe.tests, swe.gold)}


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def pool(images: dict[str, Layout]) -> AsyncIterator[SlotPool]:
    async with local_pool(2, "fresh-root") as p:
        await p.prepare_images([layout.image for layout in images.values()])
        yield p


async def rollout(pool: SlotPool, layout: Layout, script: str, *, gold: bool = False,
                  tests: RepoTests | None = None) -> tuple[float, dict[str, Any]]:
    """The gold fix with ``edit_file`` when asked, then ``script`` with bash at /testbed (uid 0,
    the image's Env), then the seal and the fresh-root verification."""
    async with pool.leased(f"fresh-{secrets.token_hex(3)}", image=layout.image) as lease:
        if gold:
            for e in layout.gold:
                await lease.ok("edit_file", {"path": f"/testbed/{e.path}", "old_string": e.old, "new_string": e.new})
        if script:
            done = await lease.bash(script, timeout_s=120)
            assert done.exit_code == 0, done.stderr
        await lease.seal()
        return await run_repo_tests(lease, tests or layout.tests, timeout_s=60)


def test_for_image_reads_the_images_env_and_finds_no_interpreter_list(images: dict[str, Layout]) -> None:
    tests = images["preload"].tests
    assert tests.env["LD_PRELOAD"] == "/usr/local/lib/libpreloaded.so" and tests.env["TASK_MODE"] == "strict"
    assert tests.env["PATH"].startswith("/opt/venv/bin:") and tests.python is None and tests.pytest_config is None
    # the test directory whole, and the settings above it (a helper module next to the tests is the task's)
    assert "tests" in tests.from_image() and "setup.cfg" in tests.from_image(), tests.from_image()
    assert not any(p.startswith("tests/") for p in tests.from_image())


@in_module_loop
@pytest.mark.parametrize("name", ["venv-link", "conda-dev", "preload"])
async def test_gold_scores_one_and_no_patch_zero_on_each_layout(pool: SlotPool, images: dict[str, Layout],
                                                                name: str) -> None:
    layout = images[name]
    score, info = await rollout(pool, layout, "", gold=True)
    assert score == 1.0 and info["tests_passed"] == len(layout.tests.ids), info
    assert info["fresh_root"]["files"] == 1 and info["fresh_root"]["dropped"] == [], info
    score, info = await rollout(pool, layout, "")
    assert score == 0.0 and info["fail_to_pass_failed"] == layout.tests.fail_to_pass, info
    assert info["pass_to_pass_failed"] == [] and "verifier_error" not in info, info


# the rows that need nothing of the layouts' repository (its helper module, its tmp_path test) also
# run on the SWE example's own task image
ROW_LAYOUTS = [*((name, row) for name in ("venv-link", "conda-dev") for row in sorted(ROWS)),
               *(("swe-example", row) for row in ("outside_repo", "pyc_beside_tests", "shared_lib",
                                                   "venv_interpreter"))]


@in_module_loop
@pytest.mark.parametrize(("name", "row"), ROW_LAYOUTS)
async def test_a_forgery_scores_zero_on_a_fresh_root(pool: SlotPool, images: dict[str, Layout], name: str,
                                                     row: str) -> None:
    layout = images[name]
    score, info = await rollout(pool, layout, ROWS[row](layout.tests))
    assert score == 0.0 and info["fail_to_pass_failed"] == layout.tests.fail_to_pass, info


@in_module_loop
async def test_gold_still_scores_one_beside_every_forgery(pool: SlotPool, images: dict[str, Layout]) -> None:
    layout = images["venv-link"]
    order = [*sorted(set(ROWS) - {"venv_interpreter"}), "venv_interpreter"]  # the others run python
    score, info = await rollout(pool, layout, "".join(ROWS[r](layout.tests) for r in order), gold=True)
    assert score == 1.0, info


@pytest.mark.parametrize("row", sorted(ROWS))
def test_each_row_wins_against_pytest_in_the_agents_root(images: dict[str, Layout], row: str) -> None:
    """Each row is a real attack: in a container of the image, after the row, the task's own test
    command (``python -m pytest`` on the task's test files, as SWE-bench's evaluation runs them)
    passes, while before it the task fails."""
    layout = images["venv-link"]
    cid = subprocess.run(["docker", "run", "-d", "--network", "none", layout.image, "sleep", "infinity"],
                         capture_output=True, text=True, check=True).stdout.strip()
    try:
        def bash(script: str) -> subprocess.CompletedProcess[str]:
            return subprocess.run(["docker", "exec", "-i", cid, "bash", "-c", script], capture_output=True,
                                  text=True, timeout=300)

        files = " ".join(sorted({i.split("::", 1)[0] for i in layout.tests.ids}))  # the test command's form
        assert bash(f"python -m pytest -p no:cacheprovider -q {files}").returncode != 0
        done = bash(ROWS[row](layout.tests))
        assert done.returncode == 0, done.stderr
        if row == "venv_interpreter":  # it answers the grader's request as the report would
            naive = bash("""echo '{"nonce": "n", "argv": ["tests/test_calc.py::test_add"]}' | python -I -c pass""")
            assert '"tests/test_calc.py::test_add": "passed"' in naive.stdout, naive
            return
        naive = bash(f"python -m pytest -p no:cacheprovider -q {files}")
        assert naive.returncode == 0, (naive.stdout + naive.stderr)[-2000:]
    finally:
        subprocess.run(["docker", "rm", "-f", cid], capture_output=True)


# -- the diff is the agent's, and hostile --------------------------------------------------------------
@in_module_loop
async def test_a_deleted_repository_file_stays_deleted(pool: SlotPool, images: dict[str, Layout]) -> None:
    layout = images["venv-link"]
    score, info = await rollout(pool, layout, "rm calc/__init__.py", gold=True)
    assert score == 0.0 and info["fresh_root"]["whiteouts"] == 1, info
    assert info["fail_to_pass_failed"] == layout.tests.fail_to_pass, info


@in_module_loop
async def test_a_renamed_directory_keeps_its_content(pool: SlotPool, images: dict[str, Layout]) -> None:
    """A directory of the image moved away and back (overlayfs records a redirect): the new root
    has its whole content, the fix included."""
    layout = images["venv-link"]
    score, info = await rollout(pool, layout, "mv calc calc_moved && mv calc_moved calc", gold=True)
    assert score == 1.0, info


@in_module_loop
async def test_a_link_out_of_the_repository_is_dropped_and_one_inside_kept(pool: SlotPool,
                                                                          images: dict[str, Layout]) -> None:
    layout = images["venv-link"]
    fixed = "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n"
    out = f"printf '{fixed}' > /tmp/ops.py && rm calc/ops.py && ln -s /tmp/ops.py calc/ops.py"
    score, info = await rollout(pool, layout, out)
    assert score == 0.0 and info["fresh_root"]["dropped"] == ["calc/ops.py -> /tmp/ops.py"], info
    inside = f"mkdir fixed && printf '{fixed}' > fixed/ops.py && rm calc/ops.py && ln -s ../fixed/ops.py calc/ops.py"
    score, info = await rollout(pool, layout, inside)
    assert score == 1.0 and info["fresh_root"]["dropped"] == [], info


@in_module_loop
async def test_a_test_directory_swapped_for_a_link_gets_the_images_tests(pool: SlotPool,
                                                                        images: dict[str, Layout]) -> None:
    layout = images["venv-link"]
    swap = ("cp -r tests forged && sed -i -E 's/^( *)assert /\\1assert True or /' forged/test_calc.py && "
            "rm -rf tests && ln -s forged tests")
    score, info = await rollout(pool, layout, swap)
    assert score == 0.0 and info["fail_to_pass_failed"] == layout.tests.fail_to_pass, info


@in_module_loop
async def test_a_test_patch_is_applied_over_the_images_tests(pool: SlotPool, images: dict[str, Layout]) -> None:
    """As SWE-bench's evaluation does: the image's tests, then the task's test patch (here adding a
    test the gold fix passes)."""
    layout = images["venv-link"]
    patch = ("diff --git a/tests/test_more.py b/tests/test_more.py\nnew file mode 100644\n"
             "--- /dev/null\n+++ b/tests/test_more.py\n@@ -0,0 +1,5 @@\n+from calc import add\n+\n+\n"
             "+def test_add_more():\n+    assert add(1, 1) == 2\n")
    tests = RepoTests.for_image(layout.image, "/testbed", ["tests/test_more.py::test_add_more"],
                                layout.tests.pass_to_pass, test_patch=patch)
    assert "tests/test_more.py" in tests.test_files
    score, info = await rollout(pool, layout, "", gold=True, tests=tests)
    assert score == 1.0, info
    score, info = await rollout(pool, layout, "", tests=tests)
    assert score == 0.0 and info["fail_to_pass_failed"] == ["tests/test_more.py::test_add_more"], info
    planted = "printf 'def test_add_more():\\n    pass\\n' > tests/test_more.py"  # the agent's own copy
    score, info = await rollout(pool, layout, planted, tests=tests)
    assert score == 0.0, info



@in_module_loop
async def test_a_diff_the_helper_refuses_scores_zero_with_the_reason_and_the_slot_goes_on(
        pool: SlotPool, images: dict[str, Layout]) -> None:
    """Changes nested deeper than the helper walks: the build fails on the agent's tree, which is the
    agent's outcome (score 0, ``fresh_root_failed``), never the host's; the slot serves the next lease."""
    layout = images["venv-link"]
    deep = "mkdir -p calc/" + "/".join(["d"] * 140) + " && touch calc/" + "/".join(["d"] * 140) + "/f.py"
    score, info = await rollout(pool, layout, deep, gold=True)
    assert score == 0.0 and info["verifier_error"] == "fresh_root_failed", info
    assert "deeper than 128" in info["verifier_message"], info
    score, info = await rollout(pool, layout, "", gold=True)
    assert score == 1.0, info
