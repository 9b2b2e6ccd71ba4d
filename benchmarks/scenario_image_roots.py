"""image_roots: slots whose ``/`` is a task image (docs/task-images.md), beside a container per task.

Every image is built here ``FROM atropos-sandbox-base:bookworm`` (nothing is pulled). Measured on
the local backend (one host), side by side in one run:

- **first call on a held image**: ``pool.lease(id, image=REF)`` (the reset to the image: its
  layers, already in the host's store, mounted as a fresh root) plus the first bash ``true``,
  interleaved round by round with today's default-root ``pool.lease(id)`` + first ``true`` and
  with ``docker run -d REF sleep`` + ``docker exec true`` of the same image (the baseline row);
- **a call on an image root**: bash ``true`` in a held image-rooted slot vs a default-root slot,
  interleaved;
- **an image the host never saw**: a pool with a fresh layer store, lease + reset to the image +
  first ``true`` (the engine's export of the image, the unpack, the mount, the sandbox start);
  the unpack rate is the image's uncompressed layer bytes over the import's share of that time
  (minus a held image's p50), beside the engine's own export (``docker save``, same image);
- **N distinct images** sharing the base (a tiny unique layer each) held by one host and leased
  round-robin, grown step by step (default 10 then 100; ``--images 10,100,1000``): disk of the
  store (``du``; ideal: the base once + N unique layers), memory (RSS of the host server and of its
  mount helper), lease and lease + first ``true`` p50/p99. These images are OCI layouts written
  here from ``docker save`` of the base (the base layer's blob hard-linked into each), because the
  engine source exports a whole image per import (see the row "one more image on a held base,
  from the engine"): 1,000 engine images would cost 1,000 exports of the base;
- **a GRPO group**: ``pool.lease_many(16 ids, image=REF)`` until all 16 are ready, and until each has
  run its first ``true``; beside the same for a default-root group.

Targets (issue 29): first ``true`` on a held image p50 <= 100 ms; a call on an image root <= 1.1x a
default-root slot's.

A part of its own (``--warm-lease-only``): the lease alone of a warm slot by the image's tag (its
host asked whether the tag still names the slot's image) vs by its id (no request).

``python -m benchmarks.scenario_image_roots [--quick] [--images 10,100,1000] [--group 16] [--warm-lease-only]``
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import hashlib
import io
import json
import os
import secrets
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path
from typing import IO, Any

from benchmarks.common import (
    BENCH_LABEL,
    BENCH_ROOT,
    Row,
    ScenarioResult,
    Target,
    bench_dir,
    docker_problem,
    format_table,
    host_pids,
    lease_first_true,
    local_pool,
    machine_info,
    machine_line,
    percentile,
    process_tree,
    rss_kib,
    run_scenario,
    setup_logging,
    time_interleaved,
    write_json,
    write_png,
)

NAME = "image_roots"
WARM_LEASE_ONLY = False  # --warm-lease-only
BASE = "atropos-sandbox-base:bookworm"
DOCKERFILE = f"""FROM {BASE}
COPY testbed /testbed
ENV TASK_NAME=bench-image-roots
WORKDIR /testbed
"""
TESTBED = {"calc.py": "def add(a, b):\n    return a + b\n",
           "tests/test_calc.py": "from calc import add\n\n\ndef test_add():\n    assert add(2, 3) == 5\n"}
MTIME = 1_700_000_000  # fixed: the unique layers hash the same on every run
FIRST_CALL_TARGET_MS = 100.0
CALL_RATIO_TARGET = 1.1
MODEL_TIME_S = 1.0  # the gap before an agent's first call (its first model turn), in one row


# -- images ------------------------------------------------------------------------------------
def _docker(*args: str, timeout: float = 600) -> str:
    proc = subprocess.run(["docker", *args], capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"docker {' '.join(args[:2])} failed: {proc.stderr.strip()[-500:]}")
    return proc.stdout


def build_task_image(scratch: Path, extra: str = "") -> str:
    """The task image (base + /testbed), built once and cached by the engine under a content tag."""
    dockerfile = DOCKERFILE + ("COPY unique /unique\n" if extra else "")
    key = hashlib.sha256(json.dumps([dockerfile, TESTBED, extra]).encode()).hexdigest()[:12]
    tag = f"atropos-bench/image-roots:{key}"
    if subprocess.run(["docker", "image", "inspect", tag], capture_output=True).returncode != 0:
        ctx = scratch / f"ctx-{key}"
        for rel, text in TESTBED.items():
            (ctx / "testbed" / rel).parent.mkdir(parents=True, exist_ok=True)
            (ctx / "testbed" / rel).write_text(text)
        (ctx / "Dockerfile").write_text(dockerfile)
        (ctx / "unique").write_text(extra)
        _docker("build", "-q", "--label", f"{BENCH_LABEL}={NAME}", "-t", tag, str(ctx))
    return tag


def engine_export(reference: str, keep_layers: Path | None = None) -> tuple[float, int, dict[str, Any]]:
    """``docker save`` of ``reference`` read to the end: (seconds, uncompressed layer bytes, config).
    With ``keep_layers`` the layer tars are written there as ``<sha256>.tar`` (their DiffIDs)."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(["docker", "save", reference], stdout=subprocess.PIPE)
    assert proc.stdout is not None
    total = 0
    config: dict[str, Any] = {}
    with tarfile.open(fileobj=proc.stdout, mode="r|") as tar:
        for member in tar:
            f = tar.extractfile(member) if member.isfile() else None
            if f is None:
                continue
            if member.name.endswith("layer.tar"):
                total += member.size
                if keep_layers is not None:
                    _keep_layer(f, keep_layers)
                else:
                    while f.read(1 << 20):
                        pass
            elif member.name.endswith(".json") and "/" not in member.name and member.name != "manifest.json":
                config = json.loads(f.read())
    if proc.wait() != 0:
        raise RuntimeError(f"docker save {reference} failed")
    return time.perf_counter() - t0, total, config


