"""Why a rollout scored what it did: what ``verify_and_score_trajectory`` returns beside the score
(``verifier_error``, ``hidden_passed``, ...) carried wherever the score goes: the group's per-rollout
``overrides`` (atroposlib keeps them in the jsonl and hands them to the trainer's batch), the HTML
report, eval ``samples.jsonl``, and the share of rollouts per ``verifier_error`` in the metrics."""

from __future__ import annotations

import html
import json
from collections import Counter
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from atropos.envs.html_report import append_table

__all__ = ["ERROR_KEY", "INFO_KEY", "append_to_html", "error_shares", "json_safe", "rollout_info"]

# the key of a rollout's override dict that holds its info (atroposlib's `overrides` is one dict per
# rollout and is passed through to the trainer untouched; a trainer reads the keys it knows only)
INFO_KEY = "score_info"
# the key of the verifier's dict that names why it failed (docs/write-an-environment.md); its values
# are counted per rollout into `<prefix>verifier_error/<value>`
ERROR_KEY = "verifier_error"
MAX_INFO_CHARS = 4000  # a verifier's dict is the env's, not the agent's, but one huge value must not blow up the jsonl


def json_safe(meta: Mapping[str, Any] | None) -> dict[str, Any]:
    """``meta`` as plain JSON values (what the jsonl writer and the API can carry); a value that is
    not JSON becomes its ``str``, and a dict longer than ``MAX_INFO_CHARS`` keeps its keys' text cut."""
    if not meta:
        return {}
    out = json.loads(json.dumps(dict(meta), default=str))
    if len(json.dumps(out)) > MAX_INFO_CHARS:
        out = {str(k): (v if isinstance(v, (int, float, bool)) or v is None else str(v)[:200]) for k, v in out.items()}
    return out if isinstance(out, dict) else {}


def rollout_info(finish: str, verifier: Mapping[str, Any]) -> dict[str, Any]:
    """A rollout's info as the jsonl, the trainer and eval samples carry it."""
    return {"finish": finish, "verifier": dict(verifier)}


def error_shares(infos: Iterable[Mapping[str, Any]], prefix: str) -> dict[str, float]:
    """The share of rollouts per ``verifier_error`` (``infos``: one ``rollout_info`` per rollout)."""
    infos = list(infos)
    if not infos:
        return {}
    counts = Counter(str(i["verifier"][ERROR_KEY]) for i in infos
                     if isinstance(i.get("verifier"), Mapping) and i["verifier"].get(ERROR_KEY) is not None)
    return {f"{prefix}verifier_error/{code}": n / len(infos) for code, n in sorted(counts.items())}


def append_to_html(path: Path, jsonl: Path) -> None:
    """Add a table of every saved rollout's score and info (read back from the run's jsonl) to the
    HTML report atroposlib made of it (that report shows messages and scores only)."""
    if not path.exists() or not jsonl.exists():
        return
    rows = []
    for g, line in enumerate(jsonl.read_text().splitlines()):
        try:
            group = json.loads(line)
        except ValueError:
            continue
        overrides = group.get("overrides") or []
        for i, score in enumerate(group.get("scores") or []):
            info = overrides[i].get(INFO_KEY, {}) if i < len(overrides) and isinstance(overrides[i], dict) else {}
            rows.append(f"<tr><td>{g}</td><td>{i}</td><td>{html.escape(str(score))}</td>"
                        f"<td>{html.escape(str(info.get('finish', '')))}</td>"
                        f"<td><pre>{html.escape(json.dumps(info.get('verifier', {}), indent=1)[:MAX_INFO_CHARS])}"
                        "</pre></td></tr>")
    if not rows:
        return
    append_table(path, "score-info", "Why each rollout scored what it did",
                 "What the verifier returned beside each score (verify_and_score_trajectory), and how the "
                 "agent loop ended.", ["group", "rollout", "score", "finish", "verifier"], rows)
