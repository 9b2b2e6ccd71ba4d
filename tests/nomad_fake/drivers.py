"""Task drivers: what the fake's simulated Nomad client uses to actually run a task.

A driver sees one :class:`AllocHandle` per (allocation, task). The fake calls

* ``start(alloc)`` once per (re)start. Return normally when the task is running; raise
  :class:`DriverError` (or any exception) for an unrecoverable ``Driver Failure`` (the
  allocation goes straight to ``failed``), or :class:`RecoverableDriverError` to let the
  restart policy decide, as Nomad does for recoverable start errors.
* ``alive(alloc)`` every monitor tick while the task runs. Return False once the task has
  exited; set ``alloc.exit_code`` / ``alloc.signal`` / ``alloc.oom_killed`` first if known.
* ``stop(alloc)`` to kill the task (scale-down, job stop, crash injection, node down, user
  restart, fake shutdown). Must be idempotent and must not raise for an exited task.

Calls for different tasks may run concurrently (the monitor uses a thread pool), never two
calls for the same task at once. They run without the fake's state lock held.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
import subprocess
import tempfile
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import IO, Any, Protocol, runtime_checkable


class DriverError(Exception):
    """An unrecoverable start error (Nomad: ``Driver Failure`` + ``Error was unrecoverable``)."""


class RecoverableDriverError(DriverError):
    """A start error the restart policy may retry (Nomad: ``structs.NewRecoverableError``)."""


@dataclass
class AllocHandle:
    """One task of one allocation, as a driver sees it."""

    id: str
    """The allocation ID."""
    name: str
    """``<job>.<group>[<index>]``."""
    index: int
    job_id: str
    namespace: str
    task_group: str
    task: str
    """The task name."""
    node_id: str
    host_ip: str
    ports: dict[str, int]
    """Port label -> host port (``AllocatedResources.Shared.Ports[].Value``)."""
    env: dict[str, str]
    """``NOMAD_*`` variables plus the task's ``Env`` (interpolated) and the output of its ``env = true``
    templates (rendered before each start), as Nomad would set them."""
    task_spec: dict[str, Any]
    """The canonical task JSON (``Config``, ``Env``, ``Resources``, ``KillTimeout`` ...)."""
    job: dict[str, Any]
    """The job version this allocation runs."""
    files: dict[str, str] = field(default_factory=dict)
    """Rendered templates: destination (e.g. ``secrets/app.env``) -> content."""
    task_dir: str = ""
    """The task directory on disk (``local/``, ``secrets/``, ``tmp/``; templates rendered there), once
    built before the first start; ``""`` for a fake without a data dir."""
    driver_state: dict[str, Any] = field(default_factory=dict)
    """Scratch space owned by the driver (e.g. the ``subprocess.Popen``)."""
    exit_code: int | None = None
    signal: int = 0
    oom_killed: bool = False

    @property
    def config(self) -> dict[str, Any]:
        """The task's driver ``Config`` block."""
        cfg = self.task_spec.get("Config")
        return cfg if isinstance(cfg, dict) else {}

    @property
    def kill_timeout(self) -> float:
        """The task's ``KillTimeout`` in seconds."""
        return float(self.task_spec.get("KillTimeout") or 0) / 1e9


@runtime_checkable
class TaskDriver(Protocol):
    """The pluggable driver interface (see the module docstring)."""

    def start(self, alloc: AllocHandle) -> None: ...

    def stop(self, alloc: AllocHandle) -> None: ...

    def alive(self, alloc: AllocHandle) -> bool: ...


class NullDriver:
    """Runs nothing. A task is alive from ``start`` until it is stopped or crashed."""

    def start(self, alloc: AllocHandle) -> None:
        alloc.driver_state["alive"] = True

    def stop(self, alloc: AllocHandle) -> None:
        alloc.driver_state["alive"] = False

    def alive(self, alloc: AllocHandle) -> bool:
        return bool(alloc.driver_state.get("alive"))


ArgvFactory = Callable[[AllocHandle], Sequence[str]]


