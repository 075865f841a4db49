"""gpt-oss's checkpoint tensors under lmforge's names.

transformers' ``GptOssForCausalLM`` (per block ``i``, under ``model.layers.{i}.``):

- ``self_attn.{q,k,v,o}_proj.{weight,bias}`` and ``self_attn.sinks`` [n_heads];
- ``mlp.router.weight`` [E, dim] and ``mlp.router.bias`` [E];
- ``mlp.experts.gate_up_proj`` [E, dim, 2 hidden] (the *input* dimension first, gate and up columns
  alternating: column ``2 j`` is gate unit ``j``, ``2 j + 1`` up unit ``j``) and ``gate_up_proj_bias``
  [E, 2 hidden] (same alternation); ``mlp.experts.down_proj`` [E, hidden, dim] and ``down_proj_bias`` [E, dim];
- ``input_layernorm.weight``, ``post_attention_layernorm.weight``.

lmforge keeps each expert projection as ``[E, out, in]`` (what a grouped matmul reads: ``w1``/``w3`` gate/up
[E, hidden, dim], ``w2`` down [E, dim, hidden]) with biases ``b1``/``b3`` [E, hidden], ``b2`` [E, dim]; so
``gate_up_proj`` is ``w1`` and ``w3`` interleaved along ``hidden`` and transposed, ``down_proj`` is ``w2``
transposed (:class:`~lmforge.models.state_dict_adapter.Packed`). Published checkpoints store the expert
weights in MXFP4 (``gate_up_proj_blocks``/``_scales``, ``down_proj_blocks``/``_scales``): the layout's read
hook dequantizes them first (:mod:`lmforge.models.gpt_oss.mxfp4`).
"""

from __future__ import annotations

from lmforge.models.common.llama_style import LLAMA_LAYOUT
from lmforge.models.gpt_oss.mxfp4 import dequantize_mxfp4_state
from lmforge.models.state_dict_adapter import Packed

__all__ = ["GPT_OSS_LAYOUT"]

_DENSE_MLP = ("feed_forward.w1.weight", "feed_forward.w2.weight", "feed_forward.w3.weight")

GPT_OSS_LAYOUT = LLAMA_LAYOUT.extend(
    layer_names={
        "attention.wq.bias": "self_attn.q_proj.bias",
        "attention.wk.bias": "self_attn.k_proj.bias",
        "attention.wv.bias": "self_attn.v_proj.bias",
        "attention.wo.bias": "self_attn.o_proj.bias",
        "attention.sinks": "self_attn.sinks",
        "feed_forward.router.weight": "mlp.router.weight",
        "feed_forward.router.bias": "mlp.router.bias",
        "feed_forward.experts.b2": "mlp.experts.down_proj_bias",
    },
    packed_names={
        "mlp.experts.gate_up_proj": Packed(("feed_forward.experts.w1", "feed_forward.experts.w3"), dim=1,
                                           interleaved=True, transposed=True),
        "mlp.experts.gate_up_proj_bias": Packed(("feed_forward.experts.b1", "feed_forward.experts.b3"), dim=1,
                                                interleaved=True),
        "mlp.experts.down_proj": Packed(("feed_forward.experts.w2",), transposed=True),
    },
    drop=_DENSE_MLP,
    read_hook=dequantize_mxfp4_state,
)
"""lmforge names <-> ``GptOssForCausalLM`` names (and MXFP4 checkpoints dequantized on reading)."""
