"""Every relative link in README.md and docs/*.md resolves inside the repository.

A link's file must exist (a folder counts), and its `#anchor`, when the target is a Markdown
file, must name one of that file's headings (GitHub's slugs). Nothing may point outside the
repository (`../shared/...`) or at an absolute path: the documentation travels with the code.
Links inside code blocks and inline code are not links and are left alone.
"""

from __future__ import annotations

import re
from pathlib import Path
from urllib.parse import unquote

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCUMENTS = sorted([ROOT / "README.md", *(ROOT / "docs").glob("*.md")])

_FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})")
_INLINE_CODE = re.compile(r"(`+).+?\1")
# [text](target "title") and ![alt](target); the target may be wrapped in <...>.
_INLINE_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
# [label]: target
_REFERENCE = re.compile(r"^ {0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+.*)?$")
_HEADING = re.compile(r"^ {0,3}#{1,6}\s+(.+?)\s*#*\s*$")
_EXTERNAL = re.compile(r"^[a-z][a-z0-9+.-]*:", re.IGNORECASE)   # https:, mailto:, ...


def prose_lines(text: str, *, keep_inline_code: bool = False) -> list[tuple[int, str]]:
    """(line number, line) outside fenced code blocks, inline code removed unless kept."""
    lines, fence = [], None
    for number, line in enumerate(text.splitlines(), 1):
        match = _FENCE.match(line)
        if match:
            marker = match.group(1)
            if fence is None:
                fence = marker
            elif marker[0] == fence[0] and len(marker) >= len(fence):
                fence = None
            continue
        if fence is None:
            lines.append((number, line if keep_inline_code else _INLINE_CODE.sub("", line)))
    return lines


def links(path: Path) -> list[tuple[int, str]]:
    found = []
    for number, line in prose_lines(path.read_text(encoding="utf-8")):
        found += [(number, target) for target in _INLINE_LINK.findall(line)]
        reference = _REFERENCE.match(line)
        if reference:
            found.append((number, reference.group(1)))
    return found


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: link text kept, markup and punctuation dropped,
    lower case, spaces to hyphens."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)
    text = re.sub(r"<[^>]+>", "", text).lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    result = set()
    for _, line in prose_lines(path.read_text(encoding="utf-8"), keep_inline_code=True):
        match = _HEADING.match(line)
        if not match:
            continue
        base = slug(match.group(1))
        count = seen.get(base, 0)
        seen[base] = count + 1
        result.add(base if count == 0 else f"{base}-{count}")
    return result


def problem(document: Path, target: str) -> str | None:
    """Why `target` (a link in `document`) does not resolve, or None when it does."""
    if _EXTERNAL.match(target):
        return None
    file_part, _, anchor = target.partition("#")
    if file_part.startswith("/"):
        return "an absolute path: link relative to this file"
    if "shared/" in file_part:
        return "points to shared/, outside the repository"
    resolved = (document.parent / unquote(file_part)).resolve() if file_part else document
    if not resolved.is_relative_to(ROOT):
        return "points outside the repository"
    if not resolved.exists():
        return f"no such file: {resolved.relative_to(ROOT)}"
    if anchor and resolved.is_file() and resolved.suffix == ".md" and unquote(anchor) not in anchors(resolved):
        return f"no heading with anchor #{anchor} in {resolved.relative_to(ROOT)}"
    return None


def test_there_are_documents_to_check():
    assert ROOT / "README.md" in DOCUMENTS
    assert len(DOCUMENTS) > 1, "docs/*.md is missing"


@pytest.mark.parametrize("document", DOCUMENTS, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve_inside_the_repository(document: Path):
    broken = [f"{document.relative_to(ROOT)}:{number}: ({target}) {why}"
              for number, target in links(document)
              if (why := problem(document, target)) is not None]
    assert not broken, "broken links:\n  " + "\n  ".join(broken)


def test_the_checker_catches_what_it_should(tmp_path: Path):
    readme = ROOT / "README.md"
    assert problem(readme, "docs/no-such-file.md") is not None
    assert problem(readme, "../shared/DESIGN.md") is not None
    assert problem(readme, "/etc/passwd") is not None
    assert problem(readme, "#no-such-heading") is not None
    assert problem(readme, "LICENSE") is None
    assert problem(readme, "https://example.com/x") is None
    assert slug("Python API: `rein.LLM`") == "python-api-reinllm"
    assert slug("Served models: `REIN_MODELS`") == "served-models-rein_models"
    assert slug("Structured outputs and n > 1") == "structured-outputs-and-n--1"
    page = tmp_path / "page.md"
    page.write_text("# Title\n\n```\n[not a link](missing.md)\n```\n\nSee `[code](missing.md)` and [x](#title).\n")
    assert links(page) == [(7, "#title")]
