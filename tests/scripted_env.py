"""Scripted coding policies, and the coding env with one of them, runnable as a CLI.

``python -m tests.scripted_env process ...`` runs the coding env against the honest scripted policy
(no model server). ATROPOS_TEST_POOL_STATUS names a file that gets the pool's real status
(``SlotPool.status()``) as JSON right before the pool stops, so tests can check what the pool
actually ran, not what the config said.
"""

from __future__ import annotations

from typing import Any

from openai.types.chat import ChatCompletion

from atropos.agent.loop import assistant_turns
from atropos.envs.examples.coding import TASKS, CodingEnv
from atropos.envs.examples.coding_reference import SOLUTIONS
from atropos.testing import ScriptedServer, call, call_text, reply
from tests.scripted import RecordsPoolStatus


def task_name(text: str) -> str:
    return next(t["name"] for t in TASKS if f"`{t['name']}(" in text)


def honest_turn(name: str, turn: int) -> str:
    """write the right solution, run the visible test, answer."""
    if turn == 0:
        return call_text("write_file", path="solution.py", content=SOLUTIONS[name])
    if turn == 1:
        return call_text("bash", command="python3 test_visible.py")
    return "Done: implemented and tested."


class CodingPolicy(ScriptedServer):
    """honest: write the right solution, run the visible test, answer. cheat: wrong code + edited test.
    broken: a malformed call first."""

    mode = "honest"

    async def respond(self, messages: list[dict[str, Any]]) -> ChatCompletion:
        name = task_name(messages[1]["content"])
        turns = assistant_turns(messages)
        if self.mode == "broken":
            if turns == 0:
                return reply('<tool_call>{"name": "bash", "arguments": {"command": "ls"</tool_call>')
            turns -= 1
        if self.mode == "cheat":
            if turns == 0:
                return call("write_file", path="solution.py", content=f"def {name}(*a):\n    return None\n")
            if turns == 1:
                return call("write_file", path="test_visible.py", content="print('ok')\n")
            return reply("Done.")
        return reply(honest_turn(name, turns))


class ScriptedCodingEnv(RecordsPoolStatus, CodingEnv):
    server_cls = CodingPolicy
    pool_status_env = "ATROPOS_TEST_POOL_STATUS"


if __name__ == "__main__":
    ScriptedCodingEnv.cli()
