"""The Nomad backend's settings: the cluster, the job it registers, how it behaves.

Settings come from keyword arguments, ``ATROPOS_NOMAD_<FIELD>`` and the Nomad CLI's own variables
(``NOMAD_ADDR``, ``NOMAD_TOKEN``, ...), so a pool reaches the cluster the ``nomad`` CLI reaches.
"""

from __future__ import annotations

import os
import re
import warnings
from typing import TYPE_CHECKING, Any, Literal

from pydantic import Field, field_validator, model_validator

from atropos.backends.slot_caps import ContainerSlotCaps, ContainerWorkspaceBytes

if TYPE_CHECKING:
    from atropos.backends.nomad.backend import NomadBackend

VARIABLE_PATH = re.compile(r"[a-zA-Z0-9\-_~/]{1,128}")  # nomad/structs/variables.go validVariablePath

# The Nomad CLI's variables and the fields they set.
NOMAD_ENV = (("NOMAD_ADDR", "address"), ("NOMAD_TOKEN", "token"), ("NOMAD_NAMESPACE", "namespace"),
             ("NOMAD_REGION", "region"), ("NOMAD_CACERT", "ca_cert"), ("NOMAD_CLIENT_CERT", "client_cert"),
             ("NOMAD_CLIENT_KEY", "client_key"))


