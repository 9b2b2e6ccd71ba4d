"""The host's side of the wire to ``slotd``, the compiled supervisor (atropos/sandbox/inslot/slotd.c).

slotd serves a slot's ``exec`` calls, its terminal and ``ping`` without Python; everything else goes
to the Python supervisor, which slotd becomes on an "upgrade" request (docs/native-supervisor.md).
This module decides which requests slotd can answer exactly as supervisor.py would, encodes them in
slotd's field format (which fields, their order and bounds: the protocol's one declaration,
atropos/sandbox/inslot/inslot_protocol.py, from which slotd's parser is generated too), and turns
its reply into the very reply supervisor.py gives: the captured bytes come back raw (base64 of the
kept head and tail) and are rendered here by the same function as in the Python supervisor
(``inslot_common.render_capture``)."""

from __future__ import annotations

import base64
import os
import struct
from typing import Any

from atropos.sandbox.inslot import inslot_file_replies as F
from atropos.sandbox.inslot import inslot_protocol as P
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


def encode_field(f: P.Field, value: Any) -> list[bytes]:
    """A checked field's value in slotd's form (the types of inslot_protocol.TYPES), for a request or
    slotd's configuration (slotd_config.py); UnicodeError or ValueError where slotd cannot carry it as
    the Python supervisor would take it."""
    t = f.type
    if t in ("int", "float"):
        return [_text(repr(value))]
    if t == "opt_int":
        return [_text("" if value is None else int(value))]
    if t in ("bool", "opt_bool"):
        return [_text("" if value is None else "1" if value else "0")]
    if t == "opt_text":  # as supervisor.py writes it to the call's stdin: strict UTF-8
        return [_field(value.encode() if value else b"")]
    if t in ("str", "opt_str"):
        raw = os.fsencode(value or "")  # as Popen and tmux's argv encode it
        if b"\0" in raw:
            raise ValueError("NUL")
        return [_field(raw)]
    if t == "strs":
        items = [os.fsencode(v) for v in value]
        if any(b"\0" in v for v in items):
            raise ValueError("NUL")
        return [_text(len(items)), *map(_field, items)]
    if t == "pairs":
        pairs = [(os.fsencode(k), os.fsencode(v)) for k, v in value.items()]
        if any(b"\0" in k or b"=" in k or not k or b"\0" in v for k, v in pairs):
            raise ValueError("an environment name or value Popen refuses")
        return [_text(len(pairs)), *(_field(x) for pair in pairs for x in pair)]
    raise ValueError(f"slotd cannot carry {t}")


def _raw(op: str, f: P.Field, req: dict[str, Any]) -> bytes:
    """A ``raw`` field's bytes: what the Python supervisor's handler works on. write_file's content
    decoded by its encoding and checked against max_bytes (inslot_file_replies.write_content: a refusal, a
    ToolFailure, is the Python supervisor's to answer), any other text strictly UTF-8 (as
    inslot_files opens a path and compares edit's strings: a lone surrogate is a UnicodeError, and the
    Python supervisor's to answer)."""
    if op == "write_file" and f.name == "content":
        return F.write_content(req)
    return str(req[f.name]).encode()


def encode_op(payload: dict[str, Any], seq: int) -> bytes | None:
    """slotd's frame body for ``payload`` (its kind byte, the sequence number, then every field slotd
    carries in the declared order), or None where the Python supervisor must answer: an op slotd does
    not serve, a request the declaration refuses (the Python supervisor's error reply stays its own),
    a field slotd cannot honour set to other than its default (exec's cwd), or strings Popen would
    refuse or transform."""
    op = P.OPS.get(str(payload.get("op")))
    if op is None or not op.native or op.served_by != "supervisor":
        return None
    try:
        req = P.check(payload)
        out = [op.native.encode(), _text(seq)]
        for f in op.fields:
            if f.host:
                continue
            if not f.native:
                if req[f.name] and req[f.name] != f.default:
                    return None
                continue
            out += [_field(_raw(op.name, f, req))] if f.raw else encode_field(f, req[f.name])
    except (P.InvalidRequest, UnicodeError, ValueError, TypeError, F.ToolFailure):
        return None
    return b"".join(out)


def encode_ping(seq: int) -> bytes:
    return b"P" + _text(seq)


def encode_upgrade(seq: int) -> bytes:
    return P.OPS["upgrade"].native.encode() + _text(seq)


