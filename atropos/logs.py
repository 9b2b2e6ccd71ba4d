"""Logging setup: plain or JSON lines; call ids travel as ``extra`` fields; secrets never logged."""

from __future__ import annotations

import json
import logging
import re
import sys
import time
from typing import Any

# Fields callers attach with ``log.info(..., extra={...})`` that JSON lines carry as keys.
CONTEXT_FIELDS = ("trajectory_id", "lease", "call_id", "slot", "host", "tool", "generation")
_SECRET = re.compile(r"(?i)(bearer\s+|token[\"'=:\s]+)[A-Za-z0-9_\-.~+/]{8,}")


def redact(text: str) -> str:
    return _SECRET.sub(lambda m: m.group(1) + "[redacted]", text)


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
        return json.dumps(out, ensure_ascii=False)


class RedactingFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        return redact(super().format(record))


def configure(level: str = "INFO", json_lines: bool = False) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if json_lines else
                         RedactingFormatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    logging.getLogger("httpx").setLevel(logging.WARNING)
