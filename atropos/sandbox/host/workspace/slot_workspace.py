"""A slot's workspace and scratch mounts: built, dropped, renewed on reset, and verified fresh
(see docs/templates.md, "What a reset verifies"). Held by ``Slot`` as ``slot.ws``: the slot reads
its state (template, kind, mounts) and asks it to build, renew, drop and verify; only it writes them."""

from __future__ import annotations

import asyncio
import os
import secrets
import stat
from collections.abc import Callable
from pathlib import Path
from typing import Any

from atropos.sandbox.contract.protocol import WorkspaceKind
from atropos.sandbox.host.config import HostConfig
from atropos.sandbox.host.images.image_root import ImageRoot
from atropos.sandbox.host.isolation.bwrap import (
    IMAGE_HELPERS,
    IMAGE_HOST_USR,
    IMAGE_LIB_DIR,
    IMAGE_PRISTINE,
    IMAGE_RUN_DIR,
    SandboxPaths,
    image_helper_name,
)
from atropos.sandbox.host.isolation.cgroups import SlotCgroup
from atropos.sandbox.host.workspace import WorkspaceError
from atropos.sandbox.host.workspace.mountns import SlotMountNamespace
from atropos.sandbox.host.workspace.templates import Template
from atropos.sandbox.host.workspace.trees import copy_tree, walk_tree
from atropos.sandbox.host.workspace.workspaces import Workspaces


