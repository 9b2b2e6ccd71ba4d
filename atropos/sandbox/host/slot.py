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

from atropos.errors import ImageRejected, SandboxRestarted, ToolError
from atropos.sandbox.contract.hostdirs import remove_tree
from atropos.sandbox.contract.protocol import (
    ErrorInfo,
    LeaseInfo,
    SlotInfo,
    SlotState,
    VerifyRequest,
    VerifyResult,
)
from atropos.sandbox.host import slotd_build
from atropos.sandbox.host.config import HostConfig
from atropos.sandbox.host.images.host_images import HostImages
from atropos.sandbox.host.images.image_root import ImageRoot
from atropos.sandbox.host.inslot_bytecode import entry
from atropos.sandbox.host.isolation import slotd_config
from atropos.sandbox.host.isolation.bwrap import (
    IMAGE_HOST_USR,
    IMAGE_LIB_DIR,
    IMAGE_PRISTINE,
    IMAGE_RUN_DIR,
    LIB_DIR,
    RUN_DIR,
    SANDBOX_ENV,
    WORKSPACE,
    SandboxPaths,
    bwrap_argv,
    host_program,
    image_bwrap_argv,
)
from atropos.sandbox.host.isolation.cgroups import SlotCgroup
from atropos.sandbox.host.isolation.network import SlirpHandshake
from atropos.sandbox.host.isolation.sandbox_process import SandboxDied, SandboxProcess
from atropos.sandbox.host.isolation.seccomp import verifier_filter_path
from atropos.sandbox.host.isolation.uidkill import UidKiller, _kill_uid
from atropos.sandbox.host.isolation.verification import (
    CHECKED_ROOT,
    VERIFIER_ENV,
    image_verifier_bwrap,
    verifier_bwrap,
)
from atropos.sandbox.host.supervisor_choice import SupervisorChoice
from atropos.sandbox.host.workspace import WorkspaceError
from atropos.sandbox.host.workspace.slot_workspace import IMAGE_MOUNT_POINTS, SlotWorkspace
from atropos.sandbox.host.workspace.templates import Template
from atropos.sandbox.host.workspace.trees import copy_tree
from atropos.sandbox.host.workspace.verify_root import VerifyRoot
from atropos.sandbox.host.workspace.workspaces import Workspaces
from atropos.sandbox.inslot.inslot_warm import WARM_KINDS

# The environment of the helpers of an image slot (their own process, not what they start).
HELPER_ENV = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"}
CHOOM = "/usr/bin/choom"  # util-linux: on every Debian/Ubuntu
TMUX = "/usr/bin/tmux"
SETPRIV = "/usr/bin/setpriv"  # util-linux too
HAVE_CHOOM = os.path.exists(CHOOM)
SANDBOX_OOM_SCORE_ADJ = 1000  # under memory pressure the sandbox dies, never the host
VERIFY_GRACE_S = 10.0  # beyond the program's own timeout: its start and its answer
# A verifier program that failed is its verify call's observation (200, ok:false, like a tool that failed);
# its error carries the status of a tool's own failure in the one table, never 200 (not an error status).
VERIFIER_FAILED = ToolError.status

log = logging.getLogger(__name__)


class SessionLost(SandboxDied):
    """The python_session interpreter died or was killed during a call (it ignored its timeout
    interrupt, exited, crashed, ran out of memory). The code's outcome, not the platform's: the
    host answers with a ``restarted`` result; the next call starts an empty session."""

    def __init__(self, message: str, *, timed_out: bool) -> None:
        super().__init__(message)
        self.timed_out = timed_out


class SandboxLost(SandboxDied):
    """The slot's sandbox failed while it served one of the slot's requests, and nothing of the
    host stopped it (a reset, a release, the host's stop): the slot's own code can cause that (a
    supervisor it stopped, killed or starved, a hand-over that then could not start), so it is the
    call's outcome, never the platform's. Failing to *start* a sandbox stays ``SandboxDied``."""


