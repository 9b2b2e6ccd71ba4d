"""slotd's C side of the slot's protocol, generated from its one declaration
(atropos/sandbox/inslot/inslot_protocol.py) into ``slotd_protocol.h`` beside slotd.c.

For every op slotd serves, and for its configuration frame: a struct with one member per field slotd
carries (in the declared order) and a parser that reads the fields in that order and checks their
bounds and choices, plus the frame bound, the op's kind byte and the configuration's rlimit names.
scripts/gen_slotd_header.py writes the file; tests/test_slot_protocol.py regenerates it and compares,
and checks that slotd.c reads every member.
"""

from __future__ import annotations

from pathlib import Path

from atropos.sandbox.inslot import inslot_protocol as P

HEADER = Path(P.__file__).with_name("slotd_protocol.h")
# C names that a field's own name would clash with (stdio's stdin is a macro).
_RESERVED = frozenset({"stdin", "stdout", "stderr", "errno", "signal", "time", "exit", "free"})


def member(name: str) -> str:
    """The C member of a field."""
    return name + "_" if name in _RESERVED else name


def _num(v: float | None, fallback: str, real: bool = False) -> str:
    if v is None:
        return fallback
    return repr(float(v)) if real else f"{int(v)}LL"


def _members(f: P.Field) -> list[str]:
    m = member(f.name)
    return {
        "float": [f"double {m};"],
        "int": [f"long long {m};"],
        "opt_int": [f"long long {m}; /* 0 when absent */", f"int has_{m};"],
        "bool": [f"int {m};"],
        "opt_bool": [f"int {m}; /* -1 when absent, else 0 or 1 */"],
        "str": [f"char *{m};{' /* may hold NUL bytes */' if f.raw else ''}", f"size_t {m}_len;"],
        "opt_str": [f"char *{m}; /* empty when absent */", f"size_t {m}_len;"],
        "opt_text": [f"char *{m}; /* empty when absent; may hold NUL bytes */", f"size_t {m}_len;"],
        "strs": [f"long long {m}_n;", f"char **{m}; /* {m}_n strings, then NULL */"],
        "pairs": [f"long long {m}_n;", f"char **{m}; /* 2*{m}_n strings: name, value, ... then NULL */"],
    }[f.type]


def _parse(f: P.Field) -> list[str]:
    m, lo, hi = member(f.name), f.lo, f.hi
    lo_c, hi_c = _num(lo, "-1e300", real=True), _num(hi, "1e300", real=True)
    n_lo, n_hi = _num(lo, "0"), _num(hi, "1LL << 62")
    if f.type == "float":
        return [f"r->{m} = slotd_float(f, {lo_c}, {hi_c});"]
    if f.type == "int":
        return [f"r->{m} = slotd_int(f, {n_lo}, {n_hi}, 0);"]
    if f.type == "opt_int":
        return [f"r->{m} = slotd_int(f, {n_lo}, {n_hi}, &r->has_{m});"]
    if f.type == "bool":
        return [f"r->{m} = slotd_bool(f, 0);"]
    if f.type == "opt_bool":
        return [f"r->{m} = slotd_bool(f, 1);"]
    if f.type == "str" and f.raw:  # bytes that may hold NUL (inslot_protocol.Field.raw)
        return [f"r->{m} = slotd_str(f, &r->{m}_len, {n_lo}, {n_hi}, 1);"]
    if f.type in ("str", "opt_str"):
        return [f"r->{m} = slotd_str(f, &r->{m}_len, {n_lo if f.type == 'str' else '0'}, {n_hi}, 0);"]
    if f.type == "opt_text":
        return [f"r->{m} = slotd_str(f, &r->{m}_len, 0, {n_hi}, 1);"]
    if f.type == "strs":
        return [f"r->{m} = slotd_strs(f, &r->{m}_n, {n_lo}, {n_hi}, 1);"]
    if f.type == "pairs":
        return [f"r->{m} = slotd_strs(f, &r->{m}_n, {n_lo}, {n_hi}, 2);"]
    raise ValueError(f"slotd cannot carry a field of type {f.type} ({f.name})")


