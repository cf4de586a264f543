"""Every relative link in the repository's Markdown resolves: the file (or folder) it names
exists, and an anchor names a heading of the page it points at."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path
from urllib.parse import unquote

ROOT = Path(__file__).resolve().parents[1]
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")


def markdown_files() -> list[Path]:
    out = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard",
                          "*.md"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    return sorted(ROOT / p for p in out.split() if "node_modules" not in p
                  and (ROOT / p).exists())


def _prose(text: str) -> str:
    """The text outside fenced code blocks and inline code."""
    text = re.sub(r"^(```|~~~).*?^\1", "", text, flags=re.S | re.M)
    return re.sub(r"`[^`\n]*`", "", text)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading's text."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)       # a link keeps its text
    text = re.sub(r"[^\w\- ]", "", text.strip().lower())
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    text = re.sub(r"^(```|~~~).*?^\1", "", page.read_text(), flags=re.S | re.M)
    for m in re.finditer(r"^#{1,6}\s+(.*?)\s*#*\s*$", text, flags=re.M):
        s = slug(m.group(1))
        n = seen.get(s, 0)
        seen[s] = n + 1
        out.add(s if n == 0 else f"{s}-{n}")
    return out


def broken_links(page: Path) -> list[str]:
    problems = []
    for target in LINK.findall(_prose(page.read_text())):
        if re.match(r"[a-z][a-z0-9+.-]*:", target, flags=re.I):    # http:, mailto:, ...
            continue
        path, _, anchor = unquote(target).partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            problems.append(f"{page.relative_to(ROOT)}: {target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            problems.append(f"{page.relative_to(ROOT)}: {target}: no such heading")
    return problems


def test_the_docs_are_found():
    names = {p.relative_to(ROOT).as_posix() for p in markdown_files()}
    assert {"README.md", "docs/architecture.md", "docs/configuration.md"} <= names


def test_every_relative_link_resolves():
    problems = [p for page in markdown_files() for p in broken_links(page)]
    assert not problems, "\n".join(problems)


def test_a_broken_link_and_a_missing_heading_are_found(tmp_path, monkeypatch):
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    (tmp_path / "other.md").write_text("# A heading (with parens)\n\n## `code` too\n")
    page = tmp_path / "page.md"
    page.write_text("[ok](other.md#a-heading-with-parens) [ok](other.md#code-too) [ok](#here)\n"
                    "[gone](missing.md) [no anchor](other.md#nowhere)\n"
                    "```\n[in code](ignored.md)\n```\n# Here\n")
    assert broken_links(page) == ["page.md: missing.md: no such file",
                                  "page.md: other.md#nowhere: no such heading"]
