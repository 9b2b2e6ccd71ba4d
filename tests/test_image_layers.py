"""The layer store (atropos/sandbox/host/images/layer_store.py): image layers are untrusted input.

Each hostile layer here is one a policy (or a poisoned dataset) could hand the host: paths that
climb out, writes through a planted symlink, hard links to host files, device nodes, setuid files,
overlayfs' own xattrs. Every test unpacks a real tar onto the real filesystem and then looks at the
host: nothing outside the store changed, and nothing refused was left in the store.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import os
import shutil
import stat
import subprocess
import tarfile
from collections.abc import Callable
from pathlib import Path

import pytest

from atropos.errors import ImageRejected
from atropos.sandbox.contract.imageref import ImageRef
from atropos.sandbox.host.images.layer_store import LayerStore

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="layers keep their owners: the store runs as root")

Member = tuple[tarfile.TarInfo, bytes | None]


def layer(*members: Member) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for info, data in members:
            tar.addfile(info, io.BytesIO(data) if data is not None else None)
    return buf.getvalue()


def entry(name: str, kind: bytes = tarfile.REGTYPE, data: bytes | None = None, *, mode: int = 0o644,
          link: str = "", uid: int = 0, pax: dict[str, str] | None = None) -> Member:
    info = tarfile.TarInfo(name)
    info.type, info.mode, info.linkname, info.uid, info.gid, info.mtime = kind, mode, link, uid, uid, 1_700_000_000
    if pax:
        info.pax_headers = pax
    if kind == tarfile.REGTYPE:
        data = data if data is not None else b""
        info.size = len(data)
    return info, data


def directory(name: str, mode: int = 0o755) -> Member:
    return entry(name, tarfile.DIRTYPE, mode=mode)


@pytest.fixture
def store(tmp_path: Path) -> LayerStore:
    return LayerStore(tmp_path / "store")


@pytest.fixture
def outside(tmp_path: Path) -> Path:
    """A host directory beside the store that no layer may touch."""
    d = tmp_path / "host"
    d.mkdir()
    (d / "secret").write_text("host\n")
    return d


def left_in_store(store: LayerStore) -> list[str]:
    return sorted(os.listdir(store.root / "layers")) + sorted(os.listdir(store.root / "tmp"))


def test_a_layer_unpacks_as_docker_would_and_is_keyed_by_its_diff_id(store: LayerStore) -> None:
    data = layer(directory("usr"), directory("usr/bin"), entry("usr/bin/tool", data=b"#!/bin/sh\n", mode=0o755),
                 entry("usr/bin/alias", tarfile.SYMTYPE, link="tool"), entry("etc/hostname", data=b"task\n"),
                 entry("usr/bin/again", tarfile.LNKTYPE, link="usr/bin/tool"),
                 directory("tmp", 0o1777), entry("etc/owned", data=b"x", uid=1000))
    info = store.add(io.BytesIO(data))
    assert info.diff_id == "sha256:" + hashlib.sha256(data).hexdigest()
    root = store.path(info.diff_id)
    assert root == info.path and store.has(info.diff_id) and store.layers() == [info.diff_id]
    assert (root / "usr/bin/tool").read_bytes() == b"#!/bin/sh\n"
    assert stat.S_IMODE((root / "usr/bin/tool").stat().st_mode) == 0o755
    assert os.readlink(root / "usr/bin/alias") == "tool"
    assert (root / "usr/bin/again").stat().st_ino == (root / "usr/bin/tool").stat().st_ino
    assert stat.S_IMODE((root / "tmp").stat().st_mode) == 0o1777  # sticky /tmp kept (tarfile's filters drop it)
    assert (root / "etc/owned").stat().st_uid == 1000
    assert (root / "etc/hostname").stat().st_mtime == 1_700_000_000
    # the same layer again, by its DiffID: nothing unpacked twice
    again = store.add(io.BytesIO(b"not even read"), diff_id=info.diff_id)
    assert again.path == root and left_in_store(store) == [info.diff_id.split(":")[1]]


@pytest.mark.parametrize("compress", ["gzip", "zstd"])
def test_compression_is_told_by_magic_bytes_and_the_diff_id_is_of_the_uncompressed_tar(
        store: LayerStore, compress: str) -> None:
    data = layer(entry("a", data=b"1" * 10_000))
    if compress == "gzip":
        blob = gzip.compress(data)
    else:
        if shutil.which("zstd") is None:
            pytest.skip("no zstd program on this machine")
        blob = subprocess.run(["zstd", "-q", "-c"], input=data, capture_output=True, check=True).stdout
    info = store.add(io.BytesIO(blob))
    assert info.diff_id == "sha256:" + hashlib.sha256(data).hexdigest()
    assert (info.path / "a").read_bytes() == b"1" * 10_000


def test_whiteouts_and_opaque_directories_become_overlayfs_ones(store: LayerStore) -> None:
    info = store.add(io.BytesIO(layer(directory("etc"), entry("etc/.wh.motd"), directory("opt"),
                                      entry("opt/.wh..wh..opq"), entry("opt/new", data=b"n"))))
    wh = os.lstat(info.path / "etc/motd")
    assert stat.S_ISCHR(wh.st_mode) and wh.st_rdev == os.makedev(0, 0)
    assert not (info.path / "etc/.wh.motd").exists()
    assert os.getxattr(info.path / "opt", "trusted.overlay.opaque") == b"y"
    assert os.getxattr(info.path / "opt", "user.overlay.opaque") == b"y"
    assert sorted(os.listdir(info.path / "opt")) == ["new"]


HOSTILE: dict[str, Callable[[Path], bytes]] = {
    "dot-dot path": lambda host: layer(entry(f"../../{host.name}/secret", data=b"pwned")),
    "dot-dot inside a path": lambda host: layer(directory("a"), entry(f"a/../../../{host.name}/secret", data=b"x")),
    "absolute path": lambda host: layer(entry(f"{host}/secret", data=b"pwned")),
    "write through a planted symlink": lambda host: layer(entry("evil", tarfile.SYMTYPE, link=str(host)),
                                                          entry("evil/secret", data=b"pwned")),
    "write through a relative symlink out": lambda host: layer(
        entry("evil", tarfile.SYMTYPE, link=f"../../{host.name}"), entry("evil/secret", data=b"pwned")),
    "hard link to a host file": lambda host: layer(entry("ln", tarfile.LNKTYPE, link=f"{host}/secret")),
    "hard link climbing out": lambda host: layer(entry("ln", tarfile.LNKTYPE, link=f"../../{host.name}/secret")),
    "hard link through a symlink": lambda host: layer(entry("evil", tarfile.SYMTYPE, link=str(host)),
                                                      entry("ln", tarfile.LNKTYPE, link="evil/secret")),
    "hard link to a lower layer's file": lambda host: layer(entry("ln", tarfile.LNKTYPE, link="etc/passwd")),
    "whiteout climbing out": lambda host: layer(entry(".wh...")),
}


@pytest.mark.parametrize("attack", sorted(HOSTILE))
def test_a_hostile_layer_is_refused_whole_and_changes_nothing_outside(
        store: LayerStore, outside: Path, attack: str) -> None:
    before = {p: (p.stat().st_ino, p.read_bytes()) for p in outside.iterdir()}
    with pytest.raises(ImageRejected):
        store.add(io.BytesIO(HOSTILE[attack](outside)))
    assert {p: (p.stat().st_ino, p.read_bytes()) for p in outside.iterdir()} == before
    assert (outside / "secret").stat().st_nlink == 1  # no hard link to it anywhere
    assert left_in_store(store) == [], "a refused layer left files in the store"


def test_device_nodes_are_dropped_and_named(store: LayerStore) -> None:
    mem = entry("dev/mem", tarfile.CHRTYPE, mode=0o666)
    mem[0].devmajor, mem[0].devminor = 1, 1
    disk = entry("dev/sda", tarfile.BLKTYPE, mode=0o666)
    disk[0].devmajor, disk[0].devminor = 8, 0
    info = store.add(io.BytesIO(layer(directory("dev"), mem, disk, entry("dev/ok", data=b"k"))))
    assert sorted(os.listdir(info.path / "dev")) == ["ok"]
    assert info.dropped == ["dev/mem: device node", "dev/sda: device node"]


def test_setuid_bits_are_kept_but_the_store_is_its_owners_only(store: LayerStore) -> None:
    info = store.add(io.BytesIO(layer(entry("su", data=b"\x7fELF", mode=0o4755))))
    assert stat.S_IMODE((info.path / "su").stat().st_mode) == 0o4755  # as `docker run` shows it
    # no other user can reach (let alone execute) a setuid file of a layer on the host
    for d in (store.root, store.root / "layers"):
        assert stat.S_IMODE(d.stat().st_mode) == 0o700 and d.stat().st_uid == os.geteuid()


def test_overlay_and_capability_xattrs_from_a_layer_are_dropped(store: LayerStore) -> None:
    info = store.add(io.BytesIO(layer(entry("f", data=b"x", pax={
        "SCHILY.xattr.trusted.overlay.redirect": "/etc/shadow",
        "SCHILY.xattr.user.overlay.opaque": "y",
        "SCHILY.xattr.security.capability": "\x01\x00\x00\x02",
        "SCHILY.xattr.user.note": "kept"}))))
    assert os.listxattr(info.path / "f") == ["user.note"]
    assert sorted(info.dropped) == ["f: xattr security.capability", "f: xattr trusted.overlay.redirect",
                                    "f: xattr user.overlay.opaque"]


def test_a_layer_whose_content_does_not_match_its_diff_id_is_refused(store: LayerStore) -> None:
    data = layer(entry("a", data=b"1"))
    wrong = "sha256:" + hashlib.sha256(b"other").hexdigest()
    with pytest.raises(ImageRejected, match="hashes to"):
        store.add(io.BytesIO(data), diff_id=wrong)
    assert left_in_store(store) == []
    with pytest.raises(ImageRejected, match="not a sha256"):
        store.path("sha256:../../etc")


def test_not_a_tar_is_refused_cleanly(store: LayerStore) -> None:
    with pytest.raises(ImageRejected, match="not a valid layer tar"):
        store.add(io.BytesIO(b"\x00garbage" * 100))
    assert left_in_store(store) == []


# -- images from the local Docker engine, compared with `docker run` of the same image -------------
BASE_IMAGE = "atropos-sandbox-base:bookworm"  # built by scripts/build_image.sh (no registry needed)
TASK_DOCKERFILE = f"""FROM {BASE_IMAGE}
RUN mkdir -p /testbed/pkg && echo 'def f(): return 1' > /testbed/pkg/mod.py && echo old > /etc/motd-task \\
    && mkdir -p /opt/envs/py/bin && printf 'shared\\n' > /opt/envs/py/bin/tool && chmod 4755 /opt/envs/py/bin/tool
