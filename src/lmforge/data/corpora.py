"""The inputs of next-token training (pretraining): the embedded corpus, directories written by
``lmforge prepare`` (token shards read on demand), or raw files, prepared into ``data.cache_dir`` on
first use and read from there; ``data.sources`` mixes several of them by weight.

Every input is checked (:func:`read_corpora`) before the run directory is touched; the datasets are
built (:func:`build_datasets`) once the tokenizer is known.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path

from lmforge.config import Config
from lmforge.data.chunks import chunk_documents, plan_chunks
from lmforge.data.corpus import embedded_corpus
from lmforge.data.inputs import validation_spec
from lmforge.data.mixture import MixtureDataset
from lmforge.data.packing import PackedTokenDataset, SampleDataset
from lmforge.data.prepare import is_up_to_date, prepare, tokenizer_fingerprint
from lmforge.data.shards import PackedShardDataset, PreparedTokens, is_prepared_dir
from lmforge.errors import UserError
from lmforge.models.tokenizer import Tokenizer


@dataclass
class DataInput:
    """One data input as the config names it, checked before the run directory is touched."""

    key: str
    """The config key that names it (``data.train``, ``data.sources[1].path``), for messages."""
    spec: str
    split: str
    text_field: str
    weight: float = 1.0
    documents: list[str] | None = None
    """The embedded corpus (kept in memory: it is small, and its packed samples stay as they were)."""
    prepared: PreparedTokens | None = None
    """A directory written by ``lmforge prepare``; raw files are prepared when the tokenizer is known."""


Corpora = tuple[list[DataInput], "DataInput | None"]
"""Training inputs (one, or several mixed by weight) and the validation input (None: no validation set)."""


def cache_root(cfg: Config) -> Path:
    return Path(cfg.data.cache_dir or os.environ.get("LMFORGE_CACHE") or "~/.cache/lmforge/prepared").expanduser()


def _cache_prefix(root: Path, spec: str, text_field: str) -> str:
    key = hashlib.sha256(f"{Path(spec).expanduser().resolve()}\0{text_field}".encode()).hexdigest()[:12]
    return str(root / f"{Path(spec).name}-{key}")


def _cached(root: Path, spec: str, text_field: str) -> bool:
    """A current preparation of ``spec`` (with any tokenizer) exists: its documents were read fine."""
    prefix = Path(_cache_prefix(root, spec, text_field))
    return any(is_up_to_date(d, [spec], text_field, None) for d in prefix.parent.glob(f"{prefix.name}-*"))


def check_input(key: str, spec: str, split: str, text_field: str, root: Path, weight: float = 1.0) -> DataInput:
    """Read enough of an input to know it is usable: every document of a raw file (one chunk in memory at
    a time) unless a current preparation of it is cached; only the index and shard checks of a prepared
    directory."""
    inp = DataInput(key, spec, split, text_field, weight)
    try:
        if spec == "embedded":
            inp.documents = embedded_corpus(split)
        elif is_prepared_dir(spec):
            inp.prepared = PreparedTokens(spec)
        elif not _cached(root, spec, text_field):
            if not any(chunk_documents(c, text_field) for c in plan_chunks(spec, text_field)):
                raise UserError(f"no documents in {Path(spec).expanduser()}")
    except UserError as e:
        raise UserError(f"{key}={spec}: {e}") from None
    return inp


def read_corpora(cfg: Config) -> Corpora:
    """Train and validation inputs (``data.validation`` by the rule of :mod:`lmforge.data.inputs`).
    Checked before the run directory is touched, so a bad data file fails the run without changing
    anything an earlier run saved there."""
    d, root = cfg.data, cache_root(cfg)
    if d.sources and d.train != "embedded":
        raise UserError(f"data.train={d.train} and data.sources are both set: name the training data in one of them")
    if not d.sources and d.train in ("", "none"):
        raise UserError(f"data.train={d.train!r}: training needs data (embedded, a file or a directory)")
    if d.sources:
        train_inputs = [check_input(f"data.sources[{i}].path", s.path, "train", d.text_field, root, s.weight)
                        for i, s in enumerate(d.sources)]
    else:
        train_inputs = [check_input("data.train", d.train, "train", d.text_field, root)]
    val, _ = validation_spec(d)
    if val.kind == "none":
        return train_inputs, None
    return train_inputs, check_input("data.validation", d.validation, "validation", d.text_field, root)


def _dataset(cfg: Config, inp: DataInput, tokenizer: Tokenizer, fp: str) -> SampleDataset:
    seq_len = cfg.data.seq_len
    try:
        if inp.documents is not None:
            return PackedTokenDataset(inp.documents, tokenizer, seq_len)
        tokens = inp.prepared
        if tokens is None:  # raw files: tokenized once into the cache, then read like any prepared directory
            out = Path(f"{_cache_prefix(cache_root(cfg), inp.spec, inp.text_field)}-{fp.rsplit('-', 1)[-1][:8]}")
            if not is_up_to_date(out, [inp.spec], inp.text_field, fp):
                main = os.environ.get("RANK", "0") == "0"
                prepare([inp.spec], out, tokenizer, text_field=inp.text_field, progress=False,
                        log=print if main else (lambda line: None))
            tokens = PreparedTokens(out)
        elif tokens.tokenizer != fp:
            raise UserError(f"prepared with tokenizer {tokens.index.get('tokenizer_name')} ({tokens.tokenizer}), but "
                            f"this run's tokenizer is {fp} (model.tokenizer); prepare it with the run's tokenizer")
        return PackedShardDataset(tokens, seq_len)
    except UserError as e:
        raise UserError(f"{inp.key}={inp.spec}: {e}") from None


def build_datasets(cfg: Config, tokenizer: Tokenizer,
                   corpora: Corpora | None = None) -> tuple[SampleDataset, SampleDataset | None]:
    """Packed train (one dataset or a weighted mixture) and validation sets (None with no validation
    input); a problem with either names its config key and file."""
    train_inputs, val_input = corpora or read_corpora(cfg)
    fp = tokenizer_fingerprint(tokenizer)
    parts = [_dataset(cfg, inp, tokenizer, fp) for inp in train_inputs]
    val_set = _dataset(cfg, val_input, tokenizer, fp) if val_input is not None else None
    if not cfg.data.sources:
        return parts[0], val_set
    mixture = MixtureDataset(parts, [inp.weight for inp in train_inputs], seed=cfg.training.seed,
                             shuffle=cfg.data.shuffle)
    return mixture, val_set
