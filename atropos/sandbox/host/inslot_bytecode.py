"""Bytecode of the in-slot programs, compiled once per host start instead of once per sandbox.

Every sandbox runs ``python3 -I -S /run/atropos/supervisor.py`` from the read-only lib dir, where it
cannot cache anything: each start compiled the supervisor and every module it imports again (about
half the supervisor's start-up CPU, measured by benchmarks/scenario_slot_cycle.py). The host
compiles them once, with the very interpreter the sandboxes run (``HostConfig.python``: the same
file, the sandbox's ``/usr`` is the host's), into the lib dir: modules into ``__pycache__`` (found
by the ordinary import system, checked against their source's mtime and size), and the entry
scripts into ``<name>.pyc`` beside them, which the host runs instead of the source when it exists
(``entry``: a script run as ``__main__`` is never read from a cache). The lib dir is root's (or
the host user's) and read-only in every sandbox, so no slot can plant bytecode there.

A failure to compile (another interpreter, a read-only dir) leaves the sources, which run as before.
"""

from __future__ import annotations

import logging
import subprocess
from pathlib import Path

log = logging.getLogger(__name__)

# Run as __main__ at every sandbox start of a slot (the terminal's tmux through ``exec_program``):
# read from ``<name>.pyc``.
# The python_session driver and the verifier stay sources: the session runs the agent's code in its
# own __main__ (its file name is part of what the agent sees), the verifier starts once per lease.
COMPILED_ENTRIES = ("supervisor.py", "exec_program.py")

_COMPILE = """\
import py_compile, sys
lib, entries = sys.argv[1], sys.argv[2].split(",")
for name in sys.argv[3:]:
    py_compile.compile(f"{lib}/{name}", doraise=True)
    if name in entries:
        py_compile.compile(f"{lib}/{name}", cfile=f"{lib}/{name}c", doraise=True)
"""


def compile_lib(python: str, lib: Path, names: tuple[str, ...]) -> bool:
    """Compile the lib dir's ``names`` with the sandbox's interpreter; False (logged) if it could not."""
    for name in COMPILED_ENTRIES:  # never run an entry's bytecode of an earlier source
        (lib / f"{name}c").unlink(missing_ok=True)
    try:
        out = subprocess.run([python, "-I", "-S", "-c", _COMPILE, str(lib), ",".join(COMPILED_ENTRIES), *names],
                             capture_output=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired) as exc:
        log.warning("in-slot programs not precompiled (every sandbox start compiles them): %s", exc)
        return False
    if out.returncode != 0:
        log.warning("in-slot programs not precompiled (every sandbox start compiles them): %s",
                    out.stderr.decode(errors="replace")[-500:])
        return False
    return True


def entry(lib: Path, script: str) -> str:
    """The file to run for ``script``: its compiled form when the host made one, else the source."""
    return f"{script}c" if script in COMPILED_ENTRIES and (lib / f"{script}c").is_file() else script