def serves(payload: dict[str, Any]) -> bool:
    """Whether slotd answers requests of this kind (what ``encode`` takes, but for strings it leaves
    to the Python supervisor): the host's record of what a lease needed (supervisor_choice.py)."""
    op = P.OPS.get(str(payload.get("op")))
    if op is None or not op.native or op.served_by != "supervisor":
        return False
    return all(f.native or not payload.get(f.name) or payload.get(f.name) == f.default for f in op.fields)


def encode(payload: dict[str, Any], seq: int) -> bytes | None:
    """slotd's form of a request, or None where supervisor.py must answer it."""
    return encode_op(payload, seq)


def decode(frame: dict[str, Any], payload: dict[str, Any], workspace: str = "/workspace") -> dict[str, Any]:
    """supervisor.py's reply to ``payload``, from slotd's ``frame``; ``workspace``: the file tools'
    (as slotd's ready frame names it)."""
    op = payload.get("op")
    if op == "exec":
        return decode_exec(frame, payload)
    if op == "terminal":
        return decode_terminal(frame)
    if "fs" in frame:
        return decode_files(frame, P.check(payload), workspace)
    return frame


def b64_text(value: Any) -> str:
    return os.fsdecode(base64.b64decode(value or ""))


def decode_files(frame: dict[str, Any], req: dict[str, Any], workspace: str) -> dict[str, Any]:
    """The file tool's reply as inslot_files.SlotFiles gives it, from slotd's raw outcome: its
    bytes, its stat fields and the paths the kernel resolved, or what failed (an errno, or which of
    SlotFiles' own checks), worded here by inslot_files' own functions."""
    fs, op, path = frame["fs"], req["op"], req["path"]
    reply: dict[str, Any]
    if not frame.get("ok"):
        why, err = fs["fail"], int(fs.get("errno") or 0)
        name = b64_text(fs["name"]) if "name" in fs else path
        if why == "os":
            exc = F.os_failure(OSError(err, os.strerror(err)), name)
            error = {"code": exc.code, "message": str(exc)}
        elif why == "raw":  # an OSError SlotFiles does not word (an fstat's): the supervisor's os_error
            error = {"code": "os_error", "message": str(OSError(err, os.strerror(err)))}
        else:
            if why == "escape":
                exc = F.escape_failure(path, workspace)
            elif why == "too_large":
                exc = F.failure(why, path, int(fs["num"]), int(req["max_bytes"]))
            elif why == "ambiguous_match":
                exc = F.failure(why, path, int(fs["num"]))
            else:
                exc = F.failure(why, path)
            error = {"code": exc.code, "message": str(exc)}
        reply = {"ok": False, "error": error}
    else:
        result: dict[str, Any]
        if op == "read_file":
            result = F.read_result(base64.b64decode(fs["data"]), int(fs["size"]), req["encoding"])
        elif op == "write_file":
            result = {"path": F.shown_path(b64_text(fs["real"]), b64_text(fs["rel"]), workspace),
                      "bytes_written": len(F.write_content(req)), "size": int(fs["size"])}
        elif op == "edit_file":
            result = {"path": F.edited_path(b64_text(fs["rel"]), workspace),
                      "replacements": int(fs["count"]) if req["replace_all"] else 1}
        elif op == "stat":
            sec, nsec = fs["mtime"]
            mtime = float(sec) + int(nsec) * 1e-9  # os.stat_result.st_mtime, as CPython computes it
            result = F.stat_result(F.shown_path(b64_text(fs["real"]), b64_text(fs["rel"]), workspace), int(fs["mode"]),
                                   int(fs["size"]), mtime)
        else:  # list_dir: sorted(os.listdir(fd)), the first max_entries stat'ed, a failed stat left out
            names = sorted((os.fsdecode(base64.b64decode(n)), mode, size) for n, mode, size in fs["entries"])
            limit = int(req["max_entries"])
            entries = [F.list_entry(n, mode, size) for n, mode, size in names[:limit] if mode >= 0]
            result = {"path": F.shown_path(b64_text(fs["real"]), b64_text(fs["rel"]), workspace), "entries": entries,
                      "truncated": len(names) > limit, "total": len(names)}
        reply = {"ok": True, "result": result}
    if "seq" in frame:
        reply["seq"] = frame["seq"]
    return reply


def encode_exec(payload: dict[str, Any], seq: int) -> bytes | None:
    """slotd's form of an exec request (``encode_op``), or None where supervisor.py must answer it."""
    return encode_op(payload, seq) if payload.get("op") == "exec" else None


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
