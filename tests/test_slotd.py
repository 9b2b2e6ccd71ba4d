"""slotd, the compiled supervisor (docs/native-supervisor.md): a slot serves its commands without
starting Python, and answers every call exactly as the Python supervisor does.

The reference is a host started with ``--native-supervisor never`` (the Python supervisor serves every
call, as before slotd): each command runs in a slot of both hosts and the replies must be equal but
for the duration. The Python supervisor's own fidelity to a fresh ``bash -c`` / ``python3 -c`` is
held by tests/test_warm_interpreters.py and tests/test_slot_signals.py, which run on slotd now.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import secrets
import shutil
import struct
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from atropos.sandbox.host import slotd_build
from atropos.sandbox.host.isolation import slotd_config, slotd_wire
from tests.conftest import IMAGE_STORE, RunningHost, leased_slot, start_host, stop_host

SLOTD_ARGV = re.compile(r"/run/atropos/slotd \d+ \d+ \d+")  # its channel's descriptors
SUPERVISOR = "cut -d' ' -f22 /proc/2/stat; tr '\\0' ' ' < /proc/2/cmdline"  # its start time and command
PROCS = ("for p in /proc/[0-9]*; do"
         " printf '%s %s\\n' \"${p#/proc/}\" \"$(tr '\\0\\n' '  ' < $p/cmdline | cut -c1-200)\"; done")


@pytest.fixture(scope="module")
def python_host() -> Iterator[RunningHost]:
    data = Path(f"/tmp/atropos-test-{os.getpid()}-{secrets.token_hex(3)}")  # slot uids traverse to it
    running = start_host(data, slots=2, extra=["--native-supervisor", "never", "--image-store", str(IMAGE_STORE)])
    yield running
    stop_host(running)


def _processes(stdout: str) -> dict[int, str]:
    out = {}
    for line in stdout.splitlines():
        pid, _, cmd = line.partition(" ")
        out[int(pid)] = cmd
    return out


async def test_a_slot_runs_commands_and_its_terminal_without_python(host: RunningHost) -> None:
    async with leased_slot(host) as slot:
        for _ in range(3):  # the first call and the warm interpreters after it
            procs = _processes((await slot.sh(PROCS))["stdout"])
        # its argv holds nothing but its channel's descriptors: the configuration came on the channel
        assert SLOTD_ARGV.fullmatch(procs[2].strip()), procs[2]
        assert not [cmd for cmd in procs.values() if "python" in cmd], procs
        py = await slot.ok("python", code="print(6 * 7)")
        assert py["stdout"] == "42\n"
        procs = _processes((await slot.sh(PROCS))["stdout"])
        assert SLOTD_ARGV.fullmatch(procs[2].strip()), procs[2]  # the python tool is a command too
        term = await slot.ok("terminal", input="echo $((6 * 7))", wait_ms=5000)
        assert "42" in term["output"]
        procs = _processes((await slot.sh(PROCS))["stdout"])
        assert SLOTD_ARGV.fullmatch(procs[2].strip()), procs[2]  # and so is the terminal (tmux clients)


async def test_file_tools_are_served_by_slotd_itself(host: RunningHost) -> None:
    """No hand-over on a file tool (issue 37, item 4): slotd does their system calls itself, so
    nothing of the slot ends and no Python starts; an archive still hands the slot over."""
    async with leased_slot(host) as slot:
        before = (await slot.sh("echo kept > note.txt; " + SUPERVISOR))["stdout"]
        assert (await slot.ok("read_file", path="note.txt"))["content"] == "kept\n"
        await slot.ok("write_file", path="b.txt", content="x")
        await slot.ok("edit_file", path="b.txt", old_string="x", new_string="y")
        await slot.ok("list_dir", path=".")
        await slot.ok("stat", path="b.txt")
        assert (await slot.sh(SUPERVISOR))["stdout"] == before  # the same slotd (its start time and argv)
        procs = _processes((await slot.sh(PROCS))["stdout"])
        assert SLOTD_ARGV.fullmatch(procs[2].strip()), procs
        assert not [cmd for cmd in procs.values() if "python" in cmd], procs
        assert (await slot.sh("cat note.txt b.txt"))["stdout"] == "kept\ny"
        await slot.ok("archive", path=".")
        procs = _processes((await slot.sh(PROCS))["stdout"])
        assert "supervisor.py" in procs[2], procs  # slotd exec'd it in its own place: same pid
        await slot.ok("write_file", path="c.txt", content="z")
        assert (await slot.sh("cat c.txt"))["stdout"] == "z"


MEM_CAP = 256 << 20
HOLDER = """import os, time
held = [b"x" * int(open("size").read())]
i = 0
while True:
    if not os.path.exists("grown") and os.path.exists("more"):
        held.append(b"y" * int(open("more").read()))
        open("grown", "w").close()
    open("beat.tmp", "w").write(str(i))
    i += 1
    os.rename("beat.tmp", "beat")
    time.sleep(0.05)
