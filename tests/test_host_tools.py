"""Every slot tool as a user relies on it, through a real host (real bubblewrap) over HTTP.

Timings are never asserted in absolute terms except where the order of events is the point
(batch results stream in completion order).
"""

from __future__ import annotations

import base64
import hashlib
import io
import os
import secrets
import shutil
import tarfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import LeasedSlot, RunningHost, slot_path, start_host, stop_host

from atropos.sandbox.contract.protocol import CallResult, ToolCall

KIB = 1024
MAX_OUTPUT = 64 * KIB  # HostConfig.max_output_bytes default: kept per stream (head + tail)
MAX_READ = 8 << 20  # HostConfig.max_read_bytes default


def _error(result: CallResult) -> tuple[str, str]:
    assert not result.ok, result
    assert result.error is not None
    return result.error.code, result.error.message


# -- bash ---------------------------------------------------------------------------------------


async def test_bash_exit_codes_and_signal(slot: LeasedSlot) -> None:
    assert (await slot.sh("true"))["exit_code"] == 0
    assert (await slot.sh("exit 3"))["exit_code"] == 3
    assert (await slot.sh("false"))["exit_code"] == 1
    killed = await slot.sh("kill -9 $$")
    assert killed["exit_code"] is None
    assert killed["signal"] == 9
    assert killed["timed_out"] is False


async def test_bash_stdout_and_stderr_are_separate(slot: LeasedSlot) -> None:
    out = await slot.sh("echo to-out; echo to-err >&2; echo more-out")
    assert out["stdout"] == "to-out\nmore-out\n"
    assert out["stderr"] == "to-err\n"
    assert out["stdout_bytes"] == len("to-out\nmore-out\n")
    assert out["stderr_bytes"] == len("to-err\n")
    assert out["stdout_truncated"] is False and out["stderr_truncated"] is False


async def test_bash_cwd_is_workspace_and_workdir_arg(slot: LeasedSlot) -> None:
    assert (await slot.sh("pwd"))["stdout"] == "/workspace\n"
    await slot.sh("mkdir -p sub/deeper && echo inside > sub/deeper/f")
    out = await slot.sh("pwd; cat f", workdir="sub/deeper")
    assert out["stdout"] == "/workspace/sub/deeper\ninside\n"
    # a workdir that climbs out of the workspace is refused, not clamped to it
    code, _ = _error(await slot.call("bash", command="pwd", workdir="../../.."))
    assert code == "path_escape"
    code, message = _error(await slot.call("bash", command="pwd", workdir="does/not/exist"))
    assert code == "not_found"
    assert "does/not/exist" in message


async def test_bash_stdin_arg(slot: LeasedSlot) -> None:
    out = await slot.sh("tr a-z A-Z; echo; wc -l < /dev/stdin", stdin="hello\nworld\n")
    assert out["stdout"].startswith("HELLO\nWORLD\n")
    # without stdin the command reads EOF immediately instead of hanging
    assert (await slot.sh("cat; echo eof"))["stdout"] == "eof\n"


async def test_bash_is_stateless_but_files_persist(slot: LeasedSlot) -> None:
    await slot.sh("export STATE=kept; cd /tmp; echo data > /workspace/persisted; touch /tmp/t")
    out = await slot.sh('echo "[$STATE]"; pwd; cat persisted')
    assert out["stdout"] == "[]\n/workspace\ndata\n"


async def test_bash_command_over_128k_goes_through_stdin(slot: LeasedSlot) -> None:
    lines = [f"n=$((n + 1))  # {i:05d} {'padding' * 4}" for i in range(3000)]
    command = "echo first-line\n" + "\n".join(lines) + '\necho "total=$n"\n'
    assert len(command.encode()) > 128 * KIB  # beyond what one exec argument can hold
    out = await slot.sh(command)
    assert out["exit_code"] == 0, out["stderr"]
    assert out["stdout"] == "first-line\ntotal=3000\n"
    # a command that big cannot also take a stdin argument: refused with a clear message
    code, message = _error(await slot.call("bash", command=command, stdin="x"))
    assert code == "invalid_arguments"
    assert "stdin" in message and "128 KiB" in message


