"""Starts one program in a slot's sandbox in place of itself: the terminal's tmux server.

The supervisor serves calls; this only sets the sandbox's limits and signal state (as the supervisor
does for everything it starts) and execs the program named in its configuration, so the terminal's
sandbox pays for no more of Python than that (the supervisor's modules cost its start-up ~10 ms).
Standard library only; copied into the host's lib dir beside ``inslot_common.py`` (see supervisor.py).
No ``make_undumpable`` here: the exec makes the process dumpable again anyway, and until then it
holds nothing but its configuration, which its argv shows.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from atropos.sandbox.inslot.inslot_common import apply_limits, clean_signals, protocol_fds
else:  # run from the host's lib dir, beside inslot_common.py (isolated mode: the dir is not on sys.path)
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from inslot_common import apply_limits, clean_signals, protocol_fds
    del sys.path[0]


def main() -> None:
    clean_signals()
    cfg = json.loads(sys.argv[1])
    # stdio on /dev/null: none of the host's pipe ends survives the exec (the slot's code runs beside
    # the program, as its uid)
    for fd in protocol_fds():
        os.close(fd)
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 2)
    os.close(devnull)
    apply_limits(cfg.get("limits", {}))
    for sig in (signal.SIGPIPE, signal.SIGXFSZ):  # Python's own ignores would outlive the exec
        signal.signal(sig, signal.SIG_DFL)
    if cfg.get("cwd"):  # an image's WorkingDir: where the terminal's shell starts
        try:
            os.chdir(cfg["cwd"])
        except OSError:
            pass
    os.execvpe(cfg["exec"][0], cfg["exec"], dict(cfg.get("env", {})))


if __name__ == "__main__":
    main()
