"""The last step of an import: the staged image made one a slot can take, checked, and only then
its layers moved into the store (docs/task-images.md, "Refused at the door"). Shared by the host
and its unprivileged import child (atropos/sandbox/host/images/userns_import.py)."""

from __future__ import annotations

import dataclasses
import hashlib

from atropos.sandbox.contract.hostdirs import remove_tree
from atropos.sandbox.host.images.image_check import IMPORT_MAX_LAYERS, check_image
from atropos.sandbox.host.images.image_root import ImageRoot
from atropos.sandbox.host.images.layer_store import LayerStore, Staging
from atropos.sandbox.host.images.layer_trees import merge_layers
from atropos.sandbox.host.images.sources import ImageConfig


def merged_key(diff_ids: tuple[str, ...]) -> str:
    """The store's name of the one layer that stacks ``diff_ids`` (not a DiffID of any tar)."""
    return "sha256:" + hashlib.sha256(("merged:" + ",".join(diff_ids)).encode()).hexdigest()


def fit_layers(store: LayerStore, staging: Staging, config: ImageConfig) -> ImageConfig:
    """``config`` whose layers an overlay stacks: an image with more than ``IMPORT_MAX_LAYERS`` gets
    its bottom layers merged into one (``layer_trees.merge_layers``), staged like its other layers;
    the merged-away layers this import staged are dropped (only the merge uses them)."""
    keys = config.diff_ids
    if len(keys) <= IMPORT_MAX_LAYERS:
        return config
    bottom = keys[: len(keys) - IMPORT_MAX_LAYERS + 1]
    key = merged_key(bottom)
    if not store.has(key) and key not in staging.layers:
        path = staging.dir / store.path(key).name
        merge_layers([store.located(d, staging) for d in bottom], path, owners=store.owners)
        staging.layers[key] = path
    rest = keys[len(bottom):]
    for d in set(bottom) - set(rest):
        if d in staging.layers:
            remove_tree(staging.layers.pop(d))
    return config.model_copy(update={"layers": (key, *rest)})


def accept(store: LayerStore, staging: Staging, config: ImageConfig, image_id: str) -> ImageRoot:
    """Fit, check (``image_check.check_image``: ``ImageRejected`` leaves the staging to be dropped)
    and commit the staged image; its ``ImageRoot`` on the store's layers, checked."""
    config = fit_layers(store, staging, config)
    staged = ImageRoot(image_id, config, tuple(store.located(d, staging) for d in config.store_layers))
    check_image(staged)
    store.commit(staging)
    return dataclasses.replace(staged, lowers=tuple(store.path(d) for d in config.store_layers))
