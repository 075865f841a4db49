"""``lmforge prepare``: tokenize text once into token shards that runs memory-map.

Inputs (``.txt``, ``.jsonl``, ``.parquet``, directories of them, ``datasets`` directories) are read in
chunks (:mod:`lmforge.data.chunks`) and tokenized by worker processes; the main process writes the
chunks' tokens in input order, so the output does not depend on the number of workers.

The output directory appears only when complete: everything is written to a hidden sibling
``.NAME.partial-PID`` and renamed at the end (an interrupted prepare removes it; a killed one leaves
only that hidden directory, which the next prepare of NAME removes). A complete directory whose
inputs (paths, sizes, modification times), text field and tokenizer are unchanged is kept as it is;
a directory prepared with another tokenizer is refused rather than overwritten.
"""

from __future__ import annotations

import hashlib
import json
import multiprocessing
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

from lmforge.data.chunks import Chunk, chunk_bytes, chunk_documents, input_files, plan_chunks
from lmforge.data.shards import DOCUMENTS_FILE, FORMAT, INDEX_FILE, SHARD_TOKENS, PreparedTokens, ShardWriter, read_index, token_dtype
from lmforge.data.sources import file_reader
from lmforge.errors import UserError
from lmforge.models.tokenizer import ByteTokenizer, Tokenizer, load_tokenizer

__all__ = ["prepare", "PrepareResult", "tokenizer_fingerprint", "source_stamps", "is_up_to_date"]


def tokenizer_fingerprint(tokenizer: Tokenizer) -> str:
    """Identity of a tokenizer's behaviour: its files (or kind), vocabulary size and EOS id."""
    h = hashlib.sha256(f"{type(tokenizer).__name__}:{tokenizer.vocab_size}:{tokenizer.eos_id}".encode())
    path = getattr(tokenizer, "path", None)
    if path is not None:
        for name in ("tokenizer.json", "tokenizer_config.json"):
            f = Path(path) / name
            if f.is_file():
                h.update(f.read_bytes())
    else:
        h.update(json.dumps(tokenizer.encode("lmforge fingerprint: Ünïcode 123 \n\t")).encode())
    return f"{type(tokenizer).__name__}-{h.hexdigest()[:16]}"


def tokenizer_name(tokenizer: Tokenizer) -> str:
    """How the config names a tokenizer: ``byte`` or its directory."""
    return "byte" if isinstance(tokenizer, ByteTokenizer) else str(getattr(tokenizer, "path", type(tokenizer).__name__))


def source_stamps(inputs: Sequence[str | Path]) -> list[dict[str, Any]]:
    """Path, size and modification time of every input file (every file inside a datasets directory)."""
    stamps = []
    for spec in inputs:
        for f in input_files(spec):
            for g in file_reader(f).stamp_files(f):
                st = g.stat()
                stamps.append({"path": str(g.resolve()), "size": st.st_size, "mtime_ns": st.st_mtime_ns})
    return stamps


def _inputs_key(inputs: Sequence[str | Path]) -> list[str]:
    return [str(Path(p).expanduser().resolve()) for p in inputs]


def is_up_to_date(out: Path, inputs: Sequence[str | Path], text_field: str, tokenizer_fp: str | None) -> bool:
    """Whether ``out`` holds a complete preparation of exactly these inputs (and tokenizer, if given)."""
    if not (out / INDEX_FILE).is_file():
        return False
    try:
        index = PreparedTokens(out).index  # its shards' sizes and sampled hashes too: a damaged one is redone
    except UserError:
        return False
    return (index.get("inputs") == _inputs_key(inputs) and index.get("text_field") == text_field
            and (tokenizer_fp is None or index.get("tokenizer") == tokenizer_fp)
            and index.get("sources") == source_stamps(inputs))


@dataclass
class PrepareResult:
    out: Path
    index: dict[str, Any]
    skipped: bool
    seconds: float


# -- worker side (module globals set once per worker process) --------------------------------------

_WORKER: dict[str, Any] = {}
_ENCODE_BATCH = 256


