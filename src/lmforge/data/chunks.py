"""Documents of large inputs, read in independent chunks.

``lmforge prepare`` tokenizes in several worker processes, and validating a raw file before a run
must not hold the whole corpus in memory. Both read an input as a list of :class:`Chunk` s: byte
ranges of ``.txt``/``.jsonl`` files cut only where a document ends (a blank line, a newline), row
groups of ``.parquet`` files, row ranges of a Hugging Face ``datasets`` directory. Reading every chunk
in order gives exactly the documents of :func:`lmforge.data.sources.read_documents`, and a chunk
knows the line or row it starts at, so errors still name ``file:line``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from lmforge.data.sources import (SUPPORTED_SUFFIXES, _append_text, _decode, _lines, append_jsonl_text, data_files,
                                  hf_column, is_hf_dataset_dir, load_hf_dataset, parse_json_line, text_blocks)
from lmforge.errors import UserError

__all__ = ["Chunk", "plan_chunks", "chunk_documents", "input_files"]

CHUNK_BYTES = 8 << 20
"""Text read per chunk: large enough that per-task overhead vanishes, small enough to bound memory and
to give every worker several chunks."""
HF_CHUNK_ROWS = 50_000
_BLANK_LINE = re.compile(rb"\n[ \t\r]*\n")


@dataclass(frozen=True)
class Chunk:
    path: str
    kind: str  # "txt", "jsonl", "parquet", "hf"
    start: int  # byte offset, row group, or row
    stop: int
    first_line: int = 1  # line (txt/jsonl) or row (parquet/hf) number of the chunk's start


def input_files(path: str | Path) -> list[Path]:
    """The files (or ``datasets`` directories) that make up one input, in sorted path order."""
    return data_files(path, SUPPORTED_SUFFIXES)


def _text_chunks(path: Path, kind: str) -> list[Chunk]:
    """Cut at a blank line (txt) or newline (jsonl) past every half CHUNK_BYTES, counting lines on the way."""
    size = path.stat().st_size
    chunks: list[Chunk] = []
    start, line = 0, 1
    with open(path, "rb") as f:
        while start < size:
            f.seek(start)
            data = f.read(CHUNK_BYTES)
            search_from = len(data) // 2
            while start + len(data) < size:  # extend to the next document boundary
                pos = _boundary(data, kind, search_from)
                if pos is not None:
                    data = data[:pos]
                    break
                search_from = max(0, len(data) - 8)
                data += f.read(1 << 20)
            chunks.append(Chunk(str(path), kind, start, start + len(data), line))
            line += data.count(b"\n")
            start += len(data)
    return chunks


def _boundary(data: bytes, kind: str, after: int) -> int | None:
    """Offset just past the first document end found from ``after`` on in ``data``."""
    if kind == "txt":
        m = _BLANK_LINE.search(data, after)
        return m.start() + 1 if m else None
    i = data.find(b"\n", after)
    return i + 1 if i >= 0 else None


def _parquet_chunks(path: Path, text_field: str) -> list[Chunk]:
    pq = _pyarrow(path)
    try:
        meta = pq.ParquetFile(path).metadata
        names = pq.read_schema(path).names
    except Exception as e:  # pyarrow raises several types for corrupt files
        raise UserError(f"{path}: not a readable parquet file ({e})") from e
    if text_field not in names:
        raise UserError(f"{path}: no column {text_field!r} (columns: {', '.join(names)})")
    chunks, row = [], 0
    for g in range(meta.num_row_groups):
        chunks.append(Chunk(str(path), "parquet", g, g + 1, row))
        row += meta.row_group(g).num_rows
    return chunks


def _hf_chunks(path: Path, text_field: str) -> list[Chunk]:
    rows = len(hf_column(load_hf_dataset(path), text_field, path))
    return [Chunk(str(path), "hf", lo, min(lo + HF_CHUNK_ROWS, rows), lo) for lo in range(0, rows, HF_CHUNK_ROWS)]


def plan_chunks(path: str | Path, text_field: str = "text") -> list[Chunk]:
    """Every chunk of the input ``path`` (file, directory of files, or datasets directory), in order."""
    out: list[Chunk] = []
    for f in input_files(path):
        if is_hf_dataset_dir(f):
            out += _hf_chunks(f, text_field)
        elif f.suffix == ".parquet":
            out += _parquet_chunks(f, text_field)
        else:
            out += _text_chunks(f, f.suffix[1:])
    return out


def _pyarrow(path: Path):
    try:
        import pyarrow.parquet as pq
    except ImportError as e:
        raise UserError(f"{path}: reading .parquet needs pyarrow (pip install 'lmforge[data]')") from e
    return pq


def chunk_documents(chunk: Chunk, text_field: str = "text") -> list[str]:
    """The non-empty documents of one chunk; errors name the file and line (or row)."""
    path = Path(chunk.path)
    if chunk.kind == "parquet":
        try:
            table = _pyarrow(path).ParquetFile(path).read_row_group(chunk.start, columns=[text_field])
            values = table.column(text_field).to_pylist()
        except Exception as e:  # corrupt data pages surface only when the column is read
            raise UserError(f"{path}: not a readable parquet file ({str(e).splitlines()[0] if str(e) else type(e).__name__})") from None
        return _column_docs(values, lambda i: f"{path}: row {chunk.first_line + i}: column {text_field!r}")
    if chunk.kind == "hf":
        column = hf_column(load_hf_dataset(path), text_field, path)
        values = column[chunk.start:chunk.stop]
        return _column_docs(values, lambda i: f"{path}: row {chunk.first_line + i}: column {text_field!r}")
    try:
        with open(path, "rb") as f:
            f.seek(chunk.start)
            data = f.read(chunk.stop - chunk.start)
    except OSError as e:
        raise UserError(f"{path}: cannot read ({e.strerror or e})") from e
    text = _decode_at(path, data, chunk)
    if chunk.kind == "txt":
        return _txt_docs(text)
    return _jsonl_docs(path, text, text_field, chunk.first_line)


def _column_docs(values: list, where) -> list[str]:
    docs: list[str] = []
    for i, value in enumerate(values):
        if value is not None:
            _append_text(docs, value, where(i))
    return docs


def _decode_at(path: Path, data: bytes, chunk: Chunk) -> str:
    if chunk.start == 0:
        return _decode(path, data)  # a byte-order mark can only start a file
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = chunk.first_line + data[: e.start].count(b"\n")
        raise UserError(f"{path}:{line}: not valid UTF-8 (byte 0x{data[e.start]:02x})") from e


def _txt_docs(text: str) -> list[str]:
    return [block for _, block in text_blocks(text)]


def _jsonl_docs(path: Path, text: str, text_field: str, first_line: int) -> list[str]:
    docs: list[str] = []
    for k, line in enumerate(_lines(text)):
        if not line.strip():
            continue
        lineno = first_line + k
        obj = parse_json_line(line, f"{path}:{lineno}")
        append_jsonl_text(docs, obj, f"{path}:{lineno}", text_field)
    return docs