RUN rm /etc/motd-task && rm -rf /usr/share/doc && mkdir -p /usr/share/doc && echo new > /usr/share/doc/only \\
    && ln /testbed/pkg/mod.py /testbed/pkg/hard.py && ln -s ../pkg/mod.py /testbed/link.py
ENV TASK_ID=7 PATH=/opt/envs/py/bin:/usr/local/bin:/usr/bin:/bin
WORKDIR /testbed
USER 0:0
"""
PROBE = ("find /testbed /opt/envs /usr/share/doc /etc/motd-task -xdev -printf '%p %y %m %u %g %s %l\\n' "
         "2>&1 | LC_ALL=C sort")


def docker_or_skip() -> None:
    from tests.pool_backends import require_docker

    require_docker()
    if subprocess.run(["docker", "image", "inspect", BASE_IMAGE], capture_output=True).returncode != 0:
        pytest.fail(f"{BASE_IMAGE} is missing: scripts/build_image.sh builds it")


def build_image(tag: str, dockerfile: str, tmp_path: Path) -> None:
    ctx = tmp_path / f"ctx-{tag.replace(':', '-').replace('/', '-')}"
    ctx.mkdir()
    (ctx / "Dockerfile").write_text(dockerfile)
    subprocess.run(["docker", "build", "-q", "-t", tag, str(ctx)], check=True, capture_output=True)


def merged(layers: list[str], tmp_path: Path) -> Path:
    """The image's root as a slot sees it: the layers as overlayfs lowers (top first)."""
    up, work, root = tmp_path / "upper", tmp_path / "work", tmp_path / "root"
    for d in (up, work, root):
        d.mkdir()
    lower = ":".join(reversed(layers))
    subprocess.run(["mount", "-t", "overlay", "overlay", "-o", f"lowerdir={lower},upperdir={up},workdir={work}",
                    str(root)], check=True)
    return root


