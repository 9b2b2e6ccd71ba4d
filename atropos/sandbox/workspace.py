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
service). This module holds the errors they share.
"""

from __future__ import annotations

from atropos.errors import AtroposSandboxError, InfrastructureError

TOOL_PATH = "/usr/local/bin:/usr/bin:/bin"


# -- errors ------------------------------------------------------------------------------------
class TemplateError(AtroposSandboxError):
    """A template request that cannot be served; ``code``/``status`` map onto the HTTP error."""

    code = "template_error"
    status = 400


class UnknownTemplate(TemplateError):
    code, status = "unknown_template", 404


class TemplateInUse(TemplateError):
    code, status = "template_in_use", 409


class TemplateSourceError(TemplateError):
    code, status = "template_source_invalid", 400


class TemplateBuildFailed(TemplateError):
    """The source could not be turned into a tree (git clone failed, corrupt archive, ...)."""

    code, status = "template_failed", 400


class WorkspaceError(InfrastructureError):
    """Mounting, unmounting or copying a workspace failed (the slot is quarantined)."""
