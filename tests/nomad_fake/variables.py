"""Nomad Variables (``/v1/var/:path``, ``/v1/vars``), per ``command/agent/variable_endpoint.go``
and ``nomad/structs/variables.go``:

* ``PUT``/``POST /v1/var/:path`` with ``{"Namespace", "Path", "Items": {k: v}}`` returns the
  stored variable (``Namespace, Path, Lock, CreateIndex, CreateTime, ModifyIndex, ModifyTime,
  Items``). ``?namespace=`` beats the body's ``Namespace``; the URL path beats the body's ``Path``.
  No ``Items`` (or empty): 400 ``variable missing required Items object``. A path outside
  ``^[a-zA-Z0-9-_~/]{1,128}$`` or under ``nomad/`` but not ``nomad/jobs...``: 500 with the
  structs' message. Over 64 KiB of keys + values: 500.
* ``?cas=N`` (check-and-set): the write happens only if the variable's ``ModifyIndex`` is ``N``
  (``0``: only if it does not exist); otherwise **409** with the *conflicting* variable as JSON
  and ``X-Nomad-Index`` = its ``ModifyIndex``. A non-integer ``cas`` is 400 ``can not parse cas: ...``.
* ``GET /v1/var/:path``: the variable, or 404 ``variable not found``; blocking on its
  ``ModifyIndex`` (the ``variables`` table index when missing).
* ``DELETE /v1/var/:path``: **204** with no body (also for an unknown path), ``?cas=`` as above.
* ``GET /v1/vars?prefix=``: metadata only (no ``Items``).

Locks (``lock-operation``) are not modelled.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .state import Cluster

VALID_PATH = re.compile(r"^[a-zA-Z0-9\-_~/]{1,128}$")
MAX_SIZE = 65536
METADATA = ("Namespace", "Path", "Lock", "CreateIndex", "CreateTime", "ModifyIndex", "ModifyTime")


class VariableConflict(Exception):
    """A check-and-set mismatch: ``current`` is the conflicting variable (or None if absent)."""

    def __init__(self, current: dict[str, Any] | None) -> None:
        super().__init__("cas conflict")
        self.current = current


def validate_path(path: str) -> str | None:
    """``structs.validatePath``: the error message, or None when the path is fine."""
    if not path:
        return "variable requires path"
    if not VALID_PATH.match(path):
        return f'invalid path "{path}"'
    parts = path.split("/")
    if parts[0] != "nomad":
        return None
    if len(parts) == 1:
        return ('"nomad" is a reserved top-level directory path, but you may write variables to "nomad/jobs", '
                '"nomad/job-templates", or below')
    if parts[1] == "jobs" or (parts[1] == "job-templates" and len(parts) == 3):
        return None
    if parts[1] == "job-templates":
        return ('"nomad/job-templates" is a reserved directory path, but you may write variables at the level '
                'below it, for example, "nomad/job-templates/template-name"')
    return ('only paths at "nomad/jobs" or "nomad/job-templates" and below are valid paths under the top-level '
            '"nomad" directory')


class Variables:
    """The variable table of a :class:`~.state.Cluster`; writes take its ``op()`` themselves (which
    wakes blocking queries and the client: templates waiting for a variable)."""

    def __init__(self, cluster: Cluster) -> None:
        self.c = cluster
        self.data: dict[tuple[str, str], dict[str, Any]] = {}

    @staticmethod
    def metadata(v: dict[str, Any]) -> dict[str, Any]:
        return {k: v[k] for k in METADATA}

    def get(self, namespace: str, path: str) -> dict[str, Any] | None:
        return self.data.get((namespace, path))

    def items(self, namespace: str, path: str) -> dict[str, str] | None:
        v = self.data.get((namespace, path))
        return dict(v["Items"]) if v is not None else None

    def _check(self, namespace: str, path: str, cas: int | None) -> dict[str, Any] | None:
        current = self.data.get((namespace, path))
        if cas is not None and (current["ModifyIndex"] if current else 0) != cas:
            raise VariableConflict(current)
        return current

    def upsert(self, namespace: str, path: str, items: dict[str, str], cas: int | None) -> dict[str, Any]:
        """Create or update; raises ValueError (validation) or :class:`VariableConflict`."""
        problem = validate_path(path)
        if problem:
            raise ValueError(problem)
        if namespace == "*":
            raise ValueError('can not target wildcard ("*")namespace')
        if sum(len(k) + len(v) for k, v in items.items()) > MAX_SIZE:
            raise ValueError("variables are limited to 64KiB in total size")
        with self.c.op():
            current = self._check(namespace, path, cas)
            idx = self.c._idx("variables")
            now = self.c.wall()
            v = {
                "Namespace": namespace,
                "Path": path,
                "Lock": None,
                "CreateIndex": current["CreateIndex"] if current else idx,
                "CreateTime": current["CreateTime"] if current else now,
                "ModifyIndex": idx,
                "ModifyTime": now,
                "Items": dict(items),
            }
            self.data[(namespace, path)] = v
            return v

    def delete(self, namespace: str, path: str, cas: int | None) -> int:
        """Delete (a missing variable is fine); returns the write index."""
        with self.c.op():
            self._check(namespace, path, cas)
            self.data.pop((namespace, path), None)
            return self.c._idx("variables")

    def list(self, namespace: str, prefix: str) -> list[dict[str, Any]]:
        found = [v for (ns, p), v in self.data.items()
                 if (namespace == "*" or ns == namespace) and p.startswith(prefix)]
        return [self.metadata(v) for v in sorted(found, key=lambda v: (v["Namespace"], v["Path"]))]
