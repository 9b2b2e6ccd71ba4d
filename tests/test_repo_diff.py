"""The verification root's upper layer (atropos/sandbox/host/workspace/repo_diff.py) against the
real overlayfs: an agent's changes made through a mounted overlay, the new layer built from its
upper layer, and the new root mounted over the same lower layer shows exactly the repository
changes (deletions, renamed directories, links inside the repository) and the image's tests,
and nothing else (changes outside the repository, caches, ``.git``, links out of it)."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from atropos.sandbox.host.workspace import repo_diff

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="overlay mounts with trusted xattrs need root")


def sh(script: str, cwd: Path) -> None:
    subprocess.run(["bash", "-ec", script], cwd=cwd, check=True)


def tree(root: Path) -> dict[str, str]:
    """Every file and link under ``root``: its content, or ``-> target`` for a link."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in [*filenames, *(d for d in dirnames if os.path.islink(os.path.join(dirpath, d)))]:
            path = os.path.join(dirpath, name)
            rel = os.path.relpath(path, root)
            out[rel] = f"-> {os.readlink(path)}" if os.path.islink(path) else Path(path).read_text().strip()
    return out


@pytest.fixture
def layers(tmp_path: Path) -> Iterator[Path]:
    for d in ("l0", "u", "w", "m", "p", "u2", "w2", "m2"):
        (tmp_path / d).mkdir()
    sh("mkdir -p l0/testbed/pkg l0/testbed/tests l0/testbed/sub l0/etc && echo bug > l0/testbed/pkg/a.py && "
       "echo test > l0/testbed/tests/test_a.py && echo help > l0/testbed/tests/helpers.py && "
       "echo x > l0/testbed/sub/x.py && echo old > l0/testbed/pkg/gone.py && echo conf > l0/etc/conf && "
       "echo cfg > l0/testbed/setup.cfg", tmp_path)
    opts = "redirect_dir=on,metacopy=off,index=off"
    sh(f"mount -t overlay overlay -o lowerdir=l0,upperdir=u,workdir=w,{opts} m && mount --bind l0 p && "
       "mount -o remount,bind,ro p", tmp_path)
    try:
        yield tmp_path
    finally:
        for d in ("m2", "m", "p"):
            subprocess.run(["umount", str(tmp_path / d)], capture_output=True)


def fresh(base: Path, from_image: list[str]) -> tuple[dict[str, str], dict[str, object]]:
    summary = repo_diff.build({"source": str(base / "u"), "merged": str(base / "m"), "repo": "/testbed",
                               "from_image": from_image}, upper=str(base / "u2"), pristine=str(base / "p"),
                              userns=False)
    sh("mount -t overlay overlay -o lowerdir=l0,upperdir=u2,workdir=w2,redirect_dir=on,metacopy=off,index=off m2",
       base)
    return tree(base / "m2"), summary


def test_only_the_repositorys_changes_and_the_images_tests_reach_the_new_root(layers: Path) -> None:
    sh("cd m && echo fix > testbed/pkg/a.py && rm testbed/pkg/gone.py && echo forged > testbed/tests/test_a.py && "
       "echo forged > testbed/tests/helpers.py && echo planted > testbed/tests/conftest.py && "
       "mkdir -p testbed/pkg/__pycache__ testbed/tests/__pycache__ testbed/.pytest_cache && "
       "echo c > testbed/pkg/__pycache__/a.cpython-311.pyc && echo c > testbed/tests/__pycache__/t.pyc && "
       "echo c > testbed/pkg/b.pyc && echo c > testbed/.pytest_cache/v && echo evil > etc/conf && "
       "echo preload > etc/ld.so.preload && mv testbed/sub testbed/moved && ln -s /etc/conf testbed/out && "
       "ln -s ../../etc/conf testbed/pkg/climb && ln -s pkg/a.py testbed/inside && echo new > testbed/new.py && "
       "mkdir -p testbed/.git && echo ref > testbed/.git/HEAD && echo changed > testbed/setup.cfg && "
       "mkfifo testbed/fifo && truncate -s 1T testbed/sparse.bin", layers)
    got, summary = fresh(layers, ["tests", "setup.cfg", "conftest.py"])
    assert got == {
        "etc/conf": "conf",  # outside the repository: the image's
        "testbed/pkg/a.py": "fix", "testbed/moved/x.py": "x", "testbed/new.py": "new",
        "testbed/inside": "-> pkg/a.py",
        "testbed/tests/test_a.py": "test", "testbed/tests/helpers.py": "help",  # the image's test dir, whole
        "testbed/setup.cfg": "cfg",
    }, got
    assert summary["whiteouts"] == 2, summary  # gone.py, and sub (moved)
    assert sorted(summary["dropped"]) == ["fifo", "out -> /etc/conf", "pkg/climb -> ../../etc/conf",
                                          "sparse.bin (sparse: 1099511627776 bytes in 0)"], summary


def test_a_test_directory_swapped_for_a_link_becomes_the_images_again(layers: Path) -> None:
    sh("cd m/testbed && cp -r tests forged && echo forged > forged/test_a.py && rm -rf tests && ln -s forged tests",
       layers)
    got, _ = fresh(layers, ["tests/test_a.py"])
    assert got["testbed/tests/test_a.py"] == "test" and got["testbed/tests/helpers.py"] == "help", got


def test_a_repository_the_agent_deleted_is_empty_but_for_the_images_tests(layers: Path) -> None:
    sh("rm -rf m/testbed", layers)
    got, _ = fresh(layers, ["tests/test_a.py"])
    assert got == {"etc/conf": "conf", "testbed/tests/test_a.py": "test"}, got


def test_a_path_the_image_lacks_is_absent(layers: Path) -> None:
    sh("cd m/testbed && echo planted > conftest.py && echo planted > tests/conftest.py", layers)
    got, _ = fresh(layers, ["conftest.py", "tests/conftest.py"])
    assert "testbed/conftest.py" not in got and "testbed/tests/conftest.py" not in got, got


def test_paths_that_leave_the_repository_are_refused(layers: Path) -> None:
    with pytest.raises(ValueError, match="not a relative path"):
        fresh(layers, ["../etc/conf"])


@pytest.mark.parametrize(("repo_dir", "from_image"), [
    ("/testbed", ["../etc/passwd"]), ("/testbed", ["/etc/passwd"]), ("/testbed", ["tests//x"]),
    ("/", []), ("testbed", []), ("/testbed/../etc", []), ("/testbed", ["./x"])])
def test_a_fresh_root_request_names_plain_paths_only(repo_dir: str, from_image: list[str]) -> None:
    from pydantic import ValidationError

    from atropos.sandbox.contract.protocol import FreshRoot

    with pytest.raises(ValidationError):
        FreshRoot(repo_dir=repo_dir, from_image=from_image)
    assert FreshRoot(repo_dir="/testbed", from_image=["tests", "setup.cfg"]).repo_dir == "/testbed"
