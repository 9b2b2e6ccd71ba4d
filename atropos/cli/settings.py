"""What every command runs with: ``ServeSettings`` from flags, ``ATROPOS_SANDBOX_<FIELD>`` and a config file.

One resolution (``load_settings``: flags over environment over file) and one spelling of each
setting's flag (``setting_flag``), shared by ``serve``, ``pool ...``, ``exec`` and ``nomad render``.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from atropos.backends.base import BACKEND_KINDS, BackendKind
from atropos.errors import ConfigError, validation_message
from atropos.renamed import accept_renamed

# The bearer token of the ToolServer `serve` runs: not the sandbox hosts' token (HOST_TOKEN_ENV of
# atropos/sandbox/contract/launch.py), which the pool makes per host and no user ever handles.
TOOLSERVER_TOKEN_ENV = TOKEN_ENV = "ATROPOS_TOOLSERVER_TOKEN"
SETTINGS_ENV_PREFIX = "ATROPOS_SANDBOX_"
CONFIG_ENV = "ATROPOS_SANDBOX_CONFIG"
# old name -> new name: still accepted (flag, variable, config key) with a FutureWarning
RENAMED_SETTINGS = {"host": "listen_host"}


class ServeSettings(BaseModel):
    """What ``serve`` (and ``pool up``, ``nomad render``) run with; every field is a flag, an
    ``ATROPOS_SANDBOX_<FIELD>`` variable and a key of the ``--config`` file."""

    # A typo'd key in a config file must fail loudly, not fall back to a default silently.
    model_config = ConfigDict(extra="forbid")

    backend: BackendKind = "local"
    # the ToolServer's own address; "host" elsewhere in these settings means a sandbox host
    listen_host: str = "127.0.0.1"
    # not 8000: that is the default of atroposlib's run-api (and of an env's rollout_server_url)
    port: int = Field(8600, ge=0, le=65535)
    slots_per_host: int = Field(16, ge=1)
    min_hosts: int = Field(1, ge=0)
    max_hosts: int = Field(4, ge=1)
    image: str = "atropos-sandbox:dev"
    nomad_address: str | None = None  # default: $NOMAD_ADDR, else http://127.0.0.1:4646
    ray_address: str | None = None  # default: $RAY_ADDRESS, else a Ray started by serve on 127.0.0.1
    # names files in the state dir and Nomad job ids: no path separators
    # per user by default (cli-<user>): two users of one machine must not share a pool's state,
    # hosts, containers or logs unless they ask for it with the same --pool-id
    pool_id: str = Field(default_factory=lambda: default_pool_id(), pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    allow_no_auth: bool = False
    # the ToolServer's token from a private file (as hosts read theirs), not from the environment
    token_file: Path | None = None
    metrics_need_token: bool = False
    web_provider: Literal["offline", "http", "none"] = "offline"
    corpus_dir: Path | None = None
    web_base_url: str | None = None
    log_json: bool = False
    log_level: str = "INFO"
    request_read_timeout_s: float = Field(60.0, gt=0)  # a request's head and body must arrive within it

    @model_validator(mode="before")
    @classmethod
    def _old_names(cls, data: Any) -> Any:
        return accept_renamed(data, RENAMED_SETTINGS, "settings")

    @field_validator("log_level")
    @classmethod
    def _known_level(cls, value: str) -> str:
        if value.upper() not in ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"):
            raise ValueError("one of DEBUG, INFO, WARNING, ERROR, CRITICAL")
        return value.upper()


def default_pool_id() -> str:
    """``cli-<user>`` (``atropos.backends.base.user_pool_id``)."""
    from atropos.backends.base import user_pool_id

    return user_pool_id("cli")


def read_private_token(path: Path) -> str:
    """The token in ``path``: refused unless it is a regular file of ours that no group or other user
    can read (a token others could read is no secret). The file stays: a pool's token file is also how
    the CLI's clients reach it."""
    import errno
    import stat

    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        why = "a symbolic link" if exc.errno == errno.ELOOP else f"cannot open it ({exc.strerror})"
        raise ConfigError(f"--token-file {path}: {why}") from None
    with os.fdopen(fd, "rb") as fh:
        st = os.fstat(fh.fileno())
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
            raise ConfigError(f"--token-file {path}: must be a regular file of this user with no group or other "
                              f"permissions (chmod 600); it is mode {stat.filemode(st.st_mode)}, uid {st.st_uid}")
        token = fh.read(4096).decode("utf-8", "replace").strip()
    if not token:
        raise ConfigError(f"--token-file {path} is empty")
    return token


def state_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    path = Path(base) / "atropos-sandbox" / "run"
    path.mkdir(parents=True, exist_ok=True)
    os.chmod(path, 0o700)
    return path


def read_config_file(path: str) -> dict[str, Any]:
    file = Path(path)
    try:
        text = file.read_text()
    except OSError as exc:
        raise ConfigError(f"cannot read the config file {path}: {exc.strerror or exc}") from None
    data = _parse_yaml(path, text) if file.suffix in (".yaml", ".yml") else _parse_json(path, text)
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"the config file {path} must hold an object of settings, not {type(data).__name__}")
    return data


