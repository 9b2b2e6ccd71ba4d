"""The slot's protocol, declared once: every op between the host and the programs inside a slot's
sandbox (the supervisor, slotd, the python_session driver, the verifier), each with its request
fields in order, their types, defaults and bounds, the fields of its reply, and every error code an
in-slot program answers with, with its HTTP status.

Everything else is derived from here: the host's encoders for slotd (host/isolation/slotd_wire.py,
which writes the fields of an op slotd serves in this order), slotd's C parser (the generated header
``slotd_protocol.h`` beside slotd.c: host/isolation/slotd_header.py writes it,
scripts/gen_slotd_header.py regenerates it, tests/test_slot_protocol.py compares), the Python
programs' request checking and defaults (``check``, applied before any handler runs), the host's
status table, and the host's tools' defaults (host/config.py). Adding a field is one line here; a
test fails if the C side or the Python side does not read it.

Standard library only: copied with the other in-slot modules into the host's lib dir.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

REQUIRED: Any = object()  # a field without a default: a request must carry it

# Field types. On slotd's wire every field is a 4-byte big-endian length and its bytes: numbers in
# decimal, ``opt_*`` empty for None, a ``strs`` list as its count then its items, a ``pairs`` map as
# its count then name and value of each entry. In JSON (the Python programs) they are the JSON types.
TYPES = ("str", "opt_str", "opt_text", "int", "opt_int", "float", "bool", "opt_bool", "strs", "pairs", "json")
# str/opt_str/strs/pairs: strings without NUL (slotd's wire: UTF-8 with surrogateescape, as os.fsencode);
# opt_text: any text, NUL included (strict UTF-8); opt_str and opt_text travel empty for None.


class Field(NamedTuple):
    name: str
    type: str
    default: Any = REQUIRED
    lo: float | None = None  # numbers: least value; str/text/strs/pairs: least length (or count)
    hi: float | None = None  # numbers: greatest value; str/text/strs/pairs: greatest length (or count)
    # slotd carries it (True), or only its default (a request with another value goes to the Python
    # supervisor: slotd cannot honour it, e.g. a cwd other than the workspace)
    native: bool = True
    choices: tuple[Any, ...] = ()
    # the host applies it to slotd's answer (slotd never sees it): read_file's encoding, list_dir's
    # max_entries, write_file's encoding and max_bytes (checked before the frame is sent)
    host: bool = False
    # on slotd's wire: the bytes the Python supervisor would work on, NUL allowed (a path, edit's
    # strings: strict UTF-8, as inslot_files encodes them; write_file's content: decoded by its
    # encoding); a value without them (a lone surrogate) goes to the Python supervisor
    raw: bool = False


class Op(NamedTuple):
    name: str
    fields: tuple[Field, ...]
    reply: tuple[str, ...]  # the keys of a successful reply's "result" (beyond them: none)
    native: str = ""  # slotd's kind byte for this op; "" where only the Python programs serve it
    served_by: str = "supervisor"  # supervisor | session | verifier
    optional_reply: tuple[str, ...] = ()  # keys a reply may add to ``reply``
    # it writes files the slot's programs read: a waiting interpreter started before it must not
    # serve a later call (its start-up read the user site, .pth files, sitecustomize)
    writes_files: bool = False


MiB = 1 << 20
MAX_FRAME = 64 * MiB  # a request frame, either wire (slotd.c's and inslot_common's bound)
MAX_ARGV = 1 << 16
MAX_ENV = 4096
MAX_KEYS = 4096
# A path's length: bounded by the frame only; a longer one than the kernel takes is the handler's
# error to give (invalid_path, as for a fresh open), not the declaration's.
MAX_PATH = MAX_FRAME
MAX_OFFSET = (1 << 63) - 1  # a file offset (off_t)
MAX_TIMEOUT = 1e7  # seconds: a deadline beyond what any host clamps to, within what a poll can count
# The output a call keeps (head and tail) and the output that ends it: the host's defaults too
# (host/config.py takes them from here).
DEFAULT_MAX_OUTPUT = 64 << 10
DEFAULT_HARD_OUTPUT = 256 * MiB
MAX_OUTPUT_CAP = 256 * MiB
MAX_HARD_OUTPUT = 1 << 40
DEFAULT_TIMEOUT = 60.0

_OUTPUT = (Field("max_output", "int", DEFAULT_MAX_OUTPUT, 0, MAX_OUTPUT_CAP),
           Field("hard_output", "int", DEFAULT_HARD_OUTPUT, 0, MAX_HARD_OUTPUT))
_EXEC_REPLY = ("exit_code", "signal", "timed_out", "output_limited", "stdout", "stderr", "stdout_bytes",
               "stderr_bytes", "stdout_truncated", "stderr_truncated", "duration_ms")

OPS: dict[str, Op] = {op.name: op for op in (
    Op("exec", (
        Field("timeout", "float", DEFAULT_TIMEOUT, 0, MAX_TIMEOUT),
        *_OUTPUT,
        Field("cpu_seconds", "opt_int", None, 1, 1 << 31),
        Field("stdin", "opt_text", None, 0, MAX_FRAME),
        Field("env", "pairs", {}, 0, MAX_ENV),
        Field("argv", "strs", REQUIRED, 1, MAX_ARGV),
        Field("cwd", "str", ".", 0, MAX_PATH, native=False),
    ), _EXEC_REPLY, native="E"),
    Op("terminal", (
        Field("input", "str", "", 0, MAX_FRAME),
        Field("enter", "opt_bool", None),
        Field("keys", "strs", [], 0, MAX_KEYS),
        Field("wait_ms", "float", 2000.0, 0, MAX_TIMEOUT * 1000),
        Field("settle_ms", "float", 300.0, 0, MAX_TIMEOUT * 1000),
        Field("cols", "int", 200, 1, 10000),
        Field("rows", "int", 50, 1, 10000),
        Field("offset", "int", 0, 0, MAX_OFFSET),
        Field("max_output", "int", DEFAULT_MAX_OUTPUT, 0, MAX_OUTPUT_CAP),
    ), ("output", "offset", "truncated", "bytes"), native="T"),
    Op("ping", (), ("pong",), native="P"),
    # slotd's own: it execs the Python supervisor in its place, which answers with its ready frame
    Op("upgrade", (), ("ready", "pid"), native="U", served_by="slotd"),
    # The file tools: slotd does their system calls (the same ones, in the same order, as
    # inslot_files.SlotFiles) and the host renders the answer with inslot_files' own functions
    # (host/isolation/slotd_wire.py): no Python start on a slot's first file call.
    Op("read_file", (
        Field("path", "str", REQUIRED, 0, MAX_PATH, raw=True),
        Field("offset", "int", 0, 0, MAX_OFFSET),
        Field("limit", "int", 0, 0, MAX_OFFSET),
        Field("encoding", "str", "text", choices=("text", "base64"), host=True),
        Field("max_bytes", "int", REQUIRED, 0, 1 << 40),
    ), ("content", "encoding", "size"), optional_reply=("binary",), native="R"),
    Op("write_file", (
        Field("path", "str", REQUIRED, 0, MAX_PATH, raw=True),
        Field("content", "str", REQUIRED, 0, MAX_FRAME, raw=True),
        Field("encoding", "str", "text", choices=("text", "base64"), host=True),
        Field("append", "bool", False),
        Field("max_bytes", "int", REQUIRED, 0, 1 << 40, host=True),
    ), ("path", "bytes_written", "size"), writes_files=True, native="W"),
    Op("edit_file", (
        Field("path", "str", REQUIRED, 0, MAX_PATH, raw=True),
        Field("old_string", "str", REQUIRED, 1, MAX_FRAME, raw=True),
        Field("new_string", "str", REQUIRED, 0, MAX_FRAME, raw=True),
        Field("replace_all", "bool", False),
        Field("max_bytes", "int", REQUIRED, 0, 1 << 40),
    ), ("path", "replacements"), writes_files=True, native="D"),
    Op("list_dir", (
        Field("path", "str", ".", 0, MAX_PATH, raw=True),
        Field("max_entries", "int", 1000, 1, 100_000, host=True),
    ), ("path", "entries", "truncated", "total"), native="L"),
    Op("stat", (Field("path", "str", REQUIRED, 0, MAX_PATH, raw=True),), ("path", "type", "size", "mode", "mtime"),
       native="S"),
    Op("archive", (
        Field("path", "str", ".", 0, MAX_PATH),
        Field("max_bytes", "int", REQUIRED, 0, 1 << 40),
    ), ("content", "encoding", "format", "size", "members", "skipped", "skipped_total")),
    Op("session", (
        Field("code", "str", "", 0, MAX_FRAME),
        Field("restart", "bool", False),
        Field("timeout", "float", DEFAULT_TIMEOUT, 0, MAX_TIMEOUT),
        *_OUTPUT,
    ), ("stdout", "stderr", "value", "error", "timed_out", "output_limited", "stdout_bytes", "stderr_bytes",
        "stdout_truncated", "stderr_truncated", "execution_count", "duration_ms"), served_by="session"),
    Op("verify", (
        Field("program", "str", REQUIRED, 1, MAX_FRAME),
        Field("secrets", "json", {}),
        Field("args", "json", None),
        Field("timeout", "float", REQUIRED, 0, MAX_TIMEOUT),
        Field("workspace", "str", "/workspace", 1, MAX_PATH),
        Field("restore", "strs", [], 0, 4096),
        Field("pristine", "opt_str", None, 1, MAX_PATH),
        Field("cwd", "opt_str", None, 1, MAX_PATH),
    ), ("log",), served_by="verifier", optional_reply=("verdict", "error")),
)}

# slotd's configuration: the first frame it reads (never its argv, which every process of the slot can
# read in /proc), in this field order on the same wire as a request's fields (host/slotd_config.py
# encodes it from a typed model, slotd_protocol.h parses it). ``choices`` of a ``pairs`` field: the
# names its entries may have.
#
# The resource limits a slot's programs start under, by name: RLIMIT_<NAME> of setrlimit(2) in C and
# of Python's resource module (inslot_common.apply_limits); host/config.py's SlotLimits.rlimits gives them.
RLIMITS = ("nproc", "as", "fsize", "nofile", "core")
MAX_RLIMIT = (1 << 64) - 1  # RLIM_INFINITY
# The warm interpreters slotd keeps (inslot_warm.WARM_KINDS: a boot script per kind).
MAX_WARM = 2
MAX_CONFIG_ARGV = 4096
MAX_CONFIG_TMUX = 64

SLOTD_CONFIG: tuple[Field, ...] = (
    # "serve": answer requests; "exec": run ``argv`` in our place at once (exec_program.py's job)
    Field("mode", "str", "serve", choices=("serve", "exec")),
    Field("limits", "pairs", {}, 0, len(RLIMITS), choices=RLIMITS),  # name -> decimal value
    Field("env", "pairs", {}, 0, MAX_ENV),  # the calls' environment (names without "=")
    Field("warm", "pairs", {}, 0, MAX_WARM),  # kind (a call's argv[0]) -> boot script, "{go}"/"{src}" the fds
    Field("workspace", "str", "/workspace", 0, MAX_PATH),  # every call's cwd; "exec": the program's ("": none)
    Field("argv", "strs", REQUIRED, 1, MAX_CONFIG_ARGV),  # the Python supervisor (upgrade); "exec": the program
    Field("run_dir", "str", "/run/term", 1, MAX_PATH),  # the terminal's socket and log
    Field("term_dir", "str", "/workspace", 1, MAX_PATH),  # where the terminal's shell starts
    Field("tmux", "strs", ["tmux"], 1, MAX_CONFIG_TMUX),  # how to run tmux
    Field("shell", "strs", [], 0, MAX_CONFIG_TMUX),  # the terminal session's command (none: tmux's own)
    # the file tools' SlotFiles(workspace, cwd) as supervisor.py builds it
    Field("files_workspace", "str", "/workspace", 1, MAX_PATH),
    Field("files_cwd", "opt_str", None, 1, MAX_PATH),
)


# The keys every request may carry beyond its op's fields: its op and its sequence number (the reply
# echoes it; inslot_common.serve).
ENVELOPE = ("op", "seq")

# Every error code an in-slot program answers with, and its HTTP status as the host reports it.
ERRORS: dict[str, int] = {
    "not_found": 404, "too_large": 413, "path_escape": 403, "permission_denied": 403,
    # the same code as the host's own argument check (atropos/errors.py: ToolInputError)
    "invalid_arguments": 422,
    "invalid_request": 400, "unknown_op": 400, "invalid_path": 400, "is_directory": 400, "not_regular": 400,
    "not_text": 400, "no_match": 400, "ambiguous_match": 400, "exists": 400, "no_space": 400, "unsupported": 400,
    "changed_during_archive": 400, "terminal_unavailable": 400, "verification_phase": 409, "os_error": 400,
    "tool_error": 400,
    # the verifier's verdict failures (reported in VerifyResult.error with the host's own status)
    "bad_program": 400, "bad_verdict": 400, "program_failed": 400, "restore_failed": 400, "timed_out": 400,
}


def status(code: str) -> int:
    """The HTTP status of an in-slot error code (an unknown one is a 400-class tool error)."""
    return ERRORS.get(code, 400)


def carried(f: Field) -> bool:
    """Whether slotd's frame holds the field (slotd_wire.encode_op writes it, slotd_protocol.h reads it)."""
    return f.native and not f.host


