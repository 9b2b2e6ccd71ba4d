"""Small encoding helpers that mimic Nomad's JSON codec."""

from __future__ import annotations

import datetime as _dt
import re
from typing import Any


def rfc3339nano(ns: int | None) -> str | None:
    """Go's ``time.RFC3339Nano`` in UTC; a zero time encodes as ``null``."""
    if not ns:
        return None
    secs, frac = divmod(int(ns), 1_000_000_000)
    base = _dt.datetime.fromtimestamp(secs, tz=_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S")
    if frac:
        base += "." + f"{frac:09d}".rstrip("0")
    return base + "Z"


def is_empty(v: Any) -> bool:
    """Go codec ``omitempty``: zero values, empty strings/collections and nil."""
    if v is None:
        return True
    if isinstance(v, bool):
        return not v
    if isinstance(v, (int, float)):
        return v == 0
    if isinstance(v, (str, list, dict, tuple)):
        return len(v) == 0
    return False


def omit_empty(d: dict[str, Any]) -> dict[str, Any]:
    """Drop empty fields, as structs carrying ``_struct bool codec:",omitempty"`` do."""
    return {k: v for k, v in d.items() if not is_empty(v)}


_ENV_SAFE = re.compile(r"[^A-Za-z0-9_]")


def env_key(label: str) -> str:
    """Nomad replaces characters not valid in an env var name with ``_``."""
    return _ENV_SAFE.sub("_", label)


_INTERP = re.compile(r"\$\{([^}]+)\}")


def interpolate(value: str, env: dict[str, str], extra: dict[str, str]) -> str:
    """Replace ``${NAME}`` from ``env``/``extra``; unknown names stay verbatim, as in Nomad."""

    def repl(m: re.Match[str]) -> str:
        key = m.group(1).strip()
        if key in env:
            return env[key]
        if key in extra:
            return extra[key]
        if key.startswith("env."):
            return env.get(key[4:], m.group(0))
        return m.group(0)

    return _INTERP.sub(repl, value)


def interpolate_tree(value: Any, env: dict[str, str], extra: dict[str, str]) -> Any:
    """``interpolate`` every string in a driver ``Config`` (lists and maps too), as the client does
    before it hands the config to the driver."""
    if isinstance(value, str):
        return interpolate(value, env, extra)
    if isinstance(value, list):
        return [interpolate_tree(v, env, extra) for v in value]
    if isinstance(value, dict):
        return {k: interpolate_tree(v, env, extra) for k, v in value.items()}
    return value
