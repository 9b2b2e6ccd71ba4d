"""A terminal/files environment: the task leaves the workspace in a state a checker verifies.

``python -m atropos.envs.examples.files process --env.total_steps 2 --env.group_size 4``
"""

from __future__ import annotations

import json
import random
from typing import Any

from atropos.envs.agent_env import AgentEnv, AgentEnvConfig, ExecTool
from atropos.envs.examples.common import server_configs, tokenizer_dir
from atropos.slots.lease import Lease


def make_task(kind: str, rng: random.Random) -> dict[str, Any]:
    if kind == "count_lines":
        n = rng.randint(3, 40)
        return {"kind": kind, "n": n, "prompt": "Count the lines of data.csv and write the number (digits only) "
                                               "to reports/summary.txt (create the reports directory)."}
    if kind == "sum_numbers":
        nums = [rng.randint(1, 99) for _ in range(rng.randint(3, 8))]
        return {"kind": kind, "nums": nums, "prompt": "numbers.txt holds one integer per line. Write their sum "
                                                     "(digits only) to total.txt."}
    names = [f"app{i}" for i in range(rng.randint(2, 4))]
    return {"kind": "rename_logs", "names": names,
            "prompt": "Rename every .log file in the logs directory to the same name with a .txt extension."}


KINDS = ("count_lines", "sum_numbers", "rename_logs")


class FilesEnv(AgentEnv):
    name = "files"
    system_preamble = ("You are a shell agent in a Linux sandbox; your workspace is /workspace. Use the tools to "
                       "inspect and change files; when the task is done, reply briefly without a tool call.")

    @classmethod
    def config_init(cls) -> tuple[AgentEnvConfig, list[Any]]:
        return AgentEnvConfig(
            tokenizer_name=tokenizer_dir(), group_size=4, use_wandb=False, wandb_name="files", total_steps=2,
            max_token_length=4096, worker_timeout=1800, agent_max_steps=6, agent_max_tokens=256,
            tool_call_grammar=True, grammar_forced_tool_turns=2, enabled_toolsets=["shell", "files", "terminal"],
            ensure_scores_are_not_same=False,
        ), server_configs()

    async def setup(self) -> None:
        await super().setup()
        self.rng = random.Random(1)

    async def get_next_item(self) -> dict[str, Any]:
        return make_task(self.rng.choice(KINDS), self.rng)

    def eval_items(self) -> list[Any]:
        rng = random.Random(99)
        return [make_task(kind, rng) for kind in KINDS]

    def build_task(self, item: dict[str, Any]) -> str:
        return str(item["prompt"])

    async def setup_trajectory_workspace(self, item: dict[str, Any], *, trajectory_id: str, exec_tool: ExecTool,
                                         lease: Lease) -> dict[str, Any]:
        if item["kind"] == "count_lines":
            await lease.write_file("data.csv", "".join(f"row{i},{i * 7}\n" for i in range(item["n"])))
        elif item["kind"] == "sum_numbers":
            await lease.write_file("numbers.txt", "".join(f"{n}\n" for n in item["nums"]))
        else:
            for name in item["names"]:
                await lease.write_file(f"logs/{name}.log", f"log of {name}\n")
            await lease.write_file("logs/keep.cfg", "not a log\n")
        return {}

    async def verify_and_score_trajectory(self, item: dict[str, Any], final_response: str, *, trajectory_id: str,
                                          exec_tool: ExecTool, lease: Lease, agent_result: Any,
                                          ) -> tuple[float, dict[str, Any]]:
        return await check(lease, item), {}

    async def score_trajectory(self, item: dict[str, Any], final_response: str) -> float:
        raise NotImplementedError("scored in the slot")


# The checker, run in the slot's verification phase (Lease.verify): it reads the workspace as the
# agent left it (read-only, every process of the agent dead), resolving paths inside it only.
CHECKER = r'''
import json, os


def text(path):
    try:
        return read_workspace(path, 1 << 20).decode("utf-8", "replace").strip()
    except OSError:
        return None


def verify(workspace, secrets, args):
    want = json.loads(secrets["expected"])
    if want["kind"] in ("count_lines", "sum_numbers"):
        return 1.0 if text(want["path"]) == want["text"] else 0.0
    try:
        fd = open_in_workspace("logs")
    except OSError:
        return 0.0
    try:
        names = sorted(os.listdir(fd))
    finally:
        os.close(fd)
    return 1.0 if names == sorted(want["names"]) else 0.0
'''


def expected(item: dict[str, Any]) -> dict[str, Any]:
    if item["kind"] == "count_lines":
        return {"kind": item["kind"], "path": "reports/summary.txt", "text": str(item["n"])}
    if item["kind"] == "sum_numbers":
        return {"kind": item["kind"], "path": "total.txt", "text": str(sum(item["nums"]))}
    return {"kind": item["kind"], "names": [f"{n}.txt" for n in item["names"]] + ["keep.cfg"]}


async def check(lease: Lease, item: dict[str, Any]) -> float:
    """The checker reads the slot's final state (never the agent's claims); a checker that could
    not give a verdict scores 0."""
    result = await lease.verify(CHECKER, secrets={"expected": json.dumps(expected(item))}, timeout_s=30)
    return result.score if result.ok and result.score is not None else 0.0


if __name__ == "__main__":
    FilesEnv.cli()
