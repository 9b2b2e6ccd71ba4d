"""Architecture as tests: the tree says where each file runs, and imports keep to it.

Four programs (docs/internals.md): the pool (in the user's trainer process: ``slots``, ``tools``,
``api``, ``envs``, ``backends``, ...), the sandbox host (``atropos/sandbox/host``), the in-slot
helpers (``atropos/sandbox/inslot``: copied into every sandbox, run by whatever ``python3`` the
sandbox has) and the mount helper (``host/workspace/mounthelper.py``). What crosses from the pool's
side to a host goes through ``atropos/sandbox/contract`` (wire models, client, lean HTTP, launch
command, and the few host-directory and cgroup helpers both sides use).
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from atropos.sandbox.inslot import LIB_FILES

ROOT = Path(__file__).resolve().parent.parent
PKG = ROOT / "atropos"
SANDBOX = PKG / "sandbox"
INSLOT = SANDBOX / "inslot"
STDLIB = set(sys.stdlib_module_names) | {"__future__"}


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path) -> Iterator[tuple[int, str, bool]]:
    """(line, absolute module imported, under ``if TYPE_CHECKING``) for every import in ``path``."""
    tree = ast.parse(path.read_text())
    typing_only: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            typing_only.update(id(n) for stmt in node.body for n in ast.walk(stmt))
    here = module_name(path).split(".")
    if path.name != "__init__.py":
        here = here[:-1]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name, id(node) in typing_only
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = here[: len(here) - node.level + 1]
                mod = ".".join([*base, node.module] if node.module else base)
            else:
                mod = node.module or ""
            names = [f"{mod}.{a.name}" for a in node.names] if mod in {"atropos", "atropos.sandbox"} else [mod]
            for name in names:
                yield node.lineno, name, id(node) in typing_only


def modules(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*.py") if "__pycache__" not in p.parts)


def test_the_pool_side_reaches_a_host_only_through_its_contract() -> None:
    """slots/, tools/, api/, envs/, backends/, cli/ (everything outside atropos/sandbox/) import from
    the sandbox package only ``atropos.sandbox.contract``: a host's internals can change, move into
    a container or onto another node without the pool noticing."""
    bad = [f"{p.relative_to(ROOT)}:{line} imports {mod}"
           for p in modules(PKG) if SANDBOX not in p.parents
           for line, mod, _ in imports(p)
           if (mod == "atropos.sandbox" or mod.startswith("atropos.sandbox."))
           and not mod.startswith("atropos.sandbox.contract")]
    assert not bad, "outside atropos/sandbox/, import only atropos.sandbox.contract:\n" + "\n".join(bad)


def test_the_contract_depends_on_no_host_internals() -> None:
    """The contract is shared by both sides: it may use the in-slot package's stdlib-only helpers
    (one walk of hostile trees) but nothing of the host server at run time (the tool definitions
    name the host's config as a type only: the host passes it in)."""
    bad = [f"{p.relative_to(ROOT)}:{line} imports {mod}"
           for p in modules(SANDBOX / "contract")
           for line, mod, typing_only in imports(p)
           if mod.startswith("atropos.sandbox.") and not typing_only
           and not mod.startswith(("atropos.sandbox.contract", "atropos.sandbox.inslot"))]
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("name", LIB_FILES)
def test_in_slot_code_is_standard_library_only(name: str) -> None:
    """Everything in the in-slot folder runs inside the sandbox with whatever python3 is there and
    nothing of atropos or of the host's site-packages: it imports only the standard library and its
    siblings (by bare name, from the lib dir), plus ``atropos.sandbox.inslot.*`` for type checking."""
    siblings = {Path(f).stem for f in LIB_FILES}
    bad = []
    for line, mod, typing_only in imports(INSLOT / name):
        top = mod.split(".")[0]
        if typing_only:
            ok = mod.startswith("atropos.sandbox.inslot.") or top in STDLIB
        else:
            ok = top in STDLIB or mod in siblings
        if not ok:
            bad.append(f"{name}:{line} imports {mod}")
    assert not bad, "\n".join(bad)


def test_the_in_slot_folder_is_what_the_host_copies() -> None:
    """``LIB_FILES`` (what the host writes into every sandbox's /run/atropos) is the folder itself:
    a module added there is shipped, and nothing else is; a sibling import names a shipped file."""
    assert set(LIB_FILES) == {p.name for p in INSLOT.glob("*.py") if p.name != "__init__.py"}
    siblings = {Path(f).stem for f in LIB_FILES}
    for name in LIB_FILES:
        for line, mod, typing_only in imports(INSLOT / name):
            if typing_only and mod.startswith("atropos.sandbox.inslot."):
                assert mod.rsplit(".", 1)[1] in siblings, f"{name}:{line}: {mod} is not in the in-slot folder"


def test_isolation_and_workspace_code_do_not_reach_up_into_the_server() -> None:
    """Kernel plumbing (host/isolation) and workspaces (host/workspace) are used by the host server,
    never the other way round: neither imports the server, the host object or its slots."""
    upward = ("atropos.sandbox.host.server", "atropos.sandbox.host.main", "atropos.sandbox.host.sandbox_host",
              "atropos.sandbox.host.slot")
    bad = [f"{p.relative_to(ROOT)}:{line} imports {mod}"
           for sub in ("isolation", "workspace")
           for p in modules(SANDBOX / "host" / sub)
           for line, mod, _ in imports(p) if mod.startswith(upward)]
    assert not bad, "\n".join(bad)


def test_every_sandbox_module_sits_in_one_of_the_four_rooms() -> None:
    """No flat module grows back in atropos/sandbox/: each file lives in the folder of the program
    that runs it (the package's __init__ and the ``-m`` entry point excepted)."""
    loose = sorted(p.name for p in SANDBOX.glob("*.py") if p.name not in {"__init__.py", "__main__.py"})
    assert not loose, f"modules outside contract/, inslot/, host/: {loose}"


def test_the_image_helpers_layout_is_spelled_in_one_place() -> None:
    """An image slot's ``/.atropos`` (helpers, host /usr, the pristine image: issue 37) is named by
    host/isolation/bwrap.py only; everything else takes the names from there (the mount helper gets
    them in its request)."""
    own = SANDBOX / "host" / "isolation" / "bwrap.py"
    bad = sorted(str(p.relative_to(ROOT)) for p in PKG.rglob("*.py")
                 if p != own and "/.atropos" in p.read_text())
    assert not bad, f"/.atropos spelled outside bwrap.py: {bad}"
