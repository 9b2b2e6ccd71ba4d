"""The mount helper: holds every workspace overlay of one sandbox host in private mount namespaces.

Started by the host (``python3 -I -S mounthelper.py MODE HOST_PID``); speaks JSON lines on
stdin/stdout, one request at a time. Standard library only.

Why a separate process: ``setns``/``unshare`` of a mount namespace is refused to a multithreaded
process (the host runs threads), and mounts made in the host's own namespace would outlive a
crashed host. Here the kernel removes every mount when the namespace dies, i.e. when this
helper and every sandbox started inside it (``nsenter``) are gone; sandboxes die with the host
(bwrap ``--die-with-parent``) and this helper too (parent-death signal, EOF on stdin).

Each slot's mounts live in a mount namespace of their own (``SlotNamespace``: a forked child of
this helper serving the slot's requests), copied from the helper's namespace as it was before any
slot mounted anything. A sandbox starts in its slot's namespace, so bubblewrap, which formats
``/proc/self/mountinfo`` once per bind it makes and copies the whole table on unshare, walks the
host's few mounts and that slot's own, never every slot's (a host of 48 image slots of 40 layers
holds thousands); and no slot's namespace holds another slot's mounts at all.

MODE ``root``: the host is uid 0. A new mount namespace only; lower layers are *idmapped*
read-only clones of the template (template owner uid -> slot uid), so each slot's agent owns
the files it sees while the template on disk belongs to a uid no slot runs as.

MODE ``userns``: the host is an unprivileged uid (the Docker backend: uid 1000, no
capability). A new user namespace mapping only our own uid to 0, plus a mount namespace in it;
overlays are mounted with ``-o userxattr`` (kernel >= 5.11). Nothing here gains a privilege
outside: the namespace's root is our own uid.
"""

from __future__ import annotations

import ctypes
import errno
import json
import os
import queue
import shutil
import signal
import socket
import sys
import threading
import time
from typing import Any

CLONE_NEWNS = 0x00020000
CLONE_NEWUSER = 0x10000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT, MS_BIND = 0x1, 0x2, 0x4, 0x8, 0x20, 0x1000
MS_MOVE, MS_REC, MS_PRIVATE = 0x2000, 0x4000, 0x40000
MNT_DETACH = 0x2
PR_SET_PDEATHSIG, PR_SET_DUMPABLE = 1, 4
# Unmounts waiting for the background thread before a renew unmounts in place (each one holds
# the pages of a slot's old tmpfs until it is done).
MAX_DEFERRED = 256
# A deferred unmount waits until no request came for this long (a burst of resets is over), or
# until half of MAX_DEFERRED are waiting: it competes with the resets for the CPU.
QUIET_S = 0.05
# Old mounts holding more than this are unmounted in place: their pages are charged to the slot's
# memory cgroup until they are freed, and the next lease must get its memory back at once.
DEFER_MAX_BYTES = 16 << 20
# new mount API (the same numbers on every architecture since 5.2)
SYS_OPEN_TREE, SYS_MOVE_MOUNT, SYS_MOUNT_SETATTR = 428, 429, 442
SYS_FSOPEN, SYS_FSCONFIG, SYS_FSMOUNT = 430, 431, 432
OPEN_TREE_CLONE, AT_FDCWD, AT_EMPTY_PATH, AT_RECURSIVE = 1, -100, 0x1000, 0x8000
FSCONFIG_SET_FLAG, FSCONFIG_SET_STRING, FSCONFIG_SET_FD, FSCONFIG_CMD_CREATE = 0, 1, 5, 6
FSOPEN_CLOEXEC = FSMOUNT_CLOEXEC = 1
MOVE_MOUNT_F_EMPTY_PATH = 0x4
MOUNT_ATTR_RDONLY, MOUNT_ATTR_NOSUID, MOUNT_ATTR_NODEV, MOUNT_ATTR_IDMAP = 0x1, 0x2, 0x4, 0x100000

_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long
_libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p]
_libc.umount2.argtypes = [ctypes.c_char_p, ctypes.c_int]


class _MountAttr(ctypes.Structure):
    _fields_ = [("attr_set", ctypes.c_uint64), ("attr_clr", ctypes.c_uint64),
                ("propagation", ctypes.c_uint64), ("userns_fd", ctypes.c_uint64)]


def _repo_diff() -> Any:
    """``repo_diff.py`` beside this file (the helper runs with ``-I``: its directory is not on
    ``sys.path``), loaded once."""
    global _REPO_DIFF
    if _REPO_DIFF is None:
        import importlib.util
        spec = importlib.util.spec_from_file_location(
            "atropos_repo_diff", os.path.join(os.path.dirname(os.path.abspath(__file__)), "repo_diff.py"))
        assert spec is not None and spec.loader is not None
        _REPO_DIFF = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(_REPO_DIFF)
    return _REPO_DIFF


_REPO_DIFF: Any = None


def _check(ret: int, what: str) -> int:
    if ret < 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")
    return ret


