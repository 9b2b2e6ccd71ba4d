"""The images a sandbox host holds: imported once into its layer store, then a slot root on demand
(docs/task-images.md).

An image is named by the reference the local Docker engine knows it by (``repo/task:tag``) or given
as an OCI layout on the host. The engine is asked for the image's id on every use (one small API
call): a tag that moved to a rebuilt image is imported again, never served stale. What was
imported is remembered under ``<store>/images/<id>.json``, so a restarted host re-imports nothing.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

from atropos.errors import ImageRejected
from atropos.sandbox.contract.hostdirs import owned_dir
from atropos.sandbox.host.images.layer_store import LayerStore
from atropos.sandbox.host.images.sources import (
    DOCKER_SOCKET,
    ImageConfig,
    docker_image_id,
    import_from_docker,
    import_oci_layout,
)

# What ``docker run`` puts in a process's environment when the image does not say (its default PATH).
DOCKER_DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


@dataclass
class ImageRoot:
    """An image ready to be a slot root: its config and its layers in the store, bottom first."""

    image_id: str
    config: ImageConfig
    lowers: tuple[Path, ...]
    imported_at: float = field(default_factory=time.time)
    last_used: float = field(default_factory=time.monotonic)
    users: set[int] = field(default_factory=set)  # slots whose root is this image now

    @property
    def reference(self) -> str:
        return self.config.reference

    def env(self) -> dict[str, str]:
        """The environment of every process of the slot, as ``docker run`` gives it (without
        ``-t``): the image's ``Env`` over a default ``PATH``, ``HOME`` of root unless set."""
        env = {"PATH": DOCKER_DEFAULT_PATH, "HOSTNAME": "sandbox"}
        for item in self.config.env:
            key, sep, value = item.partition("=")
            if sep and key:
                env[key] = value
        env.setdefault("HOME", "/root")
        return env

    @property
    def working_dir(self) -> str:
        wd = os.path.normpath(self.config.working_dir or "/")
        return wd if wd.startswith("/") else "/" + wd


class HostImages:
    """The host's image service: its layer store and the images imported into it."""

    def __init__(self, root: Path, *, docker_socket: str = DOCKER_SOCKET) -> None:
        self.root = root
        self.store = LayerStore(root)
        owned_dir(root / "images", 0o700)
        self.docker_socket = docker_socket
        self.images: dict[str, ImageRoot] = {}  # by image id
        self.refs: dict[str, str] = {}  # reference -> image id, as last seen
        self._locks: dict[str, asyncio.Lock] = {}
        self._load()

    def _record(self, image_id: str) -> Path:
        return self.root / "images" / f"{hashlib.sha256(image_id.encode()).hexdigest()}.json"

    def _load(self) -> None:
        for path in (self.root / "images").glob("*.json"):
            try:
                raw = json.loads(path.read_text())
                config = ImageConfig.model_validate(raw["config"])
                root = ImageRoot(str(raw["id"]), config, tuple(self.store.path(d) for d in config.diff_ids))
            except (OSError, ValueError, KeyError, ImageRejected):
                continue
            if all(p.is_dir() for p in root.lowers):
                self.images[root.image_id] = root
                self.refs[config.reference] = root.image_id

    async def get(self, reference: str) -> ImageRoot:
        """The image ``reference`` names, imported first when the store lacks it (one import per
        reference at a time; others wait for it)."""
        if not reference or len(reference) > 512 or "\0" in reference:
            raise ImageRejected(f"not an image reference: {reference[:80]!r}")
        lock = self._locks.setdefault(reference, asyncio.Lock())
        async with lock:
            image_id = await asyncio.to_thread(self._current_id, reference)
            root = self.images.get(image_id)
            if root is None:
                root = await asyncio.to_thread(self._import, reference, image_id)
                self.images[image_id] = root
            self.refs[reference] = image_id
            root.last_used = time.monotonic()
            return root

    def _current_id(self, reference: str) -> str:
        if reference.startswith("oci:"):
            return "oci:" + hashlib.sha256(Path(reference[4:]).joinpath("index.json").read_bytes()).hexdigest()
        return docker_image_id(reference, socket_path=self.docker_socket)

    def _import(self, reference: str, image_id: str) -> ImageRoot:
        if reference.startswith("oci:"):
            imported = import_oci_layout(self.store, Path(reference[4:]))
            config = imported.config.model_copy(update={"reference": reference})
        else:
            config = import_from_docker(self.store, reference, socket_path=self.docker_socket).config
        root = ImageRoot(image_id, config, tuple(self.store.path(d) for d in config.diff_ids))
        tmp = self._record(image_id).with_suffix(".tmp")
        tmp.write_text(json.dumps({"id": image_id, "config": config.model_dump(mode="json")}))
        os.replace(tmp, self._record(image_id))
        return root

    def held(self) -> list[dict[str, object]]:
        """What the host holds, for its status: every image and its layers."""
        return [{"reference": r.reference, "id": r.image_id, "layers": len(r.lowers), "slots": sorted(r.users)}
                for r in self.images.values()]