def _keep_layer(f: IO[bytes], into: Path) -> None:
    into.mkdir(parents=True, exist_ok=True)
    digest = hashlib.sha256()
    tmp = into / f"partial-{secrets.token_hex(4)}"
    with open(tmp, "wb") as out:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
            out.write(chunk)
    os.replace(tmp, into / f"{digest.hexdigest()}.tar")


def _unique_layer(i: int) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        folder = tarfile.TarInfo("task")
        folder.type, folder.mode, folder.mtime = tarfile.DIRTYPE, 0o755, MTIME
        tar.addfile(folder)
        data = f"task-{i:05d}\n".encode()
        member = tarfile.TarInfo("task/id")
        member.size, member.mode, member.mtime = len(data), 0o644, MTIME
        tar.addfile(member, io.BytesIO(data))
    return buf.getvalue()


class ManyImages:
    """N images as OCI layouts: the base image's layers (one blob, hard-linked into every layout)
    plus one unique layer (``/task/id``) each; referenced as ``oci:PATH``."""

    def __init__(self, root: Path) -> None:
        self.root = root
        layers = root / "base-layers"
        self.export_s, self.base_bytes, self.base_config = engine_export(BASE, keep_layers=layers)
        self.base_blobs = [layers / f"{d.split(':', 1)[1]}.tar" for d in self.base_config["rootfs"]["diff_ids"]]
        missing = [b for b in self.base_blobs if not b.exists()]
        if missing:
            raise RuntimeError(f"docker save of {BASE} did not hold the layers its config names: {missing}")
        self.refs: list[str] = []

    def grow(self, n: int) -> list[str]:
        while len(self.refs) < n:
            self.refs.append(self._layout(len(self.refs)))
        return self.refs[:n]

    def _layout(self, i: int) -> str:
        out = self.root / f"img-{i:05d}"
        blobs = out / "blobs" / "sha256"
        blobs.mkdir(parents=True)

        def put(data: bytes) -> dict[str, Any]:
            digest = hashlib.sha256(data).hexdigest()
            (blobs / digest).write_bytes(data)
            return {"digest": f"sha256:{digest}", "size": len(data)}

        layer_descs = []
        for blob in self.base_blobs:
            os.link(blob, blobs / blob.stem)
            layer_descs.append({"mediaType": "application/vnd.oci.image.layer.v1.tar",
                                "digest": f"sha256:{blob.stem}", "size": blob.stat().st_size})
        unique = put(_unique_layer(i))
        layer_descs.append({"mediaType": "application/vnd.oci.image.layer.v1.tar", **unique})
        config = json.loads(json.dumps(self.base_config))
        config["rootfs"]["diff_ids"].append(unique["digest"])  # uncompressed: digest == DiffID
        config.setdefault("config", {})["Env"] = [*(config["config"].get("Env") or []), f"TASK_ID={i}"]
        manifest = {"schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
                    "config": {"mediaType": "application/vnd.oci.image.config.v1+json",
                               **put(json.dumps(config).encode())},
                    "layers": layer_descs}
        desc = put(json.dumps(manifest).encode())
        (out / "index.json").write_text(json.dumps({"schemaVersion": 2, "manifests": [
            {"mediaType": "application/vnd.oci.image.manifest.v1+json", **desc}]}))
        (out / "oci-layout").write_text('{"imageLayoutVersion": "1.0.0"}')
        return f"oci:{out}"


