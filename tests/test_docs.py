"""Every relative link in README.md and docs/*.md points at a file that exists, and every
``#anchor`` at a heading of that file (GitHub's anchors: lower case, punctuation dropped,
spaces to hyphens, ``-1``, ``-2`` ... for repeated headings)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

_FENCE = re.compile(r"^```.*?^```", re.S | re.M)
_CODE = re.compile(r"`[^`\n]*`")
_LINK = re.compile(r"\[[^\]\n]*\]\(([^)\s]+)\)")
_HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*#*\s*$", re.M)


def _prose(text: str) -> str:
    """The text without code blocks (an indented block is four spaces: never a link here)."""
    return _FENCE.sub("", text)


def anchors(text: str) -> set[str]:
    found: set[str] = set()
    for heading in _HEADING.findall(_prose(text)):
        slug = re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")
        n, candidate = 0, slug
        while candidate in found:
            n += 1
            candidate = f"{slug}-{n}"
        found.add(candidate)
    return found


def broken_links(root: Path) -> list[str]:
    """``file: link (why)`` for each relative link of README.md and docs/*.md that leads nowhere."""
    pages = [root / "README.md", *sorted((root / "docs").glob("*.md"))]
    broken = []
    for page in pages:
        if not page.exists():
            continue
        for target in _LINK.findall(_CODE.sub("", _prose(page.read_text()))):
            if re.match(r"[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
                continue
            path_part, _, anchor = target.partition("#")
            path = (page.parent / path_part).resolve() if path_part else page
            where = f"{page.relative_to(root)}: {target}"
            if not path.exists():
                broken.append(f"{where} (no file {path_part})")
            elif anchor and path.suffix == ".md" and anchor not in anchors(path.read_text()):
                broken.append(f"{where} (no heading #{anchor} in {path.name})")
    return broken


def test_every_relative_link_and_anchor_of_the_docs_resolves():
    assert (ROOT / "docs").is_dir()
    assert broken_links(ROOT) == []


def test_the_checker_finds_a_missing_file_and_a_missing_anchor(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "README.md").write_text(
        "# Top\n\n## Read the table (`show`)\n\n[ok](#read-the-table-show) [ok](docs/a.md#more-1) "
        "[gone](docs/b.md) [bad](docs/a.md#nothing) [web](https://example.com/x) `[code](nowhere.md)`\n\n"
        "```\n[in a block](nowhere.md)\n```\n")
    (tmp_path / "docs" / "a.md").write_text("# A\n\n## More\n\n## More\n\n[back](../README.md#top)\n")
    assert broken_links(tmp_path) == ["README.md: docs/b.md (no file docs/b.md)",
                                      "README.md: docs/a.md#nothing (no heading #nothing in a.md)"]