@pytest.mark.docker
def test_an_image_from_the_engine_is_the_root_docker_run_shows(tmp_path: Path) -> None:
    from atropos.sandbox.host.images.sources import import_from_docker

    docker_or_skip()
    tag = f"atropos-test-task:{os.getpid()}"
    build_image(tag, TASK_DOCKERFILE, tmp_path)
    root = None
    try:
        store = LayerStore(tmp_path / "store")
        image = import_from_docker(store, tag)
        assert image.unpacked == len(image.config.diff_ids) == 3
        assert image.config.working_dir == "/testbed" and image.config.user == "0:0"
        assert "TASK_ID=7" in image.config.env
        root = merged(image.layers, tmp_path)
        ours = subprocess.run(["chroot", str(root), "sh", "-c", PROBE], capture_output=True, text=True).stdout
        theirs = subprocess.run(["docker", "run", "--rm", "--network", "none", "--entrypoint", "sh", tag, "-c", PROBE],
                                capture_output=True, text=True, check=True).stdout
        assert ours == theirs
        assert "/usr/share/doc/only" in ours and "/etc/motd-task" in ours and "No such file" in ours
        # a second image on the same base: the base is stored once, only the new layer is unpacked
        other = f"atropos-test-task2:{os.getpid()}"
        build_image(other, f"FROM {BASE_IMAGE}\nRUN echo two > /task2\n", tmp_path)
        try:
            second = import_from_docker(store, other)
        finally:
            subprocess.run(["docker", "rmi", "-f", other], capture_output=True)
        assert second.unpacked == 1 and second.layers[0] == image.layers[0]
        assert len(store.layers()) == 4
    finally:
        if root is not None:
            subprocess.run(["umount", str(root)], check=False)
        subprocess.run(["docker", "rmi", "-f", tag], capture_output=True)


