"""A GAIA-style environment: questions with file attachments (placed in the slot before the rollout)
and web search; scored by exact normalized answer match plus an efficiency term.

Point ``--env.gaia_dir`` at a local GAIA copy (``<dir>/<split>/metadata.jsonl`` with the attachments
beside it, or ``<dir>/2023/<split>/``); by default a small built-in dataset in that layout runs
offline. Nothing is downloaded at run time.

``python -m atropos.envs.examples.gaia process --env.total_steps 2``
"""

from __future__ import annotations

import asyncio
import json
import re
import string
from pathlib import Path
from typing import Any

from pydantic import Field

from atropos.agent.loop import AgentResult
from atropos.envs.agent_env import AgentEnv, AgentEnvConfig, ExecTool
from atropos.envs.examples.common import server_configs, tokenizer_dir
from atropos.errors import ConfigError
from atropos.slots.lease import Lease

BUILTIN = Path(__file__).with_name("gaia_data")


def load_gaia(root: Path, split: str = "validation") -> list[dict[str, Any]]:
    """Items from a GAIA-layout directory: metadata.jsonl rows with their attachment paths resolved."""
    for base in (root / split, root / "2023" / split):
        meta = base / "metadata.jsonl"
        if meta.exists():
            break
    else:
        raise ConfigError(f"no {split}/metadata.jsonl under {root} (expected the GAIA directory layout)")
    items = []
    for n, line in enumerate(meta.read_text().splitlines(), 1):
        if not line.strip():
            continue
        row = json.loads(line)
        name = row.get("file_name") or ""
        path = base / name if name else None
        if path is not None and not path.exists():
            raise ConfigError(f"{meta}:{n}: attachment {name!r} is missing")
        items.append({"task_id": row["task_id"], "question": row["Question"],
                      "answer": str(row.get("Final answer", "")), "level": row.get("Level"), "file_name": name,
                      "file_path": str(path) if path else None})
    return items


def normalize(answer: str) -> str:
    """GAIA-style normalisation: numbers compare as numbers; text without case, articles, punctuation."""
    text = answer.strip()
    number = text.replace(",", "").replace("$", "").replace("%", "").strip()
    try:
        value = float(number)
        return repr(round(value, 6))
    except ValueError:
        pass
    text = text.lower().translate(str.maketrans("", "", string.punctuation))
    words = [w for w in text.split() if w not in ("a", "an", "the")]
    return " ".join(words)


def extract_final_answer(response: str) -> str:
    match = re.search(r"final answer\s*:\s*(.+)", response, re.IGNORECASE)
    if match:
        return match.group(1).strip().splitlines()[0]
    lines = [line for line in response.strip().splitlines() if line.strip()]
    return lines[-1] if lines else ""


def score_answer(predicted: str, truth: str, steps: int, max_steps: int, efficiency_weight: float) -> float:
    if normalize(predicted) != normalize(truth):
        return 0.0
    return 1.0 + efficiency_weight * max(0.0, 1.0 - steps / max(max_steps, 1))


class GaiaEnvConfig(AgentEnvConfig):
    gaia_dir: str | None = Field(None, description="local GAIA copy (default: the small built-in set)")
    gaia_split: str = Field("validation", description="split directory to read")
    efficiency_weight: float = Field(0.2, ge=0, description="bonus for correct answers in fewer steps")


class GaiaEnv(AgentEnv):
    name = "gaia"
    env_config_cls = GaiaEnvConfig
    system_preamble = ("You are a research agent. Files for the task are in /workspace. Use the tools to inspect "
                       "them or search, then reply with a line 'FINAL ANSWER: <answer>' and no tool call.")

    @classmethod
    def config_init(cls) -> tuple[GaiaEnvConfig, list[Any]]:
        return GaiaEnvConfig(
            tokenizer_name=tokenizer_dir(), group_size=4, use_wandb=False, wandb_name="gaia", total_steps=2,
            max_token_length=4096, worker_timeout=1800, agent_max_steps=6, agent_max_tokens=256,
            tool_call_grammar=True, grammar_forced_tool_turns=1, enabled_toolsets=["shell", "files", "python"],
            tool_server_url="inprocess", ensure_scores_are_not_same=False,
        ), server_configs()

    async def setup(self) -> None:
        await super().setup()
        cfg: GaiaEnvConfig = self.config
        self.items = load_gaia(Path(cfg.gaia_dir) if cfg.gaia_dir else BUILTIN, cfg.gaia_split)
        self.index = 0

    async def get_next_item(self) -> dict[str, Any]:
        item = self.items[self.index % len(self.items)]
        self.index += 1
        return item

    def eval_items(self) -> list[Any]:
        return list(getattr(self, "items", []))

    def build_task(self, item: dict[str, Any]) -> str:
        note = f" The attached file is /workspace/{item['file_name']}." if item.get("file_name") else ""
        return item["question"] + note

    async def setup_trajectory_workspace(self, item: dict[str, Any], *, trajectory_id: str, exec_tool: ExecTool,
                                         lease: Lease) -> dict[str, Any]:
        if item.get("file_path"):
            data = await asyncio.to_thread(Path(item["file_path"]).read_bytes)
            await lease.write_bytes(item["file_name"], data)
        return {}

    async def verify_and_score_trajectory(self, item: dict[str, Any], final_response: str, *, trajectory_id: str,
                                          exec_tool: ExecTool, lease: Lease, agent_result: AgentResult,
                                          ) -> tuple[float, dict[str, Any]]:
        cfg: GaiaEnvConfig = self.config
        predicted = extract_final_answer(final_response)
        score = score_answer(predicted, item["answer"], len(agent_result.steps), cfg.agent_max_steps,
                             cfg.efficiency_weight)
        return score, {"predicted": predicted}

    async def score_trajectory(self, item: dict[str, Any], final_response: str) -> float:
        return score_answer(extract_final_answer(final_response), item["answer"], 0, 1, 0.0)


if __name__ == "__main__":
    GaiaEnv.cli()
