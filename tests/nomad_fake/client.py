"""The simulated Nomad client: a monitor thread that drives allocations through their
lifecycle with a pluggable :class:`~.drivers.TaskDriver`.

Each tick (default every 20 ms, or at once after any state change) it

1. asks the cluster which driver calls are due (start, liveness check, kill, crash,
   user restart, silent stop of processes on a down node),
2. runs them in a thread pool **without** the state lock,
3. records the outcomes (task events, restart policy, client status), then runs the
   server-side reactions (reschedules, deployment health and progress, delayed and
   blocked evaluations, job status).
"""

from __future__ import annotations

import contextlib
import threading
import traceback
from concurrent.futures import ThreadPoolExecutor

from .drivers import DriverError, TaskDriver
from .state import ClientAction, Cluster


class Monitor:
    def __init__(self, cluster: Cluster, driver: TaskDriver, *, tick: float = 0.02, workers: int = 16) -> None:
        self.cluster = cluster
        self.driver = driver
        self.tick = tick
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="fake-nomad-driver")
        self._thread = threading.Thread(target=self._run, name="fake-nomad-monitor", daemon=True)
        self._tick_lock = threading.Lock()

    def start(self) -> None:
        self._thread.start()

    def kick(self) -> None:
        self._wake.set()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.tick_once()
            except Exception:
                self.errors.append(traceback.format_exc())
            self._wake.wait(self.tick)
            self._wake.clear()

    def tick_once(self) -> None:
        with self._tick_lock:
            acts = self.cluster.plan_client()
            if acts:
                list(self._pool.map(self._execute, acts))
            self.cluster.apply_client(acts)

    def _execute(self, act: ClientAction) -> None:
        h = act.task.handle
        try:
            if act.kind == "start":
                if act.inject_failure is not None:
                    raise DriverError(act.inject_failure)
                self.driver.start(h)
            elif act.kind == "check":
                act.alive = bool(self.driver.alive(h))
                if not act.alive:
                    with contextlib.suppress(Exception):
                        self.driver.stop(h)  # reap anything the task left behind
            else:  # kill | crash | restart | silent_stop
                self.driver.stop(h)
        except BaseException as exc:
            act.error = exc
            if act.kind == "check":
                act.alive = False

    def stop(self) -> None:
        """Stop ticking, then stop every task that still has a process."""
        self._stop.set()
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout=10)
        with self.cluster.lock:
            handles = [
                tr.handle for a in self.cluster.allocs.values() for tr in a.tasks.values() if tr.has_process or tr.busy
            ]
        if handles:
            list(self._pool.map(self._stop_quietly, handles))
        self._pool.shutdown(wait=True)

    def _stop_quietly(self, handle: object) -> None:
        with contextlib.suppress(Exception):
            self.driver.stop(handle)  # type: ignore[arg-type]
