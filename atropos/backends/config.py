"""Which backend runs the sandbox hosts, as data: one config class per backend, told apart by ``kind``.

``BackendConfig`` is a discriminated union: ``{"kind": "docker", "image": ...}`` validates into a
``DockerBackendConfig``; an unknown kind or field is refused; ``.build()`` makes the backend.
``backend_config`` maps what the CLI's settings and an AgentEnv's fields say about the backend
onto it, the one way the CLI, AgentEnv, the tests and the benchmarks all use, so a setting or an
environment variable (``NOMAD_*``, ``DOCKER_HOST``) means the same thing everywhere.

Adding a backend: a module with its ``Backend`` and its config class (``kind`` tag,
``extra="forbid"``, ``build()``), and that class in ``BackendConfig`` below.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError

from atropos.backends.base import BACKEND_KINDS, Backend, BackendKind
from atropos.backends.docker import DockerBackendConfig
from atropos.backends.local import LocalBackendConfig
from atropos.backends.nomad import NomadBackendConfig
from atropos.backends.ray import RayBackendConfig
from atropos.errors import ConfigError, validation_message
from atropos.sandbox.contract.protocol import MaxTimeoutS

BackendConfig = Annotated[
    LocalBackendConfig | DockerBackendConfig | NomadBackendConfig | RayBackendConfig,
    Field(discriminator="kind"),
]
POOL_ID_PATTERN = r"^[A-Za-z0-9_.-]{1,64}$"

__all__ = ["BACKEND_KINDS", "BackendConfig", "BackendKind", "BackendSettings", "backend_config", "build_backend",
           "nomad_job_id", "parse_backend_config"]
_ADAPTER: TypeAdapter[Any] = TypeAdapter(BackendConfig)


class BackendSettings(BaseModel):
    """What the CLI's settings (``ServeSettings``) and an AgentEnv's fields (``AgentEnvConfig``) say
    about the backend. Everything else of a backend's config keeps its default or, for Nomad,
    comes from the environment as with the ``nomad`` CLI."""

    model_config = ConfigDict(extra="forbid")

    kind: BackendKind = "local"
    pool_id: str = Field(pattern=POOL_ID_PATTERN)
    slots_per_host: int = Field(16, ge=1)
    max_timeout_s: MaxTimeoutS | None = None  # None: the backend config's default
    image: str | None = Field(None, description="docker/nomad: sandbox image; default: the backend's")
    nomad_address: str | None = Field(None, description="default: $NOMAD_ADDR, else http://127.0.0.1:4646")
    nomad_job_id: str | None = Field(None, description="default: atropos-<pool_id>")
    ray_address: str | None = Field(None, description="default: $RAY_ADDRESS, else a Ray started in the pool's process")


def nomad_job_id(pool_id: str) -> str:
    """The Nomad job a pool's hosts run in (one job per pool: two pools never share hosts)."""
    return f"atropos-{pool_id}"


def backend_config(s: BackendSettings, environ: Mapping[str, str] | None = None, **overrides: Any) -> BackendConfig:
    """The backend config for these settings; ``overrides`` set any other field of the chosen
    backend's config (an unknown one is refused). ``environ`` (default: ours) supplies ``NOMAD_*``
    and ``ATROPOS_NOMAD_<FIELD>`` for Nomad; a setting given here wins over the environment. The
    Docker engine is found as the docker CLI finds it (``DOCKER_HOST``, ...) unless ``docker_url``
    is given; the Ray cluster as Ray finds it (``RAY_ADDRESS``) unless ``ray_address`` is given, and
    the Ray backend's other fields from ``ATROPOS_RAY_<FIELD>`` (e.g. ``ATROPOS_RAY_NUM_CPUS=2``)."""
    data: dict[str, Any] = {"kind": s.kind, "slots_per_host": s.slots_per_host}
    if s.max_timeout_s is not None:
        data["max_timeout_s"] = s.max_timeout_s
    if s.kind in ("docker", "nomad") and s.image is not None:
        data["image"] = s.image
    if s.kind == "nomad":
        data["job_id"] = s.nomad_job_id or nomad_job_id(s.pool_id)
        if s.nomad_address:
            data["address"] = s.nomad_address
    else:
        data["pool_id"] = s.pool_id
    if s.kind == "ray":
        if s.ray_address:
            data["address"] = s.ray_address
        env = os.environ if environ is None else environ
        for name in RayBackendConfig.model_fields:  # the rest of its settings, as ATROPOS_NOMAD_<FIELD> for Nomad
            value = env.get(f"ATROPOS_RAY_{name.upper()}")
            if value is not None and name != "kind":
                data.setdefault(name, value)
    data.update(overrides)
    try:
        if s.kind == "nomad":
            data.pop("kind")
            return NomadBackendConfig.from_env(None if environ is None else dict(environ), **data)
        config: BackendConfig = _ADAPTER.validate_python(data)
    except ValidationError as exc:
        where = {"nomad": " (settings, NOMAD_*, ATROPOS_NOMAD_*)", "ray": " (settings, ATROPOS_RAY_*)"}.get(s.kind, "")
        problem = validation_message(exc, "value", first=True)
        raise ConfigError(f"invalid {s.kind} backend settings{where}: {problem}") from None
    return config


def parse_backend_config(data: Mapping[str, Any]) -> BackendConfig:
    """A backend config from plain data (a config file's ``backend:`` mapping), ``kind`` first."""
    try:
        config: BackendConfig = _ADAPTER.validate_python(dict(data))
    except ValidationError as exc:
        raise ConfigError(f"invalid backend config: {validation_message(exc, 'value', first=True)}") from None
    return config


def build_backend(s: BackendSettings, environ: Mapping[str, str] | None = None, **overrides: Any) -> Backend:
    return backend_config(s, environ, **overrides).build()

