"""The sandbox host: N slots, their leases, and the execution of tool calls.

HTTP lives in ``server.py``; this module is the state and the rules, usable in-process too.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hmac
import logging
import os
import secrets
import time
from collections.abc import AsyncIterable, AsyncIterator, Awaitable, Iterable
from importlib import resources
from pathlib import Path
from typing import Any, TypeVar

from atropos import __version__, metrics
from atropos.errors import (
    ImageRejected,
    IsolationUnavailable,
    LeaseError,
    SandboxRestarted,
    SlotSealed,
    SlotUnavailable,
    ToolError,
)
from atropos.sandbox.contract.hostdirs import ISOLATION_FAILED, owned_dir
from atropos.sandbox.contract.imageref import ImageRef
from atropos.sandbox.contract.protocol import (
    MAX_VERIFY_SECRETS,
    CallResult,
    ErrorInfo,
    HealthInfo,
    ImageInfo,
    LeaseInfo,
    LeaseRequest,
    PrewarmResult,
    ResetRequest,
    ResetResult,
    SealResult,
    SlotInfo,
    TemplateInfo,
    TemplateRequest,
    ToolCall,
    VerifyRequest,
    VerifyResult,
)
from atropos.sandbox.contract.tools import SEALED_REFUSED, clamp_timeout, supervisor_request, validate_args
from atropos.sandbox.host import slotd_build
from atropos.sandbox.host.config import HostConfig
from atropos.sandbox.host.host_setup import (
    _write,
    check_isolation,
    claim_uid_block,
    resolve_network_isolation,
    setup_cgroups,
)
from atropos.sandbox.host.images.host_images import HostImages
from atropos.sandbox.host.images.image_root import ImageRoot
from atropos.sandbox.host.images.sources import engine_socket
from atropos.sandbox.host.inslot_bytecode import compile_lib
from atropos.sandbox.host.isolation import seccomp
from atropos.sandbox.host.isolation.cgroups import SlotCgroups
from atropos.sandbox.host.isolation.network import DNS as SLIRP_DNS
from atropos.sandbox.host.isolation.sandbox_process import SandboxDied
from atropos.sandbox.host.isolation.uidkill import UidKiller
from atropos.sandbox.host.slot import SandboxLost, SessionLost, Slot
from atropos.sandbox.host.supervisor_choice import SupervisorChoice
from atropos.sandbox.host.workspace import TemplateSourceError, WorkspaceError
from atropos.sandbox.host.workspace.templates import Template
from atropos.sandbox.host.workspace.trees import delete_trash
from atropos.sandbox.host.workspace.workspaces import Workspaces
from atropos.sandbox.inslot import LIB_FILES
from atropos.sandbox.inslot import inslot_protocol as slot_protocol

log = logging.getLogger(__name__)
T = TypeVar("T")

TMUX_CONF = """\
set -g default-shell /bin/bash
set -g history-limit 10000
set -g status off
set -g exit-empty off
set -g default-terminal screen
"""




class SandboxHost:
    def __init__(self, cfg: HostConfig) -> None:
        self.cfg = cfg
        self.root = cfg.data_dir
        self.is_root = os.geteuid() == 0
        self.uid_base: int | None = None
        self._uid_lock_fd: int | None = None
        self.seccomp_path: str | None = None
        self.slotd: Path | None = None  # the compiled supervisor for the slots, set by _prepare_root
        # slotd or Python for the next sandbox, from recent leases (or fixed: cfg.native_supervisor)
        self.supervisor_choice = SupervisorChoice(fixed=cfg.native_supervisor == "always")
        self.slots: list[Slot] = []
        self.health_slot: Slot | None = None
        self._health_lock = asyncio.Lock()
        self._trash_task: asyncio.Task[None] | None = None
        self._trash_pending = False
        self._background: set[asyncio.Task[None]] = set()
        self._warming: set[int] = set()  # slots prewarm_in_background is starting a sandbox of
        self.started_at = time.time()
        self.total_calls = 0
        self.stopping = False
        self.workspaces: Workspaces | None = None
        self._images: HostImages | None = None  # made on first use: most hosts never see an image
        self.private_net = False  # resolved from cfg.network_isolation by start()
        self.killer = UidKiller()
        self.cgroups: SlotCgroups | None = None  # one cgroup per slot: its memory, process and CPU caps
        # Prewarming sandboxes competes for CPU with resets still running: during a burst (a
        # group of forks, a wave of releases) it waits until the burst is over (or 0.25 s).
        self._resets_running = 0
        self._quiet = asyncio.Event()
        self._quiet.set()

    # -- lifecycle -------------------------------------------------------------------------
    async def start(self) -> None:
        try:
            await self._start()
        except IsolationUnavailable as exc:
            # the same exception (type and traceback kept), its message marked; see ISOLATION_FAILED
            if not str(exc).startswith(ISOLATION_FAILED):
                exc.args = (ISOLATION_FAILED + str(exc), *exc.args[1:])
            raise

    async def _start(self) -> None:
        if not self.cfg.unsafe_no_isolation:
            check_isolation(self.cfg)
        else:
            log.warning("!!! UNSAFE: slots run WITHOUT isolation (development only); never run untrusted code !!!")
        self.private_net = resolve_network_isolation(self.cfg)
        self.cgroups = setup_cgroups(self.cfg)
        if self.is_root:
            # slots, the health slot, and the uid that owns template files (no sandbox runs as it)
            self.uid_base, self._uid_lock_fd = claim_uid_block(self.cfg.slots + 2, self.cfg.uid_base)
        await asyncio.to_thread(self._prepare_root)
        owner = None if self.uid_base is None else self.uid_base + self.cfg.slots + 1
        probe_uid = None if self.uid_base is None else self.uid_base + self.cfg.slots
        self.workspaces = Workspaces(self.cfg, self.root, owner=owner, probe_uid=probe_uid, trash=self.root / "trash")
        try:
            await self.workspaces.start()
        except WorkspaceError as exc:
            raise IsolationUnavailable(str(exc)) from exc
        for i in range(self.cfg.slots):
            self.slots.append(self._make_slot(i))
        self.health_slot = self._make_slot(self.cfg.slots, name="health")
        self.health_slot.grant("health-check", network=False)
        for slot in [*self.slots, self.health_slot]:
            await slot.prepare()
        self._schedule_trash()
        probe = await self.health()
        if not probe.ok:
            raise IsolationUnavailable(f"sandbox self-test failed: {probe.detail}")

    def _make_slot(self, index: int, name: str | None = None) -> Slot:
        uid = None if self.uid_base is None else self.uid_base + index
        cgroup = None if self.cgroups is None else self.cgroups.slot(name or f"slot-{index}", self.cfg.slot_limits())
        return Slot(index, self.cfg, self.root, uid, self.seccomp_path, self.workspaces, name=name,
                    killer=self.killer, private_net=self.private_net, cgroup=cgroup, slotd=self.slotd,
                    choice=self.supervisor_choice)

    def _prepare_root(self) -> None:
        root = self.root
        root.parent.mkdir(parents=True, exist_ok=True)
        owned_dir(root, 0o711)  # slot uids traverse to their own workspace, but cannot list
        for sub in ("slots", "lib", "etc", "trash"):
            owned_dir(root / sub, 0o711 if sub != "trash" else 0o700)
        lib = root / "lib"
        os.chmod(lib, 0o755)
        # the supervisor, the python_session driver and what the two share: all run inside the sandbox
        for script in LIB_FILES:
            _write(lib / script, resources.files("atropos.sandbox.inslot").joinpath(script).read_bytes())
        _write(lib / "tmux.conf", TMUX_CONF.encode())
        compile_lib(self.cfg.python, lib, LIB_FILES)  # once here, not at every sandbox start
        # the compiled supervisor, which the slots start where there is one (docs/native-supervisor.md)
        if self.cfg.native_supervisor != "never" and not self.cfg.unsafe_no_isolation:
            self.slotd = slotd_build.install(lib)
        else:
            (lib / slotd_build.SLOTD).unlink(missing_ok=True)
        etc = root / "etc"
        os.chmod(etc, 0o755)
        _write(etc / "passwd", b"sandbox:x:1000:1000:sandbox:/workspace:/bin/bash\n"
                               b"nobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin\n")
        _write(etc / "group", b"sandbox:x:1000:\nnogroup:x:65534:\n")
        _write(etc / "hosts", b"127.0.0.1 localhost sandbox\n::1 localhost\n")
        _write(etc / "resolv.conf", f"nameserver {SLIRP_DNS}\n".encode())  # private-network slots
        if not self.cfg.unsafe_no_isolation:
            self.seccomp_path = str(seccomp.write_filter(root / "seccomp.bpf"))
            seccomp.write_filter(seccomp.verifier_filter_path(self.seccomp_path), allow_chroot=True)

    def _schedule_trash(self) -> None:
        self._trash_pending = True
        if self._trash_task is None or self._trash_task.done():
            self._trash_task = asyncio.create_task(self._empty_trash())

    async def _empty_trash(self) -> None:
        # Loops while more was discarded during a pass (otherwise it would wait for the next reset).
        while self._trash_pending:
            with contextlib.suppress(asyncio.TimeoutError):  # not in the middle of a burst of resets
                await asyncio.wait_for(self._quiet.wait(), 0.25)
            self._trash_pending = False
            await asyncio.to_thread(delete_trash, self.root / "trash")

    async def stop(self) -> None:
        self.stopping = True  # calls cut off from here on are the platform's doing, not the command's
        for task in list(self._background):  # prewarms still starting: none may outlive the stop
            task.cancel()
        await asyncio.gather(*self._background, return_exceptions=True)
        await asyncio.gather(*(s.stop_sandboxes() for s in [*self.slots, *filter(None, [self.health_slot])]))
        if self.cgroups is not None:  # whatever escaped its process group (none should) dies here
            await asyncio.to_thread(self.cgroups.close)
        if self.workspaces is not None:
            await self.workspaces.stop()  # its mount namespace, and every overlay in it, goes away
        if self._trash_task is not None:
            await self._trash_task

    # -- queries ---------------------------------------------------------------------------
    def slot_infos(self) -> list[SlotInfo]:
        return [s.info() for s in self.slots]

    async def health(self, *, mounts: bool = False) -> HealthInfo:
        """A real round trip through the exec path: `true` in the hidden health slot. ``mounts``:
        also count the workspace mounts, which reads every slot namespace's mount table (the kernel
        formats each line: 41.8-49.1 ms of the host's CPU per check with 48 image slots
        leased against ~9 without, benchmarks/README.md), so the pool's periodic check leaves it
        out and a cycle's cost does not grow with the host's other slots (issue 38 item 1)."""
        assert self.health_slot is not None
        ok, detail, exec_ms = True, "", 0.0
        async with self._health_lock:
            t0 = time.perf_counter()
            try:
                frame = await self.health_slot.request(
                    {"op": "exec", "argv": ["true"], "timeout": 10, "max_output": 1024,
                     "hard_output": 1 << 20}, timeout=15,
                )
                exec_ms = (time.perf_counter() - t0) * 1000
                metrics.HOST_HEALTH_SECONDS.observe(exec_ms / 1000)
                if not frame.get("ok") or frame["result"].get("exit_code") != 0:
                    ok, detail = False, f"health exec failed: {frame}"
            except SandboxDied as exc:
                ok, detail = False, str(exc)
        ws = self.workspaces
        if ok and ws is not None and ws.problem():
            ok, detail = False, ws.problem()
        states = [s.state for s in self.slots]
        return HealthInfo(
            ok=ok, version=__version__, slots=len(self.slots), free=states.count("free"),
            leased=states.count("leased"), quarantined=states.count("quarantined"), exec_ms=round(exec_ms, 3),
            isolation="none" if self.cfg.unsafe_no_isolation else "bubblewrap", detail=detail,
            workspace_mode="copy" if ws is None else ws.mode, workspace_detail="" if ws is None else ws.detail,
            templates=0 if ws is None else len(ws.store.templates),
            mounts=None if ws is None or not mounts else ws.mount_count(),
            workspace_cap_bytes=self.cfg.limits.workspace_bytes if ws is not None and ws.capped else None,
            workspace_cap_detail="" if ws is None else ws.cap_detail, timeouts=self.cfg.timeouts(),
        )

    # -- leases ----------------------------------------------------------------------------
    def slot(self, index: int) -> Slot:
        if not 0 <= index < len(self.slots):
            raise KeyError(f"unknown slot {index}; this host has slots 0..{len(self.slots) - 1}")
        return self.slots[index]

    def check_lease(self, slot: Slot, token: str) -> None:
        current = slot.lease_token
        if slot.state != "leased" or current is None or not hmac.compare_digest(current.encode(), token.encode()):
            raise LeaseError(
                f"lease is not valid for slot {slot.index} (state {slot.state}, generation {slot.generation});"
                " it was released or reset, or belongs to another trajectory"
            )

    def template(self, template_id: str) -> Template:
        assert self.workspaces is not None
        return self.workspaces.store.get(template_id)

    async def lease(self, req: LeaseRequest) -> LeaseInfo:
        template = None if req.template is None else self.template(req.template)
        if req.slot is not None:
            slot = self.slot(req.slot)
            if slot.state != "free":
                raise SlotUnavailable(f"slot {slot.index} is {slot.state}")
        else:
            slot = next((s for s in self.slots if s.state == "free"), None)  # type: ignore[assignment]
            if slot is None:
                states = [s.state for s in self.slots]
                raise SlotUnavailable(
                    f"no free slot: {states.count('leased')} leased, {states.count('resetting')} resetting, "
                    f"{states.count('quarantined')} quarantined of {len(self.slots)}"
                )
        if template is not None:
            slot.claim()  # taken now: the fork below awaits
            async with self._resetting(), slot.lock:
                ok, detail = await slot.reset(template)
            self._schedule_trash()
            if not ok:
                raise WorkspaceError(f"slot {slot.index}: fork of template {template.id} failed: {detail}")
        info = slot.grant(req.trajectory_id, req.network)
        if req.network:
            async with slot.lock:  # after a prewarm still starting: it has no network either
                await slot.stop_sandboxes()  # the first call starts one with network
        elif template is not None and not req.network:
            self._schedule_prewarm(slot)
        metrics.HOST_LEASES.inc()
        log.info("lease slot=%d generation=%d trajectory=%s template=%s", slot.index, slot.generation,
                 req.trajectory_id, req.template)
        return info

    @property
    def images(self) -> HostImages:
        if self._images is None:
            self._images = HostImages(self.cfg.image_store or self.root.parent / "images",
                                      docker_socket=engine_socket(), budget_bytes=self.cfg.image_store_bytes,
                                      layer_entries=self.cfg.image_layer_entries)
        return self._images

    async def prepare_image(self, reference: ImageRef) -> ImageInfo:
        """Import ``reference`` into the layer store now (a later lease of it starts without waiting)."""
        t0 = time.perf_counter()
        image = await self.images.get(reference)
        return _image_info(image, t0)

    async def derive_image(self, index: int, lease: str) -> ImageInfo:
        """A new image of a leased image-rooted slot's root as it is now (a group's setup done once):
        its reference (``derived:...``) serves ``reset(image=...)`` on any host of this machine."""
        t0 = time.perf_counter()
        slot = self.slot(index)
        self.check_lease(slot, lease)
        async with slot.lock:
            self.check_lease(slot, lease)
            image = await slot.derive_image(self.images)
        self._schedule_trash()
        return _image_info(image, t0)

    async def upload_image(self, stream: AsyncIterable[bytes], reference: ImageRef) -> ImageInfo:
        """Import an uploaded ``docker save`` archive under ``reference``: how a host with no engine
        of its own (the Docker backend's) gets an image its pool's engine holds."""
        t0 = time.perf_counter()
        spool = self.images.store.root / "tmp" / f"upload-{secrets.token_hex(8)}.tar"
        try:
            fh = await asyncio.to_thread(open, spool, "xb")
            with fh:
                async for chunk in stream:
                    fh.write(chunk)  # to the store's disk (or tmpfs): no wait worth a thread hop
            image = await self.images.add_archive(spool, reference)
        finally:
            spool.unlink(missing_ok=True)
        return _image_info(image, t0, reference)

    def held_images(self) -> list[ImageInfo]:
        if self._images is None:
            return []
        return [_image_info(r) for r in self._images.images.values()]

    async def reset(self, index: int, req: ResetRequest, *, keep: bool) -> ResetResult:
        """Reset a leased slot; ``keep`` leaves it leased (to a fresh token), else it is freed."""
        slot = self.slot(index)
        self.check_lease(slot, req.lease)
        template = None if req.template is None else self.template(req.template)  # 404 before any harm
        if req.image is not None and template is not None:
            raise ImageRejected("a slot's root is an image or its workspace a template fork, not both")
        # imported first if need be (seconds, once per host): before any harm to the lease
        image = None if req.image is None else await self.images.get(req.image)
        self.check_lease(slot, req.lease)
        trajectory = req.trajectory_id or slot.trajectory_id or "?"
        network = slot.network if req.network is None else req.network
        t0 = time.perf_counter()
        if req.keep_if_fresh and keep and image is not None and template is None and network == slot.network \
                and slot.fresh_on(image):
            # the reference names the image the slot's unused root was made of (images.get asked its
            # engine, layout or registry just now): a reset would make the same root again
            return ResetResult(slot=index, ok=True, quarantined=False, kept=True, lease=slot.grant(trajectory, network),
                               duration_ms=round((time.perf_counter() - t0) * 1000, 3),
                               verified=f"a fresh root of {image.image_id}, unused since its reset")
        # Refuse new calls at once and abort the running one: waiting for a 10-minute command
        # would hold the slot (and the pool's caller) hostage.
        slot.revoke()
        stopping = slot.kill_sandboxes()  # reaped while the reset (under the lock) renews the workspace
        async with self._resetting(), slot.lock:
            ok, detail = await slot.reset(template, image, stopping)
        self._schedule_trash()
        metrics.HOST_RESETS.labels("ok" if ok else "quarantined").inc()
        result = ResetResult(slot=index, ok=ok, quarantined=not ok, detail=detail,
                             duration_ms=round((time.perf_counter() - t0) * 1000, 3),
                             template=req.template if ok else None, verified=slot.last_verified if ok else "")
        if ok:
            if keep:
                result.lease = slot.grant(trajectory, network)
            if not network:
                self._schedule_prewarm(slot)
        log.info("reset slot=%d ok=%s keep=%s template=%s ms=%.2f %s", index, ok, keep, req.template,
                 result.duration_ms, detail)
        return result

    # -- verification phase ----------------------------------------------------------------
    async def _sealing(self, index: int, lease: str) -> Slot:
        slot = self.slot(index)
        self.check_lease(slot, lease)
        slot.mark_sealed()  # refuse new calls at once, and abort the running one (as a reset does)
        await slot.stop_sandboxes()
        return slot

    async def seal(self, index: int, lease: str) -> SealResult:
        """Begin the slot's verification phase (idempotent): see docs/verification.md."""
        t0 = time.perf_counter()
        slot = await self._sealing(index, lease)
        async with slot.lock:
            self.check_lease(slot, lease)
            separation = await self._sealed(slot, slot.seal())
        return SealResult(slot=index, separation=separation, duration_ms=round((time.perf_counter() - t0) * 1000, 3))

    async def verify(self, index: int, req: VerifyRequest) -> VerifyResult:
        """Seal the slot and run a verifier program in a fresh sandbox of it."""
        if req.secrets_size() > MAX_VERIFY_SECRETS:
            raise ToolError(f"verifier secrets are {req.secrets_size()} bytes, over {MAX_VERIFY_SECRETS}")
        slot = await self._sealing(index, req.lease)
        async with slot.lock:
            self.check_lease(slot, req.lease)
            result = await self._sealed(slot, slot.verify(req))
        outcome = "ok" if result.ok else (result.error.code if result.error else "error")
        metrics.HOST_CALLS.labels("verify", outcome).inc()
        log.info("verify slot=%d ok=%s score=%s ms=%.1f", index, result.ok, result.score, result.duration_ms)
        return result

    async def _sealed(self, slot: Slot, work: Awaitable[T]) -> T:
        try:
            return await work
        except RuntimeError as exc:  # a process of the slot survived the kill: never verify beside it
            slot.quarantine(f"verification phase: {exc}")
            raise SandboxDied(f"slot {slot.index}: {exc}") from exc

    def _schedule_prewarm(self, slot: Slot) -> asyncio.Task[None]:
        task = asyncio.create_task(self._prewarm(slot))
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        return task

    # -- templates -------------------------------------------------------------------------
    async def create_template(self, req: TemplateRequest) -> TemplateInfo:
        ws = self.workspaces
        assert ws is not None
        if req.source == "slot":
            if req.slot is None or not req.lease:
                raise TemplateSourceError("source=slot needs `slot` and its `lease`")
            slot = self.slot(req.slot)
            self.check_lease(slot, req.lease)
            async with slot.lock:
                self.check_lease(slot, req.lease)  # a reset may have happened while we waited
                template = await slot.snapshot(req.name)
            self._schedule_trash()
            if not slot.network:
                self._schedule_prewarm(slot)
        elif req.source == "dir":
            if not req.path:
                raise TemplateSourceError("source=dir needs `path`")
            template = await ws.from_dir(req.path, req.name)
        else:
            if not req.url:
                raise TemplateSourceError("source=git needs `url`")
            template = await ws.from_git(req.url, req.ref, req.depth, req.name)
        return template.info()

    async def upload_template(self, stream: AsyncIterable[bytes], name: str, *, gzip: bool) -> TemplateInfo:
        assert self.workspaces is not None
        return (await self.workspaces.from_tar(stream, name, gzip=gzip)).info()

    def templates(self) -> list[TemplateInfo]:
        assert self.workspaces is not None
        return [t.info() for t in self.workspaces.store.templates.values()]

    def delete_template(self, template_id: str) -> None:
        assert self.workspaces is not None
        self.workspaces.store.delete(template_id)
        self._schedule_trash()
        log.info("template %s deleted", template_id)

    def template_archive(self, template_id: str) -> AsyncIterator[bytes]:
        assert self.workspaces is not None
        return self.workspaces.archive(self.template(template_id))

    @contextlib.asynccontextmanager
    async def _resetting(self) -> AsyncIterator[None]:
        self._resets_running += 1
        self._quiet.clear()
        try:
            yield
        finally:
            self._resets_running -= 1
            if not self._resets_running:
                self._quiet.set()

    async def _prewarm(self, slot: Slot) -> None:
        """Start the next lease's sandbox now so its first call does not pay the start-up."""
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._quiet.wait(), 0.25)
        async with slot.lock:
            if slot.state in ("free", "leased") and not slot.network:
                try:
                    await slot.ensure_sandbox()
                except SandboxDied as exc:
                    log.warning("prewarm of slot %d failed: %s", slot.index, exc)

    async def prewarm_all(self) -> None:
        await asyncio.gather(*(self._prewarm(s) for s in self.slots))

    def prewarm_in_background(self) -> PrewarmResult:
        """Start the sandbox of every slot that has none without waiting for it: the host serves
        meanwhile (``serve()`` at start unless ``--no-prewarm``; ``POST /v1/prewarm``, which a pool
        sends once its fleet is up). A call to a slot whose prewarm holds its lock waits for that
        sandbox; one that comes first starts it. Idempotent: a slot whose sandbox runs or is being
        prewarmed is left as it is, and so is one that must not be prewarmed: leased with network
        (its first call starts a sandbox with network), busy (a call, reset or seal holds its lock;
        a reset prewarms on its own), resetting, quarantined or sealed."""
        out = PrewarmResult(warming=0)
        for slot in self.slots:
            if slot.index in self._warming or (slot.sandbox is not None and slot.sandbox.alive):
                out.running += 1
            elif slot.network or slot.sealed or slot.state not in ("free", "leased") or slot.lock.locked():
                out.skipped += 1
            else:
                self._warming.add(slot.index)
                self._schedule_prewarm(slot).add_done_callback(functools.partial(self._warmed, slot.index))
                out.slots.append(slot.index)
        out.warming = len(out.slots)
        if out.slots:
            log.info("prewarm: starting %d slot sandbox(es) in the background", out.warming)
        return out

    def _warmed(self, index: int, _task: asyncio.Task[None]) -> None:
        self._warming.discard(index)

    # -- calls -----------------------------------------------------------------------------
    async def run_calls(self, calls: Iterable[ToolCall]) -> AsyncIterator[CallResult]:
        """Run calls concurrently across slots (in order within a slot) and yield each as it ends."""
        queue: asyncio.Queue[CallResult] = asyncio.Queue()
        tasks = [asyncio.create_task(self._run_to(queue, call)) for call in calls]
        try:
            for _ in range(len(tasks)):
                yield await queue.get()
        finally:
            for task in tasks:
                task.cancel()

    async def _run_to(self, queue: asyncio.Queue[CallResult], call: ToolCall) -> None:
        await queue.put(await self.run_call(call))

    async def run_call(self, call: ToolCall) -> CallResult:
        t0 = time.perf_counter()
        result = CallResult(id=call.id, slot=call.slot, ok=False)
        try:
            slot = self.slot(call.slot)
            self.check_lease(slot, call.lease)
            args = validate_args(call.tool, call.args)
            timeout, result.notes = clamp_timeout(call.timeout_s or getattr(args, "timeout_s", None), self.cfg)
            payload = supervisor_request(call.tool, args, timeout, self.cfg)
            if slot.sealed and call.tool in SEALED_REFUSED:
                raise SlotSealed(f"{call.tool}: slot {slot.index} is in its verification phase: the agent's "
                                 "part of the lease is over (only reading the workspace and verify remain)")
            async with slot.lock:
                self.check_lease(slot, call.lease)  # a reset may have happened while we waited
                if slot.sealed and call.tool in SEALED_REFUSED:
                    raise SlotSealed(f"{call.tool}: slot {slot.index} is in its verification phase")
                slot.count_call()
                self.total_calls += 1
                frame = await self._request(slot, payload, timeout)
            if frame.get("ok"):
                result.ok, result.result = True, frame["result"]
            else:
                err = frame.get("error") or {}
                code = str(err.get("code", "error"))
                result.error = ErrorInfo(code=code, message=str(err.get("message", "")),
                                         status=slot_protocol.status(code))
        except KeyError as exc:
            result.error = ErrorInfo(code="unknown_slot", message=str(exc.args[0]), status=404)
        except (LeaseError, ToolError, SandboxDied) as exc:  # SlotSealed is a LeaseError
            result.error = ErrorInfo(code=exc.code, message=str(exc), status=exc.status)  # atropos.errors.ERRORS
        elapsed = time.perf_counter() - t0
        result.duration_ms = round(elapsed * 1000, 3)
        outcome = "ok" if result.ok else (result.error.code if result.error else "error")
        metrics.HOST_CALLS.labels(call.tool, outcome).inc()
        metrics.HOST_CALL_SECONDS.labels(call.tool).observe(elapsed)
        return result

    async def _request(self, slot: Slot, payload: dict[str, Any], timeout: float) -> dict[str, Any]:
        try:
            return await slot.request(payload, timeout + 10)
        except SessionLost as exc:
            if self.stopping:
                raise
            log.info("slot %d: python session lost during a call: %s", slot.index, exc)
            return {"ok": True, "result": session_lost_result(exc, timeout, self.cfg.session_grace_s)}
        except SandboxLost as exc:
            if self.stopping:
                raise
            # The slot's code took its own sandbox down (kill -9 -1, OOM, a supervisor it stopped or
            # starved): that is the call's outcome, shown to the model, never an infrastructure
            # retry; the next call gets a fresh sandbox, files kept.
            log.info("slot %d: sandbox lost during a call: %s", slot.index, exc)
            await slot.stop_sandboxes()
            if payload.get("op") != "exec":
                raise SandboxRestarted(f"the slot's sandbox failed during this call ({exc}); it was restarted, "
                                       "workspace files are kept") from exc
            return {"ok": True, "result": {
                "exit_code": None, "signal": 9, "timed_out": False, "output_limited": False, "stdout": "",
                "stderr": "[the command killed its own sandbox; it was restarted, workspace files are kept]\n",
                "stdout_bytes": 0, "stderr_bytes": 0, "stdout_truncated": False, "stderr_truncated": False,
                "duration_ms": 0.0, "sandbox_restarted": True}}