def _init_worker(tokenizer_spec: str | None, tokenizer: Tokenizer | None, text_field: str) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    _WORKER.update(tokenizer=tokenizer if tokenizer is not None else load_tokenizer(tokenizer_spec or "byte"),
                   text_field=text_field)


def _encode(tokenizer: Tokenizer, docs: list[str]) -> list[np.ndarray]:
    if isinstance(tokenizer, ByteTokenizer):  # same ids as encode(), without a Python list per byte
        return [np.frombuffer(d.encode("utf-8"), dtype=np.uint8) for d in docs]
    batch = getattr(tokenizer, "encode_batch", None)
    if not callable(batch):
        return [np.asarray(tokenizer.encode(d), dtype=np.int64) for d in docs]
    out: list[np.ndarray] = []
    for i in range(0, len(docs), _ENCODE_BATCH):  # a Rust Encoding per document is large: bound how many live
        out += [np.asarray(x, dtype=np.int64) for x in batch(docs[i:i + _ENCODE_BATCH])]
    return out


def _tokenize_chunk(chunk: Chunk) -> tuple[np.ndarray, np.ndarray, int]:
    """(tokens of every document followed by EOS, document lengths with EOS, text bytes read)."""
    tok: Tokenizer = _WORKER["tokenizer"]
    docs = chunk_documents(chunk, _WORKER["text_field"])
    encoded = _encode(tok, docs)
    dtype = token_dtype(tok.vocab_size)
    eos = np.asarray([tok.eos_id], dtype=dtype)
    pieces = [p for ids in encoded for p in (ids.astype(dtype, copy=False), eos)]
    tokens = np.concatenate(pieces) if pieces else np.zeros(0, dtype)
    lengths = np.asarray([len(ids) + 1 for ids in encoded], dtype=np.int64)
    return tokens, lengths, sum(len(d.encode("utf-8")) for d in docs) if docs else 0


# -- main side ---------------------------------------------------------------------------------------

def _results(chunks: list[Chunk], workers: int, tokenizer: Tokenizer, tokenizer_spec: str | None,
             text_field: str):
    if workers <= 1:
        _init_worker(None, tokenizer, text_field)
        return map(_tokenize_chunk, chunks), None
    if tokenizer_spec is None:
        raise ValueError("several workers need the tokenizer's spec to load it in each process")
    # spawn, not fork: the parent may hold torch and Rust tokenizer threads, which fork does not copy safely
    pool = multiprocessing.get_context("spawn").Pool(workers, _init_worker, (tokenizer_spec, None, text_field))
    return pool.imap(_tokenize_chunk, chunks), pool


