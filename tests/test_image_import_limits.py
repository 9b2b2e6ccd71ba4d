"""Task images as hostile input at the door (docs/task-images.md, "Refused at the door"): an image's
config is checked and its layers bounded on disk while they unpack, an OCI layout is read without
trusting a byte of it, and a refused image leaves nothing in the store. Real layers on the real
filesystem, through the host's own image service (``HostImages``); no Docker engine needed."""

from __future__ import annotations

import asyncio
import gzip
import hashlib
import io
import json
import os
import stat
import subprocess
import sys
import tarfile
import threading
from pathlib import Path
from typing import Any

import pytest

from atropos.errors import ImageOverBudget, ImageRejected
from atropos.sandbox.contract.imageref import ImageRef
from atropos.sandbox.host.images.host_images import HostImages
from atropos.sandbox.host.images.image_check import IMPORT_MAX_LAYERS, MAX_LOWERS
from atropos.sandbox.host.images.layer_trees import tree_bytes

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="layers keep their owners: the store runs as root")

PASSWD = b"root:x:0:0:root:/root:/bin/sh\nagent:x:1234:1234::/home/agent:/bin/sh\n"
GROUP = b"root:x:0:\nagent:x:1234:\n"


class Zeros(io.RawIOBase):
    """``n`` zero bytes, made as they are read (a bomb's member is never held in memory)."""

    def __init__(self, n: int) -> None:
        self.left = n

    def readable(self) -> bool:
        return True

    def readinto(self, b: Any) -> int:
        n = min(len(b), self.left)
        b[:n] = bytes(n)
        self.left -= n
        return n


def tar_of(*members: tuple[str, bytes | int | None], mode: int = 0o644) -> bytes:
    """A layer tar: (name, bytes) a file, (name, int) a file of that many zeros, (name, None) a dir."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.mtime = 1_700_000_000
            if data is None:
                info.type, info.mode = tarfile.DIRTYPE, 0o755
                tar.addfile(info)
            elif isinstance(data, int):
                info.size, info.mode = data, mode
                tar.addfile(info, Zeros(data))
            else:
                info.size, info.mode = len(data), mode
                tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


BASE = tar_of(("etc", None), ("etc/passwd", PASSWD), ("etc/group", GROUP), ("etc/motd", b"base\n"))


def gz_layer(*members: tuple[str, int], level: int = 9) -> tuple[bytes, str]:
    """(gzip blob, DiffID) of a layer of zero-filled files, streamed: the tar is never in memory."""
    class Tee(io.RawIOBase):
        def __init__(self) -> None:
            self.out, self.sha = io.BytesIO(), hashlib.sha256()
            self.gz = gzip.GzipFile(fileobj=self.out, mode="wb", compresslevel=level)

        def writable(self) -> bool:
            return True

        def write(self, b: Any) -> int:
            self.sha.update(b)
            self.gz.write(b)
            return len(b)

    tee = Tee()
    with tarfile.open(fileobj=tee, mode="w|", format=tarfile.PAX_FORMAT) as tar:
        for name, size in members:
            info = tarfile.TarInfo(name)
            info.size, info.mode, info.mtime = size, 0o644, 1_700_000_000
            tar.addfile(info, Zeros(size))
    tee.gz.close()
    return tee.out.getvalue(), "sha256:" + tee.sha.hexdigest()


class Layout:
    """An OCI image layout written as skopeo writes one (gzip blobs, ``ref.name`` annotations)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.blobs = root / "blobs" / "sha256"
        self.blobs.mkdir(parents=True)
        self.manifests: list[dict[str, Any]] = []
        (root / "oci-layout").write_text('{"imageLayoutVersion": "1.0.0"}')

    def put(self, data: bytes) -> dict[str, Any]:
        digest = hashlib.sha256(data).hexdigest()
        (self.blobs / digest).write_bytes(data)
        return {"digest": f"sha256:{digest}", "size": len(data)}

    def image(self, tag: str, layers: list[bytes | tuple[bytes, str]], **config: Any) -> str:
        """Layers: a tar (gzipped here) or a (gzip blob, DiffID) pair."""
        pairs = [t if isinstance(t, tuple) else (gzip.compress(t, 1), "sha256:" + hashlib.sha256(t).hexdigest())
                 for t in layers]
        descs = [{"mediaType": "application/vnd.oci.image.layer.v1.tar+gzip", **self.put(blob)} for blob, _ in pairs]
        cfg = {"rootfs": {"type": "layers", "diff_ids": [diff_id for _, diff_id in pairs]},
               "config": {"Env": ["PATH=/usr/bin:/bin"], "WorkingDir": "/", **config}}
        manifest = {"schemaVersion": 2, "layers": descs,
                    "config": {"mediaType": "application/vnd.oci.image.config.v1+json",
                               **self.put(json.dumps(cfg).encode())}}
        self.manifests.append({"mediaType": "application/vnd.oci.image.manifest.v1+json",
                               **self.put(json.dumps(manifest).encode()),
                               "annotations": {"org.opencontainers.image.ref.name": tag}})
        (self.root / "index.json").write_text(json.dumps({"schemaVersion": 2, "manifests": self.manifests}))
        return f"oci:{self.root}:{tag}"

    def blob_of(self, desc_digest: str) -> Path:
        return self.blobs / desc_digest.removeprefix("sha256:")

    def manifest(self, tag: str) -> dict[str, Any]:
        m = next(m for m in self.manifests if m["annotations"]["org.opencontainers.image.ref.name"] == tag)
        return dict(json.loads(self.blob_of(m["digest"]).read_bytes()))


