"""The repositories of the SWE-style example (``atropos/envs/examples/swe.py``), as data: each a
small package with a bug in one function, its tests, its test configuration and the fix.

Kept as strings rather than files in the tree so that the project's own pytest, ruff and mypy never
collect a task's tests or its deliberately buggy code. ``swe_tasks.py`` builds an image of each.
"""

from __future__ import annotations

from pydantic import BaseModel

__all__ = ["REPOS", "Edit", "Repo"]


class Edit(BaseModel):
    """One exact-string replacement in a file of the repository (what ``edit_file`` takes)."""

    path: str
    old: str
    new: str


class Repo(BaseModel):
    """A repository at its base commit and what the task says about it."""

    instance_id: str
    files: dict[str, str]  # path inside the repository -> content
    problem_statement: str
    fail_to_pass: list[str]  # pytest node ids, relative to the repository
    pass_to_pass: list[str]
    pytest_config: str  # the file pytest takes its settings from (passed as -c)
    gold: list[Edit]  # the reference fix


STRKIT = Repo(
    instance_id="strkit-1",
    files={
        "README.md": "# strkit\n\nSmall string helpers: case conversion, truncation, wrapping.\n",
        "pyproject.toml": (
            '[project]\nname = "strkit"\nversion = "0.3.1"\nrequires-python = ">=3.9"\n\n'
            '[tool.pytest.ini_options]\ntestpaths = ["tests"]\naddopts = "-ra"\n'),
        "strkit/__init__.py": ('from strkit.text import snake_case, truncate, wrap\n\n'
                               '__all__ = ["snake_case", "truncate", "wrap"]\n'),
        "strkit/text.py": '''"""Text helpers."""

import re

_BOUNDARY = re.compile(r"(?<=[a-z0-9])(?=[A-Z])|[\\s\\-]+")


def snake_case(name):
    """``HelloWorld``, ``hello-world`` and ``hello world`` all become ``hello_world``."""
    return "_".join(part.lower() for part in _BOUNDARY.split(name.strip()) if part)


def truncate(text, width, suffix="..."):
    """Shorten ``text`` to at most ``width`` characters; a cut text ends with ``suffix``."""
    if width < len(suffix):
        raise ValueError("width is shorter than the suffix")
    if len(text) <= width:
        return text
    return text[:width] + suffix


def wrap(text, width):
    """Split ``text`` into lines of at most ``width`` characters, breaking between words."""
    lines, line = [], ""
    for word in text.split():
        if line and len(line) + 1 + len(word) > width:
            lines.append(line)
            line = word
        else:
            line = f"{line} {word}" if line else word
    if line:
        lines.append(line)
    return lines
''',
        "tests/conftest.py": '''import pytest


@pytest.fixture
def sentence():
    return "the quick brown fox jumps over the lazy dog"
''',
        "tests/test_text.py": '''import pytest

from strkit import snake_case, truncate, wrap


@pytest.mark.parametrize("name", ["HelloWorld", "hello-world", "hello world", "  Hello World "])
def test_snake_case(name):
    assert snake_case(name) == "hello_world"


def test_truncate_keeps_short_text():
    assert truncate("short", 10) == "short"


def test_truncate_fits_width(sentence):
    cut = truncate(sentence, 12)
    assert cut == "the quick..."
    assert len(cut) == 12


def test_truncate_custom_suffix():
    assert truncate("abcdefghij", 6, suffix="~") == "abcde~"


def test_truncate_refuses_tiny_width():
    with pytest.raises(ValueError):
        truncate("abc", 2)


def test_wrap(sentence):
    assert wrap(sentence, 10) == ["the quick", "brown fox", "jumps over", "the lazy", "dog"]
''',
    },
    problem_statement=(
        "`strkit.truncate(text, width)` returns strings longer than `width` when it cuts them: "
        "`truncate('the quick brown fox', 12)` gives `'the quick br...'` (15 characters). The result "
        "must be at most `width` characters long, suffix included."),
    fail_to_pass=["tests/test_text.py::test_truncate_fits_width", "tests/test_text.py::test_truncate_custom_suffix"],
    pass_to_pass=["tests/test_text.py::test_snake_case[HelloWorld]", "tests/test_text.py::test_snake_case[hello-world]",
                  "tests/test_text.py::test_snake_case[hello world]",
                  "tests/test_text.py::test_snake_case[  Hello World ]",
                  "tests/test_text.py::test_truncate_keeps_short_text",
                  "tests/test_text.py::test_truncate_refuses_tiny_width", "tests/test_text.py::test_wrap"],
    pytest_config="pyproject.toml",
    gold=[Edit(path="strkit/text.py", old="    return text[:width] + suffix\n",
               new="    return text[:width - len(suffix)] + suffix\n")],
)

