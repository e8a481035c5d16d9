"""The estimator table (docs/estimators.md; the README's until issue #29 moved it) is the server's listing: the
same estimator names, and for each one the same required and optional inputs that ``ListEstimators`` declares.
A new estimator, a renamed input or an input that becomes optional fails here until the page says so. And the
README's adoption table keeps a row per framework adapter, each naming tests that exist.

Table format (docs/estimators.md, the first table under its "# Estimators" heading): one row per estimator, the
first cell the backticked name, then a "required inputs" cell and an "optional inputs" cell naming inputs in
backticks (`` `rewards` `[B]` or `[B, T]` ``; shapes in backticks are ignored, a name is a backticked word that
is not a bracketed shape).
"""
from __future__ import annotations

import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
ESTIMATORS = ROOT / "docs" / "estimators.md"
README = ROOT / "README.md"

_TICKS = re.compile(r"`([^`]+)`")


def _cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


def readme_table() -> tuple[list[str], dict[str, dict[str, str]]]:
    """(header cells, {estimator name: {header: cell}}) of the first table under the '# Estimators' heading."""
    text = ESTIMATORS.read_text()
    match = re.search(r"^#{1,3} Estimators\s*$(.*?)(?=^#{1,3} |\Z)", text, flags=re.M | re.S)
    assert match, "docs/estimators.md has no 'Estimators' heading"
    lines = [ln for ln in match.group(1).splitlines() if ln.strip().startswith("|")]
    assert len(lines) >= 3, "no table in docs/estimators.md's Estimators section"
    header = [c.lower() for c in _cells(lines[0])]
    rows: dict[str, dict[str, str]] = {}
    for line in lines[2:]:
        cells = _cells(line)
        if len(cells) != len(header):
            break  # the next table
        names = _TICKS.findall(cells[0])
        assert len(names) == 1, f"first cell must be one backticked estimator name: {line!r}"
        assert names[0] not in rows, f"estimator {names[0]!r} listed twice"
        rows[names[0]] = dict(zip(header, cells))
    return header, rows


def input_names(cell: str) -> set[str]:
    return {t for t in _TICKS.findall(cell) if not t.startswith("[") and t not in ("–", "-")}


@pytest.fixture(scope="module")
def listing(client):
    return {e.name: e for e in client.list_estimators().estimators}


@pytest.fixture(scope="module")
def table():
    header, rows = readme_table()
    assert "required inputs" in header and "optional inputs" in header, header
    return rows


def test_readme_lists_exactly_the_served_estimators(listing, table):
    missing = sorted(set(listing) - set(table))
    extra = sorted(set(table) - set(listing))
    assert not missing and not extra, \
        f"docs/estimators.md table vs ListEstimators: missing {missing}, not served {extra}"


def test_readme_required_and_optional_inputs_match_the_listing(listing, table):
    problems = []
    for name, info in sorted(listing.items()):
        if name not in table:
            continue  # reported by the test above
        required = {s.name for s in info.inputs if s.required}
        optional = {s.name for s in info.inputs if not s.required}
        got_required = input_names(table[name]["required inputs"])
        got_optional = input_names(table[name]["optional inputs"])
        if got_required != required:
            problems.append(f"{name}: table required {sorted(got_required)}, server requires {sorted(required)}")
        if got_optional != optional:
            problems.append(f"{name}: table optional {sorted(got_optional)}, server declares {sorted(optional)}")
    assert not problems, "\n".join(problems)


def test_table_parser_reads_names_not_shapes():
    assert input_names("`rewards` `[B]` or `[B, T]`, `mask`, `reward/<name>` `[B]`") == {
        "rewards", "mask", "reward/<name>"}
    assert input_names("–") == set()


#: the README's adoption table: framework (first cell) -> its adapter module under client/advantage_client/
ADAPTERS = {"NeMo RL": "nemo", "verl": "verl", "OpenRLHF": "openrlhf", "TRL": "trl", "SkyRL": "skyrl", "AReaL": "areal",
            "slime": "slime", "ROLL": "roll", "prime-rl": "prime_rl"}


def test_readme_adoption_table_has_every_framework_and_its_tests():
    text = README.read_text()
    match = re.search(r"^## Adopting it in your framework\s*$(.*?)(?=^#{1,2} )", text, flags=re.M | re.S)
    assert match, "README.md has no '## Adopting it in your framework' section"
    rows = [_cells(ln) for ln in match.group(1).splitlines() if ln.startswith("|")][2:]
    assert [r[0] for r in rows] == list(ADAPTERS), [r[0] for r in rows]
    for row in rows:
        assert len(row) == 4 and all(row), row  # framework | the change | what stays the same | proven by
        assert (ROOT / "client" / "advantage_client" / f"{ADAPTERS[row[0]]}.py").is_file(), row[0]
        tests = re.findall(r"`(tests/[\w/]+\.py)`", row[3])
        assert tests, f"{row[0]}: no test named in 'proven by'"
        missing = [t for t in tests if not (ROOT / t).is_file()]
        assert not missing, f"{row[0]}: the adoption table names tests that do not exist: {missing}"


def test_the_readme_reads_in_two_minutes():
    """Issue #37 item 4: the README is the front door: at most 150 lines, and no table cell over 300 characters (the
    adoption table's AReaL row was one 2,853-character line; the full table lives in docs/frameworks.md)."""
    lines = README.read_text().splitlines()
    assert len(lines) <= 150, len(lines)
    long = [(n + 1, len(cell)) for n, line in enumerate(lines) if line.startswith("|")
            for cell in _cells(line) if len(cell) > 300]
    assert not long, f"README table cells over 300 characters (line, length): {long}"
