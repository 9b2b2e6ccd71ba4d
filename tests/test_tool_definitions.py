"""Each tool is declared once (atropos/sandbox/contract/tools.py): everything else that names tools is derived
from the definitions or checked against them here, so adding a tool means its definition, its
in-slot op and a test, and forgetting a place fails (issue 26). docs/tools.md is generated from the
same definitions (issue 28)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from atropos.sandbox.contract.tools import TOOLS, Formatter
from atropos.tools.registry import ToolRegistry

# Tools a model is never offered (programs call them over REST): a deliberate choice, named here.
PROGRAM_ONLY = {"archive"}
# What the verification phase refuses: everything that runs code or writes. A tool moving out of
# this set lets the agent act after the seal, so the set is spelled out, not only derived.
WRITING = {"bash", "python", "python_session", "terminal", "write_file", "edit_file"}


def test_every_tool_the_host_runs_is_offered_to_the_model() -> None:
    registry = ToolRegistry.default()
    assert registry.names() == sorted(set(TOOLS) - PROGRAM_ONLY)
    for name in registry.names():
        tool = registry.get(name)
        assert tool is not None and tool.kind == "sandbox"
        assert tool.description == TOOLS[name].description != ""
        assert set(tool.parameters["properties"]) == set(TOOLS[name].args.model_fields)


def test_the_toolsets_come_from_the_definitions() -> None:
    from atropos.sandbox.contract.tools import PROGRAM_ONLY as derived

    assert derived == PROGRAM_ONLY
    registry = ToolRegistry.default()
    for name in registry.names():
        tool = registry.get(name)
        assert tool is not None and tool.toolset == TOOLS[name].toolset
    with_web = ToolRegistry.default(with_web=True)
    assert with_web.select(["web"]).names() == ["web_extract", "web_search"]


def test_the_sealed_lists_come_from_the_definitions(tmp_path: Path) -> None:
    from atropos.sandbox.host.sandbox_host import SEALED_REFUSED
    from atropos.sandbox.inslot import supervisor

    assert {name for name, spec in TOOLS.items() if spec.writes} == WRITING
    assert SEALED_REFUSED == WRITING
    # The supervisor (stdlib-only, cannot import the definitions) refuses the ops of the writing
    # tools it serves, and none of a reading tool's.
    served = set(supervisor.Supervisor({"workspace": str(tmp_path), "isolated": False}).ops())
    assert supervisor.SEALED_REFUSED == {TOOLS[name].op for name in WRITING} & served
    assert not supervisor.SEALED_REFUSED & {spec.op for spec in TOOLS.values() if not spec.writes}


def test_every_op_a_definition_names_exists_in_the_slot(tmp_path: Path) -> None:
    from atropos.sandbox.inslot import session, supervisor

    served = set(supervisor.Supervisor({"workspace": str(tmp_path), "isolated": False}).ops())
    in_slot = served | set(session.OPS)
    named = {spec.op for spec in TOOLS.values()}
    assert named <= in_slot, f"ops no in-slot program answers: {sorted(named - in_slot)}"
    # and no in-slot op is left without a tool (a dropped definition), besides the liveness probe
    assert in_slot - {"ping"} == named


def test_results_are_formatted_by_the_definition(monkeypatch: pytest.MonkeyPatch) -> None:
    from atropos.sandbox.contract.protocol import CallResult
    from atropos.tools.formatting import format_result

    def reads_as(name: str) -> Formatter:
        return lambda r: (bool(r["ok"]), f"{name} read")

    for name, spec in list(TOOLS.items()):
        monkeypatch.setitem(TOOLS, name, dataclasses.replace(spec, format=reads_as(name)))
        result = CallResult(id="1", slot=0, ok=True, result={"ok": False}, notes=["clamped"])
        assert format_result(name, result) == (False, f"{name} read\n[note: clamped]")


def test_the_tools_page_is_generated_from_the_definitions() -> None:
    from atropos.tools.catalog import DOC, tools_markdown

    assert DOC.read_text() == tools_markdown(), "docs/tools.md is stale: run python -m atropos.tools.catalog"
    text = DOC.read_text()
    for name in ToolRegistry.default(with_web=True).names() + sorted(PROGRAM_ONLY):
        assert f"| `{name}` |" in text
    for name in WRITING:
        assert next(line for line in text.splitlines() if line.startswith(f"| `{name}` |")).endswith("| yes |")
    assert "(tools.md)" in (DOC.parent / "write-an-environment.md").read_text()


def test_the_check_fails_on_a_drifted_page(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from atropos.tools import catalog

    page = tmp_path / "tools.md"
    monkeypatch.setattr(catalog, "DOC", page)
    assert catalog.main([]) == 0 and catalog.main(["--check"]) == 0
    page.write_text(page.read_text().replace("| `stat` |", "| `stat_renamed` |"))
    assert catalog.main(["--check"]) == 1
