"""Run the benchmarks: ``python -m benchmarks.run [--scenario NAME ...] [--quick] [--json F] [--png F]``.

Prints one table per scenario (with the load average before/after, since these machines are
shared), writes every result as JSON (default results/bench.json) and a PNG of the latency
distributions (default results/bench.png; needs matplotlib, the ``bench`` extra).
Each scenario also runs alone: ``python -m benchmarks.scenario_<name> [--quick]``.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path

from benchmarks.common import (
    format_table,
    machine_info,
    machine_line,
    run_scenario,
    setup_logging,
    verdict,
    write_json,
    write_png,
)

SCENARIOS = ("call_latency", "lease", "throughput", "reset", "memory", "fleet_docker", "agent_step", "fork",
             "peers", "ray", "fleet_sim", "pool_shards", "first_file", "slot_cycle", "slot_occupancy", "image_roots",
             "image_import", "verify", "malloc_arenas")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.run", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--scenario", action="append", choices=SCENARIOS, metavar="NAME",
                   help=f"run only this scenario (repeatable); one of: {', '.join(SCENARIOS)}")
    p.add_argument("--quick", action="store_true", help="fewer iterations: a smoke run, numbers are rough")
    p.add_argument("--json", type=Path, default=Path("results/bench.json"), help="JSON output (%(default)s)")
    p.add_argument("--png", type=Path, default=Path("results/bench.png"), help="PNG chart (%(default)s)")
    p.add_argument("-v", "--verbose", action="store_true", help="show the product's INFO logs")
    args = p.parse_args(argv)
    setup_logging(args.verbose)
    names = args.scenario or list(SCENARIOS)
    machine = machine_info()
    print(machine_line(machine), flush=True)
    print(f"mode: {'quick' if args.quick else 'full'}; scenarios: {', '.join(names)}\n", flush=True)
    results = []
    for name in names:
        module = importlib.import_module(f"benchmarks.scenario_{name}")
        res = run_scenario(name, module.run, args.quick)
        results.append(res)
        print(format_table(res) + "\n", flush=True)
        write_json(results, args.json, machine)  # after each scenario: a crash later keeps the rest
    print("summary:")
    for res in results:
        state = "ERROR" if res.error else ("skipped" if res.skipped else verdict(res.passed))
        print(f"  {res.name:<14} {state:<8} load {' '.join(map(str, res.load_before or ()))}")
    print(f"json: {args.json}")
    if write_png(results, args.png, machine):
        print(f"png:  {args.png}")
    else:
        print("png:  not written (matplotlib missing: pip install 'atropos-sandbox[bench]')")
    return 1 if any(r.error for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
