"""The seccomp filter, checked against the real kernel through real bubblewrap.

One probe script runs every check inside a single sandbox and reports errno values as JSON, so
the whole module costs two sandbox starts (with and without the filter) instead of one per row.
"""

from __future__ import annotations

import errno
import json
import os
import platform
import shutil
import stat
import struct
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from atropos.errors import IsolationUnavailable
from atropos.sandbox.host.isolation import seccomp
from atropos.sandbox.host.isolation.seccomp import SeccompUnavailable, build_filter_bytes, write_filter

BWRAP = shutil.which("bwrap")

pytestmark = [
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="seccomp is Linux-only"),
    # The probe script uses raw x86_64 syscall numbers and the BPF checks x86_64 audit values.
    pytest.mark.skipif(platform.machine() != "x86_64", reason="probes use x86_64 syscall numbers"),
]

needs_bwrap = pytest.mark.skipif(BWRAP is None, reason="bubblewrap (bwrap) is not installed")

# Runs inside the sandbox under the distribution's python3. Every probe yields 0 on success or
# the errno it failed with, so the host side compares plain integers.
PROBE_SCRIPT = r"""
import ctypes, errno, fcntl, json, os, socket, subprocess, termios, threading

libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
CLONE_NEWUSER = 0x10000000
SIGCHLD = 17


def syscall(nr, *args):
    # Every argument as a full 64-bit long: variadic ints would leave the upper halves undefined.
    ctypes.set_errno(0)
    ret = libc.syscall(ctypes.c_long(nr), *(ctypes.c_long(a) for a in args))
    return ret, ctypes.get_errno()


def status(nr, *args):
    ret, err = syscall(nr, *args)
    return 0 if ret >= 0 else err


def mount():
    ctypes.set_errno(0)
    ret = libc.mount(b"none", b"/tmp", b"tmpfs", ctypes.c_ulong(0), None)
    return 0 if ret == 0 else ctypes.get_errno()


def in_child(nr, *args):
    # For calls that change the caller (new user namespace, being traced), so that a success does
    # not change the outcome of the probes after it.
    pid = os.fork()
    if pid == 0:
        os._exit(status(nr, *args))
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])


def clone_newuser():
    ret, err = syscall(56, CLONE_NEWUSER | SIGCHLD, 0, 0, 0, 0)
    if ret == 0:
        os._exit(0)
    if ret < 0:
        return err
    os.waitpid(ret, 0)
    return 0


def vsock():
    socket.socket(socket.AF_VSOCK, socket.SOCK_STREAM).close()
    return 0


def unix_socket():
    socket.socket(socket.AF_UNIX, socket.SOCK_STREAM).close()
    return 0


def ioctl(request, arg):
    _master, slave = os.openpty()
    fcntl.ioctl(slave, request, arg)
    return 0


def tiocsti_high_bits():
    # The kernel truncates ioctl's request to 32 bits, so a filter comparing all 64 would miss this.
    _master, slave = os.openpty()
    buf = ctypes.create_string_buffer(b"x")
    return status(16, slave, termios.TIOCSTI | (1 << 32), ctypes.addressof(buf))


def thread():
    box = []
    worker = threading.Thread(target=box.append, args=(1,))
    worker.start()
    worker.join()
    return 0 if box == [1] else -1


def run_true():
    return subprocess.run(["/bin/true"], check=False).returncode


def fork():
    pid = os.fork()
    if pid == 0:
        os._exit(7)
    code = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
    return 0 if code == 7 else -1


PROBES = {
    "unshare_user": lambda: in_child(272, CLONE_NEWUSER),
    "setns": lambda: status(308, -1, 0),
    "mount": mount,
    "keyctl": lambda: status(250, 0, -3, 0),  # KEYCTL_GET_KEYRING_ID of the session keyring
    "bpf": lambda: status(321, 0, 0, 0),
    "io_uring_setup": lambda: status(425, 1, 0),
    "ptrace_traceme": lambda: in_child(101, 0, 0, 0, 0),
    "clone_newuser": clone_newuser,
    "clone3": lambda: status(435, 0, 0),
    "socket_vsock": vsock,
    "ioctl_tiocsti": lambda: ioctl(termios.TIOCSTI, b"x"),
    "ioctl_tiocsti_high_bits": tiocsti_high_bits,
    "ioctl_tioclinux": lambda: ioctl(0x541C, b"\0"),
    "thread": thread,
    "subprocess": run_true,
    "fork": fork,
    "socket_unix": unix_socket,
    "ioctl_tiocgwinsz": lambda: ioctl(termios.TIOCGWINSZ, b"\0" * 8),
}

results = {}
for name, probe in PROBES.items():
    try:
        results[name] = probe()
    except OSError as exc:
        results[name] = exc.errno
    except Exception as exc:
        results[name] = repr(exc)
print(json.dumps(results))
"""

