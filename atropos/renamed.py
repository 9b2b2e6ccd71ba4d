"""Old names of renamed settings, still accepted for a while: a config written for an earlier
version keeps working and says what to change."""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any


def accept_renamed(data: Any, renamed: Mapping[str, str], owner: str) -> Any:
    """For a ``model_validator(mode="before")``: a value given under an old name (a key of
    ``renamed``) moves to its new name, with a FutureWarning (shown to users by default, unlike a
    DeprecationWarning); both names at once is an error (which one was meant is unknowable)."""
    if not isinstance(data, Mapping) or not any(old in data for old in renamed):
        return data
    data = dict(data)
    for old, new in renamed.items():
        if old not in data:
            continue
        if new in data:
            raise ValueError(f"{owner}: {old} is the old name of {new}; give only {new}")
        warnings.warn(f"{owner}: {old} is deprecated, use {new}", FutureWarning, stacklevel=2)
        data[new] = data.pop(old)
    return data
