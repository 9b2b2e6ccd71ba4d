"""Task images from a registry, through the distribution's own tool, skopeo; used by both sides.

A host that reaches the registry itself (local, Ray) copies ``docker://REGISTRY/REPO:TAG`` (or
``@sha256:DIGEST``, pinned) into an OCI layout in its store's tmp dir (``fetch``), then imports it as
any OCI layout is (atropos/sandbox/host/images/sources.py: read as hostile input). A pool whose hosts
have no way to the registry (Docker, Nomad) pins the tag to the manifest digest the registry serves
now (``pin``), copies that into a ``docker save`` archive on its own machine (``fetch_archive``) and
ships it as it ships an engine's image (atropos/backends/image_shipping.py). skopeo checks a pinned
digest against what the registry sends. A registry on loopback is spoken to over plain HTTP (TLS
would protect nothing on one machine); any other over verified TLS. docs/task-images.md, "Registries"."""

from __future__ import annotations

import hashlib
import re
import shutil
import subprocess
from pathlib import Path

from atropos.errors import ImageRejected
from atropos.sandbox.contract.imageref import REGISTRY_PREFIX, ImageRef

LOOPBACK = ("127.0.0.1", "localhost", "[::1]")
_REF = re.compile(r"^docker://([A-Za-z0-9.\-]+(?::[0-9]{1,5})?|\[::1\](?::[0-9]{1,5})?)/"
                  r"([a-z0-9]+(?:[._\-/][a-z0-9]+)*)(?::([A-Za-z0-9_][A-Za-z0-9_.\-]{0,127}))?"
                  r"(?:@(sha256:[0-9a-f]{64}))?$")


def _match(reference: ImageRef) -> re.Match[str]:
    # its kind and length were checked when it was made (ImageRef.parse)
    m = _REF.match(reference)
    if m is None or reference.kind != "registry":
        raise ImageRejected(f"{reference[:120]!r}: not a registry reference (docker://HOST[:PORT]/REPO[:TAG][@sha256:...])")
    return m


def parse(reference: ImageRef) -> tuple[str, str | None]:
    """(registry host, pinned digest or None); ImageRejected unless a registry reference skopeo takes."""
    m = _match(reference)
    return m.group(1), m.group(4)


def _skopeo(args: list[str], reference: ImageRef, timeout: float) -> bytes:
    if shutil.which("skopeo") is None:
        raise ImageRejected(f"{reference}: a registry reference needs skopeo on the host (on the pool's "
                            "machine for Docker and Nomad hosts)")
    try:
        proc = subprocess.run(["skopeo", *args], capture_output=True, timeout=timeout, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        raise ImageRejected(f"{reference}: the registry {parse(reference)[0]} did not answer within "
                            f"{timeout:.0f} s") from None
    if proc.returncode != 0:
        err = proc.stderr.decode(errors="replace").strip()[-600:]
        if any(s in err for s in ("connection refused", "no such host", "i/o timeout", "dial tcp")):
            raise ImageRejected(f"{reference}: the registry {parse(reference)[0]} is unreachable ({err})")
        raise ImageRejected(f"{reference}: skopeo could not fetch it ({err})")
    return proc.stdout


def _tls(reference: ImageRef, flag: str) -> str:
    """skopeo's TLS flag (``--tls-verify`` of inspect, ``--src-tls-verify`` of copy) for the registry."""
    where = parse(reference)[0]
    host = "[::1]" if where.startswith("[") else where.rsplit(":", 1)[0]
    return f"{flag}={'false' if host in LOOPBACK else 'true'}"


def _manifest_digest(reference: ImageRef, timeout: float) -> str:
    """The digest of the manifest the registry serves for ``reference`` now (one request)."""
    raw = _skopeo(["inspect", "--raw", _tls(reference, "--tls-verify"), reference], reference, timeout)
    return f"sha256:{hashlib.sha256(raw).hexdigest()}"


def registry_image_id(reference: ImageRef, timeout: float = 120.0) -> str:
    """The store's id of a registry reference: its pinned digest, else the digest of the manifest
    the registry serves for the tag now (a moved tag is imported again)."""
    _, pinned = parse(reference)
    return f"registry:{pinned if pinned is not None else _manifest_digest(reference, timeout)}"


def pin(reference: ImageRef, timeout: float = 120.0) -> ImageRef:
    """``reference`` pinned: ``docker://HOST/REPO@sha256:DIGEST`` of the manifest the registry serves
    for its tag now (as given if pinned already), so what is fetched is what was asked about even
    if the tag moves meanwhile."""
    m = _match(reference)
    digest = m.group(4) or _manifest_digest(reference, timeout)
    return ImageRef.parse(f"{REGISTRY_PREFIX}{m.group(1)}/{m.group(2)}@{digest}")


def config_id(pinned: ImageRef, timeout: float = 120.0) -> str:
    """The image id (sha256 of its config, as the engine and an uploaded archive's import count it)
    of a pinned reference: what a host that was shipped it lists it under."""
    if parse(pinned)[1] is None:
        raise ImageRejected(f"{pinned}: not pinned to a digest")
    raw = _skopeo(["inspect", "--config", "--raw", _tls(pinned, "--tls-verify"), pinned], pinned, timeout)
    return f"sha256:{hashlib.sha256(raw).hexdigest()}"


def fetch(reference: ImageRef, into: Path, timeout: float = 3600.0) -> ImageRef:
    """Copy the image into a new OCI layout ``into``; the ``oci:`` reference of it."""
    parse(reference)
    layout = ImageRef.parse(f"oci:{into}:image")
    _skopeo(["copy", "--quiet", _tls(reference, "--src-tls-verify"), reference, layout], reference, timeout)
    return layout


def fetch_archive(pinned: ImageRef, into: Path, timeout: float = 3600.0) -> None:
    """Copy a pinned reference into a new ``docker save`` archive ``into`` (what a host's image
    upload takes); skopeo checks the digest against what the registry sends."""
    if parse(pinned)[1] is None:
        raise ImageRejected(f"{pinned}: not pinned to a digest")
    _skopeo(["copy", "--quiet", _tls(pinned, "--src-tls-verify"), pinned, f"docker-archive:{into}"], pinned, timeout)