class NomadBackendConfig(ContainerSlotCaps):
    """Slot caps (``ContainerSlotCaps``): 1 GiB, 512 pids, 1 CPU and a 128 MiB workspace per slot,
    in the subtree atropos-runc delegates."""

    kind: Literal["nomad"] = "nomad"
    # -- the cluster --------------------------------------------------------------------------
    address: str = Field("http://127.0.0.1:4646", description="Nomad HTTP API address (https:// for TLS)")
    token: str | None = Field(None, repr=False, description="ACL token SecretID, sent as X-Nomad-Token")
    namespace: str = "default"
    region: str | None = Field(None, description="default: the agent's region")
    ca_cert: str | None = Field(None, description="PEM file of the CA that signed the agent's certificate")
    client_cert: str | None = Field(None, description="PEM client certificate (mTLS)")
    client_key: str | None = Field(None, description="PEM key of client_cert")
    verify: bool = Field(True, description="verify the agent's TLS certificate")
    # -- the job ------------------------------------------------------------------------------
    job_id: str = Field("atropos-sandbox", pattern=r"^[A-Za-z0-9_.-]{1,128}$")
    image: str = "atropos-sandbox:dev"
    cpu: int = Field(2000, ge=100, description="CPU MHz reserved per host")
    memory: int = Field(4096, ge=256, description="MB per host: the container's hard limit (tmpfs counts)")
    workspace_bytes: int = Field(2 << 30, ge=64 << 20, description="size of the tmpfs holding all workspaces")
    slot_workspace_bytes: ContainerWorkspaceBytes = 128 << 20
    pids_limit: int = Field(4096, ge=64)
    datacenters: list[str] = Field(default_factory=lambda: ["*"])
    seccomp_profile: str = Field("/etc/atropos-sandbox/seccomp.json",
                                 description="outer seccomp profile, a path on every Nomad client")
    runtime: str = Field("atropos-runc", description="OCI runtime: runc with /proc unmasked (nomad/README.md)")
    token_delivery: Literal["variable", "job"] = Field(
        "variable", description="where Nomad keeps the host token, which a template renders into the task's "
        "secrets/token (0400) either way: variable: the Nomad variable nomad/jobs/<job_id> (default); job: the "
        "job spec itself, readable by every ACL token that can read the job (weaker; for job IDs no variable "
        "path takes and ACL tokens without variable write)")
    image_volume: str | None = Field(
        None, description="a Nomad host volume (client `host_volume`, writable by uid 1000) holding the hosts' "
        "task-image layer store (docs/task-images.md): shared by the hosts of a node and kept across allocations. "
        "Default: none; the store then lives in the container's /slots tmpfs and goes with it")
    ship_images: bool = Field(True, description="the pool ships a task image from its machine's Docker engine to a "
                              "host before a slot is rooted on it (a Nomad task's host has no engine of its own)")
    docker_url: str | None = Field(None, description="the Docker engine task images are shipped from; default from "
                                   "the environment (DOCKER_HOST, as the docker CLI)")
    # -- behaviour ----------------------------------------------------------------------------
    start_timeout_s: float = Field(120.0, gt=0, description="placement + image pull + health, per host")
    connect_timeout_s: float = Field(5.0, gt=0)
    request_timeout_s: float = Field(15.0, gt=0)
    watch_wait_s: float = Field(30.0, gt=0, description="wait of the blocking query on the job's allocations")
    spare_grace_s: float = Field(30.0, ge=0, description="an unused allocation is kept this long for adoption")
    purge_on_close: bool = True

    @classmethod
    def from_env(cls, environ: dict[str, str] | None = None, **overrides: Any) -> NomadBackendConfig:
        """Settings from the Nomad CLI's variables (NOMAD_ADDR, NOMAD_TOKEN, NOMAD_NAMESPACE,
        NOMAD_REGION, NOMAD_CACERT, NOMAD_CLIENT_CERT, NOMAD_CLIENT_KEY, NOMAD_SKIP_VERIFY) and
        ``ATROPOS_NOMAD_<FIELD>``; keyword arguments win."""
        env = dict(os.environ if environ is None else environ)
        data: dict[str, Any] = {name: env[var] for var, name in NOMAD_ENV if env.get(var)}
        if env.get("NOMAD_SKIP_VERIFY", "").lower() in ("1", "true", "yes"):
            data["verify"] = False
        for name in cls.model_fields:
            value = None if name == "kind" else env.get(f"ATROPOS_NOMAD_{name.upper()}")
            if value is not None:
                data[name] = [v.strip() for v in value.split(",") if v.strip()] if name == "datacenters" else value
        data.update({k: v for k, v in overrides.items() if v is not None})
        return cls.model_validate(data)

    def build(self) -> NomadBackend:
        from atropos.backends.nomad.backend import NomadBackend

        return NomadBackend(self)

    @field_validator("token_delivery", mode="before")
    @classmethod
    def _env_is_job(cls, v: Any) -> Any:
        # "env" put the token in the job's Env, hence in the host's environment; no delivery does
        # that any more, and what was left of it (the token in the job spec) is "job".
        if v == "env":
            warnings.warn("NomadBackendConfig: token_delivery='env' is deprecated, use 'job' (the token stays in "
                          "the job spec, and reaches the host as a file, never in its environment)",
                          FutureWarning, stacklevel=2)
            return "job"
        return v

    @model_validator(mode="after")
    def _slot_fits(self) -> NomadBackendConfig:
        if self.slot_workspace_bytes > self.workspace_bytes:
            raise ValueError(f"slot_workspace_bytes ({self.slot_workspace_bytes}) exceeds workspace_bytes "
                             f"({self.workspace_bytes}), the tmpfs holding every slot's workspace")
        return self

    @model_validator(mode="after")
    def _variable_path_valid(self) -> NomadBackendConfig:
        # Nomad refuses variable paths outside ^[a-zA-Z0-9-_~/]{1,128}$ (no "." : it is the template
        # syntax's separator), and the token lives at nomad/jobs/<job_id>.
        path = f"nomad/jobs/{self.job_id}"
        if self.token_delivery == "variable" and not VARIABLE_PATH.fullmatch(path):
            raise ValueError(f"job_id {self.job_id!r} cannot name the Nomad variable {path!r} the token is "
                             "delivered through (letters, digits, '-', '_', '~' only; at most 117 characters); "
                             "rename the job or set token_delivery='job'")
        return self