DATEWISE = Repo(
    instance_id="datewise-1",
    files={
        "README.md": "# datewise\n\nParse the date formats people type: `2024-03-05`, `05/03/2024`, `Mar 5, 2024`.\n",
        "setup.cfg": ("[metadata]\nname = datewise\nversion = 1.2.0\n\n[options]\npackages = datewise\n\n"
                      "[tool:pytest]\ntestpaths = tests\n"),
        "datewise/__init__.py": 'from datewise.parse import days_in_month, is_leap, parse_date\n',
        "datewise/parse.py": '''"""Parse dates in the few formats people type."""

import datetime
import re

MONTHS = {name: i for i, name in enumerate(
    ["jan", "feb", "mar", "apr", "may", "jun", "jul", "aug", "sep", "oct", "nov", "dec"], start=1)}
_DAYS = [31, 28, 31, 30, 31, 30, 31, 31, 30, 31, 30, 31]
_ISO = re.compile(r"^(\\d{4})-(\\d{1,2})-(\\d{1,2})$")
_SLASH = re.compile(r"^(\\d{1,2})/(\\d{1,2})/(\\d{4})$")
_NAMED = re.compile(r"^([A-Za-z]{3})[a-z]*\\.? (\\d{1,2}), (\\d{4})$")


def is_leap(year):
    """Whether ``year`` has a February 29 (Gregorian calendar)."""
    return year % 4 == 0


def days_in_month(year, month):
    if not 1 <= month <= 12:
        raise ValueError(f"no month {month}")
    return 29 if month == 2 and is_leap(year) else _DAYS[month - 1]


def parse_date(text):
    """``2024-03-05``, ``05/03/2024`` (day first) or ``Mar 5, 2024`` -> ``datetime.date``."""
    text = text.strip()
    if m := _ISO.match(text):
        year, month, day = (int(g) for g in m.groups())
    elif m := _SLASH.match(text):
        day, month, year = (int(g) for g in m.groups())
    elif m := _NAMED.match(text):
        month = MONTHS.get(m.group(1).lower())
        if month is None:
            raise ValueError(f"unknown month in {text!r}")
        day, year = int(m.group(2)), int(m.group(3))
    else:
        raise ValueError(f"not a date: {text!r}")
    if not 1 <= day <= days_in_month(year, month):
        raise ValueError(f"no day {day} in {year}-{month:02d}")
    return datetime.date(year, month, day)
''',
        "tests/__init__.py": "",
        "tests/test_parse.py": '''import datetime

import pytest

from datewise import days_in_month, is_leap, parse_date


def test_iso():
    assert parse_date("2024-03-05") == datetime.date(2024, 3, 5)


def test_day_first_with_slashes():
    assert parse_date("05/03/2024") == datetime.date(2024, 3, 5)


def test_month_names():
    assert parse_date("Sept 9, 2021") == datetime.date(2021, 9, 9)
    assert parse_date("mar 5, 2024") == datetime.date(2024, 3, 5)


def test_leap_days():
    assert parse_date("2024-02-29") == datetime.date(2024, 2, 29)
    assert parse_date("2000-02-29") == datetime.date(2000, 2, 29)
    with pytest.raises(ValueError):
        parse_date("2023-02-29")


def test_century_years_are_not_leap():
    assert not is_leap(1900) and not is_leap(2100)
    assert is_leap(2000) and is_leap(2400)


def test_no_february_29_in_1900():
    with pytest.raises(ValueError):
        parse_date("29/02/1900")
    assert days_in_month(1900, 2) == 28


def test_garbage():
    with pytest.raises(ValueError):
        parse_date("yesterday")
''',
    },
    problem_statement=(
        "`datewise.is_leap(1900)` returns True, so `days_in_month(1900, 2)` says 29 (and "
        "`parse_date('29/02/1900')` fails inside `datetime` rather than with datewise's own message). A "
        "century year is a leap year only when divisible by 400 (1900 is not, 2000 is)."),
    fail_to_pass=["tests/test_parse.py::test_century_years_are_not_leap",
                  "tests/test_parse.py::test_no_february_29_in_1900"],
    pass_to_pass=["tests/test_parse.py::test_iso", "tests/test_parse.py::test_day_first_with_slashes",
                  "tests/test_parse.py::test_month_names", "tests/test_parse.py::test_leap_days",
                  "tests/test_parse.py::test_garbage"],
    pytest_config="setup.cfg",
    gold=[Edit(path="datewise/parse.py", old="    return year % 4 == 0\n",
               new="    return year % 4 == 0 and (year % 100 != 0 or year % 400 == 0)\n")],
)

