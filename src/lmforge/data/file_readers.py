"""The built-in file readers (:mod:`lmforge.data.readers`):

* ``.txt`` - documents are separated by one or more blank lines; a file without blank lines is a
  single document. Blocks are stripped of surrounding whitespace. As records, ``{"text": block}``
  located at the block's first line. Chunks are byte ranges cut at a blank line.
* ``.jsonl`` - one JSON object per line; the document is the string under ``text_field``. Blank
  lines are skipped. Chunks are byte ranges cut at a newline.
* ``.parquet`` - the string column ``text_field`` (needs ``pyarrow``: ``pip install lmforge[data]``);
  null values are skipped. Records are rows; chunks are row groups.
* a Hugging Face ``datasets`` directory (written by ``Dataset.save_to_disk``; needs ``datasets``), or
  a Hub dataset in the ``datasets`` cache, ``org/name`` or ``org/name:split`` (when no such local path
  exists; :mod:`lmforge.data.hub_datasets`) - the string column ``text_field``; chunks are row ranges.

Every JSON line, of documents, records and chunks, is parsed by :func:`parse_json_line`, so a hostile
line is the same one-line error in every recipe.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Callable, Iterator

from lmforge.data.hub_datasets import hub_dataset_name, load_hub_dataset
from lmforge.data.readers import Chunk, ChunkSize, Reader, Record, TextReader, read_text, register_reader
from lmforge.errors import UserError

__all__ = ["TxtReader", "JsonlReader", "ParquetReader", "DatasetsReader", "parse_json_line", "MAX_JSON_DEPTH",
           "text_blocks", "text_lines", "append_text", "append_jsonl_text", "is_hf_dataset_dir", "load_hf_dataset",
           "hf_column"]


def text_lines(text: str) -> list[str]:
    """Split on newlines only: ``str.splitlines`` also splits on U+2028 and friends, which may
    legally appear inside a JSON string and would shift reported line numbers."""
    return [line.rstrip("\r") for line in text.split("\n")]


def text_blocks(text: str) -> Iterator[tuple[int, str]]:
    """(first line number, stripped text) of every blank-line-separated block of ``text``."""
    block: list[str] = []
    first = 0
    for lineno, line in enumerate(text_lines(text), start=1):
        if line.strip():
            if not block:
                first = lineno
            block.append(line)
        elif block:
            yield first, "\n".join(block).strip()
            block = []
    if block:
        yield first, "\n".join(block).strip()


MAX_JSON_DEPTH = 64
"""Deepest nesting of a JSON line (a tool-calling chat record is under ten levels). Deeper values would
fail later, far from their line, in whatever walks them recursively (templates, fingerprints, ``json``)."""


def _depth_over(value: Any, limit: int) -> bool:
    """Whether ``value`` nests deeper than ``limit`` (iterative: a deep value cannot exhaust the stack)."""
    stack = [(value, 1)]
    while stack:
        v, d = stack.pop()
        if isinstance(v, (dict, list)):
            if d > limit:
                return True
            stack.extend((c, d + 1) for c in (v.values() if isinstance(v, dict) else v))
    return False


def parse_json_line(line: str, where: str) -> Any:
    """One JSON line of a data file, or one ``where: ...`` error line: every JSONL reader of every recipe
    reads through here. Beyond bad syntax, Python's ``json`` raises ``RecursionError`` on deep nesting
    and ``ValueError`` on integers over ``sys.get_int_max_str_digits()`` digits; both are the line's error,
    and so is nesting deeper than :data:`MAX_JSON_DEPTH` (counted only when the line has that many brackets)."""
    try:
        value = json.loads(line)
    except json.JSONDecodeError as e:
        raise UserError(f"{where}: invalid JSON ({e.msg} at column {e.colno})") from None
    except RecursionError:
        raise UserError(f"{where}: JSON nested deeper than {MAX_JSON_DEPTH} levels") from None
    except ValueError as e:  # an integer literal over Python's digit limit
        raise UserError(f"{where}: invalid JSON ({str(e).split(';')[0]})") from None
    if line.count("[") + line.count("{") > MAX_JSON_DEPTH and _depth_over(value, MAX_JSON_DEPTH):
        raise UserError(f"{where}: JSON nested deeper than {MAX_JSON_DEPTH} levels")
    return value


def append_text(docs: list[str], value: object, where: str) -> None:
    """Keep a non-empty string document; anything but a string is the user's data error."""
    if not isinstance(value, str):
        raise UserError(f"{where} must be a string, got {type(value).__name__}")
    if value:
        docs.append(value)


