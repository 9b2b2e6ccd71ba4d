"""``image build``, ``nomad render`` and ``bench``: thin doors to scripts of a source checkout and to
what the nomad backend would register."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from atropos.cli.exit_codes import EXIT_OK, EXIT_USAGE
from atropos.cli.serve import nomad_config
from atropos.cli.settings import ServeSettings, load_settings

REPO = Path(__file__).resolve().parents[2]  # atropos/cli/extras.py -> the checkout


def cmd_image_build(args: argparse.Namespace) -> int:
    script = REPO / "scripts" / "build_image.sh"
    if not script.exists():
        print("error: image build needs a source checkout (scripts/build_image.sh)", file=sys.stderr)
        return EXIT_USAGE
    env = {**os.environ, **({"IMAGE_TAG": args.tag} if args.tag else {})}
    return subprocess.call(["bash", str(script)], env=env)


def render_nomad_job(s: ServeSettings) -> dict[str, Any]:
    """What ``serve --backend nomad`` registers for these settings, minus what exists only per
    running pool: the owner ``Meta`` (pid, boot id) and, with ``token_delivery=job``, the token
    (a placeholder here: a rendered file must never carry a live secret)."""
    from atropos.backends.nomad import render_job

    return {"Job": render_job(nomad_config(s), 0)}


def cmd_nomad_render(args: argparse.Namespace) -> int:
    print(json.dumps(render_nomad_job(load_settings(args)), indent=2))
    return EXIT_OK


def cmd_bench(args: argparse.Namespace) -> int:
    if not (REPO / "benchmarks" / "run.py").exists():
        print("error: bench needs a source checkout (benchmarks/)", file=sys.stderr)
        return EXIT_USAGE
    # run where the user is (results/ and any relative path they pass land there, not in the
    # checkout); the checkout goes on PYTHONPATH so `-m benchmarks.run` is found from anywhere
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    return subprocess.call([sys.executable, "-m", "benchmarks.run", *args.rest], cwd=os.getcwd(),
                           env={**os.environ, "PYTHONPATH": path})


def bench_args(extra: list[str], rest: list[str]) -> list[str]:
    """``bench`` forwards everything after it: unknown options argparse set aside come first (they
    preceded the first positional), then the remainder; one leading ``--`` is ours, not theirs."""
    forwarded = [*extra, *rest]
    if forwarded[:1] == ["--"]:
        forwarded = forwarded[1:]
    return forwarded