"""


@pytest.fixture(scope="module")
def capped_host() -> Iterator[RunningHost]:
    data = Path(f"/tmp/atropos-test-{os.getpid()}-{secrets.token_hex(3)}")  # slot uids traverse to it
    running = start_host(data, slots=1, extra=["--native-supervisor", "always", "--slot-memory-bytes", str(MEM_CAP),
                                               "--image-store", str(IMAGE_STORE)])
    yield running
    stop_host(running)


def _slot_memory(host: RunningHost) -> int:
    """What the one slot of ``host`` holds now: its memory cgroup's usage (v1 or v2), read on the host."""
    from atropos.sandbox.contract.cgroupfs import own_cgroups

    own = own_cgroups(str(host.proc.pid))
    v1 = Path("/sys/fs/cgroup/memory") / own.get("memory", "/").lstrip("/") / f"atropos-{host.proc.pid}"
    v2 = Path("/sys/fs/cgroup") / own.get("", "/").lstrip("/") / f"atropos-{host.proc.pid}"
    for found in [*v1.glob("slot-*/memory.usage_in_bytes"), *v2.glob("slot-*/memory.current")]:
        return int(found.read_text())
    raise AssertionError(f"no slot memory cgroup under {v1} or {v2}")


@pytest.mark.skipif(not Path("/sys/fs/cgroup/memory/memory.limit_in_bytes").exists()
                    and not Path("/sys/fs/cgroup/cgroup.controllers").exists(),
                    reason="no cgroup hierarchy mounted at /sys/fs/cgroup: no memory cap per slot")
async def test_a_program_near_its_memory_cap_survives_the_first_file_calls(capped_host: RunningHost) -> None:
    """The file tools start nothing in the slot (before, the first one started the Python supervisor
    inside the slot's memory cap, ~6 MiB more, and the kernel's OOM killer took the slot's largest
    process): a program in the slot's terminal (a call's own processes end with the call) grown to
    within 3 MiB of the slot's cap, measured on the host, runs on through every file tool."""
    async with leased_slot(capped_host) as slot:
        await slot.sh(f"rm -f more grown beat; printf '%s' '{HOLDER}' > holder.py; echo {MEM_CAP - (32 << 20)} > size")
        await slot.ok("terminal", input="python3 holder.py", wait_ms=500)
        started = await slot.sh("for i in $(seq 300); do [ -e beat ] && break; sleep 0.1; done; cat beat")
        assert started["stdout"].isdigit(), started
        await slot.sh(f"echo {MEM_CAP - _slot_memory(capped_host) - (3 << 20)} > more;"
                      " for i in $(seq 300); do [ -e grown ] && break; sleep 0.1; done")
        assert _slot_memory(capped_host) > MEM_CAP - (5 << 20)  # near the cap: the test means something
        beat = (await slot.ok("read_file", path="beat"))["content"]  # file calls only from here on
        await slot.ok("write_file", path="f.txt", content="data")
        await slot.ok("edit_file", path="f.txt", old_string="data", new_string="more")
        await slot.ok("list_dir", path=".")
        await slot.ok("stat", path="f.txt")
        await asyncio.sleep(1)
        assert int((await slot.ok("read_file", path="beat"))["content"]) > int(beat)  # still beating