def default(op: str, name: str) -> Any:
    for f in OPS[op].fields:
        if f.name == name:
            return f.default
    raise KeyError(f"{op} has no field {name!r}")


class InvalidRequest(ValueError):
    """A request that does not match its op's declaration: answered as ``invalid_arguments``."""


def _bad(op: str, f: Field, why: str) -> InvalidRequest:
    return InvalidRequest(f"{op}.{f.name}: {why}")


def _check_value(op: str, f: Field, value: Any) -> Any:
    t = f.type
    if (value is None and t.startswith("opt_")) or t == "json":
        return value
    if t in ("int", "opt_int"):
        if isinstance(value, bool) or not isinstance(value, int):
            raise _bad(op, f, f"an integer, not {type(value).__name__}")
        size: float = value
    elif t == "float":
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise _bad(op, f, f"a number, not {type(value).__name__}")
        value = float(value)
        if math.isnan(value):
            raise _bad(op, f, "not a number")
        size = value
    elif t in ("bool", "opt_bool"):
        if not isinstance(value, bool):
            raise _bad(op, f, f"true or false, not {type(value).__name__}")
        return value
    elif t in ("str", "opt_str", "opt_text"):
        if not isinstance(value, str):
            raise _bad(op, f, f"a string, not {type(value).__name__}")
        size = len(value)
    elif t == "strs":
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise _bad(op, f, "a list of strings")
        size = len(value)
    elif t == "pairs":
        if not isinstance(value, dict) or not all(isinstance(k, str) and isinstance(v, str)
                                                  for k, v in value.items()):
            raise _bad(op, f, "an object of strings")
        size = len(value)
    else:  # pragma: no cover - the declaration's own types
        raise _bad(op, f, f"unknown type {t}")
    if (f.lo is not None and size < f.lo) or (f.hi is not None and size > f.hi):
        what = "" if t in ("int", "opt_int", "float") else "length "
        raise _bad(op, f, f"{what}{value if not what else size} outside [{f.lo}, {f.hi}]")
    if f.choices and t == "pairs":
        unknown = sorted(k for k in value if k not in f.choices)
        if unknown:
            raise _bad(op, f, f"unknown name{'s' if len(unknown) > 1 else ''} {', '.join(unknown)} "
                              f"(one of {', '.join(map(str, f.choices))})")
    elif f.choices and value not in f.choices:
        raise _bad(op, f, f"one of {', '.join(map(str, f.choices))}")
    return value


