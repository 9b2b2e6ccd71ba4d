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

from atropos.sandbox.inslot.inslot_common import render_capture

_LEN = struct.Struct(">I")


def _field(data: bytes) -> bytes:
    return _LEN.pack(len(data)) + data


def _text(value: Any) -> bytes:
    return _field(str(value).encode())


def encode_ping(seq: int) -> bytes:
    return b"P" + _text(seq)


def encode_upgrade(seq: int) -> bytes:
    return b"U" + _text(seq)


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
