"""Logging setup: plain or JSON lines; call ids travel as ``extra`` fields; secrets never logged.

Every line about a call should be logged with ``extra=call_fields(...)`` so JSON lines carry
``trajectory_id``, ``lease`` (a fingerprint, never the lease secret), ``call_id``, ``slot``, ``host``
and ``tool`` as keys a log pipeline can filter on. ``redact`` is a last line of defence applied to
every formatted line (message and traceback): code must not log secrets in the first place.
"""

from __future__ import annotations

import json
import logging
import re
import sys
import time
from typing import Any

# Fields callers attach with ``log.info(..., extra={...})`` that JSON lines carry as keys.
CONTEXT_FIELDS = ("trajectory_id", "lease", "call_id", "slot", "host", "tool", "outcome", "generation")
_KNOWN_FIELDS = frozenset(CONTEXT_FIELDS)

# A credential-looking value after a credential-looking key or auth scheme. Deliberately eager:
# a redacted harmless word costs nothing, a leaked token costs a rotation.
_SECRET = re.compile(
    r"(?i)("
    r"\b(?:bearer|basic)\s+"  # Authorization: Bearer/Basic <credentials>
    r"|\b(?:x-)?api[_-]?key[\"']?\s*[=:]\s*[\"']?"  # api_key=, X-Api-Key:, "api-key": "
    r"|\b(?:secret|password|passwd)[\"']?\s*[=:]\s*[\"']?"
    r"|token[\"'=:\s]+"  # token=, token: , "token": ", ATROPOS_..._TOKEN=
    r")[A-Za-z0-9_\-.~+/=]{8,}"
)


def redact(text: str) -> str:
    return _SECRET.sub(lambda m: m.group(1) + "[redacted]", text)


def call_fields(**fields: Any) -> dict[str, Any]:
    """``extra=`` for a log line about a call: only the known id fields, ``None`` dropped (so a
    typo'd key fails here instead of silently missing from every JSON line)."""
    unknown = fields.keys() - _KNOWN_FIELDS
    if unknown:
        raise ValueError(f"unknown log context field(s): {sorted(unknown)}; known: {CONTEXT_FIELDS}")
    return {k: v for k, v in fields.items() if v is not None}


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": round(record.created, 3), "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)),
            "level": record.levelname.lower(), "logger": record.name, "msg": redact(record.getMessage()),
        }
        for key in CONTEXT_FIELDS:
            value = getattr(record, key, None)
            if value is not None:
                out[key] = value
        if record.exc_info:
            out["exc"] = redact(self.formatException(record.exc_info))
        return json.dumps(out, ensure_ascii=False, default=str)


class RedactingFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        return redact(super().format(record))


def configure(level: str = "INFO", json_lines: bool = False) -> None:
    """Route every logger (ours and libraries') through one redacting handler on stderr."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if json_lines else
                         RedactingFormatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    # httpx logs every request line at INFO (URLs of slot calls, noise at thousands per second)
    logging.getLogger("httpx").setLevel(logging.WARNING)