def left(store: Path) -> list[str]:
    """What a store holds besides its bookkeeping: layers, staged or temporary trees."""
    return sorted(os.listdir(store / "layers")) + sorted(os.listdir(store / "tmp"))


def rejected(images: HostImages, reference: str, match: str) -> str:
    with pytest.raises(ImageRejected, match=match) as info:
        asyncio.run(images.get(ImageRef.parse(reference)))
    return str(info.value)


# -- 1. the config, checked before any slot takes the image -----------------------------------------
BAD_CONFIGS = {
    "unknown user": ({"User": "nobody-here"}, "not in its /etc/passwd"),
    "unknown group": ({"User": "agent:wheel"}, "no group 'wheel'"),
    "uid out of range": ({"User": "4294967295"}, "out of range"),
    "uid of a thousand digits": ({"User": "9" * 200}, "out of range"),
    "a unicode digit uid": ({"User": "\u0663"}, "not in its /etc/passwd"),
    "NUL in Env": ({"Env": ["PATH=/bin", "A=x\u0000y"]}, "NUL byte"),
    "Env not KEY=VALUE": ({"Env": ["JUSTAWORD"]}, "not KEY=VALUE"),
    "megabytes of Env": ({"Env": [f"V{i}={'x' * 1000}" for i in range(3000)]}, "more than 1024"),
    "one huge Env entry": ({"Env": ["BIG=" + "x" * (1 << 20)]}, "more than 32768"),
    "Env a lone surrogate": ({"Env": ["S=\ud800"]}, "not valid UTF-8"),
    "Env not a list": ({"Env": "PATH=/bin"}, "not a list of strings"),
    "NUL in WorkingDir": ({"WorkingDir": "/test\u0000bed"}, "WorkingDir holds a NUL"),
    "huge WorkingDir": ({"WorkingDir": "/" + "a/" * 3000}, "longer than 4096"),
    "User not a string": ({"User": 1234}, "must be strings"),
}


@pytest.mark.parametrize("case", sorted(BAD_CONFIGS))
def test_a_bad_config_is_refused_at_import_and_leaves_nothing(tmp_path: Path, case: str) -> None:
    config, match = BAD_CONFIGS[case]
    ref = Layout(tmp_path / "oci").image("bad", [BASE, tar_of(("opt", None), ("opt/x", b"x"))], **config)
    images = HostImages(tmp_path / "store")
    message = rejected(images, ref, match)
    assert ref in message  # names the image
    assert left(tmp_path / "store") == []  # its layers were staged, and dropped together
    # every later lease of it: the same refusal, remembered (no import again)
    assert rejected(images, ref, match) == message
    assert list(images.rejected.values()) == [message]


