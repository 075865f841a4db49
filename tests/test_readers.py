"""The file-reader registry: a reader added by hand or by an installed package is read whole, as
records and in chunks through the same entry points as the built-in ones, and the suffixes lmforge
accepts (and its "unsupported file type" line) follow the registry."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from _helpers import REPO, cli_env
from lmforge.data import readers as registry
from lmforge.data.chunks import chunk_documents, plan_chunks
from lmforge.data.readers import Record, TextReader, read_text, register_reader
from lmforge.data.sources import read_documents, read_records
from lmforge.errors import UserError

FIXTURES = Path(__file__).parent / "fixtures"


class MarkdownReader(TextReader):
    """Documents are the sections of a Markdown file, each starting at a ``# `` heading line."""

    name, suffixes = "md", (".md",)

    def boundary(self, data: bytes, after: int) -> int | None:
        i = data.find(b"\n# ", after)
        return i + 1 if i >= 0 else None

    def parse(self, path: Path, text: str, first_line: int, text_field: str) -> list[str]:
        return [s.strip() for s in ("\n" + text).split("\n# ") if s.strip()]

    def records(self, path: Path) -> list[Record]:
        return [(f"{path}: section {i}", {"text": s}) for i, s in enumerate(self.parse(path, read_text(path), 1, ""))]


@pytest.fixture
def markdown(monkeypatch):
    """The Markdown reader registered for one test (the registry is restored after it)."""
    registry.readers()
    monkeypatch.setattr(registry, "_REGISTRY", dict(registry._REGISTRY))
    return register_reader(MarkdownReader())


def test_a_registered_reader_is_read_whole_as_records_and_in_chunks(tmp_path, markdown, monkeypatch):
    sections = [f"section {i}\n" + "words " * (i % 7 + 3) for i in range(60)]
    f = tmp_path / "notes.md"
    f.write_text("".join(f"# {s}\n" for s in sections))
    want = [s.strip() for s in sections]
    assert read_documents(f) == want
    assert [r["text"] for _, r in read_records(f)] == want
    monkeypatch.setattr("lmforge.data.chunks.CHUNK_BYTES", 200)
    chunks = plan_chunks(tmp_path)
    assert len(chunks) > 5 and {c.kind for c in chunks} == {"md"}
    assert [d for c in chunks for d in chunk_documents(c)] == want
    (tmp_path / "x.csv").write_text("a")
    with pytest.raises(UserError, match=r"unsupported file type '\.csv'; data must be \.jsonl, \.md, \.parquet, \.txt, "
                                        r"a directory of them, or a datasets directory$"):
        read_documents(tmp_path / "x.csv")


def test_a_reader_cannot_take_a_name_or_suffix_already_taken(markdown):
    with pytest.raises(ValueError, match="called 'md' exists already"):
        register_reader(MarkdownReader())
    other = type("Other", (MarkdownReader,), {"name": "other", "suffixes": (".txt",)})()
    with pytest.raises(ValueError, match=r"files \.txt are read by reader 'txt' already"):
        register_reader(other)
    bad = type("Bad", (MarkdownReader,), {"name": "bad", "suffixes": ("csv",)})()
    with pytest.raises(ValueError, match="must be a dot and a name"):
        register_reader(bad)


_PLUGIN_CODE = """
import sys
from pathlib import Path
from lmforge.data import chunks
from lmforge.data.sources import read_documents, read_records
f = Path(sys.argv[1])
chunks.CHUNK_BYTES = 64
cs = chunks.plan_chunks(f)
print(len(cs) > 3, read_documents(f) == [d for c in cs for d in chunks.chunk_documents(c)])
print(read_documents(f)[:2], read_records(f)[1])
"""


def test_an_installed_package_adds_a_reader(tmp_path):
    """The fixture package's ``lmforge.readers`` entry point adds ``.csv``: read whole, as records and in
    chunks (each chunk past the first takes the header from the file); without the package, ``.csv`` is
    an unsupported file type."""
    f = tmp_path / "rows.csv"
    f.write_text("id,text\n" + "".join(f'{i},"row {i}, quoted"\n' for i in range(40)))
    env = cli_env({"PYTHONPATH": f"{REPO / 'src'}:{FIXTURES / 'plugin_reader'}"})
    out = subprocess.run([sys.executable, "-c", _PLUGIN_CODE, str(f)], cwd=REPO, env=env, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.splitlines() == ["True True", f"['row 0, quoted', 'row 1, quoted'] ('{f}:3', "
                                       "{'id': '1', 'text': 'row 1, quoted'})"]
    without = subprocess.run([sys.executable, "-c", _PLUGIN_CODE, str(f)], cwd=REPO,
                             env=cli_env({"PYTHONPATH": str(REPO / "src")}), capture_output=True, text=True,
                             timeout=120)
    assert without.returncode != 0 and "unsupported file type '.csv'" in without.stderr


def test_a_plugin_that_is_not_a_reader_is_one_line(monkeypatch):
    from importlib.metadata import EntryPoint

    import lmforge.plugins

    registry.readers()
    monkeypatch.setattr(registry, "_REGISTRY", dict(registry._REGISTRY))
    monkeypatch.setattr(registry, "_LOADED", False)
    ep = EntryPoint(name="bad", value="pkg:THING", group="lmforge.readers")
    monkeypatch.setattr(lmforge.plugins, "load_entry_points", lambda group: [(ep, object())])
    with pytest.raises(UserError, match=r"^plugin bad = pkg:THING of lmforge.readers is not a Reader \(got object\)$"):
        registry.readers()
    monkeypatch.setattr(lmforge.plugins, "load_entry_points", lambda group: [(ep, MarkdownReader()), (ep, MarkdownReader())])
    with pytest.raises(UserError, match=r"^plugin bad = pkg:THING of lmforge.readers: a file reader called 'md' exists"):
        registry.readers()
