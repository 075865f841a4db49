"""File readers: one object per kind of data file, registered by suffix.

A :class:`Reader` knows everything lmforge does with one kind of file: read a whole file as documents
(pretraining) or as records (SFT examples, preference pairs, GRPO prompts), and cut it into
independent :class:`Chunk` s and read one chunk (``lmforge prepare``'s workers, and checking a large
raw corpus without holding it in memory). Keeping the four together is what guarantees that reading
every chunk in order gives exactly the file's documents: a :class:`TextReader` parses a whole file
and a byte range with the same ``parse``.

:mod:`lmforge.data.sources` and :mod:`lmforge.data.chunks` only dispatch here: the suffixes lmforge
accepts, and the "unsupported file type" error, are whatever is registered. The built-in readers
(``.txt``, ``.jsonl``, ``.parquet``, ``datasets`` directories) are in :mod:`lmforge.data.file_readers`;
a package installed beside lmforge adds one through the ``lmforge.readers`` entry point
(:mod:`lmforge.plugins`): a :class:`Reader` instance, or a module that calls :func:`register_reader`
when imported::

    [project.entry-points."lmforge.readers"]
    csv = "my_package.csv_reader:CSV_READER"

``lmforge prepare`` tokenizes in spawned worker processes, which find a chunk's reader by name in
their own registry: a reader registered by hand (:func:`register_reader` in a script) is known there
only if the workers import the module that registers it, which an entry point guarantees.
"""

from __future__ import annotations

import types
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lmforge.errors import UserError

__all__ = ["Chunk", "ChunkSize", "Reader", "TextReader", "Record", "register_reader", "readers", "reader_for",
           "reader_named", "supported_suffixes", "unsupported_file", "read_bytes", "decode", "read_text"]

Record = tuple[str, dict[str, Any]]
"""(location such as ``file.jsonl:12`` or ``file.parquet: row 3``, the record)."""

ENTRY_POINT_GROUP = "lmforge.readers"


@dataclass(frozen=True)
class Chunk:
    """A part of one input that can be read on its own (in another process: it pickles)."""

    path: str
    kind: str  # the name of the reader that planned it ("txt", "jsonl", "parquet", "hf", a plugin's)
    start: int  # byte offset, row group, or row
    stop: int
    first_line: int = 1  # line (text formats) or row (tables) number of the chunk's start


@dataclass(frozen=True)
class ChunkSize:
    """How large a chunk should be, in the unit a reader cuts by (its caller's policy, not the reader's)."""

    bytes: int  # text per byte-range chunk (at least half, up to the next document boundary past it)
    rows: int  # rows per chunk of a table read by rows


class Reader(ABC):
    """One kind of data file: how to read it whole and in chunks. Errors are one-line
    :class:`~lmforge.errors.UserError` s naming the file and the line or row."""

    name: str
    """Unique; a :class:`Chunk`'s ``kind``, so a worker process finds the reader of a chunk."""
    suffixes: tuple[str, ...] = ()
    """File suffixes (with the dot) this reader reads; each belongs to one reader."""
    shape: str = ""
    """For a reader that claims paths by their shape rather than a suffix (:meth:`claims`): what such a
    path is called in the "unsupported file type" error, e.g. ``a datasets directory``."""

    def claims(self, path: Path) -> bool:
        """Whether this reader reads ``path`` whatever its suffix (a directory of a known layout); such a
        path is one input, never walked for files."""
        return False

    @abstractmethod
    def documents(self, path: Path, text_field: str) -> list[str]:
        """The file's non-empty documents, in order (``text_field`` names the column or JSON key)."""

    @abstractmethod
    def records(self, path: Path) -> list[Record]:
        """The file's records (JSON objects), each with its location."""

    @abstractmethod
    def plan(self, path: Path, text_field: str, size: ChunkSize) -> list[Chunk]:
        """The file's chunks, in order; reading them all gives :meth:`documents`."""

    @abstractmethod
    def chunk_documents(self, chunk: Chunk, text_field: str) -> list[str]:
        """The non-empty documents of one chunk this reader planned."""

    def chunk_bytes(self, chunk: Chunk) -> int:
        """Bytes of text the chunk covers, for progress; 0 where that is unknown before reading."""
        return 0

    def stamp_files(self, path: Path) -> list[Path]:
        """The files whose size and modification time tell whether this input changed (``lmforge
        prepare``'s up-to-date check)."""
        return [path]


def read_bytes(path: Path) -> bytes:
    """The whole file, or one line saying why not."""
    if not path.exists():
        raise UserError(f"data file not found: {path}")
    try:
        return path.read_bytes()
    except OSError as e:
        raise UserError(f"{path}: cannot read ({e.strerror or e})") from e


def decode(path: Path, data: bytes, first_line: int = 1, file_start: bool = True) -> str:
    """UTF-8 text of ``data`` (read from ``path`` at line ``first_line``), or the ``file:line`` of the
    first bad byte. A byte-order mark is an encoding marker, not text, and can only start a file."""
    try:
        return data.decode("utf-8-sig" if file_start else "utf-8")
    except UnicodeDecodeError as e:
        line = first_line + data[: e.start].count(b"\n")
        raise UserError(f"{path}:{line}: not valid UTF-8 (byte 0x{data[e.start]:02x})") from e


def read_text(path: Path) -> str:
    """The whole file as text."""
    return decode(path, read_bytes(path))