# -- timing ------------------------------------------------------------------------------------
async def first_true_after(pool: Any, tid: str, image: str, gap_s: float) -> float:
    """ms of the first ``true`` on an image lease, called ``gap_s`` after the lease returned."""
    lease = await pool.lease(tid, image=image)
    try:
        await asyncio.sleep(gap_s)
        t0 = time.perf_counter()
        out = await lease.bash("true")
        took = (time.perf_counter() - t0) * 1e3
        assert out.exit_code == 0, out
    finally:
        await pool.release(lease)
    return took


def docker_first_exec(image: str) -> float:
    """``docker run -d IMAGE sleep`` + ``docker exec true`` (ms); the container is removed after, untimed."""
    t0 = time.perf_counter()
    cid = _docker("run", "-d", "--rm", "--network", "none", "--label", f"{BENCH_LABEL}={NAME}",
                  "--entrypoint", "sleep", image, "600").strip()
    try:
        _docker("exec", cid, "true")
        return (time.perf_counter() - t0) * 1e3
    finally:
        subprocess.run(["docker", "rm", "-f", cid], capture_output=True)


async def settle() -> None:
    """Gap between samples: a release's background work (the next prewarm) is not the next sample's."""
    await asyncio.sleep(0.3)


def du_bytes(path: Path) -> int:
    out = subprocess.run(["du", "-s", "--block-size=1", str(path)], capture_output=True, text=True)
    return int(out.stdout.split()[0]) if out.returncode == 0 and out.stdout else 0


def host_memory_mib(pool: Any) -> tuple[float, float]:
    """RSS (MiB) of the host server process and of its mount helper's process tree."""
    (host,) = host_pids(pool)
    helpers = []
    for pid in process_tree([host]):
        with contextlib.suppress(OSError):
            if b"mounthelper" in Path(f"/proc/{pid}/cmdline").read_bytes():
                helpers.append(pid)
    helper_tree = process_tree(helpers) if helpers else []
    return rss_kib(host) / 1024, sum(rss_kib(p) for p in helper_tree) / 1024


def _pool_id(what: str) -> str:
    return f"bench-img-{what}-{os.getpid() % 10**5}-{secrets.token_hex(2)}"


@contextlib.asynccontextmanager
async def started(pool_id: str, slots: int) -> Any:
    from atropos.sandbox.contract.hostdirs import remove_tree

    # a store of this pool's own (the local backend's default is one per machine): "never seen" is fresh
    pool = local_pool(pool_id, 1, slots, {"image_store": BENCH_ROOT / "local" / pool_id / "images"})
    try:
        await pool.start()
        yield pool
    finally:
        await pool.stop()
        await asyncio.to_thread(remove_tree, BENCH_ROOT / "local" / pool_id)  # the store too


