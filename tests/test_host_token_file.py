"""``--token-file``: the host takes its token only from a file no one else can read, reads it once and
removes it (how a Nomad task gets it: tests/test_nomad_backend.py runs that end to end)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from atropos.sandbox.host.main import TokenFileRefused, read_token_file


def token_file(tmp_path: Path, mode: int, text: str = "t0ken\n") -> Path:
    path = tmp_path / "token"
    path.write_text(text)
    os.chmod(path, mode)
    return path


@pytest.mark.parametrize("mode", [0o400, 0o600])
def test_a_private_token_file_is_read_once_and_removed(tmp_path: Path, mode: int) -> None:
    path = token_file(tmp_path, mode)
    assert read_token_file(path) == "t0ken"
    assert not path.exists()


@pytest.mark.parametrize("mode", [0o644, 0o640, 0o604, 0o420, 0o402])
def test_a_token_file_group_or_others_can_reach_is_refused_and_left_alone(tmp_path: Path, mode: int) -> None:
    path = token_file(tmp_path, mode)
    with pytest.raises(TokenFileRefused, match=f"mode {mode:04o} gives group or others access; a token file "
                                               "must be 0400 or 0600"):
        read_token_file(path)
    assert path.exists()  # not ours to judge further: the operator sees what was refused


def test_a_token_file_of_another_user_is_refused(tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("giving a file to another uid needs root")
    path = token_file(tmp_path, 0o400)
    os.chown(path, 65534, 65534)
    with pytest.raises(TokenFileRefused, match=f"owned by uid 65534, not by this host's uid {os.geteuid()}"):
        read_token_file(path)


def test_a_link_a_fifo_an_empty_or_a_missing_file_is_refused(tmp_path: Path) -> None:
    real = token_file(tmp_path, 0o400)
    link = tmp_path / "link"
    link.symlink_to(real)
    with pytest.raises(TokenFileRefused, match="a symbolic link"):
        read_token_file(link)
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo, 0o600)
    with pytest.raises(TokenFileRefused, match="not a regular file"):  # and no wait for a writer
        read_token_file(fifo)
    empty = tmp_path / "empty"
    empty.touch(mode=0o600)
    with pytest.raises(TokenFileRefused, match="empty"):
        read_token_file(empty)
    with pytest.raises(TokenFileRefused, match="cannot open it"):
        read_token_file(tmp_path / "missing")
    assert real.read_text() == "t0ken\n"


def test_the_host_refuses_to_start_on_a_readable_token_file(tmp_path: Path) -> None:
    path = token_file(tmp_path, 0o644)
    env = {k: v for k, v in os.environ.items() if k != "ATROPOS_SANDBOX_TOKEN"}
    proc = subprocess.run([sys.executable, "-m", "atropos.sandbox", "--port", "0", "--data-dir", str(tmp_path / "d"),
                           "--token-file", str(path)], capture_output=True, text=True, timeout=60, env=env)
    assert proc.returncode == 2 and proc.stdout == ""  # usage error, nothing announced
    assert f"error: --token-file {path}: mode 0644 gives group or others access" in proc.stderr
