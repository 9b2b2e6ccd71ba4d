"""Backends the shared pool suite runs against: local always, Docker when an engine and image exist.

In CI (``CI=true``) a missing Docker engine or image is a failure, not a skip: .ci/run installs
the engine and builds the image, so their absence means the setup broke.
"""

from __future__ import annotations

import os
import secrets
import subprocess
from pathlib import Path

import pytest

from atropos.backends.base import Backend
from atropos.backends.local import LocalBackend, LocalBackendConfig

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
    pool_id = pool_id or f"t{secrets.token_hex(4)}"
    if kind == "local":
        return LocalBackend(LocalBackendConfig(slots_per_host=slots, pool_id=pool_id, data_root=DATA_ROOT,
                                               max_timeout_s=120))
    require_docker()
    from atropos.backends.docker import DockerBackend, DockerBackendConfig

    return DockerBackend(DockerBackendConfig(image=DOCKER_IMAGE, slots_per_host=slots, pool_id=pool_id,
                                             cpus=1.0, memory_bytes=1 << 30, workspace_bytes=512 << 20,
                                             max_timeout_s=120))


def host_pid(backend: Backend, host_id: str) -> int | None:
    if isinstance(backend, LocalBackend):
        return backend.pid(host_id)
    return None


def kill_host(backend: Backend, host_id: str, sig: str = "KILL") -> None:
    """Kill a host the way an operator or the OOM killer would: the process or the container."""
    if isinstance(backend, LocalBackend):
        pid = backend.pid(host_id)
        assert pid is not None
        os.kill(pid, {"KILL": 9, "STOP": 19, "CONT": 18}[sig])
    else:
        verb = {"KILL": ["kill"], "STOP": ["pause"], "CONT": ["unpause"]}[sig]
        subprocess.run(["docker", *verb, host_id], check=True, capture_output=True, timeout=30)