class Helper:
    def __init__(self, mode: str) -> None:
        self.mode = mode
        self.userns_fds: dict[tuple[int, int, int], int] = {}
        # Unmounting waits for an RCU grace period (tens to hundreds of ms on a loaded machine),
        # moving a mount does not: a renew moves the old mounts aside and this thread unmounts
        # them (ctypes drops the GIL, so requests go on meanwhile).
        self.deferred: queue.Queue[str] = queue.Queue()
        self._spare = 0
        self.last_request = 0.0
        self.host_pid = 0
        # The helper's mount namespace as it was before any slot mounted anything (an nsfs fd keeps
        # it alive with no process in it): each slot's namespace is a copy of it.
        self.template_ns = -1
        self.slots: dict[int, SlotNamespace] = {}
        # A slot namespace's image layers, kept across its resets to the same image (see ``KeptLayers``).
        self.kept: KeptLayers | None = None
        self._fd_layers: bool | None = None  # whether overlayfs takes its layers as mount fds (kernel >= 6.13)
        self._fd_roots = False  # a root was built on kept layers here

    # -- namespaces ------------------------------------------------------------------------
    def enter(self, host_pid: int) -> None:
        uid, gid = os.getuid(), os.getgid()
        if self.mode == "userns":
            _check(_libc.unshare(CLONE_NEWUSER | CLONE_NEWNS), "unshare(user, mount)")
            _write("/proc/self/uid_map", f"0 {uid} 1\n")
            _write("/proc/self/setgroups", "deny")
            _write("/proc/self/gid_map", f"0 {gid} 1\n")
            # New credentials made us non-dumpable, which would hide /proc/<us>/ns and
            # /proc/<us>/root from the host (our owner). Nothing secret lives in this process.
            _libc.prctl(PR_SET_DUMPABLE, 1, 0, 0, 0)
        else:
            _check(_libc.unshare(CLONE_NEWNS), "unshare(mount)")
        # Private: nothing we mount leaks to the host, nothing the host mounts later reaches us.
        _check(_libc.mount(b"none", b"/", None, MS_REC | MS_PRIVATE, None), "make / rprivate")
        # The credential change above clears the parent-death signal: set it afterwards.
        _libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if os.getppid() != host_pid:
            sys.exit(0)
        self.host_pid = host_pid
        self.template_ns = self._empty_namespace()
        # only now: unshare() refuses a process that has more than one thread
        self.start_thread()

    def start_thread(self) -> None:
        threading.Thread(target=self._unmount_deferred, daemon=True).start()

    def _empty_namespace(self) -> int:
        """An fd of a copy of our mount namespace as it is now (the host's mounts, none of a slot)."""
        rfd, wfd = os.pipe()
        hold_r, hold_w = os.pipe()
        pid = os.fork()
        if pid == 0:  # pragma: no cover - child
            try:
                os.close(rfd)
                os.close(hold_w)
                if _libc.unshare(CLONE_NEWNS) == 0:
                    os.write(wfd, b"k")
                    os.read(hold_r, 1)  # until the helper holds the namespace (an exited task has no ns links)
            finally:
                os._exit(0)
        os.close(wfd)
        os.close(hold_r)
        try:
            if os.read(rfd, 1) != b"k":
                raise OSError(errno.EPERM, "no mount namespace for the slots could be made")
            return os.open(f"/proc/{pid}/ns/mnt", os.O_RDONLY | os.O_CLOEXEC)  # it lives as long as this fd
        finally:
            os.close(rfd)
            os.close(hold_w)
            os.waitpid(pid, 0)

    def slot_namespace(self, index: int) -> SlotNamespace:
        ns = self.slots.get(index)
        if ns is None:
            ns = self.slots[index] = SlotNamespace.start(self, index)
        return ns

    def idmap_userns(self, owner: int, uid: int, group: int | None = None) -> int:
        """A user namespace mapping ``owner`` -> ``uid`` (uids; gids too, or ``group`` -> ``uid``),
        for idmapped mounts."""
        group = owner if group is None else group
        key = (owner, uid, group)
        if key in self.userns_fds:
            return self.userns_fds[key]
        rfd, wfd = os.pipe()
        pid = os.fork()
        if pid == 0:  # pragma: no cover - child
            try:
                os.close(wfd)
                if _libc.unshare(CLONE_NEWUSER) != 0:
                    os._exit(1)
                os.read(rfd, 1)
            finally:
                os._exit(0)
        os.close(rfd)
        try:
            mine = os.readlink("/proc/self/ns/user")
            deadline = time.monotonic() + 5
            while os.readlink(f"/proc/{pid}/ns/user") == mine:
                if time.monotonic() > deadline:
                    raise OSError(errno.ETIMEDOUT, "idmap user namespace did not appear")
                time.sleep(0.0002)
            _write(f"/proc/{pid}/uid_map", f"{owner} {uid} 1\n")
            _write(f"/proc/{pid}/gid_map", f"{group} {uid} 1\n")
            fd = os.open(f"/proc/{pid}/ns/user", os.O_RDONLY | os.O_CLOEXEC)
        finally:
            os.close(wfd)
            os.waitpid(pid, 0)
        self.userns_fds[key] = fd
        return fd

    # -- mounts ----------------------------------------------------------------------------
    def clone_lower(self, tree: str, lower: str, idmap: list[int] | None) -> None:
        """A read-only (and, as root, idmapped) clone of the template tree at ``lower``."""
        fd = self.detached_clone(tree, idmap)
        try:
            _attach(fd, lower)
        finally:
            os.close(fd)

    def detached_clone(self, tree: str | int, idmap: list[int] | None) -> int:
        """An fd of a read-only (and, as root, idmapped) clone of ``tree`` (a path, or a mount fd)
        attached nowhere: in no mount table, gone with its last fd."""
        if isinstance(tree, int):
            fd = _check(_libc.syscall(SYS_OPEN_TREE, tree, b"", OPEN_TREE_CLONE | os.O_CLOEXEC | AT_RECURSIVE
                                      | AT_EMPTY_PATH), "open_tree(fd)")
        else:
            fd = _check(_libc.syscall(SYS_OPEN_TREE, AT_FDCWD, tree.encode(),
                                      OPEN_TREE_CLONE | os.O_CLOEXEC | AT_RECURSIVE), f"open_tree({tree})")
        try:
            attr = _MountAttr(MOUNT_ATTR_RDONLY | MOUNT_ATTR_NOSUID | MOUNT_ATTR_NODEV, 0, 0, 0)
            if idmap is not None:
                attr.attr_set |= MOUNT_ATTR_IDMAP
                attr.userns_fd = self.idmap_userns(int(idmap[0]), int(idmap[1]),
                                                   int(idmap[2]) if len(idmap) > 2 else None)
            _check(_libc.syscall(SYS_MOUNT_SETATTR, fd, b"", AT_EMPTY_PATH | AT_RECURSIVE, ctypes.byref(attr),
                                 ctypes.sizeof(attr)), "mount_setattr")
        except OSError:
            os.close(fd)
            raise
        return fd

    def overlay_of_fds(self, lowers: list[int], upper: str | None = None, work: str | None = None) -> int:
        """An fd of a detached overlay mount whose lower layers are the mounts ``lowers`` (top
        first); read-only without ``upper``. Options as ``mount_overlay``'s."""
        ctx = _check(_libc.syscall(SYS_FSOPEN, b"overlay", FSOPEN_CLOEXEC), "fsopen(overlay)")
        try:
            for fd in lowers:
                _check(_libc.syscall(SYS_FSCONFIG, ctx, FSCONFIG_SET_FD, b"lowerdir+", None, fd), "overlay lowerdir+")
            opts: list[tuple[str, str | None]] = []
            if upper is not None and work is not None:
                opts += [("upperdir", upper), ("workdir", work), ("volatile", None)]
                if self.mode != "userns":
                    opts += [("redirect_dir", "on"), ("metacopy", "off"), ("index", "off")]
            if self.mode == "userns":
                opts.append(("userxattr", None))
            for key, value in opts:
                _check(_libc.syscall(SYS_FSCONFIG, ctx, FSCONFIG_SET_FLAG if value is None else FSCONFIG_SET_STRING,
                                     key.encode(), None if value is None else value.encode(), 0), f"overlay {key}")
            _check(_libc.syscall(SYS_FSCONFIG, ctx, FSCONFIG_CMD_CREATE, None, None, 0), "overlay create")
            attrs = MOUNT_ATTR_NOSUID | MOUNT_ATTR_NODEV | (0 if upper is not None else MOUNT_ATTR_RDONLY)
            return _check(_libc.syscall(SYS_FSMOUNT, ctx, FSMOUNT_CLOEXEC, attrs), "fsmount(overlay)")
        finally:
            os.close(ctx)

    def fd_layers(self, tree: str, idmap: list[int] | None) -> bool:
        """Whether overlayfs here takes a layer as a mount fd (``lowerdir+`` by fd, kernel >= 6.13),
        tried once with a clone of ``tree`` as ``image_root`` makes it."""
        if self._fd_layers is None:
            fd = ctx = -1
            try:
                fd = self.detached_clone(tree, idmap)
                ctx = _check(_libc.syscall(SYS_FSOPEN, b"overlay", FSOPEN_CLOEXEC), "fsopen(overlay)")
                _check(_libc.syscall(SYS_FSCONFIG, ctx, FSCONFIG_SET_FD, b"lowerdir+", None, fd), "lowerdir+")
                self._fd_layers = True
            except OSError:
                self._fd_layers = False
            finally:
                for f in (fd, ctx):
                    if f >= 0:
                        os.close(f)
        return self._fd_layers

    def layers_for(self, lowers: list[str], idmap: list[int] | None) -> KeptLayers:
        """This slot's clones of ``lowers`` (and their read-only overlay, the pristine image): the
        ones kept from the last root when it was the same image with the same id mapping, else
        made now (the old ones dropped)."""
        key = (tuple(lowers), None if idmap is None else tuple(int(i) for i in idmap))
        if self.kept is not None and self.kept.key == key:
            return self.kept
        self.drop_layers()
        fds: list[int] = []
        try:
            for tree in lowers:
                fds.append(self.detached_clone(tree, idmap))
            pristine = self.overlay_of_fds(fds) if len(fds) > 1 else self.detached_clone(fds[0], None)
        except OSError:
            for fd in fds:
                os.close(fd)
            raise
        self.kept = KeptLayers(key, fds, pristine)
        return self.kept

    def drop_layers(self) -> None:
        """Close the kept layers: the last fd of a detached mount unmounts it."""
        kept, self.kept = self.kept, None
        if kept is not None:
            for fd in [*kept.fds, kept.pristine]:
                os.close(fd)

    def mount_overlay(self, lower: str, upper: str, work: str, target: str) -> None:
        # volatile: no syncs to the upper fs (also not at umount, which otherwise costs a journal
        # commit of the host fs per reset); the upper layer is thrown away anyway.
        opts = f"lowerdir={lower},upperdir={upper},workdir={work},volatile"
        if self.mode == "userns":
            # Unprivileged overlays keep their metadata in user.* xattrs and cannot create
            # directory redirects: renaming a directory that came from the template fails with
            # EXDEV there (mv and shutil.move fall back to copying; `git mv` of such a dir fails).
            opts += ",userxattr"
        else:
            # redirect_dir=on lets a fork rename template directories; metacopy and index stay
            # off. All of that metadata lives in the upper dir, which a reset drops whole.
            opts += ",redirect_dir=on,metacopy=off,index=off"
        _check(_libc.mount(b"overlay", target.encode(), b"overlay", MS_NOSUID | MS_NODEV, opts.encode()),
               f"mount overlay on {target}")

    def mount_tmpfs(self, target: str, quota: dict[str, Any]) -> None:
        """A size- and inode-capped tmpfs: a slot's whole writable workspace lives in one, so a
        slot fills its cap (ENOSPC), never the host's disk; dropping it is one umount."""
        opts = f"size={int(quota['bytes'])},nr_inodes={int(quota['inodes'])},mode={int(quota.get('mode', 0o700)):o}"
        if quota.get("uid") is not None:
            opts += f",uid={int(quota['uid'])},gid={int(quota['uid'])}"
        _check(_libc.mount(b"tmpfs", target.encode(), b"tmpfs", MS_NOSUID | MS_NODEV, opts.encode()),
               f"mount tmpfs on {target}")

    def umount(self, target: str) -> str:
        """Unmount everything stacked on ``target``; 'detached' when a reference kept it busy."""
        how = "none"
        for _ in range(16):
            if _libc.umount2(target.encode(), 0) == 0:
                how = "unmounted" if how == "none" else how
                continue
            err = ctypes.get_errno()
            if err == errno.EINVAL:  # not a mount point (any more)
                return how
            if err == errno.EBUSY:
                _check(_libc.umount2(target.encode(), MNT_DETACH), f"umount2({target}, MNT_DETACH)")
                how = "detached"
                continue
            raise OSError(err, f"umount {target}: {os.strerror(err)}")
        raise OSError(errno.EBUSY, f"{target}: more than 16 stacked mounts")

    def renew(self, req: dict[str, Any]) -> dict[str, Any]:
        """A slot's reset in one round trip: every mount on the ``detach`` targets is moved under
        ``trash`` (unmounted there in the background), then a fresh capped tmpfs is mounted on each
        ``tmpfs`` target, then (``image_root``: a request of that op) a fresh image root is built.
        The old mounts are unmounted here instead when they hold more than DEFER_MAX_BYTES, or
        MAX_DEFERRED unmounts are waiting already."""
        trash = str(req["trash"])
        results: dict[str, str] = {}
        targets = list(req.get("detach", []))
        in_place = self.deferred.qsize() >= MAX_DEFERRED or sum(map(_used_bytes, targets)) > DEFER_MAX_BYTES
        for target in targets:
            results[target] = self.umount(target) if in_place else self.move_aside(target, trash)
        if req.get("drop_layers"):
            self.drop_layers()
        for item in req.get("tmpfs", []):
            self.mount_tmpfs(item["target"], item["quota"])
        built = self.image_root(req["image_root"]) if req.get("image_root") is not None else {}
        return {"results": results, "deferred": self.deferred.qsize(), **built}

    def move_aside(self, target: str, trash: str) -> str:
        """Move every mount stacked on ``target`` to its own new directory under ``trash``."""
        how = "none"
        # Every mount operation takes the kernel's one global namespace lock, contended by each
        # sandbox starting or dying on the machine: ask the file system first (a mount point is on
        # another device than its parent), never probe with a move that fails.
        for _ in range(16):
            if not os.path.ismount(target):
                return how
            self._spare += 1
            spot = os.path.join(trash, f"{os.getpid()}-{self._spare}")
            os.mkdir(spot, 0o700)
            if _libc.mount(target.encode(), spot.encode(), None, MS_MOVE, None) != 0:
                err = ctypes.get_errno()
                os.rmdir(spot)
                if err == errno.EINVAL:  # not a mount point after all (a bind of the same device)
                    return how
                raise OSError(err, f"move {target} aside: {os.strerror(err)}")
            self.deferred.put(spot)
            how = "moved"
        raise OSError(errno.EBUSY, f"{target}: more than 16 stacked mounts")

    def _unmount_deferred(self) -> None:
        while True:
            spot = self.deferred.get()
            while self.deferred.qsize() < MAX_DEFERRED // 2:
                idle = time.monotonic() - self.last_request
                if idle >= QUIET_S:
                    break
                time.sleep(QUIET_S - idle)
            try:
                self.umount(spot)
                os.rmdir(spot)
            except OSError as exc:  # left for the namespace's end; never stops the next one
                sys.stderr.write(f"mount helper: deferred unmount of {spot}: {exc}\n")
            finally:
                self.deferred.task_done()

    # -- requests --------------------------------------------------------------------------
    def handle(self, req: dict[str, Any]) -> dict[str, Any]:
        op = req.get("op")
        if op == "ping":
            return {"pong": True}
        if op == "fork":
            return self.fork(req)
        if op == "tmpfs":
            self.mount_tmpfs(req["target"], req["quota"])
            return {}
        if op == "umount":
            return {"results": {t: self.umount(t) for t in req["targets"]}}
        if op == "renew":
            return self.renew(req)
        if op == "tmpfs_many":
            for item in req["mounts"]:
                self.mount_tmpfs(item["target"], item["quota"])
            return {}
        if op == "settle":  # every deferred unmount done (tests, and a host that stops)
            self.deferred.join()
            for ns in self.slots.values():
                reply = ns.call({"op": "settle"})
                if not reply.get("ok"):
                    raise OSError(errno.EIO, str(reply.get("error")))
            return {}
        if op == "probe":
            return self.probe(req["dir"], req.get("idmap"), req.get("quota"))
        if op == "image_root":
            return self.image_root(req)
        raise ValueError(f"unknown op {op!r}")

    def fork(self, req: dict[str, Any]) -> dict[str, Any]:
        """Overlay of a template. With ``quota`` the upper and work dirs (and the lower's mount
        point) live in a capped tmpfs mounted on ``layers`` first, so a fork's writes are capped
        like a plain workspace's."""
        quota = req.get("quota")
        layers = str(req.get("layers"))
        if quota is not None:
            self.mount_tmpfs(layers, quota)
            for name in ("upper", "work", "lower"):
                os.mkdir(os.path.join(layers, name), 0o700)
            if quota.get("uid") is not None:
                os.chown(os.path.join(layers, "upper"), int(quota["uid"]), int(quota["uid"]))
        try:
            self.clone_lower(req["tree"], req["lower"], req.get("idmap"))
            try:
                self.mount_overlay(req["lower"], req["upper"], req["work"], req["target"])
            except OSError:
                self.umount(req["lower"])
                raise
        except OSError:
            if quota is not None:
                self.umount(layers)
            raise
        return {}

    def image_root(self, req: dict[str, Any]) -> dict[str, Any]:
        """A slot's root from a task image (docs/task-images.md).

        A capped tmpfs on ``layers`` holds the upper and work dirs and one read-only clone of every
        image layer (as root: idmapped, image uid -> slot uid); the overlay of them all goes on
        ``target``, and a read-only overlay of the layers alone (the image as it was) on
        ``layers/pristine``. ``lowers`` are the store's layer dirs, top first; the overlays get short
        relative names (from inside ``layers``): many layers would overflow mount(2)'s one-page
        option string.

        Then every place a sandbox mounts something of its own in that root becomes a mount point
        here, made with no symlink followed (an image, and later the slot's root user, could put a
        symlink at ``/tmp`` that bubblewrap would follow out of the root while it sets up): ``/tmp``,
        ``/dev`` and ``/proc`` get an empty read-only tmpfs for bubblewrap to mount over, and
        the helpers' directory (``helpers``, a name: bwrap.IMAGE_HELPERS is the one spelling) a
        read-only tmpfs holding the helpers (``binds``: the host's lib dir, its ``/usr`` for their
        interpreter, the slot's run dir) and the pristine image (at the name ``pristine``). A mount
        point cannot be removed or renamed from inside the slot (EBUSY).

        With ``keep`` (a slot's own root, never a verification root) and a kernel whose overlayfs
        takes layers as mount fds, the layer clones and the pristine overlay are detached mounts
        this namespace's process holds (``KeptLayers``): in no mount table (a sandbox's start copies
        none of them), made once per image and kept across the slot's resets to that image. They
        are read-only: a slot's writes land in the upper layer, which every reset drops."""
        layers, target = str(req["layers"]), str(req["target"])
        lowers, quota, idmap = list(req["lowers"]), req["quota"], req.get("idmap")
        if req.get("keep") and req.get("diff") is None and lowers and self.fd_layers(lowers[0], idmap):
            try:
                return self._image_root_kept(req, self.layers_for(lowers, idmap))
            except OSError:
                if self._fd_roots:
                    raise
                # the probe passed but no root was ever built this way here (a kernel or a user
                # namespace that takes the fd and refuses the overlay): the way every kernel takes
                self._fd_layers = False
        self.mount_tmpfs(layers, quota)
        try:
            for name in ("upper", "work", "pristine"):
                os.mkdir(os.path.join(layers, name), 0o700)
            owner = quota.get("uid")
            if owner is not None:
                os.chown(os.path.join(layers, "upper"), int(owner), int(owner))
            os.chmod(os.path.join(layers, "upper"), 0o755)  # the root dir of the slot's /
            names = []
            for i, tree in enumerate(lowers):
                names.append(f"l{i}")
                os.mkdir(os.path.join(layers, names[-1]), 0o700)
                self.clone_lower(tree, os.path.join(layers, names[-1]), idmap)
            opts = f"lowerdir={':'.join(names)},upperdir=upper,workdir=work,volatile"
            opts += ",userxattr" if self.mode == "userns" else ",redirect_dir=on,metacopy=off,index=off"
            here = os.open(".", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
            result: dict[str, Any] = {}
            try:
                os.chdir(layers)
                pristine = os.path.join(layers, "pristine")
                if len(names) > 1:  # an overlay without upper needs two lowers at least
                    ro = f"lowerdir={':'.join(names)}" + (",userxattr" if self.mode == "userns" else "")
                    _check(_libc.mount(b"overlay", pristine.encode(), b"overlay",
                                       MS_NOSUID | MS_NODEV | MS_RDONLY, ro.encode()), "mount the pristine image")
                else:
                    self.bind(os.path.join(layers, names[0]), pristine, True)
                if req.get("diff") is not None:  # a verification root: the agent's repository changes only
                    result["diff"] = _repo_diff().build(req["diff"], upper=os.path.join(layers, "upper"),
                                                        pristine=pristine, userns=self.mode == "userns")
                _check(_libc.mount(b"overlay", target.encode(), b"overlay", MS_NOSUID | MS_NODEV, opts.encode()),
                       f"mount image overlay on {target}")
            finally:
                os.fchdir(here)
                os.close(here)
            self.image_mount_points(target, owner, list(req.get("binds", [])), pristine,
                                    _plain_name(req["helpers"]), _plain_name(req["pristine"]))
        except (OSError, ValueError):
            self.umount(target)
            self.umount(os.path.join(layers, "pristine"))
            self.umount(layers)
            raise
        return result

    def _image_root_kept(self, req: dict[str, Any], kept: KeptLayers) -> dict[str, Any]:
        layers, target, quota = str(req["layers"]), str(req["target"]), req["quota"]
        self.mount_tmpfs(layers, quota)
        try:
            upper, work = os.path.join(layers, "upper"), os.path.join(layers, "work")
            for d in (upper, work):
                os.mkdir(d, 0o700)
            owner = quota.get("uid")
            if owner is not None:
                os.chown(upper, int(owner), int(owner))
            os.chmod(upper, 0o755)  # the root dir of the slot's /
            root = self.overlay_of_fds(kept.fds, upper, work)
            try:
                _attach(root, target)
            finally:
                os.close(root)
            self.image_mount_points(target, owner, list(req.get("binds", [])), kept.pristine,
                                    _plain_name(req["helpers"]), _plain_name(req["pristine"]))
        except (OSError, ValueError):
            self.umount(target)
            self.umount(layers)
            self.drop_layers()
            raise
        self._fd_roots = True
        return {"layers_kept": kept.count_use(), "layers": len(kept.fds)}

    def image_mount_points(self, root: str, owner: int | None, binds: list[dict[str, Any]], pristine: str | int,
                           helpers_name: str, pristine_name: str) -> None:
        fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            for name in ("tmp", "dev", "proc", helpers_name):
                _real_dir(fd, name)
            try:  # docker run mounts sysfs there: the slot gets none, but `ls /` lists the same names
                os.mkdir("sys", 0o555, dir_fd=fd)
            except FileExistsError:
                pass
        finally:
            os.close(fd)
        placeholder = {"bytes": 64 << 10, "inodes": 64, "mode": 0o755, "uid": owner}
        for name in ("tmp", "dev", "proc"):
            self.mount_tmpfs(os.path.join(root, name), placeholder)
            self.remount_ro(os.path.join(root, name))
        helpers = os.path.join(root, helpers_name)
        self.mount_tmpfs(helpers, placeholder)
        for item in binds:
            dest = os.path.join(helpers, _plain_name(item["dest"]))
            os.mkdir(dest, 0o755)
            self.bind(str(item["source"]), dest, bool(item.get("ro", True)))
        dest = os.path.join(helpers, pristine_name)
        os.mkdir(dest, 0o755)
        if isinstance(pristine, int):  # a kept detached overlay: a read-only clone of it goes there
            fd = self.detached_clone(pristine, None)
            try:
                _attach(fd, dest)
            finally:
                os.close(fd)
        else:
            self.bind(pristine, dest, True)
        self.remount_ro(helpers)

    def bind(self, source: str, target: str, ro: bool) -> None:
        # recursive: a userns host may not bind a tree holding mounts made outside its user
        # namespace without them (EINVAL; in a container, /usr holds the engine's docker-init)
        _check(_libc.mount(source.encode(), target.encode(), None, MS_BIND | MS_REC, None),
               f"bind {source} on {target}")
        if ro:
            self.remount_ro(target, bind=True)

    def remount_ro(self, target: str, bind: bool = False) -> None:
        flags = MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV | (MS_BIND if bind else 0)
        if bind and os.statvfs(target).f_flag & os.ST_NOEXEC:
            # a bind of a mount made outside our user namespace (a userns host's: Docker mounts its
            # tmpfs noexec) keeps that flag locked: a remount that drops it is refused (EPERM)
            flags |= MS_NOEXEC
        _check(_libc.mount(None, target.encode(), None, flags, None), f"remount {target} read-only")

    def probe(self, base: str, idmap: list[int] | None, quota: dict[str, Any] | None = None) -> dict[str, Any]:
        """Fork a tiny template and check copy-up, whiteouts and opaque directories work (with
        ``quota``: on a capped tmpfs, as slots' forks will be)."""
        tree, merged, layers = (os.path.join(base, n) for n in ("tree", "ws", "ov"))
        lower, upper, work = (os.path.join(layers, n) for n in ("lower", "upper", "work"))
        for d in (tree + "/d", merged, layers) + (() if quota is not None else (lower, upper, work)):
            os.makedirs(d)
        _write(tree + "/f", "template\n")
        _write(tree + "/d/g", "x\n")
        if idmap is not None:
            os.chown(tree, idmap[0], idmap[0])
            for p in (tree + "/f", tree + "/d", tree + "/d/g"):
                os.chown(p, idmap[0], idmap[0])
            if quota is None:
                os.chown(upper, idmap[1], idmap[1])
        if quota is not None:
            quota = {**quota, "uid": None if idmap is None else idmap[1]}
        try:
            t0 = time.perf_counter()
            self.fork({"tree": tree, "lower": lower, "upper": upper, "work": work, "target": merged,
                       "idmap": idmap, "quota": quota, "layers": layers})
            ms = (time.perf_counter() - t0) * 1000
            try:
                if idmap is not None and os.lstat(merged + "/f").st_uid != idmap[1]:
                    raise OSError(errno.EPERM, "idmapped lower layer shows the wrong owner")
                with open(merged + "/f", "a") as fh:
                    fh.write("fork\n")
                shutil.rmtree(merged + "/d")
                os.mkdir(merged + "/d")
                if os.listdir(merged + "/d"):
                    raise OSError(errno.EIO, "opaque directories do not work (no xattr support on the upper fs?)")
                with open(tree + "/f") as fh:
                    if fh.read() != "template\n":
                        raise OSError(errno.EIO, "a write in the fork reached the template")
            finally:
                self.handle({"op": "umount", "targets": [merged, lower] + ([layers] if quota else [])})
        finally:
            shutil.rmtree(base, ignore_errors=True)
        return {"fork_ms": round(ms, 3)}


class KeptLayers:
    """A slot's clones of one image's layers and their read-only overlay (the pristine image), as
    detached mount fds held by the slot namespace's process: read-only (the slot's writes go to the
    root's upper layer, dropped by every reset), idmapped for the slot's uid as root. Kept while the
    slot's root is this image; closed when it becomes another root (or the default), so an image
    in no slot's use holds no mount (the store evicts only images no slot uses)."""

    def __init__(self, key: tuple[tuple[str, ...], tuple[int, ...] | None], fds: list[int], pristine: int) -> None:
        self.key, self.fds, self.pristine = key, fds, pristine
        self.uses = 0

    def count_use(self) -> bool:
        """Count a root built on these layers; whether they were kept from an earlier one."""
        self.uses += 1
        return self.uses > 1


class SlotNamespace:
    """One slot's mount namespace and the process that makes its mounts (a fork of the helper: the
    same code, single-threaded when it switches namespace, which ``setns`` requires). Reached only
    over its socket by the helper; it dies with the helper (parent-death signal, EOF)."""

    def __init__(self, index: int, pid: int, sock: socket.socket) -> None:
        self.index, self.pid, self.sock = index, pid, sock
        self.rfile = sock.makefile("r", encoding="utf-8")

    @classmethod
    def start(cls, helper: Helper, index: int) -> SlotNamespace:
        ours, theirs = socket.socketpair()
        parent = os.getpid()
        pid = os.fork()
        if pid == 0:  # pragma: no cover - child
            try:
                ours.close()
                for other in helper.slots.values():
                    other.sock.close()
                _libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
                if os.getppid() != parent:
                    os._exit(0)
                null = os.open(os.devnull, os.O_RDWR)
                os.dup2(null, 0)  # the helper's pipes to the host are the helper's alone: its
                os.dup2(null, 1)  # stdout reaches EOF when it exits, whatever we hold
                _check(_libc.setns(helper.template_ns, CLONE_NEWNS), "setns(slot template)")
                _check(_libc.unshare(CLONE_NEWNS), "unshare(slot mount namespace)")
                os.close(helper.template_ns)
                _libc.prctl(15, f"slotns-{index}".encode(), 0, 0, 0)  # PR_SET_NAME: tests and ps find it
                mine = Helper(helper.mode)
                mine.userns_fds = dict(helper.userns_fds)
                mine.start_thread()
                fh = theirs.makefile("rw", encoding="utf-8")
                serve(mine, fh, fh)
            except BaseException as exc:  # the child must never return into the helper's loop
                try:
                    theirs.sendall((json.dumps({"ok": False, "error": f"slot namespace: {exc}"}) + "\n").encode())
                except OSError:
                    pass
            finally:
                os._exit(0)
        theirs.close()
        return cls(index, pid, ours)

    def call(self, req: dict[str, Any]) -> dict[str, Any]:
        """The namespace's reply to ``req`` as it is (its error, if any, passed on unchanged)."""
        try:
            self.sock.sendall((json.dumps(req) + "\n").encode())
            line = self.rfile.readline()
        except OSError as exc:
            return {"ok": False, "error": f"slot {self.index}'s mount namespace: {exc}"}
        if not line:
            return {"ok": False, "error": f"slot {self.index}'s mount namespace is gone"}
        reply: dict[str, Any] = json.loads(line)
        if reply.get("ok"):
            reply["result"]["ns_pid"] = self.pid
        return reply


def _attach(fd: int, target: str) -> None:
    """Attach the detached mount ``fd`` on ``target``."""
    _check(_libc.syscall(SYS_MOVE_MOUNT, fd, b"", AT_FDCWD, target.encode(), MOVE_MOUNT_F_EMPTY_PATH),
           f"move_mount(-> {target})")


def _plain_name(name: object) -> str:
    """A request's directory name: one path component, so no join leaves the directory it names."""
    if not isinstance(name, str) or not name or "/" in name or name in (".", "..") or "\0" in name:
        raise ValueError(f"not a plain name: {name!r}")
    return name


def _real_dir(dir_fd: int, name: str) -> None:
    """``name`` in ``dir_fd`` is a real directory afterwards: whatever else is there (a symlink, a
    file) is removed first; nothing is followed."""
    try:
        st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        os.mkdir(name, 0o755, dir_fd=dir_fd)
        return
    if (st.st_mode & 0o170000) != 0o040000:
        os.unlink(name, dir_fd=dir_fd)
        os.mkdir(name, 0o755, dir_fd=dir_fd)


def _used_bytes(path: str) -> int:
    """What the file system mounted at ``path`` holds (0 if it cannot be read)."""
    try:
        st = os.statvfs(path)
    except OSError:
        return 0
    return (st.f_blocks - st.f_bfree) * st.f_frsize


def _write(path: str, text: str) -> None:
    with open(path, "w") as fh:
        fh.write(text)


def serve(helper: Helper, inp: Any, out: Any) -> None:
    """Answer JSON-line requests in order until EOF."""
    for line in inp:
        req: dict[str, Any] = {}
        reply: dict[str, Any]
        try:
            req = json.loads(line)
            helper.last_request = time.monotonic()
            if req.get("slot") is not None:  # a slot's mounts: made in that slot's own namespace
                reply = helper.slot_namespace(int(req["slot"])).call({k: v for k, v in req.items() if k != "slot"})
            else:
                t0 = time.perf_counter()
                result = helper.handle(req)
                result["ms"] = round((time.perf_counter() - t0) * 1000, 3)
                reply = {"ok": True, "result": result}
        except (OSError, KeyError, TypeError, ValueError) as exc:
            reply = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
        reply["id"] = req.get("id") if isinstance(req, dict) else None
        out.write(json.dumps(reply) + "\n")
        out.flush()


def main() -> None:
    mode, host_pid = sys.argv[1], int(sys.argv[2])
    helper = Helper(mode)
    out = sys.stdout
    try:
        helper.enter(host_pid)
    except OSError as exc:
        out.write(json.dumps({"ok": False, "error": str(exc)}) + "\n")
        out.flush()
        return
    out.write(json.dumps({"ok": True, "result": {"ready": True, "pid": os.getpid()}}) + "\n")
    out.flush()
    serve(helper, sys.stdin, out)


if __name__ == "__main__":
    main()
