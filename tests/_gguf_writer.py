"""Tiny transformers models written to GGUF by lmforge's writer (:mod:`lmforge.exporters.gguf_write`), which
stores them as llama.cpp's converter does (llama.cpp's tensor names, the q/k row permutation of the
``llama`` architecture, Llama 3 RoPE as a ``rope_freqs`` tensor, Gemma 3's norm weights as ``1 + w``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

from lmforge.exporters.gguf_write import write_gguf as write_gguf_file
from lmforge.models.hf_config import args_from_hf_config


def write_gguf(model: Any, arch: str, path: Path, metadata: Callable[[Any], None] | None = None,
               gguf_type: str = "f32", tokenizer: Any = None) -> Path:
    """``model`` (a transformers ``*ForCausalLM`` of GGUF architecture ``arch``) as a GGUF file;
    ``metadata(writer)`` adds or overrides architecture keys."""
    args = args_from_hf_config(model.config.to_dict(), "transformers config")
    if tokenizer is not None:
        args.vocab_size = model.config.vocab_size
    path = write_gguf_file(model.state_dict(), args, path, gguf_type=gguf_type, metadata=metadata, tokenizer=tokenizer)
    import gguf

    assert gguf.GGUFReader(str(path)).fields["general.architecture"].contents() == arch
    return path
