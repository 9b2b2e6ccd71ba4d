"""The programs that run *inside* a slot's sandbox: the supervisor, the python_session driver, the
verifier and the modules they import from beside them. This folder is exactly what the host copies
into its lib dir (mounted read-only at ``/run/atropos`` in every sandbox), so everything in it is
standard library only and imports its siblings by bare name (``tests/test_structure.py`` holds
both rules). This ``__init__`` is the host's view of the folder and is not copied.

The modules keep an ``inslot_`` prefix inside the folder: the python_session driver runs the
agent's code in its own interpreter, where a bare ``files`` or ``common`` in ``sys.modules`` would
shadow the agent's own modules of that name.
"""

from __future__ import annotations

from pathlib import Path

LIB_FILES: tuple[str, ...] = tuple(
    sorted(p.name for p in Path(__file__).parent.glob("*.py") if p.name != "__init__.py"))
