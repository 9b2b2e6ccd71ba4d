"""Every object's state has one writer (issue 26): in the pool, the env and the host's slot code no
function assigns an attribute of an object other than ``self``; it calls a method of the owner
instead (``host.give_back(...)``, not ``host.free = ...``; ``slot.revoke()``, not
``slot.lease_token = None``). A class spread over several files, or one class setting another's
fields, is what made "who changed this?" unanswerable before: this test keeps it from returning."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path
from typing import Any

from pydantic import BaseModel

import atropos

PACKAGE = Path(atropos.__file__).parent

# By module name, not path: the sandbox modules may move into sub-packages.
MODULES = ["atropos.sandbox.host.slot", "atropos.sandbox.host.workspace.slot_workspace",
           "atropos.sandbox.host.sandbox_host"]
PACKAGES = ["slots", "envs"]

# Writes that stay, with why (file name, the assigned expression).
ALLOWED = {
    ("sandbox_host.py", "exc.args"): "re-raising the same exception with its message marked (see SandboxHost.start)",
    ("env_cli.py", "sys.argv"): "the command line BaseEnv.cli parses is the process's, not an object's",
    ("agent_env.py", "config.wandb_name"): "the env's own config (a pydantic settings record), defaulted",
    ("agent_env.py", "self.server.tool_parser"): "atroposlib's ServerManager has no setter; ManagedServer reads it",
    ("agent_env.py", "self.config.max_num_workers"): "the env's own config, defaulted from the trainer's batch (serve)",
    ("env_cli.py", "base.rprint"): "atroposlib's config dump has no switch: quiet unless --show-config (issue 28)",
}


def _modules() -> list[str]:
    names = list(MODULES)
    for pkg in PACKAGES:
        names += [f"atropos.{pkg}.{p.stem}" for p in sorted((PACKAGE / pkg).glob("*.py")) if p.stem != "__init__"]
    return names


def _built_here(func: ast.AST, namespace: dict[str, Any]) -> set[str]:
    """Names a function binds to a wire record it constructs (``result = CallResult(...)``, a pydantic
    model): filling in a record it just made is not writing another object's state. An object with
    behaviour (``slot = Slot(...)``) gets what it needs through its constructor instead."""
    names = set()
    for node in ast.walk(func):
        if isinstance(node, (ast.Assign, ast.AnnAssign)) and isinstance(node.value, ast.Call):
            callee = node.value.func
            callee_name = callee.attr if isinstance(callee, ast.Attribute) else getattr(callee, "id", "")
            record = namespace.get(callee_name)
            if isinstance(record, type) and issubclass(record, BaseModel):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                names |= {t.id for t in targets if isinstance(t, ast.Name)}
    return names


def foreign_writes(source: str, namespace: dict[str, Any]) -> list[str]:
    """Every ``x.attr = ...`` (or ``+=``) whose ``x`` is not ``self``/``cls`` nor a record the function
    built (``namespace``: the module's globals, to tell a record's class from another)."""
    found = []
    tree = ast.parse(source)
    funcs = [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
    for func in funcs:
        built = _built_here(func, namespace) | {"self", "cls"}
        for node in ast.walk(func):
            if isinstance(node, ast.Assign):
                targets = node.targets
            elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
                targets = [node.target]
            else:
                continue
            for target in targets:
                for sub in ast.walk(target):
                    if (isinstance(sub, ast.Attribute) and isinstance(sub.ctx, ast.Store)
                            and not (isinstance(sub.value, ast.Name) and sub.value.id in built)):
                        found.append(ast.unparse(sub))
    return sorted(set(found))


def test_no_module_writes_another_objects_state() -> None:
    offenders = []
    for name in _modules():
        module = importlib.import_module(name)
        path = Path(str(module.__file__))
        offenders += [f"{name}: {expr}" for expr in foreign_writes(path.read_text(), vars(module))
                      if (path.name, expr) not in ALLOWED]
    assert offenders == []


def test_the_rule_sees_a_foreign_write() -> None:
    """The check itself: a write through another object is found, a fresh record filled in is not."""
    source = ("class A:\n"
              "    def f(self, host):\n"
              "        host.free = []\n"
              "        host.failures += 1\n"
              "        self.ws.capped = True\n"
              "        result = Result()\n"
              "        result.ok = True\n"
              "        slot = Slot()\n"
              "        slot.killer = None\n"
              "        self.mine = 1\n")

    class Result(BaseModel):
        ok: bool = False

    class Slot:
        killer = None

    assert foreign_writes(source, {"Result": Result, "Slot": Slot}) == [
        "host.failures", "host.free", "self.ws.capped", "slot.killer"]
