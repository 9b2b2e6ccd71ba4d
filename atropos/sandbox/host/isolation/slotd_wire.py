"""The host's side of the wire to ``slotd``, the compiled supervisor (atropos/sandbox/inslot/slotd.c).

slotd serves a slot's ``exec`` calls (and ``ping``) without Python; everything else goes to the
Python supervisor, which slotd becomes on an "upgrade" request (docs/native-supervisor.md). This
module decides which requests slotd can answer exactly as supervisor.py would, encodes them in
slotd's field format, and turns its reply into the very reply supervisor.py gives: the captured
bytes come back raw (base64 of the kept head and tail) and are rendered here by the same function
as in the Python supervisor (``inslot_common.render_capture``).
"""

from __future__ import annotations

import base64
import os
import struct
from typing import Any

from atropos.sandbox.inslot.inslot_common import (
    render_capture,
    strip_ansi,
    terminal_not_socket_message,
    terminal_timeout_message,
)

_LEN = struct.Struct(">I")


def _field(data: bytes) -> bytes:
    return _LEN.pack(len(data)) + data


def _text(value: Any) -> bytes:
    return _field(str(value).encode())


def encode_ping(seq: int) -> bytes:
    return b"P" + _text(seq)


def encode_upgrade(seq: int) -> bytes:
    return b"U" + _text(seq)


def serves(payload: dict[str, Any]) -> bool:
    """Whether slotd answers requests of this kind (what ``encode`` takes, but for strings it leaves
    to the Python supervisor): the host's record of what a lease needed (supervisor_choice.py)."""
    op = payload.get("op")
    return op in ("ping", "terminal") or (op == "exec" and (payload.get("cwd") or ".") == ".")


def encode(payload: dict[str, Any], seq: int) -> bytes | None:
    """slotd's form of a request, or None where supervisor.py must answer it."""
    op = payload.get("op")
    if op == "ping":
        return encode_ping(seq)
    if op == "exec":
        return encode_exec(payload, seq)
    if op == "terminal":
        return encode_terminal(payload, seq)
    return None


def decode(frame: dict[str, Any], payload: dict[str, Any]) -> dict[str, Any]:
    """supervisor.py's reply to ``payload``, from slotd's ``frame``."""
    op = payload.get("op")
    if op == "exec":
        return decode_exec(frame, payload)
    if op == "terminal":
        return decode_terminal(frame)
    return frame


def encode_exec(payload: dict[str, Any], seq: int) -> bytes | None:
    """slotd's form of an exec request, or None where supervisor.py must answer it: a cwd other than
    the workspace (resolved beneath it by the file tools' walk), or strings the Python supervisor
    would refuse or transform (its error replies stay its own)."""
    if payload.get("op") != "exec" or (payload.get("cwd") or ".") != ".":
        return None
    argv = payload.get("argv")
    env = payload.get("env") or {}
    stdin = payload.get("stdin")
    if not isinstance(argv, list) or not argv or not isinstance(env, dict):
        return None
    try:
        args = [os.fsencode(str(a)) for a in argv]  # as Popen encodes them
        pairs = [(os.fsencode(str(k)), os.fsencode(str(v))) for k, v in env.items()]
        data = str(stdin).encode() if stdin else b""
        timeout = float(payload.get("timeout", 60.0))
        cap = int(payload.get("max_output", 65536))
        hard = int(payload.get("hard_output", 64 << 20))
        cpu = payload.get("cpu_seconds")
        cpu_text = str(int(cpu)) if cpu else ""
    except (UnicodeError, TypeError, ValueError, OverflowError):
        return None  # supervisor.py reports these as it always has
    if any(b"\0" in a for a in args) or any(b"\0" in k or b"=" in k or not k or b"\0" in v for k, v in pairs):
        return None  # Popen's own errors, word for word, come from supervisor.py
    if not (0 <= cap < 1 << 40 and 0 <= hard < 1 << 62):
        return None
    out = [b"E", _text(seq), _text(repr(timeout)), _text(cap), _text(hard), _text(cpu_text), _field(data),
           _text(len(pairs))]
    for key, value in pairs:
        out += [_field(key), _field(value)]
    out.append(_text(len(args)))
    out += [_field(a) for a in args]
    return b"".join(out)