def test_an_image_the_engine_does_not_have_is_a_clear_error(tmp_path: Path) -> None:
    from atropos.sandbox.host.images.sources import import_from_docker

    docker_or_skip()
    with pytest.raises(ImageRejected, match="has no image"):
        import_from_docker(LayerStore(tmp_path / "store"), "atropos-no-such-image:never")


# -- an OCI image layout (what `skopeo copy docker://REF oci:DIR:TAG` writes) ----------------------
def oci_layout(root: Path, layers: list[bytes], *, diff_ids: list[str] | None = None) -> Path:
    """An OCI layout with one image ``v1``: gzip layer blobs (their digest is not their DiffID)."""
    blobs = root / "blobs" / "sha256"
    blobs.mkdir(parents=True)

    def put(data: bytes) -> dict[str, object]:
        digest = hashlib.sha256(data).hexdigest()
        (blobs / digest).write_bytes(data)
        return {"digest": f"sha256:{digest}", "size": len(data)}

    descs = [{"mediaType": "application/vnd.oci.image.layer.v1.tar+gzip", **put(gzip.compress(layer_tar))}
             for layer_tar in layers]
    config = {"rootfs": {"type": "layers", "diff_ids": diff_ids or [
        "sha256:" + hashlib.sha256(t).hexdigest() for t in layers]},
              "config": {"Env": ["PATH=/usr/bin:/bin", "TASK=oci"], "WorkingDir": "/testbed", "User": "1000"}}
    manifest = {"schemaVersion": 2, "config": {"mediaType": "application/vnd.oci.image.config.v1+json",
                                               **put(json.dumps(config).encode())}, "layers": descs}
    index = {"schemaVersion": 2, "manifests": [{"mediaType": "application/vnd.oci.image.manifest.v1+json",
                                                **put(json.dumps(manifest).encode()),
                                                "annotations": {"org.opencontainers.image.ref.name": "v1"}}]}
    (root / "index.json").write_text(json.dumps(index))
    (root / "oci-layout").write_text('{"imageLayoutVersion": "1.0.0"}')
    return root


def test_an_oci_layout_image_is_imported_with_its_config_and_layers_by_diff_id(tmp_path: Path) -> None:
    from atropos.sandbox.host.images.sources import import_oci_layout

    base = layer(directory("etc"), entry("etc/motd", data=b"base\n"), entry("etc/gone", data=b"x"))
    top = layer(directory("etc"), entry("etc/.wh.gone"), directory("testbed"), entry("testbed/a.py", data=b"1\n"))
    store = LayerStore(tmp_path / "store")
    oci_layout(tmp_path / "oci", [base, top])
    image = import_oci_layout(store, ImageRef.parse(f"oci:{tmp_path / 'oci'}:v1"))
    assert image.unpacked == 2 and len(image.layers) == 2
    assert image.config.working_dir == "/testbed" and image.config.user == "1000"
    assert "TASK=oci" in image.config.env
    assert (Path(image.layers[1]) / "testbed/a.py").read_bytes() == b"1\n"
    assert stat.S_ISCHR(os.lstat(Path(image.layers[1]) / "etc/gone").st_mode)  # the whiteout
    assert import_oci_layout(store, ImageRef.parse(f"oci:{tmp_path / 'oci'}:v1")).unpacked == 0  # all held already
    assert import_oci_layout(store, ImageRef.parse(f"oci:{tmp_path / 'oci'}")).unpacked == 0  # its one image, untagged
    with pytest.raises(ImageRejected, match="0 images tagged 'v2' \\(its tags: 'v1'\\)"):
        import_oci_layout(store, ImageRef.parse(f"oci:{tmp_path / 'oci'}:v2"))


def test_an_oci_layer_that_is_not_what_its_config_says_is_refused(tmp_path: Path) -> None:
    from atropos.sandbox.host.images.sources import import_oci_layout

    good, other = layer(entry("a", data=b"1")), layer(entry("b", data=b"2"))
    lying = oci_layout(tmp_path / "oci", [good], diff_ids=["sha256:" + hashlib.sha256(other).hexdigest()])
    store = LayerStore(tmp_path / "store")
    with pytest.raises(ImageRejected, match="hashes to"):
        import_oci_layout(store, ImageRef.parse(f"oci:{lying}:v1"))
    assert left_in_store(store) == []