def test_a_good_user_resolves_through_the_images_own_files(tmp_path: Path) -> None:
    ref = Layout(tmp_path / "oci").image("good", [BASE], User="agent", Env=["A=1"], WorkingDir="work")
    root = asyncio.run(HostImages(tmp_path / "store").get(ref))
    assert root.user_ids() == (1234, 1234)
    assert root.env()["HOME"] == "/home/agent" and root.env()["A"] == "1"
    assert root.working_dir == "/work"


def test_more_layers_than_an_overlay_takes_are_merged_not_refused(tmp_path: Path) -> None:
    """600 layers (an overlay stacks 500): the bottom ones become one layer with what they stack to
    (a file replaced, one deleted by a whiteout, an opaque dir), the others stay as they are."""
    n = 600
    layers = [BASE, tar_of(("etc/gone", b"gone soon"), ("data", None), ("data/old", b"old"))]
    layers += [tar_of((f"f{i}", f"{i}\n".encode())) for i in range(2, n)]
    layers[50] = tar_of(("etc", None), ("etc/.wh.gone", b""), ("etc/motd", b"replaced\n"))
    layers[60] = tar_of(("data", None), ("data/.wh..wh..opq", b""), ("data/new", b"new"))
    ref = Layout(tmp_path / "oci").image("tall", layers)
    images = HostImages(tmp_path / "store")
    root = asyncio.run(images.get(ImageRef.parse(ref)))
    assert len(root.lowers) == IMPORT_MAX_LAYERS < MAX_LOWERS
    merged = root.lowers[0]
    assert (merged / "etc/motd").read_bytes() == b"replaced\n"
    assert not os.path.lexists(merged / "etc/gone")  # the whiteout applied, not kept
    assert sorted(os.listdir(merged / "data")) == ["new"]  # the opaque dir hid what was below
    assert (merged / "f100").read_bytes() == b"100\n"  # merged from layer 100
    assert (root.lowers[-1] / f"f{n - 1}").read_bytes() == f"{n - 1}\n".encode()  # the top layer as it was
    # the merged-away layers were never committed: the store holds what the image uses, once
    assert sorted(os.listdir(tmp_path / "store" / "layers")) == sorted(p.name for p in root.lowers)
    # a host reading its record gets the same lowers
    again = asyncio.run(HostImages(tmp_path / "store").get(ref))
    assert again.lowers == root.lowers


# -- 2. bounded on disk while unpacking -------------------------------------------------------------
class Watch:
    """The most disk the store's layers and staging ever used while a block ran (sampled)."""

    def __init__(self, store: Path) -> None:
        self.store, self.most, self._stop = store, 0, threading.Event()

    def __enter__(self) -> Watch:
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(0.005):
            self.most = max(self.most, tree_bytes(self.store / "layers") + tree_bytes(self.store / "tmp"))

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def test_a_compressed_bomb_under_a_small_budget_never_passes_it(tmp_path: Path) -> None:
    """A 512 MiB member in a half-MiB gzip layer, and 64 MiB of 1 MiB members, under a 16 MiB budget:
    refused with the numbers, the store never past the budget, and the image's first (good) layer,
    unpacked before the bomb, dropped with it."""
    budget = 16 << 20
    layout = Layout(tmp_path / "oci")
    one = layout.image("one", [BASE, gz_layer(("bomb", 512 << 20))])
    many = layout.image("many", [BASE, gz_layer(*((f"z{i}", 1 << 20) for i in range(64)))])
    assert all(p.stat().st_size < (1 << 20) for p in layout.blobs.iterdir())  # compressed: small
    images = HostImages(tmp_path / "store", budget_bytes=budget)
    with Watch(tmp_path / "store") as watch:
        with pytest.raises(ImageOverBudget):
            asyncio.run(images.get(ImageRef.parse(one)))
        first = rejected(images, one, "would pass the image store's budget")
        second = rejected(images, many, "would pass the image store's budget")
    assert "'bomb'" in first and f"over the {budget} bytes" in first
    assert "layer 2 of 2" in second and f"the store's budget is {budget} bytes" in second
    assert watch.most <= budget, watch.most
    assert left(tmp_path / "store") == []


