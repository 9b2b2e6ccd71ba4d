"""Every process of a slot starts with default signal dispositions and an empty signal mask,
whatever the host inherited.

A host started from a background shell (``nohup atropos-sandbox … &`` ignores SIGHUP, SIGINT and
SIGQUIT) or under a blocked mask must not pass either into its slots: exec keeps an ignored signal
ignored and the mask as it is, so ``timeout -s INT``, Ctrl-C in the terminal and the
python_session's interrupt (SIGALRM) would stop working.
"""

from __future__ import annotations

import os
import secrets
import signal
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from conftest import HOST_WORKSPACE_BYTES, LeasedSlot, RunningHost, leased_slot, start_host, stop_host

IGNORED = (signal.SIGHUP, signal.SIGINT, signal.SIGQUIT)  # what `nohup cmd &` leaves ignored
BLOCKED = (signal.SIGALRM, signal.SIGUSR2)  # the python_session interrupts with SIGALRM
STATE = ("print(signal.getsignal(signal.SIGINT) is signal.default_int_handler,"
         " signal.pthread_sigmask(signal.SIG_BLOCK, []), flush=True)\n")
STATUS = "grep -E '^Sig(Ign|Blk)' /proc/self/status"
CLEAN = "SigBlk:\t0000000000000000\nSigIgn:\t0000000000000000\n"


def _as_if_started_in_the_background() -> None:
    for sig in IGNORED:
        signal.signal(sig, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_BLOCK, BLOCKED)


@pytest.fixture(scope="module")
def nohup_host() -> Iterator[RunningHost]:
    data = Path(f"/tmp/atropos-test-{os.getpid()}-{secrets.token_hex(3)}")
    running = start_host(data, slots=2, extra=["--workspace-bytes", str(HOST_WORKSPACE_BYTES)],
                         preexec_fn=_as_if_started_in_the_background)
    # the premise: the host itself runs with them blocked, and ignored but what it handles itself
    # (the HTTP server catches SIGINT and SIGTERM)
    status = Path(f"/proc/{running.proc.pid}/status").read_text()
    ign = int(next(line for line in status.splitlines() if line.startswith("SigIgn:")).split()[1], 16)
    blk = int(next(line for line in status.splitlines() if line.startswith("SigBlk:")).split()[1], 16)
    assert all(ign & (1 << (s - 1)) for s in (signal.SIGHUP, signal.SIGQUIT))
    assert all(blk & (1 << (s - 1)) for s in BLOCKED)
    yield running
    stop_host(running)


@pytest.fixture
async def nslot(nohup_host: RunningHost) -> AsyncIterator[LeasedSlot]:
    async with leased_slot(nohup_host) as leased:
        yield leased


async def test_bash_calls_start_clean_warm_or_not(nslot: LeasedSlot) -> None:
    for kw in ({}, {"workdir": "."}, {"stdin": "x"}):  # a warm bash, then two started for the call
        out = await nslot.sh(f"{STATUS}; {STATUS} | cat", **kw)
        assert out["stdout"] == CLEAN * 2, kw
        # SIGINT kills `sleep` (128+2), SIGALRM too (128+14): neither ignored nor blocked
        for sig, code in (("INT", 130), ("ALRM", 142)):
            out = await nslot.sh(f"timeout --preserve-status -s {sig} 0.3 sleep 30; echo $?", **kw)
            assert out["stdout"] == f"{code}\n", (sig, kw)


async def test_python_calls_start_clean(nslot: LeasedSlot) -> None:
    code = ("import signal, subprocess\n" + STATE +
            f"subprocess.run({STATUS!r}, shell=True)")
    for _ in range(3):  # the first python call starts its own, the next ones are served warm
        out = await nslot.ok("python", code=code)
        assert out["stdout"] == "True set()\n" + CLEAN


async def test_the_python_session_can_be_interrupted(nslot: LeasedSlot) -> None:
    code = ("import signal, os\n" + STATE +
            f"os.system({STATUS!r})")
    # os.system's child keeps what python3 itself ignores (SIGPIPE, SIGXFSZ): compare with a fresh one
    fresh = await nslot.sh('python3 -c "$(cat)"', stdin=code)
    assert fresh["stdout"].startswith("True set()\nSigBlk:\t0000000000000000\n")
    first = await nslot.ok("python_session", code=code)
    assert first["stdout"] == fresh["stdout"]
    result = await nslot.call("python_session", timeout_s=1, code="import time; time.sleep(60)")
    assert result.ok and result.result is not None
    assert result.result["timed_out"] and not result.result["restarted"]  # interrupted, not killed
    assert (await nslot.ok("python_session", code="1 + 1"))["value"] == "2"


async def test_terminal_processes_start_clean(nslot: LeasedSlot) -> None:
    seen = (await nslot.ok("terminal", input=f"{STATUS} | tr '\\n\\t' '  '; echo END-OF-STATUS"))["output"]
    for _ in range(20):
        seen += (await nslot.ok("terminal", wait_ms=1000))["output"]
        if "0 END-OF-STATUS" in seen:
            break
    assert "SigBlk: 0000000000000000 SigIgn: 0000000000000000 END-OF-STATUS" in seen, seen
