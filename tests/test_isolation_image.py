"""The isolation catalogue (tests/test_isolation.py) on a slot whose root is a task image
(docs/task-images.md): the same attacks, run by the image's root user instead of the default
slot's uid 1000, must fail the same way. The rows here are those that do not look at the default
root's layout (``/workspace``, the host-side workspace dir); test_image_roots.py covers what is
particular to an image root (its mount points, its helpers, its writable layer's cap)."""

from __future__ import annotations

import secrets
from collections.abc import AsyncIterator

import pytest

from tests.conftest import LeasedSlot, RunningHost
from tests.test_image_roots import _docker_ok, roots_image  # noqa: F401 - the fixture, used below
from tests.test_isolation import (  # noqa: F401 - collected here with this module's slot fixture
    test_r01_etc_shadow_unreadable,
    test_r08_fifo_does_not_hang,
    test_r09_dev_zero_and_special_files_refused,
    test_r10_nul_byte_in_path_or_command,
    test_r12_huge_command_goes_through_stdin,
    test_r13_egress_unreachable,
    test_r14_host_api_unreachable_from_slot,
    test_r15_host_abstract_unix_socket_unreachable,
    test_r16_vsock_refused,
    test_r20_r26_dangerous_syscalls_eperm,
    test_r20_strace_refused,
    test_r21_core_pattern_not_writable,
    test_r22_sysrq_kcore_sys_denied,
    test_r23_proc1_exe_not_writable,
    test_r24_r25_unshare_mount_mknod_fail,
    test_r28_cannot_raise_limits,
    test_r29_tiocsti_refused_and_no_controlling_tty,
    test_r31_memory_hog_memoryerror,
    test_r32_file_size_limit,
    test_r34_tmpfs_caps,
    test_r36_output_flood_truncated_host_memory_bounded,
    test_r37_binary_output,
)

pytestmark = pytest.mark.skipif(not _docker_ok(), reason="needs the Docker engine and the project's base image")


@pytest.fixture
async def slot(host: RunningHost, roots_image: str) -> AsyncIterator[LeasedSlot]:  # noqa: F811
    """A slot of the session host whose root is a task image (WorkingDir /testbed, where the
    catalogue's relative paths land), as the catalogue's ``slot``."""
    client = host.client()
    lease = await client.lease(f"img-cat-{secrets.token_hex(4)}")
    try:
        result = await client.reset(lease.slot, lease.lease, image=roots_image)
        assert result.ok and result.lease is not None, result.detail
        lease = result.lease
        yield LeasedSlot(client, lease)
    finally:
        try:
            await client.release(lease.slot, lease.lease)
        finally:
            await client.aclose()
