"""Which supervisor a host's next sandbox starts: slotd or the Python one (docs/native-supervisor.md).

slotd serves commands and the terminal without Python; the first call that needs more (a file tool,
an archive, a ``workdir``) hands the sandbox over to the Python supervisor, whose start then lies on
that call's path (~25 ms alone; 16 slots of a group doing it at once queue on the cores: p50 155 ms
in benchmarks/scenario_slot_cycle.py, against 3 ms on a Python supervisor prestarted before the
lease). So the host watches what its recent leases needed: while most of them needed the Python
supervisor, new sandboxes start with it (prestarted off the calls' path, as before slotd); while
most did not, with slotd. Every lease counts, whichever supervisor served it, so the choice follows
the workload both ways.
"""

from __future__ import annotations

import collections
import logging

log = logging.getLogger(__name__)

WINDOW = 32  # leases remembered


class SupervisorChoice:
    def __init__(self, window: int = WINDOW, *, fixed: bool = False) -> None:
        """``fixed``: slotd whatever the leases need (the host's ``--native-supervisor always``)."""
        self._needed: collections.deque[bool] = collections.deque(maxlen=window)
        self._native = True
        self._fixed = fixed

    def record(self, needed_python: bool) -> None:
        """One lease's sandbox ended: did any of its calls need the Python supervisor?"""
        self._needed.append(needed_python)
        if self._fixed:
            return
        native = 2 * sum(self._needed) < len(self._needed)
        if native != self._native:
            log.info("new sandboxes start with %s: %d of the last %d leases needed the Python supervisor",
                     "slotd" if native else "the Python supervisor", sum(self._needed), len(self._needed))
            self._native = native

    def native(self) -> bool:
        return self._native
