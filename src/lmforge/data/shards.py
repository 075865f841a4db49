"""Prepared token data on disk: the shard format, its writer, and a lazily read packed dataset.

A prepared directory holds every document's tokens, each followed by EOS, as one stream split into
shard files of raw little-endian integers (``uint16`` when every id fits, else ``uint32``), plus:

* ``documents.npy`` - int64 end offset of every document in the stream (its EOS included);
* ``index.json`` - dtype, token and document counts, the tokenizer's fingerprint, the inputs with
  their sizes and modification times, and per shard its token count, byte size, SHA-256 and a
  *sampled* SHA-256 (of 64 evenly spaced 4 KiB blocks).

Opening a directory checks every shard's size and sampled hash: constant cost per shard, and it
catches a truncated, replaced or re-prepared shard. ``lmforge prepare --verify DIR`` hashes every
byte. Samples are read with ``pread`` of just their window, so a run's memory does not grow with the
corpus (a memory map would count every page that readahead pulls in as the process's own).
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

import numpy as np

from lmforge.data.packing import Sample, window_sample
from lmforge.errors import UserError

__all__ = ["INDEX_FILE", "FORMAT", "is_prepared_dir", "read_index", "PreparedTokens", "PackedShardDataset",
           "ShardWriter", "token_dtype"]

INDEX_FILE = "index.json"
DOCUMENTS_FILE = "documents.npy"
FORMAT = "lmforge-tokens-1"
SHARD_TOKENS = 1 << 28
"""Tokens per shard file (512 MiB at uint16): few files, each small enough to copy or re-hash alone."""
_SAMPLE_BLOCKS, _BLOCK = 64, 4096


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16) if vocab_size <= np.iinfo(np.uint16).max + 1 else np.dtype(np.uint32)


def sampled_sha256(path: Path, size: int) -> str:
    """Hash of the size and of evenly spaced blocks: reads at most 256 KiB whatever the file's size."""
    h = hashlib.sha256(str(size).encode())
    with open(path, "rb") as f:
        for k in range(_SAMPLE_BLOCKS):
            f.seek((size - _BLOCK) * k // (_SAMPLE_BLOCKS - 1) if size > _BLOCK else 0)
            h.update(f.read(_BLOCK))
    return h.hexdigest()


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(16 << 20):
            h.update(block)
    return h.hexdigest()


def is_prepared_dir(path: str | Path) -> bool:
    return (Path(path).expanduser() / INDEX_FILE).is_file()


def read_index(path: str | Path) -> dict[str, Any]:
    """The index of a prepared directory; a missing or unreadable one is a one-line error."""
    f = Path(path).expanduser() / INDEX_FILE
    try:
        index = json.loads(f.read_text())
    except (OSError, ValueError) as e:
        raise UserError(f"{f}: not a readable prepared-data index ({e})") from None
    if not isinstance(index, dict) or index.get("format") != FORMAT:
        raise UserError(f"{f}: not an lmforge prepared-data index (format {FORMAT!r}); run lmforge prepare again")
    problem = _index_problem(index)
    if problem:
        raise UserError(f"{f}: {problem}; the index was edited or damaged, run lmforge prepare again")
    return index


def _index_problem(index: dict[str, Any]) -> str:
    """What is inconsistent in an index (``""``: nothing). The reader trusts these fields to cut
    windows, so a hand-edited count must be refused here rather than read past a shard's end."""
    def count(value: Any) -> bool:
        return isinstance(value, int) and not isinstance(value, bool) and value >= 0

    if index.get("dtype") not in ("uint16", "uint32"):
        return f"'dtype' must be uint16 or uint32, found {index.get('dtype')!r}"
    shards, docs = index.get("shards"), index.get("documents")
    if not isinstance(shards, list) or not all(isinstance(s, dict) for s in shards):
        return "'shards' must be a list of shard entries"
    if not isinstance(docs, dict) or docs.get("file") != DOCUMENTS_FILE or not count(docs.get("bytes")):
        return f"'documents' must name {DOCUMENTS_FILE} with its byte size"
    itemsize = np.dtype(index["dtype"]).itemsize
    for k, shard in enumerate(shards):
        name = f"tokens-{k:05d}.bin"
        if shard.get("file") != name:
            return f"shard {k} must be {name}, found {shard.get('file')!r}"
        if not (count(shard.get("tokens")) and count(shard.get("bytes"))) or shard["tokens"] * itemsize != shard["bytes"]:
            return (f"shard {name}: 'tokens' ({shard.get('tokens')!r}) x {itemsize} bytes must equal "
                    f"'bytes' ({shard.get('bytes')!r})")
        if not isinstance(shard.get("sampled_sha256"), str):
            return f"shard {name}: no 'sampled_sha256'"
    total = sum(s["tokens"] for s in shards)
    if index.get("num_tokens") != total:
        return f"'num_tokens' is {index.get('num_tokens')!r}, the shards hold {total}"
    if not count(index.get("num_documents")):
        return f"'num_documents' must be a count, found {index.get('num_documents')!r}"
    return ""


class ShardWriter:
    """Appends documents' tokens to shard files in ``root``; :meth:`finish` returns the index fields."""

    def __init__(self, root: Path, dtype: np.dtype, shard_tokens: int = SHARD_TOKENS) -> None:
        self.root, self.dtype, self.shard_tokens = root, dtype, shard_tokens
        self.shards: list[dict[str, Any]] = []
        self.doc_ends: list[np.ndarray] = []
        self.num_tokens = 0
        self._file = None
        self._hash = hashlib.sha256()
        self._in_shard = 0

    def _open(self) -> None:
        name = f"tokens-{len(self.shards):05d}.bin"
        self._file = open(self.root / name, "wb")
        self.shards.append({"file": name})
        self._hash, self._in_shard = hashlib.sha256(), 0

    def _close(self) -> None:
        if self._file is None:
            return
        self._file.close()
        self._file = None
        path = self.root / self.shards[-1]["file"]
        size = path.stat().st_size
        self.shards[-1] |= {"tokens": self._in_shard, "bytes": size, "sha256": self._hash.hexdigest(),
                            "sampled_sha256": sampled_sha256(path, size)}

    def append(self, tokens: np.ndarray, doc_lengths: np.ndarray) -> None:
        """Tokens of whole documents (each with its EOS) and their lengths."""
        if len(doc_lengths):
            self.doc_ends.append(self.num_tokens + np.cumsum(doc_lengths, dtype=np.int64))
        tokens = np.ascontiguousarray(tokens, dtype=self.dtype)
        self.num_tokens += len(tokens)
        while len(tokens):
            if self._file is None or self._in_shard == self.shard_tokens:
                self._close()
                self._open()
            part, tokens = np.split(tokens, [self.shard_tokens - self._in_shard])
            data = part.tobytes()
            self._file.write(data)
            self._hash.update(data)
            self._in_shard += len(part)

    def finish(self) -> dict[str, Any]:
        self._close()
        ends = np.concatenate(self.doc_ends) if self.doc_ends else np.zeros(0, np.int64)
        np.save(self.root / DOCUMENTS_FILE, ends)
        docs = self.root / DOCUMENTS_FILE
        return {"dtype": self.dtype.name, "num_tokens": self.num_tokens, "num_documents": len(ends),
                "shards": self.shards, "documents": {"file": DOCUMENTS_FILE, "bytes": docs.stat().st_size,
                                                     "sha256": file_sha256(docs)}}


class PreparedTokens:
    """The token stream of a prepared directory, read window by window, shards checked on open."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path).expanduser()
        self.index = read_index(self.path)
        self.dtype = np.dtype(self.index["dtype"])
        self._fds: list[int | None] = []
        counts = []
        for shard in self.index["shards"]:
            f = self.path / shard["file"]
            size = f.stat().st_size if f.is_file() else None
            if size != shard["bytes"] or sampled_sha256(f, size) != shard["sampled_sha256"]:
                what = "missing" if size is None else ("has the wrong size" if size != shard["bytes"] else "changed")
                raise UserError(f"{f}: shard {what} since it was prepared; run lmforge prepare again")
            counts.append(int(shard["tokens"]))
            self._fds.append(None)
        docs = self.path / DOCUMENTS_FILE
        if not docs.is_file() or docs.stat().st_size != self.index["documents"]["bytes"]:
            what = "missing" if not docs.is_file() else "has the wrong size"
            raise UserError(f"{docs}: {what} since it was prepared; run lmforge prepare again")
        self.starts = np.concatenate([[0], np.cumsum(counts, dtype=np.int64)])
        self.num_tokens = int(self.starts[-1])

    @property
    def tokenizer(self) -> str:
        return self.index["tokenizer"]

    def _fd(self, k: int) -> int:
        fd = self._fds[k]
        if fd is None:
            fd = os.open(self.path / self.index["shards"][k]["file"], os.O_RDONLY)
            self._fds[k] = fd
        return fd

    def read(self, start: int, stop: int) -> np.ndarray:
        """Stream tokens ``[start, stop)`` as int64, across shard boundaries."""
        out = np.empty(stop - start, dtype=np.int64)
        k = int(np.searchsorted(self.starts, start, side="right")) - 1
        pos, size = start, self.dtype.itemsize
        while pos < stop:
            lo = pos - int(self.starts[k])
            n = min(stop, int(self.starts[k + 1])) - pos
            data = os.pread(self._fd(k), n * size, lo * size)
            out[pos - start : pos - start + n] = np.frombuffer(data, dtype=self.dtype)
            pos += n
            k += 1
        return out

    def __del__(self) -> None:
        for fd in getattr(self, "_fds", []):
            if fd is not None:
                os.close(fd)

    def document_ends(self) -> np.ndarray:
        return np.load(self.path / DOCUMENTS_FILE, mmap_mode="r")

    def verify(self) -> list[str]:
        """Problems found by hashing every byte (an empty list: the directory is intact)."""
        problems = []
        entries = [*self.index["shards"], self.index["documents"]]
        for entry in entries:
            f = self.path / entry["file"]
            if not f.is_file():
                problems.append(f"{f}: missing")
            elif file_sha256(f) != entry["sha256"]:
                problems.append(f"{f}: content differs from its checksum in {INDEX_FILE}")
        return problems


class PackedShardDataset:
    """:class:`~lmforge.data.packing.PackedTokenDataset`'s windows over a prepared directory.

    Sample ``i`` is stream tokens ``[i*T, i*T + T + 1)``, exactly as the in-memory dataset cuts the
    same documents, so both give identical samples; only the window itself is read from disk.
    """

    def __init__(self, tokens: PreparedTokens, seq_len: int) -> None:
        if seq_len < 1:
            raise UserError(f"seq_len must be at least 1, got {seq_len}")
        self.data, self.seq_len = tokens, seq_len
        self._num_samples = max(0, (tokens.num_tokens - 1) // seq_len)
        if self._num_samples == 0:
            raise UserError(f"not enough data: {tokens.num_tokens} tokens in {tokens.path}, "
                            f"need at least seq_len + 1 = {seq_len + 1}")

    @property
    def num_tokens(self) -> int:
        return self.data.num_tokens

    def __len__(self) -> int:
        return self._num_samples

    def __getitem__(self, i: int) -> Sample:
        return window_sample(i, self._num_samples, self.seq_len, self.data.read)
