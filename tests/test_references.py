"""Versioned semantics: each ``semantics`` value names one release, and every place that names it agrees
with ``advantage_client/references.py`` (the one place in the code that holds the versions).

Checked here: the ``Semantics`` enum in the generated stubs has exactly those values; ``ListEstimators``
(over gRPC) reports them in ``references`` and in each ``semantics`` field's description; the ``.proto``
comment of each enum value names the release; the "Which reference" table (docs/references.md) lists each one;
``tests/references/requirements.txt`` pins the same releases the differential tests run, and the
installed packages are those releases (``make setup`` installs them).
"""
from __future__ import annotations

import importlib.metadata
import pathlib
import re

import pytest

from advantage_client import Semantics
from advantage_client.references import REFERENCES, SEMANTICS

ROOT = pathlib.Path(__file__).resolve().parent.parent
PROTO = (ROOT / "proto/advantage/v1/advantage.proto").read_text()
REFERENCES_PAGE = (ROOT / "docs" / "references.md").read_text()  # the README's until issue #29
REQUIREMENTS = (ROOT / "tests/references/requirements.txt").read_text()


def test_semantics_enum_is_the_references():
    enum_names = [n for n in Semantics.keys() if n != "SEMANTICS_UNSPECIFIED"]
    assert enum_names == [f"SEMANTICS_{s.upper()}" for s in SEMANTICS]
    assert list(REFERENCES) == list(SEMANTICS)


def test_list_estimators_reports_the_releases(client):
    listing = client.list_estimators()
    got = [(r.semantics, r.project, r.release, r.package, r.code) for r in listing.references]
    assert got == [(r.semantics, r.project, r.release, r.package or "", r.code) for r in REFERENCES.values()]
    # every semantics field says which release each of its choices reproduces
    seen = 0
    for info in listing.estimators:
        for f in info.config_fields:
            if f.name == "semantics":
                seen += 1
                for choice in f.allowed_values:
                    assert f"{choice} = {REFERENCES[choice].label}" in f.description, (info.name, choice)
    assert seen >= 5


@pytest.mark.parametrize("semantics", SEMANTICS)
def test_proto_comment_names_the_release(semantics):
    ref = REFERENCES[semantics]
    match = re.search(r"((?://[^\n]*\n\s*)+)SEMANTICS_" + semantics.upper() + r" = \d+;", PROTO)
    assert match, f"no comment above SEMANTICS_{semantics.upper()} in the .proto"
    comment = " ".join(line.strip().lstrip("/").strip() for line in match.group(1).splitlines())
    assert ref.release in comment and ref.code in comment, comment


@pytest.mark.parametrize("semantics", SEMANTICS)
def test_readme_table_names_the_release(semantics):
    ref = REFERENCES[semantics]
    # the 'Which reference' table's rows: `semantics` | release (the estimator table has an `areal` row too)
    rows = [ln for ln in REFERENCES_PAGE.splitlines() if ln.startswith(f"| `{semantics}` | {ref.project} ")]
    assert len(rows) == 1, f"docs/references.md: one row for `{semantics}` in the 'Which reference' table"
    assert f"{ref.project} {ref.release}" in rows[0] and ref.code in rows[0], rows[0]


def _pins() -> dict[str, str]:
    pins = {}
    for line in REQUIREMENTS.splitlines():
        line = line.split("#")[0].strip()
        if "==" in line:
            name, version = line.split("==")
            pins[name.strip().lower()] = version.strip()
    return pins


@pytest.mark.parametrize("ref", [r for r in REFERENCES.values() if r.package], ids=lambda r: r.semantics)
def test_differential_tests_pin_the_same_release(ref):
    assert _pins().get(ref.package) == ref.release, (
        f"tests/references/requirements.txt must pin {ref.pin} (client/advantage_client/references.py)")
    try:
        installed = importlib.metadata.version(ref.package)
    except importlib.metadata.PackageNotFoundError:
        pytest.fail(f"{ref.package} is not installed: run `make setup` (it installs tests/references/requirements.txt)")
    assert installed == ref.release, f"{ref.package} {installed} installed, the tests pin {ref.pin}: run `make setup`"
