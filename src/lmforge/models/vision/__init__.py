"""What the vision-language families share: the patch embedding, the 2-D rotary embedding of image
patches, bidirectional attention within each image (or window) of a packed patch sequence, and the
language model's multimodal RoPE (positions from the images' grids, Qwen's ``get_rope_index``).

Also the model (:mod:`.model`: the decoder with a tower, DeepStack included) and the tensor names
(:mod:`.layout`) of Qwen's vision-language families. The pieces take plain tensors (``grid_thw``
[n_images, 3] of temporal, height and width patches per image) and no configs of a family, so each
family's folder composes its own tower from them.
"""

from lmforge.models.vision.attention import VisionAttention, segment_lengths
from lmforge.models.vision.mrope import (
    MultimodalRotaryEmbedding, mrope_axes, mrope_position_ids, scatter_image_features,
)
from lmforge.models.vision.patch_embed import PatchEmbed
from lmforge.models.vision.rotary import vision_rope

__all__ = ["MultimodalRotaryEmbedding", "PatchEmbed", "VisionAttention", "mrope_axes", "mrope_position_ids",
           "scatter_image_features", "segment_lengths", "vision_rope"]
