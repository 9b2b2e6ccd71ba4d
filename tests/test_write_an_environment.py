"""docs/write-an-environment.md, run as a newcomer would (issue 20): every code block in order, in
an empty directory. ``file=NAME`` blocks are written to NAME, ``bash`` blocks run (``skip`` ones
need a real model server and are left out: the fake server of the next block stands in for it).
The doc's ports (8090 model server, 8000 run-api) become free ones; processes the blocks leave
running are stopped by the pid files they wrote."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import free_port

pytest.importorskip("atroposlib")

REPO = Path(__file__).resolve().parent.parent
DOC = REPO / "docs" / "write-an-environment.md"
FENCE = re.compile(r"^```(\w+)([^\n]*)\n(.*?)^```\s*$", re.S | re.M)


def blocks() -> list[tuple[str, str, str]]:
    """(language, info after the language, body) of every fenced block, in order."""
    return [(m.group(1), m.group(2).strip(), m.group(3)) for m in FENCE.finditer(DOC.read_text())]


def test_the_doc_has_the_blocks_a_newcomer_needs() -> None:
    found = blocks()
    files = [info for lang, info, _ in found if info.startswith("file=")]
    assert files == ["file=lines_env.py", "file=test_lines_env.py", "file=trainer.py"]
    commands = "\n".join(body for lang, _, body in found if lang == "bash")
    for needed in (" process ", " serve ", " evaluate ", "run-api", "--env.data_path_to_save_groups",
                   "--env.data_dir_to_save_evals", "atropos.testing.fake_server", "pytest"):
        assert needed in commands, needed
    assert all(lang in ("python", "bash") for lang, _, _ in found)


@pytest.mark.timeout(1800)  # a whole newcomer's session: three modes end to end, on a shared machine
def test_every_block_of_the_doc_runs(tmp_path: Path) -> None:
    from atropos.agent.model import default_gguf_path

    if not default_gguf_path().exists():
        pytest.skip("the model file (its tokenizer) is missing: "
                    "run `python3 scripts/model_server.py ensure --model-only`")
    ports = {"8090": str(free_port()), "8000": str(free_port())}

    def ported(text: str) -> str:
        return re.sub(r"\b(8090|8000)\b", lambda m: ports[m.group(1)], text)

    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}", "PYTHONPATH": str(REPO),
           "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "WANDB_MODE": "disabled"}
    env.pop("ATROPOS_MODEL_URL", None)
    outputs: list[str] = []
    try:
        for lang, info, body in blocks():
            if info.startswith("file="):
                (tmp_path / info.removeprefix("file=")).write_text(ported(body))
            elif lang == "bash" and info != "skip":
                t0 = time.monotonic()
                proc = subprocess.run(["bash", "-euo", "pipefail", "-c", ported(body)], cwd=tmp_path, env=env,
                                      capture_output=True, text=True, timeout=900)
                assert proc.returncode == 0, f"block failed:\n{body}\n--- stdout\n{proc.stdout[-3000:]}\n" \
                                             f"--- stderr\n{proc.stderr[-5000:]}"
                outputs.append(proc.stdout)
                print(f"{time.monotonic() - t0:6.1f}s  {body.splitlines()[0]}")
    finally:
        for pid_file in tmp_path.glob("*.pid"):
            try:
                os.kill(int(pid_file.read_text()), signal.SIGTERM)
            except (ProcessLookupError, ValueError):
                pass
    out = "\n".join(outputs)
    # section 2: the verifier passes the reference solution and fails a do-nothing policy
    assert "2 passed" in out
    # section 4: process mode scored every rollout with the reference solution (fake server)
    assert "[atropos-sandbox] rollouts: 4" in out and "mean score: 1.000" in out
    assert "all as expected" in out and "lines  reference 1.000  stub 0.000" in out  # the verifier check
    groups = [json.loads(line) for line in (tmp_path / "runs" / "lines.jsonl").read_text().splitlines()]
    assert [g["scores"] for g in groups] == [[1.0, 1.0], [1.0, 1.0]]
    # section 5: the trainer took two batches of two groups each
    trainer = (tmp_path / "trainer.log").read_text()
    assert "step 0: 2 groups, scores [1.0, 1.0, 1.0, 1.0]" in trainer and "step 1: 2 groups" in trainer
    # the env stopped by itself at total_steps, stopped its pool and printed its summary
    serve_log = (tmp_path / "serve.log").read_text()
    assert "[atropos-sandbox] pool: backend local" in serve_log and "mean score: 1.000" in serve_log, serve_log[-3000:]
    # section 6: evaluate printed and saved its metrics
    assert "eval/n=2" in out and "eval/mean_score=1.000" in out
    metrics = json.loads((tmp_path / "runs" / "eval" / "metrics.json").read_text())["results"]["all"]
    assert metrics["eval/mean_score"] == 1.0
