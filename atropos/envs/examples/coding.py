"""A coding environment: implement a function in the slot; hidden tests, copied in only at
verification time and run in the same slot, give the reward.

``python -m atropos.envs.examples.coding process --env.total_steps 2 --env.group_size 4``
"""

from __future__ import annotations

import json
import random
import shlex
from typing import Any

from atropos.envs.agent_env import AgentEnv, AgentEnvConfig, ExecTool
from atropos.envs.examples.common import server_configs, tokenizer_dir
from atropos.slots.lease import Lease

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

RUNNER = r'''
import importlib.util, json, os, sys
here = os.path.dirname(os.path.abspath(__file__))
spec = importlib.util.spec_from_file_location("solution", os.path.join(here, "solution.py"))
cases = json.loads(sys.argv[2])
passed = 0
try:
    mod = importlib.util.module_from_spec(spec); spec.loader.exec_module(mod)
    fn = getattr(mod, sys.argv[1])
except Exception as exc:
    print("IMPORT ERROR", type(exc).__name__, exc); print("PASSED 0/%d" % len(cases)); sys.exit(1)
for args, want in cases:
    try:
        ok = fn(*args) == want
    except Exception:
        ok = False
    passed += ok
print("PASSED %d/%d" % (passed, len(cases)))
'''


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


async def verify(lease: Lease, item: dict[str, Any]) -> tuple[float, dict[str, Any]]:
    """Run the hidden tests against solution.py in a private copy (the agent never saw them).

    The copy lives in the call's own /tmp, which nothing the agent left running (e.g. in the
    terminal) can see; ``python3 -I`` keeps the workspace off sys.path, so a planted module cannot
    shadow the standard library.
    """
    cases = json.dumps(item["hidden"])
    script = (
        "set -e; d=$(mktemp -d); cp solution.py \"$d/solution.py\"; "
        f"printf %s {shlex.quote(RUNNER)} > \"$d/run_hidden.py\"; "
        f"python3 -I \"$d/run_hidden.py\" {shlex.quote(item['name'])} {shlex.quote(cases)}"
    )
    out = await lease.call("bash", {"command": script}, timeout_s=60)
    text = (out.result or {}).get("stdout", "") if out.ok else ""
    passed, total = 0, len(item["hidden"])
    for line in text.splitlines():
        if line.startswith("PASSED "):
            passed, total = (int(x) for x in line.split()[1].split("/"))
    return passed / total if total else 0.0, {"hidden_passed": passed, "hidden_total": total}


if __name__ == "__main__":
    CodingEnv.cli()
