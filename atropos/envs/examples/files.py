"""A terminal/files environment: the task leaves the workspace in a state a checker verifies.

``python -m atropos.envs.examples.files process --env.total_steps 2 --env.group_size 4``
"""

from __future__ import annotations

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


async def check(lease: Lease, item: dict[str, Any]) -> float:
    """The checker reads the slot's final state (never the agent's claims)."""
    async def text(path: str) -> str | None:
        result = await lease.call("read_file", {"path": path})
        return str(result.result["content"]).strip() if result.ok and result.result else None

    if item["kind"] == "count_lines":
        return 1.0 if await text("reports/summary.txt") == str(item["n"]) else 0.0
    if item["kind"] == "sum_numbers":
        return 1.0 if await text("total.txt") == str(sum(item["nums"])) else 0.0
    listing = await lease.call("list_dir", {"path": "logs"})
    names = {e["name"] for e in (listing.result or {}).get("entries", [])} if listing.ok else set()
    want = {f"{n}.txt" for n in item["names"]} | {"keep.cfg"}
    return 1.0 if names == want else 0.0


if __name__ == "__main__":
    FilesEnv.cli()
