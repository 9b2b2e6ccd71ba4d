"""The host's workspace service: overlay or copy forks, capped tmpfs workspaces, the mount
namespace that holds them, and templates made from host-side sources (see docs/templates.md)."""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import shutil
import stat
import time
from collections.abc import AsyncIterable, AsyncIterator
from pathlib import Path
from typing import Any, Literal

from atropos.errors import TemplateBuildFailed, TemplateSourceError, WorkspaceError
from atropos.sandbox.contract.hostdirs import remove_tree
from atropos.sandbox.host.child_process import killed_if_left
from atropos.sandbox.host.workspace import TOOL_PATH
from atropos.sandbox.host.workspace.mountns import HELPER, REPO_DIFF, MountNamespace
from atropos.sandbox.host.workspace.templates import Template, TemplateStore, source_dir_allowed
from atropos.sandbox.host.workspace.trees import TreeSummary, copy_tree, run_tool, walk_tree

log = logging.getLogger(__name__)

WorkspaceMode = Literal["overlay", "copy"]


# -- the host's workspace service --------------------------------------------------------------
class Workspaces:
    """Decides overlay vs copy mode, owns the mount namespace and the template store, and makes
    templates from host-side sources. Slot-side fork/reset logic lives in ``slot.py``."""

    def __init__(self, cfg: Any, root: Path, *, owner: int | None, probe_uid: int | None, trash: Path) -> None:
        self.cfg = cfg
        self.root = root
        self.owner = owner  # uid owning template files on a root host (no slot runs as it)
        self.probe_uid = probe_uid
        self.store = TemplateStore(root, owner, trash)
        self.trash = trash
        # where the mount helper moves a reset slot's old mounts until its background unmount
        self.mount_trash = root / "mtrash"
        self.mode: WorkspaceMode = "copy"
        self.detail = ""
        self.ns: MountNamespace | None = None
        self.fork_probe_ms: float | None = None
        self.capped = False  # plain and copied workspaces are capped tmpfs mounts in the namespace
        self.fork_capped = False  # forks' upper layers are too
        self.cap_detail = ""
        # each slot's run dir, /tmp and /dev/shm are tmpfs mounts in the namespace, capped in size and inodes
        self.scratch_capped = False

    async def start(self) -> None:
        await asyncio.to_thread(self.store.prepare)
        await asyncio.to_thread(self._prepare_mount_trash)
        for leftover in self.root.glob("probe-*"):  # of a host that died while probing
            await asyncio.to_thread(remove_tree, leftover)
        wanted = self.cfg.workspace_mode
        quota = self.cfg.limits.workspace_quota(None)
        if self.cfg.unsafe_no_isolation:
            self._uncapped("no workspace cap without isolation (--unsafe-no-isolation)", warn=False)
            self._fallback("no overlays without isolation (--unsafe-no-isolation)", warn=False)
            return
        if quota is None:
            self._uncapped("workspaces uncapped by configuration (--workspace-bytes 0)", warn=False)
        # Started even without a workspace cap: /tmp, /dev/shm and the run dir are capped there.
        try:
            ns = await self._start_namespace()
        except (WorkspaceError, OSError, ValueError) as exc:
            if wanted == "overlay":
                raise WorkspaceError(f"overlay workspaces unavailable (--workspace-mode overlay): {exc}") from exc
            if quota is not None:
                self._uncapped(f"the mount helper cannot run: {exc}", warn=True)
            log.warning("workspace: /tmp and /dev/shm are capped in size only, NOT in inodes (a slot can pin "
                        "kernel memory with empty files): the mount helper cannot run: %s", exc)
            self._fallback(f"overlayfs unavailable: {exc}" if wanted != "copy"
                           else "copy mode forced by configuration (--workspace-mode copy)", warn=wanted != "copy")
            return
        self.ns = ns
        await self._probe_cap(quota)
        if wanted == "copy":
            self._fallback("copy mode forced by configuration (--workspace-mode copy)", warn=False)
        else:
            await self._probe_overlay(wanted)
        if not self.capped and not self.scratch_capped and self.mode != "overlay":
            await ns.stop()  # nothing left for it to hold
            self.ns = None

    def _prepare_mount_trash(self) -> None:
        """Empty directories a dead host's helper left (their mounts died with its namespace)."""
        if self.mount_trash.exists():
            self.trash.mkdir(exist_ok=True)
            os.rename(self.mount_trash, self.trash / f"mtrash-{secrets.token_hex(4)}")
        self.mount_trash.mkdir(mode=0o700)

    async def _start_namespace(self) -> MountNamespace:
        nsenter = shutil.which("nsenter", path=TOOL_PATH)
        if nsenter is None:
            raise WorkspaceError("nsenter (util-linux) not found")
        # The helper is stdlib-only: run it with the sandbox's system python from a copy in the
        # data dir, both reachable by whatever uid the host runs as.
        script = self.root / "mounthelper.py"
        for source in (REPO_DIFF, HELPER):  # the helper loads repo_diff.py from beside itself
            target = self.root / source.name
            tmp = target.with_name(target.name + ".tmp")
            tmp.write_bytes(source.read_bytes())
            os.chmod(tmp, 0o644)
            os.replace(tmp, target)
        ns = MountNamespace("root" if os.geteuid() == 0 else "userns", nsenter, self.cfg.python, script)
        await ns.start()
        return ns

    async def _probe_cap(self, quota: dict[str, Any] | None) -> None:
        """Mount and drop one capped tmpfs the way every slot will (its workspace, or without a
        workspace cap its /tmp)."""
        assert self.ns is not None
        probe_dir = self.root / f"probe-{secrets.token_hex(4)}"
        probe_dir.mkdir(mode=0o700)
        try:
            uid = self.probe_uid if self.ns.mode == "root" else None
            probe = quota if quota is not None else self.cfg.limits.scratch_quotas(None)[1]
            await self.ns.call({"op": "tmpfs", "target": str(probe_dir), "quota": {**probe, "uid": uid}})
            await self.ns.call({"op": "umount", "targets": [str(probe_dir)]})
        except WorkspaceError as exc:
            if quota is not None:
                self._uncapped(f"a capped tmpfs cannot be mounted: {exc}", warn=True)
            log.warning("workspace: /tmp and /dev/shm are capped in size only, NOT in inodes: %s", exc)
            return
        finally:
            await asyncio.to_thread(remove_tree, probe_dir)
        self.scratch_capped = True
        if quota is None:
            return
        self.capped = self.fork_capped = True
        self.cap_detail = (f"each slot's workspace is its own tmpfs of {quota['bytes'] >> 20} MiB, "
                           f"{quota['inodes']} inodes (RAM-backed)")

    async def _probe_overlay(self, wanted: str) -> None:
        assert self.ns is not None
        ns = self.ns
        idmap = [self.owner, self.probe_uid] if ns.mode == "root" else None
        quota = self.cfg.limits.workspace_quota(None) if self.capped else None
        result: dict[str, Any] | None = None
        failure = ""
        for q in ([quota, None] if quota is not None else [None]):
            try:
                probe_dir = self.root / f"probe-{secrets.token_hex(4)}"
                result = await ns.call({"op": "probe", "dir": str(probe_dir), "idmap": idmap, "quota": q})
            except WorkspaceError as exc:
                failure = failure or str(exc)
                continue
            if q is None and quota is not None:
                # e.g. tmpfs without user xattrs (kernels before 6.6) under an unprivileged host
                self.fork_capped = False
                log.warning("workspace: overlays on a capped tmpfs fail (%s); forked workspaces are NOT "
                            "size-capped (their writes go to the data dir's disk)", failure)
                self.cap_detail += f"; forks uncapped: {failure}"
            break
        if result is None:
            if wanted == "overlay":
                raise WorkspaceError(f"overlay workspaces unavailable (--workspace-mode overlay): {failure}")
            self._fallback(f"overlayfs unavailable: {failure}", warn=True)
            return
        self.mode = "overlay"
        self.fork_probe_ms = float(result.get("fork_ms", 0.0))
        how = ("idmapped template layers in a private mount namespace" if ns.mode == "root"
               else "unprivileged user+mount namespace, userxattr")
        self.detail = f"overlayfs copy-on-write forks ({how}); probe fork {self.fork_probe_ms} ms"
        log.info("workspace: %s", self.detail)

    def _uncapped(self, why: str, *, warn: bool) -> None:
        self.capped = self.fork_capped = False
        self.cap_detail = why
        if warn:
            log.warning("workspace: slots' workspaces are NOT size-capped (a slot can fill the data dir's disk): %s",
                        why)

    def _fallback(self, why: str, *, warn: bool) -> None:
        self.mode, self.detail = "copy", why
        (log.warning if warn else log.info)(
            "workspace: %s; template forks are full copies (cp -a --reflink=auto into a fresh dir), "
            "slower and using disk per fork", why)

    async def stop(self) -> None:
        if self.ns is not None:
            await self.ns.stop()

    def problem(self) -> str:
        """Non-empty when forks cannot work any more (the mount helper died)."""
        if (self.mode == "overlay" or self.capped or self.scratch_capped) and (self.ns is None or not self.ns.alive):
            return "the workspace mount helper died; slots' workspaces cannot be reset"
        return ""

    def mount_count(self) -> int | None:
        """Mounts below the data dir in the workspace namespaces (the helper's and each slot's): a
        capped tmpfs for each slot's workspace (when capped), run dir, /tmp and /dev/shm, plus the
        template layer and the overlay per forked slot; no more."""
        if self.ns is None or not self.ns.alive:
            return None
        prefix = os.path.realpath(self.root) + "/"
        leaving = os.path.realpath(self.mount_trash) + "/"  # a reset's old mounts, being unmounted
        try:
            return sum(1 for ns in (self.ns, *self.ns.slots.values()) for m in ns.mounts(prefix)
                       if not m.mountpoint.startswith(leaving))
        except OSError:
            return None

    # -- building templates ----------------------------------------------------------------
    async def build(self, source: str, name: str, fill: Any) -> Template:
        """Make a template: ``fill(tree)`` creates ``tree`` (which does not exist yet)."""
        t0 = time.perf_counter()
        tid, d = self.store.new_dir()
        tree = d / "tree"
        try:
            try:
                await fill(tree)
            except WorkspaceError as exc:
                if source == "slot":
                    raise
                raise TemplateBuildFailed(str(exc)) from exc
            summary = await asyncio.to_thread(self._seal, tree)
        except BaseException:
            await asyncio.to_thread(self.store.abandon, d)
            raise
        template = Template(tid, name, source, tree, summary, time.time(), (time.perf_counter() - t0) * 1000)
        self.store.templates[tid] = template
        log.info("template %s (%s%s): %d files, %d dirs, %.1f MB, hash %s, %.0f ms", tid, source,
                 f" {name!r}" if name else "", summary.files, summary.dirs, summary.bytes / 1e6,
                 summary.tree_hash[:12], template.prepare_ms)
        return template

    def _seal(self, tree: Path) -> TreeSummary:
        st = os.lstat(tree)
        if not stat.S_ISDIR(st.st_mode):
            raise TemplateSourceError("the template source is not a directory")
        summary = walk_tree(tree, chown_to=self.owner)
        if self.owner is not None:
            os.chown(tree, self.owner, self.owner)
        os.chmod(tree, 0o755)
        return summary

    def _new_tree(self, tree: Path) -> None:
        tree.mkdir(mode=0o755)
        if self.owner is not None:
            os.chown(tree, self.owner, self.owner)

    async def from_dir(self, path: str, name: str) -> Template:
        src = source_dir_allowed(path, self.cfg.template_source_dirs)
        if not src.is_dir():
            raise TemplateSourceError(f"{path} is not a directory")

        async def fill(tree: Path) -> None:
            await copy_tree(src, tree, timeout=self.cfg.max_timeout_s * 6)

        return await self.build("dir", name, fill)

    async def from_git(self, url: str, ref: str | None, depth: int | None, name: str) -> Template:
        local = url.startswith("/") or url.startswith("file://")
        if local:
            src = source_dir_allowed(url.removeprefix("file://"), self.cfg.template_source_dirs)
            url, user = str(src), None  # an operator-allowed directory: read it as the host user
        else:
            scheme = url.split("://", 1)[0].lower() if "://" in url else ""
            if scheme not in ("https", "http", "git"):
                raise TemplateSourceError("git URLs must be https://, http://, git:// or an allowed local path")
            user = self.owner  # untrusted remote content: clone as the unprivileged template uid
        if ref is not None and ref.startswith("-"):
            raise TemplateSourceError("invalid git ref")
        config = ["-c", "protocol.allow=never", "-c", "protocol.https.allow=always", "-c", "protocol.http.allow=always",
                  "-c", "protocol.git.allow=always", "-c", "safe.directory=*", "-c", "core.hooksPath=/dev/null"]
        if local:
            config += ["-c", "protocol.file.allow=always"]
        clone = ["git", *config, "clone", "--quiet", "--no-hardlinks"]
        if depth is not None:
            clone += ["--depth", str(depth)]
            if ref is not None:
                clone += ["--branch", ref]
        env = {"PATH": TOOL_PATH, "LANG": "C.UTF-8", "HOME": "/nonexistent", "GIT_CONFIG_NOSYSTEM": "1",
               "GIT_TERMINAL_PROMPT": "0", "GIT_ASKPASS": "/bin/false", "GIT_SSH_COMMAND": "/bin/false"}
        timeout = self.cfg.max_timeout_s

        async def fill(tree: Path) -> None:
            self._new_tree(tree)
            await run_tool([*clone, "--", url, "."], timeout=timeout, user=user, cwd=tree, env=env)
            if ref is not None and depth is None:
                await run_tool(["git", *config, "checkout", "--quiet", "--detach", ref, "--"], timeout=timeout,
                               user=user, cwd=tree, env=env)

        return await self.build("git", name, fill)

    async def from_tar(self, stream: AsyncIterable[bytes], name: str, *, gzip: bool) -> Template:
        async def fill(tree: Path) -> None:
            self._new_tree(tree)
            # Extracted as an unprivileged uid (root hosts) with GNU tar's defaults: no absolute
            # or `..` member names, links that point out are created last.
            argv = ["tar", "-x", "-f", "-", "--same-permissions", "--no-same-owner", "--delay-directory-restore"]
            if gzip:
                argv.insert(2, "-z")
            await run_tool(argv, timeout=self.cfg.max_timeout_s * 6, user=self.owner, cwd=tree, stdin=stream)

        return await self.build("tar", name, fill)

    async def archive(self, template: Template) -> AsyncIterator[bytes]:
        """Stream the template as an uncompressed POSIX tar (for shipping it to another host)."""
        template.readers += 1
        try:
            proc = await asyncio.create_subprocess_exec(
                "tar", "-c", "-f", "-", "--format=posix", "--numeric-owner", "-C", str(template.tree), ".",
                stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
                env={"PATH": TOOL_PATH, "LANG": "C.UTF-8"},
            )
            assert proc.stdout is not None and proc.stderr is not None
            async with killed_if_left(proc):
                while chunk := await proc.stdout.read(1 << 20):
                    yield chunk
                err = await proc.stderr.read()
                if await proc.wait() != 0:
                    raise WorkspaceError(f"tar of template {template.id} failed: {err.decode(errors='replace')}")
        finally:
            template.readers -= 1
