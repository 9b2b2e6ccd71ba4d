"""Shipping a task image to a host that has no engine of its own and no way to a registry (a Docker
container's host, a Nomad allocation's): the bytes of ``docker save`` streamed to the host's image
upload (docs/task-images.md, "On the Ray and Docker backends", "Registries"). An engine's image is
the engine's export (Engine API ``GET /images/{name}/get``); a registry's (``docker://...``) is
fetched by skopeo on the pool's machine, pinned to the manifest digest the registry serves now, into
an archive that is shipped, then removed (``RegistryShipper``)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import shutil
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

from atropos.errors import ImageRejected
from atropos.sandbox.contract import registry
from atropos.sandbox.contract.client import HostClient
from atropos.sandbox.contract.imageref import ImageRef

log = logging.getLogger(__name__)
Engine = Callable[[], Awaitable[tuple[Any, type[Exception]]]]  # the docker SDK's low-level client, ImageNotFound


async def ship(client: HostClient, reference: ImageRef, engine: Engine, registries: RegistryShipper) -> None:
    """Give the host behind ``client`` the image ``reference`` unless it holds it as it is now: a
    registry's through ``registries``, an engine's from ``engine()`` (asked for only then); an OCI
    layout on the host's disk or an image derived there is the host's own."""
    if reference.kind == "registry":
        await registries.ship(client, reference)
    elif reference.kind == "engine":
        api, not_found = await engine()
        await ship_from_engine(api, not_found, client, reference)


async def ship_from_engine(api: Any, not_found: type[Exception], client: HostClient, reference: ImageRef) -> None:
    """Ship ``reference`` from the engine ``api`` (the docker SDK's low-level client; ``not_found``
    its ImageNotFound) to the host behind ``client``, unless the host already holds it under the id
    the engine gives the reference now (a tag moved to a rebuilt image is shipped again)."""
    if reference.kind != "engine":  # the host's own (an OCI layout, a derived image) or a registry's
        return
    try:
        engine_id = (await asyncio.to_thread(api.inspect_image, reference))["Id"]
    except not_found:
        raise ImageRejected(f"the Docker engine has no image {reference!r}") from None
    if any(i.reference == reference and i.id == engine_id for i in await client.images()):
        return
    chunks = await asyncio.to_thread(api.get_image, reference)  # the request is made; the body streams
    started = time.perf_counter()
    info = await client.upload_image(_in_thread(chunks), reference)
    log.info("shipped image %s (%d layers) to a host in %.1f s", reference, info.layers, time.perf_counter() - started)


async def _in_thread(chunks: Iterator[bytes]) -> AsyncIterator[bytes]:
    """A blocking iterator (the docker SDK's streamed body) as an async one, a chunk per thread hop."""
    while True:
        chunk = await asyncio.to_thread(next, chunks, b"")
        if not chunk:
            return
        yield chunk


class RegistryShipper:
    """A pool's registry images, shipped to its hosts. Per lease: the tag is pinned to the manifest
    the registry serves now (one request; none for a pinned reference) and the host's list of
    images is compared with that image's id (its config's digest, asked once per digest); a host
    that lacks it, or holds an older image under the tag, gets an archive of the pinned digest. One
    fetch serves every host shipped the image meanwhile (a group's hosts, ``prepare_images``); the
    archive lives in a temporary directory of the pool's machine (``TMPDIR``) until the last of them
    is done."""

    def __init__(self) -> None:
        self._ids: dict[ImageRef, str] = {}  # pinned reference -> image id (a digest names one config)
        self._fetching: dict[ImageRef, tuple[asyncio.Future[None], Path, list[int]]] = {}

    async def ship(self, client: HostClient, reference: str | ImageRef) -> None:
        reference = ImageRef.parse(reference)
        pinned = await asyncio.to_thread(registry.pin, reference)
        image_id = self._ids.get(pinned)
        if image_id is None:
            image_id = self._ids[pinned] = await asyncio.to_thread(registry.config_id, pinned)
        if any(i.reference == reference and i.id == image_id for i in await client.images()):
            return
        async with self._archive(pinned) as archive:
            started = time.perf_counter()
            info = await client.upload_image(_file_chunks(archive), reference)
        if info.id != image_id:  # the host counts ids as the engine does; a difference reships each lease
            log.warning("%s: shipped as %s, the registry's config digest is %s", reference, info.id, image_id)
        log.info("shipped registry image %s (%s, %d layers) to a host in %.1f s", reference, pinned, info.layers,
                 time.perf_counter() - started)

    @contextlib.asynccontextmanager
    async def _archive(self, pinned: ImageRef) -> AsyncIterator[Path]:
        entry = self._fetching.get(pinned)
        if entry is None:  # no await before the entry is in: a second shipment meanwhile shares it
            tmp = Path(tempfile.mkdtemp(prefix="atropos-registry-"))
            entry = self._fetching[pinned] = (
                asyncio.ensure_future(asyncio.to_thread(registry.fetch_archive, pinned, tmp / "image.tar")), tmp, [0])
        fetch, tmp, users = entry
        users[0] += 1
        try:
            await asyncio.shield(fetch)
            yield tmp / "image.tar"
        finally:
            users[0] -= 1
            if users[0] == 0:
                self._fetching.pop(pinned, None)
                # removed once skopeo is done with it (at once unless every waiter was cancelled)
                fetch.add_done_callback(lambda _: shutil.rmtree(tmp, ignore_errors=True))


async def _file_chunks(path: Path, size: int = 1 << 20) -> AsyncIterator[bytes]:
    fh = await asyncio.to_thread(open, path, "rb")
    with fh:
        while chunk := await asyncio.to_thread(fh.read, size):
            yield chunk