class SlotWorkspace:
    """The workspace of one slot: its layout (fixed) and what it is now built as (its own state)."""

    def __init__(self, index: int, cfg: HostConfig, uid: int | None, dir: Path, paths: SandboxPaths,
                 workspaces: Workspaces | None, trash: Path, cgroup: SlotCgroup | None,
                 generation: Callable[[], int]) -> None:
        self.index = index
        self.cfg = cfg
        self.uid = uid
        self.dir = dir
        self.paths = paths
        self.workspaces = workspaces
        self.trash = trash
        self.cgroup = cgroup  # read only: what a reset can say it checked (``processes_checked``)
        self._generation = generation  # the slot's, for the names of discarded trees
        self.template: Template | None = None  # the template the workspace is built on
        self.ws_kind: WorkspaceKind = "plain"
        self.capped = False  # the workspace (a fork's layers) is a capped tmpfs mount
        self.scratch = False  # run dir, /tmp and /dev/shm are capped tmpfs mounts (size and inodes)
        self.last_verified = ""
        self.image: ImageRoot | None = None  # the task image the slot's root is built from
        self._realpaths: dict[Path, str] = {}

    @property
    def root(self) -> Path:
        """Mount point of an image-rooted slot's ``/`` (the overlay of the image's layers)."""
        return self.dir / "root"

    @property
    def ov(self) -> Path:
        """Overlay layers of a forked workspace: upper (the slot's writes), work, lower (mount point)."""
        return self.dir / "ov"

    def _fresh_dir(self, d: Path) -> None:
        d.mkdir(mode=0o700)
        if self.uid is not None:
            os.chown(d, self.uid, self.uid)
        os.chmod(d, 0o700)

    def discard(self, d: Path) -> None:
        """Move a dirty tree aside (never copy into or walk it here); deleted in the background."""
        self.trash.mkdir(exist_ok=True)
        os.rename(d, self.trash / f"{self.index}-{d.name}-{self._generation()}-{secrets.token_hex(4)}")

    def view(self, p: Path) -> Path:
        """Where the host reaches ``p`` as the slot sees it: through the mount namespace when
        ``p`` (or what holds it) is mounted there, else the path itself."""
        if not self.capped and not self.scratch and self.ws_kind not in ("overlay", "image"):
            return p
        return Path(self.ns().proc_path(Path(self._real(p))))

    def ns(self) -> SlotMountNamespace:
        """The slot's own mount namespace: only the host's mounts and this slot's are in it."""
        ns = None if self.workspaces is None else self.workspaces.ns
        if ns is None or not ns.alive:
            raise WorkspaceError("the workspace mount helper is not running")
        return ns.slot(self.index)

    def _mounts_prefix(self) -> str:
        return self._realpath(self.dir) + "/"

    def _real(self, p: Path) -> str:
        """``p`` as mountinfo and the mount helper spell it: its parent's symlinks resolved."""
        return os.path.join(self._realpath(p.parent), p.name)

    def helper_path(self, p: Path) -> str:
        """``p`` as the mount helper names it (see ``_real``)."""
        return self._real(p)

    def _realpath(self, d: Path) -> str:
        # Resolved once per directory: the parents of what a slot mounts are the slot's own dir, its
        # layers' dir and the host's lib dir, all made by the host, where a slot never writes. A
        # resolution is a lstat per path component, and a reset asked for a dozen of them.
        real = self._realpaths.get(d)
        if real is None:
            real = self._realpaths[d] = os.path.realpath(d)
        return real

    async def drop(self, keep_layers: bool = False) -> None:
        """Unmount a fork (its upper layer goes to the trash with the rest): never walk or copy
        into the dirty tree. An image root's layers (read-only, held by the slot's namespace) are
        kept with ``keep_layers`` only: the next root is of the same image."""
        targets = []
        if self.ws_kind == "overlay":
            targets += [self.paths.workspace, self.ov / "lower"]
        if self.ws_kind == "image":
            targets.append(self.root)  # its overlay first, then the tmpfs holding its layers (below)
        if self.capped:
            targets.append(self.ov if self.ws_kind in ("overlay", "image") else self.paths.workspace)
        if self.scratch:
            targets += [self.paths.run_dir, *self.scratch_dirs()]
        if targets:
            real = [self._real(t) for t in targets]
            if self.ws_kind == "overlay" and not self.capped:
                # the fork's upper layer is on disk and goes to the trash below: unmounted first
                await self.ns().call({"op": "umount", "targets": real})
            else:  # tmpfs-backed: moved aside whole, unmounted in the background
                await self.ns().call({"op": "renew", "detach": real, "trash": str(self._mount_trash()),
                                      "drop_layers": self.ws_kind == "image" and not keep_layers})
        if self.template is not None:
            self.template.users.discard(self.index)
            self.template = None
        if self.image is not None:
            self.image.users.discard(self.index)
            self.image = None
        self.ws_kind = "plain"
        self.capped = self.scratch = False
        for d in (self.paths.workspace, self.ov, self.root, self.paths.run_dir, *self.scratch_dirs()):
            if d.exists() or d.is_symlink():
                self.discard(d)

    def scratch_dirs(self) -> tuple[Path, Path]:
        """Host-side mount points of the slot's /tmp and /dev/shm."""
        return self.dir / "tmp", self.dir / "shm"

    async def _mount_cap(self, target: Path, quota: dict[str, Any]) -> None:
        self.capped = True  # before the await: a half-done mount is still unmounted by a drop
        await self.ns().call({"op": "tmpfs", "target": self._real(target), "quota": quota})

    async def _mount_scratch(self) -> None:
        """The run dir (the terminal's log), /tmp and /dev/shm: each its own tmpfs capped in size
        AND inodes (bubblewrap's --tmpfs can only cap the size; empty files cost kernel memory)."""
        self.scratch = True  # before the await: a half-done mount is still unmounted by a drop
        await self.ns().call({"op": "tmpfs_many", "mounts": self._scratch_mounts()})

    async def renew_scratch(self) -> None:
        """Fresh capped /tmp and /dev/shm (the old ones go to the trash): the verifier's, empty of
        whatever the agent left, capped as the agent's were."""
        mounts = self._scratch_mounts()[1:]  # not the run dir: the verifier has none
        await self.ns().call({"op": "renew", "detach": [m["target"] for m in mounts], "tmpfs": mounts,
                               "trash": str(self._mount_trash())})

    def _scratch_mounts(self) -> list[dict[str, Any]]:
        return [{"target": self._real(target), "quota": quota} for target, quota in
                zip((self.paths.run_dir, *self.scratch_dirs()), self.cfg.limits.scratch_quotas(self.uid), strict=True)]

    def mount_trash(self) -> Path:
        return self._mount_trash()

    def _mount_trash(self) -> Path:
        assert self.workspaces is not None
        return self.workspaces.mount_trash

    async def renew(self, template: Template | None, image: ImageRoot | None = None) -> None:
        """Back to a fresh workspace. The common case, an empty workspace after an empty one whose
        dirs are all capped tmpfs mounts, is one round trip to the mount helper: the old mounts
        move aside (their pages go with a background unmount) and fresh ones take their place on
        the same (never slot-visible) mount points."""
        mgr = self.workspaces
        renewable = (template is None and image is None and self.ws_kind == "plain" and mgr is not None
                     and mgr.ns is not None and self.scratch == mgr.scratch_capped and self.capped == mgr.capped
                     and (self.scratch or self.capped))
        if not renewable:
            same_image = (image is not None and self.ws_kind == "image" and self.image is not None
                          and self.image.image_id == image.image_id)
            if same_image and image is not None and mgr is not None and self.capped \
                    and self.scratch == mgr.scratch_capped:
                await self._renew_image(image)
                return
            await self.drop(keep_layers=same_image)
            await self.build(template, image)
            return
        mounts = self._scratch_mounts() if self.scratch else []
        ws = self.paths.workspace
        if self.capped:
            mounts.append({"target": self._real(ws), "quota": self.cfg.limits.workspace_quota(self.uid)})
        else:  # an uncapped workspace is a directory on disk: to the trash, a fresh one in its place
            self.discard(ws)
            self._fresh_dir(ws)
        await self.ns().call({"op": "renew", "detach": [m["target"] for m in mounts], "tmpfs": mounts,
                               "trash": str(self._mount_trash())})

    async def _renew_image(self, image: ImageRoot) -> None:
        """A fresh root of the image the slot's root is now, in one round trip: the root overlay,
        its layers' tmpfs and the scratch mounts move aside, fresh ones go on the same mount points
        (host dirs under this slot's dir that were covered by those mounts for the whole lease, so
        nothing of the slot is in them: no new dirs, nothing to the trash), the image's layers are
        the ones the slot's namespace kept (mounthelper.KeptLayers)."""
        ns = self.ns()
        uid, gid = await asyncio.to_thread(image.user_ids)
        if image is not self.image:  # the same image id, loaded again (another ImageRoot of it)
            assert self.image is not None
            self.image.users.discard(self.index)
            image.users.add(self.index)
            self.image = image
        mounts = self._scratch_mounts() if self.scratch else []
        await ns.call({"op": "renew", "detach": [self._real(self.root), self._real(self.ov)]
                       + [m["target"] for m in mounts], "tmpfs": mounts, "trash": str(self._mount_trash()),
                       "image_root": {**self.image_root_request(image, self.ov, self.root, (uid, gid)), "keep": True}})

    async def build(self, template: Template | None, image: ImageRoot | None = None) -> None:
        ws, mgr = self.paths.workspace, self.workspaces
        quota = self.cfg.limits.workspace_quota(self.uid) if mgr is not None and mgr.capped else None
        self._fresh_dir(self.paths.run_dir)
        if mgr is not None and mgr.scratch_capped:
            for d in self.scratch_dirs():
                self._fresh_dir(d)
            await self._mount_scratch()
        if image is not None:
            await self._build_image(image)
            return
        if template is None:
            self._fresh_dir(ws)
            if quota is not None:
                await self._mount_cap(ws, quota)
            return
        template.users.add(self.index)  # before any await: a delete now sees it in use
        self.template = template
        if mgr is not None and mgr.mode == "overlay":
            ns = self.ns()
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
        view = self.view(ws)
        await copy_tree(template.tree, view, timeout=self.cfg.max_timeout_s * 6, into_empty=quota is not None)
        summary = await asyncio.to_thread(walk_tree, view, chown_to=self.uid)
        if self.uid is not None:
            os.chown(view, self.uid, self.uid)
        os.chmod(view, 0o700)
        if summary.tree_hash != template.summary.tree_hash:
            raise WorkspaceError(f"copy of template {template.id} differs from it "
                                 f"({summary.tree_hash[:12]} != {template.summary.tree_hash[:12]})")

    async def _build_image(self, image: ImageRoot) -> None:
        """The slot's ``/`` as ``image`` (see mounthelper.image_root): its layers shared read-only
        (idmapped on a root host: the image's root is the slot's uid, which is uid 0 inside the
        slot's user namespace), the slot's writes in a capped tmpfs, dropped by the reset."""
        ns = self.ns()
        uid, gid = await asyncio.to_thread(image.user_ids)  # before anything: a bad User refuses the lease
        for d in (self.root, self.ov):
            d.mkdir(mode=0o700)
        image.users.add(self.index)  # before any await: a store eviction now sees it in use
        self.image = image
        self.ws_kind = "image"
        self.capped = True  # before the await: a half-done mount is still unmounted by a drop
        await ns.call({**self.image_root_request(image, self.ov, self.root, (uid, gid)), "keep": True})

    def image_root_request(self, image: ImageRoot, layers: Path, target: Path,
                           ids: tuple[int, int]) -> dict[str, Any]:
        """The mount helper's ``image_root`` request for a root of ``image`` on ``target`` (its
        layers, upper and work dirs in a capped tmpfs on ``layers``): the slot's own root, or a
        verification root (host/workspace/verify_root.py)."""
        quota = self.cfg.limits.workspace_quota(self.uid) or {"bytes": IMAGE_UPPER_BYTES,
                                                               "inodes": IMAGE_UPPER_INODES, "uid": self.uid}
        binds = [{"source": self._real(self.paths.lib_dir), "dest": image_helper_name(IMAGE_LIB_DIR)},
                 {"source": "/usr", "dest": image_helper_name(IMAGE_HOST_USR)},
                 {"source": self._real(self.paths.run_dir), "dest": image_helper_name(IMAGE_RUN_DIR), "ro": False}]
        idmap = [ids[0], self.uid, ids[1]] if self.ns().mode == "root" and self.uid is not None else None
        return {"op": "image_root", "layers": self._real(layers), "target": self._real(target),
                "lowers": [str(p) for p in reversed(image.lowers)], "quota": quota, "binds": binds, "idmap": idmap,
                "helpers": IMAGE_HELPERS.lstrip("/"), "pristine": image_helper_name(IMAGE_PRISTINE)}

    def verify(self) -> str:
        """What a finished reset must show (see docs/templates.md, "What a reset verifies")."""
        dirs = [self.paths.run_dir] + ([self.paths.workspace] if self.ws_kind == "plain" else [])
        if self.scratch:
            dirs += self.scratch_dirs()
        if self.capped or self.scratch:
            problem = self._verify_caps()
            if problem:
                return problem
        for d in map(self.view, dirs):
            st = os.lstat(d)
            if not stat.S_ISDIR(st.st_mode):
                return f"{d} is not a directory after reset"
            if self.uid is not None and st.st_uid != self.uid:
                return f"{d} has owner {st.st_uid}, expected {self.uid}"
            if os.listdir(d):
                return f"{d} is not empty after reset"
        if self.ws_kind == "plain":
            owner = ", owned by the slot uid" if self.uid is not None else ""
            self.last_verified = f"empty workspace and run dir{owner}; {self.processes_checked()}"
        elif self.ws_kind == "copy":
            assert self.template is not None
            st = os.lstat(self.view(self.paths.workspace))
            if not stat.S_ISDIR(st.st_mode) or (self.uid is not None and st.st_uid != self.uid):
                return "the copied workspace is not a directory owned by the slot"
            self.last_verified = (f"fresh copy of template {self.template.id}: manifest hash "
                                  f"{self.template.summary.tree_hash[:12]} matches")
        elif self.ws_kind == "image":
            problem = self._verify_image()
            if problem:
                return problem
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
            for d, quota in zip((self.paths.run_dir, *self.scratch_dirs()), lim.scratch_quotas(self.uid), strict=True):
                capped[self._real(d)] = (int(quota["bytes"]), int(quota["inodes"]))
        if self.capped:
            ws_or_layers = self.ov if self.ws_kind in ("overlay", "image") else self.paths.workspace
            if lim.workspace_bytes:
                capped[self._real(ws_or_layers)] = (lim.workspace_bytes, lim.workspace_inodes)
            else:  # an image root's layers live in a tmpfs even on a host whose workspaces are uncapped
                capped[self._real(ws_or_layers)] = (IMAGE_UPPER_BYTES, IMAGE_UPPER_INODES)
        mounts = self.ns().mounts(self._mounts_prefix())
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
        ns = self.ns()
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
        upper_view = self.view(self.ov / "upper")
        st = os.lstat(upper_view)
        if not stat.S_ISDIR(st.st_mode) or (self.uid is not None and st.st_uid != self.uid):
            return "the upper layer is not a directory owned by the slot"
        if os.listdir(upper_view):
            return "the upper layer is not empty after reset"
        self.last_verified = (f"fresh overlay (mount {m.mount_id}, none before it) of template {self.template.id}: "
                              f"empty upper layer, read-only template layer; {self.processes_checked()}")
        return ""

    def _verify_image(self) -> str:
        """A fresh root of the image: one overlay on the root mount point over exactly the image's
        layers, its upper layer in the fresh capped tmpfs checked above and empty but for the
        mount points the mount helper made."""
        assert self.image is not None
        mounts = self.ns().mounts(self._mounts_prefix())
        root = self._real(self.root)
        at_root = [m for m in mounts if m.mountpoint == root]
        if len(at_root) != 1 or at_root[0].fstype != "overlay":
            return f"expected exactly one overlay on {root}, found {[(m.mount_id, m.fstype) for m in at_root]}"
        # layers given by path: one ``lowerdir=a:b``; kept layers (mount fds): a ``lowerdir+=`` each
        fd_layers = [o for o in at_root[0].super_options.split(",") if o.startswith("lowerdir+=")]
        lowers = fd_layers or (at_root[0].super_option("lowerdir") or "").split(":")
        if len(lowers) != len(self.image.lowers):
            return f"the root overlay has {len(lowers)} lower layers, the image {len(self.image.lowers)}"
        upper = self.view(self.ov / "upper")
        st = os.lstat(upper)
        if not stat.S_ISDIR(st.st_mode) or (self.uid is not None and st.st_uid != self.uid):
            return "the root's upper layer is not a directory owned by the slot"
        extra = set(os.listdir(upper)) - IMAGE_MOUNT_POINTS
        if extra:
            return f"the root's upper layer holds {sorted(extra)[:5]} after reset"
        self.last_verified = (f"fresh root of image {self.image.reference} (mount {at_root[0].mount_id}, none "
                              f"before it): {len(lowers)} read-only layers, empty upper layer; "
                              f"{self.processes_checked()}")
        return ""

    def processes_checked(self) -> str:
        """What the reset established about the old lease's processes, and no more than that."""
        if self.cgroup is not None:
            by_uid = " and no process of the slot uid" if self.uid is not None else ""
            return f"no process left in the slot's cgroup (killed, then checked empty){by_uid}"
        if self.uid is not None:
            return "no process of the slot uid (swept by uid)"
        # Without a per-slot uid (a non-root host) there is nothing to sweep by: what holds is that
        # the slot's sandboxes were killed, and with them their PID namespaces.
        return "the slot's sandboxes killed (no per-slot uid on a non-root host, so no uid sweep)"


# An image root's writable layer on a host whose workspaces are uncapped (it is a tmpfs all the same).
IMAGE_UPPER_BYTES = 4 << 30
IMAGE_UPPER_INODES = 1 << 20
# What the mount helper makes in a fresh image root's upper layer (see mounthelper.image_mount_points).
IMAGE_MOUNT_POINTS = frozenset({"tmp", "dev", "proc", IMAGE_HELPERS.lstrip("/"), "sys"})


def _page_round(n: int) -> int:
    page = os.sysconf("SC_PAGE_SIZE")
    return (n + page - 1) // page * page


def _size_bytes(text: str) -> int:
    """tmpfs reports ``size=`` in mountinfo as bytes with a k/m/g suffix."""
    mult = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}.get(text[-1:].lower(), 1)
    return int(text[:-1] if mult != 1 else text) * mult
