"""Mistral (``model_type`` ``mistral``): the shared decoder with sliding-window attention.

A query attends to itself and the ``sliding_window - 1`` tokens before it, in every layer;
config.json's ``sliding_window`` (4096 when left out, as in transformers) sets the window and
``null`` turns it off. ``layer_types`` is not read: the window applies to all layers.
"""

from __future__ import annotations

from typing import Any

from lmforge.models.args import ModelArgs
from lmforge.models.common.gguf_names import LLAMA_GGUF_LAYER_NAMES
from lmforge.models.common.llama_style import LLAMA_LAYOUT, LlamaStyleConfig
from lmforge.models.spec import GGUFFormat


def _export_keys(args: ModelArgs) -> dict[str, Any]:
    return {"sliding_window": args.sliding_window}


MISTRAL_CONFIG = LlamaStyleConfig(
    model_type="mistral",
    architecture="MistralForCausalLM",
    defaults={"num_key_value_heads": 8, "head_dim": None, "max_position_embeddings": 4096 * 32,
              "sliding_window": 4096},
    sliding_window=True,
    export_keys=_export_keys,
)

# the fused step applies the window; mistralai/Mistral-7B-v0.1
MISTRAL = MISTRAL_CONFIG.register(LLAMA_LAYOUT, fused_decode=True, sizes={"mistral-7b": dict(
    dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_hidden_dim=14336, norm_eps=1e-5,
    rope_theta=10000.0, max_seq_len=32768, tie_embeddings=False, sliding_window=4096)},
    # llama.cpp writes Mistral as its `llama` architecture (the window in llama.attention.sliding_window),
    # which reads back as Llama
    gguf=GGUFFormat("llama", LLAMA_GGUF_LAYER_NAMES, permuted_qk=True, reads=False))
