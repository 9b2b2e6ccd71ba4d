"""A real smolagents CodeAgent whose code steps run in a leased slot (SlotPythonExecutor).

The scripted model is a smolagents ``Model`` subclass that answers each step with the next
code block of a script, so every assertion is about where and how the code ran, not about what a
model chose. The last test drives the agent with the project's real model server (SmolLM2).
"""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import AsyncIterator
from importlib import resources
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
import yaml

pytest.importorskip("smolagents")

from smolagents import CodeAgent, tool
from smolagents.memory import ActionStep
from smolagents.models import ChatMessage, MessageRole, Model

from atropos.errors import ConfigError
from atropos.integrations.smolagents import SlotPythonExecutor
from atropos.slots.pool import SlotPool
from tests.pool_backends import local_pool

REPO = Path(__file__).resolve().parent.parent


class ScriptedModel(Model):
    """Answers step i with the i-th code block, in the format CodeAgent parses."""

    def __init__(self, steps: list[str]) -> None:
        super().__init__(model_id="scripted")
        self.steps = steps
        self.calls = 0

    def generate(self, messages: list[Any], stop_sequences: list[str] | None = None,
                 response_format: dict[str, str] | None = None, tools_to_call_from: list[Any] | None = None,
                 **kwargs: Any) -> ChatMessage:
        code = self.steps[min(self.calls, len(self.steps) - 1)]
        self.calls += 1
        return ChatMessage(role=MessageRole.ASSISTANT, content=f"Thought: step {self.calls}.\n<code>\n{code}\n</code>")


# One pool for the module: every test leases through ``pool.leased`` (released, so reset, at its
# end), and runs in the module's event loop, where the pool's tasks live.
pytestmark = pytest.mark.asyncio(loop_scope="module")


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def pool() -> AsyncIterator[SlotPool]:
    async with local_pool(2) as p:
        yield p


def observations(agent: CodeAgent) -> list[str]:
    return [str(s.observations or "") for s in agent.memory.steps if isinstance(s, ActionStep)]


@tool
def where_am_i() -> str:
    """Where this tool runs: its working directory and user id."""
    import os

    return f"{os.getcwd()} uid={os.getuid()}"


async def test_code_agent_keeps_state_across_steps_in_the_slot(pool: SlotPool, tmp_path: Path) -> None:
    host_secret = tmp_path / f"host-secret-{secrets.token_hex(4)}"
    host_secret.write_text("host only")
    async with pool.leased("agent-a") as lease, pool.leased("agent-b") as other:
        other_secret = secrets.token_hex(8)
        await other.write_file("other.txt", other_secret)
        model = ScriptedModel([
            "import os\ncounter = 41\nprint('cwd', os.getcwd())\nopen('step1.txt', 'w').write('from step 1')",
            "counter += 1\nprint('counter', counter)\nprint('tool says', where_am_i())",
            f"import glob, os\nseen = [os.path.exists({str(host_secret)!r}), "
            f"bool(glob.glob('/proc/*/root/workspace/other.txt')), os.path.exists('../{other.slot}/ws/other.txt')]\n"
            "print('seen', seen)",
            "final_answer({'counter': counter, 'seen': seen})",
        ])
        executor = SlotPythonExecutor(lease)
        agent = CodeAgent(tools=[where_am_i], model=model, executor=executor, max_steps=6)
        answer = await asyncio.to_thread(agent.run, "count to 42")
        assert answer == {"counter": 42, "seen": [False, False, False]}
        obs = observations(agent)
        assert "cwd /workspace" in obs[0]
        assert "counter 42" in obs[1]
        assert "tool says /workspace uid=1000" in obs[1]  # the tool ran in the slot too
        # the code's file is in the leased slot's workspace, not in the other slot's
        assert await lease.read_file("step1.txt") == "from step 1"
        assert (await other.bash("ls"))["stdout"] == "other.txt\n"
        assert model.calls == 4


