"""Serve mode: how many groups an AgentEnv runs at once by default, the warning when the
configured number cannot be served within atroposlib's ``worker_timeout``, and the rest of what
``serve`` does differently (``ServeMode``).

atroposlib starts ``max_num_workers_per_node`` (8) groups per inference server at once. A group of
agent rollouts makes many model calls; a server that runs few requests in parallel (llama.cpp on
a small CPU) then queues every turn behind all the others, each group takes as long as all of
them together, and atroposlib cancels every one at ``worker_timeout``: the trainer gets nothing.
So an AgentEnv starts only as many groups as one trainer batch needs (fewer if the pool has not
the slots), and measures the model's turns to say when even that cannot finish in time.
"""

from __future__ import annotations

import asyncio
import logging
import math
import statistics
import sys
from collections import deque
from collections.abc import Awaitable
from typing import Any, TypeVar

import httpx

log = logging.getLogger("atropos.envs.agent_env")
T = TypeVar("T")

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


class TrainerDone(Exception):
    """Serve mode: the trainer has taken ``total_steps`` batches (ends BaseEnv's loop, not an error)."""


def say(line: str) -> None:
    print(f"[atropos-sandbox] {line}", file=sys.stderr, flush=True)


class ServeMode:
    """What an AgentEnv does differently in ``serve`` mode (its BaseEnv overrides delegate here):
    how many groups run at once, the pace warning, the stop once the trainer has its
    ``total_steps``, the check for a run-api left over from an earlier run, and the group workers
    to wait for before the pool stops."""

    def __init__(self) -> None:
        self.active = False  # set by start(): only serve mode paces and tracks its groups
        self.rollout_tasks: set[asyncio.Task[Any]] = set()  # BaseEnv's group workers still running
        self.pace = TurnPace()

    def start(self) -> None:
        self.active = True

    async def tracked(self, work: Awaitable[T]) -> T:
        """A group worker, tracked until it has ended: BaseEnv cancels workers (total_steps, queue
        full, worker_timeout) without waiting for them, and a group's slots must be released before
        the pool stops."""
        task = asyncio.current_task()
        if task is not None:
            self.rollout_tasks.add(task)
        try:
            return await work
        finally:
            if task is not None:
                self.rollout_tasks.discard(task)

    async def stop_rollouts(self) -> None:
        tasks = [t for t in self.rollout_tasks if t is not asyncio.current_task()]
        for task in tasks:
            task.cancel()
        # each releases its slots in its finally; nothing they raise matters once the run is over
        await asyncio.gather(*tasks, return_exceptions=True)

    @staticmethod
    def trainer_done(status: dict[str, Any], total_steps: int) -> bool:
        """True once the trainer has taken ``total_steps`` batches (BaseEnv waits for one more batch
        in the queue, which nobody will take)."""
        return bool(status["current_step"] >= total_steps > 0)

    @staticmethod
    async def check_leftover(rollout_server_url: str) -> None:
        """Warn if run-api already holds groups or steps this env did not make: a run-api left
        running by an earlier run hands its groups to the new trainer first."""
        try:
            async with httpx.AsyncClient(timeout=10) as client:
                status = (await client.get(f"{rollout_server_url}/status")).json()
            queued, step = int(status["queue_size"]), int(status["current_step"])
        except (httpx.HTTPError, ValueError, KeyError, TypeError) as exc:
            log.debug("run-api /status unreadable (%s); no leftover check", exc)
            return
        if queued or step:
            say(f"warning: run-api at {rollout_server_url} already holds {queued} group(s) and is at "
                f"step {step} before this env sent anything: left over from an earlier run, unless another env "
                "sent them or the trainer resumed at that step. A trainer gets those groups first, and a step "
                "at total_steps ends this env at once. Start a fresh run-api for each run, or have the trainer "
                "GET /reset_data before it registers (docs/write-an-environment.md, section 5).")

    @staticmethod
    def workers(config: Any, servers: int) -> int:
        """``max_num_workers`` when left at -1 (the groups of one batch, ``default_max_workers``),
        said once with the timeout that applies to each group."""
        c = config
        workers = c.max_num_workers
        if workers == -1:
            workers = default_max_workers(
                batch_size=c.batch_size, group_size=c.group_size,
                atroposlib_default=c.max_num_workers_per_node * servers,
                pool_slots=c.max_hosts * c.slots_per_host)
        say(f"serve: up to {workers} group(s) of {c.group_size} at once (--env.max_num_workers; "
            f"the trainer's batch is {c.batch_size}), each cancelled after {c.worker_timeout:.0f} s "
            "(--env.worker_timeout)")
        return int(workers)

    def turn_done(self, seconds: float, config: Any, groups_running: int, max_workers: int) -> None:
        """A model turn took ``seconds``: warn once if rollouts at this pace outlive ``worker_timeout``."""
        if not self.active:
            return
        self.pace.add(seconds)
        c = config
        warning = self.pace.warning(max_steps=c.agent_max_steps, worker_timeout=c.worker_timeout,
                                    groups_running=max(1, groups_running), group_size=c.group_size,
                                    max_workers=max_workers)
        if warning:
            say(warning)
