"""One running slot sandbox: bubblewrap around the supervisor, spoken to over pipes.

The protocol's pipes reach the sandbox's program only, never bubblewrap's init (PID 1 of every
sandbox, which keeps its stdio for the sandbox's life: on a backend where the host runs as the slots'
uid, the slot could open them through ``/proc/1/fd/N``). So bwrap's stdin and stdout are /dev/null,
and the request, reply and error pipes are passed as descriptors of their own (bwrap's init closes
every descriptor but its stdio; the program inherits them): their numbers are the program's last
three arguments. bwrap's stderr stays a pipe for its own set-up errors until the program is ready,
then the host closes its end: nothing of the host's is left to read or write through PID 1."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import struct
from collections.abc import Sequence
from typing import Any

from atropos.errors import SandboxDied as SandboxDied  # defined there since issue 18
from atropos.sandbox.contract.timeouts import within
from atropos.sandbox.host.isolation import slotd_wire
from atropos.sandbox.host.isolation.network import NetworkSetupFailed, SlirpHandshake

log = logging.getLogger(__name__)
FRAME = struct.Struct(">I")
MAX_FRAME = 96 << 20  # > base64 of the largest archive or read (see HostConfig)
KILL_WAIT_S = 5.0

# Every process of a slot starts as from a clean login: default dispositions, nothing blocked. A
# host started from a background shell (`nohup cmd &` ignores SIGHUP, SIGINT and SIGQUIT) or under a
# blocked mask would otherwise pass both on through bwrap into every sandbox (exec keeps an ignored
# signal ignored and the mask as it is): `timeout -s INT`, Ctrl-C in the terminal and the
# python_session's interrupt would stop working. Python itself ignores SIGPIPE and SIGXFSZ, which
# Popen resets in the child anyway (restore_signals).
_PYTHON_IGNORES = frozenset(s for s in (getattr(signal, "SIGPIPE", None), getattr(signal, "SIGXFSZ", None)) if s)
_UNCATCHABLE = frozenset({signal.SIGKILL, signal.SIGSTOP})


def _inherited_signal_state() -> tuple[list[signal.Signals], bool]:
    """The signals this process ignores that a fresh process would not, and whether the calling
    thread blocks any."""
    ignored = [s for s in signal.valid_signals()
               if s not in _UNCATCHABLE and s not in _PYTHON_IGNORES and signal.getsignal(s) is signal.SIG_IGN]
    return ignored, bool(signal.pthread_sigmask(signal.SIG_BLOCK, ()))


def signal_reset() -> Any:
    """A ``preexec_fn`` that gives the child default dispositions and an empty mask, or None when
    this process has nothing to pass on (the usual case: a preexec_fn makes Popen fork instead of
    vfork, so it is only paid by a host that inherited such a state)."""
    ignored, masked = _inherited_signal_state()
    if not ignored and not masked:
        return None

    def reset() -> None:  # in the child, between fork and exec
        for sig in ignored:
            signal.signal(sig, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_SETMASK, ())

    return reset


class SandboxProcess:
    """A long-lived sandboxed supervisor. Requests are serialised by the owning slot's lock.

    A request whose caller is cancelled (a client that disconnected from a streamed batch, a
    caller's own timeout) abandons the sandbox: the call is still running inside and its reply
    would be read as the answer to the next request, so the sandbox is killed at once (and with
    it every process of the call) and the owner starts a fresh one for the next call. Replies
    also echo the request's sequence number (``echoes_seq``), so a protocol out of step is caught
    rather than answered with another call's output."""

    # Process groups of every sandbox this process started and has not reaped: what kill_all() kills
    # when the host exits with sandboxes still starting (their tasks cancelled mid-start).
    _groups: set[int] = set()
    # Reaping tasks of abandoned sandboxes: referenced here so they are not garbage-collected.
    _reapers: set[asyncio.Task[None]] = set()

    def __init__(self, proc: asyncio.subprocess.Process, label: str, echoes_seq: bool = False) -> None:
        self.proc = proc
        SandboxProcess._groups.add(proc.pid)
        self.label = label
        self.echoes_seq = echoes_seq
        self._seq = 0
        # slotd, the compiled supervisor, serves this sandbox until a request only the Python one
        # answers (see slotd_wire): then it becomes that one, for good.
        self.native = False
        self.files_workspace = "/workspace"  # the file tools' workspace, as slotd's ready frame names it
        # Some request of this sandbox was one only the Python supervisor answers, whichever served it
        # (the host's supervisor_choice counts it).
        self.needed_python = False
        self._abandoned = False
        self.companion: asyncio.subprocess.Process | None = None  # slirp4netns of a network sandbox
        self._stderr_tail = b""
        # the channel (see the module's docstring): connected by start()
        self._writer: asyncio.StreamWriter | None = None
        self._reader: asyncio.StreamReader | None = None
        self._err_tasks: list[asyncio.Task[None]] = []
        self._stderr_task = asyncio.create_task(self._drain_stderr(proc.stderr))

    @classmethod
    async def start(
        cls,
        argv: Sequence[str],
        *,
        uid: int | None,
        seccomp_path: str | None,
        label: str,
        protocol: bool = True,
        ready_timeout: float = 15.0,
        network: SlirpHandshake | None = None,
        network_uid: int | None = None,
        echoes_seq: bool = False,
        first_frame: bytes | None = None,
    ) -> SandboxProcess:
        """Start a sandbox; with ``protocol`` False it runs a plain program (e.g. the tmux server).

        With ``network`` the sandbox gets a private network (slirp4netns run as ``network_uid``)
        before anything runs inside it."""
        fds: dict[str, int] = dict(network.sandbox_fds) if network is not None else {}
        # the channel: requests (we write), replies and the program's stderr (we read)
        req_r, req_w = os.pipe2(os.O_CLOEXEC)
        rep_r, rep_w = os.pipe2(os.O_CLOEXEC)
        err_r, err_w = os.pipe2(os.O_CLOEXEC)
        ours, theirs = (req_w, rep_r, err_r), (req_r, rep_w, err_w)
        seccomp_fd = -1
        if seccomp_path is not None:
            # bwrap consumes the descriptor's offset, so every sandbox gets a fresh one.
            seccomp_fd = fds["seccomp_fd"] = os.open(seccomp_path, os.O_RDONLY)
        placeholders = {f"{{{name}}}": str(fd) for name, fd in fds.items()}
        argv = [*(placeholders.get(a, a) for a in argv), *map(str, theirs)]
        ids: dict[str, Any] = {}
        if uid is not None:
            ids = {"user": uid, "group": uid, "extra_groups": []}
        try:
            proc = await asyncio.create_subprocess_exec(
                *argv,
                stdin=asyncio.subprocess.DEVNULL,  # bwrap's init keeps its stdio: nothing of ours there
                stdout=asyncio.subprocess.DEVNULL,
                stderr=asyncio.subprocess.PIPE,  # bwrap's set-up errors, until the program is ready
                env={},  # bwrap's own PID 1 keeps this environment: it must be empty
                pass_fds=(*fds.values(), *theirs),
                limit=MAX_FRAME,
                # Its own process group: killed while it starts, bwrap leaves a child blocked before
                # --die-with-parent applies; killpg reaches that child too.
                start_new_session=True,
                preexec_fn=signal_reset(),
                **ids,
            )
        except OSError as exc:
            if network is not None:
                network.close()
            for fd in ours:
                os.close(fd)
            raise SandboxDied(f"{label}: cannot start sandbox: {exc}") from exc
        finally:
            if seccomp_fd >= 0:
                os.close(seccomp_fd)
            for fd in theirs:
                os.close(fd)
        sandbox = cls(proc, label, echoes_seq=echoes_seq)
        try:
            await sandbox._connect(*ours)
            assert sandbox._writer is not None
            if first_frame is not None:
                sandbox._writer.write(first_frame)  # read before anything else (slotd's configuration): no wait
            if not protocol:
                sandbox._writer.close()  # a plain program: its configuration, if any, and nothing more
            if network is not None:
                network.spawned()
                try:
                    sandbox.companion = await network.attach(network_uid, label, ready_timeout)
                finally:
                    network.close()
            if protocol:
                ready = await sandbox._read_frame(ready_timeout)
                sandbox.native = ready.get("native") is True
                if sandbox.native and isinstance(ready.get("files_workspace"), str):
                    sandbox.files_workspace = slotd_wire.b64_text(ready["files_workspace"])
            sandbox._close_bwrap_stderr()  # set up and running: bwrap has nothing more to say
        except NetworkSetupFailed as exc:
            await sandbox.kill()
            raise SandboxDied(str(exc)) from exc
        except SandboxDied:
            await sandbox.kill()
            raise
        except BaseException:  # cancelled mid-start: nobody else knows this sandbox, so kill it now
            sandbox._signal_group()
            raise
        return sandbox

    async def _connect(self, req_w: int, rep_r: int, err_r: int) -> None:
        loop = asyncio.get_running_loop()
        reader = asyncio.StreamReader(limit=MAX_FRAME, loop=loop)
        await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader, loop=loop),
                                     os.fdopen(rep_r, "rb", buffering=0))
        err = asyncio.StreamReader(loop=loop)
        await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(err, loop=loop),
                                     os.fdopen(err_r, "rb", buffering=0))
        transport, protocol = await loop.connect_write_pipe(asyncio.streams.FlowControlMixin,
                                                            os.fdopen(req_w, "wb", buffering=0))
        self._writer = asyncio.StreamWriter(transport, protocol, None, loop)
        self._reader = reader
        self._err_tasks.append(asyncio.create_task(self._drain_stderr(err)))

    def _close_bwrap_stderr(self) -> None:
        """The end of bwrap's stderr: its init keeps the pipe as its fd 2 for the sandbox's life, so
        once the set-up is done the host's end goes (what the slot writes there reaches nobody)."""
        self._stderr_task.cancel()
        transport = getattr(self.proc, "_transport", None)
        pipe = transport.get_pipe_transport(2) if transport is not None else None
        if pipe is not None:
            pipe.close()

    @classmethod
    def kill_all(cls) -> None:
        """SIGKILL every sandbox still running; for the host's last words (no waiting, no event loop)."""
        for pgid in list(cls._groups):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pgid, signal.SIGKILL)
        cls._groups.clear()

    def _signal_group(self) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)  # the group outlives a reaped leader: no pid reuse

    def _kill_now(self) -> None:
        """The synchronous part of a kill: the signal, and the end of the request pipe."""
        self._signal_group()
        if self._writer is not None:
            self._writer.close()

    @property
    def alive(self) -> bool:
        # An abandoned sandbox is dying (SIGKILL sent, not reaped yet): never hand it another call.
        return self.proc.returncode is None and not self._abandoned

    def abandon(self) -> None:
        """Kill now and reap in the background: for a caller being cancelled, which must not wait.

        The kill is synchronous, so by the time the caller's lock is released the sandbox (and the
        call running in it) is already gone and ``alive`` is False for whoever comes next."""
        if self._abandoned:
            return
        self._abandoned = True
        self._kill_now()
        task = asyncio.get_running_loop().create_task(self.kill())
        SandboxProcess._reapers.add(task)
        task.add_done_callback(SandboxProcess._reapers.discard)

    @property
    def served(self) -> bool:
        """It answered at least one request."""
        return self._seq > 0

    @property
    def pid(self) -> int:
        return self.proc.pid

    async def _drain_stderr(self, stream: asyncio.StreamReader | None) -> None:
        """bwrap's set-up errors, then the program's own stderr: the tail names why a sandbox died."""
        if stream is None:
            return
        try:
            while chunk := await stream.read(4096):
                self._stderr_tail = (self._stderr_tail + chunk)[-4096:]
        except (ConnectionError, asyncio.CancelledError):
            pass

    def stderr_tail(self) -> str:
        return self._stderr_tail.decode("utf-8", "replace").strip()

    async def _read_body(self) -> bytes:
        assert self._reader is not None
        (size,) = FRAME.unpack(await self._reader.readexactly(FRAME.size))
        if size > MAX_FRAME:
            raise SandboxDied(f"{self.label}: oversized frame from sandbox ({size} bytes)")
        return await self._reader.readexactly(size)

    async def _read_frame(self, timeout: float) -> dict[str, Any]:
        try:
            # One deadline for header and body, no task per read (contract/timeouts.py)
            body = await within(self._read_body(), timeout)
        except asyncio.TimeoutError:
            raise SandboxDied(f"{self.label}: sandbox did not answer within {timeout:.1f}s") from None
        except (asyncio.IncompleteReadError, ConnectionError):
            await asyncio.sleep(0)  # let the stderr drain catch bwrap's last words
            raise SandboxDied(f"{self.label}: sandbox exited: {self.stderr_tail() or 'no message'}") from None
        try:
            frame = json.loads(body)
        except ValueError:
            raise SandboxDied(f"{self.label}: malformed frame from sandbox") from None
        if not isinstance(frame, dict):
            raise SandboxDied(f"{self.label}: malformed frame from sandbox")
        return frame

    async def request(self, payload: dict[str, Any], timeout: float) -> dict[str, Any]:
        """Send one request and wait for its answer; any transport failure kills the sandbox, and
        so does the caller's cancellation (see the class docstring)."""
        if not self.alive or self._writer is None or self._writer.is_closing():
            raise SandboxDied(f"{self.label}: sandbox is not running")
        self._seq += 1
        seq = self._seq
        native = slotd_wire.encode(payload, seq) if self.native else None
        if not self.needed_python and not (native is not None or slotd_wire.serves(payload)):
            self.needed_python = True
        if self.echoes_seq:
            payload = {**payload, "seq": seq}
        data = native if native is not None else json.dumps(payload, separators=(",", ":")).encode()
        try:
            if self.native and native is None:
                await self._upgrade(timeout)
            self._writer.write(FRAME.pack(len(data)) + data)
            await self._writer.drain()
            frame = await self._read_frame(timeout)
            if self.echoes_seq and frame.get("seq") != seq:
                raise SandboxDied(f"{self.label}: reply out of step with its request "
                                  f"(sequence {frame.get('seq')!r}, expected {seq})")
            return slotd_wire.decode(frame, payload, self.files_workspace) if native is not None else frame
        except asyncio.CancelledError:
            # Mid-write or mid-call: either way the pipe no longer lines up with our requests.
            self.abandon()
            raise
        except (ConnectionError, SandboxDied) as exc:
            await self.kill()
            if isinstance(exc, SandboxDied):
                raise
            raise SandboxDied(f"{self.label}: sandbox pipe closed") from exc

    async def _upgrade(self, timeout: float) -> None:
        """slotd execs the Python supervisor in its place (every process of the sandbox killed
        first); its ready frame says it serves from now on."""
        assert self._writer is not None
        data = slotd_wire.encode_upgrade(self._seq)
        self._writer.write(FRAME.pack(len(data)) + data)
        await self._writer.drain()
        frame = await self._read_frame(max(timeout, 15.0))
        if not (frame.get("ok") and isinstance(frame.get("result"), dict) and frame["result"].get("ready")):
            raise SandboxDied(f"{self.label}: the Python supervisor did not take over")
        self.native = False

    async def kill(self) -> None:
        """SIGKILL bwrap's process group; with a PID namespace that takes every process inside along."""
        self._kill_now()
        try:
            # asyncio's wait() also waits for the pipes' EOF; a process that escaped the group and holds
            # them must not hang the slot's lock for good.
            await asyncio.wait_for(self.proc.wait(), KILL_WAIT_S)
        except asyncio.TimeoutError:
            log.error("%s: sandbox pipes still open %.0fs after SIGKILL", self.label, KILL_WAIT_S)
        else:
            SandboxProcess._groups.discard(self.proc.pid)
        if self.companion is not None:
            # It exits by itself at the sandbox's death (EOF on its exit pipe); reap it.
            try:
                await asyncio.wait_for(self.companion.wait(), KILL_WAIT_S)
            except asyncio.TimeoutError:
                with contextlib.suppress(ProcessLookupError):
                    self.companion.kill()
        self._stderr_task.cancel()
        for task in self._err_tasks:
            task.cancel()
        if self._reader is not None:
            self._reader.feed_eof()


