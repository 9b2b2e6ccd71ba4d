"""SWE-bench-shaped images and SWE-bench-format rows of the SWE example's tasks, made here (no
registry, no dataset download): what ``atropos.envs.swebench_tasks`` loads and what the official
harness (``swebench.harness.run_evaluation.run_instance``) grades, on the same images.

Each image is the SWE example's task image (the repository at ``/testbed`` at its base commit, the
env at ``/opt/miniconda3/envs/testbed``) plus what the published evaluation scripts call:
``/opt/miniconda3/bin/activate`` defining ``conda activate ENV`` (it puts the env first on
``PATH``). Each row has the published columns: the gold ``patch`` (the task's fix as a diff), a
``test_patch`` (adds a test the fix must pass to every FAIL_TO_PASS test file, as SWE-bench's test
patches add the failing tests), and an ``eval_script`` in the published shape (activate, check the
test files out at the base commit, apply the test patch, the test command between the output
markers, check them out again).
"""

from __future__ import annotations

import difflib
import json
import subprocess
from typing import Any

from atropos.envs.examples.swe_repos import REPOS, Edit, Repo
from atropos.envs.examples.swe_tasks import _build, env_image, task_image

ACTIVATE = """# conda's activate, as far as SWE-bench's evaluation scripts use it
conda() {
    if [ "$1" = activate ]; then
        export CONDA_DEFAULT_ENV="$2" PATH="/opt/miniconda3/envs/$2/bin:$PATH"
    fi
}
"""
HEREDOC = "EOF_114329324912"  # the published scripts' own heredoc tag


def _docker(*args: str) -> str:
    return subprocess.run(["docker", *args], capture_output=True, text=True, check=True, timeout=300).stdout


def image_of(repo: Repo) -> str:
    base = task_image(repo, env_image())
    dockerfile = f"FROM {base}\nCOPY activate /opt/miniconda3/bin/activate\n"
    return _build(f"atropos-test/sweb.eval.{repo.instance_id}", dockerfile, {"activate": ACTIVATE.encode()}, base)


def diff(path: str, before: str, after: str) -> str:
    body = "".join(difflib.unified_diff(before.splitlines(True), after.splitlines(True), f"a/{path}", f"b/{path}"))
    return f"diff --git a/{path} b/{path}\n{body}"


def edits_patch(files: dict[str, str], edits: list[Edit]) -> str:
    out, text = [], dict(files)
    for e in edits:
        after = text[e.path].replace(e.old, e.new, 1)
        out.append(diff(e.path, text[e.path], after))
        text[e.path] = after
    return "".join(out)


def extra_test(repo: Repo, path: str) -> tuple[str, str]:
    """The name and source of the test the test patch adds to ``path``: the first FAIL_TO_PASS test
    of that file (its source, fixtures and all), once more under a name of its own."""
    first = next(i for i in repo.fail_to_pass if i.startswith(path + "::")).split("::", 1)[1]
    name = f"test_swebench_patch_{first.removeprefix('test_')}"
    src = repo.files[path]
    start = src.index(f"def {first}(")
    end = src.find("\n\n\n", start)
    block = src[start:end if end >= 0 else len(src)].rstrip() + "\n"
    return name, "\n\n" + block.replace(f"def {first}(", f"def {name}(", 1)


def row(repo: Repo) -> dict[str, Any]:
    image = image_of(repo)
    base = _docker("run", "--rm", "--network", "none", image, "git", "rev-parse", "HEAD").strip()
    test_files = sorted({i.split("::", 1)[0] for i in repo.fail_to_pass})
    test_patch, added = "", []
    for path in test_files:
        name, source = extra_test(repo, path)
        test_patch += diff(path, repo.files[path], repo.files[path] + source)
        added.append(f"{path}::{name}")
    files = " ".join(test_files)
    eval_script = "\n".join([
        "#!/bin/bash", "set -uxo pipefail", "source /opt/miniconda3/bin/activate", "conda activate testbed",
        "cd /testbed", "git config --global --add safe.directory /testbed", "cd /testbed", "git status",
        "git show", f"git -c core.fileMode=false diff {base}", "source /opt/miniconda3/bin/activate",
        "conda activate testbed", f"git checkout {base} {files}", f"git apply -v - <<'{HEREDOC}'",
        test_patch.rstrip("\n"), HEREDOC, ": '>>>>> Start Test Output'", f"pytest -rA {files}",
        ": '>>>>> End Test Output'", f"git checkout {base} {files}"]) + "\n"
    return {"instance_id": repo.instance_id, "repo": f"atropos-examples/{repo.instance_id.rsplit('-', 1)[0]}",
            "version": "0.1", "base_commit": base, "patch": edits_patch(repo.files, repo.gold),
            "test_patch": test_patch, "FAIL_TO_PASS": json.dumps([*repo.fail_to_pass, *added]),
            # the log parser splits a result line at whitespace, so SWE-bench's own lists (made from
            # parsed logs) never hold an id with a space: neither do these
            "PASS_TO_PASS": json.dumps([i for i in repo.pass_to_pass if " " not in i]), "image": image,
            "eval_script": eval_script,
            "log_parser": "parse_log_pytest", "eval_type": "pass_and_fail",
            "problem_statement": repo.problem_statement}


def rows() -> list[dict[str, Any]]:
    return [row(r) for r in REPOS]
