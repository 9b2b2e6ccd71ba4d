"""Shared fixtures: a real sandbox host process (real bubblewrap) and leased slots on it."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import secrets
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from atropos.sandbox.contract.client import HostClient
from atropos.sandbox.contract.protocol import CallResult, LeaseInfo, ToolCall

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "disabled")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The longest test files first (tests/file_order.py): with ``--dist loadfile`` the minutes-long
    few-test files no longer end the run on one worker while the other waits."""
    from tests import file_order

    items[:] = file_order.longest_first(items, file_order.load(), file_order.default_seconds())


@pytest.fixture(scope="module")
def tokenizer_dir() -> str:
    from atropos.agent.model import ensure_tokenizer_dir

    # fetches the model file if it is missing (a download, no build): the scripted policies need no server
    return str(ensure_tokenizer_dir())


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (for servers a test starts itself)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_for_http(url: str, proc: subprocess.Popen[Any] | None = None, timeout: float = 60.0) -> None:
    """Block until ``url`` answers at all (any status): a server a test started (run-api, ...) is up.
    Fails at once if ``proc`` (that server) exited, else after ``timeout`` seconds."""
    import httpx

    deadline = time.monotonic() + timeout
    while True:
        try:
            httpx.get(url, timeout=2)
            return
        except httpx.HTTPError:
            assert (proc is None or proc.poll() is None) and time.monotonic() < deadline, f"{url} did not answer"
            time.sleep(0.2)


MODEL_SERVER = Path(__file__).resolve().parent.parent / "scripts" / "model_server.py"


@pytest.fixture(scope="session")
def model_url() -> Iterator[str]:
    """The OpenAI-compatible URL of a real model server (scripts/model_server.py) on a free port,
    started on first use and stopped at the end of the session: the modules that use it only send it
    chat requests (it keeps no state between them), so one start serves them all rather than one per
    module (seconds each: the model is loaded anew)."""
    port = free_port()
    started = subprocess.run([sys.executable, str(MODEL_SERVER), "start", "--port", str(port)], timeout=3600)
    assert started.returncode == 0, "model server did not start (see scripts/model_server.py logs)"
    try:
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        subprocess.run([sys.executable, str(MODEL_SERVER), "stop", "--port", str(port)], timeout=60)


async def wait_until(pred: Callable[[], Any], timeout: float = 60.0, interval: float = 0.05, *,
                     what: str | None = None, in_thread: bool = False) -> Any:
    """Poll ``pred`` until it returns a true value, and return that value. After ``timeout`` seconds:
    its last (false) value, so ``assert await wait_until(...)`` fails; with ``what``, an
    AssertionError "timed out waiting for <what>". ``in_thread`` calls ``pred`` in a worker thread
    (a /proc scan, a blocking client: the event loop keeps serving meanwhile). The limit is
    generous on purpose: on a busy 2-core machine what takes 0.1 s alone can take many seconds,
    and a condition that holds returns at once however large the limit."""
    end = time.monotonic() + timeout
    while True:
        value = await asyncio.to_thread(pred) if in_thread else pred()
        if value:
            return value
        if time.monotonic() > end:
            if what is not None:
                raise AssertionError(f"timed out waiting for {what}")
            return value
        await asyncio.sleep(interval)


# above RLIMIT_FSIZE (1 GiB), so the largest-file test meets that limit before the cap
HOST_WORKSPACE_BYTES = 1536 << 20


@dataclass
class RunningHost:
    address: str
    token: str
    proc: subprocess.Popen[bytes]
    data_dir: Path

    def client(self, **kw: Any) -> HostClient:
        return HostClient(self.address, self.token, **kw)