def session_lost_result(exc: SessionLost, timeout: float, grace: float) -> dict[str, Any]:
    """What a python_session call returns when its interpreter had to be killed or died."""
    if exc.timed_out:
        why = (f"the code did not stop within {grace:g}s of its {timeout:g}s timeout interrupt (it ignored or "
               "swallowed it), so the session was killed")
    else:
        why = "the Python session exited during the call (os._exit, a crash, or out of memory)"
    message = (f"{why}; it was restarted: variables, imports and this call's output are lost "
               "(workspace files are kept)")
    return {
        "stdout": "", "stderr": "", "value": None,
        "error": {"type": "SessionRestarted", "message": message, "traceback": ""},
        "timed_out": exc.timed_out, "output_limited": False, "restarted": True, "session_started": False,
        "stdout_bytes": 0, "stderr_bytes": 0, "stdout_truncated": False, "stderr_truncated": False,
        "execution_count": 0, "duration_ms": 0.0,
    }


def _image_info(image: ImageRoot, t0: float | None = None, reference: str | None = None) -> ImageInfo:
    """What the host says of an image it holds (``t0``: when the request that got it began)."""
    return ImageInfo(reference=reference or image.reference, id=image.image_id, layers=len(image.lowers),
                     slots=sorted(image.users),
                     duration_ms=0.0 if t0 is None else round((time.perf_counter() - t0) * 1000, 3))
