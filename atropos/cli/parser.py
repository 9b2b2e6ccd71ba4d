"""The command line: every command, its flags, its help, and the exit codes and settings it documents."""

from __future__ import annotations

import argparse
import textwrap
from typing import Any

from atropos.cli.exec import cmd_exec
from atropos.cli.extras import cmd_bench, cmd_image_build, cmd_nomad_render
from atropos.cli.pool_manager import cmd_pool_down, cmd_pool_status, cmd_pool_up
from atropos.cli.serve import cmd_serve
from atropos.cli.settings import (
    CONFIG_ENV,
    SETTINGS_ENV_PREFIX,
    TOKEN_ENV,
    ServeSettings,
    add_pool_flags,
    add_settings_flags,
    setting_flag,
)

DESCRIPTION = "atropos-sandbox: run the ToolServer with a pool, manage a background pool, debug with one call."


def _wrap(text: str, indent: str = "") -> str:
    # RawDescriptionHelpFormatter keeps the epilog's layout but wraps nothing: wrap paragraphs here
    return textwrap.fill(text, 100, subsequent_indent=indent, break_on_hyphens=False)


def _settings_names() -> str:
    return ", ".join(ServeSettings.model_fields)


def _settings_epilog() -> str:
    return _wrap(f"settings (flags win over ${SETTINGS_ENV_PREFIX}<SETTING> variables, which win over the --config "
                 f"file, a YAML or JSON object with these keys; ${CONFIG_ENV} names the file when --config is not "
                 f"given): {_settings_names()}")


EPILOG = f"""\
exit codes (stable, for scripts):
  0  success
  1  the command ran but failed (exec: the tool call failed; for bash, exec exits with the
     command's own status, 124 when --timeout killed it, 128+N when signal N did); an
     unexpected error (one line; --debug shows its traceback)
  2  bad usage or configuration: unknown flag, invalid setting, missing or malformed --config
     file, bad --args JSON, no token, a request the pool refused as malformed
  3  infrastructure unavailable: no isolation on this machine, no Docker/Nomad, a pool that is
     not up, not answering, refusing its token or out of slots, a port already in use

configuration: flags, then environment variables, then the --config file (flags win)
  --config FILE                YAML (.yaml/.yml) or JSON object, keys as below, e.g.
                               {{"backend": "docker", "max_hosts": 8, "pool_id": "train"}}
  {CONFIG_ENV:<28} the config file when --config is not given
  {SETTINGS_ENV_PREFIX}<SETTING>    any setting, e.g. ATROPOS_SANDBOX_POOL_ID=train,
                               ATROPOS_SANDBOX_MAX_HOSTS=8, ATROPOS_SANDBOX_LOG_JSON=true
  {_wrap("settings: " + _settings_names(), "            ")}

environment:
  {TOKEN_ENV:<28} bearer token `serve` requires of clients (`pool up` makes one
                               and keeps it in a 0600 file in the state dir)
  NOMAD_ADDR, NOMAD_TOKEN, ... the nomad backend's cluster (and ATROPOS_NOMAD_<FIELD>, e.g.
                               ATROPOS_NOMAD_TOKEN_DELIVERY=job); see nomad/README.md
  DOCKER_HOST, ...             the docker backend's engine, as for the docker CLI
  RAY_ADDRESS                  the ray backend's cluster (and ATROPOS_RAY_<FIELD>, e.g.
                               ATROPOS_RAY_NUM_CPUS=2); see docs/ray.md
  XDG_CACHE_HOME               state of background pools: $XDG_CACHE_HOME/atropos-sandbox/run
                               (default ~/.cache/atropos-sandbox/run)
"""


def _command(parent: Any, name: str, help_text: str, description: str, epilog: str | None = None
             ) -> argparse.ArgumentParser:
    fmt = argparse.RawDescriptionHelpFormatter  # keeps the epilogs' layout; _wrap does the wrapping
    sub: argparse.ArgumentParser = parent.add_parser(name, help=help_text, description=_wrap(description),
                                                     epilog=epilog, formatter_class=fmt)
    return sub


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="atropos-sandbox", description=DESCRIPTION, epilog=EPILOG,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--debug", action="store_true",
                   help="show the traceback of a failure (default: one line)")
    sub = p.add_subparsers(dest="cmd", required=True, metavar="COMMAND")
    settings_epilog = _settings_epilog() + "\n\n" + _wrap(
        "exit codes: 0 ok, 1 failed, 2 usage/config, 3 infrastructure (atropos-sandbox --help has the details)")
    _add_serve(sub, settings_epilog)
    _add_pool(sub, settings_epilog)
    _add_exec(sub)
    _add_image(sub)
    _add_nomad(sub, settings_epilog)
    _add_bench(sub)
    return p


def _add_serve(sub: Any, settings_epilog: str) -> None:
    serve = _command(sub, "serve", "run the ToolServer (external tools + REST slot API) with a pool",
                     "Run the ToolServer with a pool in the foreground: REST slot API, web tools, /metrics, "
                     f"/status. Clients must send ${TOKEN_ENV} as a bearer token.", settings_epilog)
    add_settings_flags(serve)
    serve.set_defaults(func=cmd_serve)