async def test_slotd_is_not_readable_by_the_slot(host: RunningHost) -> None:
    """Like the Python supervisor: non-dumpable, so the slot's code cannot read its memory, its
    environment or its descriptors (the protocol pipes carry the host's requests)."""
    async with leased_slot(host) as slot:
        r = await slot.sh("for f in environ mem fd/0 fd/3; do"
                          " if cat /proc/2/$f >/dev/null 2>&1; then echo $f; fi; done;"
                          " ls /proc/2/fd 2>&1 >/dev/null | head -1; cat /proc/2/cmdline | tr '\\0' ' '")
        assert r["stdout"].startswith("ls: cannot open directory '/proc/2/fd': Permission denied\n"), r
        assert SLOTD_ARGV.fullmatch(r["stdout"].splitlines()[-1].strip()), r


# What supervisor.py and slotd must answer alike: exit codes, signals, both streams, truncation,
# undecodable bytes, stdin, the environment and start-up state a command finds (signals, limits,
# descriptors), timeouts, background children, the python tool.
CASES: list[tuple[str, dict[str, Any]]] = [
    ("bash", {"command": "echo out; echo err >&2; exit 3"}),
    ("bash", {"command": "kill -TERM $$"}),
    ("bash", {"command": "exec sleep 30 & kill -9 $!; wait $!; echo $?"}),
    ("bash", {"command": "head -c 300000 /dev/zero | tr '\\0' a; echo; seq 1 20000 >&2"}),
    ("bash", {"command": "printf 'ok \\xff\\xfe \\xe2\\x82 \\xf0\\x9f\\x98\\x80 end'"}),
    ("bash", {"command": "cat; echo; wc -c", "stdin": "line one\nline two \u00e9"}),
    ("bash", {"command": "echo \"$PWD|${SHLVL-unset}|$HOME|$PATH\"; env | sort | grep -v '^_='"}),
    ("bash", {"command": "grep -E '^(SigIgn|SigBlk|SigCgt|NoNewPrivs|Seccomp)' /proc/self/status; ulimit -a"}),
    ("bash", {"command": "ls -l /proc/self/fd | awk 'NR > 1 {print $9, $10, $11}' | sed 's/:\\[[0-9]*\\]//';"
                         " readlink /proc/self/fd/0"}),
    ("bash", {"command": "sleep 30 & echo started"}),
    ("bash", {"command": "set -x; true; echo $((1 + 2))"}),
    ("bash", {"command": "echo one; exit"}),
    ("bash", {"command": "(("}),
    ("bash", {"command": "ps -o pid=,ppid=,pgid=,sid= -p $$ | awk '{print ($1 == $3 && $1 == $4), $2}'"}),
    ("bash", {"command": "pwd; cd /tmp && pwd", "workdir": "."}),
    ("python", {"code": "import os, sys\nprint(sys.argv, os.getcwd(), sys.flags.isolated)\nsys.exit(4)"}),
    ("python", {"code": "raise ValueError('boom')"}),
    ("python", {"code": "import sys; sys.stdout.buffer.write(bytes(range(256)))"}),
]


async def _reply(host: RunningHost, tool: str, args: dict[str, Any], timeout_s: float | None = None) -> dict[str, Any]:
    async with leased_slot(host) as slot:
        await slot.sh("true")  # the call under test finds the slot as an agent's later calls do (warm)
        await asyncio.sleep(0.2)
        result = await slot.call(tool, timeout_s=timeout_s, **args)
        assert result.ok, result.error
        assert result.result is not None
        reply = dict(result.result)
        reply.pop("duration_ms", None)
        return reply


@pytest.mark.parametrize(("tool", "args"), CASES, ids=[f"{t}-{i}" for i, (t, _) in enumerate(CASES)])
async def test_slotd_answers_as_the_python_supervisor(host: RunningHost, python_host: RunningHost, tool: str,
                                                      args: dict[str, Any]) -> None:
    ours = await _reply(host, tool, args)
    reference = await _reply(python_host, tool, args)
    assert ours == reference


