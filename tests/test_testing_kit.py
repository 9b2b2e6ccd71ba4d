"""atropos.testing (issue 20, finding 5): an env can be tested without a model, in process or over
real HTTP against the fake OpenAI-compatible server on 127.0.0.1."""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import httpx
import openai
import pytest

pytest.importorskip("atroposlib")

from atropos.agent.loop import assistant_turns
from atropos.envs.examples.coding import TASKS, CodingEnv
from atropos.testing import FakeChatServer, by_turn, scripted_server, server_configs, tool_call
from tests.scripted_env import make_coding_env

ADD = "def add(a, b):\n    return a + b\n"
HONEST = by_turn(tool_call("write_file", path="/workspace/solution.py", content=ADD),
                 tool_call("bash", command="python3 test_visible.py"), "Done.")


def test_by_turn_replies_per_assistant_turn() -> None:
    policy = by_turn("a", "b")
    assert policy([{"role": "user", "content": "x"}]) == "a"
    assert policy([{"role": "user", "content": "x"}, {"role": "assistant", "content": "a"}]) == "b"
    assert policy([{"role": "assistant", "content": "a"}] * 5) == "b"
    expected = '<tool_call>\n{"name": "bash", "arguments": {"command": "ls"}}\n</tool_call>'
    assert tool_call("bash", command="ls") == expected


async def test_fake_server_speaks_openai_over_http() -> None:
    seen: list[int] = []

    def policy(messages: list[dict[str, Any]]) -> str:
        seen.append(assistant_turns(messages))
        if messages[-1]["content"] == "boom":
            raise ValueError("policy bug")
        return f"reply to {messages[-1]['content']}"

    with FakeChatServer(policy, model="m") as server:
        client = openai.AsyncOpenAI(base_url=server.base_url, api_key="x", max_retries=0)
        out = await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "q"}], n=2)
        assert [c.message.content for c in out.choices] == ["reply to q", "reply to q"]
        # atroposlib's health probe is answered without the policy
        await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=1)
        assert len(server.requests) == 1 and seen == [0, 0]
        with pytest.raises(openai.InternalServerError, match="policy bug"):
            await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "boom"}])
        models = httpx.get(f"{server.base_url}/models").json()
        assert models["data"][0]["id"] == "m"
        assert httpx.post(f"{server.base_url}/completions", json={}).status_code == 404
        tool_message = {"role": "assistant", "content": None,
                        "tool_calls": [{"id": "c1", "type": "function",
                                        "function": {"name": "bash", "arguments": '{"command": "ls"}'}}]}
        server.policy = lambda messages: tool_message
        out = await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "q"}])
        call = out.choices[0].message.tool_calls[0]  # type: ignore[index]
        assert out.choices[0].finish_reason == "tool_calls" and call.function.name == "bash"  # type: ignore[union-attr]
    assert server.port > 0


def _env(tokenizer_dir: str, servers: list[Any], server_cls: type | None = None) -> CodingEnv:
    return make_coding_env(tokenizer_dir, server_cls, servers=servers, slots_per_host=2)


async def test_an_env_against_the_fake_server_over_http(tokenizer_dir: str) -> None:
    with FakeChatServer(HONEST) as server:
        env = _env(tokenizer_dir, server.server_configs())
        try:
            group, backlog = await env.collect_trajectories(TASKS[0])
        finally:
            await env.shutdown_sandbox()
        assert group is not None and backlog == [] and group["scores"] == [1.0, 1.0]
        assert len(server.requests) == 6  # 3 turns x 2 rollouts, all over HTTP


async def test_an_env_with_an_in_process_scripted_server(tokenizer_dir: str) -> None:
    wrong = by_turn(tool_call("write_file", path="solution.py", content="def add(a, b):\n    return None\n"), "Done.")
    for policy, score in ((HONEST, 1.0), (wrong, 0.0)):
        env = _env(tokenizer_dir, server_configs(), scripted_server(policy))
        try:
            group, _ = await env.collect_trajectories(TASKS[0])
        finally:
            await env.shutdown_sandbox()
        assert group is not None and group["scores"] == [score, score]


def test_fake_server_cli_serves_a_policy_until_sigterm(tmp_path: Any) -> None:
    (tmp_path / "pol.py").write_text("def policy(messages):\n    return 'scripted ' + messages[-1]['content']\n")
    proc = subprocess.Popen([sys.executable, "-m", "atropos.testing.fake_server", "--policy", "pol:policy"],
                            cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line.startswith("fake chat server at http://127.0.0.1:"), line
        url = line.split(" at ", 1)[1].strip()
        out = httpx.post(f"{url}/chat/completions", json={"model": "f", "messages": [{"role": "user", "content": "q"}]},
                         timeout=30).json()
        assert out["choices"][0]["message"]["content"] == "scripted q"
    finally:
        proc.terminate()
        assert proc.wait(timeout=30) == 0
    # quiet (issue 28): importing atropos.testing used to import this module before runpy ran it
    assert proc.stderr is not None and "RuntimeWarning" not in proc.stderr.read()
