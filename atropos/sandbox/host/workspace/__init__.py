"""Workspace templates and copy-on-write forks of them (see docs/templates.md).

A *template* is an immutable directory tree on the host (``<data>/templates/<id>/tree``): made
from a slot after its setup, from a host directory, a tar stream or a git repository. A slot
*forked* from a template sees it through kernel overlayfs: the template is the lower layer (a
read-only, and on root hosts idmapped, clone), the slot gets a private upper layer. Writes stay
in the upper layer; resetting the slot drops it. Where overlays cannot be mounted the host falls
back to copying the template into a fresh directory (``cp -a --reflink=auto``).

All overlays of a host live in the private mount namespace of one helper process
(``mounthelper.py``); sandboxes of forked slots are started inside it with ``nsenter``.

The parts, one job each: ``trees`` (manifest hash, deletion and copies of trees), ``mountns`` (the
mount helper's client), ``templates`` (the template store), ``workspaces`` (the host's workspace
service). This module re-exports the errors they share (defined in ``atropos.errors``).
"""

from __future__ import annotations

# defined in atropos.errors (one error model); importable from here as before
from atropos.errors import TemplateBuildFailed as TemplateBuildFailed
from atropos.errors import TemplateError as TemplateError
from atropos.errors import TemplateInUse as TemplateInUse
from atropos.errors import TemplateSourceError as TemplateSourceError
from atropos.errors import UnknownTemplate as UnknownTemplate
from atropos.errors import WorkspaceError as WorkspaceError

TOOL_PATH = "/usr/local/bin:/usr/bin:/bin"