def helper_pid(data_dir: Path) -> int:
    """The host's workspace mount helper (the process that makes the slots' capped tmpfs
    workspaces and the forks' overlays, each slot's in its own namespace: ``slot_ns_pid``)."""
    script = str(Path(os.path.realpath(data_dir)) / "mounthelper.py").encode()
    found = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                if script in Path(f"/proc/{name}/cmdline").read_bytes().split(b"\0"):
                    found.append(int(name))
            except OSError:
                continue
    for pid in found:  # not one of its forks (a slot's namespace, an idmap user namespace)
        try:
            if int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1]) not in found:
                return pid
        except (OSError, IndexError, ValueError):
            continue
    raise AssertionError("no mount helper running for this host")


def slot_ns_among(pids: Iterable[int], slot: int, parents: Iterable[int] | None = None) -> int | None:
    """Among ``pids``, the process holding slot ``slot``'s own mount namespace: the one named
    ``slotns-<slot>`` whose parent is one of ``parents`` (the host's mount helper; default ``pids``
    themselves, for a container's helper and its forks). Another host's slot of the same number has
    another parent."""
    candidates = set(pids)
    helpers = candidates if parents is None else set(parents)
    for pid in candidates:
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            continue
        comm, rest = stat.split("(", 1)[1].rsplit(")", 1)
        if comm == f"slotns-{slot}" and int(rest.split()[1]) in helpers:
            return pid
    return None


def slot_ns_pid(data_dir: Path, slot: int) -> int:
    """The process holding slot ``slot``'s own mount namespace (a fork of this host's mount helper)."""
    helper = helper_pid(data_dir)
    found = slot_ns_among([int(name) for name in os.listdir("/proc") if name.isdigit()], slot, parents=[helper])
    if found is None:
        raise AssertionError(f"no mount namespace for slot {slot}")
    return found


def slot_path(data_dir: Path, slot: int, sub: str = "ws") -> Path:
    """Host-side path of what slot ``slot`` sees as its workspace (``ws``) or run dir (``run``):
    through the slot's own mount namespace, where its capped tmpfs is mounted."""
    real = Path(os.path.realpath(data_dir)) / "slots" / str(slot) / sub
    try:
        return Path(f"/proc/{slot_ns_pid(data_dir, slot)}/root{real}")
    except AssertionError:  # no helper: an uncapped host (--workspace-bytes 0, no isolation)
        return real


