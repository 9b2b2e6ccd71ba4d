"""slotd is memory-safe by test (issue 37): built with AddressSanitizer and UndefinedBehaviorSanitizer
(slotd_build.SANITIZER_CFLAGS, cached like the real build), it runs a frame fuzzer (malformed,
truncated, oversized frames, odd output caps, terminal log reads around the cap; malformed
configuration frames) and the supervisor equality cases of tests/test_slotd.py; a sanitizer report of
any kind (a heap overflow, a leak at its exit, undefined behaviour) fails the test.

The sanitizer build is dynamic (the sanitizers' runtimes are shared libraries): it runs in a plain
bubblewrap of the host's root here and in the host's default slot root (which binds the host's
/usr), never in an image root.
"""

from __future__ import annotations

import os
import random
import secrets
import shutil
import socket
import struct
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from atropos.sandbox.host import slotd_build
from atropos.sandbox.host.isolation import slotd_config, slotd_wire
from atropos.sandbox.inslot import inslot_protocol as P
from atropos.sandbox.inslot.inslot_warm import WARM_KINDS
from tests.conftest import IMAGE_STORE, RunningHost, leased_slot, start_host, stop_host
from tests.test_slotd import CASES, _file_session

REPORTS = (b"AddressSanitizer", b"LeakSanitizer", b"runtime error", b"UndefinedBehaviorSanitizer")


@pytest.fixture(scope="module")
def sanitized() -> Path:
    if shutil.which("cc") is None and shutil.which("gcc") is None:
        pytest.skip("no C compiler on this machine: slotd is not built here at all")
    binary = slotd_build.build(cflags=slotd_build.SANITIZER_CFLAGS)
    assert binary is not None, "the C compiler is there but the sanitizer build of slotd failed (see the log)"
    return binary