def test_the_budget_evicts_what_it_can_before_refusing(tmp_path: Path) -> None:
    """Images no host uses do not count against a new import (they are evicted after it); an
    image in use does."""
    layout = Layout(tmp_path / "oci")
    a = layout.image("a", [BASE, tar_of(("a", 6 << 20))])
    b = layout.image("b", [BASE, tar_of(("b", 6 << 20))])
    store = tmp_path / "store"
    holder, other = HostImages(store, budget_bytes=10 << 20), HostImages(store, budget_bytes=10 << 20)
    held = asyncio.run(holder.get(a))
    message = rejected(other, b, "would pass")  # a is held by a host: 6 MiB of the 10 are taken
    assert "held by images in use" in message
    assert other.rejected == {}  # a refusal for room is not remembered: images in use may go
    holder._unpin(held)
    holder.images.clear()
    asyncio.run(other.get(b))  # a is no longer in use: b fits, and a goes after the import
    assert other.disk_bytes() <= 10 << 20
    assert not held.lowers[-1].exists()


def test_a_layer_with_more_entries_than_the_cap_is_refused(tmp_path: Path) -> None:
    ref = Layout(tmp_path / "oci").image("wide", [BASE, tar_of(*((f"e{i}", b"") for i in range(300)))])
    images = HostImages(tmp_path / "store", layer_entries=100)
    assert "more than 100 entries" in rejected(images, ref, "per-layer cap")
    assert left(tmp_path / "store") == []


def test_a_layer_nobody_records_is_swept_by_the_next_trim(tmp_path: Path) -> None:
    """What a host that died mid-import left (a committed layer without its record, a staging dir)
    is found by eviction, not kept forever."""
    ref = Layout(tmp_path / "oci").image("ok", [BASE])
    images = HostImages(tmp_path / "store")
    root = asyncio.run(images.get(ImageRef.parse(ref)))
    (tmp_path / "store" / "layers" / ("f" * 64)).mkdir()
    (tmp_path / "store" / "tmp" / "stage-dead").mkdir()
    images.trim()
    assert left(tmp_path / "store") == [root.lowers[0].name]


# -- 3. OCI layouts as hostile input ----------------------------------------------------------------
def test_a_layer_blob_that_does_not_match_its_digest_is_refused(tmp_path: Path) -> None:
    """The same tar (so the DiffID still matches) compressed differently: the blob is not what the
    manifest names."""
    layout = Layout(tmp_path / "oci")
    top = tar_of(("a", b"1" * 5000))
    ref = layout.image("v1", [BASE, top])
    manifest = layout.manifest("v1")
    data = gzip.compress(top, 9)
    assert data != gzip.compress(top, 1)
    layout.blob_of(manifest["layers"][1]["digest"]).write_bytes(data)
    manifest["layers"][1]["size"] = len(data)  # a size that agrees: only the digest tells
    layout.manifests[0].update(layout.put(json.dumps(manifest).encode()))
    (tmp_path / "oci" / "index.json").write_text(json.dumps({"schemaVersion": 2, "manifests": layout.manifests}))
    images = HostImages(tmp_path / "store")
    assert "layer 2 hashes to" in rejected(images, ref, "not its digest")
    assert left(tmp_path / "store") == []


def test_a_config_or_manifest_that_does_not_match_its_digest_is_refused(tmp_path: Path) -> None:
    layout = Layout(tmp_path / "oci")
    ref = layout.image("v1", [BASE])
    config = layout.blob_of(layout.manifest("v1")["config"]["digest"])
    config.write_bytes(config.read_bytes().replace(b'"WorkingDir": "/"', b'"WorkingDir": "/x"'))
    rejected(HostImages(tmp_path / "store"), ref, "config hashes to .* not its digest")
    manifest = layout.blob_of(layout.manifests[0]["digest"])
    manifest.write_bytes(manifest.read_bytes() + b" ")
    rejected(HostImages(tmp_path / "store2"), ref, "manifest hashes to .* not its digest")