class TextReader(Reader):
    """A text format whose documents end at a byte pattern (a newline, a blank line): a chunk is a byte
    range cut only at such an end, and a whole file and a chunk are parsed by the same :meth:`parse`, so
    chunked reading cannot disagree with whole-file reading. A subclass gives :meth:`boundary`,
    :meth:`parse` and :meth:`records`."""

    @abstractmethod
    def boundary(self, data: bytes, after: int) -> int | None:
        """Offset just past the first document end at or after ``after`` in ``data``, or None."""

    @abstractmethod
    def parse(self, path: Path, text: str, first_line: int, text_field: str) -> list[str]:
        """The non-empty documents of ``text``, which starts at line ``first_line`` of ``path`` (for errors)."""

    def documents(self, path: Path, text_field: str) -> list[str]:
        return self.parse(path, read_text(path), 1, text_field)

    def plan(self, path: Path, text_field: str, size: ChunkSize) -> list[Chunk]:
        """Cut at a document end past every half ``size.bytes``, counting lines on the way."""
        total = path.stat().st_size
        chunks: list[Chunk] = []
        start, line = 0, 1
        with open(path, "rb") as f:
            while start < total:
                f.seek(start)
                data = f.read(size.bytes)
                search_from = len(data) // 2
                while start + len(data) < total:  # extend to the next document boundary
                    pos = self.boundary(data, search_from)
                    if pos is not None:
                        data = data[:pos]
                        break
                    search_from = max(0, len(data) - 8)
                    data += f.read(1 << 20)
                chunks.append(Chunk(str(path), self.name, start, start + len(data), line))
                line += data.count(b"\n")
                start += len(data)
        return chunks

    def chunk_text(self, chunk: Chunk) -> str:
        """The decoded text of a byte-range chunk."""
        path = Path(chunk.path)
        try:
            with open(path, "rb") as f:
                f.seek(chunk.start)
                data = f.read(chunk.stop - chunk.start)
        except OSError as e:
            raise UserError(f"{path}: cannot read ({e.strerror or e})") from e
        return decode(path, data, chunk.first_line, file_start=chunk.start == 0)

    def chunk_documents(self, chunk: Chunk, text_field: str) -> list[str]:
        return self.parse(Path(chunk.path), self.chunk_text(chunk), chunk.first_line, text_field)

    def chunk_bytes(self, chunk: Chunk) -> int:
        return chunk.stop - chunk.start


_REGISTRY: dict[str, Reader] = {}
_LOADED = False


def register_reader(reader: Reader) -> Reader:
    """Add ``reader``: its name and each of its suffixes must be new (``ValueError`` otherwise)."""
    if not getattr(reader, "name", ""):
        raise ValueError(f"a reader needs a name ({type(reader).__name__})")
    if reader.name in _REGISTRY:
        raise ValueError(f"a file reader called {reader.name!r} exists already")
    for suffix in reader.suffixes:
        if not suffix.startswith(".") or len(suffix) < 2:
            raise ValueError(f"reader {reader.name!r}: suffix {suffix!r} must be a dot and a name, like '.csv'")
        owner = next((r.name for r in _REGISTRY.values() if suffix in r.suffixes), None)
        if owner is not None:
            raise ValueError(f"reader {reader.name!r}: files {suffix} are read by reader {owner!r} already")
    _REGISTRY[reader.name] = reader
    return reader


def readers() -> dict[str, Reader]:
    """Every reader by name: the built-in ones, then those of installed packages (loaded once)."""
    global _LOADED
    if not _LOADED:
        import lmforge.data.file_readers  # noqa: F401 - registers the built-in readers
        from lmforge.plugins import load_entry_points

        for ep, obj in load_entry_points(ENTRY_POINT_GROUP):
            if isinstance(obj, types.ModuleType):
                continue  # a module that registered its readers when imported
            if not isinstance(obj, Reader):
                raise UserError(f"plugin {ep.name} = {ep.value} of {ENTRY_POINT_GROUP} is not a Reader "
                                f"(got {type(obj).__name__})")
            if _REGISTRY.get(obj.name) is not obj:
                try:
                    register_reader(obj)
                except ValueError as e:
                    raise UserError(f"plugin {ep.name} = {ep.value} of {ENTRY_POINT_GROUP}: {e}") from None
        _LOADED = True
    return dict(_REGISTRY)


def supported_suffixes() -> tuple[str, ...]:
    """Every registered suffix, sorted (the order errors list them in)."""
    return tuple(sorted(s for r in readers().values() for s in r.suffixes))


def reader_for(path: Path) -> Reader | None:
    """The reader of ``path``: one that claims it by its shape, else the one of its suffix."""
    known = readers().values()
    return (next((r for r in known if r.claims(path)), None)
            or next((r for r in known if path.suffix in r.suffixes), None))


def reader_named(name: str) -> Reader:
    """The reader a chunk's ``kind`` names."""
    known = readers()
    if name not in known:
        raise UserError(f"no file reader called {name!r} (known: {', '.join(known)}); "
                        f"is the package that adds it installed?")
    return known[name]


def unsupported_file(path: Path) -> UserError:
    """The one line for a file no reader reads, listing what is read."""
    shapes = [r.shape for r in readers().values() if r.shape]
    tail = "".join(f", or {s}" for s in shapes)
    return UserError(f"{path}: unsupported file type {path.suffix or '(none)'!r}; data must be "
                     f"{', '.join(supported_suffixes())}, a directory of them{tail}")
