"""image_import: importing a task image the host never saw, with the disk budget's accounting on
(every layer member charged and counted as it unpacks, the budget less what images in use hold
computed first; docs/task-images.md, "Bounded on disk") and off (``HostImages(accounting=False)``:
only the per-layer entry cap), interleaved round by round in one run.

The image is an OCI layout written here (no engine, no registry): a layer of many small files (a
Python environment's shape), a layer of a few large ones, and a small top layer, gzip-compressed
as skopeo writes them. Each round imports it into a fresh store (staging, digest checks, the
image check, the commit). Rates are the image's uncompressed file bytes and layer entries over the
import's wall time.

**First call on a never-seen ~1 GB image** (``--first-call``, on unless ``--no-first-call``): an
image built here ``FROM atropos-sandbox-base:bookworm`` plus four layers of random (incompressible)
data, ~1 GB in all (``--image-mb``), kept by the engine under a tag naming its recipe (built once per
machine). Per round, a local pool with a fresh layer store is started (untimed), then
``pool.lease(id, image=REF)`` + the first bash ``true`` is timed: the host asks the engine for the
image, copies its layers from the engine's own dirs into the store (sanitized, charged to the
budget), checks it, mounts the root and starts the sandbox. The baseline, interleaved round by
round: ``docker run -d REF sleep`` + ``docker exec true`` of the same image on the same engine (a
container per task; the engine already holds the image, as it does for the pool).

**The same on the Docker backend** (when the engine holds ``ATROPOS_SANDBOX_IMAGE``): per round a
Docker-backend pool of one container's host is started (untimed) with a fresh operator volume
(``image_volume``: a 1 GB image does not belong in the container's memory-backed tmpfs), then the
same lease + first ``true`` is timed: the pool asks its engine for the image's id, streams the
engine's export (``docker save`` bytes) to the host's upload, which spools it to the volume,
unpacks it as uid 1000 in a user namespace of its own, checks it, mounts the root and starts the
sandbox. Interleaved with the other two, round by round.

``python -m benchmarks.scenario_image_import [--quick] [--no-first-call] [--first-call-only] [--image-mb 1024]``
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
import subprocess
import sys
import tarfile
import time
from pathlib import Path

from benchmarks.common import (
    DOCKER_IMAGE,
    Row,
    ScenarioResult,
    bench_dir,
    docker_pool,
    docker_problem,
    lease_first_true,
    scenario_main,
)

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
    from atropos.sandbox.contract.imageref import ImageRef
    from atropos.sandbox.host.images.host_images import HostImages

    images = HostImages(store, accounting=accounting)
    t0 = time.perf_counter()
    asyncio.run(images.get(ImageRef.parse(reference)))
    took = time.perf_counter() - t0
    for root in images.images.values():
        images._unpin(root)
    return took


BASE = "atropos-sandbox-base:bookworm"
LAYERS = 4  # the random data's layers (the base's own on top: 5 in all)


def build_big_image(megabytes: int) -> str:
    """``atropos-bench/import-big:<recipe>``: the base plus LAYERS layers of random data,
    ``megabytes`` in all with the base; built unless the engine holds it (a few minutes once)."""
    base_mb = int(subprocess.run(["docker", "image", "inspect", "-f", "{{.Size}}", BASE], capture_output=True,
                                 text=True, check=True).stdout.strip()) >> 20
    per_layer = max(1, (megabytes - base_mb) // LAYERS)
    runs = "\n".join(f"RUN head -c {per_layer}M /dev/urandom > /data/layer{i}.bin" for i in range(LAYERS))
    dockerfile = f"FROM {BASE}\nRUN mkdir /data /testbed\n{runs}\nWORKDIR /testbed\n"
    tag = f"atropos-bench/import-big:{hashlib.sha256(dockerfile.encode()).hexdigest()[:12]}"
    if subprocess.run(["docker", "image", "inspect", tag], capture_output=True).returncode != 0:
        proc = subprocess.run(["docker", "build", "-q", "-t", tag, "-"], input=dockerfile, text=True,
                              capture_output=True, timeout=3600)
        if proc.returncode != 0:
            raise RuntimeError(f"docker build of {tag} failed: {proc.stderr.strip()[-500:]}")
    return tag


async def part_first_call(res: ScenarioResult, megabytes: int, rounds: int) -> None:
    """The first call on a never-seen big image, beside ``docker run`` + ``exec`` of it (see the module doc)."""
    from benchmarks.scenario_image_roots import _pool_id, docker_first_exec, started

    problem = docker_problem()
    if problem is not None:
        res.notes.append(f"first call on a never-seen image: skipped ({problem})")
        return
    if os.geteuid() != 0:
        res.notes.append("first call on a never-seen image: skipped (image roots need the root host here)")
        return
    t0 = time.perf_counter()
    image = await asyncio.to_thread(build_big_image, megabytes)
    size = int(subprocess.run(["docker", "image", "inspect", "-f", "{{.Size}}", image], capture_output=True,
                              text=True, check=True).stdout.strip())
    res.notes.append(f"big image {image}: {size / 1e6:,.0f} MB, {LAYERS + 1} layers (built or found in "
                     f"{time.perf_counter() - t0:.0f} s)")
    ours: list[float] = []
    docker: list[float] = []
    on_docker: list[float] = []
    kinds = ["ours", "docker"]
    backend_problem = docker_problem(DOCKER_IMAGE)
    if backend_problem is None:
        kinds.append("docker-backend")
    else:
        res.notes.append(f"first call on the Docker backend: skipped ({backend_problem})")
    for i in range(rounds):
        for which in kinds[i % len(kinds):] + kinds[:i % len(kinds)]:  # order rotating round by round
            if which == "docker":
                docker.append(await asyncio.to_thread(docker_first_exec, image))
                continue
            if which == "docker-backend":
                on_docker.append(await first_call_on_docker(image, i))
                continue
            async with started(_pool_id("big"), 1) as pool:
                ours.append((await lease_first_true(pool, f"big-{i}", image))[1])
    base = Row("docker run -d + docker exec true (same image)", docker,
               base="docker run -d + docker exec true (same image)")  # this part's own baseline
    first = Row("lease + first true, never-seen image (fresh store)", ours, base=base.name)
    res.rows += [base, first,
                 Row("import rate of the big image (image bytes / first call p50)",
                     value=size / 1e6 / (first.p50 / 1e3), unit="MB/s")]
    res.notes.append(f"first call on a never-seen {size / 1e6:,.0f} MB image: {first.p50 / base.p50:.1f}x "
                     "docker run + exec of the same image (same run, interleaved); the import is paid once "
                     "per host's store, a held image's first call is image_roots' row")
    if on_docker:
        shipped = Row("Docker backend: lease + first true, never-seen image (shipped, fresh volume)", on_docker,
                      base=base.name)
        rate = size / 1e6 / (shipped.p50 / 1e3)
        res.rows += [shipped, Row("Docker backend: image bytes / first call p50", value=rate, unit="MB/s")]
        res.notes.append(f"on the Docker backend: {shipped.p50 / base.p50:.1f}x docker run + exec, "
                         f"{shipped.p50 / first.p50:.2f}x the local backend's first call (same run, interleaved)")


async def first_call_on_docker(image: str, round_: int) -> float:
    """One Docker-backend sample (ms): a pool of one container's host with a fresh image volume,
    started untimed; then lease(image=) + the first ``true``, timed (see the module doc)."""
    from atropos.sandbox.contract.hostdirs import remove_tree

    volume = bench_dir(f"{NAME}-volume-{round_}")
    os.chown(volume, 1000, 1000)  # the container's host runs as uid 1000
    pool = docker_pool(f"bench-imgd-{os.getpid() % 10**5}-{round_}", 1, 1, {"image_volume": str(volume)},
                       acquire_timeout_s=3600)
    try:
        await pool.start()
        return (await lease_first_true(pool, f"bigd-{round_}", image))[1]
    finally:
        await pool.stop()
        await asyncio.to_thread(remove_tree, volume)


async def run(quick: bool) -> ScenarioResult:
    if FIRST_CALL_ONLY:
        res = ScenarioResult(NAME, "first call on a never-seen ~1 GB task image: local and Docker backends vs "
                             "docker run", params={"rounds": 2 if quick else 3, "image_mb": IMAGE_MB})
        await part_first_call(res, IMAGE_MB, 2 if quick else 3)
        return res
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
    if FIRST_CALL:
        await part_first_call(res, IMAGE_MB, 2 if quick else 3)
    return res


FIRST_CALL = "--no-first-call" not in sys.argv
FIRST_CALL_ONLY = "--first-call-only" in sys.argv
IMAGE_MB = int(sys.argv[sys.argv.index("--image-mb") + 1]) if "--image-mb" in sys.argv else 1024


if __name__ == "__main__":
    for flag in ("--no-first-call", "--first-call-only"):
        if flag in sys.argv:
            sys.argv.remove(flag)
    if "--image-mb" in sys.argv:
        at = sys.argv.index("--image-mb")
        del sys.argv[at:at + 2]
    scenario_main(NAME, run)