# -- the parts ---------------------------------------------------------------------------------
async def part_held_image(res: ScenarioResult, image: str, rounds: int, calls: int, group: int,
                          group_rounds: int) -> dict[str, float]:
    first_img: list[float] = []
    first_def: list[float] = []
    first_reset: list[float] = []
    after_gap: list[float] = []
    lease_img: list[float] = []
    docker: list[float] = []
    async with started(_pool_id("held"), max(4, group)) as pool:
        info = await pool.prepare_images([image])
        import_ms = next(iter(info.values()))[0].duration_ms
        await lease_first_true(pool, "warmup-img", image)  # first sandboxes, first idmap namespaces
        await lease_first_true(pool, "warmup-def", None)
        await asyncio.to_thread(docker_first_exec, image)
        for r in range(rounds):  # interleaved: a load change hits all three alike
            ms_lease, ms_first = await lease_first_true(pool, f"img-{r}", image)
            lease_img.append(ms_lease)
            first_img.append(ms_first)
            await settle()
            first_def.append((await lease_first_true(pool, f"def-{r}", None))[1])
            await settle()
            first_reset.append((await lease_first_true(pool, f"reset-{r}", None, reset=True))[1])
            await settle()
            after_gap.append(await first_true_after(pool, f"gap-{r}", image, MODEL_TIME_S))
            await settle()
            docker.append(await asyncio.to_thread(docker_first_exec, image))
        res.rows.append(Row("docker run -d + docker exec true (same image)", docker, baseline=True,
                            note="the engine holds the image unpacked; container removed untimed"))
        row = Row("held image: pool.lease(image=) + first true", first_img,
                  target=f"<= {FIRST_CALL_TARGET_MS:g} ms p50", note="the image's layers already in the host's store")
        row.passed = row.p50 <= FIRST_CALL_TARGET_MS
        res.rows.append(row)
        res.rows.append(Row("held image: pool.lease(image=) alone (reset to the image)", lease_img))
        res.rows.append(Row("default root: pool.lease() + first true", first_def,
                            note="today's lease; the host prewarms a default slot's sandbox after its reset"))
        res.rows.append(Row(f"held image: first true {MODEL_TIME_S:g} s after pool.lease(image=) (the call alone)",
                            after_gap, note="as an agent's first call after model time: the slot's prewarm "
                                            "(scheduled by the reset) has had time to finish"))
        res.rows.append(Row("default root: pool.lease() + reset + first true", first_reset,
                            note="the first call finds its sandbox still starting, as on an image lease"))
        ratio_def = row.p50 / percentile(first_def, 50)
        res.targets.append(Target(
            f"first true on a held image, p50 <= {FIRST_CALL_TARGET_MS:g} ms",
            f"p50 {row.p50:.0f} ms, p99 {row.p99:.0f} ms (lease alone p50 {percentile(lease_img, 50):.0f} ms, "
            f"the first call {MODEL_TIME_S:g} s after it p50 {percentile(after_gap, 50):.0f} ms); "
            f"{row.p50 / percentile(docker, 50):.2f}x docker run + exec ({percentile(docker, 50):.0f} ms), "
            f"{ratio_def:.2f}x a default-root lease + first true ({percentile(first_def, 50):.0f} ms)", row.passed))

        # steady state: one held slot of each kind, calls interleaved
        img_lease = await pool.lease("steady-img", image=image)
        def_lease = await pool.lease("steady-def")
        try:
            async def on(lease: Any) -> None:
                out = await lease.bash("true")
                assert out.exit_code == 0, out

            timed = await time_interleaved({"img": (functools.partial(on, img_lease), calls),
                                            "def": (functools.partial(on, def_lease), calls)})
        finally:
            await pool.release(img_lease)
            await pool.release(def_lease)
        base_name = "default-root slot: bash true"
        res.rows.append(Row(base_name, timed["def"]))
        steady = Row("image-rooted slot: bash true", timed["img"], base=base_name,
                     target=f"<= {CALL_RATIO_TARGET:g}x default root")
        ratio = steady.p50 / percentile(timed["def"], 50)
        steady.passed = ratio <= CALL_RATIO_TARGET
        res.rows.append(steady)
        res.targets.append(Target(f"a call on an image root <= {CALL_RATIO_TARGET:g}x a default-root slot",
                                  f"{ratio:.2f}x (p50 {steady.p50:.2f} vs {percentile(timed['def'], 50):.2f} ms; "
                                  f"p99 {steady.p99:.1f} vs {percentile(timed['def'], 99):.1f} ms)", steady.passed))

        await grpo_group(res, pool, image, group, group_rounds)
    return {"held_first_p50_ms": row.p50, "import_ms": import_ms}


