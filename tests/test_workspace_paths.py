"""One filesystem view for every tool (issue 20, finding 1): an absolute path means the same file
in the file tools, the REST file routes and bash; a path that leaves the workspace is refused with
``path_escape``, never silently re-rooted into it. Real host, real bubblewrap, real HTTP."""

from __future__ import annotations

import secrets

import pytest
from conftest import LeasedSlot, RunningHost, slot_path

from atropos.errors import PathEscapeError


async def test_write_file_at_workspace_path_is_what_bash_reads(slot: LeasedSlot) -> None:
    wrote = await slot.ok("write_file", path="/workspace/data.txt", content="1\n2\n")
    assert wrote["path"] == "/workspace/data.txt"
    out = await slot.sh("cat /workspace/data.txt; ls /workspace")
    assert out["stdout"] == "1\n2\ndata.txt\n", out  # no /workspace/workspace/data.txt
    assert (await slot.ok("read_file", path="/workspace/data.txt"))["content"] == "1\n2\n"
    assert (await slot.ok("read_file", path="data.txt"))["content"] == "1\n2\n"


async def test_file_tools_report_the_path_bash_sees(slot: LeasedSlot) -> None:
    wrote = await slot.ok("write_file", path="sub//dir/./f.txt", content="x")
    assert wrote["path"] == "/workspace/sub/dir/f.txt"
    edited = await slot.ok("edit_file", path="/workspace/sub/dir/f.txt", old_string="x", new_string="y")
    assert edited["path"] == "/workspace/sub/dir/f.txt"
    assert (await slot.ok("list_dir", path="/workspace/sub"))["path"] == "/workspace/sub"
    assert (await slot.ok("stat", path="sub/dir/f.txt"))["path"] == "/workspace/sub/dir/f.txt"
    assert (await slot.sh("cat /workspace/sub/dir/f.txt"))["stdout"] == "y"
    out = await slot.sh("pwd", workdir="/workspace/sub")
    assert out["stdout"] == "/workspace/sub\n"


@pytest.mark.parametrize("path", ["/etc/passwd", "/tmp/evil", "/", "/workspacex/f", "/proc/self/environ"])
async def test_absolute_paths_outside_the_workspace_are_refused(slot: LeasedSlot, path: str) -> None:
    for tool, args in (("read_file", {}), ("write_file", {"content": "x"}), ("stat", {}), ("list_dir", {}),
                       ("archive", {})):
        r = await slot.call(tool, path=path, **args)
        assert not r.ok and r.error is not None, (tool, path, r)
        assert r.error.code == "path_escape", (tool, path, r.error)
        assert "outside the workspace" in r.error.message
    # nothing was written inside the workspace in its place (the old behaviour re-rooted it)
    assert (await slot.sh("find . -mindepth 1 | wc -l"))["stdout"].strip() == "0"


@pytest.mark.parametrize("path", ["../../tmp/evil", "d/../../evil", "/workspace/../tmp/evil", "up/evil"])
async def test_dotdot_and_symlinks_leaving_the_workspace_are_refused(slot: LeasedSlot, path: str) -> None:
    await slot.sh("mkdir d; ln -s .. up")
    r = await slot.call("write_file", path=path, content="x")
    assert not r.ok and r.error is not None and r.error.code == "path_escape", r
    assert "leaves the workspace" in r.error.message or "outside the workspace" in r.error.message
    assert (await slot.sh("find . -name evil | wc -l"))["stdout"].strip() == "0"


async def test_absolute_symlink_is_refused_not_rerooted(slot: LeasedSlot) -> None:
    # bash follows /etc/hostname to the sandbox's file; a re-rooting file tool would read
    # /workspace/etc/hostname instead: two different files under one name.
    await slot.sh("mkdir etc; echo planted > etc/hostname; ln -s /etc/hostname link")
    r = await slot.call("read_file", path="link")
    assert not r.ok and r.error is not None and r.error.code == "path_escape", r


async def test_dotdot_inside_the_workspace_still_works(slot: LeasedSlot) -> None:
    await slot.ok("write_file", path="a/b/../c.txt", content="ok")
    assert (await slot.sh("cat /workspace/a/c.txt"))["stdout"] == "ok"


async def test_rest_upload_to_workspace_path_lands_where_bash_looks(slot: LeasedSlot, host: RunningHost) -> None:
    name = f"up-{secrets.token_hex(4)}.txt"
    out = await slot.client.write_bytes(slot.lease.slot, slot.lease.lease, f"/workspace/{name}", b"42\n")
    assert out["path"] == f"/workspace/{name}"
    assert (await slot.sh(f"cat /workspace/{name}"))["stdout"] == "42\n"
    assert (slot_path(host.data_dir, slot.lease.slot) / name).read_bytes() == b"42\n"
    assert await slot.client.read_bytes(slot.lease.slot, slot.lease.lease, f"/workspace/{name}") == b"42\n"
    for bad in ("../../tmp/evil", "/tmp/evil"):
        with pytest.raises(PathEscapeError):
            await slot.client.write_bytes(slot.lease.slot, slot.lease.lease, bad, b"x")
