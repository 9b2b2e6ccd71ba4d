"""A new user's first model reply: the README's main command from a fresh clone with an empty cache.

    python -m benchmarks.first_reply [--engine auto|prebuilt|compiled] [--keep]

Clones this checkout's HEAD into a scratch directory, points ``ATROPOS_SANDBOX_CACHE`` at an empty
directory (no model, no engine, no tokenizer), pip and uv at empty package caches, and runs ``bash
scripts/demo.sh`` there exactly as the README says, until the model server logs its first answered
``/v1/chat/completions`` request; then stops the demo. Prints the seconds to each milestone of the
demo's output (system packages checked, venv ready, model server ready, first reply), the machine's load
average before and after, and the target (<= 180 s on a fresh 2-core machine; docs/targets.md). The
system packages are whatever the machine has: on a machine that has run the project before, apt has
nothing to do, which a truly fresh one pays once (a minute or so). A benchmark, not a test: nothing
fails on a MISS. Then, with the engine the clone installed, ``scripts/model_server.py bench`` reports
its tokens/s (and the compiled engine's too when this machine's own cache holds it, under the same
load).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TARGET_S = 180.0
REPLY_RE = re.compile(rb'"POST /v1/chat/completions HTTP/1\.1" 200')
MILESTONES = [
    ("venv ready", re.compile(r"^\[setup\] ready:")),
    ("model server ready", re.compile(r"^\[model_server\] ready at ")),
]


def first_reply(engine: str, keep: bool) -> dict:
    scratch = Path(tempfile.mkdtemp(prefix="atropos-first-reply-"))
    clone, cache = scratch / "clone", scratch / "cache"
    subprocess.run(["git", "clone", "-q", "--no-hardlinks", str(REPO), str(clone)], check=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VIRTUAL_ENV", "PYTHONPATH"))}
    # A fresh machine has no package caches either: pip and uv download everything, as a new user's would.
    env.update(ATROPOS_SANDBOX_CACHE=str(cache), ATROPOS_MODEL_ENGINE=engine, ATROPOS_MODEL_PORT=str(_free_port()),
               PIP_CACHE_DIR=str(scratch / "pip-cache"), UV_CACHE_DIR=str(scratch / "uv-cache"))
    load_before = os.getloadavg()[0]
    t0 = time.monotonic()
    proc = subprocess.Popen(["bash", "scripts/demo.sh", "--env.total_steps", "1"], cwd=clone, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    seen: dict[str, float] = {}
    log = bytearray()
    reply_at = None
    os.set_blocking(proc.stdout.fileno(), False)  # type: ignore[union-attr]
    try:
        while reply_at is None and time.monotonic() - t0 < 1800:
            chunk = proc.stdout.read() if proc.stdout else None
            if chunk:
                log += chunk
                for line in chunk.decode("utf-8", "replace").splitlines():
                    for name, rx in MILESTONES:
                        if name not in seen and rx.search(line):
                            seen[name] = time.monotonic() - t0
            for server_log in (cache / "run").glob("server-*.log"):
                if REPLY_RE.search(server_log.read_bytes()):
                    reply_at = time.monotonic() - t0
            if proc.poll() is not None and reply_at is None:
                break
            time.sleep(0.2)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=60)
        subprocess.run([sys.executable, str(clone / "scripts" / "model_server.py"), "stop", "--port",
                        env["ATROPOS_MODEL_PORT"]], env=env, capture_output=True)
    out = {"engine": engine, "milestones_s": {k: round(v, 1) for k, v in seen.items()},
           "first_reply_s": None if reply_at is None else round(reply_at, 1), "target_s": TARGET_S,
           "load_avg_before": round(load_before, 2), "load_avg_after": round(os.getloadavg()[0], 2)}
    if reply_at is None:
        out["demo_output_tail"] = log.decode("utf-8", "replace")[-3000:]
    else:
        bench = subprocess.run([sys.executable, str(clone / "scripts" / "model_server.py"), "bench", "--runs", "3"],
                               env=env, capture_output=True, text=True)
        try:
            out["tokens_per_s"] = json.loads((cache / "engines.json").read_text())
        except (OSError, ValueError):
            out["tokens_per_s"] = bench.stderr[-2000:]
    if keep:
        out["scratch"] = str(scratch)
    else:
        shutil.rmtree(scratch, ignore_errors=True)
    return out


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.first_reply", description=__doc__.split("\n\n")[0])
    ap.add_argument("--engine", choices=("auto", "prebuilt", "compiled"), default="auto")
    ap.add_argument("--keep", action="store_true", help="keep the clone and its cache")
    args = ap.parse_args(argv)
    res = first_reply(args.engine, args.keep)
    print(json.dumps(res, indent=1))
    reply = res["first_reply_s"]
    verdict = "PASS" if reply is not None and reply <= TARGET_S else "MISS"
    print(f"first model reply: {reply} s (target <= {TARGET_S:.0f} s on a fresh 2-core machine): {verdict}; "
          f"load average {res['load_avg_before']} -> {res['load_avg_after']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
