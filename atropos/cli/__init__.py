"""atropos-sandbox, the command line: run the ToolServer with a pool, manage a background pool, debug
with one call.

``settings.py`` (what every command runs with), ``serve.py`` (the ToolServer and what it is built
from), ``pool_state.py``/``pool_client.py``/``pool_manager.py`` (background pools: their files, talking
to one, ``pool up|status|down``), ``exec.py`` (one tool call), ``extras.py`` (``image``, ``nomad
render``, ``bench``), ``parser.py`` (the commands and their help), ``main.py`` (exit codes and
one-line errors). ``python -m atropos.cli`` and the ``atropos-sandbox`` script run ``main()``.
"""

from atropos.cli.exit_codes import EXIT_FAILED, EXIT_INFRA, EXIT_OK, EXIT_TIMED_OUT, EXIT_USAGE
from atropos.cli.extras import render_nomad_job
from atropos.cli.main import main
from atropos.cli.parser import parser
from atropos.cli.pool_manager import render_status
from atropos.cli.serve import backend_settings, build_app, build_pool, nomad_config
from atropos.cli.settings import (
    CONFIG_ENV,
    SETTINGS_ENV_PREFIX,
    TOKEN_ENV,
    TOOLSERVER_TOKEN_ENV,
    ServeSettings,
    load_settings,
    state_dir,
)
from atropos.errors import PoolReplyError

__all__ = [
    "CONFIG_ENV", "EXIT_FAILED", "EXIT_INFRA", "EXIT_OK", "EXIT_TIMED_OUT", "EXIT_USAGE", "SETTINGS_ENV_PREFIX",
    "TOKEN_ENV", "TOOLSERVER_TOKEN_ENV", "PoolReplyError", "ServeSettings", "backend_settings", "build_app",
    "build_pool", "load_settings", "main", "nomad_config", "parser", "render_nomad_job", "render_status",
    "state_dir",
]
