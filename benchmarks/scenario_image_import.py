"""image_import: importing a task image the host never saw, with the disk budget's accounting on
(every layer member charged and counted as it unpacks, the budget less what images in use hold
computed first; docs/task-images.md, "Bounded on disk") and off (``HostImages(accounting=False)``:
only the per-layer entry cap), interleaved round by round in one run.

The image is an OCI layout written here (no engine, no registry): a layer of many small files (a
Python environment's shape), a layer of a few large ones, and a small top layer, gzip-compressed
as skopeo writes them. Each round imports it into a fresh store (staging, digest checks, the
image check, the commit). Rates are the image's uncompressed file bytes and layer entries over the
import's wall time.

``python -m benchmarks.scenario_image_import [--quick]``
"""

from __future__ import annotations

import asyncio
import gzip
import hashlib
import io
import json
import os
import random
import shutil
import tarfile
import time
from pathlib import Path

from benchmarks.common import Row, ScenarioResult, bench_dir, scenario_main

NAME = "image_import"


def _layer(members: list[tuple[str, bytes | None]]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.mtime = 1_700_000_000
            if data is None:
                info.type, info.mode = tarfile.DIRTYPE, 0o755
                tar.addfile(info)
            else:
                info.size, info.mode = len(data), 0o644
                tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def _content(rng: random.Random, size: int) -> bytes:
    """Half random, half repeated: compresses about as source and binaries do (~2:1)."""
    half = size // 2
    return rng.randbytes(half) + bytes(size - half)


def build_layout(root: Path, small_files: int, large_files: int, large_size: int) -> tuple[str, int, int]:
    """(reference, uncompressed file bytes, entries) of the benchmark image."""
    rng = random.Random(36)
    dirs = [f"usr/lib/python3/site-packages/pkg{i}" for i in range(small_files // 50 + 1)]
    small: list[tuple[str, bytes | None]] = [("usr", None), ("usr/lib", None), ("usr/lib/python3", None),
                                             ("usr/lib/python3/site-packages", None)]
    small += [(d, None) for d in dirs]
    small += [(f"{dirs[i // 50]}/m{i}.py", _content(rng, rng.randint(512, 8192))) for i in range(small_files)]
    large: list[tuple[str, bytes | None]] = [("opt", None)]
    large += [(f"opt/blob{i}.so", _content(rng, large_size)) for i in range(large_files)]
    top: list[tuple[str, bytes | None]] = [("etc", None), ("etc/passwd", b"root:x:0:0:root:/root:/bin/sh\n"),
                                           ("testbed", None), ("testbed/a.py", b"print('task')\n")]
    tars = [_layer(small), _layer(large), _layer(top)]
    members = [small, large, top]
    blobs = root / "blobs" / "sha256"
    blobs.mkdir(parents=True)

    def put(data: bytes) -> dict[str, object]:
        digest = hashlib.sha256(data).hexdigest()
        (blobs / digest).write_bytes(data)
        return {"digest": f"sha256:{digest}", "size": len(data)}

    descs = [{"mediaType": "application/vnd.oci.image.layer.v1.tar+gzip", **put(gzip.compress(t, 1))} for t in tars]
    config = {"rootfs": {"type": "layers", "diff_ids": ["sha256:" + hashlib.sha256(t).hexdigest() for t in tars]},
              "config": {"Env": ["PATH=/usr/bin:/bin"], "WorkingDir": "/testbed"}}
    manifest = {"schemaVersion": 2, "layers": descs,
                "config": {"mediaType": "application/vnd.oci.image.config.v1+json", **put(json.dumps(config).encode())}}
    (root / "index.json").write_text(json.dumps({"schemaVersion": 2, "manifests": [
        {"mediaType": "application/vnd.oci.image.manifest.v1+json", **put(json.dumps(manifest).encode()),
         "annotations": {"org.opencontainers.image.ref.name": "bench"}}]}))
    (root / "oci-layout").write_text('{"imageLayoutVersion": "1.0.0"}')
    size = sum(len(d) for layer in members for _, d in layer if d is not None)
    entries = sum(len(layer) for layer in members)
    return f"oci:{root}:bench", size, entries


def _import(store: Path, reference: str, accounting: bool) -> float:
    from atropos.sandbox.host.images.host_images import HostImages

    images = HostImages(store, accounting=accounting)
    t0 = time.perf_counter()
    asyncio.run(images.get(reference))
    took = time.perf_counter() - t0
    for root in images.images.values():
        images._unpin(root)
    return took


async def run(quick: bool) -> ScenarioResult:
    small_files, large_files, large_size = (5_000, 8, 4 << 20) if quick else (20_000, 32, 4 << 20)
    rounds = 3 if quick else 8
    res = ScenarioResult(NAME, "import of a never-seen task image (OCI layout), budget accounting on vs off",
                         params={"rounds": rounds, "small_files": small_files, "large_files": large_files,
                                 "large_size": large_size})
    root = bench_dir(NAME)
    try:
        reference, size, entries = await asyncio.to_thread(build_layout, root / "oci", small_files, large_files,
                                                           large_size)
        blob_bytes = sum(p.stat().st_size for p in (root / "oci" / "blobs" / "sha256").iterdir())
        res.notes.append(f"image: {entries:,} entries, {size / 1e6:.0f} MB of file data, {blob_bytes / 1e6:.0f} MB "
                         "of gzip blobs (3 layers)")
        samples: dict[bool, list[float]] = {False: [], True: []}
        for i in range(rounds):
            for accounting in ((False, True) if i % 2 == 0 else (True, False)):  # interleaved, order alternating
                store = root / f"store-{i}-{int(accounting)}"
                samples[accounting].append(await asyncio.to_thread(_import, store, reference, accounting) * 1000)
                await asyncio.to_thread(shutil.rmtree, store, True)
        off, on = Row("import, accounting off", samples[False], baseline=True), Row("import, accounting on",
                                                                                      samples[True])
        res.rows = [off, on]
        for row in (off, on):
            what = row.name.removeprefix("import, ")
            res.rows.append(Row(f"MB/s (file data / p50), {what}", value=size / 1e6 / (row.p50 / 1000), unit="MB/s"))
            res.rows.append(Row(f"entries/s (p50), {what}", value=entries / (row.p50 / 1000), unit="entries/s"))
        res.notes.append(f"accounting costs {on.p50 / off.p50:.3f}x the import's p50 (same run, interleaved); "
                         f"load is shared with other work on this machine: compare within the run")
    finally:
        shutil.rmtree(root, ignore_errors=True)
        os.sync()
    return res


if __name__ == "__main__":
    scenario_main(NAME, run)