class ProcessDriver:
    """Runs one real subprocess per (allocation, task), like Nomad's ``raw_exec``.

    ``argv_factory(alloc)`` builds the command line. Use ``alloc.ports[label]`` for the host
    port: as in Nomad, ``NOMAD_PORT_<label>`` is the port's ``To`` when the spec sets one (the
    in-container port for docker), and the host port otherwise.

    The child gets ``os.environ`` (unless ``inherit_env=False``) + ``extra_env`` +
    ``alloc.env``, its own session (so ``stop`` kills the whole process group), and stdout /
    stderr in ``<log_dir>/<alloc_id>.<task>.stdout|stderr`` (a temp dir by default; see
    :meth:`log_paths`). ``stop`` sends SIGTERM (or the task's ``KillSignal``), waits up to
    ``kill_timeout`` seconds (default: the task's ``KillTimeout``, capped at 5 s) and then
    SIGKILLs the group.

    When the process exits by itself, ``alive`` reports False with its exit code / signal,
    and the fake applies the job's restart policy (restart in place, or fail the
    allocation and let the reschedule policy replace it).
    """

    def __init__(
        self,
        argv_factory: ArgvFactory,
        *,
        cwd: str | None = None,
        extra_env: dict[str, str] | None = None,
        inherit_env: bool = True,
        log_dir: str | None = None,
        kill_timeout: float | None = None,
    ) -> None:
        self.argv_factory = argv_factory
        self.cwd = cwd
        self.extra_env = dict(extra_env or {})
        self.inherit_env = inherit_env
        self.log_dir = log_dir or tempfile.mkdtemp(prefix="fake-nomad-logs-")
        self.kill_timeout = kill_timeout
        self._lock = threading.Lock()
        self._procs: dict[tuple[str, str], subprocess.Popen[bytes]] = {}
        _LIVE_DRIVERS.add(self)

    def log_paths(self, alloc_id: str, task: str) -> tuple[str, str]:
        base = os.path.join(self.log_dir, f"{alloc_id}.{task}")
        return base + ".stdout", base + ".stderr"

    def start(self, alloc: AllocHandle) -> None:
        argv = list(self.argv_factory(alloc))
        env = dict(os.environ) if self.inherit_env else {}
        env.update(self.extra_env)
        env.update(alloc.env)
        out_path, err_path = self.log_paths(alloc.id, alloc.task)
        out: IO[bytes] = open(out_path, "ab")
        err: IO[bytes] = open(err_path, "ab")
        try:
            proc = subprocess.Popen(
                argv,
                env=env,
                cwd=self.cwd,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=err,
                start_new_session=True,
            )
        except OSError as exc:
            raise DriverError(f"failed to launch command with executor: {exc}") from exc
        finally:
            out.close()
            err.close()
        alloc.exit_code = None
        alloc.signal = 0
        alloc.driver_state["proc"] = proc
        with self._lock:
            self._procs[(alloc.id, alloc.task)] = proc

    @staticmethod
    def _record_exit(alloc: AllocHandle, rc: int) -> None:
        if rc < 0:
            alloc.signal = -rc
            alloc.exit_code = 128 - rc
        else:
            alloc.signal = 0
            alloc.exit_code = rc

    def alive(self, alloc: AllocHandle) -> bool:
        proc: subprocess.Popen[bytes] | None = alloc.driver_state.get("proc")
        if proc is None:
            return False
        rc = proc.poll()
        if rc is None:
            return True
        self._record_exit(alloc, rc)
        return False

    def stop(self, alloc: AllocHandle) -> None:
        proc: subprocess.Popen[bytes] | None = alloc.driver_state.get("proc")
        if proc is None:
            return
        if proc.poll() is None:
            sig = _parse_signal(str(alloc.task_spec.get("KillSignal") or "")) or signal.SIGTERM
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, sig)
            timeout = self.kill_timeout if self.kill_timeout is not None else min(alloc.kill_timeout or 5.0, 5.0)
            deadline = time.monotonic() + timeout
            while proc.poll() is None and time.monotonic() < deadline:
                time.sleep(0.01)
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=5)
        else:
            # The leader exited; make sure nothing it spawned is left in its group.
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
        if proc.returncode is not None:
            self._record_exit(alloc, proc.returncode)
        with self._lock:
            self._procs.pop((alloc.id, alloc.task), None)

    def running_pids(self) -> list[int]:
        """PIDs of the processes this driver has started and not yet reaped."""
        with self._lock:
            return [p.pid for p in self._procs.values() if p.poll() is None]

    def kill_all(self) -> None:
        """SIGKILL every process group this driver started (used at interpreter exit)."""
        with self._lock:
            procs = list(self._procs.values())
            self._procs.clear()
        for proc in procs:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(proc.pid, signal.SIGKILL)


_LIVE_DRIVERS: weakref.WeakSet[ProcessDriver] = weakref.WeakSet()


@atexit.register
def _reap_orphans() -> None:
    # Children run in their own sessions, so nothing else would kill them if a test forgot
    # to stop its FakeNomad.
    for driver in list(_LIVE_DRIVERS):
        driver.kill_all()


def _parse_signal(name: str) -> signal.Signals | None:
    if not name:
        return None
    name = name.upper()
    if not name.startswith("SIG"):
        name = "SIG" + name
    try:
        return signal.Signals[name]
    except KeyError:
        return None
