"""``python -m atropos.sandbox``: run one sandbox host.

The token comes from one line on stdin (``--token-stdin``: how the local, Ray and Docker backends pass it,
``atropos/sandbox/contract/launch.py``), a file only we can read (``--token-file``: how a Nomad task gets
it, rendered into its secrets directory; read once, then removed) or ``ATROPOS_SANDBOX_TOKEN`` (a
container run by hand); never a flag: argv is visible to every process on the machine. The host makes
itself non-dumpable first thing: no process of its user can read its environ or memory.
Once started, the host prints one JSON line on stdout:
``{"event": "ready", "port": N, ...}`` so a parent can find a port picked with ``--port 0``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ctypes
import errno
import functools
import json
import os
import signal
import socket
import stat
import sys
import threading
import time
from pathlib import Path

import uvicorn

from atropos import memstats
from atropos.asgi import listening_socket
from atropos.errors import AtroposSandboxError, ConfigError
from atropos.logs import configure
from atropos.request_deadline import server_config
from atropos.sandbox.contract import egress
from atropos.sandbox.contract.hostdirs import kill_processes_naming
from atropos.sandbox.contract.launch import HOST_TOKEN_ENV as TOKEN_ENV
from atropos.sandbox.contract.launch import UNDUMPABLE_LINE, SlotLimits
from atropos.sandbox.host.config import HostConfig, Limits, host_settings
from atropos.sandbox.host.isolation.sandbox_process import SandboxProcess
from atropos.sandbox.host.sandbox_host import SandboxHost
from atropos.sandbox.host.server import create_app, wrap
from atropos.sandbox.inslot.inslot_common import make_undumpable

SHUTDOWN_GRACE_S = 5.0  # after SIGTERM: then whatever still runs of this host is killed
TOKEN_FILE_MAX = 4096  # a token is one short line; a bigger file is not a token file


def parse_args(argv: list[str] | None = None) -> tuple[HostConfig, argparse.Namespace]:
    defaults = HostConfig()
    p = argparse.ArgumentParser(prog="python -m atropos.sandbox", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--host", default=defaults.host, help="address to listen on (default %(default)s)")
    p.add_argument("--port", type=int, default=defaults.port, help="port; 0 picks a free one")
    p.add_argument("--slots", type=int, default=defaults.slots, help="number of slots (default %(default)s)")
    p.add_argument("--data-dir", type=Path, default=defaults.data_dir, help="where workspaces live")
    p.add_argument("--image-store", type=Path, default=None,
                   help="task images' layer store (default: images/ beside the data dir, shared by the hosts of "
                        "one machine; docs/task-images.md)")
    p.add_argument("--image-store-bytes", type=int, default=defaults.image_store_bytes,
                   help="disk budget of the image store: least recently used images no host is using are evicted")
    p.add_argument("--image-layer-entries", type=int, default=defaults.image_layer_entries,
                   help="most members one image layer may hold; a layer with more is refused")
    token_source = p.add_mutually_exclusive_group()
    token_source.add_argument("--token-file", type=Path, help="file holding the bearer token: ours, mode 0400 or "
                              "0600; read at start, then removed")
    token_source.add_argument("--token-stdin", action="store_true",
                              help="read the bearer token as the first line of stdin (then stdin is /dev/null)")
    p.add_argument("--uid-base", type=int, help="first per-slot uid when running as root")
    for name, field in SlotLimits.model_fields.items():  # one flag per slot limit, as declared there
        number = int if field.annotation is int else float
        p.add_argument(SlotLimits.flag(name), dest=f"limit_{name}", type=number, default=field.default,
                       help=f"{field.description} (default %(default)s)")
    p.add_argument("--nproc", type=int, default=Limits().nproc, help="processes per slot")
    p.add_argument("--memory", type=int, default=Limits().address_space_bytes, help="address space per process (bytes)")
    p.add_argument("--workspace-inodes", type=int, default=Limits().workspace_inodes,
                   help="files a slot can create (default %(default)s)")
    p.add_argument("--tmp-inodes", type=int, default=Limits().tmp_inodes,
                   help="files a slot can create in /tmp (default %(default)s)")
    p.add_argument("--shm-inodes", type=int, default=Limits().shm_inodes,
                   help="files a slot can create in /dev/shm (default %(default)s)")
    p.add_argument("--cgroup-dir", type=Path, help="writable cgroup directory for the slot cgroups "
                   "(default: a subtree of the host's own cgroup)")
    p.add_argument("--unsafe-no-cgroups", action="store_true",
                   help="DEVELOPMENT ONLY: no per-slot memory, process or CPU caps")
    p.add_argument("--native-supervisor", choices=("auto", "always", "never"), default="auto",
                   help="slotd, the compiled supervisor (docs/native-supervisor.md): auto (default: unless most "
                        "recent leases needed the Python one), always, never")
    p.add_argument("--unsafe-no-isolation", action="store_true",
                   help="DEVELOPMENT ONLY: run slots without bubblewrap")
    p.add_argument("--no-prewarm", action="store_true",
                   help="start slot sandboxes on first use, or when asked (POST /v1/prewarm): a pool starts its "
                        "hosts so and asks once its fleet is up")
    p.add_argument("--parent-pid", type=int, help="exit when this process (the pool) dies")
    p.add_argument("--network-isolation", choices=("auto", "private", "shared"), default="auto",
                   help="network slots: private namespace behind slirp4netns, or the host's (see HostConfig)")
    p.add_argument("--egress-allow", action="append", default=[], metavar="CIDR",
                   help="network slots may reach this IPv4 range despite the deny list (repeatable)")
    p.add_argument("--egress-deny", action="append", default=[], metavar="CIDR",
                   help="network slots cannot reach this IPv4 range (repeatable; added to the defaults)")
    p.add_argument("--egress-no-default-deny", action="store_true",
                   help="drop the default deny list (link-local, private, CGNAT, multicast, reserved ranges)")
    p.add_argument("--egress-allow-host-addresses", action="store_true",
                   help="network slots may reach this host's own non-loopback addresses")
    p.add_argument("--egress-machine-address", action="append", default=[], metavar="ADDR",
                   help="an address of the machine this host runs on (a container's engine machine), denied "
                        "like the host's own (repeatable)")
    p.add_argument("--request-read-timeout", type=float, default=defaults.request_read_timeout_s,
                   help="seconds a request's head and body may take to arrive (default %(default)s)")
    p.add_argument("--workspace-mode", choices=("auto", "overlay", "copy"), default="auto",
                   help="template forks: overlayfs copy-on-write, or full copies (default %(default)s)")
    p.add_argument("--template-source-dir", type=Path, action="append", default=[],
                   help="host directory templates may be made from (repeatable; default: none)")
    p.add_argument("--log-level", default="INFO", help="log level (default %(default)s)")
    p.add_argument("--log-json", action="store_true", help="one JSON object per log line (stderr)")
    args = p.parse_args(argv)
    token = os.environ.pop(TOKEN_ENV, "")  # scrub: nothing we start should inherit it
    if args.token_stdin:
        token = _read_token_from_stdin()
    elif args.token_file:
        try:
            token = read_token_file(args.token_file)
        except ConfigError as exc:
            p.error(str(exc))
    if not token:
        p.error(f"a token is required: --token-stdin, ${TOKEN_ENV} or --token-file")
    try:
        policy = egress.EgressSettings(
            deny=tuple(egress.parse_networks(args.egress_deny)), allow=tuple(egress.parse_networks(args.egress_allow)),
            machine_addresses=tuple(egress.parse_addresses(args.egress_machine_address)),
            default_deny=not args.egress_no_default_deny, deny_host_addresses=not args.egress_allow_host_addresses,
        ).policy()
        slot = SlotLimits(**{name: getattr(args, f"limit_{name}") for name in SlotLimits.model_fields})
    except ValueError as exc:  # pydantic's ValidationError is one: the flag's bound, said as usage
        p.error(str(exc))
    cfg = HostConfig(
        slots=args.slots, data_dir=args.data_dir, image_store=args.image_store,
        image_store_bytes=args.image_store_bytes, image_layer_entries=args.image_layer_entries,
        host=args.host, port=args.port,
        token=token,
        uid_base=args.uid_base, unsafe_no_isolation=args.unsafe_no_isolation, **host_settings(slot),
        native_supervisor=args.native_supervisor,
        limits=Limits(nproc=args.nproc, address_space_bytes=args.memory, workspace_bytes=slot.workspace_bytes,
                      workspace_inodes=args.workspace_inodes, tmp_inodes=args.tmp_inodes,
                      shm_inodes=args.shm_inodes),
        workspace_mode=args.workspace_mode, network_isolation=args.network_isolation,
        template_source_dirs=args.template_source_dir, egress=policy,
        request_read_timeout_s=args.request_read_timeout,
        cgroup_dir=args.cgroup_dir, unsafe_no_cgroups=args.unsafe_no_cgroups,
    )
    return cfg, args


def _read_token_from_stdin() -> str:
    """The first line of stdin; then stdin becomes /dev/null, so nothing started later reads the
    pipe (its writer closed it: nothing more would come anyway)."""
    line = b""
    while not line.endswith(b"\n"):
        chunk = os.read(0, 4096)
        if not chunk:
            break
        line += chunk
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    return line.decode(errors="replace").strip()


def read_token_file(path: Path) -> str:
    """The token in ``path``, then the file removed (when its directory lets us), so code that later
    reaches this filesystem finds nothing. Refused unless it is a regular file of ours that no
    group or other user can read: a token others could read is no secret (Nomad renders it with
    ``perms = "0400"`` and the task's uid, nomad/sandbox.hcl)."""
    try:
        # O_NOFOLLOW: a link planted in its place is refused; O_NONBLOCK: a FIFO cannot stall the start
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        why = "a symbolic link" if exc.errno == errno.ELOOP else f"cannot open it ({exc.strerror})"
        raise ConfigError(f"--token-file {path}: {why}") from None
    try:
        st = os.fstat(fd)  # what we read, not what the path names a moment later
        if not stat.S_ISREG(st.st_mode):
            raise ConfigError(f"--token-file {path}: not a regular file")
        if st.st_uid != os.geteuid():
            raise ConfigError(f"--token-file {path}: owned by uid {st.st_uid}, not by this host's uid "
                                   f"{os.geteuid()}; a token file must be the host's own (Nomad: the template's uid)")
        if st.st_mode & 0o077:
            raise ConfigError(f"--token-file {path}: mode {stat.S_IMODE(st.st_mode):04o} gives group or others "
                                   "access; a token file must be 0400 or 0600 (Nomad: the template's perms)")
        data = os.read(fd, TOKEN_FILE_MAX + 1)
    finally:
        os.close(fd)
    token = data.decode(errors="replace").strip()
    if not token or len(data) > TOKEN_FILE_MAX:
        raise ConfigError(f"--token-file {path}: " + ("empty" if not token else f"over {TOKEN_FILE_MAX} bytes"))
    # Only the file we read: never one put in its place since. A directory that does not let us
    # (read-only, not ours) keeps it; it stays readable by our uid alone.
    with contextlib.suppress(OSError):
        now = os.stat(path, follow_symlinks=False)
        if (now.st_dev, now.st_ino) == (st.st_dev, st.st_ino):
            os.unlink(path)
    return token


def _die_with_parent(parent: int) -> None:
    PR_SET_PDEATHSIG = 1
    ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != parent:  # the parent died before the line above took effect
        sys.exit(0)


async def serve(cfg: HostConfig, prewarm: bool = True) -> None:
    host = SandboxHost(cfg)
    family = socket.AF_INET6 if ":" in cfg.host else socket.AF_INET
    # a busy port raises OSError (EADDRINUSE): LocalBackend reads it in this host's stderr
    sock = listening_socket(family, (cfg.host, cfg.port), 1024)
    await host.start()
    # in the background: the host answers while its slots warm up. A pool starts its hosts with
    # --no-prewarm and asks for it (POST /v1/prewarm) once its whole fleet is up.
    if prewarm:
        host.prewarm_in_background()
    app = create_app(host, manage_lifecycle=False)
    server = uvicorn.Server(server_config(
        wrap(app, host), cfg.request_read_timeout_s, loop="asyncio", access_log=False, log_level="warning",
        timeout_keep_alive=120, lifespan="off",
    ))
    port = sock.getsockname()[1]
    print(json.dumps({"event": "ready", "port": port, "pid": os.getpid(), "slots": cfg.slots,
                      "isolation": "none" if cfg.unsafe_no_isolation else "bubblewrap",
                      "slot_cgroups": f"v{host.cgroups.version}" if host.cgroups is not None else "none"}), flush=True)
    trim = asyncio.create_task(memstats.trim_periodically())
    try:
        await server.serve(sockets=[sock])
    finally:
        trim.cancel()
        try:
            await host.stop()
        finally:
            SandboxProcess.kill_all()  # sandboxes whose start was cancelled by the shutdown


def main(argv: list[str] | None = None) -> None:
    # before the token arrives: no process of our user (every task Ray runs on this node, the
    # slots' users in a container) may read our memory, fds or environ (root still can)
    make_undumpable()
    # before any thread exists (arenas are made per thread on first contention): see memstats
    memstats.set_arena_max(memstats.HOST_ARENA_MAX)
    if "--token-stdin" in (sys.argv[1:] if argv is None else argv):
        # ...and say so: the launcher writes the token on our stdin only after this line
        # (start_host_process), so no same-user process can take the pipe (pidfd_getfd) while we
        # were still dumpable
        sys.stdout.write(UNDUMPABLE_LINE)
        sys.stdout.flush()
    cfg, args = parse_args(argv)
    # the same redacting handler as the pool side: a host's stderr lands in the pool's logs
    configure(level=args.log_level, json_lines=args.log_json)
    # SIGTERM (a backend's stop, the pool's death) must run host.stop(): uvicorn handles it while it
    # serves, then re-raises it with this handler; before that (prewarm) it lands here directly.
    signal.signal(signal.SIGTERM, functools.partial(_exit_on_sigterm, cfg.data_dir))
    if args.parent_pid:
        _die_with_parent(args.parent_pid)
    try:
        asyncio.run(serve(cfg, prewarm=not args.no_prewarm))
    except AtroposSandboxError as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)
    finally:
        SandboxProcess.kill_all()
        kill_processes_naming(cfg.data_dir)


def _exit_on_sigterm(data_dir: Path, signum: int, frame: object) -> None:
    # A sandbox whose start the shutdown cancels is killed by asyncio's own cleanup, which kills
    # only bwrap; a child bwrap had not released yet then blocks for good, holding the pipes that
    # cleanup waits for. Past a grace period, kill everything of this host and leave.
    threading.Thread(target=_last_resort, args=(data_dir,), daemon=True).start()
    raise SystemExit(128 + signum)


def _last_resort(data_dir: Path) -> None:
    time.sleep(SHUTDOWN_GRACE_S)
    SandboxProcess.kill_all()
    kill_processes_naming(data_dir)
    time.sleep(2.0)
    os._exit(1)


if __name__ == "__main__":
    main()