class Slot:
    """State machine: free -> leased -> resetting -> free (or quarantined when a reset fails)."""

    def __init__(self, index: int, cfg: HostConfig, root: Path, uid: int | None, seccomp_path: str | None,
                 workspaces: Workspaces | None = None, *, name: str | None = None, killer: UidKiller | None = None,
                 private_net: bool = False, cgroup: SlotCgroup | None = None, slotd: Path | None = None,
                 choice: SupervisorChoice | None = None):
        self.index = index
        self.choice = choice or SupervisorChoice()  # the host's, shared by its slots
        self._agent_sandbox = False  # the sandbox is the agent phase's (not the sealed one)
        # the lease's code has run in the slot since its root was made: on an image root it may have
        # changed anything a new sandbox's start reads (ensure_sandbox)
        self._agent_ran = False
        # the compiled supervisor's host path (slotd_build.install): the lib dir's copy, or a binary
        # bound in from elsewhere; None: the Python supervisor serves every call
        self.slotd = slotd
        self.workspaces = workspaces
        self.cfg = cfg
        self.uid = uid
        self.seccomp_path = seccomp_path
        # ``name``: a slot outside the numbered ones (the host's health slot) lives beside them
        self.dir = root / name if name else root / "slots" / str(index)
        self.paths = SandboxPaths(
            workspace=self.dir / "ws", run_dir=self.dir / "run", lib_dir=root / "lib", etc_dir=root / "etc"
        )
        self.state: SlotState = "free"
        self.generation = 0
        self.lease_token: str | None = None
        self.trajectory_id: str | None = None
        self.network = False
        self.private_net = private_net  # network slots get their own namespace
        self.leased_at: float | None = None
        self.calls = 0
        self.detail = ""
        self.term_offset = 0
        self.lock = asyncio.Lock()  # one call at a time per slot, in arrival order
        self.sandbox: SandboxProcess | None = None
        self.terminal: SandboxProcess | None = None
        self.session: SandboxProcess | None = None  # the python_session interpreter, started on first use
        self.killer = killer  # shared by the host's slots
        # The verification phase of the lease began (see docs/verification.md): every process of
        # the agent is gone, no command or interpreter runs again in the slot until its reset.
        self.sealed = False
        self.cgroup = cgroup  # every sandbox of the slot runs in it
        self._verify_root: Path | None = None  # while a verifier runs on a fresh root (verify_root.py)
        self.ws = SlotWorkspace(index, cfg, uid, self.dir, self.paths, workspaces, root / "trash", cgroup,
                                generation=lambda: self.generation)

    @property
    def template(self) -> Template | None:
        """The template the workspace is a fork of (the workspace's state)."""
        return self.ws.template

    @property
    def last_verified(self) -> str:
        """What the last reset verified (the workspace's state)."""
        return self.ws.last_verified

    # -- what the host does to a slot: its methods, so the slot's state has one writer -------
    def claim(self) -> None:
        """Taken for a lease whose fork is still being built: no other lease request gets it."""
        self.state = "resetting"

    def revoke(self) -> None:
        """Refuse new calls at once (a reset or release begins); the running one is stopped next."""
        self.lease_token = None

    def fresh_on(self, image: ImageRoot) -> bool:
        """Whether the slot's root is a root of ``image`` (the host's current entry for its
        reference: a moved name is another entry) that nothing touched since its reset: no call,
        no verification phase, no code of a lease."""
        return (self.ws.image is image and self.state == "leased" and self.calls == 0 and not self._agent_ran
                and not self.sealed)

    def mark_sealed(self) -> None:
        """The verification phase begins: new calls are refused at once (see ``seal``)."""
        self.sealed = True

    def count_call(self) -> None:
        self.calls += 1

    # -- layout ----------------------------------------------------------------------------
    async def prepare(self) -> None:
        """First workspace of a starting host (whatever an earlier host left goes to the trash)."""
        def clear() -> None:
            self.dir.mkdir(parents=True, exist_ok=True)
            os.chmod(self.dir, 0o711)
            for d in (self.paths.workspace, self.paths.run_dir, self.ws.ov, *self.ws.scratch_dirs()):
                if d.exists() or d.is_symlink():
                    self.ws.discard(d)

        await asyncio.to_thread(clear)
        await self.ws.build(None)

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
            template=None if self.ws.template is None else self.ws.template.id, workspace=self.ws.ws_kind,
            image=None if self.ws.image is None else self.ws.image.reference,
            sealed=self.sealed,
        )

    # -- sandboxes -------------------------------------------------------------------------
    def _argv(self, extra: dict[str, Any], script: str, verifier: bool = False) -> tuple[list[str], bytes | None]:
        """The sandbox's command line, and the first frame its program reads (slotd's configuration)."""
        if self.ws.image is not None:
            if verifier:  # an image slot's runner has a root of host files: _start_image_verifier
                raise RuntimeError("an image slot's verifier is never started on the slot's root")
            return self._image_argv(self.ws.image, extra, script)
        sup_cfg = {"limits": self.cfg.limits.rlimits(), "env": VERIFIER_ENV if verifier else SANDBOX_ENV, **extra}
        if self.cfg.unsafe_no_isolation:
            sup_cfg.update(workspace=str(self.paths.workspace), run_dir=str(self.paths.run_dir),
                           isolated=False, env={**SANDBOX_ENV, "HOME": str(self.paths.workspace)})
            return [self.cfg.python, "-I", "-S", str(self.paths.lib_dir / entry(self.paths.lib_dir, script)),
                    json.dumps(sup_cfg)], None
        paths = self.paths
        if self.ws.scratch:
            # every sandbox of the slot, the verifier's included, binds the slot's capped /tmp and
            # /dev/shm (bubblewrap's own tmpfs caps the size only: empty files are uncounted kernel
            # memory); verify() renews them first, so nothing the agent left there reaches it
            tmp, shm = self.ws.scratch_dirs()
            paths = dataclasses.replace(paths, tmp=tmp, shm=shm)
        argv = bwrap_argv(self.cfg.bwrap, paths, self.cfg.limits, network=self.network and not verifier,
                          seccomp_fd=-1, private_net=self.private_net)
        argv[argv.index("-1")] = "{seccomp_fd}"
        if verifier:
            argv = verifier_bwrap(argv, self.paths)
        python = [self.cfg.python, "-I", "-S", f"{LIB_DIR}/{entry(paths.lib_dir, script)}", json.dumps(sup_cfg)]
        return self._supervisor(argv, LIB_DIR, python, sup_cfg, script, verifier or bool(extra))

    def _supervisor(self, argv: list[str], lib_dir: str, python: list[str], sup_cfg: dict[str, Any], script: str,
                    python_only: bool) -> tuple[list[str], bytes | None]:
        """The sandbox's program: slotd where the host has it and the sandbox is a plain supervisor's
        (it serves the calls, and the Python supervisor, its command given, only once asked for more
        than a command: docs/native-supervisor.md) or the terminal's program starter, else
        ``python``. A sealed or verifying sandbox, the python_session driver and the verifier stay
        Python throughout."""
        if self.slotd is None or (script != "exec_program.py" and (script != "supervisor.py" or python_only
                                                                    or not self.choice.native())):
            return [*argv, *python], None
        program = f"{lib_dir}/{slotd_build.SLOTD}"
        if self.slotd != self.paths.lib_dir / slotd_build.SLOTD:
            # bound in read-only from its own exec mount onto the lib dir's placeholder (the lib dir's
            # mount is noexec): after the lib dir's own mount, before the remounts read-only
            at = argv.index("--remount-ro")
            argv = [*argv[:at], "--ro-bind", str(self.slotd), program, *argv[at:]]
        if script == "exec_program.py":  # the terminal's tmux, started without a Python in between
            exec_cfg = {**sup_cfg, "workspace": sup_cfg.get("cwd") or ""}
            exec_conf = slotd_config.from_supervisor(exec_cfg, {}, list(sup_cfg["exec"]), mode="exec")
            return [*argv, program], exec_conf.frame()
        env = sup_cfg["env"]
        warm = {kind: boot("{go}", "{src}", env) for kind, boot in WARM_KINDS.items()}  # type: ignore[arg-type]
        slotd_cfg = {**sup_cfg, "workspace": sup_cfg.get("cwd") or sup_cfg.get("workspace", "/workspace"),
                     "files_workspace": sup_cfg.get("workspace", "/workspace")}
        return [*argv, program], slotd_config.from_supervisor(slotd_cfg, warm, python).frame()

    def _image_argv(self, image: ImageRoot, extra: dict[str, Any], script: str) -> tuple[list[str], bytes | None]:
        """A sandbox on the slot's image root (docs/task-images.md): the image's environment and
        WorkingDir; the helpers run on the host's interpreter (``host_program``), whatever the image
        holds, except the python_session driver, which runs the agent's code and so is the image's
        own ``python3``."""
        env = image.env()
        sup_cfg = {"limits": self.cfg.limits.rlimits(), "env": env, "workspace": "/", "cwd": image.working_dir,
                   "run_dir": IMAGE_RUN_DIR, "tmux": list(host_program(TMUX)), "terminal_shell": ["bash"], **extra}
        paths = self.paths
        if self.ws.scratch:
            tmp, shm = self.ws.scratch_dirs()
            paths = dataclasses.replace(paths, tmp=tmp, shm=shm)
        # The image's Env is for the programs the helpers start (sup_cfg["env"]), as docker run gives
        # it; the helpers themselves (the host's interpreter, slotd, tmux's starter) start with a clean
        # one: no LD_PRELOAD, LD_AUDIT, GCONV_PATH, LOCPATH or PYTHON* of the image reaches them. The
        # python_session driver is the image's own python3 running the agent's code: it gets the Env.
        argv = image_bwrap_argv(self.cfg.bwrap, self.ws.root, paths, self.cfg.limits,
                                network=self.network, seccomp_fd=-1, private_net=self.private_net,
                                env=env if script == "session.py" else HELPER_ENV, uid=image.user_ids())
        argv[argv.index("-1")] = "{seccomp_fd}"
        if script == "session.py":  # the image's interpreter: the host's bytecode is not for it
            return [*argv, "python3", "-I", "-S", f"{IMAGE_LIB_DIR}/{script}", json.dumps(sup_cfg)], None
        python = [*host_program(self.cfg.python), "-I", "-S", f"{IMAGE_LIB_DIR}/{entry(paths.lib_dir, script)}",
                  json.dumps(sup_cfg)]
        return self._supervisor(argv, IMAGE_LIB_DIR, python, sup_cfg, script, bool(extra))

    async def _start(self, extra: dict[str, Any], label: str, protocol: bool = True,
                     script: str = "supervisor.py", verifier: bool = False) -> SandboxProcess:
        argv, first_frame = self._argv(extra, script, verifier)
        return await self._launch(argv, first_frame, label, protocol=protocol, network=not verifier,
                                  seccomp_path=self.seccomp_path)

    async def _start_image_verifier(self, image: ImageRoot, root: Path) -> SandboxProcess:
        """The verification runner of an image slot (``verification.image_verifier_bwrap``): its own
        root of host files, ``root`` (the slot's root, or a fresh root of the same image: the
        runner does not care which) at ``CHECKED_ROOT``, where the programs it starts run with the
        image's ``Env`` and ``root`` as ``/``. Its own process gets a clean environment."""
        paths = self.paths
        if self.ws.scratch:
            tmp, shm = self.ws.scratch_dirs()
            paths = dataclasses.replace(paths, tmp=tmp, shm=shm)
        argv = image_verifier_bwrap(self.cfg.bwrap, root, paths, self.cfg.limits, uid=image.user_ids())
        cfg = {"limits": self.cfg.limits.rlimits(), "env": VERIFIER_ENV, "root": CHECKED_ROOT,
               "child_env": image.env()}
        python = [self.cfg.python, "-I", "-S", f"{LIB_DIR}/{entry(paths.lib_dir, 'verifier.py')}", json.dumps(cfg)]
        seccomp_path = None if self.seccomp_path is None else str(verifier_filter_path(self.seccomp_path))
        return await self._launch([*argv, *python], None, f"slot {self.index} verifier", protocol=True,
                                  network=False, seccomp_path=seccomp_path)

    async def _launch(self, argv: list[str], first_frame: bytes | None, label: str, *, protocol: bool,
                      network: bool, seccomp_path: str | None) -> SandboxProcess:
        """Start a sandbox's command line: in the workspace mount namespace where the slot's mounts
        are, its OOM score raised, in the slot's cgroup, as the slot's uid."""
        uid = self.uid
        if self.ws.ws_kind in ("overlay", "image") or self.ws.capped or self.ws.scratch:
            # The fork's overlay and the capped tmpfs mounts exist only in the workspace mount
            # namespace: start bwrap in it (nsenter drops to the slot's uid itself on a root host).
            argv, uid = [*self.ws.ns().launcher(self.uid), *argv], None
        # The OOM score is raised before bwrap starts (raising needs no privilege); /proc is
        # read-only inside, so nothing in the slot can lower it and make the host the OOM killer's
        # victim. With a cgroup, the placing shell writes it (no choom: one program fewer per start).
        if HAVE_CHOOM and self.cgroup is None:
            argv = [CHOOM, "-n", str(SANDBOX_OOM_SCORE_ADJ), "--", *argv]
        if self.cgroup is not None:
            if uid is not None:
                # Placed by root, then the uid drops: a slot uid could not move itself out of the
                # host's cgroup (v2 wants write access to the common ancestor), nor should it.
                argv, uid = [SETPRIV, f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--", *argv], None
            argv = [*self.cgroup.launcher(SANDBOX_OOM_SCORE_ADJ), *argv]
        return await SandboxProcess.start(
            argv, uid=uid, protocol=protocol,
            seccomp_path=None if self.cfg.unsafe_no_isolation else seccomp_path, label=label,
            network=(SlirpHandshake.create(self.cfg.egress, self.cfg.python) if self.network and self.private_net
                     and network
                     and not self.cfg.unsafe_no_isolation else None),
            network_uid=self.uid,
            echoes_seq=protocol,  # both in-slot programs serve through inslot.serve
            first_frame=first_frame,
        )

    async def ensure_sandbox(self) -> SandboxProcess:
        if self.sandbox is None or not self.sandbox.alive:
            # sealed: a supervisor that reads the workspace for the host and never starts anything
            try:
                self.sandbox = await self._start({"sealed": True} if self.sealed else {}, f"slot {self.index}")
            except SandboxDied as exc:
                raise self._start_failure(exc) from exc
            self._agent_sandbox = not self.sealed  # its requests are the agent's: they count for the choice
        return self.sandbox

    def _start_failure(self, exc: SandboxDied) -> Exception:
        """Whose failure a sandbox that could not start is. On an image root where the lease's code
        has run, the agent could have rewritten every file a start reads (the loader's preload list,
        the libraries the Python supervisor loads): the agent's outcome, never an infrastructure
        retry. Otherwise nothing of the lease's code was on the way: the host's."""
        if self.ws.image is None or not self._agent_ran:
            return exc
        return SandboxRestarted(f"the slot's sandbox could not start again on the root its code changed ({exc}); "
                                "workspace files are kept")

    async def ensure_terminal(self) -> None:
        sock = self.ws.view(self.paths.run_dir) / "tmux.sock"
        if self.terminal is not None and self.terminal.alive:
            if _is_socket(sock):
                return
            # the slot put something else where the terminal's socket was: a new terminal
            await self.terminal.kill()
            self.terminal = None
        run_dir = RUN_DIR if not self.cfg.unsafe_no_isolation else str(self.paths.run_dir)
        lib_dir = LIB_DIR if not self.cfg.unsafe_no_isolation else str(self.paths.lib_dir)
        tmux: list[str] = ["tmux"]
        extra: dict[str, Any] = {}
        if self.ws.image is not None:  # the host's tmux (an image rarely has one), on the image's bash
            run_dir, lib_dir, tmux = IMAGE_RUN_DIR, IMAGE_LIB_DIR, list(host_program(TMUX))
            extra["env"] = {**self.ws.image.env(), "SHELL": "/bin/bash", "TERM": SANDBOX_ENV["TERM"],
                            "PS1": SANDBOX_ENV["PS1"],
                            "TERMINFO_DIRS": f"{IMAGE_HOST_USR}/share/terminfo:/lib/terminfo"}
        if os.path.lexists(sock):  # noqa: ASYNC240 - one lstat; whatever the slot left there goes
            await asyncio.to_thread(remove_tree, sock)
        exec_argv = [*tmux, "-D", "-S", f"{run_dir}/tmux.sock", "-f", f"{lib_dir}/tmux.conf"]
        self.terminal = await self._start({"exec": exec_argv, **extra}, f"slot {self.index} terminal",
                                          protocol=False, script="exec_program.py")
        # generous: a dead tmux is noticed at once (``alive``), so the deadline only bounds a slow
        # start, and on a starved machine tmux took over 5 s (the soak's "did not start" errors)
        deadline = time.monotonic() + 30.0
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
            try:
                self.session = await self._start({}, f"slot {self.index} python session", script="session.py")
            except SandboxDied as exc:
                raise self._start_failure(exc) from exc
        self._agent_ran = True
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
        self._agent_ran = self._agent_ran or not self.sealed
        try:
            frame = await sandbox.request(payload, timeout)
        except SandboxDied as exc:
            if self.sandbox is not sandbox:
                raise  # stopped from outside (a reset, a release, the host stopping): not the slot's doing
            raise SandboxLost(str(exc)) from exc
        if payload.get("op") == "terminal" and frame.get("ok"):
            self.term_offset = int(frame["result"]["offset"])
        return frame

    async def stop_sandboxes(self) -> None:
        await self.kill_sandboxes()

    def kill_sandboxes(self) -> asyncio.Future[list[None]]:
        """Kill every sandbox of the slot (side by side) and reap them; the slot has none from now
        on. A reset starts it before it waits for the slot's lock and renews the workspace while
        the kernel tears the sandboxes down (see ``reset``)."""
        # The session goes too: the next lease must never see this trajectory's variables (the
        # supervisor's kill(-1) only reaches its own sandbox's PID namespace).
        procs = [p for p in (self.sandbox, self.terminal, self.session) if p is not None]
        if self.sandbox is not None and self._agent_sandbox and self.sandbox.served:
            # what this lease's calls needed picks the supervisor of the host's next sandboxes
            self.choice.record(self.sandbox.needed_python)
        self.sandbox = self.terminal = self.session = None
        for proc in procs:
            proc.abandon()  # the signal now, not when the task reaping it first runs
        return asyncio.gather(*(proc.kill() for proc in procs))

    # -- reset ---------------------------------------------------------------------------
    async def reset(self, template: Template | None = None, image: ImageRoot | None = None,
                    stopping: asyncio.Future[list[None]] | None = None) -> tuple[bool, str]:
        """Kill everything of the lease, rebuild the workspace (empty, or a fresh fork of
        ``template``) and check the result before the slot can be leased again. ``stopping``:
        the slot's sandboxes, killed already (``kill_sandboxes``) and being reaped."""
        self.state = "resetting"
        try:
            if stopping is None:
                stopping = self.kill_sandboxes()
            # Ending the lease's processes (the sandboxes' teardown, the cgroup, the uid sweep) and
            # renewing the workspace run side by side: the slot is not leasable until both are
            # done, and the check below comes after both. A killed sandbox cannot reach the fresh
            # mounts (its mount namespace is a private copy made when it started: nothing mounted
            # in the helper's namespace since propagates into it), and whatever a survivor of the
            # sweep did quarantines the slot all the same.
            outcomes = await asyncio.gather(self._end_processes(stopping), self.ws.renew(template, image),
                                            return_exceptions=True)
            for outcome in outcomes:
                if isinstance(outcome, BaseException):
                    raise outcome
            problem = self.ws.verify()
            if problem:
                raise RuntimeError(problem)
        except Exception as exc:
            # Even a surprise (a bug, a malformed helper answer) leaves the workspace in an unknown
            # state, and a slot left "resetting" would be neither leasable nor reported. Quarantine it.
            self.quarantine(f"reset failed: {self._failure(exc, 'during reset')}")
            return False, self.detail
        self.generation += 1
        self._agent_ran = False
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
        return self.ws.processes_checked()

    async def verify(self, req: VerifyRequest) -> VerifyResult:
        """Run a verifier program in a fresh sandbox of the sealed slot (see docs/verification.md)."""
        separation = await self.seal()
        t0 = time.monotonic()
        result = VerifyResult(slot=self.index, ok=False, separation=separation)
        workspace = str(self.paths.workspace) if self.cfg.unsafe_no_isolation else WORKSPACE
        image_fields: dict[str, Any] = {}
        if self.ws.image is not None:
            # the runner's paths: the checked root (the slot's, or a fresh one) is at CHECKED_ROOT of
            # the runner's own (host-made) root
            workspace = CHECKED_ROOT + self.ws.image.working_dir.rstrip("/")
            image_fields = {"restore": req.restore, "pristine": CHECKED_ROOT + IMAGE_PRISTINE, "cwd": workspace}
        elif req.restore or req.fresh_root is not None:
            result.error = ErrorInfo(code="invalid_request", status=VERIFIER_FAILED,
                                     message="restore and fresh_root need a slot whose root is a task image")
            return result
        proc: SandboxProcess | None = None
        fresh = VerifyRoot(self.ws) if req.fresh_root is not None else None
        try:
            if self.ws.scratch:
                await self.ws.renew_scratch()
            if fresh is not None and req.fresh_root is not None:
                try:
                    self._verify_root = await fresh.build(req.fresh_root)
                except (OSError, ValueError, WorkspaceError) as exc:
                    if isinstance(exc, WorkspaceError) and not str(exc).startswith("mount helper: "):
                        raise  # the helper itself is gone or silent: the host's failure, retried
                    # the helper refused the agent's tree (a full cap, a deep nest): the agent's outcome
                    result.error = ErrorInfo(code="fresh_root_failed", status=VERIFIER_FAILED,
                                             message=f"the verification root could not be built: {exc}"[:500])
                    return result
            if self.ws.image is not None:
                proc = await self._start_image_verifier(self.ws.image, self._verify_root or self.ws.root)
            else:
                proc = await self._start({}, f"slot {self.index} verifier", script="verifier.py", verifier=True)
            frame = await proc.request({"op": "verify", "program": req.program, "secrets": req.secrets,
                                        "args": req.args, "timeout": req.timeout_s, "workspace": workspace,
                                        **image_fields},
                                       req.timeout_s + VERIFY_GRACE_S)
        except SandboxDied as exc:
            late = time.monotonic() - t0 >= req.timeout_s
            result.error = ErrorInfo(code="timed_out" if late else "verifier_died",
                                     message=str(exc), status=VERIFIER_FAILED)
            return result
        finally:
            if proc is not None:
                await proc.kill()
            await self._kill_all()  # nothing the program started outlives it
            if fresh is not None:
                self._verify_root = None
                await fresh.drop()
                result.fresh_root = fresh.summary or None
            result.duration_ms = round((time.monotonic() - t0) * 1000, 3)
        answer = frame.get("result") if frame.get("ok") else None
        if not isinstance(answer, dict):
            result.error = ErrorInfo(code="verifier_died", message=f"malformed answer: {frame!r:.300}",
                                     status=VERIFIER_FAILED)
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
                                     status=VERIFIER_FAILED)
        return result

    async def _end_processes(self, stopping: asyncio.Future[list[None]]) -> None:
        await stopping
        await self.stop_sandboxes()  # none started since (the reset holds the slot's lock): cheap
        await self._kill_all()

    async def _kill_all(self) -> None:
        await self._kill_cgroup()
        await self._kill_uid()

    async def _kill_cgroup(self) -> None:
        if self.cgroup is None:
            return
        # Killed sandboxes were reaped by stop_sandboxes: the cgroup is normally empty already,
        # which one read of cgroup.procs tells (nothing can enter it but a fork from inside).
        if self.cgroup.pids():
            left = await self.cgroup.empty()
            if left:
                raise RuntimeError(f"processes survived in the slot's cgroup {self.cgroup.main}: {left}")
        drift = self.cgroup.drift()  # the cgroup outlives the lease: its caps must too
        if drift:
            raise RuntimeError(drift)

    async def _kill_uid(self) -> None:
        if self.uid is not None:
            if self.killer is not None:
                survivors = await self.killer.kill(self.uid)
            else:
                survivors = await asyncio.to_thread(_kill_uid, self.uid)
            if survivors:
                raise RuntimeError(f"processes of uid {self.uid} survived: {survivors}")

    # -- templates -------------------------------------------------------------------------
    async def snapshot(self, name: str) -> Template:
        """Make a template of this (leased) slot's workspace; the slot continues as a fresh
        fork of it under the same lease. Every process of the slot is stopped first: a
        snapshot of a tree that is still being written is not a snapshot."""
        mgr = self.workspaces
        assert mgr is not None
        await self.stop_sandboxes()
        await self._kill_all()
        kind, ws = self.ws.ws_kind, self.paths.workspace
        source = str(self.ws.view(ws)) if kind == "overlay" or self.ws.capped else None

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
            await self.ws.drop()
            await self.ws.build(template)
            problem = self.ws.verify()
            if problem:
                raise RuntimeError(problem)
        except Exception as exc:  # even a surprise: the slot's workspace is gone all the same, never leave it leased
            self.quarantine(f"re-fork after snapshot failed: {self._failure(exc, 're-forking after a snapshot')}")
            raise WorkspaceError(self.detail) from exc
        return template

    async def derive_image(self, images: HostImages) -> ImageRoot:
        """A new image of this (leased, image-rooted) slot's root as it is now (see
        ``HostImages.derive``); the slot continues as a fresh root of it under the same lease.
        Every process of the slot is stopped first, as for a snapshot."""
        parent = self.ws.image
        if parent is None:
            raise ImageRejected("only a slot whose root is an image can be made an image")
        await self.stop_sandboxes()
        await self._kill_all()
        upper = self.ws.view(self.ws.ov / "upper")
        derived = await asyncio.to_thread(images.derive, parent, upper, self.uid, IMAGE_MOUNT_POINTS)
        try:
            await self.ws.drop()
            await self.ws.build(None, derived)
            problem = self.ws.verify()
            if problem:
                raise RuntimeError(problem)
        except Exception as exc:  # the slot's root is gone all the same: never leave it leased
            self.quarantine(f"re-rooting after a derived image failed: {self._failure(exc, 're-rooting')}")
            raise WorkspaceError(self.detail) from exc
        return derived

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