def _add_pool(sub: Any, settings_epilog: str) -> None:
    pool = _command(sub, "pool", "a pool (with its ToolServer) in the background",
                    "A pool with its ToolServer in the background; its state (0600 token and settings files, "
                    "the log) is kept in the state dir.")
    pool_sub = pool.add_subparsers(dest="pool_cmd", required=True, metavar="COMMAND")
    up = _command(pool_sub, "up", "start a pool in the background",
                  "Start `serve` in the background with these settings (a token is generated) and wait until "
                  "it is healthy.", settings_epilog)
    add_settings_flags(up)
    up.add_argument("--timeout", type=float, default=120.0,
                    help="seconds to wait for the pool to be healthy; past it the pool is stopped (default 120)")
    up.set_defaults(func=cmd_pool_up)
    status = _command(pool_sub, "status", "hosts, health, slots, lease ages, calls/s",
                      "The pool at a glance: hosts, health, slots free/leased/quarantined, the oldest lease per "
                      "host, calls/s, scaling events.")
    add_pool_flags(status)
    status.add_argument("--json", action="store_true", help="machine-readable output (the /v1/status body)")
    status.set_defaults(func=cmd_pool_status)
    down = _command(pool_sub, "down", "stop the background pool and everything it made",
                    "Stop the background pool (its hosts and containers go with it) and remove its state. A "
                    "pool that is not up is not an error.")
    add_pool_flags(down)
    down.set_defaults(func=cmd_pool_down)


def _add_exec(sub: Any) -> None:
    ex = _command(sub, "exec", "run one tool call in a fresh lease (debugging)",
                  "Run one tool call in a fresh lease: in the background pool if it is up, else in an "
                  "ephemeral local one. For bash, the exit status is the command's own.",
                  "examples:\n  atropos-sandbox exec -- 'python3 -V'\n"
                  "  atropos-sandbox exec --task-image repo/task:tag -- 'cd /testbed && git status'\n"
                  "  atropos-sandbox exec --tool read_file --args '{\"path\": \"a.txt\"}'\n"
                  "  atropos-sandbox exec --tool web_search --args '{\"query\": \"tar\"}'   (needs a pool)")
    ex.add_argument("--tool", default="bash", help="tool name (default bash)")
    ex.add_argument("--args", help="tool arguments as a JSON object (default: the command, for bash)")
    ex.add_argument("--timeout", type=float, help="call timeout in seconds")
    ex.add_argument("--lease-timeout", dest="lease_timeout", type=float, default=60.0,
                    help="pool: seconds to wait for a free slot (default 60)")
    ex.add_argument("--network", action="store_true", help="let the call reach the network")
    ex.add_argument("--task-image", dest="task_image",
                    help="run in a slot whose / is this task image (a Docker engine reference, or oci:PATH; "
                         "docs/task-images.md). Not --image: that flag names the sandbox image elsewhere")
    # The old spelling: accepted with a warning (cmd_exec), hidden from the help.
    ex.add_argument("--image", dest="old_image", help=argparse.SUPPRESS)
    add_pool_flags(ex)
    ex.add_argument("command", nargs="*", help="the bash command")
    ex.set_defaults(func=cmd_exec)


def _add_image(sub: Any) -> None:
    image = _command(sub, "image", "sandbox image", "The sandbox image the docker and nomad backends run.")
    image_sub = image.add_subparsers(dest="image_cmd", required=True, metavar="COMMAND")
    build = _command(image_sub, "build", "build the sandbox image (local base without a registry)",
                     "Build the sandbox image with scripts/build_image.sh (a debootstrap base, no registry), "
                     "showing its progress.")
    build.add_argument("--tag", help="image tag (default atropos-sandbox:dev)")
    build.set_defaults(func=cmd_image_build)


def _add_nomad(sub: Any, settings_epilog: str) -> None:
    nomad = _command(sub, "nomad", "Nomad helpers", "Helpers for the nomad backend.")
    nomad_sub = nomad.add_subparsers(dest="nomad_cmd", required=True, metavar="COMMAND")
    render = _command(
        nomad_sub, "render", "print the job JSON the backend registers",
        "Print the job JSON ({\"Job\": ...}, for the HTTP API or `nomad job run -json`) that `serve --backend "
        "nomad` registers with the same settings: the job id is atropos-<pool_id>; NOMAD_* and "
        "ATROPOS_NOMAD_<FIELD> (e.g. ATROPOS_NOMAD_TOKEN_DELIVERY=job) apply. The owner Meta and, with "
        "token_delivery=job, the host token exist per running pool and are not printed.", settings_epilog)
    setting_flag(render, "config", f"YAML or JSON settings file (default ${CONFIG_ENV})")
    setting_flag(render, "image", "sandbox image (default atropos-sandbox:dev)")
    setting_flag(render, "slots_per_host", "slots per host (default 16)", type=int)
    setting_flag(render, "pool_id", "the pool; the job id is atropos-<pool_id> (default cli-<user>)")
    render.set_defaults(func=cmd_nomad_render)


def _add_bench(sub: Any) -> None:
    bench = _command(sub, "bench", "run the benchmarks (arguments go to benchmarks.run)",
                     "Run `python -m benchmarks.run` with every argument after `bench`, e.g. `atropos-sandbox "
                     "bench --quick`; `atropos-sandbox bench -- --help` shows its options.")
    bench.add_argument("rest", nargs=argparse.REMAINDER, help="arguments for benchmarks.run")
    bench.set_defaults(func=cmd_bench)
