"""The README and the pages of docs/ link to each other (issue #29: the README is a front door and the reference
lives in docs/): every relative link of README.md and docs/*.md names a file or directory of the repository, and
a link with an anchor (``page.md#section``, ``#section``) names a heading of that page, by GitHub's rule for
heading anchors (lower case; characters other than letters, digits, ``_``, ``-`` and spaces dropped; spaces to
``-``; a repeated heading gets ``-1``, ``-2`` ...). Every docs/ page is linked from the README. Links inside code
blocks and absolute URLs are not checked (no network here)."""
from __future__ import annotations

import pathlib
import re
import urllib.parse

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

FENCED = re.compile(r"^```.*?^```[ \t]*$", re.M | re.S)
LINK = re.compile(r"!?\[(?:[^\[\]]|`[^`]*`)*\]\(([^)\s]+)\)")
HEADING = re.compile(r"^(#{1,6})[ \t]+(.+?)[ \t]*#*[ \t]*$", re.M)


def prose(text: str) -> str:
    return FENCED.sub("", text)


def slug(heading: str) -> str:
    text = re.sub(r"`([^`]*)`", r"\1", heading)                 # code spans keep their text
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)       # links keep their text
    return re.sub(r"[^\w\- ]", "", text.strip().lower()).replace(" ", "-")


def anchors_of(text: str) -> set[str]:
    """The anchors of a page's headings (code blocks left out)."""
    seen: dict[str, int] = {}
    out = set()
    for match in HEADING.finditer(prose(text)):
        base = slug(match.group(2))
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


def anchors(page: pathlib.Path) -> set[str]:
    return anchors_of(page.read_text())


def links(page: pathlib.Path) -> list[str]:
    return [m.group(1) for m in LINK.finditer(prose(page.read_text()))]


def test_slug_follows_githubs_rule():
    assert slug("Quick start (fresh machine: Python 3.10+, `make`)") == "quick-start-fresh-machine-python-310-make"
    assert slug("verl: the `remote_<name>` plugin") == "verl-the-remote_name-plugin"
    assert slug("Alerts and the autoscaler's metric") == "alerts-and-the-autoscalers-metric"
    assert anchors_of("# x\n## x\n```\n# not a heading\n```\n") == {"x", "x-1"}


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page):
    broken = []
    for target in links(page):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # https:, mailto: ...
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / urllib.parse.unquote(path)).resolve() if path else page
        if not dest.exists():
            broken.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{target}: no heading with anchor #{anchor} in {dest.relative_to(ROOT)}")
        elif ROOT not in dest.parents and dest != ROOT:
            broken.append(f"{target}: outside the repository")
    assert not broken, f"{page.relative_to(ROOT)}: " + "; ".join(broken)


def test_readme_links_every_docs_page():
    linked = {(ROOT / urllib.parse.unquote(t.partition("#")[0])).resolve() for t in links(ROOT / "README.md")}
    unlinked = [str(p.relative_to(ROOT)) for p in PAGES[1:] if p.resolve() not in linked]
    assert not unlinked, f"docs pages the README does not link to: {unlinked}"


def test_readme_is_a_front_door():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 300, f"README.md has {len(lines)} lines: the reference belongs in docs/ (issue #29)"