def start_host(data_dir: Path, slots: int = 8, extra: list[str] | None = None,
               preexec_fn: Callable[[], Any] | None = None) -> RunningHost:
    token = secrets.token_urlsafe(16)
    env = {**os.environ, "ATROPOS_SANDBOX_TOKEN": token}
    proc = subprocess.Popen(
        [sys.executable, "-m", "atropos.sandbox", "--port", "0", "--slots", str(slots),
         "--data-dir", str(data_dir), "--log-level", "WARNING", *(extra or [])],
        stdout=subprocess.PIPE, env=env, preexec_fn=preexec_fn,
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if not line:
        proc.wait(10)
        raise RuntimeError(f"sandbox host failed to start (exit {proc.returncode})")
    ready = json.loads(line)
    return RunningHost(f"http://127.0.0.1:{ready['port']}", token, proc, data_dir)


def stop_host(host: RunningHost) -> None:
    host.proc.terminate()
    try:
        host.proc.wait(15)
    except subprocess.TimeoutExpired:
        host.proc.kill()
        host.proc.wait()


# Task images' layer store of the tests' hosts: layers are content-addressed and checked against their
# DiffID at import, so a store kept between runs is as good as a fresh one (and saves importing the
# ~200 MB base image every run).
IMAGE_STORE = Path.home() / ".cache" / "atropos-sandbox" / "test-image-store"


@pytest.fixture(scope="session")
def host(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningHost]:
    data = Path(f"/tmp/atropos-test-{os.getpid()}-{secrets.token_hex(3)}")
    # slotd in every sandbox, whatever the tests before needed (auto would start the Python supervisor
    # once most leases used file tools): the catalogue runs on slotd and its hand-over
    running = start_host(data, slots=8, extra=["--workspace-bytes", str(HOST_WORKSPACE_BYTES),
                                               "--image-store", str(IMAGE_STORE), "--native-supervisor", "always"])
    yield running
    stop_host(running)


@dataclass
class LeasedSlot:
    client: HostClient
    lease: LeaseInfo

    async def call(self, tool: str, timeout_s: float | None = None, **args: Any) -> CallResult:
        return await self.client.call(ToolCall(id=secrets.token_hex(4), slot=self.lease.slot,
                                               lease=self.lease.lease, tool=tool, args=args,
                                               timeout_s=timeout_s))

    async def ok(self, tool: str, **args: Any) -> dict[str, Any]:
        result = await self.call(tool, **args)
        assert result.ok, result.error
        assert result.result is not None
        return result.result

    async def sh(self, command: str, **kw: Any) -> dict[str, Any]:
        return await self.ok("bash", command=command, **kw)


@contextlib.asynccontextmanager
async def leased_slot(host: RunningHost) -> AsyncIterator[LeasedSlot]:
    """A slot of ``host`` leased on a client of its own; released (its client closed) on exit."""
    client = host.client()
    lease = await client.lease(f"test-{secrets.token_hex(4)}")
    leased = LeasedSlot(client, lease)
    try:
        yield leased
    finally:
        try:
            await client.release(lease.slot, leased.lease.lease)
        finally:
            await client.aclose()


@pytest.fixture
async def slot(host: RunningHost) -> AsyncIterator[LeasedSlot]:
    async with leased_slot(host) as leased:
        yield leased


@pytest.fixture
async def slot_pair(host: RunningHost) -> AsyncIterator[tuple[LeasedSlot, LeasedSlot]]:
    client = host.client()
    a = LeasedSlot(client, await client.lease("pair-a"))
    b = LeasedSlot(client, await client.lease("pair-b"))
    try:
        yield a, b
    finally:
        for s in (a, b):
            await client.release(s.lease.slot, s.lease.lease)
        await client.aclose()


def _task_images_or_skip(pytestconfig: pytest.Config, build: Callable[[], Any], what: str) -> Any:
    """Build (or find) task images (tests/task_images.py) with the build's progress on the terminal
    (a cold build takes seconds to a minute). Skipped only where the Docker engine is missing, or
    (outside CI) where this machine cannot build the image (the reason says why)."""
    from tests import task_images

    problem = task_images.engine_problem()
    if problem is not None:
        if os.environ.get("CI") == "true":
            pytest.fail(f"Docker tests must run in CI: {problem}")
        pytest.skip(f"Docker unavailable on this machine: {problem}")
    capman = pytestconfig.pluginmanager.getplugin("capturemanager")
    try:
        with capman.global_and_fixture_disabled() if capman else contextlib.nullcontext():
            return build()
    except task_images.TaskImageUnavailable as exc:
        if os.environ.get("CI") == "true":
            pytest.fail(f"task image {what} cannot be built: {exc}")
        pytest.skip(f"task image {what} cannot be built on this machine: {exc}")


@pytest.fixture(scope="session")
def task_image(pytestconfig: pytest.Config) -> Callable[[str], str]:
    """``task_image("pyenv")``: the reference (``atropos-test/pyenv:<recipe key>``) of a task image
    of tests/task_images.py, built on first use in the session and cached by the engine across
    sessions (a changed recipe builds anew)."""
    from tests import task_images

    refs: dict[str, str] = {}

    def get(name: str) -> str:
        if name not in refs:
            refs[name] = _task_images_or_skip(pytestconfig, lambda: task_images.ensure(name).reference, name)
        return refs[name]

    return get


@pytest.fixture(scope="session")
def many_images(pytestconfig: pytest.Config) -> Callable[[int], list[str]]:
    """``many_images(n)``: n distinct task images sharing the base layer (tests/task_images.py build_many)."""
    from tests import task_images

    return lambda n: _task_images_or_skip(pytestconfig, lambda: task_images.build_many(n), f"many-<i> (n={n})")
