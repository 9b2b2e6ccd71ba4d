"""slotd's configuration, the first frame it reads: a typed model whose fields are the declaration's
(``inslot_protocol.SLOTD_CONFIG``: their order, defaults, bounds, the rlimit names), encoded on the
same wire as a request (slotd_wire's field encoder) and parsed by the C side generated from the same
declaration (``slotd_parse_config`` in slotd_protocol.h). An unknown key, a limit slotd has no name
for, or a value out of the declared bounds is refused here, before any sandbox starts.
"""

from __future__ import annotations

import struct
from collections.abc import Mapping
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, model_validator

from atropos.sandbox.host.isolation import slotd_wire
from atropos.sandbox.inslot import inslot_protocol as P

_LEN = struct.Struct(">I")


def _default(name: str) -> Any:
    for f in P.SLOTD_CONFIG:
        if f.name == name:
            return f.default
    raise KeyError(name)


class SlotdConfig(BaseModel):
    """One field per ``inslot_protocol.SLOTD_CONFIG`` entry, in its order (tests/test_slot_protocol.py
    holds the two equal); the defaults are the declaration's."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    mode: Literal["serve", "exec"] = _default("mode")
    limits: dict[str, int] = Field(default_factory=dict)  # the declaration's RLIMITS names only
    env: dict[str, str] = Field(default_factory=dict)
    warm: dict[str, str] = Field(default_factory=dict)
    workspace: str = _default("workspace")
    argv: list[str]
    run_dir: str = _default("run_dir")
    term_dir: str = _default("term_dir")
    tmux: list[str] = Field(default_factory=lambda: list(_default("tmux")))
    shell: list[str] = Field(default_factory=list)
    files_workspace: str = _default("files_workspace")
    files_cwd: str | None = _default("files_cwd")
    _frame: bytes = PrivateAttr(b"")

    @model_validator(mode="after")
    def _declared(self) -> SlotdConfig:
        """The declaration's own checks (bounds, counts, choices), as slotd's parser makes them, and
        the strings slotd's wire can carry (no NUL; an environment name without "=")."""
        for name, value in self.limits.items():
            if not 0 <= value <= P.MAX_RLIMIT:
                raise ValueError(f"slotd configuration.limits: {name}={value} outside [0, {P.MAX_RLIMIT}]")
        values = self.wire_values()
        try:
            P.check_fields("slotd configuration", P.SLOTD_CONFIG, values)
            body = b"".join(part for f in P.SLOTD_CONFIG for part in slotd_wire.encode_field(f, values[f.name]))
        except (P.InvalidRequest, UnicodeError) as exc:
            raise ValueError(str(exc)) from None
        except ValueError as exc:
            raise ValueError(f"slotd configuration: a string slotd cannot carry ({exc})") from None
        self._frame = _LEN.pack(len(body)) + body
        return self

    def wire_values(self) -> dict[str, Any]:
        """The fields as the declaration types them (a limit's value in decimal, as slotd reads it)."""
        values = self.model_dump()
        values["limits"] = {k: str(v) for k, v in self.limits.items()}
        return values

    def frame(self) -> bytes:
        """The frame: every declared field in order, on slotd_wire's field encoding (made when the
        model was checked)."""
        return self._frame


def from_supervisor(cfg: Mapping[str, Any], warm: Mapping[str, str], argv: list[str],
                    mode: Literal["serve", "exec"] = "serve") -> SlotdConfig:
    """slotd's configuration from a supervisor configuration (``cfg`` as supervisor.py reads it, with
    ``files_workspace`` where the calls' cwd is not the file tools' workspace), the warm interpreters'
    boot scripts and the Python supervisor's command (``mode="exec"``: the program run in our place)."""
    workspace = str(cfg.get("workspace", _default("workspace")))
    cwd = cfg.get("cwd") or None
    return SlotdConfig(
        mode=mode,
        limits={str(k): int(v) for k, v in dict(cfg.get("limits") or {}).items() if v is not None},
        env={str(k): str(v) for k, v in dict(cfg.get("env") or {}).items()},
        warm=dict(warm), workspace=workspace, argv=list(argv),
        run_dir=str(cfg.get("run_dir", _default("run_dir"))),
        term_dir=str(cwd or workspace or "/"),
        tmux=[str(a) for a in cfg.get("tmux") or _default("tmux")],
        shell=[str(a) for a in cfg.get("terminal_shell") or []],
        files_workspace=str(cfg.get("files_workspace") or workspace or "/"),
        files_cwd=None if cwd is None else str(cwd),
    )
