"""A verification root (docs/verification.md, "A fresh root"): a new root of the slot's image
holding only the agent's changes to one repository, built after the seal beside the slot's own root
and gone when the verifier is.

What the agent did to the rest of its root (``/etc/ld.so.preload``, the env's interpreter and
site-packages, the standard library, name-service modules, ``/usr/lib``) does not exist there:
the new root's lower layers are the image's, shared with every slot (no copy), and its upper layer
is built by the mount helper from the slot's upper layer under the repository alone
(``repo_diff.py``: caches and ``.git`` left out, links out of the repository dropped), with the
task's test files and settings put back from the image. The cost is one capped tmpfs, one
idmapped clone per layer and a copy of the agent's changes to the repository.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from atropos.sandbox.contract.protocol import FreshRoot
from atropos.sandbox.host.workspace.slot_workspace import SlotWorkspace

__all__ = ["VerifyRoot"]


class VerifyRoot:
    """The verification root of one slot: ``build`` it, run the verifier with ``root`` as ``/``,
    then ``drop`` it (the slot's own root is untouched throughout)."""

    def __init__(self, ws: SlotWorkspace) -> None:
        self.ws = ws
        self.root = ws.dir / "vroot"
        self.layers = ws.dir / "vov"
        self.summary: dict[str, Any] = {}
        self._mounted = False

    async def build(self, spec: FreshRoot) -> Path:
        ws = self.ws
        image = ws.image
        if image is None:
            raise ValueError("fresh_root needs a slot whose root is a task image")
        for d in (self.root, self.layers):
            if d.exists() or d.is_symlink():
                ws.discard(d)
            d.mkdir(mode=0o700)
        req = ws.image_root_request(image, self.layers, self.root, image.user_ids())
        # read from the slot's own upper layer and merged root, in the helper's mount namespace
        req["diff"] = {"source": ws.helper_path(ws.ov / "upper"), "merged": ws.helper_path(ws.root),
                       "repo": spec.repo_dir, "from_image": list(spec.from_image)}
        self._mounted = True  # before the await: a half-done mount is still unmounted by ``drop``
        answer = await ws.ns().call(req)
        self.summary = dict(answer.get("diff") or {})
        return self.root

    async def drop(self) -> None:
        """Unmount (moved aside to the mount trash, unmounted in the background) and discard."""
        ws = self.ws
        if self._mounted:
            self._mounted = False
            await ws.ns().call({"op": "renew", "detach": [ws.helper_path(self.root), ws.helper_path(self.layers)],
                                "trash": str(ws.mount_trash())})
        for d in (self.root, self.layers):
            if d.exists() or d.is_symlink():
                ws.discard(d)