async def part_warm_lease(res: ScenarioResult, image: str, samples: int) -> None:
    """The lease alone of a held image's warm slot (released on the image's root): by its tag, which
    may have moved, so the slot's host is asked whether the tag still names the slot's image (one
    request, ``keep_if_fresh``: the engine asked for the tag's id, the slot kept), against by the
    image's id (``sha256:...``, ``ImageRef.fixed``: no request), interleaved; the warm slot is reused
    in both (docs/task-images.md, "A reference that moves")."""
    image_id = (await asyncio.to_thread(_docker, "image", "inspect", "-f", "{{.Id}}", image)).strip()
    by_tag: list[float] = []
    by_id: list[float] = []
    async with started(_pool_id("warm"), 2) as pool:
        async def lease_ms(ref: str, tid: str) -> float:
            t0 = time.perf_counter()
            lease = await pool.lease(tid, image=ref)
            took = (time.perf_counter() - t0) * 1e3
            await pool.release(lease)
            return took

        for ref in (image, image_id):  # each reference's slot warm on its root
            await lease_ms(ref, "warmup")
        for i in range(samples):
            for ref, into in ((image, by_tag), (image_id, by_id))[::1 if i % 2 else -1]:
                into.append(await lease_ms(ref, f"warm-{i}"))
    base = "warm slot: pool.lease(image id) (fixed: no request)"
    res.rows.append(Row(base, by_id))
    res.rows.append(Row("warm slot: pool.lease(tag) (the host asked whether the tag moved)", by_tag, base=base,
                        note="one reset request with keep_if_fresh: the engine's id of the tag, the slot kept"))
    res.notes.append(f"re-resolving a tag on a warm lease: +{percentile(by_tag, 50) - percentile(by_id, 50):.1f} ms "
                     f"p50 ({percentile(by_tag, 50):.1f} vs {percentile(by_id, 50):.2f} ms), p99 "
                     f"{percentile(by_tag, 99):.1f} vs {percentile(by_id, 99):.2f} ms")


async def grpo_group(res: ScenarioResult, pool: Any, image: str, group: int, rounds: int) -> None:
    ready: dict[str, list[float]] = {"img": [], "def": []}
    first: dict[str, list[float]] = {"img": [], "def": []}

    async def one(kind: str, r: int) -> None:
        ids = [f"grpo-{kind}-{r}-{i}" for i in range(group)]
        t0 = time.perf_counter()
        leases = await pool.lease_many(ids, image=image if kind == "img" else None)
        t1 = time.perf_counter()
        try:
            outs = await asyncio.gather(*(lease.bash("true") for lease in leases))
            t2 = time.perf_counter()
            assert all(o.exit_code == 0 for o in outs), outs
        finally:
            await asyncio.gather(*(pool.release(lease) for lease in leases))
        ready[kind].append((t1 - t0) * 1e3)
        first[kind].append((t2 - t0) * 1e3)
        await asyncio.sleep(1.0)  # the 16 resets' prewarms

    await one("img", -1)  # warm-up
    for r in range(rounds):
        await one("img", r)
        await one("def", r)
    res.rows.append(Row(f"GRPO group of {group}, one image: lease_many ready", ready["img"]))
    res.rows.append(Row(f"GRPO group of {group}, one image: + first true in all", first["img"]))
    res.rows.append(Row(f"GRPO group of {group}, default root: lease_many + first true in all", first["def"],
                        note=f"lease_many alone p50 {percentile(ready['def'], 50):.1f} ms"))


