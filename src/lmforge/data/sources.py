"""Reading user data into documents or records: the one entry point every recipe reads files through.

An input is a file, a directory (every file of a registered suffix under it, found recursively, read in
sorted path order), a Hugging Face ``datasets`` directory, or a Hub dataset's name. How each kind of
file is read is its reader's business (:mod:`lmforge.data.readers`; the built-in ``.txt``, ``.jsonl``,
``.parquet`` and ``datasets`` readers are described in :mod:`lmforge.data.file_readers`); this module
finds an input's files and hands each to its reader, so the suffixes accepted here, and the
"unsupported file type" error, are exactly what is registered.

Records (SFT examples, GRPO prompts) are JSON objects of ``.jsonl`` lines, ``.parquet`` rows or
``datasets`` rows, and ``{"text": block}`` for each block of a ``.txt`` file; :func:`read_records`
reads them with their location, so later checks can name ``file:line`` too.

Every problem is a :class:`~lmforge.errors.UserError` naming the file, and the line where
there is one, so a bad row in a large file can be found without a debugger. Empty documents
are dropped since they would only add stray EOS tokens.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from lmforge.data.file_readers import MAX_JSON_DEPTH, hf_column, is_hf_dataset_dir, load_hf_dataset, parse_json_line
from lmforge.data.readers import Reader, Record, reader_for, readers, supported_suffixes, unsupported_file
from lmforge.errors import UserError

__all__ = ["Record", "data_files", "read_documents", "read_records", "read_file_records", "record_files",
           "read_jsonl_records", "file_reader", "SUPPORTED_SUFFIXES", "RECORD_SUFFIXES", "is_hf_dataset_dir",
           "load_hf_dataset", "hf_column", "parse_json_line", "MAX_JSON_DEPTH"]


def __getattr__(name: str) -> Any:
    """``SUPPORTED_SUFFIXES`` and ``RECORD_SUFFIXES`` (the same: every reader reads both documents and
    records): the registry's suffixes when asked, so a plugin's reader is among them."""
    if name in ("SUPPORTED_SUFFIXES", "RECORD_SUFFIXES"):
        return supported_suffixes()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _claimed(path: Path) -> bool:
    """Whether a reader takes ``path`` as one input by its shape (a ``datasets`` directory)."""
    return any(r.claims(path) for r in readers().values())


def data_files(path: str | Path) -> list[Path]:
    """The files ``path`` names: the file itself, those under a directory (recursively, in sorted path
    order), or a ``datasets`` directory itself; anything else is a one-line error."""
    path = Path(path).expanduser()
    if _claimed(path):
        return [path]
    suffixes = supported_suffixes()
    if path.is_dir():
        found = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in suffixes)
        if not found:
            raise UserError(f"no documents in {path} (no {', '.join(suffixes)} files)")
        return found
    if not path.exists():
        raise UserError(f"data file not found: {path}")
    if path.suffix not in suffixes:
        raise unsupported_file(path)
    return [path]


def file_reader(path: Path) -> Reader:
    """The reader of one file :func:`data_files` returned."""
    reader = reader_for(path)
    if reader is None:
        raise unsupported_file(path)
    return reader


def read_documents(path: str | Path, text_field: str = "text") -> list[str]:
    """All documents under ``path`` (a file, a directory, a datasets directory), in a deterministic order."""
    docs = [doc for f in data_files(path) for doc in file_reader(f).documents(f, text_field)]
    if not docs:
        raise UserError(f"no documents in {Path(path).expanduser()}")
    return docs


def record_files(path: str | Path) -> list[Path]:
    """The files of a registered suffix (or the datasets directory) of ``path``."""
    return data_files(path)


def read_file_records(path: Path) -> list[Record]:
    """Every record of one file or datasets directory, each with its location (``file.jsonl:LINE``,
    ``file.txt:LINE`` of the block's first line, ``file.parquet: row N``)."""
    return file_reader(path).records(path)


def read_records(path: str | Path) -> list[Record]:
    """Every record of a file, or of all such files under a directory, with its location: the one
    reader of record data (SFT examples, GRPO prompts)."""
    out = [r for f in record_files(path) for r in read_file_records(f)]
    if not out:
        raise UserError(f"no records in {path}")
    return out


def read_jsonl_records(path: str | Path) -> list[dict[str, Any]]:
    """The records of :func:`read_records` without their locations."""
    return [record for _, record in read_records(path)]
