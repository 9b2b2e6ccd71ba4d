"""A coding environment: implement a function in the slot; hidden tests, which never enter the
workspace, run in the slot's verification sandbox (``Lease.verify``) and give the reward (see
``hidden_tests`` for why the solution cannot forge that result).

``python -m atropos.envs.examples.coding process --env.total_steps 2 --env.group_size 4``
"""

from __future__ import annotations

import random
from typing import Any

from atropos.envs.agent_env import AgentEnv, AgentEnvConfig, ExecTool
from atropos.envs.examples.coding_reference import reference_policy
from atropos.envs.examples.common import server_configs, tokenizer_dir
from atropos.envs.examples.hidden_tests import verify
from atropos.envs.verifier_check import VerifierCheck
from atropos.slots.lease import Lease

__all__ = ["TASKS", "CodingEnv", "verify", "visible_test"]

TASKS: list[dict[str, Any]] = [
    {"name": "add", "signature": "def add(a, b):", "doc": "Return the sum of a and b.",
     "visible": [[[1, 2], 3]], "hidden": [[[2, 3], 5], [[-1, 1], 0], [[10, 5], 15], [[0, 0], 0]]},
    {"name": "is_palindrome", "signature": "def is_palindrome(s):",
     "doc": "Return True if the string s reads the same backwards, ignoring case.",
     "visible": [[["Abba"], True]], "hidden": [[["racecar"], True], [["hello"], False], [[""], True], [["Ab"], False]]},
    {"name": "fizzbuzz", "signature": "def fizzbuzz(n):",
     "doc": "Return 'Fizz' if n is divisible by 3, 'Buzz' if by 5, 'FizzBuzz' if by both, else str(n).",
     "visible": [[[3], "Fizz"]], "hidden": [[[5], "Buzz"], [[15], "FizzBuzz"], [[7], "7"], [[30], "FizzBuzz"]]},
    {"name": "count_vowels", "signature": "def count_vowels(s):",
     "doc": "Return how many vowels (a, e, i, o, u, either case) the string s contains.",
     "visible": [[["hello"], 2]], "hidden": [[["AEIOU"], 5], [["xyz"], 0], [["Programming"], 3], [[""], 0]]},
    {"name": "reverse_words", "signature": "def reverse_words(s):",
     "doc": "Return the words of s (separated by single spaces) in reverse order, joined by single spaces.",
     "visible": [[["a b"], "b a"]], "hidden": [[["hello world"], "world hello"], [["one"], "one"],
                                                  [["x y z"], "z y x"]]},
    {"name": "max_of", "signature": "def max_of(xs):", "doc": "Return the largest number in the list xs.",
     "visible": [[[[1, 5, 2]], 5]], "hidden": [[[[-3, -1]], -1], [[[7]], 7], [[[2, 9, 9, 1]], 9]]},
]

def visible_test(task: dict[str, Any]) -> str:
    lines = ["from solution import " + task["name"], "", "", "def test_visible():"]
    for args, want in task["visible"]:
        lines.append(f"    assert {task['name']}(*{args!r}) == {want!r}")
    return "\n".join(lines) + "\n\n\nif __name__ == '__main__':\n    test_visible()\n    print('ok')\n"


class CodingEnv(AgentEnv):
    name = "coding"
    system_preamble = (
        "You are a coding agent in a Linux sandbox; your workspace is /workspace. Edit files with the tools, "
        "run code with bash or python, and when the task is done reply with a short summary and no tool call."
    )

    @classmethod
    def config_init(cls) -> tuple[AgentEnvConfig, list[Any]]:
        return AgentEnvConfig(
            tokenizer_name=tokenizer_dir(), group_size=4, use_wandb=False, wandb_name="coding",
            total_steps=2, max_token_length=4096, worker_timeout=1800, agent_max_steps=6,
            agent_max_tokens=256, tool_call_grammar=True, grammar_forced_tool_turns=2,
            enabled_toolsets=["shell", "files"],
            ensure_scores_are_not_same=False,
        ), server_configs()

    async def setup(self) -> None:
        await super().setup()
        self.rng = random.Random(0)
        self.index = 0

    async def get_next_item(self) -> dict[str, Any]:
        task = TASKS[self.index % len(TASKS)]
        self.index += 1
        return task

    def eval_items(self) -> list[Any]:
        return TASKS[:3]

    def build_task(self, item: dict[str, Any]) -> str:
        return (f"Implement `{item['signature'].removeprefix('def ').rstrip(':')}` in solution.py: {item['doc']} "
                f"You can check your work with `python3 test_visible.py`.")

    async def setup_trajectory_workspace(self, item: dict[str, Any], *, trajectory_id: str, exec_tool: ExecTool,
                                         lease: Lease) -> dict[str, Any]:
        stub = f'{item["signature"]}\n    """{item["doc"]}"""\n    raise NotImplementedError\n'
        await lease.write_file("solution.py", stub)
        await lease.write_file("test_visible.py", visible_test(item))
        return {}

    async def verify_and_score_trajectory(self, item: dict[str, Any], final_response: str, *, trajectory_id: str,
                                          exec_tool: ExecTool, lease: Lease, agent_result: Any,
                                          ) -> tuple[float, dict[str, Any]]:
        return await verify(lease, item)

    async def score_trajectory(self, item: dict[str, Any], final_response: str) -> float:
        raise NotImplementedError("scored in the slot by verify_and_score_trajectory")

    def verifier_checks(self) -> list[VerifierCheck]:
        return [VerifierCheck(task["name"], task, reference_policy(task["name"])) for task in TASKS]


if __name__ == "__main__":
    CodingEnv.cli()
