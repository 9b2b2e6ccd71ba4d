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
from atropos.envs.config import AgentEnvConfig
from atropos.envs.examples.coding import TASKS, CodingEnv
from atropos.envs.examples.coding_reference import SOLUTIONS
from atropos.testing import ScriptedServer, call, call_text, reply, server_configs
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


def make_coding_env(tokenizer_dir: str, policy: type | None = CodingPolicy, *, env_cls: type[CodingEnv] = CodingEnv,
                    servers: list[Any] | None = None, **overrides: Any) -> CodingEnv:
    """A coding env (``env_cls``) in this process whose model is ``policy`` (a ScriptedServer class;
    None: whatever ``servers`` point at), with the tests' small settings; ``overrides`` win."""
    fields: dict[str, Any] = dict(tokenizer_name=tokenizer_dir, group_size=2, use_wandb=False, wandb_name="t",
                                  slots_per_host=4, max_hosts=1, agent_max_steps=4,
                                  enabled_toolsets=["shell", "files"], tool_batch_window_ms=5)
    fields.update(overrides)
    cls = env_cls if policy is None else type(f"Test{env_cls.__name__}", (env_cls,), {"server_cls": policy})
    env = cls(AgentEnvConfig(**fields), servers or server_configs(), slurm=False, testing=False)
    env.index = 0
    return env


class ScriptedCodingEnv(RecordsPoolStatus, CodingEnv):
    server_cls = CodingPolicy
    pool_status_env = "ATROPOS_TEST_POOL_STATUS"


if __name__ == "__main__":
    ScriptedCodingEnv.cli()
