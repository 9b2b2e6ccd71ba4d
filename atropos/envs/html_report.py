"""Sections the env adds to the run's HTML report (the one atroposlib writes beside the jsonl):
one table each, placed before ``</body>``."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

__all__ = ["append_table"]


def append_table(path: Path, section_id: str, title: str, intro: str, headers: Sequence[str],
                 rows: Sequence[str]) -> None:
    """Add ``<section id=section_id>`` with ``title``, ``intro`` and a table of ``headers`` and
    ``rows`` (each an escaped ``<tr>...</tr>``; the caller escapes what it did not write itself)
    to the report at ``path``: before ``</body>``, or at the end of a report that has none."""
    head = "".join(f"<th>{h}</th>" for h in headers)
    section = (f"<section id='{section_id}'><h2>{title}</h2><p>{intro}</p>"
               f"<table border='1'><tr>{head}</tr>{''.join(rows)}</table></section>")
    text = path.read_text()
    text = text.replace("</body>", section + "</body>", 1) if "</body>" in text else text + section
    path.write_text(text)
