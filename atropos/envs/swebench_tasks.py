"""SWE-bench instances as they are published, verified on a fresh root (docs/verification.md).

A row of a SWE-bench-format dataset (``instance_id``, ``repo``, ``version``, ``base_commit``,
``patch``, ``test_patch``, ``FAIL_TO_PASS``, ``PASS_TO_PASS``, ``image``, and, as the official
package's rows carry them since its version 5, ``eval_script``, ``log_parser``, ``eval_type``)
becomes a ``SweBenchTask``. The verdict is the official package's own (the ``swebench`` extra):
its ``make_test_spec`` turns the row into the evaluation script (the test command between its
output markers, with the test patch applied over the test files at ``base_commit``), and its
``get_eval_report`` parses the log with the row's log parser and decides ``resolved``. What differs
from its harness is where the script runs: not in a new container of the image with the agent's
patch applied, but on a fresh root of the slot's image holding the agent's changes to the
repository (``Lease.verify(fresh_root=...)``): the same root a container would have, without the
container, and with the test files, their settings and the test directories taken from the image
(so a patch that plants a ``conftest.py`` or rewrites a helper module next to the tests, which the
official harness grades as the patch leaves them, does not count here).

The gold policy applies ``patch`` with ``git apply`` in the slot.
"""

from __future__ import annotations

import json
import tempfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict

from atropos.envs.repo_tests import RepoTests, image_env, patch_files
from atropos.errors import ConfigError
from atropos.sandbox.contract.protocol import FreshRoot
from atropos.slots.lease import Lease

__all__ = ["EVAL_PROGRAM", "SweBenchTask", "apply_patch_command", "load_instances", "run_swebench_eval"]

REPO_DIR = "/testbed"  # where SWE-bench's images keep the repository (and the official harness works)
MAX_LOG_BYTES = 4 << 20


class SweBenchTask(BaseModel):
    """One published instance: the row as it came (the official package reads it) and what the env
    needs besides."""

    model_config = ConfigDict(extra="allow")

    instance_id: str
    repo: str
    version: str
    base_commit: str
    patch: str
    test_patch: str
    FAIL_TO_PASS: list[str] | str
    PASS_TO_PASS: list[str] | str
    image: str
    eval_script: str
    log_parser: str = "parse_log_pytest"
    eval_type: str = "pass_and_fail"
    problem_statement: str = ""

    def row(self) -> dict[str, Any]:
        return self.model_dump()

    def test_spec(self) -> Any:
        """The official package's TestSpec of this row."""
        return _swebench().make_test_spec(self.row())

    def fresh_root(self) -> FreshRoot:
        """The files the test patch touches, and their settings, from the image (the evaluation
        script checks them out at ``base_commit`` and applies the test patch over them)."""
        spec = self.test_spec()
        tests = RepoTests(repo_dir=REPO_DIR, fail_to_pass=list(spec.FAIL_TO_PASS), pass_to_pass=list(spec.PASS_TO_PASS),
                          test_files=patch_files(self.test_patch))
        return FreshRoot(repo_dir=REPO_DIR, from_image=tests.from_image())


def _swebench() -> Any:
    try:
        from swebench.harness import utils
    except ImportError as exc:
        raise ConfigError("SWE-bench instances are graded with the official package: "
                          "pip install 'atropos-sandbox[swebench]'") from exc
    return utils


def load_instances(rows: Iterable[dict[str, Any]]) -> list[SweBenchTask]:
    """SWE-bench-format rows (a dataset's records, or lines of its JSONL) as tasks; each row is
    checked by the official ``make_test_spec`` before it is accepted."""
    tasks = []
    for row in rows:
        task = SweBenchTask.model_validate(row)
        task.test_spec()  # a row the official package cannot read is refused here, not at grading
        tasks.append(task)
    return tasks


def apply_patch_command(patch: str) -> str:
    """A bash command applying ``patch`` at the repository as the official harness tries it
    (``git apply``, then ``patch --fuzz``): the gold policy's tool call."""
    tag = "EOF_PATCH_7f3a9c"
    return (f"cd {REPO_DIR} && cat > /tmp/gold.diff <<'{tag}'\n{patch}{tag}\n"
            "git apply --verbose /tmp/gold.diff || patch --batch --forward --fuzz=5 -p1 -i /tmp/gold.diff")


# Runs the row's evaluation script on the fresh root as the official harness runs it in its
# container (``/bin/bash /eval.sh`` as root at the image's WorkingDir with the image's Env), and
# returns its output, stdout and stderr together, on the protocol pipe (never through a file).
EVAL_PROGRAM = r'''
import os, subprocess


def verify(workspace, secrets, args):
    # the script where the checked root's programs see /tmp/eval.sh (ROOT: that root, as the runner
    # sees it; the runner's own /tmp is not theirs)
    with open(os.path.join(ROOT, "tmp/eval.sh"), "w") as fh:
        fh.write(args["eval_script"])
    env = dict(args["env"])
    env.setdefault("HOME", "/root")
    try:
        done = subprocess.run(["/bin/bash", "/tmp/eval.sh"], cwd=args["cwd"], env=env, stdin=subprocess.DEVNULL,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=args["timeout"],
                              start_new_session=True)
        out, timed_out = done.stdout, False
    except subprocess.TimeoutExpired as exc:
        out, timed_out = exc.stdout or b"", True
    finally:
        try:
            os.kill(-1, 9)
        except OSError:
            pass
    log = out[-args["max_bytes"]:].decode("utf-8", "replace")
    return {"score": 0.0, "log": log, "timed_out": timed_out}
'''


async def run_swebench_eval(lease: Lease, task: SweBenchTask, *, timeout_s: float = 1800.0
                            ) -> tuple[float, dict[str, Any]]:
    """Grade the sealed slot as the official harness grades a prediction: 1.0 only if its report
    says ``resolved``. The dict is that report (``tests_status`` included) plus ``fresh_root``."""
    spec = task.test_spec()
    env = image_env(task.image)
    args = {"eval_script": spec.eval_script, "env": env, "cwd": REPO_DIR, "timeout": timeout_s,
            "max_bytes": MAX_LOG_BYTES}
    result = await lease.verify(EVAL_PROGRAM, args=args, timeout_s=timeout_s + 60, fresh_root=task.fresh_root())
    info: dict[str, Any] = {"fresh_root": result.fresh_root}
    if not result.ok or result.verdict is None:
        info["verifier_error"] = result.error.code if result.error is not None else "no_verdict"
        return 0.0, info
    log = str(result.verdict.get("log", ""))
    if result.verdict.get("timed_out"):
        info["verifier_error"] = "timed_out"
        return 0.0, info
    from swebench.harness.grading import get_eval_report

    with tempfile.TemporaryDirectory(prefix="swebench-log-") as tmp:
        path = Path(tmp) / "test_output.txt"
        path.write_text(log)
        prediction = {"instance_id": task.instance_id, "model_name_or_path": "atropos-fresh-root",
                      "model_patch": "(the slot's changes to the repository)"}
        report = get_eval_report(spec, prediction, str(path), include_tests_status=True)[task.instance_id]
    info.update(json.loads(json.dumps(report, default=str)))
    return (1.0 if report.get("resolved") else 0.0), info
