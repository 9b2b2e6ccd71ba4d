"""One process's memory, by measurement (issue 40): RSS against the allocator's own view (glibc's
``mallinfo2``), live objects by type (``gc``), the Python heap by allocation site (``tracemalloc``
diffs against a baseline), and ``malloc_trim``.

The pool calls these in its own process; a host serves them on its token-gated
``POST /v1/debug/memory`` (atropos/sandbox/host/server.py), so a soak can take the same figures
from every host process. Nothing here runs unless asked: tracing costs ~2x on allocation-heavy
code and is only ever started on request.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import ctypes
import ctypes.util
import gc
import os
import sys
import tempfile
import threading
import time
import tracemalloc
import types
from collections import Counter
from typing import Any, Literal

from pydantic import BaseModel, Field

# Frames kept per traced allocation: enough to see which of our lines called into a library.
# Each frame costs: 8 frames slowed a loaded pool and host ~10x (a soak then measures tracing);
# 1 frame names the allocating line only, for a fraction of that.
TRACE_FRAMES = 8
# tracemalloc's own bookkeeping and the import system's allocations are not the program's.
_IGNORED = (tracemalloc.__file__, "<frozen importlib._bootstrap>", "<frozen importlib._bootstrap_external>",
            "<unknown>")


class MallocInfo(BaseModel):
    """glibc's ``struct mallinfo2`` in KB: what malloc holds from the kernel and what of it is in use."""

    arena_kb: int  # bytes from sbrk and the thread arenas' heaps (non-mmapped), all arenas
    in_use_kb: int  # uordblks: allocated and not freed (every C, Rust and Python allocation)
    free_kb: int  # fordblks: freed but kept by malloc (the fragmentation RSS can show)
    mmapped_kb: int  # hblkhd: large blocks mmapped one by one (returned to the kernel on free)
    releasable_kb: int  # keepcost: free at the top of the main heap (trimmable without madvise)
    arenas: int | None = None  # malloc arenas (the main one and one per thread that needed its own)


class PyMallocInfo(BaseModel):
    """CPython's small-object allocator (objects up to 512 bytes), which takes its 1 MiB arenas from
    mmap, outside malloc (``mallinfo2`` does not see it): an arena goes back only when all of it is free."""

    arenas: int
    arenas_highwater: int
    allocated_kb: int  # in blocks handed out (live small objects)
    available_kb: int  # in free blocks of its arenas' pools


class SiteGrowth(BaseModel):
    """One allocation site's live bytes and blocks now, against the tracing baseline."""

    site: str  # "file:line" of the frame in this program nearest the allocation (then the innermost)
    size_kb: float
    size_diff_kb: float
    count: int
    count_diff: int


class ContainerGrowth(BaseModel):
    """A list, dict, set or deque that holds more entries than at the baseline: the shape of a
    per-trajectory record left behind, whatever its entries are (ints and strings included, which
    the collector does not track and ``types`` cannot count)."""

    owner: str  # where it hangs: "Class.attribute", "module.global", or its type alone
    type: str
    length: int
    growth: int
    bound: int | None = None  # a deque's maxlen: a window that fills, then stays


class MemoryReport(BaseModel):
    pid: int
    rss_kb: int
    malloc: MallocInfo | None = None  # None where glibc is not the allocator
    # when asked; None while tracemalloc traces (its hooks replace pymalloc's, which then reports nothing)
    pymalloc: PyMallocInfo | None = None
    threads: int
    asyncio_tasks: int | None = None  # None outside a running event loop
    open_fds: int | None = None
    gc_objects: int | None = None  # all objects the collector tracks (containers), when types were counted
    types: dict[str, int] = Field(default_factory=dict)  # the most numerous tracked types, or those asked for
    traced_kb: float | None = None  # the Python heap tracemalloc sees (None: not tracing)
    growth: list[SiteGrowth] = Field(default_factory=list)  # the sites that grew most since the baseline
    trimmed_kb: int | None = None  # RSS given back by malloc_trim(0), when asked
    containers: list[ContainerGrowth] = Field(default_factory=list)  # grown since the container baseline
    trims: TrimStats | None = None  # the periodic malloc_trim's (trim_periodically), if it runs


class MemoryRequest(BaseModel):
    """What a report should include. ``trace``: "start" (re)sets the baseline and starts tracing,
    "diff" reports the growth since it, "stop" ends tracing; ``types``: count live objects by
    type (all of them walked: ~0.1 s per million objects) and report the ``top`` most numerous,
    plus every type named in ``type_names``; ``trim``: call ``malloc_trim(0)`` first."""

    trace: Literal["start", "diff", "stop"] | None = None
    frames: int = Field(default=TRACE_FRAMES, ge=1, le=64)  # per traced allocation, at "start"
    types: bool = False
    type_names: list[str] = Field(default_factory=list, max_length=200)
    top: int = Field(default=25, ge=0, le=500)
    trim: bool = False
    pymalloc: bool = False  # the small-object allocator's statistics (stderr redirected ~1 ms to read them)
    # "start": note the length of every list, dict, set and deque; "diff": report those that grew by
    # at least ``min_growth`` entries since (the ``top`` largest growths)
    containers: Literal["start", "diff"] | None = None
    min_growth: int = Field(default=10, ge=1)


