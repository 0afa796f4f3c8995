"""Every relative link in the README and the docs/ pages points to a file that exists, and to a heading there."""

from __future__ import annotations

import re
from pathlib import Path
from urllib.parse import unquote

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = sorted([ROOT / "README.md", ROOT / "deploy" / "README.md", *(ROOT / "docs").rglob("*.md")])

FENCE = re.compile(r"^(```|~~~).*?^\1", re.M | re.S)
INLINE_CODE = re.compile(r"`[^`\n]*`")
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*#*\s*$", re.M)


def links(text: str) -> list[str]:
    """The link targets of a markdown text, code blocks and inline code left out."""
    text = INLINE_CODE.sub("", FENCE.sub("", text))
    return LINK.findall(text)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: the rendered text, lowercased, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link's text only
    text = text.replace("`", "").lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for heading in HEADING.findall(FENCE.sub("", page.read_text(encoding="utf-8"))):
        base = slug(heading)
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


def test_the_checker_sees_links_and_anchors() -> None:
    assert links("a [x](b.md#c) `[y](no.md)` ![p](i.png)\n```\n[z](no2.md)\n```\n") == ["b.md#c", "i.png"]
    assert slug("GPU serving: CUDA and WebGPU on an `H200` (issue 22)") == "gpu-serving-cuda-and-webgpu-on-an-h200-issue-22"


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(ROOT)) for p in PAGES])
def test_relative_links_resolve(page: Path) -> None:
    broken = []
    for target in links(page.read_text(encoding="utf-8")):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto: ...
            continue
        path_part, _, fragment = target.partition("#")
        dest = page if not path_part else (page.parent / unquote(path_part)).resolve()
        if not dest.exists():
            broken.append(f"{target}: no such file")
        elif ROOT not in dest.parents and dest != ROOT:
            broken.append(f"{target}: outside the repository")
        elif fragment and dest.suffix == ".md" and fragment not in anchors(dest):
            broken.append(f"{target}: no heading #{fragment} in {dest.relative_to(ROOT)}")
    assert broken == []
