"""A trajectory's hold on one slot, with async tool methods."""

from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import Awaitable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

from atropos.backends.base import HostInfo
from atropos.errors import HostUnavailable, InfrastructureError, LeaseError, ResetFailed, SandboxDied, ToolError
from atropos.sandbox.contract.client import HostClient
from atropos.sandbox.contract.imageref import ImageRef
from atropos.sandbox.contract.protocol import (
    CallResult,
    FreshRoot,
    ResetResult,
    SealResult,
    TemplateInfo,
    ToolCall,
    VerifyRequest,
    VerifyResult,
)
from atropos.slots.results import BashResult, SessionResult, WriteResult

if TYPE_CHECKING:
    from atropos.slots.pool import SlotPool

T = TypeVar("T")
L = TypeVar("L", bound="LeaseCalls")


class PoolHost:
    """The pool's view of one sandbox host: its free slots (with their host lease tokens) and leases."""

    def __init__(self, info: HostInfo, client: HostClient) -> None:
        self.info = info
        self.client = client
        self.free: list[tuple[int, str, int]] = []  # (slot, host lease token, generation)
        self.leases: dict[int, Lease] = {}
        self.dead = asyncio.Event()
        self._guarded: set[asyncio.Future[Any]] = set()  # work in flight under ``guard``
        self.dead_reason = ""
        self.failures = 0
        self.suspected = False  # a call saw a transport error; cleared by the next passing probe
        self.quarantined = 0
        self.idle_since: float | None = time.monotonic()
        self.last_health_ms: float | None = None
        self.images: set[str] = set()  # task images this host holds in its layer store (as far as we know)
        # Free slots whose fresh root is a task image (kept from their last lease, prewarmed by the
        # host): a lease of that image takes one with no reset on its path. Absent: the default root.
        self.roots: dict[int, str] = {}
        # Task images this host refused (image_rejected: a node without the image, a store it does not
        # fit): (when, why). The pool sends such an image elsewhere while the refusal is recent.
        self.refused: dict[str, tuple[float, str]] = {}

    def refusal(self, image: str, ttl: float) -> str | None:
        """Why this host refused ``image`` within the last ``ttl`` seconds, or None."""
        entry = self.refused.get(image)
        if entry is None or time.monotonic() - entry[0] > ttl:
            return None
        return entry[1]

    @property
    def id(self) -> str:
        return self.info.id

    @property
    def leasable(self) -> bool:
        """Whether its free slots may be handed out now."""
        return not self.dead.is_set() and not self.suspected

    # -- what the pool does to a host: its methods, so the host's state has one writer --------
    def hold(self, lease: Lease) -> None:
        """``lease`` now holds its slot (taken from ``free``): the host is no longer idle."""
        self.leases[lease.slot] = lease
        self.idle_since = None

    def drop(self, lease: Lease) -> None:
        """``lease`` no longer holds its slot (released, or its reset failed)."""
        if self.leases.get(lease.slot) is lease:
            del self.leases[lease.slot]

    def give_back(self, slot: int, token: str, generation: int, image: str | None = None) -> None:
        """A reset slot with its fresh host lease token returns to the free list (its root a fresh
        one of ``image``, or the default root)."""
        self.free.append((slot, token, generation))
        if image is None:
            self.roots.pop(slot, None)
        else:
            self.roots[slot] = image

    def take_free(self, image: str | None = None) -> tuple[int, str, int, str | None]:
        """A free slot and the image its root is (None: the default root): one whose root is
        ``image`` if any, else one on the default root, else any."""
        pick = len(self.free) - 1
        if self.roots:
            default = None
            for i in range(len(self.free) - 1, -1, -1):
                root = self.roots.get(self.free[i][0])
                if root == image:
                    pick = i
                    break
                if root is None and default is None:
                    default = i
            else:
                pick = pick if default is None else default
        slot, token, generation = self.free.pop(pick)
        return slot, token, generation, self.roots.pop(slot, None)

    def quarantine_slot(self) -> None:
        """Count a slot that failed its reset (it never returns to ``free``)."""
        self.quarantined += 1

    def mark_dead(self, reason: str) -> list[Lease]:
        """Out of service for good: the free list is emptied and the leases it held are returned
        (the pool fails them)."""
        self.dead_reason = reason
        self.dead.set()
        for task in list(self._guarded):  # every guarded call fails now (guard: HostUnavailable)
            task.cancel()
        leases = list(self.leases.values())
        self.leases.clear()
        return leases

    def retire(self) -> None:
        """Removed from the pool: nothing is leased from it again."""
        self.free.clear()

    def suspect(self) -> None:
        """Lease nothing from it until a health probe passes."""
        self.suspected = True

    def probed(self, healthy: bool, ms: float | None) -> bool:
        """Record a health probe (``ms``: how long its answer took, None without one); returns
        whether a passing probe lifted a suspicion (its free slots may be leased again)."""
        if ms is not None:
            self.last_health_ms = ms
        if not healthy:
            self.failures += 1
            return False
        self.failures = 0
        lifted, self.suspected = self.suspected, False
        return lifted

    def idle_for(self, now: float) -> float | None:
        """Seconds it has been wholly idle (no lease, every slot free), None when in use."""
        if self.leases or len(self.free) != self.info.slots:
            self.idle_since = None
            return None
        self.idle_since = self.idle_since or now
        return now - self.idle_since

    async def guard(self, work: Awaitable[T]) -> T:
        """Await ``work`` unless the host is declared dead first; then fail fast with HostUnavailable.

        On the hot path (every call): ``work`` runs as one task that ``mark_dead`` cancels, rather
        than racing a second task on ``dead`` through ``asyncio.wait`` (issue 38: that race was a
        third of the pool's CPU per call)."""
        if self.dead.is_set():
            if asyncio.iscoroutine(work):
                work.close()
            raise HostUnavailable(f"host {self.id} is dead: {self.dead_reason}")
        task = asyncio.ensure_future(work)
        self._guarded.add(task)
        try:
            return await task
        except asyncio.CancelledError:
            caller = asyncio.current_task()
            if task.cancelled() and (caller is None or caller.cancelling() == 0):
                # the work was cancelled, not its caller: the host died under it
                raise HostUnavailable(f"host {self.id} died during the call: {self.dead_reason}") from None
            raise
        finally:
            self._guarded.discard(task)


