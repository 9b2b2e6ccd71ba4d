"""Backends the shared pool suite runs against: local always, Docker when an engine and image exist.

In CI (``CI=true``) a missing Docker engine or image is a failure, not a skip: .ci/run installs
the engine and builds the image, so their absence means the setup broke.

``make_backend("nomad", ...)`` gives a NomadBackend on an in-process fake Nomad agent
(tests/nomad_fake) whose ProcessDriver runs real sandbox hosts; it is not in ``BACKENDS`` (the
orphan test kills the pool's process, and the fake would die with it), tests/test_nomad_backend.py
runs the shared scenarios on it.
"""

from __future__ import annotations

import atexit
import os
import secrets
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from atropos.backends.base import Backend
from atropos.backends.config import BackendSettings, build_backend
from atropos.backends.local import LocalBackend
from atropos.slots.config import PoolConfig
from atropos.slots.pool import SlotPool

DOCKER_IMAGE = os.environ.get("ATROPOS_SANDBOX_IMAGE", "atropos-sandbox:dev")
DATA_ROOT = Path("/tmp/atropos-sandbox-tests")


def docker_problem() -> str | None:
    try:
        info = subprocess.run(["docker", "info"], capture_output=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"docker CLI unusable: {exc}"
    if info.returncode != 0:
        return "no Docker engine is running (scripts/docker_engine.sh starts one)"
    image = subprocess.run(["docker", "image", "inspect", DOCKER_IMAGE], capture_output=True, timeout=20)
    if image.returncode != 0:
        return f"image {DOCKER_IMAGE} is missing (scripts/build_image.sh builds it)"
    return None


def require_docker() -> None:
    problem = docker_problem()
    if problem is None:
        return
    if os.environ.get("CI") == "true":
        pytest.fail(f"Docker tests must run in CI: {problem}")
    pytest.skip(f"Docker unavailable on this machine: {problem}")


BACKENDS = ["local", pytest.param("docker", marks=pytest.mark.docker)]


def make_backend(kind: str, slots: int, pool_id: str | None = None) -> Backend:
    """A backend built the way the CLI and AgentEnv build one (atropos.backends.config), with the
    tests' smaller limits on top."""
    pool_id = pool_id or f"t{secrets.token_hex(4)}"
    overrides: dict[str, Any]
    if kind == "nomad":
        overrides = nomad_test_overrides(shared_nomad_fake().address)
    elif kind == "local":
        overrides = {"data_root": DATA_ROOT}
    else:
        require_docker()
        overrides = {"cpus": 1.0, "memory_bytes": 1 << 30, "workspace_bytes": 512 << 20}
    settings = BackendSettings(kind=kind, pool_id=pool_id, slots_per_host=slots, max_timeout_s=120,
                               image=DOCKER_IMAGE)
    return build_backend(settings, environ={}, **overrides)  # environ={}: no NOMAD_* of the machine


def local_shard_backend(slots: int, index: int, pool_id: str) -> Backend:
    """Shard ``index``'s backend of a ShardedPool (atropos/slots/shards.py): real local sandbox hosts
    under the shard's own pool id (a module the shard process can import, unlike a test file)."""
    return make_backend("local", slots=slots, pool_id=pool_id)


def pool_cfg(**kw: Any) -> PoolConfig:
    """The tests' pool settings: one host, frequent probes, a generous wait for a slot (``kw`` wins)."""
    base: dict[str, Any] = {"min_hosts": 1, "max_hosts": 1, "health_interval_s": 0.5, "acquire_timeout_s": 120}
    return PoolConfig.model_validate({**base, **kw})


def local_pool(slots: int, pool_id: str | None = None, **kw: Any) -> SlotPool:
    """A pool on the local backend, not started (``async with local_pool(2) as pool:``)."""
    if pool_id is not None:
        kw["pool_id"] = pool_id
    return SlotPool(make_backend("local", slots=slots, pool_id=pool_id), pool_cfg(**kw))


# -- Nomad ----------------------------------------------------------------------------------------
NOMAD_DATA_ROOT = DATA_ROOT / "nomad"
_SHARED_FAKE: Any = None


def sandbox_host_argv(data_root: Path) -> Callable[[Any], list[str]]:
    """ProcessDriver argv for a fake Nomad allocation: the job's own docker ``args`` (slots, timeout,
    the token file in the task's secrets dir, as Nomad interpolated them) run as
    ``python -m atropos.sandbox``, on the allocation's host port, with a local data dir."""

    def argv(alloc: Any) -> list[str]:
        # the fake has no atropos-runc to delegate /run/atropos/cgroup: the host nests its slot
        # cgroups under its own cgroup instead
        args = [str(a) for a in alloc.config.get("args") or [] if not str(a).startswith("--cgroup-dir=")]
        for flag, value in (("--host", "127.0.0.1"), ("--port", str(alloc.ports["http"])),
                            ("--data-dir", str(data_root / alloc.id))):
            if flag in args:
                args[args.index(flag) + 1] = value
            else:
                args += [flag, value]
        return [sys.executable, "-m", "atropos.sandbox", *args, "--parent-pid", str(os.getpid()),
                "--log-level", "WARNING"]

    return argv


def nomad_data_dir(name: str) -> Path:
    """A data root every slot uid can traverse (0o755 all the way down)."""
    path = NOMAD_DATA_ROOT / name
    for d in (DATA_ROOT, NOMAD_DATA_ROOT, path):
        d.mkdir(exist_ok=True)
        os.chmod(d, 0o755)
    return path


def nomad_test_overrides(address: str) -> dict[str, Any]:
    """Nomad settings for the fake: the default token delivery (a Nomad variable rendered into the task's
    secrets/token, which the host reads with --token-file), short waits."""
    return {"address": address, "start_timeout_s": 60, "watch_wait_s": 5, "connect_timeout_s": 2,
            "request_timeout_s": 5}


def nomad_test_config(address: str, *, slots: int, **kw: Any) -> Any:
    """Backend settings for the fake (``kw`` wins)."""
    from atropos.backends.nomad import NomadBackendConfig

    base: dict[str, Any] = {**nomad_test_overrides(address), "job_id": f"atropos-t{secrets.token_hex(4)}",
                            "slots_per_host": slots, "max_timeout_s": 120}
    base.update(kw)
    return NomadBackendConfig.model_validate(base)


def start_nomad_fake(nodes: int = 1, name: str | None = None) -> Any:
    """A started FakeNomad running real sandbox hosts (the caller stops it)."""
    from nomad_fake import FakeNomad, ProcessDriver

    data = nomad_data_dir(name or secrets.token_hex(4))
    driver = ProcessDriver(sandbox_host_argv(data), log_dir=str(data), kill_timeout=0.5)
    return FakeNomad(driver=driver, nodes=nodes, time_scale=0.02).start()


def shared_nomad_fake() -> Any:
    global _SHARED_FAKE
    if _SHARED_FAKE is None:
        _SHARED_FAKE = start_nomad_fake(nodes=2, name=f"shared-{os.getpid()}")
        atexit.register(shutil.rmtree, _SHARED_FAKE.driver.log_dir, True)
        atexit.register(_SHARED_FAKE.stop)  # atexit runs last-registered first: stop, then remove
    return _SHARED_FAKE


def nomad_host_pid(alloc_id: str) -> int | None:
    """The sandbox host process a fake Nomad allocation runs (its --data-dir ends in the alloc ID)."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"atropos.sandbox" in argv and any(a.endswith(alloc_id.encode()) for a in argv):
            return int(entry.name)
    return None


def host_pid(backend: Backend, host_id: str) -> int | None:
    if isinstance(backend, LocalBackend):
        return backend.pid(host_id)
    if backend.name == "nomad":
        return nomad_host_pid(host_id)
    return None


def kill_host(backend: Backend, host_id: str, sig: str = "KILL") -> None:
    """Kill a host the way an operator or the OOM killer would: the process or the container."""
    if isinstance(backend, LocalBackend):
        pid = backend.pid(host_id)
        assert pid is not None
        os.kill(pid, {"KILL": 9, "STOP": 19, "CONT": 18}[sig])
    elif backend.name == "nomad":
        # The process of the allocation, as the OOM killer would hit it; the fake notices the exit
        # and applies the job's restart and reschedule policies.
        pid = nomad_host_pid(host_id)
        assert pid is not None, f"no sandbox host process for allocation {host_id}"
        os.kill(pid, {"KILL": 9, "STOP": 19, "CONT": 18}[sig])
    else:
        verb = {"KILL": ["kill"], "STOP": ["pause"], "CONT": ["unpause"]}[sig]
        subprocess.run(["docker", *verb, host_id], check=True, capture_output=True, timeout=30)