def append_jsonl_text(docs: list[str], obj: object, where: str, text_field: str) -> None:
    """Append the ``text_field`` document of one JSON line (``where`` = ``file:line``), or say in one
    line why it has none."""
    if not isinstance(obj, dict):
        raise UserError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    if text_field not in obj:
        raise UserError(f"{where}: missing field {text_field!r}")
    append_text(docs, obj[text_field], f"{where}: field {text_field!r}")


def _column_docs(values: list, where: Callable[[int], str]) -> list[str]:
    """The non-null values of a text column as documents (``where(i)`` locates value ``i``)."""
    docs: list[str] = []
    for i, value in enumerate(values):
        if value is not None:
            append_text(docs, value, where(i))
    return docs


_BLANK_LINE = re.compile(rb"\n[ \t\r]*\n")


class TxtReader(TextReader):
    name, suffixes = "txt", (".txt",)

    def boundary(self, data: bytes, after: int) -> int | None:
        m = _BLANK_LINE.search(data, after)
        return m.start() + 1 if m else None

    def parse(self, path: Path, text: str, first_line: int, text_field: str) -> list[str]:
        return [block for _, block in text_blocks(text)]

    def records(self, path: Path) -> list[Record]:
        return [(f"{path}:{line}", {"text": block}) for line, block in text_blocks(read_text(path))]


class JsonlReader(TextReader):
    name, suffixes = "jsonl", (".jsonl",)

    def boundary(self, data: bytes, after: int) -> int | None:
        i = data.find(b"\n", after)
        return i + 1 if i >= 0 else None

    @staticmethod
    def _values(path: Path, text: str, first_line: int) -> Iterator[tuple[int, Any]]:
        """(line number, parsed value) of every non-blank line."""
        for k, line in enumerate(text_lines(text)):
            if line.strip():
                yield first_line + k, parse_json_line(line, f"{path}:{first_line + k}")

    def parse(self, path: Path, text: str, first_line: int, text_field: str) -> list[str]:
        docs: list[str] = []
        for lineno, obj in self._values(path, text, first_line):
            append_jsonl_text(docs, obj, f"{path}:{lineno}", text_field)
        return docs

    def records(self, path: Path) -> list[Record]:
        out: list[Record] = []
        for lineno, obj in self._values(path, read_text(path), 1):
            if not isinstance(obj, dict):
                raise UserError(f"{path}:{lineno}: expected a JSON object, got {type(obj).__name__}")
            out.append((f"{path}:{lineno}", obj))
        return out


def _pyarrow(path: Path):
    try:
        import pyarrow.parquet as pq
    except ImportError as e:
        raise UserError(f"{path}: reading .parquet needs pyarrow (pip install 'lmforge[data]')") from e
    return pq


def _unreadable_parquet(path: Path, e: Exception) -> UserError:
    """Corrupt data pages surface only when a column is read, with multi-line messages: keep the first."""
    return UserError(f"{path}: not a readable parquet file ({str(e).splitlines()[0] if str(e) else type(e).__name__})")


class ParquetReader(Reader):
    name, suffixes = "parquet", (".parquet",)

    def _column_names(self, path: Path, text_field: str) -> Any:
        """The pyarrow module, after checking that the file opens and has the column ``text_field``."""
        pq = _pyarrow(path)
        if not path.exists():
            raise UserError(f"data file not found: {path}")
        try:
            names = pq.read_schema(path).names
        except Exception as e:  # pyarrow raises several types for corrupt files
            raise UserError(f"{path}: not a readable parquet file ({e})") from e
        if text_field not in names:
            raise UserError(f"{path}: no column {text_field!r} (columns: {', '.join(names)})")
        return pq

    def documents(self, path: Path, text_field: str) -> list[str]:
        pq = self._column_names(path, text_field)
        try:
            values = pq.read_table(path, columns=[text_field]).column(text_field).to_pylist()
        except Exception as e:
            raise _unreadable_parquet(path, e) from None
        return _column_docs(values, lambda i: f"{path}: row {i}: column {text_field!r}")

    def records(self, path: Path) -> list[Record]:
        try:
            rows = _pyarrow(path).read_table(path).to_pylist()
        except UserError:
            raise
        except Exception as e:  # pyarrow raises several types for corrupt files
            raise UserError(f"{path}: not a readable parquet file ({e})") from e
        return [(f"{path}: row {i}", row) for i, row in enumerate(rows)]

    def plan(self, path: Path, text_field: str, size: ChunkSize) -> list[Chunk]:
        pq = self._column_names(path, text_field)
        try:
            meta = pq.ParquetFile(path).metadata
        except Exception as e:  # pyarrow raises several types for corrupt files
            raise UserError(f"{path}: not a readable parquet file ({e})") from e
        chunks, row = [], 0
        for g in range(meta.num_row_groups):
            chunks.append(Chunk(str(path), self.name, g, g + 1, row))
            row += meta.row_group(g).num_rows
        return chunks

    def chunk_documents(self, chunk: Chunk, text_field: str) -> list[str]:
        path = Path(chunk.path)
        try:
            table = _pyarrow(path).ParquetFile(path).read_row_group(chunk.start, columns=[text_field])
            values = table.column(text_field).to_pylist()
        except UserError:
            raise
        except Exception as e:
            raise _unreadable_parquet(path, e) from None
        return _column_docs(values, lambda i: f"{path}: row {chunk.first_line + i}: column {text_field!r}")


