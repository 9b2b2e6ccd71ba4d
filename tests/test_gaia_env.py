"""GAIA-style env: attachments placed in the slot, in-process ToolServer web search, scoring."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("atroposlib")

from openai.types.chat import ChatCompletion

from atropos.envs.examples.gaia import (
    BUILTIN,
    GaiaEnv,
    GaiaEnvConfig,
    extract_final_answer,
    load_gaia,
    normalize,
)
from atropos.errors import ConfigError
from atropos.testing import ScriptedServer, call, reply, server_configs

SOLVERS = {
    "sales.csv": "python3 -c \"import csv; rows=list(csv.DictReader(open('sales.csv'))); "
                 "print(sum(int(r['amount']) for r in rows {cond}))\"",
    "service.log": "grep -c ' ERROR ' service.log",
    "notes.txt": "grep -i owner notes.txt | sed 's/.*: //'",
}


class Researcher(ScriptedServer):
    async def respond(self, messages: list[dict[str, Any]]) -> ChatCompletion:
        question = messages[1]["content"]
        tool_msgs = [m["content"] for m in messages if m["role"] == "tool"]
        if not tool_msgs:
            if "Everest" in question:
                return call("web_search", query="Mount Everest mountain range")
            name = re.search(r"/workspace/(\S+?)\.?$", question).group(1)  # type: ignore[union-attr]
            cmd = SOLVERS[name].replace("{cond}", "if r['region']=='north'" if "north" in question else "")
            return call("bash", command=cmd)
        last = tool_msgs[-1].removeprefix("<tool_response>\n").removesuffix("\n</tool_response>")
        if "Everest" in question:
            return reply("FINAL ANSWER: the Himalayas" if "Himalaya" in last else "FINAL ANSWER: unknown")
        return reply(f"I computed it.\nFINAL ANSWER: {last.strip()}")


def test_loader_reads_the_gaia_layout_and_names_missing_attachments(tmp_path: Path) -> None:
    items = load_gaia(BUILTIN)
    assert len(items) == 5 and all(Path(i["file_path"]).exists() for i in items if i["file_name"])
    split = tmp_path / "2023" / "validation"
    split.mkdir(parents=True)
    (split / "metadata.jsonl").write_text(json.dumps(
        {"task_id": "x", "Question": "q", "Level": 2, "Final answer": "42", "file_name": "gone.pdf"}) + "\n")
    with pytest.raises(ConfigError, match=r"gone\.pdf"):
        load_gaia(tmp_path)
    with pytest.raises(ConfigError, match=r"metadata\.jsonl"):
        load_gaia(tmp_path, "test")


def test_normalized_match_and_final_answer_extraction() -> None:
    assert normalize("6,664") == normalize("6664.0")
    assert normalize("The Himalayas.") == normalize("himalayas")
    assert normalize("Paris") != normalize("Lyon")
    assert extract_final_answer("thinking...\nFINAL ANSWER: 42\n") == "42"
    assert extract_final_answer("just 7") == "just 7"


async def test_attachments_and_web_search_score_in_the_slot(tokenizer_dir: str) -> None:
    cfg = GaiaEnvConfig(tokenizer_name=tokenizer_dir, group_size=1, use_wandb=False, wandb_name="g",
                        slots_per_host=4, max_hosts=1, agent_max_steps=4, tool_server_url="inprocess",
                        enabled_toolsets=["shell", "files"], ensure_scores_are_not_same=False)
    servers = server_configs()
    env = type("G", (GaiaEnv,), {"server_cls": Researcher})(cfg, servers, slurm=False, testing=False)
    await env.setup()
    try:
        assert "web_search" in env.tools.names()
        scores = {}
        for item in env.items:
            group, _ = await env.collect_trajectories(item)
            assert group is not None
            scores[item["task_id"]] = group["scores"][0]
        # every answer is right; two steps out of four earn half the efficiency bonus
        assert scores == {task: pytest.approx(1.1) for task in scores}
    finally:
        await env.shutdown_sandbox()


class Searcher(ScriptedServer):
    """Searches the question, answers with the ground truth only if the search results contain it."""

    answers: dict[str, str] = {}

    async def respond(self, messages: list[dict[str, Any]]) -> ChatCompletion:
        question = messages[1]["content"]
        tools = [m["content"] for m in messages if m["role"] == "tool"]
        if not tools:
            return call("web_search", query=question, max_results=3)
        answer = self.answers[question]
        return reply(f"FINAL ANSWER: {answer}" if answer.lower() in tools[-1].lower() else "FINAL ANSWER: unknown")


async def test_search_env_rewards_answers_found_through_offline_search(tokenizer_dir: str) -> None:
    from atropos.envs.examples.search import SearchEnv, SearchEnvConfig

    cfg = SearchEnvConfig(tokenizer_name=tokenizer_dir, group_size=1, use_wandb=False, wandb_name="s",
                          slots_per_host=2, max_hosts=1, agent_max_steps=3, tool_server_url="inprocess",
                          enabled_toolsets=[], ensure_scores_are_not_same=False)
    servers = server_configs()
    env = type("S", (SearchEnv,), {"server_cls": Searcher})(cfg, servers, slurm=False, testing=False)
    await env.setup()
    Searcher.answers = {t["question"]: t["answer"] for t in env.tasks}
    try:
        assert env.tools.names() == ["web_extract", "web_search"]
        scores = []
        for task in env.tasks:
            group, _ = await env.collect_trajectories(task)
            assert group is not None
            scores.append(group["scores"][0])
        assert scores == [1.0] * len(env.tasks)
    finally:
        await env.shutdown_sandbox()