INIKIT = Repo(
    instance_id="inikit-1",
    files={
        "README.md": "# inikit\n\nA forgiving INI reader: sections, `key = value`, `;` and `#` comments.\n",
        "pytest.ini": "[pytest]\ntestpaths = tests\nxfail_strict = true\n",
        "conftest.py": '''import textwrap

import pytest


@pytest.fixture
def sample():
    return textwrap.dedent("""
        ; global settings
        name = demo

        [server]
        host = example.org
        # the port
        port = 8080
    """)
''',
        "inikit/__init__.py": 'from inikit.reader import parse\n',
        "inikit/reader.py": '''"""Read INI text into nested dicts."""


def parse(text):
    """``{section: {key: value}}``; keys before the first section go to ``""``."""
    sections = {"": {}}
    current = sections[""]
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if not line or line[0] in ";#":
            continue
        if line.startswith("[") and line.endswith("]"):
            current = sections.setdefault(line[1:-1].strip(), {})
            continue
        if "=" not in line:
            raise ValueError(f"line {number}: expected key = value")
        key, value = line.split("=")[:2]
        current[key.strip()] = value.strip()
    return sections
''',
        "tests/test_reader.py": '''import pytest

from inikit import parse


def test_sections(sample):
    assert parse(sample) == {"": {"name": "demo"}, "server": {"host": "example.org", "port": "8080"}}


def test_empty():
    assert parse("") == {"": {}}


def test_bad_line():
    with pytest.raises(ValueError, match="line 2"):
        parse("[a]\\nnonsense")


def test_value_may_hold_equals_signs():
    assert parse("[db]\\nurl = postgres://h/db?sslmode=require")["db"]["url"] == "postgres://h/db?sslmode=require"
    assert parse("expr = a == b")[""]["expr"] == "a == b"
''',
    },
    problem_statement=(
        "inikit cuts values that contain `=`: `url = postgres://h/db?sslmode=require` is read as "
        "`postgres://h/db?sslmode`. Only the first `=` of a line separates the key from the value."),
    fail_to_pass=["tests/test_reader.py::test_value_may_hold_equals_signs"],
    pass_to_pass=["tests/test_reader.py::test_sections", "tests/test_reader.py::test_empty",
                  "tests/test_reader.py::test_bad_line"],
    pytest_config="pytest.ini",
    gold=[Edit(path="inikit/reader.py", old='        key, value = line.split("=")[:2]\n',
               new='        key, _, value = line.partition("=")\n')],
)

REPOS: list[Repo] = [STRKIT, DATEWISE, INIKIT]
