"""The images a sandbox host holds: imported once into its layer store, then a slot root on demand
(docs/task-images.md).

An image is named by the reference the local Docker engine knows it by (``repo/task:tag``) or given
as an OCI layout on the host. The engine is asked for the image's id on every use (one small API
call): a tag that moved to a rebuilt image is imported again, never served stale. What was
imported is remembered under ``<store>/images/<id>.json``, so a restarted host re-imports nothing.

**Refused at the door.** An import stages the image's new layers, checks the image
(atropos/sandbox/host/images/image_check.py) and only then moves them into the store
(image_accept.py). A refused image leaves nothing, and is remembered by its id: every later lease
of it is the same ``image_rejected`` at once, before any slot is touched.

**Disk budget.** The store is shared by the hosts of a machine and kept under ``budget_bytes``.
An import may write at most the budget less what images in use hold (they cannot be evicted):
bytes and entries are counted as layers unpack (layer_store.ImportBudget), and an import past
either stops and is refused with the numbers. After an import (or a ``derive``) that leaves the
store over budget, the least recently used images are evicted with those of their layers no other
image has, and so are layers no image records (a host that died mid-import).

An image in use is never evicted, by any host: a host holds a shared ``flock`` on
``<store>/images/<id>.lock`` while the image is in its table (from its first use until it has been
idle for ``IDLE_S`` with no slot on it), and eviction takes that lock exclusively without waiting:
held anywhere, the image stays. A host that finds an image's layers gone imports it again.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import hashlib
import json
import logging
import os
import secrets
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

from atropos.errors import ImageOverBudget, ImageRejected
from atropos.sandbox.contract import registry
from atropos.sandbox.contract.hostdirs import owned_dir, remove_tree
from atropos.sandbox.contract.imageref import DERIVED_PREFIX, ImageRef
from atropos.sandbox.host.images import userns_import
from atropos.sandbox.host.images.image_accept import accept
from atropos.sandbox.host.images.image_check import MAX_LOWERS, check_image
from atropos.sandbox.host.images.image_root import ImageRoot
from atropos.sandbox.host.images.layer_store import DEFAULT_LAYER_ENTRIES, ImportBudget, LayerStore
from atropos.sandbox.host.images.layer_trees import shift_owner, tree_bytes
from atropos.sandbox.host.images.sources import (
    DOCKER_SOCKET,
    ImageConfig,
    ImportedImage,
    docker_image_id,
    import_docker_archive,
    import_from_docker,
    import_from_engine_dirs,
    import_oci_layout,
    oci_image_id,
)

log = logging.getLogger(__name__)
IDLE_S = 600.0  # an image no slot used for this long leaves the host's table (and may be evicted)
DEFAULT_BUDGET_BYTES = 64 << 30
MAX_REJECTED = 4096  # refusals remembered (by image id), oldest forgotten first


class HostImages:
    """The host's image service: its layer store and the images imported into it."""

    def __init__(self, root: Path, *, docker_socket: str = DOCKER_SOCKET,
                 budget_bytes: int = DEFAULT_BUDGET_BYTES, layer_entries: int = DEFAULT_LAYER_ENTRIES,
                 accounting: bool = True) -> None:
        self.root = root
        self.budget_bytes = budget_bytes
        self.layer_entries = layer_entries
        self.accounting = accounting  # off: imports are not bounded while unpacking (the benchmark's baseline)
        self.store = LayerStore(root)
        self.rejected: dict[str, str] = {}  # image id -> why it was refused
        owned_dir(root / "images", 0o700)
        self.docker_socket = docker_socket
        # by reference: a slot reports the name it was asked for; two names of one image share its
        # layers (and each holds a pin on it)
        self.images: dict[str, ImageRoot] = {}
        self.refs: dict[str, str] = {}  # reference -> image id, as last seen
        # registry references the pool shipped (a Docker or Nomad host: the pool fetched them, the
        # pool checks the registry's digest on every lease and ships a moved tag again)
        self.shipped: set[str] = set()
        self._retired: list[ImageRoot] = []  # a name that moved to another image, still under a slot
        self._locks: dict[str, asyncio.Lock] = {}

    def _record(self, image_id: str) -> Path:
        return self.root / "images" / f"{hashlib.sha256(image_id.encode()).hexdigest()}.json"

    def _read_record(self, path: Path) -> ImageRoot | None:
        try:
            raw = json.loads(path.read_text())
            config = ImageConfig.model_validate(raw["config"])
            return ImageRoot(str(raw["id"]), config, tuple(self.store.path(d) for d in config.store_layers))
        except (OSError, ValueError, KeyError, ImageRejected):
            return None

    def _refused(self, image_id: str, exc: ImageRejected) -> ImageRejected:
        """Remember a refusal (every later lease of the image gets it at once), unless it was for
        room (``ImageOverBudget``: images in use may go)."""
        if isinstance(exc, ImageOverBudget):
            return exc
        self.rejected.pop(image_id, None)
        self.rejected[image_id] = str(exc)
        while len(self.rejected) > MAX_REJECTED:
            del self.rejected[next(iter(self.rejected))]
        return exc

    def import_budget(self) -> ImportBudget:
        """What the next import may write: the budget less the layers of images in use (by any
        host: their pin is held), which no eviction can free."""
        if not self.accounting:
            return ImportBudget(None, self.layer_entries)
        held = self._held_bytes()
        return ImportBudget(max(0, self.budget_bytes - held), self.layer_entries,
                            context=f"the store's budget is {self.budget_bytes} bytes, {held} of them held by "
                                    "images in use")

    def _held_bytes(self) -> int:
        layers: set[Path] = set()
        for record in (self.root / "images").glob("*.json"):
            image = self._read_record(record)
            if image is None:
                continue
            fd = os.open(record.with_suffix(".lock"), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                layers.update(p for p in image.lowers if p.is_dir())  # pinned: some host uses it
            finally:
                os.close(fd)
        return sum(self.store.layer_bytes(p) for p in layers)

    def _pin(self, image_id: str) -> int:
        fd = os.open(self._record(image_id).with_suffix(".lock"), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        fcntl.flock(fd, fcntl.LOCK_SH)  # waits only while an eviction of this very image runs
        return fd

    def _unpin(self, root: ImageRoot) -> None:
        if root.pin_fd is not None:
            os.close(root.pin_fd)  # releases the flock
            root.pin_fd = None

    async def get(self, reference: ImageRef) -> ImageRoot:
        """The image ``reference`` names, imported first when the store lacks it (one import per
        reference at a time; others wait for it)."""
        reference = ImageRef.parse(reference)  # the same object when parsed already (every caller here)
        lock = self._locks.setdefault(reference, asyncio.Lock())
        async with lock:
            image_id = await asyncio.to_thread(self._current_id, reference)
            if image_id in self.rejected:
                raise ImageRejected(self.rejected[image_id])
            root = self.images.get(reference)
            if root is None or root.image_id != image_id:
                try:
                    fresh = await asyncio.to_thread(self._load_or_import, reference, image_id)
                except ImageRejected as exc:
                    raise self._refused(image_id, exc) from None
                if root is not None:
                    self._retire(root)  # the name moved to a rebuilt image
                root = self.images[reference] = fresh
            elif time.monotonic() - root.last_used > 60:
                with contextlib.suppress(OSError):
                    os.utime(self._record(image_id))  # (at most once a minute per image)
            self.refs[reference] = image_id
            root.last_used = time.monotonic()
            self._drop_idle()
            return root

    def _load_or_import(self, reference: ImageRef, image_id: str) -> ImageRoot:
        """Pinned first (so no other host evicts it meanwhile), then from its record if its layers
        are all there, else imported; the store is brought back under budget after an import."""
        fd = self._pin(image_id)
        try:
            root = self._read_record(self._record(image_id))
            if root is None or not all(p.is_dir() for p in root.lowers):
                if reference.kind == "derived":
                    raise ImageRejected(f"{reference}: no longer in the image store (evicted, or never made here)")
                with self._store_lock(fcntl.LOCK_SH):  # no eviction while layers are being added
                    root = self._import(reference, image_id)
                self.trim()
            else:
                check_image(root)  # another host's record (or one this host made before it checked images)
            with contextlib.suppress(OSError):
                os.utime(self._record(image_id))  # its last use, for the least-recently-used order
            if root.config.reference != reference:  # recorded under another name of the same image
                root = ImageRoot(image_id, root.config.model_copy(update={"reference": reference}), root.lowers)
            root.pin_fd = fd
            return root
        except BaseException:
            os.close(fd)
            raise

    @contextlib.contextmanager
    def _store_lock(self, how: int) -> Iterator[None]:
        fd = os.open(self.root / "images" / "store.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, how)
            yield
        finally:
            os.close(fd)

    def _retire(self, root: ImageRoot) -> None:
        if root.users:
            self._retired.append(root)  # unpinned once no slot is on it (``_drop_idle``)
        else:
            self._unpin(root)

    def _drop_idle(self) -> None:
        now = time.monotonic()
        for reference, root in list(self.images.items()):
            if not root.users and now - root.last_used > IDLE_S:
                self._unpin(root)
                del self.images[reference]
        for root in [r for r in self._retired if not r.users]:
            self._unpin(root)
            self._retired.remove(root)

    def disk_bytes(self) -> int:
        """Disk used by the store's layers (what the budget counts)."""
        return sum(self.store.layer_bytes(p) for p in (self.root / "layers").iterdir())

    def trim(self) -> None:
        """Bring the store back under budget (after every import; also for an operator)."""
        with self._store_lock(fcntl.LOCK_EX):  # no import adds layers meanwhile: the records are complete
            self._evict_over_budget()

    def _evict_over_budget(self) -> None:
        """Least recently used first (the record's mtime: touched by every host's use), images no
        host holds (an exclusive lock taken without waiting), with their layers no other image has."""
        self._sweep_orphans()
        used = self.disk_bytes()
        if used <= self.budget_bytes:
            return
        records = sorted((self.root / "images").glob("*.json"), key=lambda p: p.stat().st_mtime)
        for record in records:
            if used <= self.budget_bytes:
                break
            victim = self._read_record(record)
            if victim is None:
                continue
            fd = os.open(record.with_suffix(".lock"), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
            try:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    continue  # some host holds it: in use
                record.unlink()
                kept = {p for r in map(self._read_record, (self.root / "images").glob("*.json"))
                        if r is not None for p in r.lowers}
                for layer in victim.lowers:
                    if layer not in kept and layer.is_dir():
                        size = self.store.layer_bytes(layer)
                        if self._drop_layer(layer):
                            used -= size
                log.info("image store over budget: evicted %s (%s)", victim.reference, victim.image_id)
            finally:
                os.close(fd)
        if used > self.budget_bytes:
            log.warning("image store at %d bytes, over its budget of %d: every other image is in use",
                        used, self.budget_bytes)

    def _drop_layer(self, layer: Path) -> bool:
        gone = self.store.root / "tmp" / f"evicted-{layer.name}"
        try:
            os.rename(layer, gone)
        except OSError:
            return False
        remove_tree(gone)
        self.store.forget_size(layer)
        return True

    def _sweep_orphans(self) -> None:
        """Under the exclusive store lock no import is running: a layer no record names, or a
        staging dir, is what a host that died mid-import left, and goes."""
        kept = {p.name for r in map(self._read_record, (self.root / "images").glob("*.json"))
                if r is not None for p in r.lowers}
        for layer in list((self.root / "layers").iterdir()):
            if layer.name not in kept:
                log.info("image store: removing layer %s, which no image records", layer.name)
                self._drop_layer(layer)
        for left in (self.store.root / "tmp").glob("stage-*"):
            remove_tree(left)

    def _current_id(self, reference: ImageRef) -> str:
        if reference.kind == "derived":  # made here (``derive``): its own id
            return str(reference)
        if reference.kind == "oci":
            return oci_image_id(reference)
        if reference.kind == "registry":
            if reference in self.shipped:
                return self.refs[reference]
            return registry.registry_image_id(reference)
        if reference in self.refs and not os.path.exists(self.docker_socket):
            # uploaded (a host with no engine: the Docker backend's, whose pool ships the image
            # again whenever the engine's id for the reference changes)
            return self.refs[reference]
        return docker_image_id(reference, socket_path=self.docker_socket)

    async def add_archive(self, archive: Path, reference: ImageRef) -> ImageRoot:
        """An uploaded ``docker save`` archive, imported under ``reference`` (an unprivileged host
        unpacks it in a user namespace of its own: atropos/sandbox/host/images/userns_import.py)."""
        reference = ImageRef.parse(reference)  # the same object when parsed already (every caller here)
        if reference.kind in ("oci", "derived"):  # names the host resolves itself, never an upload's
            raise ImageRejected(f"not a name for an uploaded image: {reference[:80]!r}")
        lock = self._locks.setdefault(reference, asyncio.Lock())
        async with lock:
            imported = await asyncio.to_thread(self._add_archive, archive, reference)
            root = self.images.get(reference)
            if root is not None and root.image_id == imported.image_id:
                self._unpin(imported)  # pinned already, by the table's entry
            else:
                if root is not None:
                    self._retire(root)
                root = self.images[reference] = imported
            self.refs[reference] = root.image_id
            if reference.kind == "registry":
                self.shipped.add(reference)
            root.last_used = time.monotonic()
            self._drop_idle()
            return root

    def _add_archive(self, archive: Path, reference: ImageRef) -> ImageRoot:
        with self._store_lock(fcntl.LOCK_SH):  # no eviction while layers are being added
            budget = self.import_budget()
            if os.geteuid() == 0:
                with self.store.staging() as staging:
                    imported = import_docker_archive(self.store, archive, reference, staging=staging, budget=budget)
                    if imported.image_id in self.rejected:
                        raise ImageRejected(self.rejected[imported.image_id])
                    try:
                        accepted = accept(self.store, staging, imported.config, imported.image_id)
                    except ImageRejected as exc:
                        raise self._refused(imported.image_id, exc) from None
                config = accepted.config
            else:  # the child stages, checks and commits the same way
                imported = ImportedImage.model_validate(userns_import.import_archive(
                    self.root, archive, reference, budget=budget))
                config = imported.config
            root = self._remember(imported.image_id, config)
            root.pin_fd = self._pin(root.image_id)  # before the store lock goes: no eviction in between
        try:
            self.trim()
        except BaseException:
            self._unpin(root)
            raise
        return root

    def _import(self, reference: ImageRef, image_id: str) -> ImageRoot:
        """Staged, checked, committed (see the module doc); the caller holds the store lock shared."""
        budget = self.import_budget()
        with self.store.staging() as staging:
            if reference.kind == "oci":
                imported = import_oci_layout(self.store, reference, staging=staging, budget=budget)
            elif reference.kind == "registry":
                fetched = self.store.root / "tmp" / f"registry-{secrets.token_hex(8)}"
                try:
                    imported = import_oci_layout(self.store, registry.fetch(reference, fetched), staging=staging,
                                                 budget=budget)
                finally:
                    remove_tree(fetched)
            else:
                maybe: ImportedImage | None
                try:
                    maybe = import_from_engine_dirs(self.store, reference, socket_path=self.docker_socket,
                                                    staging=staging, budget=budget)
                except OSError as exc:  # e.g. the engine removed a dir meanwhile
                    log.info("%s: copying the engine's layer dirs failed (%s); exporting the image instead",
                             reference, exc)
                    maybe = None
                imported = maybe if maybe is not None else import_from_docker(
                    self.store, reference, socket_path=self.docker_socket, staging=staging, budget=budget)
            accepted = accept(self.store, staging, imported.config.model_copy(update={"reference": reference}),
                              image_id)
        root = self._remember(image_id, accepted.config)
        root._ids, root._env = accepted._ids, accepted._env
        return root

    def _remember(self, image_id: str, config: ImageConfig) -> ImageRoot:
        root = ImageRoot(image_id, config, tuple(self.store.path(d) for d in config.store_layers))
        # a name of its own: the hosts of one machine (or Ray node) share the store and may record
        # the same image at once
        tmp = self._record(image_id).with_suffix(f".{secrets.token_hex(6)}.tmp")
        tmp.write_text(json.dumps({"id": image_id, "config": config.model_dump(mode="json")}))
        os.replace(tmp, self._record(image_id))
        return root

    def derive(self, parent: ImageRoot, upper: Path, owner: int | None, skip: frozenset[str]) -> ImageRoot:
        """A new image: ``parent`` plus one layer, a copy of a slot's writable layer ``upper`` (a
        group's setup, done once and then the root of every rollout of the group). The copy keeps
        what overlayfs wrote there (its whiteouts, opaque and redirect xattrs: made by the kernel,
        not the slot) and moves the slot's uid ``owner`` back to the image's 0, so the layer is
        idmapped to any slot like the image's own. ``skip``: top-level names that are the mount
        helper's mount points, not the slot's. It counts against the store's budget like an import
        (refused past it) and is evicted like any image once no host uses it."""
        if len(parent.lowers) + 1 > MAX_LOWERS:
            raise ImageRejected(f"{parent.reference}: has {len(parent.lowers)} layers; one more is past the "
                                f"{MAX_LOWERS} an overlay stacks")
        hexid = secrets.token_hex(32)
        tmp = self.store.root / "tmp" / f"derive-{hexid}"
        tmp.mkdir(mode=0o700)
        reference = ImageRef.parse(f"{DERIVED_PREFIX}{hexid}")
        key = f"sha256:{hexid}"
        config = parent.config.model_copy(update={
            "reference": reference, "diff_ids": (*parent.config.diff_ids, key),
            "layers": (*parent.config.layers, key) if parent.config.layers else ()})
        try:
            entries = [str(upper / n) for n in sorted(os.listdir(upper)) if n not in skip]
            if os.geteuid() != 0:  # an unprivileged host (Docker, Nomad): the copy in a user namespace
                # of its own (mknod of the kernel's whiteouts); the slot's files are already the
                # host's uid, the store's owner of every file
                if entries:
                    userns_import.copy_tree(upper, [os.path.basename(e) for e in entries], tmp)
            else:
                if entries:
                    subprocess.run(["cp", "-a", "--", *entries, str(tmp)], check=True, capture_output=True,
                                   timeout=3600)
                if owner is not None:
                    shift_owner(tmp, owner, 0)
            os.chmod(tmp, os.lstat(upper).st_mode & 0o7777)
            candidate = ImageRoot(reference, config, (*parent.lowers, tmp))
            check_image(candidate)  # its passwd is the slot's now: the User must still resolve
            with self._store_lock(fcntl.LOCK_SH):
                self.import_budget().charge(tree_bytes(tmp), "the derived layer")
                os.rename(tmp, self.store.path(key))
                record = self._record(reference)
                record.with_suffix(".new").write_text(json.dumps({"id": reference,
                                                                  "config": config.model_dump(mode="json")}))
                os.replace(record.with_suffix(".new"), record)
                pin = self._pin(reference)
        except BaseException:
            remove_tree(tmp)
            raise
        root = ImageRoot(reference, config, (*parent.lowers, self.store.path(key)))
        root._ids, root._env = candidate._ids, candidate._env
        root.pin_fd = pin
        self.images[reference] = root
        self.refs[reference] = reference
        try:
            self.trim()
        except OSError as exc:
            log.warning("image store: trimming after a derive failed: %s", exc)
        return root
