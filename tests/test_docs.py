"""The README is a front door (issue 26): short, and every doc is one or more links away from it.

A doc nobody links to is a doc nobody reads, and a link that points at a moved file or a renamed
heading sends the reader nowhere; both happen silently when files move. These tests read the
Markdown as a reader's browser would: links in code blocks and inline code are not links."""

from __future__ import annotations

import re
from pathlib import Path
from urllib.parse import unquote

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
README_MAX_LINES = 150

FENCE = re.compile(r"^[ \t]*(```|~~~).*?^[ \t]*\1[^\n]*$", re.MULTILINE | re.DOTALL)
INLINE_CODE = re.compile(r"`+[^`\n]*`+")
LINK = re.compile(r"\[[^\]\n]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*#*\s*$", re.MULTILINE)
EXTERNAL = ("http://", "https://", "mailto:")


def documents() -> list[Path]:
    """The pages the front door must lead to and whose links must hold."""
    return [README, ROOT / "benchmarks" / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def prose(text: str) -> str:
    return INLINE_CODE.sub("", FENCE.sub("", text))


def links(path: Path) -> list[str]:
    return [m.group(1) for m in LINK.finditer(prose(path.read_text()))]


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation other than '-' and '_' dropped,
    spaces to '-'. Markup characters are punctuation too, so `code` and **bold** keep their text."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for heading in HEADING.findall(FENCE.sub("", path.read_text())):
        base = slug(heading)
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


def resolve(source: Path, target: str) -> tuple[Path, str]:
    file_part, _, anchor = target.partition("#")
    return ((source.parent / unquote(file_part)).resolve() if file_part else source), anchor


def test_the_readme_is_a_front_door_not_a_manual() -> None:
    lines = README.read_text().count("\n")
    assert lines < README_MAX_LINES, (
        f"README.md has {lines} lines; keep it under {README_MAX_LINES}: what it is, the two commands, "
        "the architecture, one pool and one env example, the docs index. Move the rest into docs/.")


def test_every_relative_link_points_at_a_file_and_heading_that_exist() -> None:
    broken = []
    for page in documents():
        for target in links(page):
            if target.startswith(EXTERNAL):
                continue
            where, anchor = resolve(page, target)
            if not where.exists():
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such file)")
            elif anchor and where.suffix == ".md" and anchor not in anchors(where):
                broken.append(f"{page.relative_to(ROOT)}: {target} (no heading '#{anchor}' in "
                              f"{where.relative_to(ROOT)})")
    assert not broken, "broken links:\n" + "\n".join(broken)


def test_every_doc_is_reachable_from_the_readme() -> None:
    reached, todo = {README}, [README]
    while todo:
        page = todo.pop()
        for target in links(page):
            if target.startswith(EXTERNAL):
                continue
            where, _ = resolve(page, target)
            if where.suffix == ".md" and where.is_file() and where not in reached:
                reached.add(where)
                todo.append(where)
    unreached = [str(p.relative_to(ROOT)) for p in documents() if p not in reached]
    assert not unreached, "linked from nowhere the README leads to (add them to its docs index):\n" + \
        "\n".join(unreached)


def test_the_link_reader_sees_what_a_browser_sees() -> None:
    """The checks above are only as good as the link parser: a link in a code block is not a link,
    an anchor is GitHub's slug of its heading."""
    text = "[a](x.md) `[b](y.md)`\n```\n[c](z.md)\n```\n[d](w.md#two-words \"title\")\n"
    assert [m.group(1) for m in LINK.finditer(prose(text))] == ["x.md", "w.md#two-words"]
    assert slug("Ray and the simulated fleet (`ray`, `fleet_sim`)") == "ray-and-the-simulated-fleet-ray-fleet_sim"
    assert slug("Where a `true` call's time goes (direct lease, local host)") == \
        "where-a-true-calls-time-goes-direct-lease-local-host"