# The file tools on both supervisors, one lease, in order: every reply (result or error) equal,
# then the workspace they leave. Paths through symlinks in and out, escapes, NUL, non-UTF-8
# names and contents, FIFOs, directories, edits (unique, ambiguous, replace_all, multibyte, through a
# symlink, not text), appends, base64, parents made, listing order and limits, stat fields. (A name
# that is not UTF-8 is left out: list_dir's reply then fails on the host with either supervisor, its
# JSON cannot carry the name; a bug of its own.)
FILE_SETUP = ("mkdir -p d/sub; printf 'hello\\nworld\\n' > a.txt; printf 'x\\001y' > bin; printf '\\377\\376' > latin;"
              " ln -s /etc/passwd out; ln -s a.txt link; ln -s ../.. up; mkfifo fifo; printf 'aaa' > three;"
              " printf 'caf\\303\\251 caf\\303\\251!' > multi; touch \"$(printf 'n\\303\\251')\" nz;"
              " chmod 640 a.txt; touch -h -d @1700000000.123456789 a.txt d link out")
FILE_CALLS: list[tuple[str, dict[str, Any]]] = [
    ("read_file", {"path": "a.txt"}), ("read_file", {"path": "a.txt", "offset": 2, "limit": 3}),
    ("read_file", {"path": "a.txt", "encoding": "base64"}), ("read_file", {"path": "bin"}),
    ("read_file", {"path": "latin"}), ("read_file", {"path": "out"}), ("read_file", {"path": "/etc/passwd"}),
    ("read_file", {"path": "/workspace//a.txt"}), ("read_file", {"path": "d"}), ("read_file", {"path": "fifo"}),
    ("read_file", {"path": "missing"}), ("read_file", {"path": "up/x"}), ("read_file", {"path": "a.txt/x"}),
    ("read_file", {"path": "link"}), ("read_file", {"path": "/workspace"}),
    ("read_file", {"path": "a.txt", "offset": 99}),
    ("stat", {"path": "a.txt"}), ("stat", {"path": "link"}), ("stat", {"path": "out"}), ("stat", {"path": "d"}),
    ("stat", {"path": "missing"}), ("stat", {"path": "/tmp"}), ("stat", {"path": "."}),
    ("list_dir", {"path": "."}), ("list_dir", {"path": "d"}), ("list_dir", {"path": ".", "max_entries": 3}),
    ("list_dir", {"path": "a.txt"}), ("list_dir", {"path": "missing"}), ("list_dir", {"path": "up"}),
    ("write_file", {"path": "new/deep/x.txt", "content": "one\n"}),
    ("write_file", {"path": "new/deep/x.txt", "content": "two\n", "append": True}),
    ("write_file", {"path": "b64", "content": "AAEC/w==", "encoding": "base64"}),
    ("write_file", {"path": "nul", "content": "a\u0000b\u00e9"}),
    ("write_file", {"path": "link", "content": "through the link\n"}),
    ("write_file", {"path": "out", "content": "x"}), ("write_file", {"path": "d", "content": "x"}),
    ("write_file", {"path": "fifo", "content": "x"}), ("write_file", {"path": "a.txt/x/y", "content": "x"}),
    ("write_file", {"path": "up/z", "content": "x"}), ("write_file", {"path": "./d/./sub//f", "content": "x"}),
    ("edit_file", {"path": "a.txt", "old_string": "through", "new_string": "via"}),
    ("edit_file", {"path": "three", "old_string": "a", "new_string": "b"}),
    ("edit_file", {"path": "three", "old_string": "a", "new_string": "bc", "replace_all": True}),
    ("edit_file", {"path": "multi", "old_string": "\u00e9!", "new_string": "E"}),
    ("edit_file", {"path": "multi", "old_string": "caf", "new_string": "", "replace_all": True}),
    ("edit_file", {"path": "latin", "old_string": "x", "new_string": "y"}),
    ("edit_file", {"path": "a.txt", "old_string": "nowhere", "new_string": "y"}),
    ("edit_file", {"path": "link", "old_string": "via", "new_string": "by"}),
    ("edit_file", {"path": "missing", "old_string": "a", "new_string": "b"}),
    ("edit_file", {"path": "out", "old_string": "a", "new_string": "b"}),
    ("edit_file", {"path": "nul", "old_string": "\u0000", "new_string": "-"}),
    ("read_file", {"path": "nul"}), ("read_file", {"path": "three"}), ("read_file", {"path": "multi"}),
    ("read_file", {"path": ""}), ("stat", {"path": "new/deep/x.txt"}),
]


