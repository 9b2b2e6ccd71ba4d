"""What an image must be for a slot to take it as its root, checked once when it is imported (and
when a host takes up another host's record), before any slot is touched: a reset that failed on
it would have dropped the slot's old root already, and every lease of the image would cost a slot
(docs/task-images.md, "Refused at the door").

Checked: the ``User`` resolves through the image's own ``/etc/passwd`` and ``/etc/group`` to ids
a user namespace can map; ``Env`` is what ``execve`` takes (``KEY=VALUE``, no NUL, encodable, a
bounded count and size); ``WorkingDir`` is a path (no NUL, bounded); the layer count is one an
overlay takes (``HostImages`` merges the bottom layers of an image with more, see
``layer_trees.merge_layers``). Each failure is an ``ImageRejected`` naming the image and the reason.
"""

from __future__ import annotations

from atropos.errors import ImageRejected
from atropos.sandbox.host.images.image_root import ImageRoot

# overlayfs stacks at most 500 lower layers (fs/overlayfs/params.h OVL_MAX_STACK; measured in the
# task-images reference). An imported image keeps a few below that, so that images derived from
# it (one layer more each) still mount.
MAX_LOWERS = 500
IMPORT_MAX_LAYERS = MAX_LOWERS - 8
# Env: execve refuses one string past 32 pages (MAX_ARG_STRLEN) and the whole of argv and envp past
# a quarter of the stack limit; an image's Env is a few dozen short variables.
MAX_ENV_VARS = 1024
MAX_ENV_ITEM = 32 << 10
MAX_ENV_BYTES = 256 << 10
MAX_PATH = 4096
MAX_NAME = 255
MAX_USER = 256
MAX_ID = (1 << 31) - 1  # a uid_t a user namespace maps (-1 is "no id"; 2^31 and up are refused by many tools)


def check_env(reference: str, env: tuple[str, ...]) -> None:
    if len(env) > MAX_ENV_VARS:
        raise ImageRejected(f"{reference}: its Env has {len(env)} variables, more than {MAX_ENV_VARS}")
    total = 0
    for item in env:
        key, sep, _ = item.partition("=")
        if not sep or not key:
            raise ImageRejected(f"{reference}: an Env entry is not KEY=VALUE: {item[:80]!r}")
        if "\0" in item:
            raise ImageRejected(f"{reference}: the Env entry {key[:80]!r} holds a NUL byte")
        try:
            size = len(item.encode("utf-8")) + 1
        except UnicodeEncodeError:
            raise ImageRejected(f"{reference}: the Env entry {key[:80]!r} is not valid UTF-8") from None
        if size > MAX_ENV_ITEM:
            raise ImageRejected(f"{reference}: the Env entry {key[:80]!r} is {size} bytes, more than {MAX_ENV_ITEM}")
        total += size
    if total > MAX_ENV_BYTES:
        raise ImageRejected(f"{reference}: its Env is {total} bytes, more than {MAX_ENV_BYTES}")


def check_working_dir(reference: str, working_dir: str) -> None:
    if "\0" in working_dir:
        raise ImageRejected(f"{reference}: its WorkingDir holds a NUL byte")
    if len(working_dir.encode("utf-8", "surrogatepass")) > MAX_PATH:
        raise ImageRejected(f"{reference}: its WorkingDir is longer than {MAX_PATH} bytes")
    if any(len(part.encode("utf-8", "surrogatepass")) > MAX_NAME for part in working_dir.split("/")):
        raise ImageRejected(f"{reference}: its WorkingDir has a component longer than {MAX_NAME} bytes")
    try:
        working_dir.encode("utf-8")
    except UnicodeEncodeError:
        raise ImageRejected(f"{reference}: its WorkingDir is not valid UTF-8") from None


def check_user(reference: str, user: str) -> None:
    if len(user) > MAX_USER or "\0" in user or "\n" in user:
        raise ImageRejected(f"{reference}: its User {user[:80]!r} is not a user name or id")


def check_image(root: ImageRoot) -> None:
    """Refuse ``root`` unless a slot can take it (see the module doc); fills its caches (ids, env)
    so no slot reads its passwd again. Raises ``ImageRejected``."""
    ref = root.reference
    config = root.config
    if len(root.lowers) > MAX_LOWERS:
        raise ImageRejected(f"{ref}: {len(root.lowers)} layers, more than the {MAX_LOWERS} an overlay stacks")
    check_user(ref, config.user)
    check_env(ref, config.env)
    check_working_dir(ref, config.working_dir)
    try:
        uid, gid = root.user_ids()
    except ImageRejected as exc:
        raise ImageRejected(f"{ref}: {exc}") from None
    if not (0 <= uid <= MAX_ID and 0 <= gid <= MAX_ID):
        raise ImageRejected(f"{ref}: its User {config.user!r} is uid {uid} gid {gid}, out of range (0..{MAX_ID})")
    env = root.env()  # HOME from its passwd: the same checks on what the slot will get
    check_env(ref, tuple(f"{k}={v}" for k, v in env.items()))
