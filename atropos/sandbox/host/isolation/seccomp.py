"""The seccomp filter handed to bubblewrap (``bwrap --seccomp FD``).

Namespaces, dropped capabilities and a read-only root already confine the sandboxed code; this
filter removes the kernel surface that those layers do not cover and that a coding agent never
needs: creating further namespaces (the usual first step of a user-namespace privilege
escalation), the mount API, keyrings, BPF, io_uring, tracing other processes, module loading,
terminal injection and so on.

The policy is a deny-list with a default of ALLOW. An allow-list would be tighter, but the
sandbox runs arbitrary toolchains (compilers, package managers, language runtimes) whose syscall
sets we cannot enumerate, and a missing entry there turns into flaky "works on my machine"
failures in training rather than a security report.

We build the BPF program with the system's libseccomp through ``ctypes`` so that no compiled
dependency is added; libseccomp knows each architecture's syscall numbers and emits the
architecture check for us.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import functools
import os
import pathlib
import tempfile

from atropos.errors import SeccompUnavailable as SeccompUnavailable  # defined there since issue 18

__all__ = ["SeccompUnavailable", "build_filter_bytes", "verifier_filter_path", "write_filter"]

# The verification runner's filter (atropos/sandbox/host/isolation/verification.py): the same, but
# chroot(2) allowed. The runner alone holds CAP_SYS_CHROOT (in its own user namespace) to start the
# programs it checks inside the slot's root; they drop it before they exec, so for them the call
# fails as everywhere else (EPERM).
VERIFIER_FILTER = "seccomp-verifier.bpf"


def _act_errno(code: int) -> int:
    return 0x00050000 | (code & 0xFFFF)


_SCMP_ACT_ALLOW = 0x7FFF0000
_EPERM = _act_errno(errno.EPERM)
_ENOSYS = _act_errno(errno.ENOSYS)
_EAFNOSUPPORT = _act_errno(errno.EAFNOSUPPORT)

# enum scmp_compare in <seccomp.h>; the numbering starts at 1 (0 is the _SCMP_CMP_MIN sentinel).
_SCMP_CMP_NE = 1
_SCMP_CMP_EQ = 4
_SCMP_CMP_MASKED_EQ = 7

# The kernel reads ioctl's request and socket's family as 32-bit ints and ignores the upper half
# of the register. An EQ on the full 64-bit value could be dodged by setting any upper bit, so we
# compare only the low 32 bits.
_LOW32 = 0xFFFFFFFF

# AUDIT_ARCH_S390 / AUDIT_ARCH_S390X: the only libseccomp arches whose clone() takes the stack
# first and the flags second.
_SCMP_ARCH_S390 = 0x00000016
_SCMP_ARCH_S390X = 0x80000016

# fmt: off
_EPERM_SYSCALLS: tuple[str, ...] = (
    # Namespaces and the mount API: the sandbox's own namespaces are set up by bwrap before the
    # filter is loaded; nested ones are the classic path to CAP_SYS_ADMIN over kernel code.
    "unshare", "setns", "mount", "umount2", "pivot_root", "chroot",
    "move_mount", "open_tree", "fsopen", "fsconfig", "fsmount", "fspick", "mount_setattr",
    # Kernel keyrings are not namespaced by user namespaces.
    "keyctl", "add_key", "request_key",
    # Large, bug-prone kernel attack surface with no legitimate use in the sandbox.
    "bpf", "perf_event_open", "userfaultfd",
    "io_uring_setup", "io_uring_enter", "io_uring_register",
    # Reading or steering other processes (and their file descriptors).
    "ptrace", "process_vm_readv", "process_vm_writev", "kcmp", "pidfd_getfd",
    # Host-wide state: kernels, modules, power, swap, accounting, quotas, clocks, logs.
    "kexec_load", "kexec_file_load", "init_module", "finit_module", "delete_module",
    "reboot", "swapon", "swapoff", "acct", "quotactl", "quotactl_fd",
    "syslog", "settimeofday", "clock_settime", "clock_adjtime", "adjtimex",
    # File handles bypass path-based confinement (the "shocker" container escape).
    "open_by_handle_at", "name_to_handle_at", "lookup_dcookie",
    # Miscellaneous legacy or hardware-facing calls.
    "fanotify_init", "uselib", "ioperm", "iopl", "vhangup",
    # NUMA policy lets one tenant disturb memory placement of the whole host.
    "mbind", "set_mempolicy", "migrate_pages", "move_pages",
)
# fmt: on

_CLONE_NAMESPACE_FLAGS: tuple[int, ...] = (
    0x00020000,  # CLONE_NEWNS
    0x02000000,  # CLONE_NEWCGROUP
    0x04000000,  # CLONE_NEWUTS
    0x08000000,  # CLONE_NEWIPC
    0x10000000,  # CLONE_NEWUSER
    0x20000000,  # CLONE_NEWPID
    0x40000000,  # CLONE_NEWNET
    # CLONE_NEWTIME overlaps the exit-signal byte of clone(); no valid signal number (< 128)
    # sets it, so denying the bit never breaks an ordinary fork.
    0x00000080,  # CLONE_NEWTIME
)

_TIOCSTI = 0x5412  # pushes bytes into a terminal's input queue: keystroke injection
_TIOCLINUX = 0x541C  # virtual console subcommands, some of which can also inject input
_AF_VSOCK = 40  # reaches the hypervisor host, which our network namespace does not cover


class _ArgCmp(ctypes.Structure):
    # struct scmp_arg_cmp; enum scmp_compare is int-sized on every ABI libseccomp supports.
    _fields_ = [
        ("arg", ctypes.c_uint),
        ("op", ctypes.c_int),
        ("datum_a", ctypes.c_uint64),
        ("datum_b", ctypes.c_uint64),
    ]


def _masked_eq(arg: int, mask: int, value: int) -> _ArgCmp:
    return _ArgCmp(arg, _SCMP_CMP_MASKED_EQ, mask, value)


@functools.lru_cache(maxsize=1)
def _load_libseccomp() -> ctypes.CDLL:
    # The soname first: find_library() shells out to ldconfig, which minimal images may lack.
    candidates = ["libseccomp.so.2"]
    found = ctypes.util.find_library("seccomp")
    if found:
        candidates.append(found)
    last_error: OSError | None = None
    for name in candidates:
        try:
            lib = ctypes.CDLL(name, use_errno=True)
            break
        except OSError as exc:
            last_error = exc
    else:
        raise SeccompUnavailable(
            "libseccomp could not be loaded, so no syscall filter can be built and sandboxes will "
            f"not start; install it with `apt-get install libseccomp2` ({last_error})"
        )

    # Without explicit prototypes ctypes would pass the context pointer as a C int and truncate
    # it on 64-bit hosts.
    lib.seccomp_init.argtypes = [ctypes.c_uint32]
    lib.seccomp_init.restype = ctypes.c_void_p
    lib.seccomp_release.argtypes = [ctypes.c_void_p]
    lib.seccomp_release.restype = None
    lib.seccomp_syscall_resolve_name.argtypes = [ctypes.c_char_p]
    lib.seccomp_syscall_resolve_name.restype = ctypes.c_int
    lib.seccomp_arch_native.argtypes = []
    lib.seccomp_arch_native.restype = ctypes.c_uint32
    # seccomp_rule_add() is variadic and ctypes cannot pass 64-bit variadic structs portably;
    # the _array form takes a plain pointer.
    lib.seccomp_rule_add_array.argtypes = [
        ctypes.c_void_p,
        ctypes.c_uint32,
        ctypes.c_int,
        ctypes.c_uint,
        ctypes.POINTER(_ArgCmp),
    ]
    lib.seccomp_rule_add_array.restype = ctypes.c_int
    lib.seccomp_export_bpf.argtypes = [ctypes.c_void_p, ctypes.c_int]
    lib.seccomp_export_bpf.restype = ctypes.c_int
    return lib


def _add_rule(lib: ctypes.CDLL, ctx: int, action: int, name: str, *cmps: _ArgCmp) -> None:
    nr = lib.seccomp_syscall_resolve_name(name.encode())
    if nr < 0:
        # Not a syscall on this architecture (e.g. ioperm outside x86): nothing to deny.
        return
    array = (_ArgCmp * len(cmps))(*cmps) if cmps else None
    rc = lib.seccomp_rule_add_array(ctx, action, nr, len(cmps), array)
    if rc < 0:
        raise SeccompUnavailable(f"libseccomp rejected the rule for {name}: {os.strerror(-rc)}")


def _populate(lib: ctypes.CDLL, ctx: int, allow_chroot: bool) -> None:
    for name in _EPERM_SYSCALLS:
        if not (allow_chroot and name == "chroot"):
            _add_rule(lib, ctx, _EPERM, name)

    clone_flags_arg = 1 if lib.seccomp_arch_native() in (_SCMP_ARCH_S390, _SCMP_ARCH_S390X) else 0
    # Several rules on one syscall are OR-ed by libseccomp, so one per flag means "any of them".
    for flag in _CLONE_NAMESPACE_FLAGS:
        _add_rule(lib, ctx, _EPERM, "clone", _masked_eq(clone_flags_arg, flag, flag))

    # clone3 passes its flags in a struct in user memory, which seccomp cannot read. ENOSYS
    # (rather than EPERM) makes glibc fall back to clone(), whose flags the rules above inspect.
    _add_rule(lib, ctx, _ENOSYS, "clone3")

    for request in (_TIOCSTI, _TIOCLINUX):
        _add_rule(lib, ctx, _EPERM, "ioctl", _masked_eq(1, _LOW32, request))

    # Changing the resource limits of another process (prlimit64 with a pid and a new limit): a
    # call could lower its own supervisor's, and every later call would fail as if the host had.
    # glibc's setrlimit (bash's ulimit, Python's resource.setrlimit) passes pid 0, and reading any
    # process's limits (no new limit) stays allowed. Compared on all 64 bits: a pid with only upper
    # bits set (the kernel reads 0) is refused too, never let through.
    _add_rule(lib, ctx, _EPERM, "prlimit64", _ArgCmp(0, _SCMP_CMP_NE, 0, 0), _ArgCmp(2, _SCMP_CMP_NE, 0, 0))

    # EAFNOSUPPORT is what a kernel without vsock says, so programs take their "no vsock" path.
    _add_rule(lib, ctx, _EAFNOSUPPORT, "socket", _masked_eq(0, _LOW32, _AF_VSOCK))


@functools.lru_cache(maxsize=2)
def build_filter_bytes(allow_chroot: bool = False) -> bytes:
    """Return the filter as a classic-BPF program (``struct sock_filter[]``) for the native arch.

    Syscalls made under any other architecture (i386 ``int 0x80``, x32) hit libseccomp's default
    bad-arch action and kill the caller, because our per-arch rules do not describe them.
    """
    lib = _load_libseccomp()
    ctx = lib.seccomp_init(_SCMP_ACT_ALLOW)
    if not ctx:
        raise SeccompUnavailable("seccomp_init failed; libseccomp does not support this architecture")
    try:
        _populate(lib, ctx, allow_chroot)
        # An unnamed temporary file rather than a pipe: export writes the whole program before
        # returning, and a pipe would deadlock if it ever outgrew the pipe buffer.
        with tempfile.TemporaryFile() as out:
            rc = lib.seccomp_export_bpf(ctx, out.fileno())
            if rc < 0:
                raise SeccompUnavailable(f"seccomp_export_bpf failed: {os.strerror(-rc)}")
            out.seek(0)
            program = out.read()
    finally:
        lib.seccomp_release(ctx)
    # Each struct sock_filter is 8 bytes; anything else means the export was truncated.
    if not program or len(program) % 8:
        raise SeccompUnavailable(f"seccomp_export_bpf produced a malformed program ({len(program)} bytes)")
    return program


def verifier_filter_path(path: str | pathlib.Path) -> pathlib.Path:
    """Where the host writes the verification runner's filter, beside the slots' filter ``path``."""
    return pathlib.Path(path).with_name(VERIFIER_FILTER)


def write_filter(path: pathlib.Path, allow_chroot: bool = False) -> pathlib.Path:
    """Write the filter to ``path`` atomically, world-readable, and return ``path``.

    Sandboxes may be starting concurrently and open the file at any moment; rename guarantees
    they see either the previous complete program or the new one, never a partial write that
    bwrap would reject (or, worse, accept as a shorter filter).
    """
    path = pathlib.Path(path)
    program = build_filter_bytes(allow_chroot)
    fd, tmp_name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as tmp:
            tmp.write(program)
            tmp.flush()
            # mkstemp creates 0600; the sandbox launcher may run under another user.
            os.fchmod(tmp.fileno(), 0o644)
            os.fsync(tmp.fileno())
        os.replace(tmp_name, path)
    except BaseException:
        try:
            os.unlink(tmp_name)
        except FileNotFoundError:
            pass
        raise
    return path
