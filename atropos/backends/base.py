"""What every backend provides: sandbox hosts somewhere, each an address, a token and N slots.

A backend answers *where* hosts run (a local process, a Docker container, a Nomad allocation);
*how* a call runs is the host's business. The pool only ever sees ``HostInfo``.
"""

from __future__ import annotations

import abc
import secrets
from typing import TYPE_CHECKING, Literal, get_args

from pydantic import BaseModel, Field

if TYPE_CHECKING:
    from atropos.sandbox.contract.client import HostClient
    from atropos.sandbox.contract.imageref import ImageRef

# Every backend's ``kind`` (its config class's tag in atropos/backends/config.py); here, where the
# CLI can name them without importing any backend.
BackendKind = Literal["local", "docker", "nomad", "ray"]
BACKEND_KINDS: tuple[str, ...] = get_args(BackendKind)


class HostInfo(BaseModel):
    id: str = Field(description="backend-specific id (process id, container id, allocation id)")
    address: str = Field(description="base URL of the host's API, e.g. http://127.0.0.1:40123")
    token: str = Field(repr=False)
    slots: int
    labels: dict[str, str] = Field(default_factory=dict)
    log: str | None = Field(None, description="where the host's own log is: a file path on the pool's machine, "
                                              "else how to read it (e.g. `docker logs ID`); every failure of "
                                              "this host the pool reports names it")


# The one meaning of every backend config's ``prewarm`` (local, docker, ray): the backend starts its
# hosts with ``--no-prewarm`` and the pool picks the moment (atropos/slots/pool_hosts.py, ``HostFleet``).
PREWARM_DESCRIPTION = (
    "start every slot's sandbox ahead of its first call: the pool asks each host (POST /v1/prewarm) "
    "once its whole initial fleet is up, so prewarming never competes with the hosts still starting, "
    "and a later host (scale-up, replacement) as soon as it is ready; the sandboxes then start in the "
    "background (a call to a slot still warming waits for it). Off: each slot's sandbox starts on first use")


def user_pool_id(prefix: str = "py") -> str:
    """``<prefix>-<user>``, the default pool id: the login name of this process's uid (not $USER, which
    anyone can set), characters outside ``[A-Za-z0-9_.-]`` replaced; the uid for a uid without a name.
    Per user, because a pool's id names its hosts, containers and state, and a pool reaps what carries
    its id: two users of one machine must never share one. The CLI's pools are ``cli-<user>``, the
    Python API's ``py-<user>``, so neither reaps the other's."""
    import os
    import pwd

    try:
        name = pwd.getpwuid(os.getuid()).pw_name
    except KeyError:
        name = str(os.getuid())
    return (prefix + "-" + "".join(c if c.isalnum() or c in "_.-" else "-" for c in name))[:64]


def new_token() -> str:
    return secrets.token_urlsafe(32)


def pid_alive(pid: int) -> bool:
    import os

    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class Backend(abc.ABC):
    """Starts and stops sandbox hosts. Implementations must be safe to call concurrently."""

    name: str = "backend"

    @abc.abstractmethod
    async def start_host(self) -> HostInfo:
        """Start one host and return once its API answers (raises InfrastructureError otherwise)."""

    @abc.abstractmethod
    async def stop_host(self, host_id: str) -> None:
        """Stop a host and remove everything it made; unknown ids are ignored."""

    @abc.abstractmethod
    async def alive(self, host_id: str) -> bool:
        """Whether the backend still runs this host (a cheap check, not a health probe)."""

    def host_slots(self) -> int | None:
        """How many slots each host this backend starts will have, if known before starting one
        (the pool rejects at once a group larger than max_hosts x this). Every built-in backend's
        config names it ``slots_per_host``; a backend without one returns None (unknown)."""
        value = getattr(getattr(self, "cfg", None), "slots_per_host", None)
        return value if isinstance(value, int) and value > 0 else None

    def prewarm(self) -> bool:
        """Whether the pool asks each host to prewarm its slots' sandboxes (``POST /v1/prewarm``)
        once it may (``PREWARM_DESCRIPTION``). A built-in backend's config names the switch
        ``prewarm`` and its hosts start with ``--no-prewarm``; a backend without one gets the
        request too, which a host that prewarmed on its own answers with nothing to do."""
        value = getattr(getattr(self, "cfg", None), "prewarm", True)
        return value if isinstance(value, bool) else True

    def removal_order(self, host_ids: list[str]) -> list[str]:
        """Which idle hosts to give back first (Nomad must shrink from the highest index)."""
        return host_ids

    async def reap_orphans(self) -> int:
        """Remove hosts that crashed earlier pools left behind; returns how many."""
        return 0

    async def ship_image(self, client: HostClient, reference: ImageRef) -> None:
        """Before a slot of this host is rooted on task image ``reference``: give the host the image
        if it cannot get it itself (docs/task-images.md). Local and Ray hosts import it from their
        machine's engine on first use: nothing to do here."""
        return None

    @abc.abstractmethod
    async def close(self) -> None:
        """Stop every host this backend started."""
