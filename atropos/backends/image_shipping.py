"""Shipping a task image from the pool's Docker engine to a host that has no engine of its own (a
Docker container's host, a Nomad allocation's): the engine's export of the image (Engine API
``GET /images/{name}/get``, the bytes of ``docker save``) streamed to the host's image upload
(docs/task-images.md, "On the Ray and Docker backends")."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

from atropos.errors import ImageRejected
from atropos.sandbox.contract.client import HostClient
from atropos.sandbox.contract.imageref import ImageRef

log = logging.getLogger(__name__)


async def ship_from_engine(api: Any, not_found: type[Exception], client: HostClient, reference: ImageRef) -> None:
    """Ship ``reference`` from the engine ``api`` (the docker SDK's low-level client; ``not_found``
    its ImageNotFound) to the host behind ``client``, unless the host already holds it under the id
    the engine gives the reference now (a tag moved to a rebuilt image is shipped again)."""
    if reference.host_side:  # the host's own: an OCI layout on its disk, an image derived there, a registry's
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
