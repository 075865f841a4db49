"""Bounds on everything a GGUF file declares, checked before anything is built from it.

A GGUF header is a list of declared counts and sizes: how many metadata keys and tensors, how long
each string and array, each tensor's dimensions, type and offset. ``gguf.GGUFReader`` trusts them
(a few-MB file declaring a billion-entry array keeps it looping with memory growing), and the model
built from the metadata trusts its values (a declared block count or width becomes an allocation).
So lmforge reads the file in two passes:

1. :func:`check_gguf_layout` walks the header itself (``struct`` over a memory map, no allocation
   per declared item) and refuses any length that does not fit in the bytes left, an unknown value or
   tensor type, a tensor with no or over four dimensions or a zero dimension, a name that is not UTF-8,
   and tensor data outside the file or overlapping. It also holds each tensor's type to its bytes:
   llama.cpp packs tensors back to back, padded to the alignment, so the room a tensor has up to the
   next one must be its declared type's size (a mislabelled type would be read as garbage).
2. :func:`check_config_bounds` holds the metadata values, once mapped onto a Hugging Face config, to
   what a model can be: positive integer widths, head and layer counts within bounds, a finite positive
   norm epsilon and RoPE base, a context length within bounds; and, before a model is allocated from
   them (:func:`check_against_tensors`), the layer count equal to the layers the tensors hold and the
   width to the embedding's.

Each refusal is one :class:`~lmforge.errors.UserError` line naming the file and the value.
"""

from __future__ import annotations

import math
import mmap
import struct
from pathlib import Path
from typing import Any, Mapping

from lmforge.errors import UserError

__all__ = ["check_gguf_layout", "check_config_bounds", "check_against_tensors", "MAX_LAYERS", "MAX_DIM", "MAX_HEADS",
           "MAX_CONTEXT"]

MAX_LAYERS = 1024
"""Most transformer blocks (the largest open models have under 200)."""
MAX_DIM = 1 << 20
"""Largest width, FFN width, head size or vocabulary row count (the largest open models are under 1 << 18)."""
MAX_HEADS = 4096
MAX_CONTEXT = 1 << 21
"""Longest context length (2M tokens; the longest released are about 1M)."""
MAX_ROPE_TABLE = 1 << 28
"""Most entries of a RoPE table (context length x head size: 1 GB in fp32), which the model builds whole."""
MAX_NAME_BYTES = 1 << 16
"""Longest metadata key or tensor name."""
MAX_TENSOR_DIMS = 4
"""GGML_MAX_DIMS."""
MAX_ARRAY_NESTING = 2

# GGUF value types: id -> (struct format or None for STRING/ARRAY, size in bytes)
_SCALARS: dict[int, tuple[str, int]] = {0: ("B", 1), 1: ("b", 1), 2: ("H", 2), 3: ("h", 2), 4: ("I", 4), 5: ("i", 4),
                                        6: ("f", 4), 7: ("?", 1), 10: ("Q", 8), 11: ("q", 8), 12: ("d", 8)}
_STRING, _ARRAY = 8, 9


class _Header:
    """A cursor over the file's bytes that refuses to read past their end."""

    def __init__(self, data: Any, size: int, order: str, where: str) -> None:
        self.data, self.size, self.order, self.where, self.at = data, size, order, where, 0

    def fail(self, what: str) -> UserError:
        return UserError(f"{self.where}: damaged GGUF header, {what} (at byte {self.at} of {self.size})")

    def need(self, n: int, what: str) -> None:
        if n < 0 or self.at + n > self.size:
            raise self.fail(f"{what} needs {n} bytes, {self.size - self.at} left")

    def unpack(self, fmt: str, what: str) -> Any:
        n = struct.calcsize(fmt)
        self.need(n, what)
        value = struct.unpack_from(self.order + fmt, self.data, self.at)[0]
        self.at += n
        return value

    def text(self, what: str, limit: int | None = MAX_NAME_BYTES) -> str | None:
        """A GGUF string; decoded (or refused as not UTF-8) only when ``limit`` is set."""
        n = self.unpack("Q", f"{what}'s length")
        if limit is not None and n > limit:
            raise self.fail(f"{what} is {n} bytes long")
        self.need(n, what)
        raw = bytes(self.data[self.at:self.at + n]) if limit is not None else None
        self.at += n
        if raw is None:
            return None
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            raise self.fail(f"{what} is not UTF-8 text ({raw[:40]!r})") from None

    def value(self, kind: int, what: str, depth: int = 0) -> Any:
        """Skip (arrays, strings inside them) or read one value of GGUF type ``kind``."""
        if kind in _SCALARS:
            return self.unpack(_SCALARS[kind][0], what)
        if kind == _STRING:
            return self.text(what, limit=None if depth else 1 << 24)
        if kind != _ARRAY:
            raise self.fail(f"{what} has unknown value type {kind}")
        if depth >= MAX_ARRAY_NESTING:
            raise self.fail(f"{what} nests arrays deeper than {MAX_ARRAY_NESTING}")
        item, count = self.unpack("I", f"{what}'s item type"), self.unpack("Q", f"{what}'s length")
        if item in _SCALARS:
            self.need(count * _SCALARS[item][1], f"{what} ({count} items)")
            self.at += count * _SCALARS[item][1]
            return None
        if item not in (_STRING, _ARRAY):
            raise self.fail(f"{what} has unknown item type {item}")
        self.need(count * (8 if item == _STRING else 12), f"{what} ({count} items)")  # each at least its header
        for _ in range(count):
            self.value(item, what, depth + 1)
        return None


