"""A lease of an image reference gets the image the reference names when it is leased
(docs/task-images.md, "A reference that moves"): a released slot stays warm on its image's root,
and the next lease of the same reference is served from it only while the reference still names
that image. An engine tag retagged to another image, an OCI layout whose tag skopeo rewrote and a
registry tag pushed anew are each the new image at the next lease, on every backend that can reach
such a reference; a lease while nothing moved keeps the warm root (no reset)."""

from __future__ import annotations

import asyncio
import secrets
import shutil
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from atropos.slots.pool import SlotPool
from tests.pool_backends import make_backend, pool_cfg
from tests.test_image_registry import build_variant, engine_id, push, registry

__all__ = ["registry"]  # the fixture, served on 127.0.0.1 by the test (tests/test_image_registry.py)

SHOWS = "cat /testbed/a.txt; echo $WHICH"
needs_skopeo = pytest.mark.skipif(shutil.which("skopeo") is None, reason="needs skopeo (Debian package)")
needs_registry = pytest.mark.skipif(shutil.which("skopeo") is None or shutil.which("docker-registry") is None,
                                    reason="needs skopeo and docker-registry (Debian packages)")


@pytest.fixture
def variants(task_image: Callable[[str], str], tmp_path: Path) -> Iterator[tuple[str, str]]:
    """Two engine images of the same base: ``/testbed/a.txt`` and ``$WHICH`` say ``one`` or ``two``."""
    base = task_image("nopython")
    built = tuple(build_variant(base, which, tmp_path / which) for which in ("one", "two"))
    try:
        yield built[0], built[1]
    finally:
        subprocess.run(["docker", "image", "rm", "-f", *built], capture_output=True, timeout=120)


def run(*argv: str) -> None:
    subprocess.run(list(argv), check=True, capture_output=True, timeout=300)


def engine_tag(one: str, two: str, tmp_path: Path) -> tuple[str, Callable[[str], None], Callable[[], None]]:
    tag = f"atropos-test/moving-{secrets.token_hex(4)}:latest"
    return (tag, lambda image: run("docker", "tag", image, tag),
            lambda: run("docker", "image", "rm", "-f", tag))


def oci_tag(one: str, two: str, tmp_path: Path) -> tuple[str, Callable[[str], None], Callable[[], None]]:
    ref = f"oci:{tmp_path / 'layout'}:v1"  # skopeo rewrites the layout's index.json for the tag
    return ref, lambda image: run("skopeo", "copy", "--quiet", f"docker-daemon:{image}", ref), lambda: None


def registry_tag(where: str) -> Callable[[str, str, Path], tuple[str, Callable[[str], None], Callable[[], None]]]:
    def make(one: str, two: str, tmp_path: Path) -> tuple[str, Callable[[str], None], Callable[[], None]]:
        ref = f"docker://{where}/tasks/moving:v1"

        def point_at(image: str) -> None:
            push(f"docker-daemon:{image}", ref)

        return ref, point_at, lambda: None
    return make


CASES = [
    pytest.param("engine", "local", id="engine-local"),
    pytest.param("engine", "docker", id="engine-docker", marks=pytest.mark.docker),
    pytest.param("engine", "nomad", id="engine-nomad"),
    pytest.param("oci", "local", id="oci-local", marks=needs_skopeo),
    pytest.param("oci", "nomad", id="oci-nomad", marks=needs_skopeo),
    pytest.param("registry", "local", id="registry-local", marks=needs_registry),
    pytest.param("registry", "docker", id="registry-docker", marks=[needs_registry, pytest.mark.docker]),
    pytest.param("registry", "nomad", id="registry-nomad", marks=needs_registry),
]


@pytest.mark.parametrize(("ref_kind", "backend"), CASES)
async def test_a_lease_gets_what_the_reference_names_now(ref_kind: str, backend: str, variants: tuple[str, str],
                                                        tmp_path: Path, request: pytest.FixtureRequest) -> None:
    """One slot, so every lease takes the slot the last one released, warm on the reference's
    image. The reference moves from image one to image two while the slot is free: the next lease
    is image two (it was image one before the fix). While nothing moved, a lease keeps the warm
    root: its generation shows no reset between the release's and the lease."""
    one, two = variants
    maker = registry_tag(request.getfixturevalue("registry")) if ref_kind == "registry" else \
        {"engine": engine_tag, "oci": oci_tag}[ref_kind]
    ref, point_at, forget = await asyncio.to_thread(maker, one, two, tmp_path)
    await asyncio.to_thread(point_at, one)
    try:
        async with SlotPool(make_backend(backend, slots=1), pool_cfg(acquire_timeout_s=300)) as pool:
            async def leased(tid: str) -> tuple[str, int]:
                lease = await pool.lease(tid, image=ref)
                try:
                    return str((await lease.bash(SHOWS))["stdout"]), lease.generation
                finally:
                    await lease.release()

            shown, first = await leased("moving-1")
            assert shown == "one\none\n"
            host = next(iter(pool.hosts.values()))
            assert host.roots == {0: ref}, "the released slot stays warm on the reference's root"
            shown, kept = await leased("moving-2")
            assert shown == "one\none\n"
            assert kept == first + 1, "nothing moved: the warm root was kept (only the release's reset)"
            await asyncio.to_thread(point_at, two)  # the reference moves while the slot is free and warm
            shown, moved = await leased("moving-3")
            assert shown == "two\ntwo\n", "a lease of a moved reference was served the image it named before"
            assert moved == kept + 2, "the warm slot was reset to the image the reference names now"
            held = {i.reference: i.id for i in await host.client.images()}
            if ref_kind == "engine" or (ref_kind == "registry" and backend != "local"):
                assert held[ref] == engine_id(two)  # the engine's own id (shipped: the pool's engine's)
            shown, again = await leased("moving-4")
            assert (shown, again) == ("two\ntwo\n", moved + 1)  # warm on the new image: kept again
            assert pool.status().quarantines == 0
    finally:
        await asyncio.to_thread(forget)


async def test_a_reference_that_no_longer_names_an_image_refuses_the_warm_slot(
        variants: tuple[str, str], tmp_path: Path) -> None:
    """A tag removed from the engine while a slot is warm on it: the next lease is
    ``image_rejected`` (it was served the removed image before), no slot is quarantined, and the
    pool still leases the slot for the default root."""
    from atropos.errors import ImageRejected

    one, _ = variants
    ref, point_at, forget = engine_tag(one, one, tmp_path)
    await asyncio.to_thread(point_at, one)
    async with SlotPool(make_backend("local", slots=1), pool_cfg(acquire_timeout_s=300)) as pool:
        async with pool.leased("gone-1", image=ref) as lease:
            assert (await lease.bash(SHOWS))["stdout"] == "one\none\n"
        await asyncio.to_thread(forget)
        with pytest.raises(ImageRejected, match="no image"):
            await pool.lease("gone-2", image=ref)
        async with pool.leased("gone-3") as lease:
            assert (await lease.bash("test -e /testbed/a.txt; echo $?"))["stdout"] == "1\n"
        assert pool.status().quarantines == 0

