"""docs/task-images.md's table of what a program sees in a slot on a task image against
``docker run`` of the same image, checked row by row against the real thing, so the table cannot go
stale: each row's command runs in ``docker run --rm --entrypoint bash IMAGE -c COMMAND`` (Docker's
defaults, as a researcher runs it) and with ``bash`` in a slot whose root is that image.

A row's cells (``in a slot``, ``in docker run``) say: ``same`` (the two outputs are equal), a
backquoted value (that output exactly, trailing newline aside) or prose (docker's output is
something else than the slot's: the row is a difference, its reason in the row's last cell). A
row whose difference has gone, or a new difference in a ``same`` row, fails here."""

from __future__ import annotations

import re
from pathlib import Path

from tests.conftest import RunningHost
from tests.task_images import _docker
from tests.test_image_roots import image_host, image_slot, roots_image  # noqa: F401 (fixtures)
from tests.test_image_roots import pytestmark as pytestmark  # the same engine and base image

DOC = Path(__file__).resolve().parents[1] / "docs" / "task-images.md"
TABLE_TITLE = "### What a program sees, against `docker run`"


def table_rows() -> list[dict[str, str]]:
    """The table under ``TABLE_TITLE``: one dict per row, keyed by the header's cells."""
    text = DOC.read_text()
    assert TABLE_TITLE in text, f"{DOC.name} lost its table ({TABLE_TITLE!r})"
    lines = text.split(TABLE_TITLE, 1)[1].splitlines()
    table = [ln for ln in lines[lines.index(next(ln for ln in lines if ln.startswith("|"))):]]
    table = table[:next((i for i, ln in enumerate(table) if not ln.startswith("|")), len(table))]

    def cells(line: str) -> list[str]:
        return [c.strip().replace("\\|", "|") for c in re.split(r"(?<!\\)\|", line.strip())[1:-1]]

    header = cells(table[0])
    return [dict(zip(header, cells(line), strict=True)) for line in table[2:]]


def _literal(cell: str) -> str | None:
    m = re.fullmatch(r"`([^`]*)`", cell)
    return m.group(1) if m else None


def test_the_table_is_well_formed() -> None:
    rows = table_rows()
    assert len(rows) >= 10
    for row in rows:
        assert _literal(row["command"]) is not None, row
        assert row["in a slot"] == "same" or _literal(row["in a slot"]) is not None, row
        if row["in a slot"] == "same":
            assert row["in docker run"] == "same", row
        else:
            assert row["why"], f"a difference says why: {row}"


def docker_default_run(image: str, command: str) -> tuple[int, str]:
    """Docker's defaults (its network, its ulimits): no flag a researcher would not type."""
    code, out, err = _docker("run", "--rm", "--entrypoint", "bash", image, "-c", command, check=False, timeout=180)
    if code == 125:
        raise RuntimeError(f"docker run {image} failed: {err.strip()}")
    return code, out


async def test_each_row_holds_against_docker_run(image_host: RunningHost, roots_image: str) -> None:  # noqa: F811
    rows = table_rows()
    failures = []
    async with image_slot(image_host, roots_image) as slot:
        for row in rows:
            command = _literal(row["command"])
            assert command is not None
            got = (await slot.sh(command))["stdout"].rstrip("\n")
            _code, docker = docker_default_run(roots_image, command)
            docker = docker.rstrip("\n")
            slot_cell, docker_cell = row["in a slot"], row["in docker run"]
            if slot_cell == "same":
                ok = got == docker
            else:
                want_docker = _literal(docker_cell)
                ok = got == _literal(slot_cell) and (docker == want_docker if want_docker is not None
                                                     else docker != got)
            if not ok:
                failures.append(f"{row['what']} ({command}): slot {got!r}, docker run {docker!r}; "
                                f"the table says slot {slot_cell}, docker run {docker_cell}")
    assert not failures, "docs/task-images.md's table no longer holds:\n" + "\n".join(failures)
