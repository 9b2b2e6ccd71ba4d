"""How a tool result reads to the model: short, plain text, nothing of the platform's internals."""

from __future__ import annotations

import base64
import json
from typing import Any

from atropos.sandbox.protocol import CallResult

_CONTROL_TO_MARK = {c: "\ufffd" for c in (*range(0, 9), 11, 12, *range(14, 32))}


def format_exec(r: dict[str, Any]) -> str:
    parts = []
    if r.get("stdout"):
        parts.append(str(r["stdout"]).rstrip("\n"))
    if r.get("stderr"):
        parts.append("[stderr]\n" + str(r["stderr"]).rstrip("\n"))
    if r.get("timed_out"):
        parts.append("[timed out: the command was killed]")
    elif r.get("output_limited"):
        parts.append("[output limit reached: the command was killed]")
    elif r.get("signal"):
        parts.append(f"[killed by signal {r['signal']}]")
    elif r.get("exit_code") not in (0, None):
        parts.append(f"[exit code: {r['exit_code']}]")
    return "\n".join(parts) if parts else "(no output)"


def format_session(r: dict[str, Any]) -> str:
    """A python_session result as a notebook cell's output: prints, the final value, the error."""
    parts = []
    if r.get("stdout"):
        parts.append(str(r["stdout"]).rstrip("\n"))
    if r.get("stderr"):
        parts.append("[stderr]\n" + str(r["stderr"]).rstrip("\n"))
    if r.get("value") is not None:
        parts.append(f"Out: {r['value']}")
    err = r.get("error") or {}
    if r.get("restarted"):
        parts.append(f"[session restarted: {err.get('message', 'the session was lost')}]")
    elif err:
        parts.append(str(err.get("traceback") or f"{err.get('type')}: {err.get('message')}").rstrip("\n"))
    elif r.get("timed_out"):  # the code caught its interrupt and finished anyway
        parts.append("[timed out: the code was interrupted; the session is kept]")
    if r.get("output_limited") and not r.get("restarted"):
        parts.append("[output limit reached: the code was interrupted]")
    return "\n".join(parts) if parts else "(no output)"


def format_result(tool: str, result: CallResult) -> tuple[bool, str]:
    """(ok, text). ``ok`` is False when the tool could not do what was asked."""
    notes = "".join(f"\n[note: {n}]" for n in result.notes)
    if not result.ok or result.result is None:
        err = result.error
        text = f"error ({err.code}): {err.message}" if err else "error: the tool failed"
        return False, text + notes
    r = result.result
    if tool in ("bash", "python"):
        ok = not r.get("timed_out") and r.get("exit_code") == 0
        return ok, format_exec(r) + notes
    if tool == "python_session":
        ok = not r.get("error") and not r.get("timed_out") and not r.get("restarted")
        return ok, format_session(r) + notes
    if tool == "read_file":
        if r.get("encoding") == "base64":
            text = base64.b64decode(r["content"]).decode("utf-8", "replace").translate(_CONTROL_TO_MARK)
            return True, f"(binary content, {r.get('size')} bytes; undecodable and control bytes shown as \ufffd)\n" \
                f"{text}" + notes
        return True, str(r["content"]) + notes
    if tool == "write_file":
        return True, f"wrote {r['bytes_written']} bytes to {r['path']}" + notes
    if tool == "edit_file":
        return True, f"replaced {r['replacements']} occurrence(s) in {r['path']}" + notes
    if tool == "list_dir":
        lines = [e["name"] + ("/" if e["type"] == "dir" else "") + (f"  ({e['size']} bytes)" if e["type"] == "file"
                 else "") for e in r["entries"]]
        if r.get("truncated"):
            lines.append(f"... ({r['total']} entries in all)")
        return True, ("\n".join(lines) if lines else "(empty directory)") + notes
    if tool == "terminal":
        out = str(r.get("output", ""))
        return True, (out if out.strip() else "(no new output)") + notes
    return True, json.dumps(r, ensure_ascii=False) + notes