def _quant_sizes() -> dict[int, tuple[str, int, int]]:
    """GGML tensor type id -> (name, block size in elements, block size in bytes)."""
    from gguf.constants import GGML_QUANT_SIZES

    return {int(t): (t.name, block, size) for t, (block, size) in GGML_QUANT_SIZES.items()}


def check_gguf_layout(path: Path, where: str) -> None:
    """Pass 1 (module doc): the header's declared counts, lengths, types and tensor extents against the file."""
    with path.open("rb") as f:
        size = path.stat().st_size
        if size < 24:
            raise UserError(f"{where}: unreadable GGUF file, truncated or damaged ({size} bytes)")
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
            _check(data, size, where)


def _check(data: Any, size: int, where: str) -> None:
    version = struct.unpack_from("<I", data, 4)[0]
    order = "<" if version & 0xFFFF else ">"  # a big-endian file reads as a multiple of 65536
    h = _Header(data, size, order, where)
    h.at = 4
    version = h.unpack("I", "version")
    if version not in (2, 3):
        raise h.fail(f"version {version} (lmforge reads GGUF versions 2 and 3)")
    n_tensors, n_kv = h.unpack("Q", "tensor count"), h.unpack("Q", "metadata count")
    if n_kv * 13 > size or n_tensors * 29 > size:  # the smallest entry of each
        raise h.fail(f"{n_kv} metadata entries and {n_tensors} tensors do not fit in {size} bytes")
    alignment = 32
    for k in range(n_kv):
        key = h.text(f"metadata key {k}")
        kind = h.unpack("I", f"{key}'s type")
        value = h.value(kind, str(key))
        if key == "general.alignment":
            if kind != 4 or not value or value & (value - 1):
                raise h.fail(f"general.alignment {value!r} is not a power of two")
            alignment = value
    quants = _quant_sizes()
    tensors: list[tuple[int, int, str]] = []
    names: set[str] = set()
    for k in range(n_tensors):
        name = str(h.text(f"tensor {k}'s name"))
        if name in names:
            raise h.fail(f"tensor {name!r} appears twice")
        names.add(name)
        n_dims = h.unpack("I", f"{name}'s dimension count")
        if not 1 <= n_dims <= MAX_TENSOR_DIMS:
            raise h.fail(f"tensor {name} has {n_dims} dimensions (1 to {MAX_TENSOR_DIMS})")
        dims = [h.unpack("Q", f"{name}'s dimensions") for _ in range(n_dims)]
        kind = h.unpack("I", f"{name}'s type")
        offset = h.unpack("Q", f"{name}'s offset")
        if kind not in quants:
            raise h.fail(f"tensor {name} has unknown type {kind}")
        type_name, block, block_bytes = quants[kind]
        if min(dims) < 1 or max(dims) > 1 << 40:
            raise h.fail(f"tensor {name} has dimensions {dims}")
        if dims[0] % block:
            raise h.fail(f"tensor {name}: {type_name} packs {block} values a block, its rows have {dims[0]}")
        tensors.append((offset, math.prod(dims) // block * block_bytes, f"{name} ({type_name} {dims})"))
    start = h.at + (-h.at) % alignment
    _check_extents(tensors, start, size, alignment, where)


def _check_extents(tensors: list[tuple[int, int, str]], start: int, size: int, alignment: int, where: str) -> None:
    """Every tensor's bytes inside the file, aligned, not overlapping the next, and filling the room up to it
    (less than one alignment of padding): the declared type is the one the bytes were written in."""
    tensors = sorted(tensors)
    for i, (offset, nbytes, what) in enumerate(tensors):
        if offset % alignment:
            raise UserError(f"{where}: damaged GGUF file, tensor {what} starts at {offset}, not a multiple of "
                            f"the alignment {alignment}")
        room = (tensors[i + 1][0] if i + 1 < len(tensors) else size - start) - offset
        if start + offset + nbytes > size:
            raise UserError(f"{where}: truncated or damaged GGUF file, tensor {what} needs {nbytes} bytes at "
                            f"{start + offset}, past the file's end ({size} bytes)")
        if not nbytes <= room < nbytes + alignment:
            raise UserError(f"{where}: damaged GGUF file, tensor {what} is {nbytes} bytes by its type but has "
                            f"{room} bytes of room (a mislabelled tensor type, or overlapping tensors)")


def _int(cfg: Mapping[str, Any], key: str, where: str, low: int, high: int) -> None:
    v = cfg.get(key)
    if v is None:
        return
    if isinstance(v, bool) or not isinstance(v, int) or not low <= v <= high:
        raise UserError(f"{where}: GGUF metadata gives {key}={v!r}; expected an integer from {low} to {high}")


def _positive_float(cfg: Mapping[str, Any], key: str, where: str, below: float = math.inf) -> None:
    v = cfg.get(key)
    if v is None:
        return
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not (math.isfinite(v) and 0 < v < below):
        bound = f" below {below:g}" if below != math.inf else ""
        raise UserError(f"{where}: GGUF metadata gives {key}={v!r}; expected a finite positive number{bound}")


def check_config_bounds(cfg: Mapping[str, Any], where: str) -> None:
    """Pass 2 (module doc): a GGUF file's metadata as a Hugging Face config, within what a model can be,
    before any value is divided by or sized from."""
    for key in ("hidden_size", "intermediate_size", "head_dim", "vocab_size"):
        _int(cfg, key, where, 1, MAX_DIM)
    for key in ("num_attention_heads", "num_key_value_heads"):
        _int(cfg, key, where, 1, MAX_HEADS)
    _int(cfg, "num_hidden_layers", where, 1, MAX_LAYERS)
    for key in ("max_position_embeddings", "sliding_window"):
        _int(cfg, key, where, 1, MAX_CONTEXT)
    _positive_float(cfg, "rms_norm_eps", where, below=1.0)
    for key in ("rope_theta", "rope_local_base_freq", "query_pre_attn_scalar"):
        _positive_float(cfg, key, where)
    context, head_dim = cfg.get("max_position_embeddings"), cfg.get("head_dim")
    if context and head_dim and context * head_dim > MAX_ROPE_TABLE:
        raise UserError(f"{where}: GGUF metadata gives context length {context} with heads of {head_dim}: RoPE "
                        f"tables of {context * head_dim * 4 / 2**30:.0f} GiB each; at most {MAX_ROPE_TABLE} entries")
    scaling = cfg.get("rope_scaling") or {}
    if isinstance(scaling, dict):
        _positive_float(scaling, "factor", where)
        _int(scaling, "original_max_position_embeddings", where, 1, MAX_CONTEXT)


def check_against_tensors(cfg: Mapping[str, Any], embedding_shape: tuple[int, ...], layer_ids: set[int],
                          where: str) -> None:
    """The metadata's layer count and width agree with the tensors (each bounded by the file's size), before
    a model of that shape is allocated: a declared count alone could ask for gigabytes."""
    if layer_ids != set(range(cfg["num_hidden_layers"])):
        held = f"layers {min(layer_ids)} to {max(layer_ids)}" if layer_ids else "none"
        raise UserError(f"{where}: GGUF metadata declares {cfg['num_hidden_layers']} layers, its tensors hold "
                        f"{len(layer_ids)} ({held})")
    if embedding_shape[0] != cfg["hidden_size"]:
        raise UserError(f"{where}: GGUF metadata gives hidden_size={cfg['hidden_size']}, the token embedding is "
                        f"{embedding_shape[0]} wide")