async def _file_session(host: RunningHost) -> tuple[list[Any], str, str]:
    """Every reply of FILE_CALLS then the workspace they left; and the supervisor before and after."""
    async with leased_slot(host) as slot:
        await slot.sh(FILE_SETUP)
        before = (await slot.sh(SUPERVISOR))["stdout"]
        replies: list[Any] = []
        for tool, args in FILE_CALLS:
            r = await slot.call(tool, **args)
            out = dict(r.result or {})
            if tool == "stat" and args["path"] in ("new/deep/x.txt", "."):
                out.pop("mtime", None)  # made during the session
            replies.append((tool, args, r.ok, out, r.error and (r.error.code, r.error.message)))
        replies.append((await slot.sh("find . -printf '%p %y %s %m\\n' | sort; cat a.txt three multi new/deep/x.txt;"
                                      " od -c nul b64"))["stdout"])
        return replies, before, (await slot.sh(SUPERVISOR))["stdout"]


async def test_the_file_tools_answer_as_the_python_supervisor(host: RunningHost, python_host: RunningHost) -> None:
    ours, before, after = await _file_session(host)
    reference, _, _ = await _file_session(python_host)
    for mine, theirs in zip(ours, reference, strict=True):
        assert mine == theirs
    assert SLOTD_ARGV.search(before) and after == before  # slotd answered them all, no hand-over


# Names that are not UTF-8 (a name is bytes; a reply is JSON): list_dir shows each byte that is not
# UTF-8 as \\xNN and gives the exact bytes in name_base64; a path a result reports (the kernel's, through
# a symlink into such a directory) is shown the same way; on both supervisors alike.
BYTES_SETUP = ("mkdir \"$(printf 'd\\377')\"; printf 'x' > \"$(printf 'n\\377\\376')\";"
               " printf 'y' > \"$(printf 'ok\\303\\251')\";"
               " printf 'z' > \"$(printf 'd\\377/f')\"; ln -s \"$(printf 'd\\377')\" into")
BYTES_CALLS: list[tuple[str, dict[str, Any]]] = [
    ("list_dir", {"path": "."}), ("list_dir", {"path": "into"}), ("list_dir", {"path": "into/"}),
    ("stat", {"path": "into/f"}), ("read_file", {"path": "into/f"}),
    ("write_file", {"path": "into/g", "content": "w"}), ("edit_file", {"path": "into/f", "old_string": "z",
                                                                     "new_string": "Z"}),
    ("list_dir", {"path": "into", "max_entries": 1}),
]


async def _bytes_session(host: RunningHost) -> list[Any]:
    async with leased_slot(host) as slot:
        await slot.sh(BYTES_SETUP)
        replies: list[Any] = []
        for tool, args in BYTES_CALLS:
            r = await slot.call(tool, **args)
            replies.append((tool, args, r.ok, r.result, r.error and (r.error.code, r.error.message)))
        replies.append((await slot.sh("od -c into/f into/g"))["stdout"])
        return replies


async def test_names_that_are_not_utf8_are_answered_alike(host: RunningHost, python_host: RunningHost) -> None:
    ours = await _bytes_session(host)
    assert all(reply[2] for reply in ours[:-1]), ours  # every call answered (they were HTTP 500s)
    listing = ours[0][3]
    assert listing["entries"] == [
        {"name": "d\\xff", "type": "dir", "size": listing["entries"][0]["size"], "name_base64": "ZP8="},
        {"name": "into", "type": "symlink", "size": 2},
        {"name": "n\\xff\\xfe", "type": "file", "size": 1, "name_base64": "bv/+"},
        {"name": "ok\u00e9", "type": "file", "size": 1},  # UTF-8: as it is, no name_base64
    ]
    assert ours[1][3]["path"] == "/workspace/d\\xff" and ours[3][3]["path"] == "/workspace/d\\xff/f"
    assert [e["name"] for e in ours[1][3]["entries"]] == ["f"]
    assert ours[4][3]["content"] == "z" and ours[5][3]["path"] == "/workspace/d\\xff/g"
    assert "Z" in ours[-1] and "w" in ours[-1]
    reference = await _bytes_session(python_host)
    for mine, theirs in zip(ours, reference, strict=True):
        if mine[0] == "stat":
            mine[3].pop("mtime"), theirs[3].pop("mtime")
        assert mine == theirs


