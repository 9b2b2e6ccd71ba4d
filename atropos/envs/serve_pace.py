"""Serve mode's pace: how many groups an AgentEnv runs at once by default, and the warning when
the configured number cannot be served within atroposlib's ``worker_timeout``.

atroposlib starts ``max_num_workers_per_node`` (8) groups per inference server at once. A group of
agent rollouts makes many model calls; a server that runs few requests in parallel (llama.cpp on
a small CPU) then queues every turn behind all the others, each group takes as long as all of
them together, and atroposlib cancels every one at ``worker_timeout``: the trainer gets nothing.
So an AgentEnv starts only as many groups as one trainer batch needs (fewer if the pool has not
the slots), and measures the model's turns to say when even that cannot finish in time.
"""

from __future__ import annotations

import math
import statistics
from collections import deque

# the recent turns the estimate looks at, and how many it needs before it says anything
TURN_WINDOW = 16
MIN_TURNS = 2


def default_max_workers(*, batch_size: int, group_size: int, atroposlib_default: int, pool_slots: int) -> int:
    """Groups at once when ``max_num_workers`` is left at -1: the groups of one trainer batch
    (more only queue at the inference server and run off-policy), at most atroposlib's own
    default, at most what the pool's slots hold, at least 1."""
    per_batch = math.ceil(batch_size / group_size) if batch_size > 0 else atroposlib_default
    return max(1, min(atroposlib_default, per_batch, pool_slots // max(1, group_size)))


class TurnPace:
    """The latency of the model's recent turns, and whether a rollout of ``max_steps`` turns at
    that latency outlives ``worker_timeout`` (said once per run)."""

    def __init__(self) -> None:
        self.turns: deque[float] = deque(maxlen=TURN_WINDOW)
        self.warned = False

    def add(self, seconds: float) -> None:
        self.turns.append(seconds)

    def warning(self, *, max_steps: int, worker_timeout: float, groups_running: int, group_size: int,
                max_workers: int) -> str | None:
        """The warning to print now, or None (no timeout, too few turns yet, in time, or said already)."""
        if self.warned or worker_timeout <= 0 or len(self.turns) < MIN_TURNS:
            return None
        turn = statistics.median(self.turns)
        needed = turn * max_steps
        if needed <= worker_timeout:
            return None
        self.warned = True
        return (f"warning: a model turn takes {turn:.1f} s with {groups_running} group(s) of {group_size} at "
                f"once, so a rollout of up to {max_steps} turns (agent_max_steps) needs up to {needed:.0f} s, more "
                f"than worker_timeout ({worker_timeout:.0f} s): atroposlib cancels a group that runs longer and the "
                f"trainer gets nothing from it. Lower --env.max_num_workers (now {max_workers}) or "
                "--env.agent_max_steps, or raise --env.worker_timeout.")
