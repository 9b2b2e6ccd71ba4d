"""The coding env scored by hidden test files (``atropos.envs.hidden_test_files``) instead of
value comparisons: each task's hidden cases written as the pytest-style tests a user would have.

``python -m atropos.envs.examples.coding_pytest process --env.total_steps 2 --env.group_size 4``
"""

from __future__ import annotations

from typing import Any

from atropos.envs.agent_env import ExecTool
from atropos.envs.examples.coding import CodingEnv
from atropos.envs.hidden_test_files import run_hidden_tests
from atropos.slots.lease import Lease

__all__ = ["CodingPytestEnv", "hidden_test_file"]


def hidden_test_file(task: dict[str, Any]) -> dict[str, str]:
    """``test_<name>.py`` with one test per hidden case. Each checks the type before the value: an
    object whose ``__eq__`` always says True must not pass (see hidden_test_files)."""
    name = task["name"]
    lines = [f"from solution import {name}", ""]
    for i, (args, want) in enumerate(task["hidden"]):
        lines += ["", f"def test_case_{i}():", f"    got = {name}(*{args!r})",
                  f"    assert type(got) is {type(want).__name__} and got == {want!r}", ""]
    return {f"test_{name}.py": "\n".join(lines)}


class CodingPytestEnv(CodingEnv):
    name = "coding_pytest"

    async def verify_and_score_trajectory(self, item: dict[str, Any], final_response: str, *, trajectory_id: str,
                                          exec_tool: ExecTool, lease: Lease, agent_result: Any,
                                          ) -> tuple[float, dict[str, Any]]:
        return await run_hidden_tests(lease, hidden_test_file(item), timeout_s=5.0)


if __name__ == "__main__":
    CodingPytestEnv.cli()