@pytest.mark.parametrize("where", ["blob", "blobs dir", "sha256 dir", "index.json"])
def test_a_symlink_in_a_layout_is_not_followed(tmp_path: Path, where: str) -> None:
    """A link to bytes outside the layout (here: the very bytes the blob should hold, so only the
    link itself is wrong) is refused, never read."""
    layout = Layout(tmp_path / "oci")
    ref = layout.image("v1", [BASE])
    outside = tmp_path / "outside"
    if where == "blob":
        blob = layout.blob_of(layout.manifest("v1")["layers"][0]["digest"])
        outside.write_bytes(blob.read_bytes())
        blob.unlink()
        blob.symlink_to(outside)
    elif where == "index.json":
        index = tmp_path / "oci" / "index.json"
        outside.write_bytes(index.read_bytes())
        index.unlink()
        index.symlink_to(outside)
    else:
        moved = layout.blobs if where == "sha256 dir" else layout.blobs.parent
        moved.rename(outside)
        moved.symlink_to(outside)
    assert "is a symlink (not followed)" in rejected(HostImages(tmp_path / "store"), ref, "symlink")
    assert left(tmp_path / "store") == []


def test_a_fifo_for_a_blob_is_refused_without_blocking(tmp_path: Path) -> None:
    layout = Layout(tmp_path / "oci")
    ref = layout.image("v1", [BASE])
    blob = layout.blob_of(layout.manifests[0]["digest"])
    blob.unlink()
    os.mkfifo(blob)
    rejected(HostImages(tmp_path / "store"), ref, "not a regular file")


PROBE = """
import asyncio, sys
from atropos.errors import ImageOverBudget, ImageRejected
from atropos.sandbox.host.images.host_images import HostImages
try:
    asyncio.run(HostImages(__import__("pathlib").Path(sys.argv[1])).get(sys.argv[2]))
except ImageRejected as exc:
    print(exc)
print(next(line.split()[1] for line in open("/proc/self/status") if line.startswith("VmHWM:")))
"""


@pytest.mark.parametrize("which", ["manifest", "config", "index.json"])
def test_a_huge_json_blob_is_refused_without_reading_it(tmp_path: Path, which: str) -> None:
    """A 512 MiB (sparse) manifest, config or index: refused on its size; the importing process's
    peak memory stays far below it (read whole, it was 557 MiB)."""
    layout = Layout(tmp_path / "oci")
    ref = layout.image("v1", [BASE])
    path = {"manifest": layout.blob_of(layout.manifests[0]["digest"]),
            "config": layout.blob_of(layout.manifest("v1")["config"]["digest"]),
            "index.json": tmp_path / "oci" / "index.json"}[which]
    with open(path, "r+b") as fh:
        fh.truncate(512 << 20)
    out = subprocess.run([sys.executable, "-c", PROBE, str(tmp_path / "store"), ref], capture_output=True,
                         text=True, timeout=120, check=True).stdout.splitlines()
    assert "is 536870912 bytes, more than" in out[0], out
    assert int(out[-1]) < 200 << 10, out  # peak KiB since the exec: an interpreter's, not the blob's


