"""What the two programs that run *inside* a slot's sandbox share: the supervisor (``supervisor.py``)
and the python_session driver (``session.py``).

Standard library only and import-light: the host copies this file beside the two scripts into its
lib directory, and they import it from there with whatever ``python3`` the sandbox's ``/usr``
offers (they run isolated, ``-I``, so their directory is put on ``sys.path`` by hand for this one
import and taken off again).

The wire: length-prefixed JSON frames on the program's stdin/stdout, one request at a time. A
request may carry ``seq``; the reply echoes it, so the host can tell a reply that answers another
request (a protocol out of step) from the one it waits for.
"""

from __future__ import annotations

import json
import os
import re
import resource
import signal
import struct
import sys
from collections.abc import Callable
from typing import Any

FRAME = struct.Struct(">I")
MAX_FRAME = 64 << 20


class Capture:
    """Keeps the first and last ``cap/2`` bytes of a stream and counts the rest."""

    def __init__(self, cap: int) -> None:
        self.half = max(cap // 2, 1)
        self.head = bytearray()
        self.tail = bytearray()
        self.total = 0

    def feed(self, data: bytes) -> None:
        self.total += len(data)
        room = self.half - len(self.head)
        if room > 0:
            self.head += data[:room]
            data = data[room:]
        if data:
            self.tail += data
            if len(self.tail) > 2 * self.half:
                del self.tail[: len(self.tail) - self.half]

    def text(self) -> tuple[str, bool]:
        return render_capture(bytes(self.head), bytes(self.tail[-self.half :]) if self.tail else b"", self.total)


def render_capture(head: bytes, tail: bytes, total: int) -> tuple[str, bool]:
    """A captured stream as a call's reply shows it (and whether bytes were dropped): the kept head
    and tail, with a marker for what was between them. The host renders the compiled supervisor's
    raw capture with this too (host/isolation/slotd_wire.py), so both read the same."""
    dropped = total - len(head) - len(tail)
    if dropped <= 0:
        return (head + tail).decode("utf-8", "replace"), False
    marker = f"\n[... {dropped} bytes truncated ...]\n"
    return head.decode("utf-8", "replace") + marker + tail.decode("utf-8", "replace"), True


_ANSI = re.compile(r"\x1b\[[0-?]*[ -/]*[@-~]|\x1b\][^\x07\x1b]*(?:\x07|\x1b\\)|\x1b[()][0-9A-Za-z]|\x1b[=>78cDEHM]")


def strip_ansi(text: str) -> str:
    """The terminal's text without its escape sequences (the terminal tool's reply; the host applies
    it to the compiled supervisor's raw capture too)."""
    text = _ANSI.sub("", text).replace("\r\n", "\n")
    # A bare CR moves to line start: keep what was drawn last on that line.
    return "\n".join(line.rsplit("\r", 1)[-1] for line in text.split("\n"))


# The terminal tool's failures, worded once for both supervisors (inslot_terminal.py; the host's
# rendering of slotd's, host/isolation/slotd_wire.py). slotd.c's TMUX_TIMEOUT is the same 5 s.
TMUX_TIMEOUT = 5


def terminal_timeout_message() -> str:
    return f"the terminal did not answer within {TMUX_TIMEOUT} s; reset the slot for a new terminal"


def terminal_not_socket_message(sock: str) -> str:
    return (f"{sock} is not the terminal's socket any more (replaced from inside the slot); "
            "the next terminal call starts a new one")


PR_SET_DUMPABLE = 4


def make_undumpable() -> None:
    """No process of the slot may ptrace this one or open its ``/proc/<pid>/mem``, ``environ`` or
    ``fd/*``: they carry the host's requests (a verifier's secrets among them). Call it first
    thing; the flag survives fork but not exec, so every program started from here (the slot's
    code) is dumpable again, as it must be for its own tools."""
    import ctypes

    if ctypes.CDLL(None, use_errno=True).prctl(PR_SET_DUMPABLE, 0, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_DUMPABLE, 0) failed")


_last_pid_fd: int | None = None


def ns_last_pid() -> int:
    """The last pid handed out in this process's PID namespace (the kernel keeps it per namespace).
    The file stays open (close-on-exec): a pread is a fraction of an open+read+close."""
    global _last_pid_fd
    if _last_pid_fd is None:
        _last_pid_fd = os.open("/proc/sys/kernel/ns_last_pid", os.O_RDONLY | os.O_CLOEXEC)
    return int(os.pread(_last_pid_fd, 32, 0))


def apply_limits(limits: dict[str, int]) -> None:
    """The slot's resource limits by name: RLIMIT_<NAME> of the resource module, as slotd's generated
    table maps the same names (inslot_protocol.RLIMITS); a name with no such limit is an error, never
    a limit silently left off."""
    for name, value in limits.items():
        which = getattr(resource, "RLIMIT_" + name.upper(), None) if name.isalpha() else None
        if which is None:
            raise ValueError(f"no resource limit named {name!r}")
        if value is not None:
            resource.setrlimit(which, (int(value), int(value)))


def protocol_fds() -> tuple[int, int]:
    """The protocol's descriptors: the request and reply pipes, whose numbers are the program's last
    three arguments with its stderr's (the host passes them past bubblewrap's init, which never holds
    them: host/isolation/sandbox_process.py). The stderr pipe becomes fd 2, stdin and stdout
    /dev/null; none of them is inherited by what the slot's code runs."""
    rfd, wfd, efd = (int(a) for a in sys.argv[-3:])
    os.dup2(efd, 2)
    if efd != 2:
        os.close(efd)
    devnull = os.open(os.devnull, os.O_RDWR)
    for std in (0, 1):
        os.dup2(devnull, std)
    os.close(devnull)
    os.set_inheritable(rfd, False)
    os.set_inheritable(wfd, False)
    return rfd, wfd


def clean_signals() -> None:
    """Signal state as a fresh ``python3`` has it, whatever this process inherited: nothing blocked,
    nothing ignored but what Python itself ignores (SIGPIPE, SIGXFSZ), SIGINT raising
    KeyboardInterrupt. What this process starts gets it too (exec keeps an ignored signal ignored
    and the mask); the host starts every sandbox clean already (sandbox_process.signal_reset), this
    holds whoever started us."""
    signal.pthread_sigmask(signal.SIG_SETMASK, ())
    for sig in signal.valid_signals():
        if sig in (signal.SIGKILL, signal.SIGSTOP, signal.SIGPIPE, signal.SIGXFSZ):
            continue
        if signal.getsignal(sig) is signal.SIG_IGN:
            signal.signal(sig, signal.default_int_handler if sig == signal.SIGINT else signal.SIG_DFL)


def cloexec_all() -> None:
    """Every descriptor this process holds beyond stdio becomes close-on-exec, so a child started
    with a bare fork and exec (which, unlike ``Popen(close_fds=True)``, closes nothing itself) inherits
    only what is made inheritable for it on purpose. Descriptors Python opens later are
    close-on-exec already (PEP 446)."""
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        if fd > 2:
            try:
                os.set_inheritable(fd, False)
            except OSError:
                pass  # the listing's own descriptor, closed by now


def read_exact(fd: int, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        try:
            chunk = os.read(fd, n - len(buf))
        except InterruptedError:  # a session's interrupt timer firing between requests
            continue
        if not chunk:
            raise EOFError
        buf += chunk
    return bytes(buf)


def write_frame(fd: int, obj: dict[str, Any]) -> None:
    data = json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode("utf-8", "replace")
    view = memoryview(FRAME.pack(len(data)) + data)
    while view:
        view = view[os.write(fd, view):]


def serve(rfd: int, wfd: int, handle: Callable[[dict[str, Any]], dict[str, Any]],
          idle: Callable[[], None] = lambda: None) -> None:
    """Announce readiness, then answer requests until the host closes the pipe. ``idle`` runs
    after each reply is on its way (work that must not delay an answer)."""
    write_frame(wfd, {"ok": True, "result": {"ready": True, "pid": os.getpid()}})
    idle()
    while True:
        try:
            (size,) = FRAME.unpack(read_exact(rfd, FRAME.size))
            if size > MAX_FRAME:
                return
            req = json.loads(read_exact(rfd, size))
        except EOFError:
            return
        reply = handle(req) if isinstance(req, dict) else {
            "ok": False, "error": {"code": "invalid_request", "message": "a request is a JSON object"}}
        if isinstance(req, dict) and "seq" in req:
            reply["seq"] = req["seq"]
        write_frame(wfd, reply)
        idle()
