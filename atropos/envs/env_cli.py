"""The command line of an AgentEnv (``python your_env.py process|serve|evaluate``): BaseEnv's, with
wandb off unless asked, SIGTERM stopping the run as Ctrl-C does, one clear line for a failure, and
``--help`` showing what the env's ``config_init`` sets. Functions of the env class, behind
``AgentEnv.cli``, ``AgentEnv.config_init`` and ``AgentEnv.print_defaults``."""

from __future__ import annotations

import logging
import os
import signal
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from atroposlib.envs.base import APIServerConfig
from pydantic import ValidationError

from atropos.envs.config import AgentEnvConfig, default_server_configs, settings_problem, wandb_requested
from atropos.errors import AtroposSandboxError, exit_code

if TYPE_CHECKING:
    from atropos.envs.agent_env import AgentEnv

log = logging.getLogger("atropos.envs.agent_env")


def default_config(cls: type[AgentEnv]) -> tuple[AgentEnvConfig, list[APIServerConfig]]:
    """Defaults for the CLI. A subclass that does not override this still gets a LIST of
    ``APIServerConfig`` (BaseEnv's ``ServerBaseline`` default makes ``--openai.*`` a no-op) and a
    ``wandb_name``. ``tokenizer_name`` stays BaseEnv's hub default: set a local path offline."""
    cfg_cls = cls.env_config_cls if issubclass(cls.env_config_cls, AgentEnvConfig) else AgentEnvConfig
    return cfg_cls(wandb_name=cls.name, use_wandb=False), default_server_configs()


def run_cli(cls: type[AgentEnv], base_cli: Callable[[], None]) -> None:
    """``python your_env.py process|serve|evaluate [--env.* --openai.*]``: BaseEnv's CLI, with
    wandb off unless asked and SIGTERM stopping the run as Ctrl-C does (pool down, summary)."""
    # process and evaluate force use_wandb=True; offline with no API key wandb.init then
    # crashes the run. Unless wandb was asked for, make it a no-op (an explicit WANDB_MODE wins).
    try:
        default = bool(cls.config_init()[0].use_wandb)
    except Exception:
        default = False  # BaseEnv.cli calls config_init again and reports the error
    if not wandb_requested(sys.argv[1:], default):
        os.environ.setdefault("WANDB_MODE", "disabled")
        if sys.argv[1:2] in (["process"], ["evaluate"]) and "--env.use_wandb" not in sys.argv:
            # those commands force use_wandb=True over config_init (the config they print said
            # True while the env had said False): say what the run really does
            sys.argv += ["--env.use_wandb", "false"]
    if "-h" in sys.argv[1:] or "--help" in sys.argv[1:]:
        cls.print_defaults()
    quiet_atroposlib(show_config="--show-config" in sys.argv[1:])
    sys.argv = [a for a in sys.argv if a != "--show-config"]  # ours: BaseEnv's parser would refuse it
    stopped: list[int] = []

    def on_sigterm(signum: int, _frame: Any) -> None:
        # as Ctrl-C: asyncio.run cancels the run, whose finally stops the pool and prints the summary
        stopped.append(signum)
        signal.raise_signal(signal.SIGINT)

    signal.signal(signal.SIGTERM, on_sigterm)
    # A process started in the background by a non-interactive shell (`nohup ... &`, many job
    # runners) inherits SIGINT ignored; asyncio then installs no SIGINT handler and the SIGINT
    # above would be lost: the run would never stop on SIGTERM. Ctrl-C semantics, always.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        base_cli()
    except AtroposSandboxError as exc:
        # one line that says what failed (e.g. "cannot reach Nomad at ..."), not the chained
        # tracebacks of the HTTP client under it; a bug (any other exception) keeps its traceback
        print(f"error: {exc}", file=sys.stderr, flush=True)
        sys.exit(exit_code(exc))
    except ValidationError as exc:  # a bad --env.* / --openai.* value: one line too (exit 2, usage)
        if (problem := settings_problem(exc, cls.env_config_cls)) is None:
            raise
        print(f"error: {problem}", file=sys.stderr, flush=True)
        sys.exit(2)
    except KeyboardInterrupt:
        name = "SIGTERM" if stopped else "interrupt"
        print(f"[atropos-sandbox] stopped by {name}; the sandbox pool is down", file=sys.stderr, flush=True)
        sys.exit(128 + (signal.SIGTERM if stopped else signal.SIGINT))


def print_defaults(cls: type[AgentEnv]) -> None:
    """What this env's ``config_init`` sets: ``--help`` below lists atroposlib's class defaults,
    not these, and these are what a run uses unless a flag or ``--config`` overrides them."""
    try:
        cfg, servers = cls.config_init()
    except Exception as exc:  # the help must still print
        print(f"[atropos-sandbox] config_init failed ({type(exc).__name__}: {exc})", flush=True)
        return
    lines = [f"  --env.{k} {' '.join(map(str, v)) if isinstance(v, list) else v}"
             for k, v in cfg.model_dump(exclude_defaults=True, mode="json").items()]
    if isinstance(servers, list) and servers:
        lines += [f"  --openai.{k} {getattr(servers[0], k)}" for k in ("base_url", "model_name", "server_type")]
    print(f"[atropos-sandbox] {cls.__name__} sets (the defaults shown by --help below are atroposlib's):\n"
          + "\n".join(lines) + "\n  --show-config  print the whole config (env and servers) and atroposlib's "
          "warnings at the start of a run (quiet by default)\n", flush=True)


# atroposlib's warnings that every run with a local model server gets (they repeat what the run's
# own lines say, or nothing the user can act on); shown again with --show-config
NOISY_WARNINGS = ("You are using a local Base URL",)


def quiet_atroposlib(show_config: bool) -> None:
    """BaseEnv's CLI prints its whole config (~90 lines) on every run and warns about a local
    server URL: without ``--show-config`` both are left out, so the ``[atropos-sandbox]`` lines show."""
    if show_config:
        return
    import warnings

    import atroposlib.envs.base as base

    base.rprint = lambda *_args, **_kwargs: None  # used by BaseEnv's cli for the config dump only
    for text in NOISY_WARNINGS:
        warnings.filterwarnings("ignore", message=text)