def decode_exec(frame: dict[str, Any], payload: dict[str, Any]) -> dict[str, Any]:
    """supervisor.py's reply to the same call, from slotd's."""
    r = frame["result"]
    result: dict[str, Any] = {"exit_code": r["exit_code"], "signal": r["signal"], "timed_out": r["timed_out"],
                              "output_limited": r["output_limited"]}
    for name in ("stdout", "stderr"):
        head, tail, total = r[name]
        text, truncated = render_capture(base64.b64decode(head), base64.b64decode(tail), int(total))
        result[name] = text
        result[f"{name}_bytes"] = int(total)
        result[f"{name}_truncated"] = truncated
    if r.get("start_errno"):
        result["stderr"] = f"cannot start {payload['argv'][0]}: {os.strerror(int(r['start_errno']))}\n"
    result["duration_ms"] = r["duration_ms"]
    reply: dict[str, Any] = {"ok": True, "result": result}
    if "seq" in frame:
        reply["seq"] = frame["seq"]
    return reply


def encode_terminal(payload: dict[str, Any], seq: int) -> bytes | None:
    """The terminal request (inslot_terminal.run_terminal's fields), or None for what supervisor.py
    reports itself (text tmux's argv cannot carry)."""
    try:
        text = os.fsencode(str(payload.get("input") or ""))
        keys = [os.fsencode(str(k)) for k in payload.get("keys") or []]
        enter = payload.get("enter")
        wait = float(payload.get("wait_ms", 2000))
        settle = float(payload.get("settle_ms", 300))
        cols, rows = str(payload.get("cols", 200)), str(payload.get("rows", 50))
        offset = int(payload.get("offset") or 0)
        cap = int(payload.get("max_output", 65536))
    except (UnicodeError, TypeError, ValueError, OverflowError):
        return None
    if b"\0" in text or any(b"\0" in k for k in keys) or "\0" in cols + rows or not (0 <= cap < 1 << 40):
        return None
    out = [b"T", _text(seq), _field(text), _text("" if enter is None else "1" if enter else "0"), _text(len(keys)),
           *(_field(k) for k in keys), _text(repr(wait)), _text(repr(settle)), _text(cols), _text(rows),
           _text(offset), _text(cap)]
    return b"".join(out)


def decode_terminal(frame: dict[str, Any]) -> dict[str, Any]:
    """run_terminal's reply, or the error supervisor.py gives for the same failure."""
    reply: dict[str, Any]
    if frame.get("ok"):
        r = frame["result"]
        head, tail, total = r["output"]
        text, truncated = render_capture(base64.b64decode(head), base64.b64decode(tail), int(total))
        reply = {"ok": True, "result": {"output": strip_ansi(text), "offset": r["offset"], "truncated": truncated,
                                        "bytes": r["bytes"]}}
    else:
        why = frame.get("fail")
        if why == "os":
            file = base64.b64decode(frame.get("file") or "").decode(errors="surrogateescape")
            errno = int(frame.get("errno") or 0)
            message = str(OSError(errno, os.strerror(errno), file))
            reply = {"ok": False, "error": {"code": "os_error", "message": message}}
        else:
            if why == "timeout":
                message = terminal_timeout_message()
            elif why == "not_socket":
                sock = base64.b64decode(frame.get("file") or "").decode(errors="replace")
                message = terminal_not_socket_message(sock)
            else:
                message = "cannot start the terminal: " + base64.b64decode(frame.get("detail") or "").decode(
                    errors="replace")
            reply = {"ok": False, "error": {"code": "terminal_unavailable", "message": message}}
    if "seq" in frame:
        reply["seq"] = frame["seq"]
    return reply
