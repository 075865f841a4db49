"""Reading user data files into documents or records.

Supported inputs:

* ``.txt`` - documents are separated by one or more blank lines; a file without blank lines
  is a single document. Blocks are stripped of surrounding whitespace.
* ``.jsonl`` - one JSON object per line; the document is the string under ``text_field``.
  Blank lines are skipped.
* ``.parquet`` - the string column ``text_field`` (needs ``pyarrow``: ``pip install
  lmforge[data]``). Null values are skipped.
* a directory - every file above, found recursively, read in sorted path order.
* a Hugging Face ``datasets`` directory (written by ``Dataset.save_to_disk``; needs ``datasets``:
  ``pip install lmforge[data]``) - the string column ``text_field``;
* a Hub dataset in the ``datasets`` cache, ``org/name`` or ``org/name:split`` (when no such local path
  exists; :mod:`lmforge.data.hub_datasets`) - read as a ``datasets`` directory.

Records (SFT examples, GRPO prompts) are JSON objects of ``.jsonl`` lines, ``.parquet`` rows or
``datasets`` rows, and ``{"text": block}`` for each block of a ``.txt`` file; :func:`read_records`
reads them with their location, so later checks can name ``file:line`` too.

Every problem is a :class:`~lmforge.errors.UserError` naming the file, and the line where
there is one, so a bad row in a large file can be found without a debugger. Empty documents
are dropped since they would only add stray EOS tokens.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterator

from lmforge.data.hub_datasets import hub_dataset_name, load_hub_dataset
from lmforge.errors import UserError

__all__ = ["Record", "data_files", "read_documents", "read_records", "read_file_records", "record_files", "read_jsonl_records",
           "SUPPORTED_SUFFIXES", "RECORD_SUFFIXES", "is_hf_dataset_dir", "load_hf_dataset", "hf_column", "parse_json_line",
           "MAX_JSON_DEPTH"]

SUPPORTED_SUFFIXES = (".txt", ".jsonl", ".parquet")
RECORD_SUFFIXES = (".jsonl", ".parquet", ".txt")
"""Files read as records: JSON lines, parquet rows, and text blocks (as ``{"text": block}``)."""

Record = tuple[str, dict[str, Any]]
"""(location such as ``file.jsonl:12`` or ``file.parquet: row 3``, the record)."""


def _read_bytes(path: Path) -> bytes:
    if not path.exists():
        raise UserError(f"data file not found: {path}")
    try:
        return path.read_bytes()
    except OSError as e:
        raise UserError(f"{path}: cannot read ({e.strerror or e})") from e


def _decode(path: Path, data: bytes) -> str:
    try:
        return data.decode("utf-8-sig")  # a byte-order mark is an encoding marker, not text
    except UnicodeDecodeError as e:
        line = data[: e.start].count(b"\n") + 1
        raise UserError(f"{path}:{line}: not valid UTF-8 (byte 0x{data[e.start]:02x})") from e


def _lines(text: str) -> list[str]:
    """Split on newlines only: ``str.splitlines`` also splits on U+2028 and friends, which may
    legally appear inside a JSON string and would shift reported line numbers."""
    return [line.rstrip("\r") for line in text.split("\n")]


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


def _jsonl_lines(path: Path) -> Iterator[tuple[int, Any]]:
    """Yields (line number, parsed value) for every non-blank line."""
    text = _decode(path, _read_bytes(path))
    for lineno, line in enumerate(_lines(text), start=1):
        if not line.strip():
            continue
        yield lineno, parse_json_line(line, f"{path}:{lineno}")


def _txt_blocks(path: Path) -> Iterator[tuple[int, str]]:
    """(first line number, text) of every blank-line-separated block of a text file."""
    return text_blocks(_decode(path, _read_bytes(path)))


def text_blocks(text: str) -> Iterator[tuple[int, str]]:
    """(first line number, stripped text) of every blank-line-separated block of ``text``."""
    block: list[str] = []
    first = 0
    for lineno, line in enumerate(_lines(text), start=1):
        if line.strip():
            if not block:
                first = lineno
            block.append(line)
        elif block:
            yield first, "\n".join(block).strip()
            block = []
    if block:
        yield first, "\n".join(block).strip()


def _read_txt(path: Path) -> list[str]:
    return [doc for _, doc in _txt_blocks(path)]


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


def _read_hf(path: Path, text_field: str) -> list[str]:
    docs: list[str] = []
    for row, value in enumerate(hf_column(load_hf_dataset(path), text_field, path)):
        if value is not None:
            _append_text(docs, value, f"{path}: row {row}: column {text_field!r}")
    return docs


def _read_jsonl(path: Path, text_field: str) -> list[str]:
    docs: list[str] = []
    for lineno, obj in _jsonl_lines(path):
        append_jsonl_text(docs, obj, f"{path}:{lineno}", text_field)
    return docs


def append_jsonl_text(docs: list[str], obj: object, where: str, text_field: str) -> None:
    """Append the ``text_field`` document of one JSON line (``where`` = ``file:line``), or say in one
    line why it has none."""
    if not isinstance(obj, dict):
        raise UserError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    if text_field not in obj:
        raise UserError(f"{where}: missing field {text_field!r}")
    _append_text(docs, obj[text_field], f"{where}: field {text_field!r}")


def _append_text(docs: list[str], value: object, where: str) -> None:
    """Keep a non-empty string document; anything but a string is the user's data error."""
    if not isinstance(value, str):
        raise UserError(f"{where} must be a string, got {type(value).__name__}")
    if value:
        docs.append(value)


