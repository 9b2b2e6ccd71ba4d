"""slotd, the compiled supervisor (atropos/sandbox/inslot/slotd.c): where the host gets the binary,
and the command line that starts it in a sandbox (docs/native-supervisor.md).

The binary is static (it runs on any root a slot has, whatever libc is there) and built once per
machine from the source the package ships: by ``ATROPOS_SLOTD`` (a binary built ahead, e.g. into
the sandbox image by scripts/build_image.sh), else by the C compiler on the host into the cache
(``${ATROPOS_SANDBOX_CACHE:-${XDG_CACHE_HOME:-~/.cache}/atropos-sandbox}/slotd/<source hash>``).
No binary (no compiler, a failed build) leaves the Python supervisor serving every call, as before.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from importlib import resources
from pathlib import Path

log = logging.getLogger(__name__)

SLOTD = "slotd"  # its name in the host's lib dir
CFLAGS = ("-O2", "-static", "-Wall")
# The tests' build under AddressSanitizer and UndefinedBehaviorSanitizer (tests/test_slotd_sanitized.py):
# dynamic, as the sanitizers' runtimes are shared libraries (a static ASan program is not supported),
# so it runs where the host's libraries are visible: the default slot root (the host's /usr) or a
# plain bubblewrap of the host's root, not an image root.
SANITIZER_CFLAGS = ("-O1", "-g", "-fsanitize=address,undefined", "-fno-sanitize-recover=all",
                    "-fno-omit-frame-pointer", "-Wall", "-DSLOTD_SANITIZED")


SOURCES = ("slotd.c", "slotd_protocol.h")  # the program and its generated protocol header


def sources() -> dict[str, bytes]:
    pkg = resources.files("atropos.sandbox.inslot")
    return {name: pkg.joinpath(name).read_bytes() for name in SOURCES}


def source() -> bytes:
    """What the build depends on, as one byte string (its hash names the cached binary)."""
    return b"".join(sources().values())


def cache_dir() -> Path:
    base = os.environ.get("ATROPOS_SANDBOX_CACHE")
    if base:
        return Path(base)
    xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(xdg) / "atropos-sandbox"


def build(out_dir: Path | None = None, cflags: tuple[str, ...] = CFLAGS) -> Path | None:
    """The slotd binary for this package's source, compiled with ``cflags`` into ``out_dir`` (default:
    the cache) if not there yet; None (logged) when it cannot be had. ``ATROPOS_SLOTD`` stands for the
    default build only."""
    prebuilt = os.environ.get("ATROPOS_SLOTD") if cflags == CFLAGS else None
    if prebuilt:
        if os.access(prebuilt, os.X_OK):
            return Path(prebuilt)
        log.warning("ATROPOS_SLOTD=%s is not an executable: building slotd instead", prebuilt)
    files = sources()
    src = b"".join(files.values())
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        log.warning("no C compiler: slots run the Python supervisor for every call (slower starts)")
        return None
    key = hashlib.sha256(src + " ".join(cflags).encode()).hexdigest()[:16]
    target_dir = (out_dir or cache_dir() / "slotd") / key
    target = target_dir / SLOTD
    try:  # a cache this user cannot reach (a host run as another uid with root's HOME): no slotd
        if target.is_file():
            return target
        target_dir.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=target_dir) as tmp:
            for name, data in files.items():
                (Path(tmp) / name).write_bytes(data)
            out = subprocess.run([cc, *cflags, "-o", f"{tmp}/{SLOTD}", f"{tmp}/slotd.c"], capture_output=True,
                                 timeout=120)
            if out.returncode != 0:
                log.warning("slotd did not build (slots run the Python supervisor): %s",
                            out.stderr.decode(errors="replace")[-800:])
                return None
            os.replace(f"{tmp}/{SLOTD}", target)  # atomic: hosts starting side by side share it
    except (OSError, subprocess.TimeoutExpired) as exc:
        log.warning("slotd did not build (slots run the Python supervisor): %s", exc)
        return None
    return target


def install(lib: Path) -> Path | None:
    """Give the host's sandboxes slotd: a copy in the lib dir (mounted read-only in every sandbox),
    or, where the lib dir is on a noexec mount (a container's tmpfs unless mounted exec: Docker's
    default, a Nomad job's tmpfs), the prebuilt binary (``ATROPOS_SLOTD``, e.g. the sandbox image's)
    to bind in read-only from its own, exec mount onto a placeholder in the lib dir (an empty file
    nobody can run: a sandbox started without the bind fails loudly). Returns the host path the
    sandboxes get it from, or None: no slotd, the Python supervisor serves every call."""
    dest = lib / SLOTD
    dest.unlink(missing_ok=True)  # an earlier host's binary never serves this one
    if os.statvfs(lib).f_flag & os.ST_NOEXEC:
        prebuilt = os.environ.get("ATROPOS_SLOTD")
        if prebuilt and os.access(prebuilt, os.X_OK) and not os.statvfs(prebuilt).f_flag & os.ST_NOEXEC:
            dest.touch(mode=0o444)
            return Path(prebuilt)
        log.warning("the lib dir %s is on a noexec mount and no ATROPOS_SLOTD binary is on an exec one: "
                    "slots run the Python supervisor", lib)
        return None
    binary = build()
    if binary is None:
        return None
    tmp = lib / f".{SLOTD}.tmp"
    shutil.copyfile(binary, tmp)
    os.chmod(tmp, 0o755)
    os.replace(tmp, dest)
    return dest
