"""A background pool's files in the state dir (``pool-<id>.json``, token, settings, log), and whether
its process still runs."""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path

from pydantic import BaseModel, ValidationError

from atropos.cli.settings import state_dir
from atropos.errors import InfrastructureError


class PoolState(BaseModel):
    """``pool-<id>.json`` in the state dir: how to reach (and stop) a background pool."""

    pool_id: str
    pid: int
    url: str
    token_file: Path
    settings_file: Path | None = None
    log: Path


def pool_files(pool_id: str) -> dict[str, Path]:
    d = state_dir()
    return {"state": d / f"pool-{pool_id}.json", "token": d / f"pool-{pool_id}.token",
            "settings": d / f"pool-{pool_id}.settings.json", "log": d / f"pool-{pool_id}.log"}


def write_private(path: Path, text: str) -> None:
    """Create ``path`` as 0600 from the start (no window where another user could read it)."""
    path.unlink(missing_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)


def read_state(pool_id: str) -> PoolState | None:
    path = pool_files(pool_id)["state"]
    try:
        return PoolState.model_validate_json(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValidationError) as exc:
        raise InfrastructureError(f"the state file {path} is unreadable or corrupt ({exc.__class__.__name__}); "
                                  f"`atropos-sandbox pool down --pool-id {pool_id}` removes it") from None


def remove_files(pool_id: str, keep_log: bool = True) -> None:
    for name, path in pool_files(pool_id).items():
        if name != "log" or not keep_log:
            path.unlink(missing_ok=True)


def remove_host_logs(pool_id: str) -> int:
    """Remove the logs the local backend's hosts of this pool left (``<pool_id>-<pid>-<n>.log`` under
    its data root; the hosts of a running process keep theirs); how many went."""
    from atropos.backends.local import LocalBackendConfig
    root = LocalBackendConfig(pool_id=pool_id).data_root / pool_id
    removed = 0
    for log in root.glob(f"{pool_id}-*-*.log"):
        pid = log.name.removesuffix(".log").rsplit("-", 2)[-2]
        if pid.isdigit() and not _running(int(pid)):
            log.unlink(missing_ok=True)
            removed += 1
    with contextlib.suppress(OSError):
        root.rmdir()  # only when empty: a host of another run of this pool id may still be there
    return removed


def _running(pid: int) -> bool:
    """Alive and not a zombie (a pool just stopped is one until init reaps it)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def is_pool_process(pid: int) -> bool:
    """Alive and still our ``serve`` (a pid can be reused after the pool died)."""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    return b"atropos.cli" in argv and b"serve" in argv


def stop_process_group(pgid: int, running: Callable[[], bool], grace_s: float) -> None:
    """SIGTERM the pool's process group (it leads its own session), SIGKILL after ``grace_s``.
    SIGTERM first: the pool's shutdown stops its hosts and containers. ``running`` is not
    ``kill(pid, 0)``: that succeeds on a zombie, which a child of ours is until we wait for it."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while running() and time.monotonic() < deadline:
        time.sleep(0.2)
    if running():
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, signal.SIGKILL)


def tail(path: Path, n: int = 1500) -> str:
    """The end of a pool's log, secrets redacted."""
    from atropos.logs import redact

    try:
        return redact(path.read_text(errors="replace")[-n:])
    except OSError:
        return ""