@dataclass(eq=False)
class PoolTemplate:
    """A workspace template usable on every host of the pool.

    It is made on one host (from a leased slot after setup, or from a dir/git/tar source) and
    shipped to another host the first time a slot there is forked from it: the origin streams
    its tar archive, the other host unpacks it, and the manifest hashes must match. Shipping
    (rather than re-running the setup on each host) keeps every rollout of a group on exactly
    the same bytes, and costs nothing when the group fits on one host, which the pool prefers.
    """

    name: str
    info: TemplateInfo  # of the origin copy
    copies: dict[str, str] = field(default_factory=dict)  # host id -> template id on that host
    shipping: dict[str, asyncio.Future[str]] = field(default_factory=dict, repr=False)
    deleted: bool = False

    @property
    def id(self) -> str:
        return self.info.id

    @property
    def tree_hash(self) -> str:
        return self.info.tree_hash

    def mark_deleted(self) -> None:
        """No slot may be forked from it again (its copies are being deleted)."""
        self.deleted = True


class LeaseCalls:
    """What every lease answers the same way, whoever carries its calls (``Lease`` to a host,
    ``ShardLease`` to a pool shard): its released/lost state and the typed tool methods over ``call``."""

    released: bool
    lost: str | None

    async def call(self, tool: str, args: dict[str, Any] | None = None, *, timeout_s: float | None = None,
                   call_id: str | None = None) -> CallResult:
        raise NotImplementedError

    async def release(self) -> None:
        raise NotImplementedError

    def lose(self, reason: str) -> None:
        """Its host (or shard) was lost or the pool stopped: every later call raises HostUnavailable."""
        self.lost = reason

    def end(self) -> bool:
        """Mark the lease released; False when it already was (release is idempotent)."""
        if self.released:
            return False
        self.released = True
        return True

    def check(self) -> None:
        """Raise ``LeaseError`` if released, ``HostUnavailable`` if its host (or shard) was lost."""
        if self.released:
            raise LeaseError(f"{self!r} was released")
        if self.lost is not None:
            raise HostUnavailable(f"{self!r} is lost: {self.lost}")

    async def ok(self, tool: str, args: dict[str, Any] | None = None, **kw: Any) -> dict[str, Any]:
        """Like ``call``, but a failed tool raises ToolError (with the host's code and status) and
        only the structured result is returned."""
        result = await self.call(tool, args, **kw)
        if not result.ok or result.result is None:
            assert result.error is not None
            raise ToolError(f"{tool}: {result.error.code}: {result.error.message}", code=result.error.code,
                            status=result.error.status)
        return result.result

    async def bash(self, command: str, *, timeout_s: float | None = None) -> BashResult:
        """Run ``command`` with bash in the workspace (cwd ``/workspace``); a failing command is a
        result with its ``exit_code``, arguments the tool refuses raise ``ToolError``."""
        return BashResult.model_validate(await self.ok("bash", {"command": command}, timeout_s=timeout_s))

    async def python_session(self, code: str, *, restart: bool = False,
                             timeout_s: float | None = None) -> SessionResult:
        """Run code in the slot's persistent Python session (state survives between calls; a
        failing cell is a result with ``error`` set, not an exception)."""
        return SessionResult.model_validate(
            await self.ok("python_session", {"code": code, "restart": restart}, timeout_s=timeout_s))

    async def read_file(self, path: str) -> str:
        """The text of a workspace file (``path`` relative to /workspace or under /workspace/);
        ``ToolError`` when it is missing, binary, too large or outside the workspace."""
        return str((await self.ok("read_file", {"path": path}))["content"])

    async def write_file(self, path: str, content: str) -> WriteResult:
        """Create or overwrite a workspace file (parents created); the result names the path
        bash sees. ``ToolError`` for a path outside the workspace (``path_escape``)."""
        return WriteResult.model_validate(await self.ok("write_file", {"path": path, "content": content}))

    async def __aenter__(self: L) -> L:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.release()