def test_oci_references_as_skopeo_writes_them(tmp_path: Path) -> None:
    """``oci:DIR:TAG`` picks one image of a layout holding several; ``oci:DIR`` takes the only one
    or says which tags there are; a tag or a layout that does not exist is ``image_rejected``."""
    layout = Layout(tmp_path / "oci")
    v1 = layout.image("v1", [BASE], Env=["WHICH=one"])
    v2 = layout.image("v2", [BASE, tar_of(("two", b"2"))], Env=["WHICH=two"])
    images = HostImages(tmp_path / "store")
    assert asyncio.run(images.get(ImageRef.parse(v1))).env()["WHICH"] == "one"
    two = asyncio.run(images.get(ImageRef.parse(v2)))
    assert two.env()["WHICH"] == "two" and two.reference == v2 and (two.lowers[-1] / "two").exists()
    rejected(images, f"oci:{tmp_path / 'oci'}", "holds 2 images; name one as oci:DIR:TAG \\(its tags: 'v1', 'v2'\\)")
    rejected(images, f"oci:{tmp_path / 'oci'}:v3", "0 images tagged 'v3'")
    rejected(images, f"oci:{tmp_path / 'nowhere'}", "no OCI image layout at")
    rejected(images, f"oci:{tmp_path / 'nowhere'}:v1", "no OCI image layout at")


def test_a_refused_half_import_leaves_nothing_and_a_good_one_after_it_works(tmp_path: Path) -> None:
    """Three layers, the third hostile (a path climbing out): the first two, unpacked already, go
    with it; the good image sharing the first layer imports whole afterwards."""
    layout = Layout(tmp_path / "oci")
    bad = layout.image("bad", [BASE, tar_of(("ok", b"ok")), tar_of(("../escape", b"x"))])
    good = layout.image("good", [BASE, tar_of(("ok", b"ok"))])
    images = HostImages(tmp_path / "store")
    rejected(images, bad, "layer 3 of 3: .*climbs out")
    assert left(tmp_path / "store") == []
    root = asyncio.run(images.get(ImageRef.parse(good)))
    assert (root.lowers[1] / "ok").read_bytes() == b"ok"
    assert stat.S_IMODE(os.stat(root.lowers[1]).st_mode) == 0o755


# -- the unprivileged import (a Docker host's: atropos/sandbox/host/images/userns_import.py) --------
def docker_archive(path: Path, layers: list[bytes], **config: Any) -> Path:
    """A ``docker save`` archive (the legacy layout: manifest.json, the config, layer tars)."""
    cfg = json.dumps({"rootfs": {"type": "layers", "diff_ids": ["sha256:" + hashlib.sha256(t).hexdigest()
                                                                 for t in layers]},
                      "config": {"Env": ["PATH=/bin"], **config}}).encode()
    names = [f"l{i}/layer.tar" for i in range(len(layers))]
    members = [("manifest.json", json.dumps([{"Config": "c.json", "RepoTags": ["x:1"], "Layers": names}]).encode()),
               ("c.json", cfg), *zip(names, layers, strict=True)]
    with tarfile.open(path, "w") as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


def test_the_unprivileged_import_stages_checks_and_bounds_as_the_host_does(tmp_path: Path) -> None:
    """The child in its own user namespace (what a Docker host, uid 1000, runs): a good archive is
    committed with its check done; a bad User and a bomb past its budget are refused, leaving
    nothing, the bomb as ``ImageOverBudget``."""
    from atropos.sandbox.host.images.layer_store import ImportBudget, LayerStore
    from atropos.sandbox.host.images.userns_import import import_archive

    store = tmp_path / "store"
    LayerStore(store, owners=False)
    good = import_archive(store, docker_archive(tmp_path / "good.tar", [BASE], User="agent"), "good:1")
    assert [Path(p).is_dir() for p in good["layers"]] == [True]  # type: ignore[union-attr]
    with pytest.raises(ImageRejected, match="'ghost' is not in its /etc/passwd"):
        import_archive(store, docker_archive(tmp_path / "bad.tar", [BASE, tar_of(("x", b"x"))], User="ghost"), "bad:1")
    bomb = docker_archive(tmp_path / "bomb.tar", [BASE, tar_of(("big", 8 << 20))])
    with pytest.raises(ImageOverBudget, match="would pass the image store's budget"):
        import_archive(store, bomb, "bomb:1", budget=ImportBudget(bytes_left=4 << 20))
    assert sorted(os.listdir(store / "layers")) == [Path(good["layers"][0]).name]  # type: ignore[index]
    assert os.listdir(store / "tmp") == []
