"""Documents of large inputs, read in independent chunks.

``lmforge prepare`` tokenizes in several worker processes, and validating a raw file before a run
must not hold the whole corpus in memory. Both read an input as a list of :class:`Chunk` s, planned
and read by each file's reader (:mod:`lmforge.data.readers`): byte ranges of ``.txt``/``.jsonl``
files cut only where a document ends (a blank line, a newline), row groups of ``.parquet`` files, row
ranges of a Hugging Face ``datasets`` directory. Reading every chunk in order gives exactly the
documents of :func:`lmforge.data.sources.read_documents`, and a chunk knows the line or row it starts
at, so errors still name ``file:line``. This module owns only the chunk sizes.
"""

from __future__ import annotations

from pathlib import Path

from lmforge.data.readers import Chunk, ChunkSize, reader_named
from lmforge.data.sources import data_files, file_reader

__all__ = ["Chunk", "plan_chunks", "chunk_documents", "chunk_bytes", "input_files"]

CHUNK_BYTES = 8 << 20
"""Text read per chunk: large enough that per-task overhead vanishes, small enough to bound memory and
to give every worker several chunks."""
HF_CHUNK_ROWS = 50_000


def input_files(path: str | Path) -> list[Path]:
    """The files (or ``datasets`` directories) that make up one input, in sorted path order."""
    return data_files(path)


def plan_chunks(path: str | Path, text_field: str = "text") -> list[Chunk]:
    """Every chunk of the input ``path`` (file, directory of files, or datasets directory), in order."""
    size = ChunkSize(bytes=CHUNK_BYTES, rows=HF_CHUNK_ROWS)  # read at each call: tests shrink them
    return [c for f in input_files(path) for c in file_reader(f).plan(f, text_field, size)]


def chunk_documents(chunk: Chunk, text_field: str = "text") -> list[str]:
    """The non-empty documents of one chunk; errors name the file and line (or row)."""
    return reader_named(chunk.kind).chunk_documents(chunk, text_field)


def chunk_bytes(chunk: Chunk) -> int:
    """Bytes of text the chunk covers (progress), 0 where unknown before reading."""
    return reader_named(chunk.kind).chunk_bytes(chunk)
