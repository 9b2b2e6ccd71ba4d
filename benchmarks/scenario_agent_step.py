"""agent_step: a scripted policy loop (no LLM) and the sandbox's share of rollout time.

16 trajectories at once, each: 20 steps of [simulated model time: ``asyncio.sleep(0.05)``, then
one turn of three tool calls through ``ToolExecutor.execute_many``: bash ``ls``, ``write_file``
(a 1 KiB file per step), ``read_file`` of it]; the slot is leased on the first call and released
(reset) at the end, both counted as sandbox time. Local backend, 1 host x 16 slots.

Reported per executor batch window (20 ms = the default, and 0 ms): the per-step tool time (the
three calls of one turn), the rollout wall time per trajectory, and the sandbox share:
time in lease + tool calls + release divided by the trajectory's wall time (the rest is the
simulated model time, measured as the actual sleep, which a busy event loop can stretch).

No target in docs/targets.md; the design goal is "the sandbox is never what a training run
waits on", i.e. a small share next to real model time (which is usually far above 50 ms).
"""

from __future__ import annotations

import asyncio
import shutil
import time

from benchmarks.common import BENCH_ROOT, Row, ScenarioResult, local_pool, scenario_main

NAME = "agent_step"
TRAJECTORIES = 16
MODEL_S = 0.050


async def _rollouts(pool: object, window_ms: float,
                    steps: int) -> tuple[list[float], list[float], list[float], list[float]]:
    from atropos.tools.executor import AgentToolCall, ExecutorConfig, ToolExecutor

    ex = ToolExecutor(pool, cfg=ExecutorConfig(tool_batch_window_ms=window_ms))  # type: ignore[arg-type]
    step_ms: list[float] = []
    wall_ms: list[float] = []
    share: list[float] = []
    release_ms: list[float] = []
    payload = "0123456789abcdef" * 64  # 1 KiB

    async def trajectory(k: int) -> None:
        tid = f"agent-{window_ms:g}-{k}"
        sandbox = 0.0
        t_start = time.perf_counter()
        try:
            for s in range(steps):
                await asyncio.sleep(MODEL_S)  # the "model" thinks
                calls = [
                    AgentToolCall(id=f"{s}a", name="bash", arguments={"command": "ls"}),
                    AgentToolCall(id=f"{s}b", name="write_file",
                                  arguments={"path": f"notes/step{s}.txt", "content": payload}),
                    AgentToolCall(id=f"{s}c", name="read_file", arguments={"path": f"notes/step{s}.txt"}),
                ]
                t0 = time.perf_counter()
                outs = await ex.execute_many(tid, calls)
                dt = time.perf_counter() - t0
                sandbox += dt
                step_ms.append(dt * 1e3)
                if not all(o.ok for o in outs):
                    raise RuntimeError(f"{tid} step {s}: {[o.content[:200] for o in outs if not o.ok]}")
        finally:
            t0 = time.perf_counter()
            await ex.release_trajectory(tid)
            sandbox += time.perf_counter() - t0
            release_ms.append((time.perf_counter() - t0) * 1e3)
        wall = time.perf_counter() - t_start
        wall_ms.append(wall * 1e3)
        share.append(sandbox / wall)

    try:
        await asyncio.gather(*(trajectory(k) for k in range(TRAJECTORIES)))
    finally:
        await ex.close()
    return step_ms, wall_ms, share, release_ms


async def run(quick: bool) -> ScenarioResult:
    steps = 5 if quick else 20
    res = ScenarioResult(NAME, f"scripted agent loop: {TRAJECTORIES} trajectories x {steps} steps "
                               f"(model {MODEL_S * 1e3:.0f} ms + ls, write_file, read_file)",
                         params={"trajectories": TRAJECTORIES, "steps": steps, "model_ms": MODEL_S * 1e3,
                                 "hosts": 1, "slots_per_host": TRAJECTORIES})
    pool = local_pool(f"bench-agent-{time.monotonic_ns() % 10**6}", 1, TRAJECTORIES)
    await pool.start()
    try:
        # warm-up (connections, code paths), not measured
        await _rollouts(pool, 20.0, 1)
        for window in (20.0, 0.0):
            step_ms, wall_ms, share, release_ms = await _rollouts(pool, window, steps)
            mean_share = sum(share) / len(share)
            ideal = steps * MODEL_S * 1e3
            res.rows.append(Row(f"window {window:g} ms: one step's 3 tool calls", step_ms,
                                note=f"sandbox share of rollout time {mean_share * 100:.1f}% "
                                     f"(min {min(share) * 100:.1f}%, max {max(share) * 100:.1f}%)",
                                extra={"sandbox_share": mean_share}))
            res.rows.append(Row(f"window {window:g} ms: release (reset) at the end", release_ms,
                                note="16 trajectories end together: 16 concurrent resets on one host"))
            res.rows.append(Row(f"window {window:g} ms: rollout wall time", wall_ms, value=mean_share * 100,
                                unit="% sandbox",
                                note=f"model time alone would be {ideal:.0f} ms per trajectory"))
            res.notes.append(f"batch window {window:g} ms: sandbox share {mean_share * 100:.1f}% of rollout time")
    finally:
        await pool.stop()
        shutil.rmtree(BENCH_ROOT / "local" / pool.cfg.pool_id, ignore_errors=True)
    return res


if __name__ == "__main__":
    scenario_main(NAME, run)
