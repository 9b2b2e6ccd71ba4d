"""One slot of a host: its workspace, its lease, its sandbox processes, and its reset."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import os
import secrets
import stat
import time
from pathlib import Path
from typing import Any

from atropos.sandbox.bwrap import LIB_DIR, RUN_DIR, SANDBOX_ENV, WORKSPACE, SandboxPaths, bwrap_argv
from atropos.sandbox.cgroups import SlotCgroup
from atropos.sandbox.config import HostConfig
from atropos.sandbox.network import SlirpHandshake
from atropos.sandbox.protocol import ErrorInfo, LeaseInfo, SlotInfo, SlotState, VerifyRequest, VerifyResult
from atropos.sandbox.sandbox_process import SandboxDied, SandboxProcess
from atropos.sandbox.verification import VERIFIER_ENV, verifier_bwrap
from atropos.sandbox.workspace import (
    MountNamespace,
    Template,
    WorkspaceError,
    WorkspaceKind,
    Workspaces,
    copy_tree,
    remove_tree,
    walk_tree,
)

CHOOM = "/usr/bin/choom"  # util-linux: on every Debian/Ubuntu
SETPRIV = "/usr/bin/setpriv"  # util-linux too
HAVE_CHOOM = os.path.exists(CHOOM)
SANDBOX_OOM_SCORE_ADJ = 1000  # under memory pressure the sandbox dies, never the host
VERIFY_GRACE_S = 10.0  # beyond the program's own timeout: its start and its answer

log = logging.getLogger(__name__)


class SessionLost(SandboxDied):
    """The python_session interpreter died or was killed during a call (it ignored its timeout
    interrupt, exited, crashed, ran out of memory). The code's outcome, not the platform's: the
    host answers with a ``restarted`` result; the next call starts an empty session."""

    def __init__(self, message: str, *, timed_out: bool) -> None:
        super().__init__(message)
        self.timed_out = timed_out


class Slot:
    """State machine: free -> leased -> resetting -> free (or quarantined when a reset fails)."""

    def __init__(self, index: int, cfg: HostConfig, root: Path, uid: int | None, seccomp_path: str | None,
                 workspaces: Workspaces | None = None):
        self.index = index
        self.workspaces = workspaces
        self.cfg = cfg
        self.uid = uid
        self.seccomp_path = seccomp_path
        self.dir = root / "slots" / str(index)
        self.paths = SandboxPaths(
            workspace=self.dir / "ws", run_dir=self.dir / "run", lib_dir=root / "lib", etc_dir=root / "etc"
        )
        self.trash = root / "trash"
        self.state: SlotState = "free"
        self.generation = 0
        self.lease_token: str | None = None
        self.trajectory_id: str | None = None
        self.network = False
        self.private_net = False  # set by the host: network slots get their own namespace
        self.leased_at: float | None = None
        self.calls = 0
        self.detail = ""
        self.term_offset = 0
        self.lock = asyncio.Lock()  # one call at a time per slot, in arrival order
        self.sandbox: SandboxProcess | None = None
        self.terminal: SandboxProcess | None = None
        self.session: SandboxProcess | None = None  # the python_session interpreter, started on first use
        self.killer: UidKiller | None = None  # shared by the host's slots
        self.template: Template | None = None  # the template the workspace is built on
        self.ws_kind: WorkspaceKind = "plain"
        self.capped = False  # the workspace (a fork's layers) is a capped tmpfs mount
        self.scratch = False  # run dir, /tmp and /dev/shm are capped tmpfs mounts (size and inodes)
        self.last_verified = ""
        # The verification phase of the lease began (see docs/verification.md): every process of
        # the agent is gone, no command or interpreter runs again in the slot until its reset.
        self.sealed = False
        self.cgroup: SlotCgroup | None = None  # every sandbox of the slot runs in it (set by the host)

    @property
    def ov(self) -> Path:
        """Overlay layers of a forked workspace: upper (the slot's writes), work, lower (mount point)."""
        return self.dir / "ov"

    # -- layout ----------------------------------------------------------------------------
    async def prepare(self) -> None:
        """First workspace of a starting host (whatever an earlier host left goes to the trash)."""
        def clear() -> None:
            self.dir.mkdir(parents=True, exist_ok=True)
            os.chmod(self.dir, 0o711)
            for d in (self.paths.workspace, self.paths.run_dir, self.ov, *self._scratch_dirs()):
                if d.exists() or d.is_symlink():
                    self._discard(d)

        await asyncio.to_thread(clear)
        await self._build_workspace(None)

    def _view(self, p: Path) -> Path:
        """Where the host reaches ``p`` as the slot sees it: through the mount namespace when
        ``p`` (or what holds it) is mounted there, else the path itself."""
        if not self.capped and not self.scratch and self.ws_kind != "overlay":
            return p
        return Path(self._ns().proc_path(Path(self._real(p))))

    def _fresh_dir(self, d: Path) -> None:
        d.mkdir(mode=0o700)
        if self.uid is not None:
            os.chown(d, self.uid, self.uid)
        os.chmod(d, 0o700)

    def _discard(self, d: Path) -> None:
        """Move a dirty tree aside (never copy into or walk it here); deleted in the background."""
        self.trash.mkdir(exist_ok=True)
        os.rename(d, self.trash / f"{self.index}-{d.name}-{self.generation}-{secrets.token_hex(4)}")

    # -- leases ----------------------------------------------------------------------------
    def grant(self, trajectory_id: str, network: bool) -> LeaseInfo:
        self.lease_token = secrets.token_urlsafe(24)
        self.state = "leased"
        self.trajectory_id = trajectory_id
        self.network = network
        self.leased_at = time.monotonic()
        self.calls = 0
        return self.lease_info()

    def lease_info(self) -> LeaseInfo:
        assert self.lease_token is not None and self.trajectory_id is not None
        return LeaseInfo(slot=self.index, lease=self.lease_token, generation=self.generation,
                         trajectory_id=self.trajectory_id, network=self.network)

    def info(self) -> SlotInfo:
        return SlotInfo(
            slot=self.index, state=self.state, generation=self.generation, trajectory_id=self.trajectory_id,
            network=self.network, calls=self.calls, detail=self.detail,
            leased_for_s=None if self.leased_at is None else round(time.monotonic() - self.leased_at, 3),
            sandbox_running=self.sandbox is not None and self.sandbox.alive,
            session_running=self.session is not None and self.session.alive,
            template=None if self.template is None else self.template.id, workspace=self.ws_kind,
            sealed=self.sealed,
        )

    # -- sandboxes -------------------------------------------------------------------------
    def _argv(self, extra: dict[str, Any], script: str, verifier: bool = False) -> list[str]:
        sup_cfg = {"limits": self.cfg.limits.rlimits(), "env": VERIFIER_ENV if verifier else SANDBOX_ENV, **extra}
        if self.cfg.unsafe_no_isolation:
            sup_cfg.update(workspace=str(self.paths.workspace), run_dir=str(self.paths.run_dir),
                           isolated=False, env={**SANDBOX_ENV, "HOME": str(self.paths.workspace)})
            return [self.cfg.python, "-I", "-S", str(self.paths.lib_dir / script), json.dumps(sup_cfg)]
        paths = self.paths
        if self.scratch and not verifier:
            # the verifier gets fresh /tmp and /dev/shm: nothing the agent left in the slot's own
            tmp, shm = self._scratch_dirs()
            paths = dataclasses.replace(paths, tmp=tmp, shm=shm)
        argv = bwrap_argv(self.cfg.bwrap, paths, self.cfg.limits, network=self.network and not verifier,
                          seccomp_fd=-1, private_net=self.private_net)
        argv[argv.index("-1")] = "{seccomp_fd}"
        if verifier:
            argv = verifier_bwrap(argv, self.paths)
        return [*argv, self.cfg.python, "-I", "-S", f"{LIB_DIR}/{script}", json.dumps(sup_cfg)]

    async def _start(self, extra: dict[str, Any], label: str, protocol: bool = True,
                     script: str = "supervisor.py", verifier: bool = False) -> SandboxProcess:
        argv, uid = self._argv(extra, script, verifier), self.uid
        if self.ws_kind == "overlay" or self.capped or self.scratch:
            # The fork's overlay and the capped tmpfs mounts exist only in the workspace mount
            # namespace: start bwrap in it (nsenter drops to the slot's uid itself on a root host).
            argv, uid = [*self._ns().launcher(self.uid), *argv], None
        if HAVE_CHOOM:
            # Raised before bwrap starts (raising needs no privilege); /proc is read-only inside, so
            # nothing in the slot can lower it and make the host the OOM killer's victim.
            argv = [CHOOM, "-n", str(SANDBOX_OOM_SCORE_ADJ), "--", *argv]
        if self.cgroup is not None:
            if uid is not None:
                # Placed by root, then the uid drops: a slot uid could not move itself out of the
                # host's cgroup (v2 wants write access to the common ancestor), nor should it.
                argv, uid = [SETPRIV, f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--", *argv], None
            argv = [*self.cgroup.launcher(), *argv]
        return await SandboxProcess.start(
            argv, uid=uid, protocol=protocol,
            seccomp_path=None if self.cfg.unsafe_no_isolation else self.seccomp_path, label=label,
            network=(SlirpHandshake.create(self.cfg.egress, self.cfg.python) if self.network and self.private_net
                     and not verifier
                     and not self.cfg.unsafe_no_isolation else None),
            network_uid=self.uid,
            echoes_seq=protocol,  # both in-slot programs serve through inslot.serve
        )

    async def ensure_sandbox(self) -> SandboxProcess:
        if self.sandbox is None or not self.sandbox.alive:
            # sealed: a supervisor that reads the workspace for the host and never starts anything
            self.sandbox = await self._start({"sealed": True} if self.sealed else {}, f"slot {self.index}")
        return self.sandbox

    async def ensure_terminal(self) -> None:
        sock = self._view(self.paths.run_dir) / "tmux.sock"
        if self.terminal is not None and self.terminal.alive:
            if _is_socket(sock):
                return
            # the slot put something else where the terminal's socket was: a new terminal
            await self.terminal.kill()
            self.terminal = None
        run_dir = RUN_DIR if not self.cfg.unsafe_no_isolation else str(self.paths.run_dir)
        lib_dir = LIB_DIR if not self.cfg.unsafe_no_isolation else str(self.paths.lib_dir)
        if os.path.lexists(sock):  # noqa: ASYNC240 - one lstat; whatever the slot left there goes
            await asyncio.to_thread(remove_tree, sock)
        exec_argv = ["tmux", "-D", "-S", f"{run_dir}/tmux.sock", "-f", f"{lib_dir}/tmux.conf"]
        self.terminal = await self._start({"exec": exec_argv}, f"slot {self.index} terminal", protocol=False)
        deadline = time.monotonic() + 5.0
        while not _is_socket(sock):
            if not self.terminal.alive or time.monotonic() > deadline:
                await self.terminal.kill()
                self.terminal = None
                raise SandboxDied(f"slot {self.index}: terminal did not start")
            await asyncio.sleep(0.01)

    async def _session_request(self, payload: dict[str, Any]) -> dict[str, Any]:
        """A python_session call: in the slot's own interpreter sandbox (a third one, same uid and
        workspace, its own PID namespace), started on first use and kept until reset or release."""
        if payload.get("restart") and self.session is not None:
            await self.session.kill()
            self.session = None
        started = self.session is None or not self.session.alive
        if started:
            if self.session is not None:
                await self.session.kill()  # it died between calls: reap it before starting another
            self.session = await self._start({}, f"slot {self.index} python session", script="session.py")
        proc = self.session
        assert proc is not None
        # The driver interrupts the code itself at its timeout; the grace is how long the code
        # gets to stop before we stop waiting and kill it.
        deadline = float(payload["timeout"]) + self.cfg.session_grace_s
        t0 = time.monotonic()
        try:
            frame = await proc.request(payload, deadline)
        except SandboxDied as exc:
            if self.session is not proc:
                raise  # stopped from outside (reset, release, host stop): not the code's doing
            await proc.kill()
            self.session = None
            raise SessionLost(str(exc), timed_out=time.monotonic() - t0 >= deadline - 0.05) from exc
        if frame.get("ok") and isinstance(frame.get("result"), dict):
            frame["result"].update(session_started=started, restarted=False)
        return frame

    async def request(self, payload: dict[str, Any], timeout: float) -> dict[str, Any]:
        if payload.get("op") == "session":
            return await self._session_request(payload)
        if payload.get("op") == "terminal":
            await self.ensure_terminal()
            payload = {**payload, "offset": self.term_offset}
        sandbox = await self.ensure_sandbox()
        frame = await sandbox.request(payload, timeout)
        if payload.get("op") == "terminal" and frame.get("ok"):
            self.term_offset = int(frame["result"]["offset"])
        return frame

    async def stop_sandboxes(self) -> None:
        # The session goes too: the next lease must never see this trajectory's variables (the
        # supervisor's kill(-1) only reaches its own sandbox's PID namespace).
        procs = (self.sandbox, self.terminal, self.session)
        self.sandbox = self.terminal = self.session = None
        for proc in procs:
            if proc is not None:
                await proc.kill()

    # -- reset ---------------------------------------------------------------------------
    async def reset(self, template: Template | None = None) -> tuple[bool, str]:
        """Kill everything of the lease, rebuild the workspace (empty, or a fresh fork of
        ``template``) and check the result before the slot can be leased again."""
        self.state = "resetting"
        try:
            await self.stop_sandboxes()
            await self._kill_cgroup()
            # The uid sweep (a /proc scan) and the workspace's renewal run side by side: the slot is
            # not leasable until both are done, and a survivor quarantines it all the same.
            outcomes = await asyncio.gather(self._kill_uid(), self._renew_workspace(template),
                                            return_exceptions=True)
            for outcome in outcomes:
                if isinstance(outcome, BaseException):
                    raise outcome
            problem = self._verify()
            if problem:
                raise RuntimeError(problem)
        except Exception as exc:
            # Even a surprise (a bug, a malformed helper answer) leaves the workspace in an unknown
            # state, and a slot left "resetting" would be neither leasable nor reported. Quarantine it.
            self.quarantine(f"reset failed: {self._failure(exc, 'during reset')}")
            return False, self.detail
        self.generation += 1
        self.sealed = False
        self.lease_token = None
        self.trajectory_id = None
        self.network = False
        self.leased_at = None
        self.term_offset = 0
        self.state = "free"
        self.detail = ""
        return True, ""

    # -- verification phase ----------------------------------------------------------------
    async def seal(self) -> str:
        """Begin the verification phase: every process of the slot goes (calls, waiting
        interpreters, terminal, python_session) and none starts again until the reset. Returns
        what was established about the agent's processes."""
        self.sealed = True
        await self.stop_sandboxes()
        await self._kill_all()  # RuntimeError if any process of the slot's uid survived
        return self._processes_checked()

    async def verify(self, req: VerifyRequest) -> VerifyResult:
        """Run a verifier program in a fresh sandbox of the sealed slot (see docs/verification.md)."""
        separation = await self.seal()
        t0 = time.monotonic()
        result = VerifyResult(slot=self.index, ok=False, separation=separation)
        workspace = str(self.paths.workspace) if self.cfg.unsafe_no_isolation else WORKSPACE
        proc: SandboxProcess | None = None
        try:
            proc = await self._start({}, f"slot {self.index} verifier", script="verifier.py", verifier=True)
            frame = await proc.request({"op": "verify", "program": req.program, "secrets": req.secrets,
                                        "args": req.args, "timeout": req.timeout_s, "workspace": workspace},
                                       req.timeout_s + VERIFY_GRACE_S)
        except SandboxDied as exc:
            late = time.monotonic() - t0 >= req.timeout_s
            result.error = ErrorInfo(code="timed_out" if late else "verifier_died",
                                     message=str(exc), status=200)
            return result
        finally:
            if proc is not None:
                await proc.kill()
            await self._kill_all()  # nothing the program started outlives it
            result.duration_ms = round((time.monotonic() - t0) * 1000, 3)
        answer = frame.get("result") if frame.get("ok") else None
        if not isinstance(answer, dict):
            result.error = ErrorInfo(code="verifier_died", message=f"malformed answer: {frame!r:.300}", status=200)
            return result
        result.log = str(answer.get("log", ""))
        verdict = answer.get("verdict")
        if isinstance(verdict, dict) and isinstance(verdict.get("score"), (int, float)):
            result.ok, result.verdict, result.score = True, verdict, float(verdict["score"])
        else:
            err = answer.get("error")
            if not isinstance(err, dict):
                err = {}
            result.error = ErrorInfo(code=str(err.get("code", "bad_verdict")), message=str(err.get("message", "")),
                                     status=200)
        return result

    async def _kill_all(self) -> None:
        await self._kill_cgroup()
        await self._kill_uid()

    async def _kill_cgroup(self) -> None:
        if self.cgroup is None:
            return
        # Killed sandboxes were reaped by stop_sandboxes: the cgroup is normally empty already,
        # which one read of cgroup.procs tells (nothing can enter it but a fork from inside).
        if self.cgroup.pids():
            left = await asyncio.to_thread(self.cgroup.kill)
            if left:
                raise RuntimeError(f"processes survived in the slot's cgroup {self.cgroup.main}: {left}")

    async def _kill_uid(self) -> None:
        if self.uid is not None:
            if self.killer is not None:
                survivors = await self.killer.kill(self.uid)
            else:
                survivors = await asyncio.to_thread(_kill_uid, self.uid)
            if survivors:
                raise RuntimeError(f"processes of uid {self.uid} survived: {survivors}")

    def _ns(self) -> MountNamespace:
        ns = None if self.workspaces is None else self.workspaces.ns
        if ns is None or not ns.alive:
            raise WorkspaceError("the workspace mount helper is not running")
        return ns

    def _mounts_prefix(self) -> str:
        return os.path.realpath(self.dir) + "/"

    def _real(self, p: Path) -> str:
        return os.path.join(os.path.realpath(p.parent), p.name)

    async def _drop_workspace(self) -> None:
        """Unmount a fork (its upper layer goes to the trash with the rest): never walk or copy
        into the dirty tree."""
        targets = []
        if self.ws_kind == "overlay":
            targets += [self.paths.workspace, self.ov / "lower"]
        if self.capped:
            targets.append(self.ov if self.ws_kind == "overlay" else self.paths.workspace)
        if self.scratch:
            targets += [self.paths.run_dir, *self._scratch_dirs()]
        if targets:
            real = [self._real(t) for t in targets]
            if self.ws_kind == "overlay" and not self.capped:
                # the fork's upper layer is on disk and goes to the trash below: unmounted first
                await self._ns().call({"op": "umount", "targets": real})
            else:  # tmpfs-backed: moved aside whole, unmounted in the background
                await self._ns().call({"op": "renew", "detach": real, "trash": str(self._mount_trash())})
        if self.template is not None:
            self.template.users.discard(self.index)
            self.template = None
        self.ws_kind = "plain"
        self.capped = self.scratch = False
        for d in (self.paths.workspace, self.ov, self.paths.run_dir, *self._scratch_dirs()):
            if d.exists() or d.is_symlink():
                self._discard(d)

    def _scratch_dirs(self) -> tuple[Path, Path]:
        """Host-side mount points of the slot's /tmp and /dev/shm."""
        return self.dir / "tmp", self.dir / "shm"

    async def _mount_cap(self, target: Path, quota: dict[str, Any]) -> None:
        self.capped = True  # before the await: a half-done mount is still unmounted by a drop
        await self._ns().call({"op": "tmpfs", "target": self._real(target), "quota": quota})

    async def _mount_scratch(self) -> None:
        """The run dir (the terminal's log), /tmp and /dev/shm: each its own tmpfs capped in size
        AND inodes (bubblewrap's --tmpfs can only cap the size; empty files cost kernel memory)."""
        self.scratch = True  # before the await: a half-done mount is still unmounted by a drop
        await self._ns().call({"op": "tmpfs_many", "mounts": self._scratch_mounts()})

    def _scratch_mounts(self) -> list[dict[str, Any]]:
        return [{"target": self._real(target), "quota": quota} for target, quota in
                zip((self.paths.run_dir, *self._scratch_dirs()), self.cfg.limits.scratch_quotas(self.uid), strict=True)]

    def _mount_trash(self) -> Path:
        assert self.workspaces is not None
        return self.workspaces.mount_trash

    async def _renew_workspace(self, template: Template | None) -> None:
        """Back to a fresh workspace. The common case, an empty workspace after an empty one whose
        dirs are all capped tmpfs mounts, is one round trip to the mount helper: the old mounts
        move aside (their pages go with a background unmount) and fresh ones take their place on
        the same (never slot-visible) mount points."""
        mgr = self.workspaces
        renewable = (template is None and self.ws_kind == "plain" and mgr is not None and mgr.ns is not None
                     and self.scratch == mgr.scratch_capped and self.capped == mgr.capped
                     and (self.scratch or self.capped))
        if not renewable:
            await self._drop_workspace()
            await self._build_workspace(template)
            return
        mounts = self._scratch_mounts() if self.scratch else []
        ws = self.paths.workspace
        if self.capped:
            mounts.append({"target": self._real(ws), "quota": self.cfg.limits.workspace_quota(self.uid)})
        else:  # an uncapped workspace is a directory on disk: to the trash, a fresh one in its place
            self._discard(ws)
            self._fresh_dir(ws)
        await self._ns().call({"op": "renew", "detach": [m["target"] for m in mounts], "tmpfs": mounts,
                               "trash": str(self._mount_trash())})

    async def _build_workspace(self, template: Template | None) -> None:
        ws, mgr = self.paths.workspace, self.workspaces
        quota = self.cfg.limits.workspace_quota(self.uid) if mgr is not None and mgr.capped else None
        self._fresh_dir(self.paths.run_dir)
        if mgr is not None and mgr.scratch_capped:
            for d in self._scratch_dirs():
                self._fresh_dir(d)
            await self._mount_scratch()
        if template is None:
            self._fresh_dir(ws)
            if quota is not None:
                await self._mount_cap(ws, quota)
            return
        template.users.add(self.index)  # before any await: a delete now sees it in use
        self.template = template
        if mgr is not None and mgr.mode == "overlay":
            ns = self._ns()
            ov, upper, work, lower = self.ov, self.ov / "upper", self.ov / "work", self.ov / "lower"
            ov.mkdir(mode=0o700)
            fork_quota = quota if mgr.fork_capped else None
            if fork_quota is None:  # else the helper makes them in the capped tmpfs it mounts on ov
                for d in (work, lower):
                    d.mkdir(mode=0o700)
                self._fresh_dir(upper)
            self._fresh_dir(ws)
            targets = {self._real(ws), self._real(lower), self._real(ov)}
            if any(m.mountpoint in targets for m in ns.mounts(self._mounts_prefix())):
                raise WorkspaceError("a mount is still in place before the fork; refusing to stack another")
            self.ws_kind = "overlay"
            self.capped = fork_quota is not None
            idmap = None if ns.mode != "root" else [mgr.owner, self.uid]
            await ns.call({"op": "fork", "tree": str(template.tree), "lower": self._real(lower),
                           "upper": self._real(upper), "work": self._real(work), "target": self._real(ws),
                           "idmap": idmap, "quota": fork_quota, "layers": self._real(ov)})
            return
        # Copy mode: a fresh directory (cp creates it; with a cap, the fresh tmpfs is the
        # directory), then owner and manifest in one walk.
        self.ws_kind = "copy"
        if quota is not None:
            self._fresh_dir(ws)
            await self._mount_cap(ws, quota)
        view = self._view(ws)
        await copy_tree(template.tree, view, timeout=self.cfg.max_timeout_s * 6, into_empty=quota is not None)
        summary = await asyncio.to_thread(walk_tree, view, chown_to=self.uid)
        if self.uid is not None:
            os.chown(view, self.uid, self.uid)
        os.chmod(view, 0o700)
        if summary.tree_hash != template.summary.tree_hash:
            raise WorkspaceError(f"copy of template {template.id} differs from it "
                                 f"({summary.tree_hash[:12]} != {template.summary.tree_hash[:12]})")

    def _verify(self) -> str:
        """What a finished reset must show (see docs/templates.md, "What a reset verifies")."""
        dirs = [self.paths.run_dir] + ([self.paths.workspace] if self.ws_kind == "plain" else [])
        if self.scratch:
            dirs += self._scratch_dirs()
        if self.capped or self.scratch:
            problem = self._verify_caps()
            if problem:
                return problem
        for d in map(self._view, dirs):
            st = os.lstat(d)
            if not stat.S_ISDIR(st.st_mode):
                return f"{d} is not a directory after reset"
            if self.uid is not None and st.st_uid != self.uid:
                return f"{d} has owner {st.st_uid}, expected {self.uid}"
            if os.listdir(d):
                return f"{d} is not empty after reset"
        if self.ws_kind == "plain":
            owner = ", owned by the slot uid" if self.uid is not None else ""
            self.last_verified = f"empty workspace and run dir{owner}; {self._processes_checked()}"
        elif self.ws_kind == "copy":
            assert self.template is not None
            st = os.lstat(self._view(self.paths.workspace))
            if not stat.S_ISDIR(st.st_mode) or (self.uid is not None and st.st_uid != self.uid):
                return "the copied workspace is not a directory owned by the slot"
            self.last_verified = (f"fresh copy of template {self.template.id}: manifest hash "
                                  f"{self.template.summary.tree_hash[:12]} matches")
        else:
            problem = self._verify_overlay()
            if problem:
                return problem
        return ""

    def _verify_caps(self) -> str:
        """Exactly one fresh capped tmpfs on each capped dir, of the configured size and inodes."""
        lim = self.cfg.limits
        capped: dict[str, tuple[int, int]] = {}
        if self.scratch:
            for d, quota in zip((self.paths.run_dir, *self._scratch_dirs()), lim.scratch_quotas(self.uid), strict=True):
                capped[self._real(d)] = (int(quota["bytes"]), int(quota["inodes"]))
        if self.capped:
            ws_or_layers = self.ov if self.ws_kind == "overlay" else self.paths.workspace
            capped[self._real(ws_or_layers)] = (lim.workspace_bytes, lim.workspace_inodes)
        mounts = self._ns().mounts(self._mounts_prefix())
        for path, (size, inodes) in capped.items():
            at = [m for m in mounts if m.mountpoint == path]
            if len(at) != 1 or at[0].fstype != "tmpfs":
                return f"expected exactly one tmpfs on {path}, found {[(m.mount_id, m.fstype) for m in at]}"
            got = at[0].super_option("size")
            if got is None or _size_bytes(got) != _page_round(size):
                return f"the tmpfs on {path} has size {got}, expected {size} bytes"
            got = at[0].super_option("nr_inodes")
            if got is None or _size_bytes(got) != inodes:
                return f"the tmpfs on {path} has nr_inodes={got}, expected {inodes}"
        return ""

    def _verify_overlay(self) -> str:
        assert self.template is not None
        ns = self._ns()
        ws, lower, upper, work = (self._real(p) for p in (self.paths.workspace, self.ov / "lower",
                                                            self.ov / "upper", self.ov / "work"))
        mounts = ns.mounts(self._mounts_prefix())
        at_ws = [m for m in mounts if m.mountpoint == ws]
        at_lower = [m for m in mounts if m.mountpoint == lower]
        if len(at_ws) != 1 or at_ws[0].fstype != "overlay":
            return f"expected exactly one overlay on {ws}, found {[(m.mount_id, m.fstype) for m in at_ws]}"
        m = at_ws[0]
        layers = (m.super_option("lowerdir"), m.super_option("upperdir"), m.super_option("workdir"))
        if layers != (lower, upper, work):
            return f"the overlay on {ws} has unexpected layers {layers}"
        if len(at_lower) != 1 or "ro" not in at_lower[0].options.split(","):
            return f"expected exactly one read-only template mount on {lower}"
        if not at_lower[0].root.endswith(f"/templates/{self.template.id}/tree"):
            return f"the lower layer is {at_lower[0].root}, not template {self.template.id}"
        if ns.mode == "root" and "idmapped" not in at_lower[0].options.split(","):
            return "the template layer is not idmapped"
        upper_view = self._view(self.ov / "upper")
        st = os.lstat(upper_view)
        if not stat.S_ISDIR(st.st_mode) or (self.uid is not None and st.st_uid != self.uid):
            return "the upper layer is not a directory owned by the slot"
        if os.listdir(upper_view):
            return "the upper layer is not empty after reset"
        self.last_verified = (f"fresh overlay (mount {m.mount_id}, none before it) of template {self.template.id}: "
                              f"empty upper layer, read-only template layer; {self._processes_checked()}")
        return ""

    def _processes_checked(self) -> str:
        """What the reset established about the old lease's processes, and no more than that."""
        if self.cgroup is not None:
            by_uid = " and no process of the slot uid" if self.uid is not None else ""
            return f"no process left in the slot's cgroup (killed, then checked empty){by_uid}"
        if self.uid is not None:
            return "no process of the slot uid (swept by uid)"
        # Without a per-slot uid (a non-root host) there is nothing to sweep by: what holds is that
        # the slot's sandboxes were killed, and with them their PID namespaces.
        return "the slot's sandboxes killed (no per-slot uid on a non-root host, so no uid sweep)"

    # -- templates -------------------------------------------------------------------------
    async def snapshot(self, name: str) -> Template:
        """Make a template of this (leased) slot's workspace; the slot continues as a fresh
        fork of it under the same lease. Every process of the slot is stopped first: a
        snapshot of a tree that is still being written is not a snapshot."""
        mgr = self.workspaces
        assert mgr is not None
        await self.stop_sandboxes()
        await self._kill_all()
        kind, ws = self.ws_kind, self.paths.workspace
        source = str(self._view(ws)) if kind == "overlay" or self.capped else None

        async def fill(tree: Path) -> None:
            if source is not None:
                await copy_tree(source, tree, timeout=self.cfg.max_timeout_s * 6)
            else:
                os.rename(ws, tree)  # the slot's own tree, nobody left to write it: O(1)

        try:
            template = await mgr.build("slot", name, fill)
        except BaseException as exc:
            if not ws.exists():
                self.quarantine(f"snapshot failed after the workspace was taken: {exc}")
            raise
        try:
            await self._drop_workspace()
            await self._build_workspace(template)
            problem = self._verify()
            if problem:
                raise RuntimeError(problem)
        except Exception as exc:  # even a surprise: the slot's workspace is gone all the same, never leave it leased
            self.quarantine(f"re-fork after snapshot failed: {self._failure(exc, 're-forking after a snapshot')}")
            raise WorkspaceError(self.detail) from exc
        return template

    def _failure(self, exc: Exception, doing: str) -> str:
        """Why a reset or re-fork failed, for the quarantine; a surprise (not an OS, runtime or
        workspace error) is logged with its traceback and named by its type."""
        if isinstance(exc, (OSError, RuntimeError, WorkspaceError)):
            return str(exc)
        log.exception("slot %d: unexpected error %s", self.index, doing)
        return f"{type(exc).__name__}: {exc}"

    def quarantine(self, why: str) -> None:
        log.error("slot %d quarantined: %s", self.index, why)
        self.state = "quarantined"
        self.lease_token = None
        self.detail = why


def _is_socket(path: Path) -> bool:
    try:
        return stat.S_ISSOCK(os.lstat(path).st_mode)
    except OSError:
        return False


def _page_round(n: int) -> int:
    page = os.sysconf("SC_PAGE_SIZE")
    return (n + page - 1) // page * page


def _size_bytes(text: str) -> int:
    """tmpfs reports ``size=`` in mountinfo as bytes with a k/m/g suffix."""
    mult = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}.get(text[-1:].lower(), 1)
    return int(text[:-1] if mult != 1 else text) * mult


def _kill_uid(uid: int) -> list[int]:
    """SIGKILL every process of ``uid`` (a per-slot uid owns nothing else) and report survivors."""
    return _kill_uids({uid}).get(uid, [])


def _kill_uids(uids: set[int]) -> dict[int, list[int]]:
    """SIGKILL every process of these uids and wait until they are gone; survivors per uid.

    Each process found is opened as a pidfd first (no pid-reuse race), killed through it, and
    waited for by polling the pidfds (the kernel says when each one has exited: no sleeping
    and rescanning while a pid namespace is torn down). A rescan then catches anything forked
    between the scan and the kill; one /proc scan per round serves every uid of a burst.
    """
    import select
    import signal

    survivors: dict[int, list[int]] = {}
    for _ in range(20):
        found = _pids_of_uids(uids)
        if not found:
            return {}
        fds: list[int] = []
        for pids in found.values():
            for pid in pids:
                try:
                    fd = os.pidfd_open(pid)
                except OSError:  # already gone
                    continue
                try:
                    signal.pidfd_send_signal(fd, signal.SIGKILL)
                except OSError:
                    pass
                fds.append(fd)
        try:
            poller = select.poll()
            for fd in fds:
                poller.register(fd, select.POLLIN)
            waiting, deadline = len(fds), time.monotonic() + 1.0
            while waiting and time.monotonic() < deadline:
                events = poller.poll(max(1, int((deadline - time.monotonic()) * 1000)))
                for fd, _ in events:
                    poller.unregister(fd)
                    waiting -= 1
        finally:
            for fd in fds:
                os.close(fd)
        survivors = found
    left = _pids_of_uids(uids)
    return {uid: [p for p in pids if p in survivors.get(uid, [])] for uid, pids in left.items()}


def _pids_of_uids(uids: set[int]) -> dict[int, list[int]]:
    found: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/status", "rb") as fh:
                for line in fh:
                    if line.startswith(b"Uid:"):
                        uid = int(line.split()[1])
                        if uid in uids and not _is_zombie(name):
                            found.setdefault(uid, []).append(int(name))
                        break
        except OSError:
            continue
    return found


class UidKiller:
    """Coalesces the process sweeps of concurrent resets (a GRPO group of 16 forks at once) into
    one /proc scan per round instead of one per slot."""

    def __init__(self) -> None:
        self._pending: dict[int, list[asyncio.Future[list[int]]]] = {}
        self._task: asyncio.Task[None] | None = None

    async def kill(self, uid: int) -> list[int]:
        future: asyncio.Future[list[int]] = asyncio.get_running_loop().create_future()
        self._pending.setdefault(uid, []).append(future)
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._run())
        return await future

    async def _run(self) -> None:
        await asyncio.sleep(0)  # let the rest of a burst join this round
        while self._pending:
            batch, self._pending = self._pending, {}
            try:
                result = await asyncio.to_thread(_kill_uids, set(batch))
            except Exception as exc:
                for futures in batch.values():
                    for f in futures:
                        if not f.done():
                            f.set_exception(exc)
                continue
            for uid, futures in batch.items():
                for f in futures:
                    if not f.done():
                        f.set_result(result.get(uid, []))


def _is_zombie(pid: str) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            return fh.read().rsplit(b")", 1)[1].split()[0] == b"Z"
    except (OSError, IndexError):
        return True


def delete_trash(trash: Path) -> None:
    """Remove discarded trees (remove_tree never follows symlinks, so a planted link cannot redirect
    it); one tree that resists never keeps the others, or the next pass, from being removed."""
    if not trash.exists():
        return
    for entry in trash.iterdir():
        try:
            remove_tree(entry)
        except Exception:  # a background sweep: log and go on with the next tree
            log.exception("trash: could not remove %s", entry)
