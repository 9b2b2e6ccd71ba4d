"""Task directories on disk, and the rendered templates in them, as a Nomad client lays them out.

Nomad gives every task ``<data_dir>/alloc/<alloc_id>/<task>/`` with ``local/``, ``secrets/`` and
``tmp/``, beside the allocation's shared ``alloc/``; its environment names them
(``NOMAD_TASK_DIR``, ``NOMAD_SECRETS_DIR``, ``NOMAD_ALLOC_DIR``: host paths for a driver that runs a
local process, as ``raw_exec``; a docker task sees them at ``/local``, ``/secrets``, ``/alloc``).
The directories are mode 0777 (owned by ``nobody`` when the agent is root: allocdir's
``dropDirPermissions``), so the task may remove what is rendered there. Real Nomad mounts
``secrets/`` as a tmpfs of the task's own; the fake uses a plain directory.

A template renders to ``DestPath`` relative to the task directory (one that leaves it is refused,
as Nomad's file sandbox does), written whole and then renamed into place (consul-template's
atomic write), with ``Perms`` (octal text, default ``644``) and ``Uid``/``Gid`` (default: the
agent's user). The fake runs every task as its own user (a ``ProcessDriver`` cannot switch users),
so a ``Uid``/``Gid`` naming the task's own ``User`` (``"1000:1000"``) is that user, the fake's; any
other owner is set as Nomad sets it (which needs root).
"""

from __future__ import annotations

import contextlib
import os
import pwd
from pathlib import Path
from typing import Any

DIR_MODE = 0o777
DEFAULT_PERMS = "644"


class TaskDirError(Exception):
    """A template that cannot be written where and how its task asks (``Template failed``)."""


def task_dir(root: Path, alloc_id: str, task: str) -> Path:
    return root / "alloc" / alloc_id / task


def task_env(root: Path, alloc_id: str, task: str) -> dict[str, str]:
    """The ``NOMAD_*_DIR`` variables of one task."""
    tdir = task_dir(root, alloc_id, task)
    return {"NOMAD_ALLOC_DIR": str(root / "alloc" / alloc_id / "alloc"), "NOMAD_TASK_DIR": str(tdir / "local"),
            "NOMAD_SECRETS_DIR": str(tdir / "secrets")}


def build(root: Path, alloc_id: str, task: str) -> Path:
    """Create the task's directories (idempotent: a restart in place keeps them) and return the task dir."""
    alloc = root / "alloc" / alloc_id
    tdir = alloc / task
    for d in (alloc / "alloc", tdir, tdir / "local", tdir / "secrets", tdir / "tmp"):
        d.mkdir(parents=True, exist_ok=True)
        os.chmod(d, DIR_MODE)
        if os.geteuid() == 0:
            with contextlib.suppress(KeyError):
                nobody = pwd.getpwnam("nobody")
                os.chown(d, nobody.pw_uid, nobody.pw_gid)
    return tdir


def _task_user(spec: dict[str, Any]) -> tuple[int | None, int | None]:
    user, _, group = str(spec.get("User") or "").partition(":")
    return (int(user) if user.isdigit() else None), (int(group) if group.isdigit() else None)


def write_template(tdir: Path, template: dict[str, Any], text: str, task_spec: dict[str, Any]) -> Path:
    """Write one rendered template into the task dir, as Nomad would; returns its path."""
    dest = str(template.get("DestPath") or "")
    path = Path(os.path.normpath(tdir / dest))
    if not dest or not path.is_relative_to(tdir) or path == tdir:
        raise TaskDirError(f"template destination {dest!r} escapes the task directory")
    perms_text = str(template.get("Perms") or DEFAULT_PERMS)
    try:
        perms = int(perms_text, 8)
    except ValueError:
        raise TaskDirError(f"failed to parse {perms_text!r} as octal") from None
    uid, gid = template.get("Uid"), template.get("Gid")
    task_uid, task_gid = _task_user(task_spec)
    # the fake's tasks run as the fake's own user: an owner that is the task's user is ours
    owner_uid = -1 if uid is None or uid < 0 or uid == task_uid else int(uid)
    owner_gid = -1 if gid is None or gid < 0 or gid == task_gid else int(gid)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.fake-nomad-render")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    try:
        os.write(fd, text.encode())
        os.fchmod(fd, perms)  # not the umask's
        if (owner_uid, owner_gid) != (-1, -1):
            try:
                os.fchown(fd, owner_uid, owner_gid)
            except PermissionError as exc:
                raise TaskDirError(f"failed to set ownership of {dest!r}: {exc.strerror}") from None
    except BaseException:
        os.close(fd)
        os.unlink(tmp)
        raise
    os.close(fd)
    os.replace(tmp, path)
    return path
