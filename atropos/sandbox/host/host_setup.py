"""What a sandbox host checks and claims before it starts: bubblewrap works here, a private uid block
(root hosts), its own data dir, the slots' cgroups and network isolation. Fails closed, saying why."""

from __future__ import annotations

import fcntl
import logging
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

from atropos.errors import IsolationUnavailable
from atropos.sandbox.host.config import HostConfig
from atropos.sandbox.host.isolation.cgroups import CgroupUnavailable, SlotCgroups
from atropos.sandbox.host.isolation.network import private_network_available

log = logging.getLogger(__name__)


UID_LOCK_DIR = Path("/run/atropos-sandbox/uids")
UID_FIRST, UID_BLOCK, UID_BLOCKS = 200_000, 1024, 4096


def claim_uid_block(needed: int, wanted_base: int | None) -> tuple[int, int]:
    """Reserve a block of per-slot uids for this host's lifetime (an flock held until we exit).

    Two hosts sharing a uid would see, signal and reset each other's processes, so a host
    running as root never uses uids it has not locked.
    """
    if needed > UID_BLOCK:
        raise IsolationUnavailable(f"at most {UID_BLOCK - 2} slots per host when running as root")
    UID_LOCK_DIR.mkdir(parents=True, exist_ok=True)
    candidates = (
        [wanted_base] if wanted_base is not None
        else [UID_FIRST + UID_BLOCK * ((os.getpid() + i) % UID_BLOCKS) for i in range(UID_BLOCKS)]
    )
    for base in candidates:
        fd = os.open(UID_LOCK_DIR / f"{base}.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            continue
        return base, fd
    raise IsolationUnavailable(f"uid block {wanted_base} is in use by another host" if wanted_base
                               else "no free uid block for slot users")


def _write(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(data)
    os.chmod(tmp, 0o644)
    os.replace(tmp, path)


def resolve_network_isolation(cfg: HostConfig) -> bool:
    """True when network slots get a private namespace; refuses 'private' where it cannot work."""
    if cfg.unsafe_no_isolation or cfg.network_isolation == "shared":
        return False
    problem = private_network_available()
    if problem is None:
        return True
    if cfg.network_isolation == "private":
        raise IsolationUnavailable(f"--network-isolation private: {problem}")
    log.warning("slots leased with network will share this host's network namespace (its loopback "
                "services are reachable from them): %s", problem)
    return False


def setup_cgroups(cfg: HostConfig) -> SlotCgroups | None:
    """The slots' cgroups; refuses to start without them (the fail-closed rule of bubblewrap)
    unless told --unsafe-no-cgroups (or running without isolation at all)."""
    if cfg.unsafe_no_cgroups:
        log.warning("!!! UNSAFE: slots run WITHOUT per-slot cgroups: no memory, process or CPU cap for a slot "
                    "as a whole; one slot can take this machine's memory (tmpfs and memfd pages included) !!!")
        return None
    try:
        cgroups = SlotCgroups.setup(cfg.cgroup_dir)
    except CgroupUnavailable as exc:
        if cfg.unsafe_no_isolation:
            log.warning("no per-slot cgroups either: %s", exc)
            return None
        raise
    log.info("slot cgroups (v%d) under %s: memory %d bytes, %d pids, cpus %s per slot", cgroups.version,
             cgroups.where, cfg.slot_memory_bytes, cfg.slot_pids, cfg.slot_cpus or "equal share")
    lim = cfg.limits
    tmpfs = lim.workspace_bytes + lim.tmp_bytes + lim.shm_bytes
    if cfg.slot_memory_bytes < tmpfs + (256 << 20):
        # a slot that fills its tmpfs mounts then has too little left to start a sandbox until reset
        log.warning("--slot-memory-bytes %d leaves less than 256 MiB beside the slot's tmpfs mounts (workspace, "
                    "/tmp, /dev/shm: %d bytes), which count against it", cfg.slot_memory_bytes, tmpfs)
    return cgroups


def check_isolation(cfg: HostConfig) -> None:
    """Fail closed, with instructions, when bubblewrap cannot build our sandbox here."""
    install = ("install it (Debian/Ubuntu: apt-get install bubblewrap). For development only, "
               "--unsafe-no-isolation runs without any isolation.")
    if not Path(cfg.bwrap).exists():
        raise IsolationUnavailable(f"bubblewrap not found at {cfg.bwrap}: {install}")
    if not os.access(cfg.bwrap, os.X_OK) or not Path(cfg.bwrap).is_file():
        raise IsolationUnavailable(f"bubblewrap at {cfg.bwrap} is not an executable file: {install}")
    if not Path(cfg.python).exists():
        raise IsolationUnavailable(f"{cfg.python} not found: the sandbox needs a python3 in /usr")
    if shutil.which("tmux") is None:
        log.warning("tmux not found: the terminal tool will not work (apt-get install tmux)")
    ids: dict[str, Any] = {"user": 65534, "group": 65534, "extra_groups": []} if os.geteuid() == 0 else {}
    try:
        probe = subprocess.run(
            [cfg.bwrap, "--unshare-all", "--unshare-user", "--disable-userns", "--die-with-parent",
             "--ro-bind", "/usr", "/usr", "--symlink", "usr/bin", "/bin", "--symlink", "usr/lib", "/lib",
             "--symlink", "usr/lib64", "/lib64", "--proc", "/proc", "--dev", "/dev", "true"],
            env={}, capture_output=True, timeout=30, **ids,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise IsolationUnavailable(f"cannot run bubblewrap at {cfg.bwrap}: {exc}; {install}") from exc
    if probe.returncode != 0:
        raise IsolationUnavailable(
            "bubblewrap cannot create a sandbox here: "
            f"{probe.stderr.decode(errors='replace').strip()}. Unprivileged user namespaces must be allowed "
            "(sysctl kernel.unprivileged_userns_clone=1 / user.max_user_namespaces>0; on Ubuntu 24.04+ an "
            "AppArmor profile allowing userns for bwrap); inside Docker use the options in sandbox_image/README.md."
        )