def import_here(image: str) -> float:
    """Seconds of the host's own import code (the engine's export, the spool, the unpack) run here,
    into a fresh layer store: the import's floor without the host process around it."""
    from atropos.sandbox.contract.hostdirs import remove_tree
    from atropos.sandbox.host.images.layer_store import LayerStore
    from atropos.sandbox.host.images.sources import import_from_docker

    root = bench_dir(f"{NAME}-store")
    try:
        t0 = time.perf_counter()
        import_from_docker(LayerStore(root / "store"), image)
        return time.perf_counter() - t0
    finally:
        remove_tree(root)


async def part_unseen(res: ScenarioResult, image: str, samples: int, held_first_ms: float) -> None:
    """An image the host never saw: a fresh pool (a fresh layer store) per sample."""
    firsts: list[float] = []
    for k in range(samples):
        async with started(_pool_id(f"unseen{k}"), 2) as pool:
            await lease_first_true(pool, "warmup", None)  # the host's own first sandbox: not the image's cost
            firsts.append((await lease_first_true(pool, f"unseen-{k}", image))[1])
    export_s, total, _ = await asyncio.to_thread(engine_export, image)
    in_process_s = await asyncio.to_thread(import_here, image)
    res.rows.append(Row("never-seen image: lease(image=) + first true (fresh store)", firsts,
                        note=("the import (from the engine's layer dirs as root beside it, else its export), "
                             "the mount, the first sandbox")))
    res.rows.append(Row("  the engine's export alone: docker save of it", [export_s * 1e3],
                        note=f"{total / 1e6:.0f} MB of uncompressed layers"))
    res.rows.append(Row("  the same import in this process (import_from_docker, fresh store)", [in_process_s * 1e3],
                        note="the host's import code called directly: export, spool, unpack; no host, no slot"))
    import_s = (percentile(firsts, 50) - held_first_ms) / 1e3
    rate = total / 1e6 / import_s if import_s > 0 else float("nan")
    res.targets.append(Target("an image the host never saw: time to first call vs docker run + exec",
                              f"p50 {percentile(firsts, 50) / 1e3:.1f} s; import (minus a held image's first call) "
                              f"{import_s:.1f} s = {rate:.0f} MB/s of uncompressed layer ({total / 1e6:.0f} MB); "
                              f"the engine's export of it alone {export_s:.1f} s ({total / 1e6 / export_s:.0f} MB/s)",
                              None))


async def part_engine_increment(res: ScenarioResult, pool: Any, scratch: Path, n: int) -> None:
    """One more image on a base the store holds, from the engine: what an import costs when only a
    tiny layer is new (the engine still exports the whole image)."""
    took = []
    for i in range(n):
        ref = await asyncio.to_thread(build_task_image, scratch, f"inc{i}")
        (infos,) = (await pool.prepare_images([ref])).values()
        took.append(infos[0].duration_ms)
    res.rows.append(Row("one more image on a held base, from the engine: import", took,
                        note=("prepare_image: only the new layer is copied from the engine's layer dirs "
                             "(a host beside the engine, as root)")))