async def test_a_timeout_is_answered_alike(host: RunningHost, python_host: RunningHost) -> None:
    args = {"command": "echo before; sleep 30; echo after"}
    ours = await _reply(host, "bash", args, timeout_s=1.0)
    reference = await _reply(python_host, "bash", args, timeout_s=1.0)
    assert ours["timed_out"] is True
    assert ours == reference


async def _terminal_session(host: RunningHost) -> list[dict[str, Any]]:
    async with leased_slot(host) as slot:
        replies = []
        for args in ({"input": "printf 'plain \\033[31mred\\033[0m\\n'; echo $((6 * 7))", "wait_ms": 5000},
                     {"input": "sleep 30", "wait_ms": 300}, {"keys": ["C-c"], "wait_ms": 2000},
                     {"input": "seq 1 20000", "wait_ms": 10000, "enter": True}):
            replies.append(await slot.ok("terminal", **args))
        return replies


async def test_the_terminal_answers_as_with_the_python_supervisor(host: RunningHost,
                                                                  python_host: RunningHost) -> None:
    ours, reference = await _terminal_session(host), await _terminal_session(python_host)
    assert "plain red\n42\n" in ours[0]["output"]
    assert ours[3]["truncated"] is True  # 20000 lines: over the output cap, head and tail kept

    def seen(replies: list[dict[str, Any]]) -> list[tuple[str, bool, int]]:
        # The shell's first prompt reaches the log before or after tmux's pipe-pane starts, with either
        # supervisor (a race of tmux's own): the first reply is compared without it, and offsets (the
        # log's length so far) as what each call added.
        first = replies[0]["output"].removeprefix("[sandbox ~]$ ")
        return [(first, replies[0]["truncated"], -1)] + [(r["output"], r["truncated"], r["bytes"])
                                                         for r in replies[1:]]

    assert seen(ours) == seen(reference)


# -- slotd on its own: the protocol, in a PID namespace of its own (bubblewrap) ----------------------

