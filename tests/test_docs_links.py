"""Every relative link in the docs a newcomer walks (README.md, ARCHITECTURE.md,
docs/*.md) points at a file that exists, and a link to a heading (`#anchor`,
in the same file or another Markdown file) at a heading that exists. The
README opens with the two commands for a fresh clone and maps the docs.

Anchors follow GitHub's rule: lower case, punctuation other than `-` and `_`
dropped, each space a `-`."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DOCS = [REPO / "README.md", REPO / "ARCHITECTURE.md", *sorted((REPO / "docs").glob("*.md"))]

_LINK = re.compile(r"\]\(([^)\s]+)\)")
_FENCE = re.compile(r"^```.*?^```", re.S | re.M)


def _anchors(path: Path) -> "set[str]":
    text = _FENCE.sub("", path.read_text())
    out = set()
    for heading in re.findall(r"^#+ (.+)$", text, re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        out.add(slug)
    return out


def _links(path: Path) -> "list[str]":
    return _LINK.findall(_FENCE.sub("", path.read_text()))


def test_the_docs_exist():
    for path in DOCS:
        assert path.is_file(), path


def test_every_relative_link_points_at_something_that_exists():
    broken = []
    for doc in DOCS:
        for link in _links(doc):
            if re.match(r"[a-z]+:", link):  # http:, https:, mailto:
                continue
            target, _, anchor = link.partition("#")
            path = (doc.parent / target).resolve() if target else doc
            name = f"{doc.relative_to(REPO)}: ({link})"
            if not path.exists():
                broken.append(f"{name}: no file {target}")
            elif anchor and path.suffix == ".md" and anchor not in _anchors(path):
                broken.append(f"{name}: no heading #{anchor} in {path.relative_to(REPO)}")
    assert not broken, "broken links:\n" + "\n".join(broken)


def test_the_readme_opens_with_the_two_commands_and_stays_short():
    text = (REPO / "README.md").read_text()
    first_block = text.split("```sh\n", 1)[1].split("```", 1)[0]
    assert [line.split()[0] for line in first_block.splitlines()] == ["scripts/demo", "scripts/test"]
    assert text.index("```sh") < text.index("\n## "), "the two commands come first"
    assert len(text.splitlines()) <= 150, "README.md is for the first five minutes: move the rest to docs/"
    for doc in ("docs/operator.md", "docs/reference.md", "ARCHITECTURE.md"):
        assert f"]({doc})" in text, f"README.md's map of the docs links {doc}"


def test_the_checker_sees_a_broken_link(tmp_path):
    doc = tmp_path / "a.md"
    doc.write_text("# A title, here\n[x](#a-title-here) [y](#gone)\n")
    assert _anchors(doc) == {"a-title-here"}
    assert _links(doc) == ["#a-title-here", "#gone"]
