"""Task ``template`` rendering: the small subset of consul-template the fake needs.

Nomad renders every template of a task before the task starts; one with ``env = true``
(``Envvars`` in JSON) is parsed as an env file and merged into the task's environment. The
fake supports what a job reading a Nomad variable needs::

    {{ with nomadVar "nomad/jobs/my-job" }}TOKEN={{ .token }}{{ end }}

* plain text, ``{{ with nomadVar "PATH" }} ... {{ end }}`` (nestable) and ``{{ .key }}`` inside it;
* ``{{-`` / ``-}}`` whitespace trimming, as Go's text/template does;
* a variable that does not exist (or that the task may not read) *blocks* the template: the
  caller gets :class:`MissingVariable` and the task does not start, as in Nomad (which reports
  ``Missing: nomad.var.block(PATH@NAMESPACE.REGION)`` in a ``Template`` task event);
* anything else (functions, ``range``, ``if``, ``$vars``) raises :class:`TemplateError`: a fake
  that silently rendered it wrong would be worse.
"""

from __future__ import annotations

import re
from collections.abc import Callable

VarLookup = Callable[[str], "dict[str, str] | None"]

_ACTION = re.compile(r"\{\{(-?)\s*(.*?)\s*(-?)\}\}", re.S)
_WITH_VAR = re.compile(r'with\s+nomadVar\s+"([^"]+)"')
_FIELD = re.compile(r"\.([A-Za-z_][A-Za-z0-9_]*)")


class TemplateError(Exception):
    """The template uses something the fake (or Nomad) cannot render."""


class MissingVariable(Exception):
    """The template reads a variable that does not exist (yet): rendering blocks."""

    def __init__(self, path: str) -> None:
        super().__init__(path)
        self.path = path


def _tokens(text: str) -> list[tuple[str, str]]:
    """[("text", s) | ("action", body)], with ``{{-``/``-}}`` trimming applied to the text."""
    out: list[tuple[str, str]] = []
    pos = 0
    for m in _ACTION.finditer(text):
        chunk = text[pos : m.start()]
        if m.group(1):
            chunk = chunk.rstrip()
        out.append(("text", chunk))
        out.append(("action", m.group(2)))
        pos = m.end()
        if m.group(3):
            rest = text[pos:]
            pos += len(rest) - len(rest.lstrip())
    out.append(("text", text[pos:]))
    return out


def render(text: str, lookup: VarLookup) -> str:
    """Render ``text``; ``lookup(path)`` returns a variable's Items or None when it is missing."""
    out: list[str] = []
    scopes: list[dict[str, str]] = []
    for kind, body in _tokens(text):
        if kind == "text":
            out.append(body)
            continue
        m = _WITH_VAR.fullmatch(body)
        if m:
            items = lookup(m.group(1))
            if items is None:
                raise MissingVariable(m.group(1))
            scopes.append(items)
            continue
        if body == "end":
            if not scopes:
                raise TemplateError("unexpected {{end}}")
            scopes.pop()
            continue
        m = _FIELD.fullmatch(body)
        if m and scopes:
            # consul-template prints a missing key of a variable as "<no value>".
            out.append(scopes[-1].get(m.group(1), "<no value>"))
            continue
        raise TemplateError(f"fake-nomad cannot render template action {{{{ {body} }}}}")
    if scopes:
        raise TemplateError("unexpected EOF: missing {{end}}")
    return "".join(out)


def parse_env(text: str) -> dict[str, str]:
    """An ``env = true`` template's output: ``KEY=VALUE`` lines (blank lines and ``#`` comments
    skipped, optional ``export`` prefix and surrounding quotes removed), as Nomad's envparse reads it."""
    env: dict[str, str] = {}
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.startswith("export "):
            line = line[len("export ") :].lstrip()
        key, sep, value = line.partition("=")
        if not sep or not key.strip():
            raise TemplateError(f"invalid env file line {raw!r}")
        value = value.strip()
        if len(value) >= 2 and value[0] == value[-1] and value[0] in "\"'":
            value = value[1:-1]
        env[key.strip()] = value
    return env