def _frame(body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + body


def _read(proc: Channel) -> dict[str, Any]:
    import json

    assert proc.stdout is not None
    (size,) = struct.unpack(">I", proc.stdout.read(4))
    return json.loads(proc.stdout.read(size))


class Channel:
    """slotd's channel as the host has it (host/isolation/sandbox_process.py): requests, replies and
    stderr on descriptors of their own, their numbers slotd's last three arguments."""

    def __init__(self, argv: list[str]) -> None:
        req_r, req_w = os.pipe()
        rep_r, rep_w = os.pipe()
        err_r, err_w = os.pipe()
        self.proc = subprocess.Popen([*argv, str(req_r), str(rep_w), str(err_w)], pass_fds=(req_r, rep_w, err_w),
                                     stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, env={})
        for fd in (req_r, rep_w, err_w):
            os.close(fd)
        self.stdin = os.fdopen(req_w, "wb")
        self.stdout = os.fdopen(rep_r, "rb")
        self.stderr = os.fdopen(err_r, "rb")

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait()
        for f in (self.stdin, self.stdout, self.stderr):
            with contextlib.suppress(OSError):
                f.close()


@pytest.fixture
def slotd(tmp_path: Path) -> Iterator[Channel]:
    binary = slotd_build.build()
    if binary is None:
        pytest.skip("slotd cannot be built here: no C compiler")
    ws = tmp_path / "ws"
    ws.mkdir()
    bwrap = shutil.which("bwrap")
    assert bwrap, "bubblewrap is a requirement of the project (scripts/setup.sh installs it)"
    proc = Channel([bwrap, "--unshare-all", "--die-with-parent", "--ro-bind", "/", "/", "--proc", "/proc", "--dev",
                    "/dev", "--bind", str(ws), "/tmp", str(binary)])
    cfg = slotd_config.SlotdConfig(env={"PATH": "/usr/bin:/bin"}, workspace="/tmp", term_dir="/tmp",
                                   files_workspace="/tmp", argv=[sys.executable, "-c", "pass"]).frame()
    proc.stdin.write(cfg)
    proc.stdin.flush()
    yield proc
    proc.close()


def _exec(proc: Channel, payload: dict[str, Any], seq: int = 1) -> dict[str, Any]:
    assert proc.stdin is not None
    body = slotd_wire.encode_exec({"op": "exec", **payload}, seq)
    assert body is not None
    proc.stdin.write(_frame(body))
    proc.stdin.flush()
    return slotd_wire.decode_exec(_read(proc), {"op": "exec", **payload})


def test_slotd_reports_a_program_it_cannot_start_as_the_python_supervisor_does(slotd: Channel) -> None:
    assert _read(slotd)["result"]["ready"] is True
    r = _exec(slotd, {"argv": ["no-such-program-here"], "timeout": 5})
    assert r["result"]["exit_code"] == 127
    assert r["result"]["stderr"] == "cannot start no-such-program-here: No such file or directory\n"
    r = _exec(slotd, {"argv": ["/tmp"], "timeout": 5}, seq=2)
    assert r["result"]["stderr"] == "cannot start /tmp: Permission denied\n"
    assert r["seq"] == 2
    r = _exec(slotd, {"argv": ["sh", "-c", "echo $A-$B; exit 5"], "env": {"A": "x", "B": "y"}, "timeout": 5}, seq=3)
    assert (r["result"]["stdout"], r["result"]["exit_code"]) == ("x-y\n", 5)


def test_slotd_keeps_only_the_head_and_tail_of_a_flood(slotd: Channel) -> None:
    _read(slotd)
    r = _exec(slotd, {"argv": ["sh", "-c", "seq 1 100000"], "timeout": 10, "max_output": 100})
    out = r["result"]
    assert out["stdout_truncated"] is True
    assert out["stdout"].startswith("1\n2\n3\n")
    assert out["stdout"].endswith("99999\n100000\n")
    assert out["stdout_bytes"] == len("".join(f"{i}\n" for i in range(1, 100001)))
    r = _exec(slotd, {"argv": ["sh", "-c", "yes"], "timeout": 10, "max_output": 100, "hard_output": 1 << 20}, seq=2)
    assert r["result"]["output_limited"] is True
    assert r["result"]["signal"] == 9


def test_slotd_refuses_to_run_outside_a_pid_namespace_of_its_own() -> None:
    """Its sweeps are kill(-1): run by mistake on a host, it would kill every process of its user."""
    binary = slotd_build.build()
    if binary is None:
        pytest.skip("slotd cannot be built here: no C compiler")
    out = subprocess.run([str(binary)], input=b"", capture_output=True, timeout=10)
    assert out.returncode == 2
    assert b"refusing to run" in out.stderr


def test_without_a_compiler_the_python_supervisor_serves(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))  # no cc, no gcc
    monkeypatch.delenv("ATROPOS_SLOTD", raising=False)
    monkeypatch.setenv("ATROPOS_SANDBOX_CACHE", str(tmp_path / "cache"))
    lib = tmp_path / "lib"
    lib.mkdir()
    (lib / slotd_build.SLOTD).write_bytes(b"stale")
    assert slotd_build.install(lib) is None
    assert not (lib / slotd_build.SLOTD).exists()  # a stale binary never serves