def _read_parquet(path: Path, text_field: str) -> list[str]:
    try:
        import pyarrow.parquet as pq
    except ImportError as e:
        raise UserError(
            f"{path}: reading .parquet needs pyarrow (pip install 'lmforge[data]')"
        ) from e
    if not path.exists():
        raise UserError(f"data file not found: {path}")
    try:
        schema = pq.read_schema(path)
    except Exception as e:  # pyarrow raises several types for corrupt files
        raise UserError(f"{path}: not a readable parquet file ({e})") from e
    if text_field not in schema.names:
        raise UserError(f"{path}: no column {text_field!r} (columns: {', '.join(schema.names)})")
    try:
        values = pq.read_table(path, columns=[text_field]).column(text_field).to_pylist()
    except Exception as e:  # corrupt data pages surface only when the column is read
        raise UserError(f"{path}: not a readable parquet file ({str(e).splitlines()[0] if str(e) else type(e).__name__})") from None
    docs: list[str] = []
    for row, value in enumerate(values):
        if value is not None:
            _append_text(docs, value, f"{path}: row {row}: column {text_field!r}")
    return docs


def data_files(path: str | Path, suffixes: tuple[str, ...] = SUPPORTED_SUFFIXES) -> list[Path]:
    """The files ``path`` names: the file itself, those under a directory (recursively, in sorted path
    order), or a ``datasets`` directory itself; anything else is a one-line error."""
    path = Path(path).expanduser()
    if is_hf_dataset_dir(path):
        return [path]
    if path.is_dir():
        found = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in suffixes)
        if not found:
            raise UserError(f"no documents in {path} (no {', '.join(suffixes)} files)")
        return found
    if not path.exists():
        raise UserError(f"data file not found: {path}")
    if path.suffix not in suffixes:
        raise UserError(f"{path}: unsupported file type {path.suffix or '(none)'!r}; data must be "
                        f"{', '.join(suffixes)}, a directory of them, or a datasets directory")
    return [path]


def read_documents(path: str | Path, text_field: str = "text") -> list[str]:
    """All documents under ``path`` (a file, a directory, a datasets directory), in a deterministic order."""
    path = Path(path).expanduser()
    if is_hf_dataset_dir(path):
        docs = _read_hf(path, text_field)
        if not docs:
            raise UserError(f"no documents in {path}")
        return docs
    docs = []
    for f in data_files(path):
        if f.suffix == ".txt":
            docs.extend(_read_txt(f))
        elif f.suffix == ".jsonl":
            docs.extend(_read_jsonl(f, text_field))
        else:
            docs.extend(_read_parquet(f, text_field))
    if not docs:
        raise UserError(f"no documents in {path}")
    return docs


def record_files(path: str | Path) -> list[Path]:
    """The ``.jsonl``/``.parquet``/``.txt`` files (or the datasets directory) of ``path``."""
    return data_files(path, RECORD_SUFFIXES)


def _parquet_rows(path: Path) -> Iterator[Record]:
    try:
        import pyarrow.parquet as pq
    except ImportError as e:
        raise UserError(f"{path}: reading .parquet needs pyarrow (pip install 'lmforge[data]')") from e
    try:
        rows = pq.read_table(path).to_pylist()
    except Exception as e:  # pyarrow raises several types for corrupt files
        raise UserError(f"{path}: not a readable parquet file ({e})") from e
    for i, row in enumerate(rows):
        yield f"{path}: row {i}", row


def read_file_records(path: Path) -> list[Record]:
    """Every record of one ``.jsonl``/``.parquet``/``.txt`` file or datasets directory, each with its
    location (``file.jsonl:LINE``, ``file.txt:LINE`` of the block's first line, ``file.parquet: row N``)."""
    if is_hf_dataset_dir(path):
        ds = load_hf_dataset(path)
        return [(f"{path}: row {i}", row) for i, row in enumerate(ds)]
    if path.suffix == ".parquet":
        return list(_parquet_rows(path))
    if path.suffix == ".txt":
        return [(f"{path}:{line}", {"text": block}) for line, block in _txt_blocks(path)]
    out: list[Record] = []
    for lineno, obj in _jsonl_lines(path):
        if not isinstance(obj, dict):
            raise UserError(f"{path}:{lineno}: expected a JSON object, got {type(obj).__name__}")
        out.append((f"{path}:{lineno}", obj))
    return out


def read_records(path: str | Path) -> list[Record]:
    """Every record of a ``.jsonl``/``.parquet`` file, or of all such files under a directory, with
    its location: the one reader of record data (SFT examples, GRPO prompts)."""
    out = [r for f in record_files(path) for r in read_file_records(f)]
    if not out:
        raise UserError(f"no records in {path}")
    return out


def read_jsonl_records(path: str | Path) -> list[dict[str, Any]]:
    """The records of :func:`read_records` without their locations."""
    return [record for _, record in read_records(path)]