def is_hf_dataset_dir(path: Path) -> bool:
    """A directory written by ``datasets.Dataset.save_to_disk`` (or ``DatasetDict.save_to_disk``), or a
    Hub dataset's name (``org/name[:split]``, :mod:`lmforge.data.hub_datasets`): both are read as a
    ``datasets.Dataset``."""
    if hub_dataset_name(path) is not None:
        return True
    return path.is_dir() and ((path / "state.json").is_file() or (path / "dataset_dict.json").is_file())


def load_hf_dataset(path: Path):
    """The ``datasets.Dataset`` saved in ``path``, or of the Hub dataset it names (memory-mapped Arrow
    files: nothing is read yet)."""
    if hub_dataset_name(path) is not None:
        return load_hub_dataset(path)
    try:
        import datasets
    except ImportError as e:
        raise UserError(f"{path}: reading a datasets directory needs datasets (pip install 'lmforge[data]')") from e
    if (path / "dataset_dict.json").is_file():
        splits = sorted(p.name for p in path.iterdir() if (p / "state.json").is_file())
        raise UserError(f"{path}: a dataset with splits ({', '.join(splits)}); name one split's directory, "
                        f"e.g. {path / (splits[0] if splits else 'train')}")
    try:
        return datasets.load_from_disk(str(path), keep_in_memory=False)
    except Exception as e:  # datasets raises several types for damaged directories
        raise UserError(f"{path}: not a readable datasets directory ({str(e).splitlines()[0] if str(e) else type(e).__name__})") from None


def hf_column(ds, field: str, path: Path):
    """Column ``field`` of a datasets ``Dataset`` (a lazy column: rows are read when sliced)."""
    if field not in ds.column_names:
        raise UserError(f"{path}: no column {field!r} (columns: {', '.join(ds.column_names)})")
    return ds[field] if len(ds) == 0 else ds.select_columns([field])[field]


class DatasetsReader(Reader):
    """A ``datasets`` directory or a Hub dataset's name: claimed by its shape, not a suffix."""

    name, shape = "hf", "a datasets directory"

    def claims(self, path: Path) -> bool:
        return is_hf_dataset_dir(path)

    def documents(self, path: Path, text_field: str) -> list[str]:
        column = hf_column(load_hf_dataset(path), text_field, path)
        return _column_docs(column, lambda i: f"{path}: row {i}: column {text_field!r}")

    def records(self, path: Path) -> list[Record]:
        return [(f"{path}: row {i}", row) for i, row in enumerate(load_hf_dataset(path))]

    def plan(self, path: Path, text_field: str, size: ChunkSize) -> list[Chunk]:
        rows = len(hf_column(load_hf_dataset(path), text_field, path))
        return [Chunk(str(path), self.name, lo, min(lo + size.rows, rows), lo) for lo in range(0, rows, size.rows)]

    def chunk_documents(self, chunk: Chunk, text_field: str) -> list[str]:
        path = Path(chunk.path)
        values = hf_column(load_hf_dataset(path), text_field, path)[chunk.start:chunk.stop]
        return _column_docs(values, lambda i: f"{path}: row {chunk.first_line + i}: column {text_field!r}")

    def stamp_files(self, path: Path) -> list[Path]:
        if hub_dataset_name(path) is not None:  # the cache's Arrow files, which change with a new version
            return sorted(Path(c["filename"]) for c in load_hf_dataset(path).cache_files)
        return sorted(p for p in path.rglob("*") if p.is_file())


for _reader in (DatasetsReader(), TxtReader(), JsonlReader(), ParquetReader()):
    register_reader(_reader)