def test_requests_slotd_does_not_serve_go_to_the_python_supervisor() -> None:
    assert slotd_wire.encode_exec({"op": "exec", "argv": ["/bin/bash", "-c", "true"]}, 1) is not None
    for payload in ({"op": "exec", "argv": ["/bin/bash", "-c", "true"], "cwd": "sub"},
                    {"op": "exec", "argv": ["/bin/bash", "-c", "a\0b"]},
                    {"op": "exec", "argv": ["x"], "env": {"A=B": "1"}},
                    {"op": "exec", "argv": ["x"], "stdin": "\udc80"},
                    {"op": "read_file", "path": "x"}):
        assert slotd_wire.encode_exec(payload, 1) is None, payload
    # the file tools: slotd's, but for text it cannot take as the Python supervisor would
    assert slotd_wire.encode({"op": "read_file", "path": "x", "max_bytes": 10}, 1) is not None
    for payload in ({"op": "read_file", "path": "\udc80", "max_bytes": 10},
                    {"op": "edit_file", "path": "x", "old_string": "\ud800", "new_string": "", "max_bytes": 10},
                    {"op": "write_file", "path": "x", "content": "toolong", "max_bytes": 3},
                    {"op": "archive", "path": ".", "max_bytes": 10}):
        assert slotd_wire.encode(payload, 1) is None, payload
    assert os.path.basename(slotd_build.SLOTD) == "slotd"


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a noexec tmpfs needs root")
def test_a_lib_dir_on_a_noexec_mount_gets_the_prebuilt_slotd_bound_in(monkeypatch: pytest.MonkeyPatch) -> None:
    """A container's tmpfs is noexec unless told (Docker's default; a Nomad job's tmpfs mounts cannot
    say it): nothing in the lib dir could run there, so the host binds the image's prebuilt slotd
    (``ATROPOS_SLOTD``) into its sandboxes from its own mount, and without one keeps the Python
    supervisor. End to end: a host whose data dir is a noexec tmpfs."""
    built = slotd_build.build()
    if built is None:
        pytest.skip("slotd cannot be built here: no C compiler")
    base = Path(f"/tmp/atropos-noexec-{os.getpid()}-{secrets.token_hex(3)}")
    data, bindir = base / "data", base / "bin"
    bindir.mkdir(parents=True)
    data.mkdir()
    os.chmod(base, 0o755)
    os.chmod(bindir, 0o755)
    shutil.copyfile(built, bindir / "slotd")
    os.chmod(bindir / "slotd", 0o755)
    subprocess.run(["mount", "-t", "tmpfs", "-o", "noexec,size=256m", "tmpfs", str(data)], check=True)
    try:
        lib = data / "probe-lib"
        lib.mkdir()
        monkeypatch.delenv("ATROPOS_SLOTD", raising=False)
        assert slotd_build.install(lib) is None  # no prebuilt binary: the Python supervisor
        monkeypatch.setenv("ATROPOS_SLOTD", str(bindir / "slotd"))
        assert slotd_build.install(lib) == bindir / "slotd"
        assert (lib / slotd_build.SLOTD).stat().st_size == 0  # the placeholder the binary is bound onto
        running = start_host(data / "host", slots=1)
        try:
            async def probe() -> None:
                async with leased_slot(running) as slot:
                    await slot.sh("true")
                    out = await slot.sh("tr '\\0' ' ' < /proc/2/cmdline; echo; echo $((6 * 7))")
                    first, second = out["stdout"].splitlines()
                    assert SLOTD_ARGV.fullmatch(first.strip()) and second == "42", out
                    assert (await slot.ok("write_file", path="a.txt", content="x"))  # the Python supervisor now
                    assert (await slot.sh("cat a.txt"))["stdout"] == "x"

            asyncio.run(probe())
        finally:
            stop_host(running)
    finally:
        subprocess.run(["umount", "-l", str(data)], check=True)
        shutil.rmtree(base, ignore_errors=True)


def _supervisor_of(procs: dict[int, str]) -> str:
    return "slotd" if SLOTD_ARGV.fullmatch(procs[2].strip()) else "python" if "supervisor.py" in procs[2] else procs[2]


async def test_a_host_whose_leases_need_the_python_supervisor_starts_it_before_their_calls() -> None:
    """Where most leases need the Python supervisor (an archive: slotd serves the file tools, not
    that), each would pay its start on that call's path (slotd hands over): the host then starts new
    sandboxes with the Python supervisor, prestarted off the calls' path as before slotd; where most
    leases run what slotd serves again (commands, file tools), with slotd (host/supervisor_choice.py)."""
    data = Path(f"/tmp/atropos-test-{os.getpid()}-{secrets.token_hex(3)}")
    running = start_host(data, slots=1)
    try:
        async def lease_once(archive: bool) -> str:
            async with leased_slot(running) as slot:
                supervisor = _supervisor_of(_processes((await slot.sh(PROCS))["stdout"]))
                await slot.ok("write_file", path="a.txt", content="x")  # slotd's: counts as not needing Python
                if archive:
                    await slot.ok("archive", path=".")
                return supervisor

        assert await lease_once(True) == "slotd"
        seen = [await lease_once(True) for _ in range(3)]
        assert seen[-1] == "python", seen  # most leases so far needed it
        assert (await lease_once(False)) == "python"
        seen = [await lease_once(False) for _ in range(6)]
        assert seen[-1] == "slotd", seen  # most recent leases ran commands only
    finally:
        stop_host(running)
