"""Task images from a registry (docs/task-images.md, "Registries"): a registry server from the
distribution's package (``docker-registry``) on loopback, started by the test; the host fetches
through skopeo, pins digests, and says clearly when the registry is unreachable. On the Docker and
Nomad backends the pool fetches instead (a container's host reaches no registry on the machine's
loopback) and ships the image: the same leases, pins and errors on every backend."""

from __future__ import annotations

import asyncio
import contextlib
import json
import secrets
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from atropos.backends.base import Backend
from atropos.errors import ImageRejected
from atropos.sandbox.contract import registry as registry_refs
from atropos.sandbox.contract.imageref import ImageRef
from atropos.sandbox.host.images.host_images import HostImages
from atropos.slots.pool import SlotPool
from tests.pool_backends import make_backend, pool_cfg
from tests.test_image_import_limits import BASE, Layout, tar_of

pytestmark = pytest.mark.skipif(shutil.which("skopeo") is None or shutil.which("docker-registry") is None,
                                reason="needs skopeo and docker-registry (Debian packages)")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def registry(tmp_path: Path) -> Iterator[str]:
    port = free_port()
    config = tmp_path / "registry.yml"
    config.write_text(json.dumps({"version": 0.1, "log": {"level": "error"},
                                  "storage": {"filesystem": {"rootdirectory": str(tmp_path / "registry")}},
                                  "http": {"addr": f"127.0.0.1:{port}"}}))
    proc = subprocess.Popen(["docker-registry", "serve", str(config)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 30
        while True:
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", port)) == 0:
                    break
            assert time.monotonic() < deadline and proc.poll() is None, "the registry did not start"
            time.sleep(0.1)
        yield f"127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(10)


def push(layout_ref: str, dest: str) -> str:
    subprocess.run(["skopeo", "copy", "--quiet", "--dest-tls-verify=false", layout_ref, dest], check=True,
                   capture_output=True, timeout=120)
    out = subprocess.run(["skopeo", "inspect", "--tls-verify=false", dest], check=True, capture_output=True,
                         timeout=60).stdout
    return str(json.loads(out)["Digest"])


def test_a_registry_image_by_tag_and_by_pinned_digest(registry: str, tmp_path: Path) -> None:
    layout = Layout(tmp_path / "oci")
    one = layout.image("one", [BASE, tar_of(("testbed", None), ("testbed/a.txt", b"one\n"))], Env=["WHICH=one"])
    two = layout.image("two", [BASE, tar_of(("testbed", None), ("testbed/a.txt", b"two\n"))], Env=["WHICH=two"])
    ref = f"docker://{registry}/tasks/demo:v1"
    digest_one = push(one, ref)
    images = HostImages(tmp_path / "store")
    got = asyncio.run(images.get(ImageRef.parse(ref)))
    assert got.env()["WHICH"] == "one" and (got.lowers[-1] / "testbed/a.txt").read_bytes() == b"one\n"
    pinned = f"docker://{registry}/tasks/demo@{digest_one}"
    push(two, ref)  # the tag moves
    moved = asyncio.run(images.get(ImageRef.parse(ref)))
    assert moved.env()["WHICH"] == "two"  # imported again: never served stale
    assert asyncio.run(images.get(ImageRef.parse(pinned))).env()["WHICH"] == "one"  # the pin still names the first
    wrong = f"docker://{registry}/tasks/demo@sha256:{'0' * 64}"
    with pytest.raises(ImageRejected, match="skopeo could not fetch it"):
        asyncio.run(images.get(ImageRef.parse(wrong)))
    assert not list((tmp_path / "store" / "tmp").iterdir())  # the fetched layouts are gone


def test_an_unreachable_registry_is_a_clear_error(tmp_path: Path) -> None:
    ref = f"docker://127.0.0.1:{free_port()}/tasks/demo:v1"
    with pytest.raises(ImageRejected, match=r"the registry 127\.0\.0\.1:\d+ is unreachable"):
        asyncio.run(HostImages(tmp_path / "store").get(ImageRef.parse(ref)))
    with pytest.raises(ImageRejected, match="not a registry reference"):
        asyncio.run(HostImages(tmp_path / "store").get(ImageRef.parse("docker://no-repo")))


def build_variant(base: str, which: str, ctx: Path) -> str:
    """``base`` (a task image with a shell) plus ``/testbed/a.txt`` and ``WHICH``, both ``which``."""
    ctx.mkdir()
    (ctx / "a.txt").write_text(f"{which}\n")
    (ctx / "Dockerfile").write_text(f"FROM {base}\nCOPY a.txt /testbed/a.txt\nENV WHICH={which}\n")
    tag = f"atropos-test/registry-{which}:{secrets.token_hex(4)}"
    subprocess.run(["docker", "build", "-q", "-t", tag, str(ctx)], check=True, capture_output=True, timeout=600)
    return tag


def engine_id(tag: str) -> str:
    return subprocess.run(["docker", "image", "inspect", "-f", "{{.Id}}", tag], check=True, capture_output=True,
                          text=True, timeout=60).stdout.strip()


@contextlib.contextmanager
def backend_of(kind: str, slots: int) -> Iterator[Backend]:
    """A backend of ``kind`` for the registry's leases; ``ray``: a real Ray cluster (a head and two
    worker nodes on 127.0.0.1, tests/test_ray_backend.py's), started here and shut down after."""
    if kind != "ray":
        yield make_backend(kind, slots=slots)
        return
    from tests import test_ray_backend as on_ray  # skips the case where Ray is not installed

    cluster = on_ray.RayCluster.start()
    try:
        yield on_ray.make_backend(cluster, slots=slots, prewarm=False)
    finally:
        cluster.shutdown()


@pytest.mark.parametrize("kind", ["local", pytest.param("docker", marks=pytest.mark.docker), "nomad",
                                  pytest.param("ray", marks=pytest.mark.timeout(900))])  # a cluster to start
async def test_a_registry_image_leases_on_every_backend(kind: str, registry: str, tmp_path: Path,
                                                        task_image: object, monkeypatch: pytest.MonkeyPatch) -> None:
    """A lease of ``docker://...`` on a pool of each backend: a local host, and a Ray node's host,
    fetch it themselves (each node's host reaches the registry: here every node is on 127.0.0.1); a
    Docker container's host (which cannot reach the test's loopback registry) and a Nomad host (the
    fake's, a real host) are shipped it by the pool, which fetched it once for the group, pinned to
    the digest the registry served, and lists it under the image's own id. A moved tag is shipped
    (or fetched) again, a pinned digest stays what it names, a wrong digest and an unreachable
    registry are ``image_rejected`` (named with the host, and its node on Ray) and leave the lease as
    it was."""
    base = task_image("nopython")  # type: ignore[operator]
    one, two = [await asyncio.to_thread(build_variant, base, w, tmp_path / w) for w in ("one", "two")]
    fetched: list[str] = []
    real_fetch = registry_refs.fetch_archive

    def counted(pinned: str, into: Path, timeout: float = 3600.0) -> None:  # the pool's real fetch, counted
        fetched.append(pinned)
        real_fetch(pinned, into, timeout)

    monkeypatch.setattr(registry_refs, "fetch_archive", counted)
    ref = f"docker://{registry}/tasks/demo:v1"
    try:
        pinned_one = f"docker://{registry}/tasks/demo@{push(f'docker-daemon:{one}', ref)}"
        shows = "cat /testbed/a.txt; echo $WHICH; command -v python3; echo $?"
        ships = kind not in ("local", "ray")
        with backend_of(kind, slots=2) as backend:
            async with SlotPool(backend, pool_cfg(acquire_timeout_s=300, health_timeout_s=30)) as pool:
                a, b = await pool.lease_many(["reg-a", "reg-b"], image=ref)
                try:
                    for lease in (a, b):
                        assert (await lease.bash(shows))["stdout"] == "one\none\n1\n"  # the image's root, no python
                    held = {i.reference: i.id for i in await a.host.client.images()}
                    if ships:  # under the engine's own id of the pushed image: what the registry holds
                        assert held[ref] == engine_id(one) and fetched == [pinned_one], "one fetch for the group's host"
                    else:
                        assert held[ref] == f"registry:{pinned_one.rsplit('@', 1)[1]}" and fetched == []
                    pinned_two = f"docker://{registry}/tasks/demo@{push(f'docker-daemon:{two}', ref)}"  # the tag moves
                    await a.reset(image=ref)
                    assert (await a.bash(shows))["stdout"] == "two\ntwo\n1\n"  # never served stale
                    await b.reset(image=pinned_one)
                    assert (await b.bash(shows))["stdout"] == "one\none\n1\n"  # the pin still names the first
                    wrong = f"docker://{registry}/tasks/demo@sha256:{'0' * 64}"
                    with pytest.raises(ImageRejected, match="skopeo could not fetch it"):
                        await b.reset(image=wrong)
                    assert (await b.bash(shows))["stdout"] == "one\none\n1\n"  # the lease kept its root
                finally:
                    for lease in (a, b):
                        await lease.release()
                port = free_port()
                node = r" on node \S+" if kind in ("ray", "nomad") else ""  # named with its node there
                unreachable = rf"host \S+{node}: .*the registry 127\.0\.0\.1:{port} is unreachable"
                with pytest.raises(ImageRejected, match=unreachable):
                    await pool.lease("reg-x", image=f"docker://127.0.0.1:{port}/tasks/demo:v1")
                assert pool.status().quarantines == 0  # refused before a slot was touched
        assert fetched == ([pinned_one, pinned_two, pinned_one] if ships else [])
        assert not list(Path(tempfile.gettempdir()).glob("atropos-registry-*")), "the pool's archives are gone"
    finally:
        subprocess.run(["docker", "image", "rm", "-f", one, two], capture_output=True, timeout=120)


async def test_one_fetch_serves_every_host_shipped_the_image_at_once(registry: str, task_image: object,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """``RegistryShipper`` (the Docker and Nomad pools' registry path) shipping one reference to two
    real hosts at once fetches it once; both hold it under the image's id; a shipment to a host that
    holds it already fetches nothing; the archive is gone after."""
    from atropos.backends.image_shipping import RegistryShipper

    base = task_image("nopython")  # type: ignore[operator]
    ref = f"docker://{registry}/tasks/base:v1"
    push(f"docker-daemon:{base}", ref)
    fetched: list[str] = []
    real_fetch = registry_refs.fetch_archive

    def counted(pinned: str, into: Path, timeout: float = 3600.0) -> None:
        fetched.append(pinned)
        real_fetch(pinned, into, timeout)

    monkeypatch.setattr(registry_refs, "fetch_archive", counted)
    shipper = RegistryShipper()
    async with SlotPool(make_backend("local", slots=1), pool_cfg(min_hosts=2, max_hosts=2)) as pool:
        clients = [h.client for h in pool.hosts.values()]
        assert len(clients) == 2
        await asyncio.gather(*(shipper.ship(c, ref) for c in clients))
        assert len(fetched) == 1
        for client in clients:
            assert {i.reference: i.id for i in await client.images()}[ref] == engine_id(base)
        await shipper.ship(clients[0], ref)
        assert len(fetched) == 1  # held under that id: nothing fetched or shipped
    assert not list(Path(tempfile.gettempdir()).glob("atropos-registry-*"))