def _frame(body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + body


def _field(data: bytes | str | int) -> bytes:
    raw = data if isinstance(data, bytes) else str(data).encode()
    return struct.pack(">I", len(raw)) + raw


@dataclass
class Run:
    returncode: int
    stdout: bytes
    stderr: bytes

    def replies(self) -> list[bytes]:
        out, data = [], self.stdout
        while len(data) >= 4:
            (size,) = struct.unpack(">I", data[:4])
            out.append(data[4:4 + size])
            data = data[4 + size:]
        return out


class Rig:
    """slotd (the sanitizer build) in a PID namespace of its own, with a terminal whose tmux is a stub
    (every client succeeds) and whose log the test writes: the terminal's read of the log, at any
    size against any cap, without a tmux server."""

    def __init__(self, binary: Path, root: Path) -> None:
        self.binary = binary
        self.root = root
        self.ws = root / "ws"
        self.run_dir = root / "run"
        self.ws.mkdir()
        self.run_dir.mkdir()
        sock = socket.socket(socket.AF_UNIX)
        sock.bind(str(self.run_dir / "tmux.sock"))  # a socket file is all slotd checks before its clients
        sock.close()
        self.tmux = self.run_dir / "tmux"  # (bound at its own path: the rig binds ws over /tmp)
        self.tmux.write_text("#!/bin/sh\nexit 0\n")
        self.tmux.chmod(0o755)

    def log(self, data: bytes) -> None:
        (self.run_dir / "terminal.log").write_bytes(data)

    def config(self, warm: bool = True) -> bytes:
        return self.config_model(warm).frame()

    def config_model(self, warm: bool = True, **extra: Any) -> slotd_config.SlotdConfig:
        env = {"PATH": "/usr/bin:/bin", "HOME": "/tmp"}
        boots = ({kind: boot("{go}", "{src}", env)  # type: ignore[arg-type]  # placeholders, as slot.py
                  for kind, boot in WARM_KINDS.items()} if warm else {})
        fields: dict[str, Any] = {
            "env": env, "warm": boots, "workspace": "/tmp", "term_dir": "/tmp", "files_workspace": "/tmp",
            "limits": {"as": 4 << 30, "nproc": 256}, "run_dir": str(self.run_dir), "tmux": [str(self.tmux)],
            "argv": [sys.executable, "-c", "pass"]}
        return slotd_config.SlotdConfig(**{**fields, **extra})

    def run(self, data: bytes, timeout: float = 60.0) -> Run:
        """slotd with ``data`` on its request descriptor (a file: it reads to its end), its replies and
        stderr into files (as the host passes the channel: its last three arguments)."""
        bwrap = shutil.which("bwrap")
        assert bwrap, "bubblewrap is a requirement of the project (scripts/setup.sh installs it)"
        with tempfile.TemporaryFile() as req, tempfile.TemporaryFile() as rep, tempfile.TemporaryFile() as err:
            req.write(data)
            req.seek(0)
            fds = (req.fileno(), rep.fileno(), err.fileno())
            proc = subprocess.run(
                [bwrap, "--unshare-all", "--die-with-parent", "--ro-bind", "/", "/", "--proc", "/proc", "--dev",
                 "/dev", "--bind", str(self.ws), "/tmp", "--bind", str(self.run_dir), str(self.run_dir),
                 str(self.binary), *map(str, fds)],
                stdin=subprocess.DEVNULL, capture_output=True, env={}, timeout=timeout, pass_fds=fds)
            rep.seek(0)
            err.seek(0)
            return Run(proc.returncode, rep.read(), proc.stderr + err.read())


@pytest.fixture
def rig(sanitized: Path, tmp_path: Path) -> Rig:
    return Rig(sanitized, tmp_path)


def _clean(run: Run) -> None:
    for marker in REPORTS:
        assert marker not in run.stderr, run.stderr.decode(errors="replace")[-6000:]
    assert run.returncode not in (86, 87, -6), run.stderr.decode(errors="replace")[-6000:]


def _exec(argv: list[str], seq: int = 1, **extra: Any) -> bytes:
    body = slotd_wire.encode({"op": "exec", "argv": argv, "timeout": 10, **extra}, seq)
    assert body is not None
    return _frame(body)


def _terminal(seq: int, cap: int, offset: int = 0) -> bytes:
    body = slotd_wire.encode({"op": "terminal", "input": "", "wait_ms": 200, "settle_ms": 0, "offset": offset,
                              "max_output": cap}, seq)
    assert body is not None
    return _frame(body)


def test_a_session_of_valid_requests_is_clean_and_leaks_nothing(rig: Rig) -> None:
    """Every kind of call slotd serves, warm and not (a call with its own environment or stdin starts
    its own process: the environment array it builds is freed), then the end of its input: slotd
    exits, and LeakSanitizer checks its heap."""
    frames = [rig.config()]
    seq = 0
    for i in range(40):
        seq += 1
        frames.append(_exec(["/bin/bash", "-c", f"echo {i}; echo e >&2"], seq))
        seq += 1
        frames.append(_exec(["sh", "-c", "echo $A$B", ], seq, env={"A": "x" * i, "B": "y"}, stdin="in" * i))
        seq += 1
        frames.append(_exec(["no-such-program"], seq, env={"C": "z"}))
    seq += 1
    frames.append(_exec(["python3", "-c", "print(6 * 7)"], seq, max_output=7))
    for i, req in enumerate(_FILE_REQUESTS * 3):  # the file tools, their successes and failures
        seq += 1
        frames.append(_file(req, seq, i))
    seq += 1
    frames.append(_frame(slotd_wire.encode_ping(seq)))
    run = rig.run(b"".join(frames))
    _clean(run)
    assert run.returncode == 0
    replies = run.replies()
    assert len(replies) == seq + 1  # the ready frame and one reply per request


_FILE_REQUESTS: list[dict[str, Any]] = [
    {"op": "write_file", "path": "d/e/f{i}.txt", "content": "caf\u00e9 one\nx\u0000 two {i}\n"},
    {"op": "write_file", "path": "d/e/f{i}.txt", "content": "AAEC", "encoding": "base64", "append": True},
    {"op": "read_file", "path": "d/e/f{i}.txt"},
    {"op": "read_file", "path": "/tmp/d/e/f{i}.txt", "offset": 3, "limit": 5},
    {"op": "edit_file", "path": "d/e/f0.txt", "old_string": "one", "new_string": "ONE{i}"},
    {"op": "edit_file", "path": "d/e/f{i}.txt", "old_string": "\u00e9", "new_string": "e", "replace_all": True},
    {"op": "edit_file", "path": "d/e/f{i}.txt", "old_string": "absent", "new_string": ""},
    {"op": "list_dir", "path": "d/e"}, {"op": "list_dir", "path": ""}, {"op": "stat", "path": "d/e/f{i}.txt"},
    {"op": "read_file", "path": "missing/x"}, {"op": "read_file", "path": "/etc/passwd"},
    {"op": "read_file", "path": "d"}, {"op": "read_file", "path": ""}, {"op": "stat", "path": "../x"},
    {"op": "write_file", "path": "d/e/f{i}.txt/under", "content": "x"},
]


def _file(req: dict[str, Any], seq: int, i: int) -> bytes:
    req = {k: v.replace("{i}", str(i)) if isinstance(v, str) else v for k, v in req.items()}
    if req["op"] in ("read_file", "write_file", "edit_file"):
        req["max_bytes"] = 1 << 20
    body = slotd_wire.encode(req, seq)
    assert body is not None, req
    return _frame(body)


@pytest.mark.parametrize("cap", [0, 1, 2, 3, 7, 100, 101, 4097])
def test_the_terminal_reads_its_log_within_any_cap(rig: Rig, cap: int) -> None:
    """The overflow of issue 37: a log part of exactly an odd cap was read whole into a buffer of
    2*(cap/2) bytes. Every size around the cap, at offsets before and past it."""
    for size in sorted({0, 1, max(cap - 1, 0), cap, cap + 1, 2 * cap + 3}):
        rig.log(bytes(range(256)) * (size // 256) + bytes(range(size % 256)))
        frames = [rig.config(warm=False), _terminal(1, cap), _terminal(2, cap, offset=size // 2),
                  _terminal(3, cap, offset=size + 5)]
        run = rig.run(b"".join(frames))
        _clean(run)
        replies = [slotd_wire.decode_terminal(__import__("json").loads(r)) for r in run.replies()[1:]]
        assert len(replies) == 3, run.stderr
        first = replies[0]["result"]
        assert first["bytes"] == size
        assert first["truncated"] == (size > 2 * (cap // 2 if cap // 2 > 1 else 1))


def _mutations(valid: bytes, rng: random.Random) -> Iterator[bytes]:
    body = valid[4:]
    yield valid[: rng.randrange(1, len(valid))]  # truncated: the input ends mid-frame
    for _ in range(6):  # flipped bytes inside the body, the length header kept
        b = bytearray(body)
        for _ in range(rng.randint(1, 4)):
            b[rng.randrange(len(b))] = rng.randrange(256)
        yield _frame(bytes(b))
    for _ in range(3):  # a field's length beyond the frame, or shrunk
        b = bytearray(body)
        at = rng.randrange(1, max(2, len(b) - 4))
        b[at:at + 4] = struct.pack(">I", rng.choice([0xFFFFFFFF, 0x7FFFFFFF, len(b), 0, 1]))
        yield _frame(bytes(b))
    yield _frame(body[: rng.randrange(1, len(body))])  # the body cut short, the header telling the truth
    yield _frame(body + os.urandom(rng.randint(1, 64)))  # trailing garbage


def _hostile_frames() -> list[bytes]:
    seq = _field(1)
    huge = _field(str(10 ** 30))
    return [
        struct.pack(">I", 65 << 20) + b"E",  # over the 64 MiB bound
        struct.pack(">I", 0xFFFFFFFF),
        struct.pack(">I", 0),  # an empty frame
        _frame(b"Z" + seq),  # an unknown kind
        _frame(b"E"),
        _frame(b"P"),
        _frame(b"U" + seq)[:-1],
        # exec: counts out of range, numbers no machine holds, NaN timeouts, no argv
        _frame(b"E" + seq + _field("nan") + _field(100) + _field(1000) + _field("") + _field(b"") + _field(0)
               + _field(1) + _field("true")),
        _frame(b"E" + seq + _field("1e308") + huge + huge + huge + _field(b"") + _field(0) + _field(1)
               + _field("true")),
        _frame(b"E" + seq + _field("1") + _field(-5) + _field(-1) + _field(-1) + _field(b"") + _field(-3)
               + _field(1) + _field("true")),
        _frame(b"E" + seq + _field("1") + _field(101) + _field(1000) + _field("") + _field(b"") + _field(0)
               + _field(0)),
        _frame(b"E" + seq + _field("1") + _field(101) + _field(1000) + _field("") + _field(b"") + _field(1 << 40)
               + _field(1) + _field("true")),
        _frame(b"E" + seq + _field("1") + _field(3) + _field(1000) + _field("") + _field(b"") + _field(0)
               + _field(1 << 20) + _field("true")),
        # terminal: key counts out of range, NaN waits, negative offsets and caps
        _frame(b"T" + seq + _field(b"") + _field("") + _field(-1)),
        _frame(b"T" + seq + _field(b"") + _field("") + _field(1 << 40)),
        _frame(b"T" + seq + _field(b"x") + _field("1") + _field(0) + _field("nan") + _field("nan") + _field("a")
               + _field("b") + _field(-100) + _field(-7)),
    ]


def test_the_frame_fuzzer_finds_nothing(rig: Rig) -> None:
    """Malformed, truncated and oversized frames after a few valid ones (each in a slotd of its own:
    a malformed request ends slotd, which must end cleanly: no report, no crash)."""
    rng = random.Random(37)
    rig.log(b"log line\n" * 50)
    valid = [_exec(["/bin/bash", "-c", "echo hi"], 2), _exec(["sh", "-c", "cat"], 2, stdin="abc", env={"K": "v"}),
             _terminal(2, 101), _frame(slotd_wire.encode_ping(2)), _frame(slotd_wire.encode_upgrade(2)),
             *(_file(req, 2, 0) for req in _FILE_REQUESTS[:10])]
    cases = _hostile_frames() + [m for v in valid for m in _mutations(v, rng)]
    warmup = _exec(["/bin/bash", "-c", "true"], 1)
    config = rig.config()
    for case in cases:
        run = rig.run(config + warmup + case + _exec(["/bin/bash", "-c", "echo after"], 3), timeout=60)
        _clean(run)
        assert run.returncode >= 0, (case[:64], run.returncode, run.stderr[-2000:])
    for cut in (1, 5, 17, len(config) // 2, len(config) - 1):  # the configuration itself, truncated or garbled
        _clean(rig.run(config[:cut]))
        garbled = bytearray(config)
        garbled[min(cut + 4, len(garbled) - 1)] ^= 0xFF
        _clean(rig.run(bytes(garbled)))


def config_frame(values: dict[str, Any]) -> bytes:
    """A configuration frame of ``values`` (one per declared field, in the declaration's order), built
    without the model's checks: a ``bytes`` value is the field's encoding as it stands."""
    parts: list[bytes] = []
    for f in P.SLOTD_CONFIG:
        value = values[f.name]
        if isinstance(value, bytes):
            parts.append(value)
        elif f.type == "strs":
            parts += [_field(len(value)), *map(_field, value)]
        elif f.type == "pairs":
            parts += [_field(len(value)), *(_field(x) for pair in value.items() for x in pair)]
        else:
            parts.append(_field(b"" if value is None else value))
    return _frame(b"".join(parts))


def hostile_configs(rig: Rig) -> list[tuple[str, bytes]]:
    """Configuration frames the declaration refuses, each one field off (a host and a slotd out of
    step, or bytes nobody meant): slotd must refuse each as malformed before it serves anything."""
    good = rig.config_model().wire_values()
    assert config_frame(good) == rig.config(), "the test's encoder drifted from the model's"
    huge = _field(str(10 ** 30))
    cases: list[tuple[str, dict[str, Any]]] = [
        ("mode", {"mode": "fork"}), ("mode", {"mode": ""}),
        ("limits", {"limits": {"cpu": "1"}}), ("limits", {"limits": {"nofile": "12x"}}),
        ("limits", {"limits": {"nofile": "-1"}}), ("limits", {"limits": {"nofile": "9" * 30}}),
        ("limits", {"limits": {"nofile": ""}}), ("limits", {"limits": huge}),
        ("limits", {"limits": {n: "1" for n in P.RLIMITS} | {"nproc ": "1"}}),
        ("env", {"env": {"A=B": "x"}}), ("env", {"env": {"": "x"}}), ("env", {"env": _field(-1)}),
        ("env", {"env": _field(P.MAX_ENV + 1)}), ("warm", {"warm": {"a": "x", "b": "y", "c": "z"}}),
        ("argv", {"argv": []}), ("argv", {"argv": huge}), ("run_dir", {"run_dir": ""}),
        ("tmux", {"tmux": []}), ("tmux", {"tmux": ["tmux"] * (P.MAX_CONFIG_TMUX + 1)}),
        ("files_workspace", {"files_workspace": ""}), ("argv", {"argv": [b"a\0b".decode()]}),
    ]
    out = [(what, config_frame({**good, **change})) for what, change in cases]
    out.append(("trailing", _frame(config_frame(good)[4:] + _field("extra"))))
    out.append(("short", _frame(config_frame(good)[4:-4])))
    return out


def test_slotd_refuses_every_malformed_configuration(rig: Rig) -> None:
    """The configuration frame under the same fuzzer as the requests: each hostile configuration is
    refused as malformed (exit 2, nothing served) with no sanitizer report; the random mutations of a
    valid one end cleanly whatever they do."""
    after = _exec(["/bin/bash", "-c", "echo after"], 1)
    for what, frame in hostile_configs(rig):
        run = rig.run(frame + after)
        _clean(run)
        assert run.returncode == 2 and b"malformed configuration" in run.stderr, (what, run)
        assert run.replies() == [], what
    rng = random.Random(3737)
    config = rig.config()
    for case in _mutations(config, rng):
        run = rig.run(case + after)
        _clean(run)
        assert run.returncode >= 0, (case[:64], run.returncode, run.stderr[-2000:])


# -- the supervisor equality cases, on a host whose slots run the sanitizer build ----------------------

@pytest.fixture(scope="module")
def sanitized_host(sanitized: Path) -> Iterator[RunningHost]:
    data = Path(f"/tmp/atropos-test-{os.getpid()}-{secrets.token_hex(3)}")  # slot uids traverse to it
    saved = os.environ.get("ATROPOS_SLOTD")
    os.environ["ATROPOS_SLOTD"] = str(sanitized)  # the host installs it as its slotd (start_host passes os.environ)
    try:
        running = start_host(data, slots=2, extra=["--native-supervisor", "always", "--image-store",
                                                   str(IMAGE_STORE)])
    finally:
        if saved is None:
            os.environ.pop("ATROPOS_SLOTD", None)
        else:
            os.environ["ATROPOS_SLOTD"] = saved
    yield running
    stop_host(running)


STARTED = "cut -d' ' -f22 /proc/2/stat; tr '\\0' ' ' < /proc/2/cmdline"


async def _sanitized_reply(host: RunningHost, tool: str, args: dict[str, Any]) -> dict[str, Any]:
    async with leased_slot(host) as slot:
        before = (await slot.sh(STARTED))["stdout"]
        assert "/run/atropos/slotd " in before, before
        result = await slot.call(tool, **args)
        assert result.ok, result.error
        # the same slotd still serves (a sanitizer report would have ended it, and the host started another)
        assert (await slot.sh(STARTED))["stdout"] == before
        assert result.result is not None
        reply = dict(result.result)
        reply.pop("duration_ms", None)
        return reply


@pytest.mark.parametrize(("tool", "args"), [c for c in CASES if "workdir" not in c[1]],
                         ids=[f"{t}-{i}" for i, (t, a) in enumerate(CASES) if "workdir" not in a])
async def test_the_sanitizer_build_answers_the_equality_cases(sanitized_host: RunningHost, host: RunningHost,
                                                              tool: str, args: dict[str, Any]) -> None:
    ours = await _sanitized_reply(sanitized_host, tool, args)
    reference = await _sanitized_reply(host, tool, args)  # the same calls (pids included) on the real build
    assert ours == reference


async def test_the_sanitizer_build_answers_the_file_tools_alike(sanitized_host: RunningHost, host: RunningHost) -> None:
    """The file tools' session of tests/test_slotd.py (every reply, then the workspace) on the sanitizer
    build and on the real one; the same slotd serves throughout (a report would have ended it)."""
    ours, before, after = await _file_session(sanitized_host)
    reference, _, _ = await _file_session(host)
    assert ours == reference
    assert "/run/atropos/slotd " in before and after == before
