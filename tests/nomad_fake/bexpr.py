"""A small subset of go-bexpr, enough for ``?filter=`` on list endpoints.

Supported: ``and`` / ``or`` / ``not`` / parentheses; ``Sel == v``, ``Sel != v``,
``v in Sel``, ``v not in Sel``, ``Sel contains v``, ``Sel not contains v``,
``Sel is empty``, ``Sel is not empty``, ``Sel matches "re"``; selectors are dotted paths
(``TaskStates.web.State``); values are "double-quoted" or `backtick` strings, numbers,
``true``/``false``. Anything else raises :class:`FilterError` (the endpoints answer 400).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

Pred = Callable[[Any], bool]


class FilterError(Exception):
    pass


_TOKEN = re.compile(
    r"""\s*(?:
        (?P<lp>\() | (?P<rp>\)) |
        (?P<op>==|!=) |
        (?P<str>"(?:[^"\\]|\\.)*"|`[^`]*`) |
        (?P<num>-?\d+(?:\.\d+)?) |
        (?P<word>[A-Za-z_][A-Za-z0-9_\-]*(?:\.[A-Za-z0-9_\-\[\]"]+)*)
    )""",
    re.VERBOSE,
)

_KEYWORDS = {"and", "or", "not", "in", "contains", "is", "empty", "matches", "true", "false"}


def _tokenize(text: str) -> list[tuple[str, str]]:
    pos, out = 0, []
    text = text.strip()
    while pos < len(text):
        m = _TOKEN.match(text, pos)
        if not m or m.end() == pos:
            raise FilterError(f'1:{pos + 1} ({pos}): no match found, expected: "(", "not" or selector')
        kind = m.lastgroup or ""
        value = m.group(kind)
        if kind == "word" and value.lower() in _KEYWORDS:
            kind = "kw"
            value = value.lower()
        out.append((kind, value))
        pos = m.end()
        while pos < len(text) and text[pos].isspace():
            pos += 1
    return out


def _lookup(obj: Any, path: str) -> tuple[bool, Any]:
    cur = obj
    for part in path.split("."):
        if isinstance(cur, dict) and part in cur:
            cur = cur[part]
        else:
            return False, None
    return True, cur


def _literal(kind: str, value: str) -> Any:
    if kind == "str":
        if value.startswith("`"):
            return value[1:-1]
        return bytes(value[1:-1], "utf-8").decode("unicode_escape")
    if kind == "num":
        return float(value) if "." in value else int(value)
    if value == "true":
        return True
    if value == "false":
        return False
    raise FilterError(f"invalid value {value!r}")


def _equal(a: Any, b: Any) -> bool:
    if isinstance(a, bool) or isinstance(b, bool):
        return str(a).lower() == str(b).lower()
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return a == b
    return str(a) == str(b) if a is not None else b == ""


class _Parser:
    def __init__(self, tokens: list[tuple[str, str]]) -> None:
        self.t = tokens
        self.i = 0

    def peek(self) -> tuple[str, str] | None:
        return self.t[self.i] if self.i < len(self.t) else None

    def take(self) -> tuple[str, str]:
        tok = self.peek()
        if tok is None:
            raise FilterError("unexpected end of expression")
        self.i += 1
        return tok

    def accept(self, kind: str, value: str | None = None) -> bool:
        tok = self.peek()
        if tok and tok[0] == kind and (value is None or tok[1] == value):
            self.i += 1
            return True
        return False

    def parse(self) -> Pred:
        pred = self.or_expr()
        if self.peek() is not None:
            raise FilterError(f"unexpected token {self.peek()[1]!r}")  # type: ignore[index]
        return pred

    def or_expr(self) -> Pred:
        left = self.and_expr()
        while self.accept("kw", "or"):
            right = self.and_expr()
            left = (lambda lft, rgt: lambda o: lft(o) or rgt(o))(left, right)
        return left

    def and_expr(self) -> Pred:
        left = self.not_expr()
        while self.accept("kw", "and"):
            right = self.not_expr()
            left = (lambda lft, rgt: lambda o: lft(o) and rgt(o))(left, right)
        return left

    def not_expr(self) -> Pred:
        if self.accept("kw", "not"):
            inner = self.not_expr()
            return lambda o: not inner(o)
        if self.accept("lp"):
            inner = self.or_expr()
            if not self.accept("rp"):
                raise FilterError('expected ")"')
            return inner
        return self.match()

    def match(self) -> Pred:
        kind, value = self.take()
        if kind in ("str", "num") or (kind == "kw" and value in ("true", "false")):
            lit = _literal(kind, value)
            negate = self.accept("kw", "not")
            if not self.accept("kw", "in"):
                raise FilterError('expected "in"')
            sk, sel = self.take()
            if sk != "word":
                raise FilterError("expected selector")

            def in_pred(o: Any) -> bool:
                found, v = _lookup(o, sel)
                if not found or v is None:
                    res = False
                elif isinstance(v, dict):
                    res = str(lit) in v
                elif isinstance(v, list):
                    res = any(_equal(x, lit) for x in v)
                else:
                    res = str(lit) in str(v)
                return res != negate

            return in_pred
        if kind != "word":
            raise FilterError(f"unexpected token {value!r}")
        sel = value
        tok = self.take()
        if tok == ("op", "=="):
            lit = _literal(*self.take())
            return lambda o: _equal(_lookup(o, sel)[1], lit) if _lookup(o, sel)[0] else False
        if tok == ("op", "!="):
            lit = _literal(*self.take())
            return lambda o: not (_equal(_lookup(o, sel)[1], lit) if _lookup(o, sel)[0] else False)
        if tok == ("kw", "is"):
            negate = self.accept("kw", "not")
            if not self.accept("kw", "empty"):
                raise FilterError('expected "empty"')
            return lambda o: (not _lookup(o, sel)[1]) != negate
        negate = False
        if tok == ("kw", "not"):
            negate = True
            tok = self.take()
        if tok == ("kw", "contains"):
            lit = _literal(*self.take())

            def contains(o: Any) -> bool:
                found, v = _lookup(o, sel)
                if not found or v is None:
                    return negate
                if isinstance(v, (list, dict)):
                    res = any(_equal(x, lit) for x in v)
                else:
                    res = str(lit) in str(v)
                return res != negate

            return contains
        if tok == ("kw", "matches"):
            pattern = re.compile(str(_literal(*self.take())))
            return lambda o: bool(pattern.search(str(_lookup(o, sel)[1] or ""))) != negate
        raise FilterError(f"unexpected token {tok[1]!r}")


def compile_filter(text: str) -> Pred:
    return _Parser(_tokenize(text)).parse()
