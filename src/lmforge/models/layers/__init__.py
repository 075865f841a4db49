"""The building blocks every model family is made of, one idea per module.

- :mod:`.norm`: ``RMSNorm`` / ``rms_norm``;
- :mod:`.rope`: rotary embeddings (``RotaryEmbedding``, ``apply_rope``) and their frequency schemes;
- :mod:`.attention`: the grouped-query ``Attention`` module and ``attend``, its SDPA dispatch;
- :mod:`.packed_attention`: per-document causal attention for packed batches (``packed_layout``);
- :mod:`.context_attention`: attention over keys all-gathered from a context-parallel group;
- :mod:`.masks`: ``sliding_window_mask`` and the dense reference ``document_mask``;
- :mod:`.mlp`: the gated ``FeedForward`` (SwiGLU, GeGLU) and ``gated_activation``;
- :mod:`.kv_cache`: the ``KVCache`` generation fills and attention reads.

A family's model (:mod:`lmforge.models.model` for the dense decoder) composes these; the fused
decode step (:mod:`lmforge.models.decode_step`) reuses ``rms_norm`` and ``apply_rope`` so both
paths do the same arithmetic.
"""

from lmforge.models.layers.attention import Attention, attend
from lmforge.models.layers.kv_cache import KVCache
from lmforge.models.layers.masks import document_mask, sliding_window_mask
from lmforge.models.layers.mlp import FeedForward
from lmforge.models.layers.norm import RMSNorm, rms_norm
from lmforge.models.layers.packed_attention import LengthGroup, PackedLayout, attend_packed, packed_layout
from lmforge.models.layers.rope import RotaryEmbedding, apply_rope, rope_frequencies

__all__ = [
    "Attention", "FeedForward", "KVCache", "LengthGroup", "PackedLayout", "RMSNorm", "RotaryEmbedding",
    "apply_rope", "attend", "attend_packed", "document_mask", "packed_layout", "rms_norm", "rope_frequencies",
    "sliding_window_mask",
]
