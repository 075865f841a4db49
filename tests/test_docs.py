"""The documentation holds together: no relative link points at a missing file, the README stays a
front page, and the API reference builds from the docstrings (every module imports, pdoc succeeds)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = ["README.md", "ARCHITECTURE.md", "BENCHMARKS.md", "CHANGELOG.md"]
README_MAX_LINES = 260

LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
FENCE = re.compile(r"^\s*(```|~~~)")
INLINE_CODE = re.compile(r"`[^`]*`")


def doc_files() -> list[Path]:
    return [ROOT / p for p in PAGES] + sorted((ROOT / "docs").glob("*.md"))


def relative_links(text: str) -> list[tuple[int, str]]:
    """(line number, target) of every relative link outside code blocks and inline code."""
    found, in_fence = [], False
    for n, line in enumerate(text.splitlines(), 1):
        if FENCE.match(line):
            in_fence = not in_fence
            continue
        if in_fence:
            continue
        for target in LINK.findall(INLINE_CODE.sub("", line)):
            if re.match(r"[a-z][a-z0-9+.-]*:", target, re.I) or target.startswith("#"):
                continue  # http(s), mailto, ...; anchors within the page
            found.append((n, target))
    return found


def dangling(page: Path, root: Path = ROOT) -> list[str]:
    missing = []
    for n, target in relative_links(page.read_text(encoding="utf-8")):
        path = target.split("#", 1)[0]
        if not (page.parent / path).exists():
            missing.append(f"{page.relative_to(root)}:{n}: {target}")
    return missing


def test_link_finder_sees_links_and_skips_code() -> None:
    text = ("see [a](docs/a.md) and ![img](docs/x.png#frag) or [web](https://x.org) [in](#here)\n"
            "`[not](a link)`\n```\n[nor](this.md)\n```\n[b](../B.md \"title\")\n")
    assert relative_links(text) == [(1, "docs/a.md"), (1, "docs/x.png#frag"), (6, "../B.md")]


def test_dangling_link_is_reported(tmp_path: Path) -> None:
    (tmp_path / "there.md").write_text("x")
    page = tmp_path / "page.md"
    page.write_text("[ok](there.md) [gone](missing.md#top)\n")
    assert dangling(page, tmp_path) == ["page.md:1: missing.md#top"]


def test_every_page_exists() -> None:
    for p in PAGES + ["docs/README.md"]:
        assert (ROOT / p).is_file(), p


def test_no_dangling_relative_links() -> None:
    missing = [m for page in doc_files() for m in dangling(page)]
    assert not missing, "links to missing files:\n" + "\n".join(missing)


def test_docs_index_lists_every_page() -> None:
    index = (ROOT / "docs" / "README.md").read_text(encoding="utf-8")
    linked = {t.split("#", 1)[0] for _, t in relative_links(index)}
    pages = {p.name for p in (ROOT / "docs").glob("*.md") if p.name != "README.md"}
    assert not pages - linked, f"docs pages missing from docs/README.md: {sorted(pages - linked)}"


def test_readme_is_short() -> None:
    lines = (ROOT / "README.md").read_text(encoding="utf-8").count("\n")
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines (at most {README_MAX_LINES})"


def test_api_reference_builds(tmp_path: Path) -> None:
    """What `make docs` runs (docs/build_api.py: pdoc over every public module, in one process): it exits
    non-zero when a module fails to import or a page is missing."""
    pytest.importorskip("pdoc")
    out = tmp_path / "api"
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    done = subprocess.run([sys.executable, str(ROOT / "docs" / "build_api.py"), str(out)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    assert (out / "index.html").is_file() and (out / "lmforge" / "training" / "loop.html").is_file()
    assert 'id="train"' in (out / "lmforge" / "training" / "loop.html").read_text(encoding="utf-8")


def test_api_reference_fails_on_a_module_that_does_not_import(tmp_path: Path) -> None:
    """The build's own guard: a package whose module raises on import stops it with a non-zero exit."""
    pytest.importorskip("pdoc")
    pkg = tmp_path / "src" / "brokenpkg"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text('"""A package."""\n__all__ = []\n')
    (pkg / "bad.py").write_text("import a_module_that_does_not_exist_anywhere\n")
    script = (f"import sys; sys.path.insert(0, {str(ROOT / 'docs')!r}); import build_api as b; "
              f"from pathlib import Path; b.SRC = Path({str(tmp_path / 'src')!r}); sys.path.insert(0, str(b.SRC)); "
              f"b.public_modules.__defaults__ = ('brokenpkg',); b.build(Path({str(tmp_path / 'out')!r}))")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    assert "a_module_that_does_not_exist_anywhere" in done.stderr
