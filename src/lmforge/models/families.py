"""The registry's list of built-in families: one folder each under ``lmforge/models/``, each registering
its :class:`~lmforge.models.spec.ModelSpec` (config.json both ways, named sizes, tensor names, and its
own modules where it has them) when imported.

- ``llama``: Llama 2 / 3 / 3.1-3.3 and SmolLM2 (``model_type`` ``llama``);
- ``qwen``: Qwen2 / Qwen2.5 (``qwen2``) and Qwen3 (``qwen3``);
- ``mistral``: Mistral (``mistral``);
- ``phi3``: Phi-3 / Phi-3.5-mini (``phi3``);
- ``gemma3``: Gemma 3 text models (``gemma3_text``);
- ``qwen3_moe``, ``mixtral``, ``olmoe``: the mixtures of experts Qwen3-MoE, Mixtral, OLMoE;
- ``deepseek_v3``: DeepSeek-V3 and Kimi-K2 (latent attention, grouped sigmoid router, shared experts);
- ``gpt_oss``: gpt-oss (``gpt_oss``: sinks, biased router and experts, clamped SwiGLU, MXFP4 on load);
- ``qwen2_5_vl``, ``qwen3_vl``: the vision-language Qwen2.5-VL (window attention in its tower) and Qwen3-VL
  (DeepStack), and ``gemma3_vl``: Gemma 3 with its SigLIP tower (``model_type`` ``gemma3``), on what ``vision``
  shares (the towers' layers, multimodal RoPE, the model with a tower);
- ``common``: what several folders share (the Llama tensor names and config.json mapping, the MoE keys).

Importing this module (which the first registry lookup does) registers them all; a new family is its folder
and one line here.
"""

# Registration order is the order error messages list the supported families in.
from lmforge.models import llama  # noqa: F401
from lmforge.models import qwen  # noqa: F401
from lmforge.models import mistral  # noqa: F401
from lmforge.models import phi3  # noqa: F401
from lmforge.models import gemma3  # noqa: F401
from lmforge.models import qwen3_moe  # noqa: F401
from lmforge.models import mixtral  # noqa: F401
from lmforge.models import olmoe  # noqa: F401
from lmforge.models import deepseek_v3  # noqa: F401
from lmforge.models import gpt_oss  # noqa: F401
from lmforge.models import qwen2_5_vl  # noqa: F401
from lmforge.models import qwen3_vl  # noqa: F401
from lmforge.models import gemma3_vl  # noqa: F401
