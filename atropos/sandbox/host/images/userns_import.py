"""Importing an image archive as an unprivileged host (the Docker backend's: uid 1000, no
capability, no engine socket), docs/task-images.md "On the Docker backend".

A layer's whiteouts are overlayfs' own 0/0 character devices. ``mknod`` of one is refused to an
unprivileged process in the machine's user namespace, and allowed in a user namespace it owns
(as ``unshare -Ur`` then ``mknod c 0 0`` shows). So the import runs in a child process that first
makes a user namespace mapping only our own uid and gid to 0 (a process with threads, like the
host, cannot ``unshare`` one). Nothing is gained outside: the namespace's root is our own uid, and
every file it makes is owned by that uid, as any file of ours.

File owners: such a namespace maps one uid, so the store cannot keep the image's owners (the
store's ``owners=False``): every file belongs to the host's uid, which a slot's user namespace
maps to 0. A root-owned image (the SWE images: ``/testbed`` and the env are root's) looks as in
``docker run``; a file owned by another user (``_apt``, ``www-data``, a uid 1000 home) is root's
in the slot too, and setgid groups (``shadow``, ``mail``) are root's group.

The child stages the image, checks it and commits it as the host does (image_accept.py), within
the budget it is given. Run as ``python -m atropos.sandbox.host.images.userns_import STORE ARCHIVE
REFERENCE BUDGET_JSON``; prints the ``ImportedImage`` as JSON, or ``{"error": ...}`` for an image
refused.

The same child copies a slot's writable layer into a derived image's layer (``copy_tree``; run as
``python -m atropos.sandbox.host.images.userns_import --copy DEST FD NAME...``): that layer holds the
kernel's whiteouts too, and its files are the host's uid already (the slot's 0), as the store's are.
"""

from __future__ import annotations

import ctypes
import json
import os
import subprocess
import sys
from pathlib import Path

from atropos.errors import ImageOverBudget, ImageRejected
from atropos.sandbox.host.images.layer_store import ImportBudget

CLONE_NEWUSER = 0x10000000


def import_archive(store_root: Path, archive: Path, reference: str, *, budget: ImportBudget | None = None,
                   timeout: float = 3600) -> dict[str, object]:
    """Import ``archive`` (``docker save`` bytes) into the store at ``store_root`` from a child in
    a user namespace of its own; the ``ImportedImage`` as plain data."""
    budget = budget if budget is not None else ImportBudget()
    limits = json.dumps({"bytes_left": budget.bytes_left, "entries_per_layer": budget.entries_per_layer,
                         "context": budget.context})
    proc = subprocess.run([sys.executable, "-m", __name__, str(store_root), str(archive), reference, limits],
                          stdin=subprocess.DEVNULL, capture_output=True, timeout=timeout)
    try:
        out = json.loads(proc.stdout.decode() or "{}")
    except ValueError:
        out = {}
    if "error" in out:
        raise (ImageOverBudget if out.get("over_budget") else ImageRejected)(str(out["error"]))
    if proc.returncode != 0 or "config" not in out:
        tail = proc.stderr.decode(errors="replace").strip()[-800:]
        raise ImageRejected(f"{reference}: the unprivileged import failed (exit {proc.returncode}): {tail}")
    return dict(out)


def copy_tree(source: Path, names: list[str], dest: Path, *, timeout: float = 3600) -> None:
    """``cp -a`` of the entries ``names`` of the directory ``source`` into ``dest``, from a child in
    a user namespace of its own (whiteouts kept, owners the host's uid as they were). ``source`` is
    opened here and handed to the child as a descriptor it changes into: a slot's layer is reached
    through the mount helper's ``/proc/PID/root``, which a process in another user namespace may not
    walk. Raises ``OSError`` with cp's own words when the copy fails."""
    fd = os.open(source, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        proc = subprocess.run([sys.executable, "-m", __name__, "--copy", str(dest), str(fd), *names],
                              stdin=subprocess.DEVNULL, capture_output=True, timeout=timeout, pass_fds=(fd,))
    finally:
        os.close(fd)
    if proc.returncode != 0:
        raise OSError(f"copying the slot's layer failed (exit {proc.returncode}): "
                      f"{proc.stderr.decode(errors='replace').strip()[-800:]}")


def _enter_own_userns() -> None:
    uid, gid = os.getuid(), os.getgid()
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.unshare(CLONE_NEWUSER) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"unshare(CLONE_NEWUSER): {os.strerror(err)}")
    for name, text in (("uid_map", f"0 {uid} 1\n"), ("setgroups", "deny"), ("gid_map", f"0 {gid} 1\n")):
        with open(f"/proc/self/{name}", "w") as fh:
            fh.write(text)


def main(argv: list[str]) -> int:
    if argv[:1] == ["--copy"]:
        _enter_own_userns()
        dest, fd, *names = argv[1:]
        os.fchdir(int(fd))
        os.close(int(fd))
        return subprocess.run(["cp", "-a", "--", *names, dest], stdin=subprocess.DEVNULL).returncode
    store_root, archive, reference, limits = argv
    _enter_own_userns()
    # imported only now: nothing may start a thread before the unshare
    from atropos.sandbox.host.images.image_accept import accept
    from atropos.sandbox.host.images.layer_store import LayerStore
    from atropos.sandbox.host.images.sources import import_docker_archive

    store = LayerStore(Path(store_root), owners=False)
    try:
        with store.staging() as staging:
            imported = import_docker_archive(store, Path(archive), reference, staging=staging,
                                             budget=ImportBudget(**json.loads(limits)))
            accepted = accept(store, staging, imported.config, imported.image_id)
        imported = imported.model_copy(update={"config": accepted.config,
                                               "layers": [str(p) for p in accepted.lowers]})
    except ImageRejected as exc:
        print(json.dumps({"error": str(exc), "over_budget": isinstance(exc, ImageOverBudget)}))
        return 2
    print(imported.model_dump_json())
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
