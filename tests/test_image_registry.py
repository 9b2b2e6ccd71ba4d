"""Task images from a registry (docs/task-images.md, "Registries"): a registry server from the
distribution's package (``docker-registry``) on loopback, started by the test; the host fetches
through skopeo, pins digests, and says clearly when the registry is unreachable."""

from __future__ import annotations

import asyncio
import json
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from atropos.errors import ImageRejected
from atropos.sandbox.contract.imageref import ImageRef
from atropos.sandbox.host.images.host_images import HostImages
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