def check_fields(what: str, fields: tuple[Field, ...], values: dict[str, Any]) -> dict[str, Any]:
    """``values`` with every one of ``fields``, defaults filled in, each checked against its
    declaration (type, bounds, choices); a key none of them names, a missing required field, a wrong
    type or a value out of bounds is an ``InvalidRequest`` naming ``what``."""
    known = {f.name for f in fields}
    unknown = sorted(k for k in values if k not in known)
    if unknown:
        raise InvalidRequest(f"{what}: unknown field{'s' if len(unknown) > 1 else ''} {', '.join(unknown)}")
    out: dict[str, Any] = {}
    for f in fields:
        if f.name in values:
            out[f.name] = _check_value(what, f, values[f.name])
        elif f.default is REQUIRED:
            raise _bad(what, f, "missing")
        else:
            out[f.name] = f.default.copy() if isinstance(f.default, (list, dict)) else f.default
    return out


def check(req: dict[str, Any]) -> dict[str, Any]:
    """``req`` with every field of its op, defaults filled in, checked against the declaration: a
    key the op does not declare, a missing required field, a wrong type or a value out of bounds is
    an ``InvalidRequest``; an op nobody declares, a ``KeyError`` (answered as ``unknown_op``)."""
    op = OPS[str(req.get("op"))]
    fields = check_fields(op.name, op.fields, {k: v for k, v in req.items() if k not in ENVELOPE})
    return {**{k: req[k] for k in ENVELOPE if k in req}, **fields}
