"""The docs hold together: a README a newcomer reads in five minutes, guides it links, and
no relative link (file or #anchor) that leads nowhere. Plain text checks, no torch."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = ROOT / "docs"
GUIDES = ("your-model", "sharded-models", "ram-tier", "trust-and-safety", "planning",
          "trainer-and-faults", "cli", "on-disk-format", "configuration", "testing")
"""The guides the README points to for everything it leaves out (issue 23)."""

LINK = re.compile(r"\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```.*?^```", re.S | re.M)


def _pages() -> list[Path]:
    return [README, *sorted(DOCS.glob("*.md"))]


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to '-'."""
    text = heading.strip().lower().replace("`", "")
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for line in FENCE.sub("", page.read_text()).splitlines():
        m = re.match(r"#{1,6} (.+)", line)
        if not m:
            continue
        slug = _slug(m.group(1))
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def _links(page: Path) -> list[str]:
    text = FENCE.sub("", page.read_text())
    return [t for t in LINK.findall(text) if not re.match(r"[a-z]+:", t)]


def test_readme_is_short_and_starts_with_the_two_commands():
    lines = README.read_text().splitlines()
    assert len(lines) <= 200, f"README.md has {len(lines)} lines; move detail to docs/"
    top = "\n".join(lines[:10])
    assert "make demo" in top and "make test" in top


def test_every_guide_exists_opens_with_its_task_and_is_linked_from_the_readme():
    links = set(_links(README))
    for name in GUIDES:
        page = DOCS / f"{name}.md"
        assert page.is_file(), page
        lines = page.read_text().splitlines()
        assert lines[0].startswith("# ") and lines[1] == "" and lines[2].strip(), \
            f"{page.name}: a title, then a sentence saying which task it solves"
        assert f"docs/{name}.md" in links, f"README.md does not link docs/{name}.md"
    for name in ("results", "architecture"):
        assert f"docs/{name}.md" in links


def test_every_relative_link_resolves():
    bad = []
    for page in _pages():
        for target in _links(page):
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            if not dest.exists():
                bad.append(f"{page.relative_to(ROOT)}: {target} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
                bad.append(f"{page.relative_to(ROOT)}: {target} (no such heading)")
    assert not bad, "\n".join(bad)
