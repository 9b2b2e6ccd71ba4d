"""The slot's protocol has one declaration (atropos/sandbox/inslot/inslot_protocol.py) that a test
holds both languages to (issue 37): slotd's generated header is what the declaration makes, slotd.c
reads every field it carries, the Python programs read every field of the ops they serve, a request
the declaration does not allow is refused by both supervisors, and the error codes the in-slot
programs answer with are declared with their statuses."""

from __future__ import annotations

import re
import struct
from pathlib import Path
from typing import Any

import pytest

from atropos import errors
from atropos.sandbox.host import slotd_build
from atropos.sandbox.host.config import HostConfig
from atropos.sandbox.host.isolation import slotd_header, slotd_wire
from atropos.sandbox.inslot import inslot_common
from atropos.sandbox.inslot import inslot_protocol as P
from atropos.sandbox.inslot.supervisor import SEALED_REFUSED, Supervisor
from tests.test_slotd_sanitized import Rig, _frame

INSLOT = Path(P.__file__).parent


def test_the_checked_in_header_is_the_generated_one() -> None:
    """scripts/gen_slotd_header.py regenerates it: a field added to the declaration and not to the
    header (or the header edited by hand) fails here."""
    assert slotd_header.HEADER.read_text() == slotd_header.c_header(), (
        "atropos/sandbox/inslot/slotd_protocol.h is stale: run scripts/gen_slotd_header.py")


def test_slotd_reads_every_field_it_carries() -> None:
    source = (INSLOT / "slotd.c").read_text()
    for op in P.OPS.values():
        if not op.native:
            continue
        assert f"slotd_parse_{op.name}(" in source, f"slotd.c never parses {op.name}"
        assert f"SLOTD_OP_{op.name.upper()}" in source, f"slotd.c never dispatches {op.name}"
        for f in op.fields:
            if P.carried(f):
                assert re.search(rf"\br\.{re.escape(slotd_header.member(f.name))}\b", source), (
                    f"slotd.c does not read {op.name}.{f.name} (declared as carried to slotd)")


_HANDLERS = {"supervisor": ("supervisor.py", "inslot_files.py", "inslot_file_replies.py", "inslot_terminal.py",
                            "inslot_archive.py"),
             "session": ("session.py",), "verifier": ("verifier.py",)}


@pytest.mark.parametrize("op", [op for op in P.OPS.values() if op.served_by in _HANDLERS], ids=lambda op: op.name)
def test_the_python_side_reads_every_field(op: P.Op) -> None:
    text = "".join((INSLOT / name).read_text() for name in _HANDLERS[op.served_by])
    for f in op.fields:
        if op.name == "session" and f.name == "restart":
            continue  # the host's (slot.py restarts the session's sandbox); the driver takes and ignores it
        assert re.search(rf"req(?:\.get\()?\[?[\"']{f.name}[\"']", text), (
            f"{op.served_by} never reads {op.name}.{f.name}")


def test_the_supervisor_serves_exactly_the_declared_ops(tmp_path: Path) -> None:
    served = set(Supervisor({"workspace": str(tmp_path), "isolated": False}).ops())
    declared = {name for name, op in P.OPS.items() if op.served_by == "supervisor"}
    assert served == declared
    assert declared >= SEALED_REFUSED


def test_request_defaults_are_written_once() -> None:
    """The host's output limits are the declaration's (the 64 MiB fallback of the in-slot programs
    against the host's 256 MiB is gone), and no in-slot program states a default of its own."""
    cfg = HostConfig()
    assert cfg.max_output_bytes == P.default("exec", "max_output") == P.default("session", "max_output")
    assert cfg.hard_output_bytes == P.default("exec", "hard_output") == P.default("session", "hard_output")
    for name in ("supervisor.py", "session.py", "inslot_terminal.py"):
        text = (INSLOT / name).read_text()
        defaulted = r"req\.get\(\"(max_output|hard_output|timeout|wait_ms|settle_ms|cols|rows)\", "
        assert not re.search(defaulted, text), name
        assert "64 << 20" not in text and "65536))" not in text, name
    assert inslot_common.MAX_FRAME == P.MAX_FRAME  # the Python programs' frame bound (stdlib imports only there)