async def part_many(res: ScenarioResult, scratch: Path, steps: list[int], lease_samples: int) -> None:
    images = await asyncio.to_thread(ManyImages, scratch / "many")
    unique_bytes = len(_unique_layer(0))
    async with started(_pool_id("many"), 4) as pool:
        store = BENCH_ROOT / "local" / pool.cfg.pool_id / "images"
        await lease_first_true(pool, "warmup", None)
        rss0 = host_memory_mib(pool)
        res.notes.append(f"N images: host RSS before any image {rss0[0]:.1f} MiB, mount helper {rss0[1]:.1f} MiB")
        held = 0
        for n in steps:
            refs = await asyncio.to_thread(images.grow, n)
            t0 = time.perf_counter()
            imports: list[float] = []
            for ref in refs[held:]:  # one at a time: per-image import cost
                (infos,) = (await pool.prepare_images([ref])).values()
                imports.append(infos[0].duration_ms)
            import_s = time.perf_counter() - t0
            held = n
            leases: list[float] = []
            firsts: list[float] = []
            count = max(lease_samples, 1)
            for k in range(count):  # round-robin, spread over all n images
                ms_lease, ms_first = await lease_first_true(pool, f"many-{n}-{k}", refs[(k * n) // count % n])
                leases.append(ms_lease)
                firsts.append(ms_first)
                await settle()
            disk = await asyncio.to_thread(du_bytes, store)
            host_mib, helper_mib = host_memory_mib(pool)
            ideal = images.base_bytes + n * unique_bytes
            res.rows.append(Row(f"{n} images held: lease(image=)", leases,
                                note=f"{count} leases round-robin over the {n}; imports p50 "
                                     f"{percentile(imports, 50):.0f} ms each ({import_s:.1f} s for "
                                     f"{len(imports)}; the first of all holds the base)"))
            res.rows.append(Row(f"{n} images held: lease(image=) + first true", firsts))
            res.rows.append(Row(f"{n} images held: store on disk (du)", value=disk / 2**20, unit="MiB", n=1,
                                note=f"base layer {images.base_bytes / 2**20:.1f} MiB + {n} unique layers "
                                     f"({unique_bytes} B tars); {disk / ideal:.2f}x that"))
            res.rows.append(Row(f"{n} images held: host server RSS", value=host_mib, unit="MiB", n=1))
            res.rows.append(Row(f"{n} images held: mount helper RSS", value=helper_mib, unit="MiB", n=1))
        if docker_problem(None) is None:
            await part_engine_increment(res, pool, scratch, 2)


async def run(quick: bool, images: list[int] | None = None, group: int = 16) -> ScenarioResult:
    steps = images or ([10] if quick else [10, 100])
    res = ScenarioResult(NAME, "task images as slot roots vs a container per task (local backend, one host)",
                         params={"images": steps, "group": group})
    problem = docker_problem(BASE)
    if problem is not None:
        res.skipped = problem
        return res
    scratch = bench_dir(NAME)
    try:
        image = await asyncio.to_thread(build_task_image, scratch)
        res.params["image"] = image
        if WARM_LEASE_ONLY:
            await part_warm_lease(res, image, 10 if quick else 100)
            return res
        held = await part_held_image(res, image, rounds=5 if quick else 10, calls=60 if quick else 200,
                                     group=group, group_rounds=2 if quick else 3)
        res.notes.append(f"the task image's first import into a fresh store (prepare_images): "
                         f"{held['import_ms'] / 1e3:.1f} s")
        await part_unseen(res, image, 1, held["held_first_p50_ms"])
        await part_many(res, scratch, steps, 20 if quick else 40)
    finally:
        ids = subprocess.run(["docker", "ps", "-aq", "--filter", f"label={BENCH_LABEL}={NAME}"],
                             capture_output=True, text=True).stdout.split()
        if ids:
            subprocess.run(["docker", "rm", "-f", *ids], capture_output=True)
        shutil.rmtree(scratch, ignore_errors=True)
    return res


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog=f"python -m benchmarks.scenario_{NAME}", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="fewer iterations (a smoke run)")
    p.add_argument("--images", type=lambda s: [int(x) for x in s.split(",")], default=None,
                   help="numbers of distinct images held, step by step (default 10,100; --quick: 10)")
    p.add_argument("--group", type=int, default=16, help="GRPO group size (%(default)s)")
    p.add_argument("--warm-lease-only", action="store_true",
                   help="only the lease of a warm slot by tag vs by image id (the re-resolution's cost)")
    p.add_argument("--json", type=Path, help="write the result as JSON here")
    p.add_argument("--png", type=Path, help="write a latency chart here")
    p.add_argument("-v", "--verbose", action="store_true", help="show the product's INFO logs")
    args = p.parse_args(argv)
    setup_logging(args.verbose)
    global WARM_LEASE_ONLY
    WARM_LEASE_ONLY = args.warm_lease_only
    machine = machine_info()
    print(machine_line(machine), flush=True)
    res = run_scenario(NAME, functools.partial(run, images=args.images, group=args.group), args.quick)
    print(format_table(res), flush=True)
    if args.json:
        write_json([res], args.json, machine)
    if args.png:
        write_png([res], args.png, machine)
    return 1 if res.error else 0


if __name__ == "__main__":
    sys.exit(main())