BWRAP_ARGS = (
    "--unshare-all", "--unshare-user", "--die-with-parent",
    "--ro-bind", "/usr", "/usr",
    "--symlink", "usr/bin", "/bin",
    "--symlink", "usr/lib", "/lib",
    "--symlink", "usr/lib64", "/lib64",
    "--proc", "/proc", "--dev", "/dev", "--tmpfs", "/tmp",
)  # fmt: skip

DENIED: dict[str, int] = {
    "unshare_user": errno.EPERM,
    "setns": errno.EPERM,
    "mount": errno.EPERM,
    "keyctl": errno.EPERM,
    "bpf": errno.EPERM,
    "io_uring_setup": errno.EPERM,
    "ptrace_traceme": errno.EPERM,
    "clone_newuser": errno.EPERM,
    "clone3": errno.ENOSYS,
    "socket_vsock": errno.EAFNOSUPPORT,
    "ioctl_tiocsti": errno.EPERM,
    "ioctl_tiocsti_high_bits": errno.EPERM,
    "ioctl_tioclinux": errno.EPERM,
}

ALLOWED = ("thread", "subprocess", "fork", "socket_unix", "ioctl_tiocgwinsz")


def _bwrap(*extra: str, pass_fds: tuple[int, ...] = ()) -> subprocess.CompletedProcess[str]:
    assert BWRAP is not None
    return subprocess.run(
        [BWRAP, *BWRAP_ARGS, *extra, "--", "/usr/bin/python3", "-c", PROBE_SCRIPT],
        pass_fds=pass_fds,
        env={},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def _run_probes(filter_path: Path | None) -> dict[str, int | str]:
    if filter_path is None:
        proc = _bwrap()
    else:
        # bwrap reads the program from the descriptor's current offset, so each run needs a
        # fresh descriptor.
        fd = os.open(filter_path, os.O_RDONLY)
        try:
            proc = _bwrap("--seccomp", str(fd), pass_fds=(fd,))
        finally:
            os.close(fd)
    assert proc.returncode == 0, f"sandbox failed (rc={proc.returncode}): {proc.stderr}"
    results: dict[str, int | str] = json.loads(proc.stdout)
    return results


def _describe(value: int | str) -> str:
    if isinstance(value, int) and value > 0:
        return f"{errno.errorcode.get(value, '?')} ({value})"
    return repr(value)


@pytest.fixture(scope="module")
def filter_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    try:
        return write_filter(tmp_path_factory.mktemp("seccomp") / "filter.bpf")
    except SeccompUnavailable as exc:
        pytest.skip(f"libseccomp unavailable: {exc}")


@pytest.fixture(scope="module")
def bwrap_usable() -> Iterator[None]:
    # Distinguishes "this host cannot run bubblewrap" (skip) from "our filter broke the sandbox"
    # (fail): only the former makes this plain, unfiltered start fail.
    if BWRAP is None:
        pytest.skip("bubblewrap (bwrap) is not installed")
    assert BWRAP is not None
    proc = subprocess.run(
        [BWRAP, *BWRAP_ARGS, "--", "/usr/bin/true"], env={}, capture_output=True, timeout=30, check=False
    )
    if proc.returncode != 0:
        pytest.skip(f"bubblewrap cannot create a sandbox here: {proc.stderr.decode(errors='replace')}")
    yield


@pytest.fixture(scope="module")
def filtered(bwrap_usable: None, filter_path: Path) -> dict[str, int | str]:
    return _run_probes(filter_path)


@pytest.fixture(scope="module")
def unfiltered(bwrap_usable: None) -> dict[str, int | str]:
    return _run_probes(None)


@needs_bwrap
@pytest.mark.parametrize(("probe", "expected"), DENIED.items(), ids=list(DENIED))
def test_denied_inside_sandbox(filtered: dict[str, int | str], probe: str, expected: int) -> None:
    got = filtered[probe]
    assert got == expected, f"{probe}: expected {_describe(expected)}, got {_describe(got)}"


@needs_bwrap
@pytest.mark.parametrize("probe", ALLOWED)
def test_ordinary_work_still_runs(filtered: dict[str, int | str], probe: str) -> None:
    got = filtered[probe]
    assert got == 0, f"{probe} should work under the filter, got {_describe(got)}"


@needs_bwrap
def test_without_filter_the_probes_differ(
    filtered: dict[str, int | str], unfiltered: dict[str, int | str]
) -> None:
    # Without this control, the denial tests would also pass if bwrap silently ignored --seccomp
    # (or the host already forbade everything): these rows must succeed in a plain bwrap sandbox.
    assert unfiltered["unshare_user"] == 0, _describe(unfiltered["unshare_user"])
    assert unfiltered["clone_newuser"] == 0, _describe(unfiltered["clone_newuser"])
    assert unfiltered["ptrace_traceme"] == 0, _describe(unfiltered["ptrace_traceme"])
    # clone3 with a zero-sized argument is rejected by the kernel with EINVAL, not ENOSYS.
    assert unfiltered["clone3"] == errno.EINVAL, _describe(unfiltered["clone3"])
    for probe in ALLOWED:
        assert unfiltered[probe] == filtered[probe] == 0


# --- The exported program itself, evaluated without the kernel --------------------------------

AUDIT_ARCH_X86_64 = 0xC000003E
AUDIT_ARCH_I386 = 0x40000003
SECCOMP_RET_ALLOW = 0x7FFF0000
SECCOMP_RET_KILL_THREAD = 0x00000000


def _errno_action(code: int) -> int:
    return 0x00050000 | code


def _run_bpf(program: bytes, nr: int, arch: int = AUDIT_ARCH_X86_64, args: tuple[int, ...] = ()) -> int:
    """Evaluate a classic-BPF seccomp program on one syscall; enough of cBPF for libseccomp output."""
    padded = (*args, *(0,) * (6 - len(args)))
    data = struct.pack("<iIQ6Q", nr, arch, 0, *(a & 0xFFFFFFFFFFFFFFFF for a in padded))
    insns: list[tuple[int, int, int, int]] = [
        struct.unpack_from("<HBBI", program, off) for off in range(0, len(program), 8)
    ]
    acc = 0
    pc = 0
    while True:
        code, jt, jf, k = insns[pc]
        pc += 1
        if code == 0x20:  # BPF_LD | BPF_W | BPF_ABS
            acc = struct.unpack_from("<I", data, k)[0]
        elif code == 0x54:  # BPF_ALU | BPF_AND | BPF_K
            acc &= k
        elif code == 0x06:  # BPF_RET | BPF_K
            return k
        elif code == 0x05:  # BPF_JMP | BPF_JA
            pc += k
        elif code in (0x15, 0x25, 0x35, 0x45):  # BPF_JMP | JEQ/JGT/JGE/JSET | BPF_K
            taken = {0x15: acc == k, 0x25: acc > k, 0x35: acc >= k, 0x45: bool(acc & k)}[code]
            pc += jt if taken else jf
        else:
            raise AssertionError(f"opcode {code:#x} not handled by this test's evaluator")


def _program() -> bytes:
    try:
        return build_filter_bytes()
    except SeccompUnavailable as exc:
        pytest.skip(f"libseccomp unavailable: {exc}")


def test_program_is_cached_and_well_formed() -> None:
    program = _program()
    assert program is build_filter_bytes()
    assert len(program) % 8 == 0
    # The first instruction must load seccomp_data.arch, or a foreign ABI could reuse our numbers.
    assert struct.unpack_from("<HBBI", program, 0) == (0x20, 0, 0, 4)
    assert issubclass(SeccompUnavailable, IsolationUnavailable)


def test_write_filter_is_atomic_and_world_readable(tmp_path: Path) -> None:
    _program()
    target = tmp_path / "filter.bpf"
    target.write_bytes(b"stale")
    assert write_filter(target) == target
    assert target.read_bytes() == build_filter_bytes()
    assert stat.S_IMODE(target.stat().st_mode) == 0o644
    assert sorted(p.name for p in tmp_path.iterdir()) == ["filter.bpf"]  # no temp file left


@pytest.mark.parametrize(
    ("nr", "arch", "args", "expected"),
    [
        pytest.param(0, AUDIT_ARCH_X86_64, (), SECCOMP_RET_ALLOW, id="read-allowed"),
        pytest.param(272, AUDIT_ARCH_X86_64, (0,), _errno_action(errno.EPERM), id="unshare"),
        pytest.param(56, AUDIT_ARCH_X86_64, (0x11,), SECCOMP_RET_ALLOW, id="clone-fork"),
        pytest.param(56, AUDIT_ARCH_X86_64, (0x3D0F00,), SECCOMP_RET_ALLOW, id="clone-thread"),
        pytest.param(56, AUDIT_ARCH_X86_64, (0x20000 | 0x11,), _errno_action(errno.EPERM), id="clone-newns"),
        pytest.param(56, AUDIT_ARCH_X86_64, (0x80,), _errno_action(errno.EPERM), id="clone-newtime"),
        pytest.param(435, AUDIT_ARCH_X86_64, (), _errno_action(errno.ENOSYS), id="clone3"),
        pytest.param(16, AUDIT_ARCH_X86_64, (0, 0x5412), _errno_action(errno.EPERM), id="tiocsti"),
        pytest.param(
            16, AUDIT_ARCH_X86_64, (0, 0x5412 | 1 << 63), _errno_action(errno.EPERM), id="tiocsti-hi"
        ),
        pytest.param(16, AUDIT_ARCH_X86_64, (0, 0x541C), _errno_action(errno.EPERM), id="tioclinux"),
        pytest.param(16, AUDIT_ARCH_X86_64, (0, 0x5413), SECCOMP_RET_ALLOW, id="tiocgwinsz"),
        pytest.param(41, AUDIT_ARCH_X86_64, (40, 1), _errno_action(errno.EAFNOSUPPORT), id="vsock"),
        pytest.param(
            41, AUDIT_ARCH_X86_64, (40 | 1 << 32, 1), _errno_action(errno.EAFNOSUPPORT), id="vsock-hi"
        ),
        pytest.param(41, AUDIT_ARCH_X86_64, (2, 1), SECCOMP_RET_ALLOW, id="inet"),
        # prlimit64(pid, resource, new, old): a process's own limits (pid 0: glibc's setrlimit, bash's
        # ulimit, Python's resource.setrlimit) and reading anyone's stay allowed; setting another's not
        pytest.param(302, AUDIT_ARCH_X86_64, (0, 7, 0x7FFF0000, 0), SECCOMP_RET_ALLOW, id="prlimit-self"),
        pytest.param(302, AUDIT_ARCH_X86_64, (0, 7, 0, 0x7FFF0000), SECCOMP_RET_ALLOW, id="prlimit-self-read"),
        pytest.param(302, AUDIT_ARCH_X86_64, (2, 7, 0, 0x7FFF0000), SECCOMP_RET_ALLOW, id="prlimit-read-other"),
        pytest.param(302, AUDIT_ARCH_X86_64, (2, 7, 0x7FFF0000, 0), _errno_action(errno.EPERM), id="prlimit-other"),
        pytest.param(302, AUDIT_ARCH_X86_64, (1 << 32, 7, 0x7FFF0000, 0), _errno_action(errno.EPERM),
                     id="prlimit-pid-hi"),
        pytest.param(302, AUDIT_ARCH_X86_64, (2, 7, 1 << 40, 0), _errno_action(errno.EPERM), id="prlimit-new-hi"),
        pytest.param(160, AUDIT_ARCH_X86_64, (7, 0x7FFF0000), SECCOMP_RET_ALLOW, id="setrlimit"),
        # i386 via int 0x80 and the x32 ABI have their own numbering; the filter does not describe them.
        pytest.param(3, AUDIT_ARCH_I386, (), SECCOMP_RET_KILL_THREAD, id="i386-killed"),
        pytest.param(0x40000000, AUDIT_ARCH_X86_64, (), SECCOMP_RET_KILL_THREAD, id="x32-killed"),
    ],
)
def test_program_decisions(nr: int, arch: int, args: tuple[int, ...], expected: int) -> None:
    assert _run_bpf(_program(), nr, arch, args) == expected


def test_every_deny_listed_name_is_a_syscall_here() -> None:
    # Unknown names are skipped silently (they are legitimately absent on some arches), so a typo
    # in the list would silently allow the call; on x86_64 every one of them must exist and be denied.
    program = _program()
    lib = seccomp._load_libseccomp()
    for name in seccomp._EPERM_SYSCALLS:
        nr = lib.seccomp_syscall_resolve_name(name.encode())
        assert nr >= 0, f"libseccomp does not know {name!r}"
        assert _run_bpf(program, nr) == _errno_action(errno.EPERM), name


def test_only_the_verification_runners_filter_allows_chroot() -> None:
    """The runner of an image slot's verification starts the programs it checks in the slot's root
    (atropos/sandbox/inslot/verifier.py); every other sandbox keeps chroot denied."""
    _program()
    chroot = 161
    assert _run_bpf(build_filter_bytes(), chroot) == _errno_action(errno.EPERM)
    runner = build_filter_bytes(allow_chroot=True)
    assert _run_bpf(runner, chroot) == SECCOMP_RET_ALLOW
    for nr, args in ((272, (0,)), (165, ()), (302, (2, 7, 0x7FFF0000, 0))):  # unshare, mount, prlimit: as before
        assert _run_bpf(runner, nr, AUDIT_ARCH_X86_64, args) == _errno_action(errno.EPERM), nr