async def test_python_code_over_128k_goes_through_stdin(slot: LeasedSlot) -> None:
    code = "\n".join(f"v{i} = {i}" for i in range(14000)) + "\nprint(v7999 + 1)\n"
    assert len(code.encode()) > 128 * KIB
    out = await slot.ok("python", code=code)
    assert out["exit_code"] == 0, out["stderr"]
    assert out["stdout"] == "8000\n"


async def test_bash_non_utf8_output_is_replaced(slot: LeasedSlot) -> None:
    out = await slot.sh(r"printf 'ok\xff\xfe\x80end'; printf '\xc3' >&2")
    assert out["exit_code"] == 0
    assert out["stdout"].startswith("ok") and out["stdout"].endswith("end")
    assert "\ufffd" in out["stdout"]
    assert out["stdout_bytes"] == 8
    assert out["stderr"] == "\ufffd"


async def test_bash_output_over_cap_keeps_head_and_tail(slot: LeasedSlot) -> None:
    expected = "".join(f"{i}\n" for i in range(1, 100_001))
    out = await slot.sh("seq 1 100000; seq 1 50000 >&2")
    assert out["exit_code"] == 0
    assert out["stdout_bytes"] == len(expected)
    assert out["stdout_truncated"] is True
    stdout = out["stdout"]
    dropped = len(expected) - MAX_OUTPUT
    marker = f"\n[... {dropped} bytes truncated ...]\n"
    assert marker in stdout
    head, tail = stdout.split(marker)
    assert head == expected[: MAX_OUTPUT // 2]
    assert tail == expected[-MAX_OUTPUT // 2 :]
    assert stdout.startswith("1\n2\n3\n")
    assert stdout.endswith("99999\n100000\n")
    # stderr is capped on its own, with its own count
    expected_err = "".join(f"{i}\n" for i in range(1, 50_001))
    assert out["stderr_bytes"] == len(expected_err)
    assert out["stderr_truncated"] is True
    assert f"[... {len(expected_err) - MAX_OUTPUT} bytes truncated ...]" in out["stderr"]
    assert out["stderr"].endswith("49999\n50000\n")


async def test_bash_output_under_cap_is_not_truncated(slot: LeasedSlot) -> None:
    out = await slot.sh("head -c 60000 /dev/zero | tr '\\0' a")
    assert out["stdout"] == "a" * 60000
    assert out["stdout_truncated"] is False


async def test_bash_timeout_sets_timed_out_and_kills_everything(slot: LeasedSlot) -> None:
    result = await slot.call("bash", timeout_s=1,
                             command="sleep 300 & echo $! > bg.pid; echo $$ > main.pid; echo started; sleep 300")
    assert result.ok, result.error
    out = result.result
    assert out is not None
    assert out["timed_out"] is True
    assert out["exit_code"] is None and out["signal"] == 9
    assert out["stdout"] == "started\n"
    # neither the main process nor its background child survives the call
    check = await slot.sh('for f in bg.pid main.pid; do p=$(cat $f); [ -d /proc/$p ] && echo "$f alive"; done; '
                          "pgrep -x sleep || echo no-sleep")
    assert "alive" not in check["stdout"]
    assert "no-sleep" in check["stdout"]
    # the slot keeps working
    assert (await slot.sh("echo fine"))["stdout"] == "fine\n"


async def test_bash_timeout_in_args(slot: LeasedSlot) -> None:
    out = await slot.sh("sleep 30", timeout_s=0.5)
    assert out["timed_out"] is True


# -- python -------------------------------------------------------------------------------------


async def test_python_prints_and_exceptions(slot: LeasedSlot) -> None:
    out = await slot.ok("python", code="import sys\nprint('hi', 6 * 7)\nprint('warn', file=sys.stderr)")
    assert out["exit_code"] == 0
    assert out["stdout"] == "hi 42\n"
    assert out["stderr"] == "warn\n"
    out = await slot.ok("python", code="print('before')\ndef f():\n    raise ValueError('boom-42')\nf()\n")
    assert out["exit_code"] == 1
    assert out["stdout"] == "before\n"
    assert "Traceback (most recent call last)" in out["stderr"]
    assert "ValueError: boom-42" in out["stderr"]
    # runs in the workspace and sees files written by other tools
    await slot.ok("write_file", path="data.txt", content="from-file")
    out = await slot.ok("python", code="import os; print(os.getcwd()); print(open('data.txt').read())")
    assert out["stdout"] == "/workspace\nfrom-file\n"


# -- read_file / write_file ---------------------------------------------------------------------


async def test_write_and_read_text(slot: LeasedSlot) -> None:
    text = "héllo\nwörld ✓\n"
    written = await slot.ok("write_file", path="t.txt", content=text)
    assert written["bytes_written"] == len(text.encode())
    assert written["size"] == len(text.encode())
    read = await slot.ok("read_file", path="t.txt")
    assert read["content"] == text
    assert read["encoding"] == "text"
    assert read["size"] == len(text.encode())
    assert (await slot.sh("cat t.txt"))["stdout"] == text


async def test_binary_round_trip_all_byte_values(slot: LeasedSlot) -> None:
    data = bytes(range(256)) * 4
    await slot.ok("write_file", path="bin/all.bytes", content=base64.b64encode(data).decode(), encoding="base64")
    read = await slot.ok("read_file", path="bin/all.bytes", encoding="base64")
    assert base64.b64decode(read["content"]) == data
    # the bytes on disk are exactly these (checked from inside the sandbox)
    out = await slot.sh("sha256sum bin/all.bytes")
    assert out["stdout"].split()[0] == hashlib.sha256(data).hexdigest()
    # reading binary as text does not crash or bloat: it comes back as base64, flagged binary
    as_text = await slot.ok("read_file", path="bin/all.bytes")
    assert as_text.get("binary") is True and as_text["encoding"] == "base64"
    assert base64.b64decode(as_text["content"]) == data


async def test_write_append_and_parents(slot: LeasedSlot) -> None:
    await slot.ok("write_file", path="a/b/c/log.txt", content="one\n")
    out = await slot.ok("write_file", path="a/b/c/log.txt", content="two\n", append=True)
    assert out["size"] == len("one\ntwo\n")
    assert (await slot.ok("read_file", path="a/b/c/log.txt"))["content"] == "one\ntwo\n"
    # overwrite (no append) truncates
    await slot.ok("write_file", path="a/b/c/log.txt", content="3")
    assert (await slot.ok("read_file", path="a/b/c/log.txt"))["content"] == "3"
    assert (await slot.sh("test -d a/b/c && echo dir"))["stdout"] == "dir\n"


async def test_read_offset_and_limit(slot: LeasedSlot) -> None:
    await slot.ok("write_file", path="digits", content="0123456789")
    part = await slot.ok("read_file", path="digits", offset=3, limit=4)
    assert part["content"] == "3456"
    assert part["size"] == 10
    assert (await slot.ok("read_file", path="digits", offset=7))["content"] == "789"
    assert (await slot.ok("read_file", path="digits", offset=20))["content"] == ""


async def test_read_missing_file(slot: LeasedSlot) -> None:
    code, message = _error(await slot.call("read_file", path="nope.txt"))
    assert code == "not_found"
    assert "nope.txt" in message


async def test_read_too_large_names_the_limit_and_parts_still_work(slot: LeasedSlot) -> None:
    await slot.sh("head -c 9M /dev/zero > big.bin && printf END >> big.bin")
    result = await slot.call("read_file", path="big.bin")
    code, message = _error(result)
    assert code == "too_large"
    assert result.error is not None and result.error.status == 413
    assert str(MAX_READ) in message
    assert "offset" in message and "limit" in message  # tells the model how to read part of it
    tail = await slot.ok("read_file", path="big.bin", offset=(9 << 20), limit=3)
    assert tail["content"] == "END"


# -- edit_file ----------------------------------------------------------------------------------


async def test_edit_file(slot: LeasedSlot) -> None:
    await slot.ok("write_file", path="code.py", content="a = 1\nb = 2\nc = 1\nd = 1\n")
    out = await slot.ok("edit_file", path="code.py", old_string="b = 2", new_string="b = 20")
    assert out["replacements"] == 1
    assert (await slot.ok("read_file", path="code.py"))["content"] == "a = 1\nb = 20\nc = 1\nd = 1\n"

    code, message = _error(await slot.call("edit_file", path="code.py", old_string=" = 1\n", new_string="!"))
    assert code == "ambiguous_match"
    assert "3 times" in message
    # a refused edit changes nothing
    assert (await slot.ok("read_file", path="code.py"))["content"] == "a = 1\nb = 20\nc = 1\nd = 1\n"

    code, message = _error(await slot.call("edit_file", path="code.py", old_string="zzz", new_string="y"))
    assert code == "no_match"
    assert "not found" in message

    out = await slot.ok("edit_file", path="code.py", old_string=" = 1\n", new_string=" = 9\n", replace_all=True)
    assert out["replacements"] == 3
    assert (await slot.ok("read_file", path="code.py"))["content"] == "a = 9\nb = 20\nc = 9\nd = 9\n"

    code, _ = _error(await slot.call("edit_file", path="missing.py", old_string="a", new_string="b"))
    assert code == "not_found"
    code, message = _error(await slot.call("edit_file", path="code.py", old_string="", new_string="b"))
    assert code == "invalid_arguments"
    assert "old_string" in message


async def test_edit_file_shrinking_leaves_no_stale_tail(slot: LeasedSlot) -> None:
    await slot.ok("write_file", path="s.txt", content="keep LONG-LONG-LONG-LONG tail\n")
    await slot.ok("edit_file", path="s.txt", old_string="LONG-LONG-LONG-LONG", new_string="x")
    assert (await slot.ok("read_file", path="s.txt"))["content"] == "keep x tail\n"


@pytest.fixture(scope="module")
def capped_host() -> Iterator[RunningHost]:
    """One slot whose workspace is a 4 MiB tmpfs: filling it is quick."""
    data = Path(f"/tmp/atropos-test-capped-{os.getpid()}-{secrets.token_hex(3)}")
    running = start_host(data, slots=1, extra=["--workspace-bytes", str(4 << 20)])
    yield running
    stop_host(running)
    shutil.rmtree(data, ignore_errors=True)


async def test_edit_file_that_cannot_be_written_leaves_the_original_intact(capped_host: RunningHost) -> None:
    async with capped_host.client() as client:
        lease = await client.lease("edit-enospc")
        s = LeasedSlot(client, lease)
        try:
            original = "x = 1\n" + "y" * (1 << 20) + "\n"
            await s.ok("write_file", path="big.txt", content=original)
            await s.sh("cat /dev/zero > fill 2>/dev/null; true")  # the workspace is full now
            # the edit grows the file by a few pages: there is no room for them
            grown = "x = " + "2" * 9000
            code, message = _error(await s.call("edit_file", path="big.txt", old_string="x = 1", new_string=grown))
            assert code == "no_space", message
            assert "big.txt" in message
            assert (await s.ok("read_file", path="big.txt"))["content"] == original
            names = {e["name"] for e in (await s.ok("list_dir"))["entries"]}
            assert names == {"big.txt", "fill"}  # nothing half-written left behind

            # with room again the same edit succeeds, and the file keeps its mode
            await s.sh("rm fill && chmod 640 big.txt")
            await s.ok("edit_file", path="big.txt", old_string="x = 1", new_string=grown)
            assert (await s.ok("read_file", path="big.txt"))["content"] == original.replace("x = 1", grown)
            assert (await s.ok("stat", path="big.txt"))["mode"] == "0o640"
            assert {e["name"] for e in (await s.ok("list_dir"))["entries"]} == {"big.txt"}
        finally:
            await client.release(lease.slot, s.lease.lease)


async def test_edit_file_through_a_symlink_edits_the_target(slot: LeasedSlot) -> None:
    await slot.sh("mkdir -p sub && printf 'v = 1\\n' > sub/real.py && ln -s sub/real.py link.py")
    await slot.ok("edit_file", path="link.py", old_string="v = 1", new_string="v = 2")
    assert (await slot.ok("read_file", path="sub/real.py"))["content"] == "v = 2\n"
    assert (await slot.ok("stat", path="link.py"))["type"] == "symlink"  # still a link, not replaced


# -- list_dir / stat ----------------------------------------------------------------------------


async def test_list_dir_types_sizes_truncation(slot: LeasedSlot) -> None:
    await slot.sh("mkdir d && printf 12345 > f5 && ln -s f5 link && touch empty && mkfifo pipe")
    out = await slot.ok("list_dir", path=".")
    entries = {e["name"]: e for e in out["entries"]}
    assert set(entries) == {"d", "f5", "link", "empty", "pipe"}
    assert entries["d"]["type"] == "dir"
    assert entries["f5"]["type"] == "file" and entries["f5"]["size"] == 5
    assert entries["empty"]["size"] == 0
    assert entries["link"]["type"] == "symlink"
    assert entries["pipe"]["type"] == "other"
    assert out["truncated"] is False
    assert out["total"] == 5

    limited = await slot.ok("list_dir", path=".", max_entries=2)
    assert len(limited["entries"]) == 2
    assert limited["truncated"] is True
    assert limited["total"] == 5

    assert (await slot.ok("list_dir", path="d"))["entries"] == []
    code, _ = _error(await slot.call("list_dir", path="missing"))
    assert code == "not_found"


async def test_stat_does_not_follow_symlinks(slot: LeasedSlot) -> None:
    await slot.sh("printf 'twelve bytes' > target && ln -s target link && ln -s /etc/passwd out && mkdir dd")
    target = await slot.ok("stat", path="target")
    assert target["type"] == "file" and target["size"] == 12
    link = await slot.ok("stat", path="link")
    assert link["type"] == "symlink"
    assert link["size"] == len("target")
    out_link = await slot.ok("stat", path="out")
    assert out_link["type"] == "symlink"
    assert (await slot.ok("stat", path="dd"))["type"] == "dir"
    assert isinstance(target["mtime"], float) and target["mode"].startswith("0o")
    code, _ = _error(await slot.call("stat", path="nothing-here"))
    assert code == "not_found"


# -- archive ------------------------------------------------------------------------------------


async def test_archive_is_a_real_tar_gz(slot: LeasedSlot) -> None:
    files = {
        "top.txt": b"top level\n",
        "src/main.py": b"print('hi')\n",
        "src/pkg/data.bin": bytes(range(256)),
        "empty.txt": b"",
    }
    for path, data in files.items():
        await slot.ok("write_file", path=path, content=base64.b64encode(data).decode(), encoding="base64")
    await slot.sh("ln -s top.txt link-to-top")
    out = await slot.ok("archive", path=".")
    assert out["format"] == "tar.gz"
    raw = base64.b64decode(out["content"])
    assert out["size"] == len(raw)
    with tarfile.open(fileobj=io.BytesIO(raw), mode="r:gz") as tar:
        members = {m.name: m for m in tar.getmembers()}
        for path, data in files.items():
            assert members[path].isfile(), path
            fh = tar.extractfile(members[path])
            assert fh is not None
            assert fh.read() == data, path
        assert members["src"].isdir() and members["src/pkg"].isdir()
        assert members["link-to-top"].issym() and members["link-to-top"].linkname == "top.txt"

    sub = base64.b64decode((await slot.ok("archive", path="src"))["content"])
    with tarfile.open(fileobj=io.BytesIO(sub), mode="r:gz") as tar:
        assert sorted(m.name for m in tar.getmembers() if m.isfile()) == ["main.py", "pkg/data.bin"]


# -- terminal -----------------------------------------------------------------------------------


async def _terminal_until(slot: LeasedSlot, needle: str, tries: int = 20, **args: Any) -> str:
    """Read the terminal (empty input) until ``needle`` shows up; returns everything read."""
    seen = ""
    for _ in range(tries):
        seen += (await slot.ok("terminal", wait_ms=1000, **args))["output"]
        if needle in seen:
            return seen
    raise AssertionError(f"{needle!r} never appeared; terminal showed {seen!r}")


async def test_terminal_state_persists(slot: LeasedSlot) -> None:
    first = await slot.ok("terminal", input="export FOO=1")
    assert "export FOO=1" in first["output"]
    out = await slot.ok("terminal", input="echo value-$FOO-$((40 + 2))")
    assert "value-1-42" in out["output"]
    await slot.ok("terminal", input="mkdir -p there && cd there")
    out = await slot.ok("terminal", input="pwd")
    assert "/workspace/there" in out["output"]


async def test_terminal_returns_only_new_output(slot: LeasedSlot) -> None:
    first = await slot.ok("terminal", input="echo first-marker")
    assert "first-marker" in first["output"]
    second = await slot.ok("terminal", input="echo second-marker")
    assert "second-marker" in second["output"]
    assert "first-marker" not in second["output"]
    third = await slot.ok("terminal", wait_ms=300)  # nothing typed, nothing new
    assert "marker" not in third["output"]


async def test_terminal_long_command_returns_early_then_picks_up(slot: LeasedSlot) -> None:
    # `do""ne` keeps the typed command's echo from containing the word the command prints
    early = await slot.ok("terminal", input='sleep 3; echo do""ne', wait_ms=300)
    assert "done\n" not in early["output"]
    later = await _terminal_until(slot, "done\n")
    assert 'do""ne' not in later  # the typed command was already returned by the first call


async def test_terminal_ctrl_c_interrupts(slot: LeasedSlot) -> None:
    await slot.ok("terminal", input="sleep 100", wait_ms=300)
    await slot.ok("terminal", keys=["C-c"], wait_ms=500)
    # if the sleep were still running this would only be typed ahead, never executed
    out = await _terminal_until(slot, "after-2", input="echo after-$((1 + 1))", tries=1)
    assert "after-2" in out


async def test_terminal_call_timeout_keeps_state(slot: LeasedSlot) -> None:
    await slot.ok("terminal", input="export KEEP=kept-value; cd /tmp")
    await slot.ok("terminal", input="sleep 60", wait_ms=300)
    # nothing prints, so the read waits its whole wait_ms: far longer than the call's timeout
    await slot.call("terminal", timeout_s=1, wait_ms=30_000)
    # whatever that call reported, the terminal, its shell and the running command are still there
    out = await _terminal_until(slot, "kept-value", keys=["C-c"], input="echo $KEEP; pwd", tries=3)
    assert "^C" in out  # the sleep was still running in the same shell
    assert "/tmp" in out.split("kept-value", 1)[1]


async def test_terminal_call_timeout_is_a_normal_result(slot: LeasedSlot) -> None:
    await slot.ok("terminal", input="echo ready")
    result = await slot.call("terminal", timeout_s=1, wait_ms=30_000)  # nothing will print
    assert result.ok, result.error
    assert result.result is not None and result.result["output"] == ""


async def test_terminal_after_a_burst_shows_its_end_then_only_new_output(slot: LeasedSlot,
                                                                          host: RunningHost) -> None:
    log = slot_path(host.data_dir, slot.lease.slot, "run") / "terminal.log"
    # ~2.7 MB of output: far over the output cap (64 KiB) and the old per-read window (8x the cap)
    # the burst starts after this call's read has returned (on an idle machine the whole burst
    # takes less than the read's wait, and that read would show its end instead of the next one)
    await slot.ok("terminal", input="sleep 2; seq 1 400000; echo burst-$((6 * 7))", wait_ms=200)
    deadline = time.monotonic() + 120
    while True:  # watched from outside the slot: until the shell is back at its prompt
        with open(log, "rb") as fh:
            fh.seek(max(0, os.fstat(fh.fileno()).st_size - 256))
            end = fh.read()
        if b"burst-42" in end and end.endswith(b"]$ "):
            break
        assert time.monotonic() < deadline, f"the burst never finished: {end!r}"
        time.sleep(0.1)

    out = await slot.ok("terminal", wait_ms=300)
    assert "burst-42" in out["output"]  # the end of the burst, in the first read after it
    assert out["truncated"] and "bytes truncated" in out["output"]
    assert len(out["output"]) < MAX_OUTPUT + 200
    after = await slot.ok("terminal", input="echo next-$((1 + 1))")
    assert "next-2" in after["output"]
    assert "burst-42" not in after["output"] and "39999" not in after["output"]


# -- batching -----------------------------------------------------------------------------------


def _call(s: LeasedSlot, tool: str, **args: Any) -> ToolCall:
    return ToolCall(id=secrets.token_hex(4), slot=s.lease.slot, lease=s.lease.lease, tool=tool, args=args)


async def test_batch_fast_call_is_not_delayed_by_slow_one(slot_pair: tuple[LeasedSlot, LeasedSlot]) -> None:
    a, b = slot_pair
    slow = _call(a, "bash", command="sleep 3; echo slow")
    fast = _call(b, "bash", command="echo fast")
    t0 = time.monotonic()
    arrivals: list[tuple[str, float, CallResult]] = []
    async for result in a.client.call_batch([slow, fast]):
        arrivals.append((result.id, time.monotonic() - t0, result))
    assert [r[0] for r in arrivals] == [fast.id, slow.id]  # the ORDER is the assertion
    assert arrivals[0][1] < 2.0  # the fast result streamed back while the slow one still ran
    assert arrivals[0][2].result is not None and arrivals[0][2].result["stdout"] == "fast\n"
    assert arrivals[1][2].result is not None and arrivals[1][2].result["stdout"] == "slow\n"


async def test_batch_calls_on_one_slot_run_in_order(slot: LeasedSlot) -> None:
    calls = [_call(slot, "bash", command=f"sleep 0.0{9 - i}; echo {i} >> order.txt") for i in range(10)]
    calls.append(_call(slot, "read_file", path="order.txt"))
    results = [r async for r in slot.client.call_batch(calls)]
    assert [r.id for r in results] == [c.id for c in calls]
    assert all(r.ok for r in results), [r.error for r in results if not r.ok]
    final = results[-1].result
    assert final is not None
    assert final["content"] == "".join(f"{i}\n" for i in range(10))


async def test_batch_mixes_errors_with_results(slot: LeasedSlot) -> None:
    calls = [_call(slot, "bash", command="echo ok"), _call(slot, "no_such_tool"),
             _call(slot, "read_file", path="absent")]
    by_id = {r.id: r async for r in slot.client.call_batch(calls)}
    assert by_id[calls[0].id].ok
    assert _error(by_id[calls[1].id])[0] == "invalid_arguments"
    assert _error(by_id[calls[2].id])[0] == "not_found"
