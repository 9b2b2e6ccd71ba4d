"""Templates of one host: the immutable trees slots are forked from, and their store."""

from __future__ import annotations

import os
import secrets
from dataclasses import dataclass, field
from pathlib import Path

from atropos.errors import TemplateInUse, TemplateSourceError, UnknownTemplate
from atropos.sandbox.contract.protocol import TemplateInfo
from atropos.sandbox.host.workspace.trees import TreeSummary


# -- templates ---------------------------------------------------------------------------------
@dataclass
class Template:
    id: str
    name: str
    source: str
    tree: Path
    summary: TreeSummary
    created_at: float
    prepare_ms: float
    users: set[int] = field(default_factory=set)  # slot indices whose workspace is built on it
    readers: int = 0  # archive downloads in progress

    def info(self) -> TemplateInfo:
        s = self.summary
        return TemplateInfo(id=self.id, name=self.name, source=self.source, created_at=self.created_at,
                            files=s.files, dirs=s.dirs, others=s.others, bytes=s.bytes, tree_hash=s.tree_hash,
                            prepare_ms=round(self.prepare_ms, 3), users=sorted(self.users))


class TemplateStore:
    """Templates of one host. The directory is private to the host user (0700): on a root host
    no slot uid can even reach it; overlays read it with the mounter's credentials."""

    def __init__(self, root: Path, owner: int | None, trash: Path) -> None:
        self.dir = root / "templates"
        self.owner = owner
        self.trash = trash
        self.templates: dict[str, Template] = {}

    def prepare(self) -> None:
        self.dir.mkdir(mode=0o700, exist_ok=True)
        os.chmod(self.dir, 0o700)
        for entry in self.dir.iterdir():  # templates never survive a host restart
            self.trash.mkdir(exist_ok=True)
            os.rename(entry, self.trash / f"template-{entry.name}-{secrets.token_hex(4)}")

    def new_dir(self) -> tuple[str, Path]:
        tid = f"tpl-{secrets.token_hex(6)}"
        d = self.dir / tid
        d.mkdir(mode=0o700)
        return tid, d

    def abandon(self, d: Path) -> None:
        if d.exists():
            self.trash.mkdir(exist_ok=True)
            os.rename(d, self.trash / f"template-{d.name}-{secrets.token_hex(4)}")

    def get(self, tid: str) -> Template:
        try:
            return self.templates[tid]
        except KeyError:
            raise UnknownTemplate(f"unknown template {tid!r}") from None

    def delete(self, tid: str) -> None:
        t = self.get(tid)
        if t.users or t.readers:
            who = f"slot(s) {sorted(t.users)}" if t.users else f"{t.readers} archive download(s)"
            raise TemplateInUse(f"template {tid} is in use by {who}; reset or release them first")
        del self.templates[tid]
        self.abandon(t.tree.parent)


def source_dir_allowed(path: str, allowed: list[Path]) -> Path:
    """Resolve a host path and require it under one of the configured source directories."""
    if not allowed:
        raise TemplateSourceError("this host accepts no host directories as template sources "
                                  "(start it with --template-source-dir)")
    real = Path(os.path.realpath(path))
    for root in allowed:
        root_real = Path(os.path.realpath(root))
        if real == root_real or root_real in real.parents:
            return real
    raise TemplateSourceError(f"{path} is not under an allowed template source directory")
