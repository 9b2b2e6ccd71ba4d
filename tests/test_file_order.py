"""The suite hands its files to the workers longest first (tests/file_order.py, scripts/test.sh)."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests import file_order

REPO = Path(__file__).resolve().parent.parent


@dataclass
class Item:
    nodeid: str


def ids(items: list[Item]) -> list[str]:
    return [i.nodeid for i in items]


def test_files_go_longest_first_and_keep_their_own_order() -> None:
    items = [Item(n) for n in ("tests/test_a.py::one", "tests/test_a.py::two", "tests/test_b.py::x[1]",
                               "tests/test_b.py::x[2]", "tests/test_c.py::only", "tests/test_a.py::three")]
    out = file_order.longest_first(items, {"tests/test_a.py": 1.0, "tests/test_b.py": 300.0, "tests/test_c.py": 20.0})
    assert ids(out) == ["tests/test_b.py::x[1]", "tests/test_b.py::x[2]", "tests/test_c.py::only",
                        "tests/test_a.py::one", "tests/test_a.py::two", "tests/test_a.py::three"]


def test_a_file_the_table_does_not_know_is_given_the_median_and_ties_keep_collection_order() -> None:
    items = [Item("tests/test_new.py::t"), Item("tests/test_fast.py::t"), Item("tests/test_mid.py::t"),
             Item("tests/test_slow.py::t"), Item("tests/test_new2.py::t")]
    table = {"tests/test_fast.py": 1.0, "tests/test_mid.py": 10.0, "tests/test_slow.py": 100.0}
    out = file_order.longest_first(items, table)
    assert ids(out) == ["tests/test_slow.py::t", "tests/test_new.py::t", "tests/test_mid.py::t",
                        "tests/test_new2.py::t", "tests/test_fast.py::t"]
    assert ids(file_order.longest_first(items, {})) == ids(items)  # no table: the order as collected
    # a table that lists only some files says what the others weigh
    assert ids(file_order.longest_first(items, table, default=5.0))[:3] == [
        "tests/test_slow.py::t", "tests/test_mid.py::t", "tests/test_new.py::t"]


def test_a_missing_or_broken_table_costs_only_the_order(tmp_path: Path) -> None:
    assert file_order.load(tmp_path / "absent.json") == {}
    (tmp_path / "broken.json").write_text("{not json")
    assert file_order.load(tmp_path / "broken.json") == {}
    assert file_order.default_seconds(tmp_path / "broken.json") is None
    (tmp_path / "t.json").write_text('{"default": 12, "files": {"tests/test_a.py": 3.5}}')
    assert file_order.load(tmp_path / "t.json") == {"tests/test_a.py": 3.5}
    assert file_order.default_seconds(tmp_path / "t.json") == 12.0


def test_the_table_names_only_test_files_that_exist() -> None:
    table = file_order.load()
    assert table, "tests/durations.json is missing or empty"
    stale = [f for f in table if not (REPO / f).is_file() or not Path(f).name.startswith("test_")]
    assert not stale, f"rewrite the table (scripts/test_durations.py): {stale}"
    assert all(s >= 0 for s in table.values())


def test_the_suite_keeps_this_order_under_xdist(pytestconfig: pytest.Config) -> None:
    """scripts/test.sh runs loadfile with pytest-xdist's own reordering off (it would put the files with
    the most tests first again), and the installed pytest-xdist knows the option."""
    script = (REPO / "scripts" / "test.sh").read_text()
    assert "--dist loadfile --no-loadscope-reorder" in script
    assert pytestconfig.getoption("loadscopereorder", default=None) is not None, "pytest-xdist >= 3.6 is needed"


def test_the_rewrite_script_sums_a_junit_report_per_file(tmp_path: Path) -> None:
    report = tmp_path / "r.xml"
    report.write_text(
        '<testsuites><testsuite name="pytest">'
        '<testcase classname="tests.test_chaos" name="test_a" time="400.5"/>'
        '<testcase classname="tests.test_chaos" name="test_b" time="2.0"/>'
        '<testcase classname="tests.test_fuzz.TestHost" name="test_c[1]" time="3.5"/>'
        '</testsuite></testsuites>')
    before = (REPO / "tests" / "durations.json").read_bytes()
    out = subprocess.run([sys.executable, str(REPO / "scripts" / "test_durations.py"), "--dry-run", str(report)],
                         capture_output=True, text=True, timeout=60, check=True)
    rows = [line.split() for line in out.stdout.splitlines()]
    assert ["402.5", "tests/test_chaos.py"] in rows and ["3.5", "tests/test_fuzz.py"] in rows
    assert rows.index(["402.5", "tests/test_chaos.py"]) < rows.index(["3.5", "tests/test_fuzz.py"])  # longest first
    assert (REPO / "tests" / "durations.json").read_bytes() == before  # --dry-run writes nothing
