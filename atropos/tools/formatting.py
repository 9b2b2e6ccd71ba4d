"""How a tool result reads to the model: short, plain text, nothing of the platform's internals.

Each tool's own formatting is part of its definition (``atropos/sandbox/contract/tools.py``); this adds what
every tool shares: the error line and the host's notes.
"""

from __future__ import annotations

from atropos.sandbox.contract.protocol import CallResult
from atropos.sandbox.contract.tools import TOOLS, format_exec, format_json, format_session

__all__ = ["format_exec", "format_result", "format_session"]


def format_result(tool: str, result: CallResult) -> tuple[bool, str]:
    """(ok, text). ``ok`` is False when the tool could not do what was asked."""
    notes = "".join(f"\n[note: {n}]" for n in result.notes)
    if not result.ok or result.result is None:
        err = result.error
        text = f"error ({err.code}): {err.message}" if err else "error: the tool failed"
        return False, text + notes
    spec = TOOLS.get(tool)
    ok, text = (spec.format if spec is not None else format_json)(result.result)
    return ok, text + notes