def _free(f: P.Field) -> list[str]:
    m = member(f.name)
    if f.type in ("str", "opt_str", "opt_text"):
        return [f"free(r->{m});"]
    if f.type in ("strs", "pairs"):
        return [f"slotd_free_strs(r->{m});"]
    return []


def _choices(prefix: str, f: P.Field) -> tuple[list[str], list[str]]:
    """A field's ``choices`` checked in C: the table (before the parser) and the check (after the field
    is read); a ``str`` is one of them, each name of a ``pairs`` field is."""
    if not f.choices:
        return [], []
    m, table = member(f.name), f"{prefix}_{member(f.name)}_choices"
    names = ", ".join(f'"{c}"' for c in f.choices)
    decl = [f"static const char *const {table}[] = {{{names}, NULL}};"]
    if f.type == "str":
        return decl, [f"slotd_choices(f, &r->{m}, 1, 1, {table});"]
    if f.type == "pairs":
        return decl, [f"slotd_choices(f, r->{m}, r->{m}_n, 2, {table});"]
    raise ValueError(f"choices of a {f.type} field are not carried to slotd ({f.name})")


def _record(name: str, fields: list[P.Field]) -> list[str]:
    """The struct ``slotd_<name>_t`` of ``fields`` (in their order), its parser and its free."""
    out = ["typedef struct {"]
    out += [f"    {line}" for f in fields for line in _members(f)] or ["    int unused;"]
    out += [f"}} slotd_{name}_t;", ""]
    for f in fields:
        out += _choices(f"slotd_{name}", f)[0]
    out += [f"static void slotd_parse_{name}(fields_t *f, slotd_{name}_t *r) {{",
            "    memset(r, 0, sizeof *r);"] + (["    (void)f;"] if not fields else [])
    out += [f"    {line}" for f in fields for line in [*_parse(f), *_choices(f"slotd_{name}", f)[1]]]
    out += ["}", "", f"static void slotd_free_{name}(slotd_{name}_t *r) {{"]
    out += [f"    {line}" for f in fields for line in _free(f)] or ["    (void)r;"]
    out += ["}"]
    return out


def c_header() -> str:
    out = [
        "/* GENERATED from atropos/sandbox/inslot/inslot_protocol.py by scripts/gen_slotd_header.py: do not edit.",
        " * The requests slotd serves and its configuration frame, their fields in the declared order",
        " * (tests/test_slot_protocol.py regenerates this file and compares). slotd.c defines fields_t and",
        " * the slotd_* readers. */",
        "#ifndef SLOTD_PROTOCOL_H",
        "#define SLOTD_PROTOCOL_H",
        "",
        f"#define SLOTD_MAX_FRAME {P.MAX_FRAME}u",
    ]
    for op in P.OPS.values():
        if not op.native:
            continue
        carried = [f for f in op.fields if P.carried(f)]
        out += ["", f"/* {op.name}: {', '.join(f.name for f in carried) or 'no fields'} */",
                f"#define SLOTD_OP_{op.name.upper()} '{op.native}'", *_record(op.name, carried)]
    rlimits = ", ".join(f'{{"{name}", RLIMIT_{name.upper()}}}' for name in P.RLIMITS)
    out += ["", f"/* the configuration (the first frame): {', '.join(f.name for f in P.SLOTD_CONFIG)} */",
            f"#define SLOTD_MAX_WARM {P.MAX_WARM}",
            "/* a configuration's limits by name: setrlimit(2)'s resource of each */",
            "static const struct { const char *name; int resource; } slotd_rlimits[] = {" + rlimits + "};",
            *_record("config", list(P.SLOTD_CONFIG))]
    out += ["", "#endif", ""]
    return "\n".join(out)


def write() -> Path:
    HEADER.write_text(c_header())
    return HEADER
