"""The slot's protocol has one declaration (atropos/sandbox/inslot/inslot_protocol.py) that a test
holds both languages to (issue 37): slotd's generated header is what the declaration makes, slotd.c
reads every field it carries, the Python programs read every field of the ops they serve, a request
the declaration does not allow is refused by both supervisors, and the error codes the in-slot
programs answer with are declared with their statuses."""

from __future__ import annotations

import json
import re
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from atropos import errors
from atropos.sandbox.host import slotd_build
from atropos.sandbox.host.config import HostConfig
from atropos.sandbox.host.isolation import slotd_config, slotd_header, slotd_wire
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


def test_slotd_reads_every_field_of_its_configuration() -> None:
    """The configuration frame is parsed by the generated slotd_parse_config into ``conf``: each
    declared field is read in main(), and no hand-written field reader is left."""
    source = (INSLOT / "slotd.c").read_text()
    assert "slotd_parse_config(&f, &conf)" in source
    for f in P.SLOTD_CONFIG:
        assert re.search(rf"\bconf\.{re.escape(slotd_header.member(f.name))}\b", source), (
            f"slotd.c does not read the configuration's {f.name}")
    assert "cfg_take" not in source and "cfg_count" not in source
    for name in P.RLIMITS:  # the generated table, not one written by hand
        assert f'"{name}"' not in source, f"slotd.c names the limit {name} itself"
        assert f'{{"{name}", RLIMIT_{name.upper()}}}' in slotd_header.c_header()


def test_the_configuration_model_is_the_declaration() -> None:
    """slotd_config.SlotdConfig has the declared fields in the declared order, with their defaults;
    its frame holds each of them in that order."""
    fields = slotd_config.SlotdConfig.model_fields
    assert list(fields) == [f.name for f in P.SLOTD_CONFIG]
    conf = slotd_config.SlotdConfig(argv=["py"])
    for f in P.SLOTD_CONFIG:
        if f.default is not P.REQUIRED:
            assert getattr(conf, f.name) == f.default, f.name
    conf = slotd_config.SlotdConfig(mode="exec", limits={"nofile": 7, "core": 0}, env={"A": "1"},
                                    warm={"k": "boot"}, workspace="/w", argv=["p", "q"], run_dir="/r",
                                    term_dir="/t", tmux=["tm"], shell=["sh"], files_workspace="/fw",
                                    files_cwd="/c")
    data = conf.frame()
    assert int.from_bytes(data[:4], "big") == len(data) - 4
    items, rest = [], data[4:]
    while rest:
        n = int.from_bytes(rest[:4], "big")
        items.append(rest[4:4 + n])
        rest = rest[4 + n:]
    assert items == [b"exec", b"2", b"nofile", b"7", b"core", b"0", b"1", b"A", b"1", b"1", b"k", b"boot",
                     b"/w", b"2", b"p", b"q", b"/r", b"/t", b"1", b"tm", b"1", b"sh", b"/fw", b"/c"]


@pytest.mark.parametrize("bad", [
    {"colour": "red"},  # a key the declaration does not name
    {"mode": "fork"},
    {"limits": {"cpu": 1}},  # a limit slotd has no name for
    {"limits": {"nofile": -1}},
    {"limits": {"nofile": 1 << 64}},
    {"env": {"A=B": "x"}},
    {"env": {"A": "x\0y"}},
    {"warm": {"a": "1", "b": "2", "c": "3"}},
    {"argv": []},
    {"tmux": []},
    {"run_dir": ""},
    {"files_workspace": ""},
    {"shell": ["sh"] * (P.MAX_CONFIG_TMUX + 1)},
])
def test_the_configuration_refuses_what_the_declaration_does_not_allow(bad: dict[str, Any]) -> None:
    with pytest.raises(ValidationError):
        slotd_config.SlotdConfig(**{"argv": ["py"], **bad})


def test_the_limit_names_are_the_hosts_and_every_program_applies_them() -> None:
    """The host's limits (SlotLimits.rlimits) are the declared names; the Python programs apply each
    (inslot_common.apply_limits) and refuse a name with no limit, as slotd's parser does."""
    assert set(HostConfig().limits.rlimits()) == set(P.RLIMITS)
    probe = ("import resource, sys\n"
             "from atropos.sandbox.inslot.inslot_common import apply_limits\n"
             f"apply_limits({{n: 64 for n in {P.RLIMITS!r}}})\n"
             f"print([resource.getrlimit(getattr(resource, 'RLIMIT_' + n.upper())) for n in {P.RLIMITS!r}])\n"
             "try:\n    apply_limits({'cpu_seconds': 1})\nexcept ValueError as e:\n    print(e)\n")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == [str([(64, 64)] * len(P.RLIMITS)), "no resource limit named 'cpu_seconds'"]


def test_slotd_applies_the_configured_limits(tmp_path: Path) -> None:
    """The configuration's limits reach the calls slotd starts, through the generated name table."""
    binary = slotd_build.build()
    if binary is None:
        pytest.skip("slotd cannot be built here: no C compiler")
    rig = Rig(binary, tmp_path)
    conf = rig.config_model(warm=False, limits={"nofile": 77, "fsize": 12345 * 512, "nproc": 256})
    body = slotd_wire.encode({"op": "exec", "argv": ["sh", "-c", "ulimit -n; ulimit -f"]}, 1)
    assert body is not None
    run = rig.run(conf.frame() + _frame(body))
    assert run.returncode == 0, run
    reply = slotd_wire.decode_exec(json.loads(run.replies()[1]), {"op": "exec", "argv": ["sh"]})
    assert reply["result"]["stdout"] == "77\n12345\n", reply


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
