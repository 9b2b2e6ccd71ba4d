"""The repository stands on its own: nothing in it points at files outside it.

The research notes this project started from are not part of the repository, so a docstring or
comment citing them sends a reader nowhere; the facts live in ``docs/`` instead."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUTSIDE = re.compile(r"\bshared/(reference|design\.md|seeds)")


def test_no_source_cites_files_outside_the_repository() -> None:
    offenders = []
    for top in ("atropos", "tests", "benchmarks", "scripts", "docs", "nomad", "sandbox_image"):
        for path in (ROOT / top).rglob("*"):
            if path.suffix not in {".py", ".md", ".sh", ".hcl", ".txt"} or not path.is_file():
                continue
            for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
                if OUTSIDE.search(line):
                    offenders.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()}")
    for name in ("README.md",):
        for n, line in enumerate((ROOT / name).read_text().splitlines(), 1):
            if OUTSIDE.search(line):
                offenders.append(f"{name}:{n}: {line.strip()}")
    assert not offenders, "cite docs/ instead:\n" + "\n".join(offenders)


def test_docs_cited_by_the_code_exist() -> None:
    cited = set()
    for path in (ROOT / "atropos").rglob("*.py"):
        cited.update(re.findall(r"docs/[\w-]+\.md", path.read_text()))
    missing = sorted(c for c in cited if not (ROOT / c).is_file())
    assert not missing, f"cited but missing: {missing}"