def test_error_codes_are_declared_with_their_statuses() -> None:
    used: set[str] = set()
    for path in INSLOT.glob("*.py"):
        text = path.read_text()
        used |= set(re.findall(r'ToolFailure\(\s*"([a-z_]+)"', text))
        used |= set(re.findall(r'"code": "([a-z_]+)"', text))
        used |= set(re.findall(r'errno\.E[A-Z]+: \("([a-z_]+)"', text))
    assert used, "the scan found no error codes"
    assert used <= set(P.ERRORS), f"undeclared in-slot error codes: {sorted(used - set(P.ERRORS))}"
    table = {code: status for status, code in errors.ERRORS.values()}
    for code, status in P.ERRORS.items():
        if code in table:
            assert table[code] == status, f"{code}: {status} here, {table[code]} in atropos/errors.py"


@pytest.mark.parametrize("req", [
    {"op": "exec", "argv": ["true"], "colour": "red"},
    {"op": "exec", "argv": []},
    {"op": "exec", "argv": ["true"], "timeout": float("nan")},
    {"op": "exec", "argv": ["true"], "max_output": 1 << 40},
    {"op": "exec", "argv": ["true"], "env": {"A": 1}},
    {"op": "terminal", "rows": 0},
    {"op": "read_file", "path": "x", "max_bytes": 1, "encoding": "rot13"},
    {"op": "read_file", "max_bytes": 1},
])
def test_the_declaration_refuses_what_it_does_not_declare(req: dict[str, Any]) -> None:
    with pytest.raises(P.InvalidRequest):
        P.check(req)
    assert slotd_wire.encode(req, 1) is None  # slotd never sees it: the Python supervisor answers


def test_every_carried_field_reaches_slotd_in_the_declared_order() -> None:
    """A request's slotd frame holds each carried field of its op, in order (a field added to the
    declaration goes to slotd without a line of encoder code)."""
    req = {"op": "exec", "argv": ["a", "b"], "stdin": "in", "timeout": 2.5, "env": {"K": "V"}, "max_output": 7,
           "hard_output": 9, "cpu_seconds": 3}
    body = slotd_wire.encode(req, 5)
    assert body is not None and body[:1] == b"E"
    fields, data = [], body[1:]
    while data:
        n = int.from_bytes(data[:4], "big")
        fields.append(data[4:4 + n])
        data = data[4 + n:]
    assert fields == [b"5", b"2.5", b"7", b"9", b"3", b"in", b"1", b"K", b"V", b"2", b"a", b"b"]


def test_the_python_supervisor_refuses_an_unknown_field(tmp_path: Path) -> None:
    sup = Supervisor({"workspace": str(tmp_path), "isolated": False})
    reply = sup.handle({"op": "exec", "argv": ["true"], "colour": "red"})
    assert reply["ok"] is False and reply["error"]["code"] == "invalid_arguments"
    assert "colour" in reply["error"]["message"]
    assert sup.handle({"op": "ping", "seq": 4}) == {"ok": True, "result": {"pong": True}}


def test_slotd_refuses_a_field_its_op_does_not_declare(tmp_path: Path) -> None:
    """A frame with one field more than the declaration (a host and a slotd out of step) ends slotd
    as malformed: it never reads a request's fields into the wrong places."""
    binary = slotd_build.build()
    if binary is None:
        pytest.skip("slotd cannot be built here: no C compiler")
    rig = Rig(binary, tmp_path)
    body = slotd_wire.encode({"op": "exec", "argv": ["true"]}, 1)
    assert body is not None
    run = rig.run(rig.config(warm=False) + _frame(body + struct.pack(">I", 1) + b"x"))
    assert run.returncode == 112 and b"malformed exec request" in run.stderr, run
    assert len(run.replies()) == 1  # the ready frame only
