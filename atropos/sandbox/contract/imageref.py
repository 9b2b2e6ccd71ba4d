"""A task image's reference, parsed once where it enters (a request model, a flag, a config) and
carried as ``ImageRef`` from there: the kind is known, never guessed again from a prefix.

Four kinds (docs/task-images.md):

- ``engine``: a Docker engine reference (``repo/task:tag``), imported from the host's engine or
  uploaded by the pool from its own (atropos/backends/image_shipping.py);
- ``oci``: ``oci:DIR`` or ``oci:DIR:TAG``, an OCI image layout on the host's disk (skopeo's form);
- ``derived``: ``derived:...``, an image a host of this machine made from a slot (``derive``);
- ``registry``: ``docker://HOST[:PORT]/REPO[:TAG][@sha256:...]``, fetched with skopeo by the host
  (local, Ray) or by the pool, which ships it (Docker, Nomad).

``ImageRef`` is a ``str`` (the wire, logs and messages keep the text as given) whose ``kind`` was
decided and whose bounds were checked when it was made; pydantic models validate a string into one
and serialise it back as the string.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Literal

from pydantic import GetCoreSchemaHandler
from pydantic_core import PydanticCustomError, core_schema

from atropos.errors import ImageRejected

MAX_IMAGE_REFERENCE = 512  # characters: the one bound of a reference, wherever it arrives
OCI_PREFIX = "oci:"
DERIVED_PREFIX = "derived:"
REGISTRY_PREFIX = "docker://"
ImageKind = Literal["engine", "oci", "derived", "registry"]
# the kinds only the host can resolve (a path on its disk, an image made there): the pool never
# ships them. A registry's is fetched by a host that reaches the registry (local, Ray) and by the
# pool for hosts that cannot (Docker, Nomad: atropos/backends/image_shipping.py)
HOST_SIDE_KINDS: frozenset[ImageKind] = frozenset({"oci", "derived"})
# a reference that names one image for good: pinned to a digest (an engine's ``repo@sha256:...``, a
# registry's ``docker://.../repo@sha256:...``) or an engine's image id (``sha256:...``)
_CONTENT_ADDRESSED = re.compile(r"(?:@|^)sha256:[0-9a-f]{64}$")


class ImageRef(str):
    """A checked image reference (see the module doc); make one with ``ImageRef.parse``."""

    kind: ImageKind

    @classmethod
    def parse(cls, text: str | ImageRef) -> ImageRef:
        """``text`` as an ImageRef; ImageRejected when it cannot be one (empty, over
        MAX_IMAGE_REFERENCE characters, a NUL, a bare ``oci:``)."""
        if isinstance(text, ImageRef):
            return text
        if not isinstance(text, str) or not text or len(text) > MAX_IMAGE_REFERENCE or "\0" in text:
            shown = text[:80] if isinstance(text, str) else type(text).__name__
            raise ImageRejected(f"not an image reference: {shown!r} (1 to {MAX_IMAGE_REFERENCE} characters, no NUL)")
        kind: ImageKind
        if text.startswith(OCI_PREFIX):
            if not text[len(OCI_PREFIX):]:
                raise ImageRejected(f"{text!r}: an OCI reference is oci:DIR or oci:DIR:TAG")
            kind = "oci"
        elif text.startswith(DERIVED_PREFIX):
            kind = "derived"
        elif text.startswith(REGISTRY_PREFIX):
            kind = "registry"
        else:
            kind = "engine"
        ref = cls(text)
        ref.kind = kind
        return ref

    @property
    def host_side(self) -> bool:
        """Whether only the host can resolve it (a pool never ships it)."""
        return self.kind in HOST_SIDE_KINDS

    @property
    def fixed(self) -> bool:
        """Whether it names the same image for good (a derived image, a digest, an image id): a
        slot rooted on it never goes stale. A tag (an engine's, a registry's) or an OCI layout (its
        ``index.json`` may be rewritten) may name another image at the next lease."""
        return self.kind == "derived" or (self.kind != "oci" and _CONTENT_ADDRESSED.search(self) is not None)

    def oci_layout(self) -> tuple[Path, str | None]:
        """An ``oci`` reference as (layout dir, tag), read on the machine that holds the layout: a
        DIR that exists as given wins (a path may hold a colon), else the part after the last colon
        is the tag."""
        if self.kind != "oci":
            raise ImageRejected(f"{self!r}: not an OCI layout reference (oci:DIR[:TAG])")
        body = self[len(OCI_PREFIX):]
        if Path(body).is_dir() or ":" not in body:
            return Path(body), None
        path, _, tag = body.rpartition(":")
        if not tag or "/" in tag or not path:
            return Path(body), None
        return Path(path), tag

    @classmethod
    def __get_pydantic_core_schema__(cls, source: Any, handler: GetCoreSchemaHandler) -> core_schema.CoreSchema:
        def validate(value: str) -> ImageRef:
            try:
                return cls.parse(value)
            except ImageRejected as exc:
                raise PydanticCustomError("image_reference", str(exc)) from None

        return core_schema.no_info_after_validator_function(
            validate,
            core_schema.str_schema(min_length=1, max_length=MAX_IMAGE_REFERENCE),
            serialization=core_schema.plain_serializer_function_ser_schema(str, when_used="json"),
        )
