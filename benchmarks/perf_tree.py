"""CPU of a process tree by program, sampled by ``perf record -a`` (where perf is installed and allowed).

The slot cycle's processes are short-lived (a placer shell that execs choom, nsenter, bwrap, the
supervisor, a warm bash): /proc cannot see them and a cgroup's counter cannot tell them apart. A
system-wide ``cpu-clock`` sampling at ``FREQ`` Hz sees every one, and its fork and comm events give
the tree, so each sample of a process descended from the host is counted under its program name as
it was at that moment (``parent>program``, the parent's last name: ``bwrap>python3`` is the
supervisor, ``python3>bash`` the warm bash and the commands it runs). Kernel threads (the deferred
namespace and cgroup teardown, RCU, softirqs) are counted by name beside the tree; everything else
is "other processes" (other load on a shared machine). The sampling itself costs ~1% of the CPU.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import tempfile
from collections import defaultdict
from pathlib import Path

from benchmarks.common import process_tree

FREQ = 997
_SAMPLE = re.compile(r"^\s*(.+?)\s+(-?\d+)/(-?\d+)\s+([\d.]+):\s*(.*)$")
_FORK = re.compile(r"PERF_RECORD_FORK\((\d+):\d+\):\((\d+):\d+\)")
_COMM = re.compile(r"PERF_RECORD_COMM(?: exec)?: (.+):(\d+)/\d+")
KERNEL_THREADS = ("kworker", "ksoftirqd", "rcu", "kthreadd", "migration", "kcompactd", "khugepaged", "kswapd")


def available() -> str | None:
    """Why perf cannot sample here, or None."""
    if shutil.which("perf") is None:
        return "perf is not installed"
    try:
        out = subprocess.run(["perf", "record", "-a", "-e", "cpu-clock", "-F", str(FREQ), "-o", "/dev/null",
                              "--", "true"], capture_output=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"perf record failed: {exc}"
    return None if out.returncode == 0 else f"perf record failed: {out.stderr.decode(errors='replace')[-200:]}"


class PerfTree:
    """``start()``, the work, ``stop(roots)`` -> CPU seconds per label of the roots' trees."""

    def __init__(self) -> None:
        self._dir = Path(tempfile.mkdtemp(prefix="atropos-perf-"))
        self._proc: subprocess.Popen[bytes] | None = None

    def start(self, roots: dict[int, str]) -> None:
        """``roots``: pid -> label of a tree (the host server, the mount helper, the pool; a tree
        inside another one after it): the processes alive now are known by /proc, later ones by perf.
        Returns once perf samples (it starts disabled and acknowledges its enabling)."""
        ctl, ack = self._dir / "ctl", self._dir / "ack"
        os.mkfifo(ctl)
        os.mkfifo(ack)
        self._proc = subprocess.Popen(["perf", "record", "-a", "-q", "-e", "cpu-clock", "-F", str(FREQ), "-D", "-1",
                                       "--control", f"fifo:{ctl},{ack}", "-o", str(self._dir / "perf.data")],
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        with open(ctl, "w") as c, open(ack) as a:
            c.write("enable\n")
            c.flush()
            a.readline()
        self._roots = roots
        self._seed: dict[int, tuple[int, str, str]] = {}
        for root, label in roots.items():
            for pid in process_tree([root]):
                if pid == self._proc.pid:
                    continue  # perf itself (a child of the pool's process) is not the pool's work
                f = _stat(pid)
                if f is not None:
                    self._seed[pid] = (f[0], f[1], label)
                elif pid in self._seed:
                    self._seed[pid] = (*self._seed[pid][:2], label)

    def stop(self) -> dict[str, float]:
        """CPU seconds per label: a root's own samples under its label, its descendants' under
        ``label: parent>program``, kernel threads and other processes beside them."""
        assert self._proc is not None
        self._proc.send_signal(signal.SIGINT)
        self._proc.wait(timeout=60)
        script = subprocess.run(["perf", "script", "-i", str(self._dir / "perf.data"), "--show-task-events",
                                 "-F", "comm,pid,tid,time"], capture_output=True, text=True, timeout=300).stdout
        shutil.rmtree(self._dir, ignore_errors=True)
        return attribute(script.splitlines(), self._roots, 1.0 / FREQ, self._seed)

    def close(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._proc.wait(timeout=10)
        shutil.rmtree(self._dir, ignore_errors=True)


def attribute(lines: list[str], roots: dict[int, str], period_s: float,
              seed: dict[int, tuple[int, str, str]] | None = None) -> dict[str, float]:
    """Seconds per label from ``perf script --show-task-events`` lines (see the module docstring);
    ``seed``: pid -> (parent pid, program, tree label) of the processes alive when sampling began."""
    seed = seed or {}
    parent = {pid: v[0] for pid, v in seed.items()}
    name = {pid: v[1] for pid, v in seed.items()}
    owner = {pid: v[2] for pid, v in seed.items()} | roots  # pid -> the label of the tree it belongs to
    out: dict[str, float] = defaultdict(float)
    for line in lines:
        m = _SAMPLE.match(line)
        if m is None:
            continue
        comm, pid, rest = m.group(1), int(m.group(2)), m.group(5)
        if m.group(4).strip("0.") == "":
            continue  # perf's own summary of the tasks that existed when it began: the seed knows them
        if rest.startswith("PERF_RECORD_FORK"):
            f = _FORK.search(rest)
            if f is not None:
                child, par = int(f.group(1)), int(f.group(2))
                if child != par:
                    parent[child] = par
                    name[child] = name.get(par, comm)
                    if par in owner:
                        owner[child] = owner[par]
            continue
        if rest.startswith("PERF_RECORD_COMM"):
            c = _COMM.search(rest)
            if c is not None:
                name[int(c.group(2))] = c.group(1)
            continue
        if rest.startswith("PERF_RECORD"):
            continue
        if pid == 0:
            continue  # idle
        tree = owner.get(pid)
        if tree is None:
            kind = next((k for k in KERNEL_THREADS if comm.startswith(k)), None)
            out[f"kernel threads: {kind}" if kind else "other processes"] += period_s
        elif pid in roots:
            out[tree] += period_s
        else:
            out[f"{tree}: {name.get(parent.get(pid, -1), '?')}>{comm}"] += period_s
    return dict(out)


def _stat(pid: int) -> tuple[int, str] | None:
    """(parent pid, program name) from /proc/<pid>/stat."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_bytes()
    except OSError:
        return None
    comm = raw[raw.index(b"(") + 1:raw.rindex(b")")].decode(errors="replace")
    return int(raw.rsplit(b")", 1)[1].split()[1]), comm
