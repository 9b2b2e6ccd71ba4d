"""The coding env with a policy that solves ``add`` and deletes solution.py in every other task, so a
run has rollouts that score 1 and rollouts whose verifier says why they scored 0 (``no_solution``).
``python -m tests.score_info_env process ...`` runs it as a user would."""

from __future__ import annotations

from typing import Any

from atropos.agent.loop import assistant_turns
from atropos.envs.examples.coding import CodingEnv
from atropos.testing import call_text
from tests.scripted_env import honest_turn, task_name


def solve_add_delete_others(messages: list[dict[str, Any]]) -> str:
    name, turn = task_name(messages[1]["content"]), assistant_turns(messages)
    if name == "add":
        return honest_turn(name, turn)
    return call_text("bash", command="rm -f solution.py") if turn == 0 else "Done."


class ScoreInfoEnv(CodingEnv):
    pass


if __name__ == "__main__":
    from atropos.testing import scripted_server

    type("ScriptedScoreInfoEnv", (ScoreInfoEnv,), {"server_cls": scripted_server(solve_add_delete_others)}).cli()