def rss_kb() -> int:
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return 0


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]


def _libc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    try:
        lib = ctypes.CDLL(name)
    except OSError:
        return None
    return lib if hasattr(lib, "mallinfo2") else None  # glibc >= 2.33


_LIBC = _libc()
if _LIBC is not None:
    _LIBC.mallinfo2.restype = _MallInfo2
    _LIBC.malloc_trim.argtypes = [ctypes.c_size_t]
    _LIBC.malloc_trim.restype = ctypes.c_int
    _LIBC.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    _LIBC.mallopt.restype = ctypes.c_int

M_ARENA_MAX = -8  # mallopt parameter (malloc.h)


def mallinfo() -> MallocInfo | None:
    if _LIBC is None:
        return None
    m = _LIBC.mallinfo2()
    return MallocInfo(arena_kb=m.arena // 1024, in_use_kb=m.uordblks // 1024, free_kb=m.fordblks // 1024,
                      mmapped_kb=m.hblkhd // 1024, releasable_kb=m.keepcost // 1024, arenas=_arena_count())


def _arena_count() -> int | None:
    """Arenas glibc made: ``malloc_info`` prints one ``<heap nr=...>`` per arena."""
    if _LIBC is None or not hasattr(_LIBC, "malloc_info") or not hasattr(_LIBC, "open_memstream"):
        return None
    buf, size = ctypes.c_char_p(), ctypes.c_size_t()
    _LIBC.open_memstream.restype = ctypes.c_void_p
    _LIBC.open_memstream.argtypes = [ctypes.POINTER(ctypes.c_char_p), ctypes.POINTER(ctypes.c_size_t)]
    _LIBC.malloc_info.argtypes = [ctypes.c_int, ctypes.c_void_p]
    _LIBC.fclose.argtypes = [ctypes.c_void_p]
    _LIBC.free.argtypes = [ctypes.c_void_p]
    stream = _LIBC.open_memstream(ctypes.byref(buf), ctypes.byref(size))
    if not stream:
        return None
    _LIBC.malloc_info(0, stream)
    _LIBC.fclose(stream)
    text = ctypes.string_at(buf, size.value) if buf.value is not None else b""
    _LIBC.free(ctypes.cast(buf, ctypes.c_void_p))
    return text.count(b"<heap nr=")


def malloc_trim() -> int | None:
    """Give malloc's free pages back to the kernel (every arena, ``madvise`` inside the heaps);
    the RSS this released in KB, None without glibc."""
    if _LIBC is None:
        return None
    before = rss_kb()
    _LIBC.malloc_trim(0)
    return max(0, before - rss_kb())


_STDERR_LOCK = threading.Lock()


def pymalloc() -> PyMallocInfo | None:
    """``sys._debugmallocstats()``'s totals. It prints to the C stderr, so fd 2 points at a
    temporary file for the ~1 ms it takes (a log line written by another thread meanwhile would
    land there: a debug route's price)."""
    if not hasattr(sys, "_debugmallocstats"):
        return None
    with _STDERR_LOCK, tempfile.TemporaryFile() as fh:
        sys.stderr.flush()
        saved = os.dup(2)
        try:
            os.dup2(fh.fileno(), 2)
            sys._debugmallocstats()
        finally:
            os.dup2(saved, 2)
            os.close(saved)
        fh.seek(0)
        text = fh.read().decode(errors="replace")
    values: dict[str, int] = {}
    for line in text.splitlines():
        if line.startswith("# ") and "=" in line:
            key, _, value = line[2:].partition("=")
            with contextlib.suppress(ValueError):
                values[key.strip()] = int(value.strip().replace(",", ""))
    try:
        return PyMallocInfo(arenas=values["arenas allocated current"],
                            arenas_highwater=values["arenas highwater mark"],
                            allocated_kb=values["bytes in allocated blocks"] // 1024,
                            available_kb=values["bytes in available blocks"] // 1024)
    except KeyError:
        return None


def set_arena_max(n: int) -> bool:
    """``mallopt(M_ARENA_MAX, n)``: at most ``n`` malloc arenas from now on (the environment's
    ``MALLOC_ARENA_MAX`` does the same for a process not yet started). False without glibc."""
    return _LIBC is not None and _LIBC.mallopt(M_ARENA_MAX, n) == 1


# The allocator settings that bound a long-running process's RSS (issue 40; measured in
# benchmarks/README.md, "Memory over millions of trajectories"): glibc keeps freed pages, per arena,
# until a trim; a host's threads (asyncio.to_thread for file-system work) each got an arena of
# their own (16 on 2 cores), each keeping its own free pages.
HOST_ARENA_MAX = 2
TRIM_INTERVAL_S = 60.0


async def trim_periodically(interval_s: float = TRIM_INTERVAL_S) -> None:
    """``malloc_trim(0)`` every ``interval_s`` (~0.3-2 ms of the event loop each on a 15 MB heap):
    the free pages glibc kept go back to the kernel, so RSS follows the live heap instead of
    creeping with fragmentation."""
    if _LIBC is None:
        return
    while True:
        await asyncio.sleep(interval_s)
        t0 = time.perf_counter()
        _LIBC.malloc_trim(0)
        TRIMS.add((time.perf_counter() - t0) * 1000)


class TrimStats(BaseModel):
    """The periodic trims so far: how long each held the event loop (the cost on call latency)."""

    count: int = 0
    last_ms: float = 0.0
    max_ms: float = 0.0
    total_ms: float = 0.0

    def add(self, ms: float) -> None:
        self.count += 1
        self.last_ms = round(ms, 3)
        self.max_ms = round(max(self.max_ms, ms), 3)
        self.total_ms = round(self.total_ms + ms, 3)


TRIMS = TrimStats()


def count_types(names: list[str] | None = None, top: int = 25) -> tuple[int, dict[str, int]]:
    """Live objects the collector tracks, by type name: the ``top`` most numerous plus ``names``
    (qualified ``module.Class`` or bare ``Class``; 0 when there are none)."""
    counts: Counter[str] = Counter()
    gc.collect()  # garbage awaiting the collector is not retained: count only what is reachable
    objs = gc.get_objects()
    for obj in objs:
        t = type(obj)
        counts[f"{t.__module__}.{t.__qualname__}"] += 1
    total = len(objs)
    del objs
    out = dict(counts.most_common(top))
    for name in names or []:
        if "." in name:
            out[name] = counts.get(name, 0)
        else:
            out[name] = sum(n for k, n in counts.items() if k.rsplit(".", 1)[-1] == name)
    return total, out


class _Tracer:
    """tracemalloc against one baseline snapshot (one per process: tracing is process-wide)."""

    def __init__(self) -> None:
        self.baseline: tracemalloc.Snapshot | None = None
        self.lock = threading.Lock()

    def start(self, frames: int = TRACE_FRAMES) -> None:
        with self.lock:
            if tracemalloc.is_tracing() and tracemalloc.get_traceback_limit() != frames:
                tracemalloc.stop()
            if not tracemalloc.is_tracing():
                tracemalloc.start(frames)
            gc.collect()
            self.baseline = self._snapshot()

    def stop(self) -> None:
        with self.lock:
            self.baseline = None
            tracemalloc.stop()

    @staticmethod
    def _snapshot() -> tracemalloc.Snapshot:
        return tracemalloc.take_snapshot().filter_traces(
            [tracemalloc.Filter(False, pattern) for pattern in _IGNORED])

    def diff(self, top: int) -> list[SiteGrowth]:
        with self.lock:
            if self.baseline is None or not tracemalloc.is_tracing():
                return []
            gc.collect()
            now = self._snapshot()
            stats = now.compare_to(self.baseline, "traceback")
        by_site: dict[str, list[int]] = {}
        for st in stats:
            key = _site(st.traceback)
            acc = by_site.setdefault(key, [0, 0, 0, 0])
            acc[0] += st.size
            acc[1] += st.size_diff
            acc[2] += st.count
            acc[3] += st.count_diff
        ranked = sorted(by_site.items(), key=lambda kv: kv[1][1], reverse=True)[:top]
        return [SiteGrowth(site=site, size_kb=round(v[0] / 1024, 1), size_diff_kb=round(v[1] / 1024, 1),
                           count=v[2], count_diff=v[3]) for site, v in ranked]


def _site(tb: tracemalloc.Traceback) -> str:
    """The innermost frame, and the nearest frame of this program when that is in a library:
    ``lib.py:10 <- atropos/x.py:20`` names both what allocated and which of our lines asked."""
    frames = list(tb)  # most recent call first (tracemalloc's default order)
    inner = frames[0]
    text = f"{_short(inner.filename)}:{inner.lineno}"
    if "/atropos/" not in inner.filename:
        ours = next((f for f in frames[1:] if "/atropos/" in f.filename), None)
        if ours is not None:
            text += f" <- {_short(ours.filename)}:{ours.lineno}"
    return text


def _short(path: str) -> str:
    for marker in ("/atropos/", "/site-packages/", "/lib/python3"):
        i = path.rfind(marker)
        if i >= 0:
            return path[i + 1:]
    return path


TRACER = _Tracer()

_CONTAINERS = (list, dict, set, collections.deque)


class _Containers:
    """Lengths of every container the collector tracks, against one baseline (by object id: a
    container freed and its id reused can look grown; a growth threshold keeps that rare)."""

    def __init__(self) -> None:
        self.baseline: dict[int, int] = {}

    def start(self) -> None:
        gc.collect()
        self.baseline = {id(o): len(o) for o in _containers()}

    def diff(self, min_growth: int, top: int) -> list[ContainerGrowth]:
        gc.collect()
        grown = []
        # the diagnosis's own records: this baseline, and tracemalloc's baseline snapshot (a list of
        # every traced block, taken after this baseline when both start together)
        own = {id(self.baseline)}
        if TRACER.baseline is not None:
            own.add(id(TRACER.baseline.traces._traces))  # type: ignore[attr-defined]
        for o in _containers():
            if id(o) in own:
                continue
            delta = len(o) - self.baseline.get(id(o), 0)
            if delta >= min_growth:
                grown.append((delta, o))
        grown.sort(key=lambda pair: -pair[0])
        out = [ContainerGrowth(owner=_owner(o), type=type(o).__qualname__, length=len(o), growth=delta,
                               bound=getattr(o, "maxlen", None)) for delta, o in grown[:top]]
        del grown
        return out


def _containers() -> list[Any]:
    """Every list, dict, set and deque reachable from a tracked object: the collector's own list,
    plus the dicts it does not track (a dict holding only strings and numbers, e.g. ids to counts),
    found among what tracked objects refer to."""
    out: dict[int, Any] = {}
    for o in gc.get_objects():
        if type(o) in _CONTAINERS:
            out[id(o)] = o
        for r in gc.get_referents(o):
            if type(r) is dict and not gc.is_tracked(r):
                out[id(r)] = r
    return list(out.values())


def _owner(container: object) -> str:
    """Name a container by what holds it: an object's attribute, a module's global, a class's."""
    for ref in gc.get_referrers(container):
        if isinstance(ref, dict):
            key = next((k for k, v in ref.items() if v is container), None)
            if key is None:
                continue
            for holder in gc.get_referrers(ref):
                if getattr(holder, "__dict__", None) is ref:
                    return f"{_name(holder)}.{key}"
            return f"dict[{key!r}]"
        attrs = getattr(ref, "__dict__", None)  # an instance whose attributes live inline (3.11+)
        if isinstance(attrs, dict):
            key = next((k for k, v in attrs.items() if v is container), None)
            if key is not None:
                return f"{_name(ref)}.{key}"
    return type(container).__qualname__


def _name(holder: object) -> str:
    if isinstance(holder, type):
        return f"{holder.__module__}.{holder.__qualname__}"
    if isinstance(holder, types.ModuleType):
        return holder.__name__
    return f"{type(holder).__module__}.{type(holder).__qualname__}"


CONTAINERS = _Containers()


def report(req: MemoryRequest | None = None) -> MemoryReport:
    """This process's memory now (see ``MemoryRequest`` for the optional parts)."""
    req = req or MemoryRequest()
    trimmed = malloc_trim() if req.trim else None
    if req.containers == "start":
        # before tracing starts: the baseline (an id and a length per container, ~1.2 MB for a host's
        # 21,000) is then untraced, where it read as the traced heap's largest growth at "diff"
        CONTAINERS.start()
    if req.trace == "start":
        TRACER.start(req.frames)
    out = MemoryReport(pid=os.getpid(), rss_kb=rss_kb(), malloc=mallinfo(), threads=threading.active_count(),
                       trimmed_kb=trimmed, pymalloc=pymalloc() if req.pymalloc else None,
                       trims=TRIMS.model_copy() if TRIMS.count else None)
    with contextlib.suppress(RuntimeError):
        out.asyncio_tasks = len(asyncio.all_tasks())
    with contextlib.suppress(OSError):
        out.open_fds = len(os.listdir("/proc/self/fd"))
    if req.types or req.type_names:
        out.gc_objects, out.types = count_types(req.type_names, req.top if req.types else 0)
    if tracemalloc.is_tracing():
        out.traced_kb = round(tracemalloc.get_traced_memory()[0] / 1024, 1)
    if req.containers == "diff":
        out.containers = CONTAINERS.diff(req.min_growth, req.top)
    if req.trace == "diff":
        out.growth = TRACER.diff(req.top)
    elif req.trace == "stop":
        out.growth = TRACER.diff(req.top)
        TRACER.stop()
    return out