def _remove_leftovers(out: Path) -> None:
    """Partial directories of killed prepares of ``out`` whose process is gone."""
    for p in out.parent.glob(f".{out.name}.partial-*"):
        pid = p.name.rsplit("-", 1)[-1]
        if pid.isdigit() and not _alive(int(pid)):
            shutil.rmtree(p, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def prepare(inputs: Sequence[str | Path], out: str | Path, tokenizer: Tokenizer, *, tokenizer_spec: str | None = None,
            workers: int = 1, text_field: str = "text", shard_tokens: int = SHARD_TOKENS,
            progress: bool | None = None, log: Callable[[str], None] = print) -> PrepareResult:
    """Tokenize ``inputs`` into the prepared directory ``out`` (see the module docstring)."""
    t0 = time.perf_counter()
    out = Path(out).expanduser()
    if not inputs:
        raise UserError("prepare: no inputs given")
    fp = tokenizer_fingerprint(tokenizer)
    old = _readable_index(out)
    if old is not None:
        if old.get("tokenizer") != fp:
            raise UserError(f"{out} was prepared with tokenizer {old.get('tokenizer_name')} ({old.get('tokenizer')}), "
                            f"not {tokenizer_name(tokenizer)} ({fp}); choose another --out or delete it")
        if is_up_to_date(out, inputs, text_field, fp):
            log(f"{out} is up to date ({old['num_tokens']:,} tokens, {old['num_documents']:,} documents): nothing to do")
            return PrepareResult(out, old, True, time.perf_counter() - t0)
    elif out.exists() and (not out.is_dir() or any(out.iterdir())) and not (out / DOCUMENTS_FILE).is_file():
        raise UserError(f"{out} exists and is not a prepared-data directory; choose another --out")
    chunks = [c for spec in inputs for c in plan_chunks(spec, text_field)]
    stamps = source_stamps(inputs)
    out.parent.mkdir(parents=True, exist_ok=True)
    _remove_leftovers(out)
    tmp = out.parent / f".{out.name}.partial-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    pool = None
    try:
        writer = ShardWriter(tmp, token_dtype(tokenizer.vocab_size), shard_tokens)
        results, pool = _results(chunks, workers, tokenizer, tokenizer_spec, text_field)
        text_bytes = 0
        from tqdm import tqdm

        total = sum(chunk_bytes(c) for c in chunks) or None
        with tqdm(total=total, unit="B", unit_scale=True, desc=f"prepare {out.name}", disable=progress is False
                  if progress is not None else None, leave=False) as bar:
            try:
                for chunk, (tokens, lengths, nbytes) in zip(chunks, results):
                    writer.append(tokens, lengths)
                    text_bytes += nbytes
                    bar.update(chunk_bytes(chunk))
                index = {"format": FORMAT, "tokenizer": fp, "tokenizer_name": tokenizer_name(tokenizer),
                         "vocab_size": tokenizer.vocab_size, "eos_id": tokenizer.eos_id, "text_field": text_field,
                         "inputs": _inputs_key(inputs), "sources": stamps, "text_bytes": text_bytes, **writer.finish()}
                if index["num_documents"] == 0:
                    raise UserError(f"no documents in {', '.join(map(str, inputs))}")
                (tmp / INDEX_FILE).write_text(json.dumps(index, indent=1))
            except OSError as e:  # a full disk, a quota: the earlier preparation (if any) stays as it was
                raise UserError(f"prepare --out {out}: cannot write the prepared data ({e.strerror or e}); "
                                "nothing was changed") from None
        _install(tmp, out, inputs, text_field, fp)
    finally:
        if pool is not None:
            pool.terminate()
            pool.join()
        shutil.rmtree(tmp, ignore_errors=True)
    index = read_index(out)
    seconds = time.perf_counter() - t0
    log(f"prepared {out}: {index['num_tokens']:,} tokens ({index['dtype']}), {index['num_documents']:,} documents, "
        f"{len(index['shards'])} shard(s), {index['text_bytes'] / 1e6:,.1f} MB of text in {seconds:.1f}s")
    return PrepareResult(out, index, False, seconds)


def _readable_index(out: Path) -> dict[str, Any] | None:
    """The index of an earlier preparation in ``out``; None when there is none, or when it is damaged
    (hand-edited, cut short) in a directory that is a preparation (it has ``documents.npy``): that
    one is prepared again and replaced whole. An ``index.json`` of anything else is refused."""
    if not (out / INDEX_FILE).is_file():
        return None
    try:
        return read_index(out)
    except UserError:
        if (out / DOCUMENTS_FILE).is_file():
            return None
        raise


def _install(tmp: Path, out: Path, inputs: Sequence[str | Path], text_field: str, fp: str) -> None:
    """Move the finished ``tmp`` to ``out``; an older preparation is replaced only once this one is whole."""
    old = None
    if is_up_to_date(out, inputs, text_field, fp):
        return  # another process (a rank of the same run) installed the same preparation meanwhile
    if out.exists():
        old = out.parent / f".{out.name}.old-{os.getpid()}"
        try:
            os.rename(out, old)
        except FileNotFoundError:  # another prepare moved it aside meanwhile
            old = None
    try:
        os.rename(tmp, out)
    except OSError as e:
        if not out.exists():  # not a race: the earlier preparation goes back in place
            if old is not None:
                os.rename(old, out)
                old = None
            raise UserError(f"prepare --out {out}: cannot move the prepared data into place ({e.strerror or e})") from None
        # Another process (a rank of the same run) installed its own preparation first: keep it if it matches.
        if not is_up_to_date(out, inputs, text_field, fp):
            raise UserError(f"prepare --out {out}: another prepare wrote other data there meanwhile ({e.strerror}); "
                            "its result stands, run this one again to replace it") from None
    finally:
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
