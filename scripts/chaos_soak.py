#!/usr/bin/env python3
"""Chaos soak: the loops of tests/test_chaos.py for many iterations, with the figures at the end.

Iterations are split between the scenarios by ``--mix``: ``local`` (kill -9 a host process of a
live pool with 64 calls in flight), ``docker`` (docker kill a container; skipped when no engine or
image is present unless ``--require-docker``) and ``pool`` (SIGKILL a pool subprocess with 64 calls
in flight, then check the next pool with the same pool_id reaps everything).

    .venv/bin/python scripts/chaos_soak.py                      # 1000 iterations
    .venv/bin/python scripts/chaos_soak.py -n 200 --mix local=1

Prints per-scenario and total figures: iterations, calls, lost results (must be 0), orphans, double
leases, peak RSS and wall time. Exit status 0 when no result was lost, nothing leaked and no slot
was leased twice.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(1, str(REPO / "tests"))  # test modules import their conftest by name, as under pytest

from tests.pool_backends import docker_problem  # noqa: E402
from tests.test_chaos import Figures, run_chaos  # noqa: E402


def parse_mix(text: str) -> dict[str, float]:
    mix: dict[str, float] = {}
    for part in text.split(","):
        name, _, weight = part.partition("=")
        if name.strip() not in ("local", "docker", "pool"):
            raise SystemExit(f"unknown scenario {name!r} in --mix (local, docker, pool)")
        mix[name.strip()] = float(weight or 1)
    return mix


def split(total: int, mix: dict[str, float]) -> dict[str, int]:
    weight = sum(mix.values())
    counts = {name: int(total * w / weight) for name, w in mix.items()}
    first = next(iter(counts))
    counts[first] += total - sum(counts.values())
    return counts


async def run(args: argparse.Namespace) -> int:
    mix = parse_mix(args.mix)
    if "docker" in mix:
        problem = docker_problem()
        if problem is not None:
            if args.require_docker:
                print(f"docker is required but unusable: {problem}", file=sys.stderr)
                return 2
            print(f"skipping the docker scenario: {problem}", flush=True)
            mix["local"] = mix.get("local", 0) + mix.pop("docker")
    counts = split(args.iterations, mix)
    print(json.dumps({"event": "plan", **counts}), flush=True)
    t0 = time.monotonic()

    shown: dict[str, int] = {}

    def progress(fig: Figures) -> None:
        for p in fig.problems[shown.get(fig.scenario, 0):]:  # as they happen, not only at the end
            print(f"  problem [{fig.scenario}]: {p}", flush=True)
        shown[fig.scenario] = len(fig.problems)
        if fig.iterations % args.report_every == 0:
            print(json.dumps({"t_s": round(time.monotonic() - t0), "scenario": fig.scenario,
                              "iterations": fig.iterations, "calls": fig.calls, "lost": fig.lost,
                              "collateral": fig.collateral, "orphans": fig.orphans,
                              "double_leases": fig.double_leases}), flush=True)

    figures = await run_chaos(counts, seed=args.seed, hosts=args.hosts, sequential=args.sequential,
                              progress=progress)
    total = Figures("total")
    for fig in figures:
        print(json.dumps({"event": "scenario", **fig.summary()}), flush=True)
        total.merge(fig)
    total.wall_s = time.monotonic() - t0
    summary = total.summary()
    print(json.dumps({"event": "final", "iterations": summary["iterations"], "calls": summary["calls"],
                      "correct": summary["correct"], "infra_errors": summary["infra_errors"],
                      "died_with_pool": summary["died_with_pool"], "infra_unkilled": total.infra_unkilled,
                      "lost_results": total.lost + total.collateral,
                      "orphans": total.orphans, "double_leases": total.double_leases,
                      "peak_host_rss_mb": summary["peak_host_rss_mb"], "peak_self_rss_mb": summary["peak_self_rss_mb"],
                      "wall_s": summary["wall_s"]}), flush=True)
    return 0 if total.clean else 1


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("-n", "--iterations", type=int, default=1000)
    p.add_argument("--mix", default="local=0.4,docker=0.2,pool=0.4", help="scenario weights (default %(default)s)")
    p.add_argument("--hosts", type=int, default=6, help="hosts of 16 slots in the host-kill pools")
    p.add_argument("--require-docker", action="store_true", help="fail instead of skipping docker")
    p.add_argument("--report-every", type=int, default=25, help="print progress every N iterations")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--sequential", action="store_true", help="one scenario after the other (default: at once)")
    args = p.parse_args()
    logging.basicConfig(level=logging.CRITICAL)  # the pool logs every kill at ERROR: expected here
    sys.exit(asyncio.run(run(args)))


if __name__ == "__main__":
    main()