async def test_errors_and_timeouts_reach_the_agent_and_the_session_survives(pool: SlotPool) -> None:
    async with pool.leased("agent-errors") as lease:
        model = ScriptedModel([
            "kept = 'value'\nundefined_thing",
            "while True:\n    pass",
            "final_answer(kept)",
        ])
        agent = CodeAgent(tools=[], model=model, executor=SlotPythonExecutor(lease, timeout_s=1), max_steps=5)
        assert await asyncio.to_thread(agent.run, "fail, then finish") == "value"
        errors = [str(s.error) for s in agent.memory.steps if isinstance(s, ActionStep) and s.error]
        assert "NameError" in errors[0] and "undefined_thing" in errors[0]
        assert "SessionTimeout" in errors[1]


async def test_a_restarted_session_gets_its_tools_back(pool: SlotPool) -> None:
    async with pool.leased("agent-restart") as lease:
        model = ScriptedModel([
            "lost = 1\nimport signal\nsignal.signal(signal.SIGALRM, signal.SIG_IGN)\nwhile True: pass",
            "print('lost' in dir())\nprint(where_am_i())",
            "final_answer('done')",
        ])
        agent = CodeAgent(tools=[where_am_i], model=model, executor=SlotPythonExecutor(lease, timeout_s=1),
                          max_steps=5)
        assert await asyncio.to_thread(agent.run, "survive a restart") == "done"
        steps = [s for s in agent.memory.steps if isinstance(s, ActionStep)]
        assert steps[0].error is not None and "restarted" in str(steps[0].error)
        assert "False\n/workspace uid=1000" in str(steps[1].observations)


async def test_the_executor_refuses_to_block_its_own_event_loop(pool: SlotPool) -> None:
    async with pool.leased("agent-loop") as lease:
        executor = SlotPythonExecutor(lease)
        with pytest.raises(ConfigError, match="to_thread"):
            executor("1 + 1")
        assert (await asyncio.to_thread(executor, "1 + 1")).output == "2"


async def test_additional_imports_present_in_the_sandbox_need_no_network(pool: SlotPool) -> None:
    async with pool.leased("agent-imports") as lease:
        executor = SlotPythonExecutor(lease, additional_imports=["json"])
        out = await asyncio.to_thread(executor, "import json; json.dumps([1])")
        assert out.output == "'[1]'"
        assert executor.installed_packages == ["json"]


# -- with the project's real model server --------------------------------------------------------


# The tiny model does not write working agent code on its own; a grammar (the server's GBNF
# support) keeps its answer in CodeAgent's format so the loop itself is what is tested.
STEP_GRAMMAR = (r'root ::= "Thought: " [a-zA-Z ,.]{1,60} "\n<code>\n" '
                r'"print(" [0-9]{1,3} " + " [0-9]{1,3} ")" "\n</code>"')


@pytest.mark.slow
@pytest.mark.timeout(1800)
async def test_code_agent_with_the_real_model(pool: SlotPool, model_url: str) -> None:
    from smolagents import OpenAIModel

    # flatten: llama.cpp's server takes message content as a string, not a list of parts
    model = OpenAIModel(model_id="smollm2", api_base=model_url, api_key="unused", max_tokens=96,
                        flatten_messages_as_text=True,
                        temperature=0.0, extra_body={"grammar": STEP_GRAMMAR})
    async with pool.leased("agent-real-model") as lease:
        executor = SlotPythonExecutor(lease, timeout_s=10)
        # A short system prompt: the default one is thousands of tokens for a 135M model on 2 cores.
        templates = yaml.safe_load(resources.files("smolagents.prompts").joinpath("code_agent.yaml").read_text())
        templates["system_prompt"] = ("You solve tasks by writing Python. "
                                      "Answer with 'Thought: ...' then one <code> block.")
        agent = CodeAgent(tools=[], model=model, executor=executor, max_steps=2, prompt_templates=templates)
        await asyncio.to_thread(agent.run, "Add two numbers and print the sum.")
        steps = [s for s in agent.memory.steps if isinstance(s, ActionStep)]
        assert len(steps) >= 2  # the two code steps (and the max-steps answer step)
        ran = [s for s in steps if s.code_action and s.code_action.startswith("print(")]
        assert ran, [s.model_output for s in steps]
        for step in ran:
            a, b = step.code_action.removeprefix("print(").removesuffix(")").split(" + ")
            assert f"Execution logs:\n{int(a) + int(b)}\n" in str(step.observations)  # computed in the slot
        # the steps ran in this lease's session: its execution count went on from them
        after = await lease.python_session("1")
        assert after["execution_count"] > len(ran)
