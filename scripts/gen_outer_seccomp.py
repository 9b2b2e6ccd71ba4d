#!/usr/bin/env python3
"""Generate the OUTER Docker seccomp profile for running bubblewrap inside a container.

See the isolation research notes, §4.3 ("The custom outer seccomp profile").

Docker's default profile only lets containers create namespaces when
they hold CAP_SYS_ADMIN; we want the opposite: no capabilities at all (``--cap-drop ALL``, non-root user),
but unprivileged user namespaces for bwrap. This profile therefore:

* denies by default (``SCMP_ACT_ERRNO``/EPERM), so syscalls unknown to this list stay denied;
* allows every x86_64 syscall that libseccomp knows, INCLUDING ``unshare``, ``setns``, ``mount``,
  ``umount2``, ``pivot_root`` and ``clone`` with any flags (bwrap needs them; without capabilities they
  only work inside a fresh user namespace);
* returns ENOSYS for ``clone3`` (flags behind a pointer; glibc falls back to ``clone``), as Docker does;
* restricts ``personality`` to the values Docker's default profile allows;
* never allows the kernel-attack-surface / host-global syscalls listed in ``NEVER_ALLOW``.

Syscall names are enumerated from the installed libseccomp through ctypes
(``seccomp_syscall_resolve_num_arch``); no Python dependency is needed.

Usage: ``python3 scripts/gen_outer_seccomp.py [-o atropos/backends/docker_seccomp.json]``
(sandbox_image/seccomp.json links to it)
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import fnmatch
import json
import sys
from pathlib import Path

# Never allowed, even though the caller is unprivileged (patterns use fnmatch syntax).
NEVER_ALLOW = [
    "acct", "add_key", "bpf", "clock_adjtime", "clock_settime", "settimeofday", "adjtimex",
    "*module*", "kexec_*", "keyctl", "request_key", "lookup_dcookie", "nfsservctl",
    "open_by_handle_at", "name_to_handle_at", "perf_event_open", "quotactl*", "reboot",
    "swapon", "swapoff", "sysfs", "_sysctl", "uselib", "userfaultfd", "ustat", "vm86*",
    "iopl", "ioperm", "kcmp", "process_vm_*", "ptrace", "pidfd_getfd", "process_madvise",
    "syslog", "vhangup", "fanotify_init", "*mempolicy", "mbind", "move_pages", "migrate_pages",
    "io_uring_*",
]  # fmt: skip

# Handled by dedicated rules below.
SPECIAL = {"clone3", "personality"}

ENOSYS = 38
EPERM = 1

# Docker's default profile: PER_LINUX, PER_LINUX32, UNAME26, UNAME26|PER_LINUX32, query (0xffffffff).
PERSONALITY_VALUES = [0x0, 0x8, 0x20000, 0x20008, 0xFFFFFFFF]

# Highest x86_64 syscall number to probe (real numbers end in the 400s; x32 ones carry bit 30).
MAX_NR = 1024


def _libseccomp() -> ctypes.CDLL:
    name = ctypes.util.find_library("seccomp") or "libseccomp.so.2"
    try:
        lib = ctypes.CDLL(name)
    except OSError as exc:  # pragma: no cover - depends on the machine
        sys.exit(f"libseccomp not found ({exc}); install libseccomp2")
    lib.seccomp_arch_resolve_name.argtypes = [ctypes.c_char_p]
    lib.seccomp_arch_resolve_name.restype = ctypes.c_uint32
    lib.seccomp_syscall_resolve_num_arch.argtypes = [ctypes.c_uint32, ctypes.c_int]
    lib.seccomp_syscall_resolve_num_arch.restype = ctypes.c_void_p  # malloc'd char*, we free it
    return lib


def known_syscalls(arch: str = "x86_64") -> list[str]:
    lib = _libseccomp()
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    libc.free.argtypes = [ctypes.c_void_p]
    token = lib.seccomp_arch_resolve_name(arch.encode())
    if token == 0:
        sys.exit(f"libseccomp does not know architecture {arch!r}")
    names: set[str] = set()
    for nr in range(MAX_NR):
        ptr = lib.seccomp_syscall_resolve_num_arch(token, nr)
        if ptr:
            name = ctypes.string_at(ptr).decode()
            libc.free(ptr)
            names.add(name)
    return sorted(names)


def never_allowed(name: str) -> bool:
    return any(fnmatch.fnmatchcase(name, pat) for pat in NEVER_ALLOW)


def build_profile(names: list[str]) -> dict:
    allowed = [n for n in names if n not in SPECIAL and not never_allowed(n)]
    syscalls: list[dict] = [{"names": allowed, "action": "SCMP_ACT_ALLOW"}]
    for v in PERSONALITY_VALUES:
        syscalls.append(
            {
                "names": ["personality"],
                "action": "SCMP_ACT_ALLOW",
                "args": [{"index": 0, "value": v, "op": "SCMP_CMP_EQ"}],
            }
        )
    syscalls.append({"names": ["clone3"], "action": "SCMP_ACT_ERRNO", "errnoRet": ENOSYS})
    return {
        "defaultAction": "SCMP_ACT_ERRNO",
        "defaultErrnoRet": EPERM,
        # x86_64 only: no i386/x32 compat entry points for anything in the container.
        "archMap": [{"architecture": "SCMP_ARCH_X86_64", "subArchitectures": []}],
        "syscalls": syscalls,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "-o",
        "--output",
        default=str(Path(__file__).resolve().parent.parent / "atropos" / "backends" / "docker_seccomp.json"),
    )
    ap.add_argument(
        "--check", action="store_true", help="exit 1 if the output file differs from what would be generated"
    )
    args = ap.parse_args(argv)

    names = known_syscalls()
    profile = build_profile(names)
    text = json.dumps(profile, indent=1) + "\n"
    out = Path(args.output)
    if args.check:
        same = out.exists() and out.read_text() == text
        print(f"{out}: {'up to date' if same else 'OUT OF DATE'}")
        return 0 if same else 1
    out.write_text(text)
    denied = [n for n in names if n not in SPECIAL and never_allowed(n)]
    print(
        f"wrote {out}: {len(names)} syscalls known, {len(profile['syscalls'][0]['names'])} allowed, "
        f"{len(denied)} never allowed, clone3 -> ENOSYS, personality restricted; {len(text)} bytes",
        file=sys.stderr,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
