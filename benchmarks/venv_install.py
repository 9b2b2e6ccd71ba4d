"""What the README's main command waits for most on a fresh machine: the project's venv install
(``scripts/setup.sh``: ``.[env]``), with pip alone against uv, each from an empty cache.

    python -m benchmarks.venv_install [--spec '.[env]'] [--only pip|uv]

Clones this checkout's HEAD into a scratch directory, then for each installer makes a fresh venv
and runs ``scripts/setup.sh``'s install there with ``ATROPOS_INSTALLER`` set, its caches (pip's and
uv's) pointed at empty directories, so every package is downloaded as on a fresh machine. Prints the
seconds of each and their ratio, with the load average: a benchmark, run once, never a test."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def install(installer: str, scratch: Path) -> dict[str, float | str]:
    clone = scratch / f"clone-{installer}"
    subprocess.run(["git", "clone", "-q", "--no-hardlinks", str(REPO), str(clone)], check=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VIRTUAL_ENV", "PYTHONPATH"))}
    env.update(ATROPOS_INSTALLER=installer, PIP_CACHE_DIR=str(scratch / f"pip-cache-{installer}"),
               UV_CACHE_DIR=str(scratch / f"uv-cache-{installer}"))
    load = os.getloadavg()[0]
    t0 = time.monotonic()
    proc = subprocess.run(["bash", "scripts/setup.sh"], cwd=clone, env=env, capture_output=True, text=True)
    seconds = time.monotonic() - t0
    if proc.returncode != 0:
        raise SystemExit(f"{installer}: setup.sh failed:\n{proc.stderr[-3000:]}")
    return {"installer": installer, "seconds": round(seconds, 1), "load_before": round(load, 1),
            "load_after": round(os.getloadavg()[0], 1), "used_uv": str((clone / ".venv/bin/uv").exists())}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", choices=("pip", "uv"))
    args = ap.parse_args()
    scratch = Path(tempfile.mkdtemp(prefix="atropos-venv-install-"))
    try:
        runs = [install(i, scratch) for i in ("pip", "uv") if args.only in (None, i)]
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    out: dict[str, object] = {"runs": runs}
    if len(runs) == 2:
        out["uv_over_pip"] = round(float(runs[1]["seconds"]) / float(runs[0]["seconds"]), 3)
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
