"""The in-slot programs are compiled once per host start (atropos/sandbox/host/inslot_bytecode.py).

What a host relies on: the sandbox runs the bytecode of the very sources it wrote (never an earlier
host's), the modules' bytecode is what the import system picks up (it would otherwise compile them at
every sandbox start in the read-only lib dir), and a host that cannot compile still runs the sources.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from importlib import resources
from pathlib import Path

from atropos.sandbox.host.config import HostConfig
from atropos.sandbox.host.inslot_bytecode import COMPILED_ENTRIES, compile_lib, entry
from atropos.sandbox.inslot import LIB_FILES

PYTHON = HostConfig.model_fields["python"].default


def lib_copy(tmp_path: Path) -> Path:
    lib = tmp_path / "lib"
    lib.mkdir()
    for name in LIB_FILES:
        (lib / name).write_bytes(resources.files("atropos.sandbox.inslot").joinpath(name).read_bytes())
    return lib


def test_the_entry_runs_from_bytecode_and_its_modules_are_not_compiled_again(tmp_path: Path) -> None:
    lib = lib_copy(tmp_path)
    assert compile_lib(PYTHON, lib, LIB_FILES)
    assert entry(lib, "supervisor.py") == "supervisor.pyc" and entry(lib, "session.py") == "session.py"
    # Blank every module's source, keeping its size and mtime (what the cache is checked against):
    # the supervisor still imports its modules only if they are read from the host's bytecode.
    for name in ("inslot_common.py", "inslot_files.py", "inslot_warm.py", "inslot_fs.py"):
        path = lib / name
        st = path.stat()
        path.write_bytes(b" " * st.st_size)
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    lib.chmod(0o555)  # as in a sandbox: nothing can be written there
    try:
        # the entry's bytecode runs as the host runs it, and gets as far as its configuration
        run = subprocess.run([PYTHON, "-I", "-S", str(lib / "supervisor.pyc"), "{not json"], capture_output=True,
                             text=True, stdin=subprocess.DEVNULL)
        assert run.returncode != 0 and "JSONDecodeError" in run.stderr, run.stderr
    finally:
        lib.chmod(0o755)


def test_bytecode_of_an_earlier_source_is_never_run(tmp_path: Path) -> None:
    lib = lib_copy(tmp_path)
    assert compile_lib(PYTHON, lib, LIB_FILES)
    (lib / "supervisor.py").write_text("raise SystemExit('the new source')\n")
    assert not compile_lib("/nonexistent/python3", lib, LIB_FILES)  # the new host cannot compile
    assert entry(lib, "supervisor.py") == "supervisor.py", "the old bytecode would run"
    run = subprocess.run([PYTHON, "-I", "-S", str(lib / entry(lib, "supervisor.py"))], capture_output=True,
                         text=True)
    assert "the new source" in run.stderr


def test_a_host_whose_interpreter_cannot_compile_runs_the_sources(tmp_path: Path) -> None:
    lib = lib_copy(tmp_path)
    broken = tmp_path / "python3"
    broken.write_text("#!/bin/sh\nexit 3\n")
    broken.chmod(0o755)
    assert not compile_lib(str(broken), lib, LIB_FILES)
    assert not any((lib / f"{e}c").exists() for e in COMPILED_ENTRIES)
    assert [entry(lib, name) for name in LIB_FILES] == list(LIB_FILES)
    shutil.rmtree(lib)
