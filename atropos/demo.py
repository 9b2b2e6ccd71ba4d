"""A short tour: start a local pool, run tool calls in several slots at once, show isolation and reset.

``python -m atropos.demo [--trajectories N]``
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import time

from atropos.backends.local import LocalBackend, LocalBackendConfig
from atropos.slots.config import PoolConfig
from atropos.slots.pool import SlotPool
from atropos.tools.executor import AgentToolCall, ToolExecutor


async def run(trajectories: int, slots: int) -> None:
    t0 = time.perf_counter()
    pool = SlotPool(LocalBackend(LocalBackendConfig(slots_per_host=slots, pool_id="demo")),
                    PoolConfig(pool_id="demo", min_hosts=1, max_hosts=2))
    await pool.start()
    print(f"pool up: {pool.status().free} slots in {time.perf_counter() - t0:.2f}s (local backend, bubblewrap)")
    executor = ToolExecutor(pool)

    async def trajectory(i: int) -> tuple[str, float]:
        tid = f"demo-{i}"
        calls = [
            AgentToolCall(id="1", name="write_file",
                          arguments={"path": "hello.py", "content": f"print('hi from {i}')"}),
            AgentToolCall(id="2", name="bash", arguments={"command": "python3 hello.py && ls"}),
            AgentToolCall(id="3", name="bash", arguments={"command": "cat /etc/shadow; ls /root; id -un"}),
        ]
        t = time.perf_counter()
        outs = [await executor.execute(tid, c) for c in calls]
        took = time.perf_counter() - t
        await executor.release_trajectory(tid)
        return f"{tid}: " + " | ".join(o.content.replace("\n", " ") for o in outs[1:]), took

    results = await asyncio.gather(*(trajectory(i) for i in range(trajectories)))
    for line, took in results:
        print(f"  {line}   ({took * 1000:.0f} ms for 3 calls)")
    status = pool.status()
    print(f"{status.calls_total} tool calls in {trajectories} slots; {executor.requests_sent} host requests; "
          f"leases {status.leases_total}, free again {status.free}, quarantined {status.quarantined}")
    await executor.close()
    await pool.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--trajectories", type=int, default=6)
    parser.add_argument("--slots", type=int, default=8)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    asyncio.run(run(args.trajectories, args.slots))


if __name__ == "__main__":
    main()