class Lease(LeaseCalls):
    """One slot held by one trajectory until ``release()``; tool calls go to that slot only."""

    def __init__(self, pool: SlotPool, host: PoolHost, slot: int, token: str, generation: int,
                 trajectory_id: str, network: bool, image: str | None = None) -> None:
        self.pool = pool
        self.host = host
        self.slot = slot
        self.token = token
        self.generation = generation
        self.trajectory_id = trajectory_id
        self.network = network
        self.leased_at = time.monotonic()
        self.released = False
        self.lost: str | None = None
        self.calls = 0
        self.template: PoolTemplate | None = None  # the template the workspace is a fork of
        self.image = image  # the task image the slot's root is (docs/task-images.md)
        self.sealed = False  # in the verification phase (see ``seal``) until the next reset

    def __repr__(self) -> str:
        return f"Lease({self.trajectory_id!r} -> {self.host.id}/{self.slot} gen {self.generation})"

    @property
    def key(self) -> tuple[str, int]:
        """``(host id, slot)``: the slot this lease holds."""
        return (self.host.id, self.slot)

    # -- what the pool does to a lease: its methods, so the lease's state has one writer ----
    def renewed(self, token: str, generation: int) -> None:
        """The host reset the slot under this lease: its new token and generation."""
        self.token, self.generation = token, generation

    def forked_from(self, template: PoolTemplate) -> None:
        """The workspace was snapshotted as ``template`` and is now a fork of it."""
        self.template = template

    def tool_call(self, tool: str, args: dict[str, Any] | None = None, *, timeout_s: float | None = None,
                  call_id: str | None = None) -> ToolCall:
        """The wire form of a call on this lease (for batching through the host client yourself)."""
        return ToolCall(id=call_id or secrets.token_hex(6), slot=self.slot, lease=self.token, tool=tool,
                        args=args or {}, timeout_s=timeout_s, trajectory_id=self.trajectory_id)

    # -- the one tool-call path: Lease.call and the ToolExecutor's batches both go through
    # start_call (checks, counts) and settled (what a result means); only the transport differs.
    def start_call(self, tool: str, args: dict[str, Any] | None = None, *, timeout_s: float | None = None,
                   call_id: str | None = None) -> ToolCall:
        """A call about to be sent on this lease: the lease checked, the call counted, its wire form."""
        self.check()
        call = self.tool_call(tool, args, timeout_s=timeout_s, call_id=call_id)
        self.calls += 1
        self.pool.count_call()
        return call

    @staticmethod
    def settled(result: CallResult) -> CallResult:
        """``result``, unless it is the platform's or the lease's failure rather than the tool's:
        a lease the host no longer honours raises LeaseError (the caller retries on a fresh lease),
        a sandbox that failed raises InfrastructureError. A tool that failed stays a result."""
        error = result.error
        if error is not None:
            if error.code == LeaseError.code:
                raise LeaseError(error.message)
            if error.code == SandboxDied.code:
                raise InfrastructureError(error.message)  # the platform failed, not the tool
        return result

    async def call(self, tool: str, args: dict[str, Any] | None = None, *, timeout_s: float | None = None,
                   call_id: str | None = None) -> CallResult:
        """Run one tool call. Tool failures come back in the result; a lease the host refuses raises
        LeaseError, a dead host HostUnavailable (see ``settled``)."""
        call = self.start_call(tool, args, timeout_s=timeout_s, call_id=call_id)
        try:
            result = await self.host.guard(self.host.client.call(call))
        except HostUnavailable:
            self.pool.suspect(self.host)
            raise
        return self.settled(result)

    async def read_bytes(self, path: str) -> bytes:
        """The raw bytes of a workspace file (no text decoding, no base64 in between)."""
        self.check()
        return await self.host.guard(self.host.client.read_bytes(self.slot, self.token, path))

    async def write_bytes(self, path: str, data: bytes) -> WriteResult:
        """Write raw bytes to a workspace file (parents created)."""
        self.check()
        return WriteResult.model_validate(
            await self.host.guard(self.host.client.write_bytes(self.slot, self.token, path, data)))

    async def archive(self, path: str = ".") -> bytes:
        """A tar.gz of a workspace directory (default: the whole workspace)."""
        self.check()
        return await self.host.guard(self.host.client.archive(self.slot, self.token, path))

    async def seal(self) -> SealResult | None:
        """End the agent's part of the lease: every process of the slot is killed (calls, waiting
        interpreters, terminal, python_session) and nothing runs or writes in it again until a
        reset; reading the workspace and ``verify`` remain. AgentEnv seals every rollout before
        ``verify_and_score_trajectory``. Idempotent (None when this lease is already sealed)."""
        self.check()
        if self.sealed:
            return None
        result = await self._host_op(self.host.client.seal(self.slot, self.token))
        self.sealed = True
        return result

    async def verify(self, program: str, *, secrets: dict[str, str] | None = None, args: Any = None,
                     timeout_s: float = 60.0, restore: Sequence[str] = (),
                     fresh_root: FreshRoot | None = None) -> VerifyResult:
        """Run a verifier program against the slot's final workspace and return its verdict.

        ``program`` is Python source defining ``verify(workspace, secrets, args)`` that returns a
        number or a dict with a numeric ``"score"``. It runs after the lease is sealed, in a fresh
        sandbox of the slot with the workspace read-only, in a non-dumpable process that alone
        holds ``secrets`` (in memory); the verdict comes back through the host's protocol. A
        program that fails, times out or is killed by the code it checks gives ``ok=False`` (score
        it 0); only a host failure raises. See docs/verification.md.

        On a slot whose root is a task image, ``restore`` names absolute paths (files or whole
        directories) put back exactly as the image has them before the program runs: what the
        agent made of them is undone, and a path the image does not have is removed.

        ``fresh_root`` (an image root too) runs the program on a new root instead: the image's
        layers plus only the agent's changes to one repository, the named test files from the
        image (``FreshRoot``; docs/verification.md)."""
        self.check()
        req = VerifyRequest(lease=self.token, program=program, secrets=secrets or {}, args=args, timeout_s=timeout_s,
                            restore=list(restore), fresh_root=fresh_root)
        result = await self._host_op(self.host.client.verify(self.slot, req))
        self.sealed = True
        return result

    async def _host_op(self, work: Awaitable[T]) -> T:
        try:
            return await self.host.guard(work)
        except HostUnavailable:
            self.pool.suspect(self.host)
            raise

    async def reset(self, template: PoolTemplate | None = None, *, network: bool | None = None,
                    image: str | ImageRef | None = None, keep_if_fresh: bool = False) -> ResetResult:
        """Restart this lease's workspace, keeping the lease: empty, a fresh copy-on-write fork of
        ``template`` (shipped to this host first if it was made elsewhere), or a fresh root of the
        task image ``image`` (imported into the host's layer store first if need be, shipped to it
        first on a backend whose hosts cannot get it themselves). Every
        process of the slot is killed. A failed reset loses the lease (ResetFailed).
        ``keep_if_fresh`` (with ``image``): a slot nothing used since its root was made, of the
        image ``image`` names now, is kept as it is (``ResetResult.kept``; the lease gets a new token)."""
        self.check()
        template_id = None if template is None else await self.pool.template_on(template, self.host)
        if image is not None:  # a Docker or Nomad host is shipped it first (a moved tag again)
            image = ImageRef.parse(image)  # a bad reference fails here, before the slot is touched
            await self.pool.image_on(image, self.host)
        try:
            result = await self.host.guard(self.host.client.reset(
                self.slot, self.token, trajectory_id=self.trajectory_id, network=network, template=template_id,
                image=image, keep_if_fresh=keep_if_fresh))
        except HostUnavailable:
            self.pool.suspect(self.host)
            raise
        if not result.ok or result.lease is None:
            self.lost = f"reset failed, slot quarantined: {result.detail}"
            self.pool.quarantine(self.host, self.slot, result.detail)
            self.host.drop(self)
            raise ResetFailed(f"{self!r}: {result.detail}")
        self.token, self.generation = result.lease.lease, result.lease.generation
        self.sealed = False
        if network is not None:
            self.network = network
        self.template = template
        self.image = image
        if image is not None:
            self.host.images.add(image)
        return result

    async def derive_image(self) -> str:
        """Make this image-rooted slot's root, as it is now, an image of its own (a group's setup,
        done once); returns its reference for ``reset(image=...)``/``pool.lease(image=...)`` on
        hosts of the same machine. This slot continues as a fresh root of it."""
        self.check()
        info = await self._host_op(self.host.client.derive_image(self.slot, self.token))
        self.image = info.reference
        self.host.images.add(info.reference)
        return info.reference

    async def release(self) -> None:
        """Give the slot back (its workspace is wiped before anyone else gets it); idempotent."""
        await self.pool.release(self)