def _parse_yaml(path: str, text: str) -> Any:
    try:
        import yaml
    except ImportError:
        raise ConfigError(f"{path}: YAML config files need PyYAML (pip install pyyaml), or use JSON") from None
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"the config file {path} is not valid YAML: {exc}") from None


def _parse_json(path: str, text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError as exc:
        raise ConfigError(f"the config file {path} is not valid JSON: {exc}") from None


def load_settings(args: argparse.Namespace, environ: dict[str, str] | None = None) -> ServeSettings:
    """Flags over ``ATROPOS_SANDBOX_<FIELD>`` over the config file; every command resolves here."""
    env = os.environ if environ is None else environ
    data: dict[str, Any] = {}
    config = getattr(args, "config", None) or env.get(CONFIG_ENV)
    if config:
        data.update(accept_renamed(read_config_file(config), RENAMED_SETTINGS, f"config file {config}"))
    # each source's old names become new ones before the sources meet, so precedence holds across them
    for name in [*RENAMED_SETTINGS, *ServeSettings.model_fields]:
        value = env.get(f"{SETTINGS_ENV_PREFIX}{name.upper()}")
        if value is not None:
            data.update(accept_renamed({name: value}, RENAMED_SETTINGS, "environment: ATROPOS_SANDBOX_<NAME>"))
    for name in [*RENAMED_SETTINGS, *ServeSettings.model_fields]:
        value = getattr(args, name, None)
        if value is not None:
            data.update(accept_renamed({name: value}, RENAMED_SETTINGS, "flag --<name>"))
    try:
        return ServeSettings.model_validate(data)
    except ValidationError as exc:
        problems = validation_message(exc, "settings")
        where = f" (config file {config})" if config else ""
        raise ConfigError(f"invalid settings{where}: {problems}") from None


def setting_flag(p: argparse.ArgumentParser, name: str, help_text: str, **kw: Any) -> None:
    """``--<name>`` (dashes) into ``args.<name>``: the one spelling of a setting's flag (``config`` too)
    in every command; load_settings reads the settings back by field name."""
    p.add_argument(f"--{name.replace('_', '-')}", dest=name, help=help_text, **kw)


def add_settings_flags(p: argparse.ArgumentParser) -> None:
    setting_flag(p, "config", f"YAML or JSON file with settings (flags override it; default ${CONFIG_ENV})")
    setting_flag(p, "backend", "where sandbox hosts run (default local)", choices=list(BACKEND_KINDS))
    setting_flag(p, "listen_host", "the ToolServer's address to listen on (default 127.0.0.1)")
    setting_flag(p, "host", argparse.SUPPRESS)  # the old name of --listen-host, still accepted
    setting_flag(p, "port", "port (default 8600; pool up: 0 picks a free one)", type=int)
    setting_flag(p, "slots_per_host", "slots per host (default 16)", type=int)
    setting_flag(p, "min_hosts", "hosts kept running (default 1)", type=int)
    setting_flag(p, "max_hosts", "most hosts (default 4)", type=int)
    setting_flag(p, "image", "docker/nomad: sandbox image (default atropos-sandbox:dev)")
    setting_flag(p, "nomad_address", "nomad: agent address (default $NOMAD_ADDR)")
    setting_flag(p, "ray_address", "ray: cluster address (default $RAY_ADDRESS, else a Ray started here)")
    setting_flag(p, "pool_id", "names this pool's hosts and state (default cli-<user>)")
    setting_flag(p, "web_provider", "web_search/web_extract provider (default offline corpus)",
                 choices=["offline", "http", "none"])
    setting_flag(p, "corpus_dir", "offline search corpus (default: built-in)", type=Path)
    setting_flag(p, "web_base_url", "http provider: the API base URL")
    setting_flag(p, "token_file", f"read the ToolServer's bearer token from this file (mode 0600, ours) instead of "
                 f"${TOKEN_ENV}: a file only our user reads, where an environment is readable by every process "
                 "of the same user until serve makes itself non-dumpable")
    setting_flag(p, "allow_no_auth", "DEVELOPMENT: no token (only on a loopback address)",
                 action="store_true", default=None)
    setting_flag(p, "metrics_need_token",
                 "/metrics requires the bearer token too (default: public; it holds no secret or id)",
                 action="store_true", default=None)
    setting_flag(p, "log_json", "JSON log lines", action="store_true", default=None)
    setting_flag(p, "log_level", "log level (default INFO)")
    setting_flag(p, "request_read_timeout_s", "a request's head and body must arrive within this many "
                 "seconds, else 408 and the connection closes (default 60)", type=float)


def add_pool_flags(p: argparse.ArgumentParser) -> None:
    """The flags commands talking to a background pool need: which pool (same resolution as serve)."""
    setting_flag(p, "pool_id", "which pool (default: $ATROPOS_SANDBOX_POOL_ID, the config file's pool_id, "
                 "else cli-<user>)")
    setting_flag(p, "config", f"YAML or JSON settings file to take pool_id from (default ${CONFIG_ENV})")


def pool_id_of(args: argparse.Namespace) -> tuple[str, bool]:
    """(pool id, whether anyone asked for it) through the same resolution as ``serve``."""
    s = load_settings(args)
    return s.pool_id, "pool_id" in s.model_fields_set


def setup_logging(settings: ServeSettings) -> None:
    from atropos.logs import configure

    configure(level=settings.log_level, json_lines=settings.log_json)
