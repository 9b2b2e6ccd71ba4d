"""The ``terminal`` tool inside a slot: drives the slot's tmux session and reads what it printed from
the session's log, never blocking on whatever the slot put in the log's place.

Standard library only; copied into the host's lib dir beside ``supervisor.py`` (see there).
"""

from __future__ import annotations

import io
import os
import stat
import subprocess
import time
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from atropos.sandbox.inslot.inslot_common import (
        TMUX_TIMEOUT,
        Capture,
        strip_ansi,
        terminal_not_socket_message,
        terminal_timeout_message,
    )
else:  # run from the host's lib dir beside inslot.py (see supervisor.py)
    from inslot_common import (
        TMUX_TIMEOUT,
        Capture,
        strip_ansi,
        terminal_not_socket_message,
        terminal_timeout_message,
    )
if TYPE_CHECKING:
    from atropos.sandbox.inslot.inslot_files import ToolFailure
else:  # run from the host's lib dir beside inslot_files.py (see supervisor.py)
    from inslot_files import ToolFailure





def run_terminal(req: dict[str, Any], workspace: str, run_dir: str, env: dict[str, str],
                 tmux_cmd: list[str] | None = None, shell: list[str] | None = None) -> dict[str, Any]:
    """Send the request's keys/input to the slot's tmux session (started on first use) and return
    what the terminal printed since ``req['offset']``. ``tmux_cmd``: how to run tmux (on an image
    root, the host's, through its own loader); ``shell``: the session's command instead of tmux's
    default login shell (an image's terminal is ``docker exec -it bash``: its environment as is)."""
    sock = os.path.join(run_dir, "tmux.sock")
    log = os.path.join(run_dir, "terminal.log")
    tmux = [*(tmux_cmd or ["tmux"]), "-S", sock]
    env = dict(env)

    def tmux_run(*args: str) -> subprocess.CompletedProcess[bytes]:
        try:
            return subprocess.run([*tmux, *args], env=env, capture_output=True, timeout=TMUX_TIMEOUT,
                                  stdin=subprocess.DEVNULL)
        except subprocess.TimeoutExpired:
            # e.g. tmux.sock replaced from inside the slot by a socket nobody answers on
            raise ToolFailure("terminal_unavailable", terminal_timeout_message()) from None

    try:
        is_socket = stat.S_ISSOCK(os.lstat(sock).st_mode)
    except OSError:
        is_socket = False
    if not is_socket:
        raise ToolFailure("terminal_unavailable", terminal_not_socket_message(sock))
    if tmux_run("has-session", "-t", "main").returncode != 0:
        created = tmux_run("new-session", "-d", "-s", "main", "-x", str(req["cols"]),
                           "-y", str(req["rows"]), "-c", workspace, *(shell or []))
        if created.returncode != 0:
            raise ToolFailure("terminal_unavailable",
                              "cannot start the terminal: " + created.stderr.decode(errors="replace"))
        tmux_run("pipe-pane", "-O", "-t", "main", f"exec cat >> {log}")
    # the request's fields, checked and with their defaults (inslot_protocol.check)
    for key in req["keys"]:
        tmux_run("send-keys", "-t", "main", str(key))
    text = req["input"]
    if text:
        tmux_run("send-keys", "-t", "main", "-l", "--", text)
    enter = req["enter"]
    if enter if enter is not None else bool(text):
        tmux_run("send-keys", "-t", "main", "Enter")
    wait = req["wait_ms"] / 1000.0
    settle = req["settle_ms"] / 1000.0
    offset = req["offset"]
    size = _size(log)
    end = time.monotonic() + wait
    last_change = time.monotonic()
    while time.monotonic() < end:
        time.sleep(0.01)
        now_size = _size(log)
        if now_size != size:
            size, last_change = now_size, time.monotonic()
            if _ends_with_prompt(log, size):
                break  # the shell is back at its prompt: the command finished
        elif now_size > offset and time.monotonic() - last_change >= settle:
            break
    cap = req["max_output"]
    if size < offset:
        offset = 0  # the log was truncated from inside the slot: what it holds now is all new
    text_out, truncated = _read_region(log, offset, size, cap)
    # Everything up to `size` counts as shown, even what the cap dropped: the next read starts
    # at what is new then, never in the middle of an old burst.
    return {"output": strip_ansi(text_out), "offset": size, "truncated": truncated, "bytes": size - offset}



def _read_region(path: str, start: int, end: int, cap: int) -> tuple[str, bool]:
    """Bytes ``start:end`` of a file as text, keeping only the first and last ``cap/2`` bytes with a
    marker between when the region is larger than ``cap``; reads no more than ``cap`` bytes."""
    if end <= start:
        return "", False
    capture = Capture(cap)
    fh = _open_log(path)
    if fh is None:
        return "", False
    with fh:
        fh.seek(start)
        if end - start <= cap:
            capture.feed(fh.read(end - start))
        else:
            capture.feed(fh.read(capture.half))
            fh.seek(end - capture.half)
            # Capture counts what it is fed; the skipped middle is reported through `total`.
            capture.total += end - start - 2 * capture.half
            capture.feed(fh.read(capture.half))
    return capture.text()


PROMPT_END = b"]$ "


def _open_log(path: str) -> io.FileIO | None:
    """The terminal log for reading, never blocking on whatever the slot may have put in its place."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_NOCTTY | os.O_CLOEXEC)
    except OSError:
        return None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        return None
    return io.FileIO(fd, "rb")


def _ends_with_prompt(path: str, size: int) -> bool:
    fh = _open_log(path)
    if fh is None:
        return False
    with fh:
        fh.seek(max(0, size - 64))
        return (fh.read(64) or b"").endswith(PROMPT_END)


def _size(path: str) -> int:
    try:
        st = os.lstat(path)
    except OSError:
        return 0
    return st.st_size if stat.S_ISREG(st.st_mode) else 0

