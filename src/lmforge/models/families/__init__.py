"""The built-in model families, one module per family, each registering its :class:`ModelSpec`.

- :mod:`.llama`: Llama 2 / 3 / 3.1-3.3 and SmolLM2 (``model_type`` ``llama``);
- :mod:`.qwen`: Qwen2 / Qwen2.5 (``qwen2``) and Qwen3 (``qwen3``);
- :mod:`.mistral`: Mistral (``mistral``);
- :mod:`.phi3`: Phi-3 / Phi-3.5-mini (``phi3``);
- :mod:`.gemma3`: Gemma 3 text models (``gemma3_text``);
- :mod:`.moe`: the mixtures of experts Qwen3-MoE (``qwen3_moe``), Mixtral (``mixtral``), OLMoE (``olmoe``);
- :mod:`lmforge.models.gpt_oss`: gpt-oss (``gpt_oss``), a family folder of its own;
- :mod:`.llama_style`: what they share (the Llama tensor names and config.json mapping).

Importing this package (or :mod:`lmforge.models.spec`) registers them all.
"""

# Registration order is the order error messages list the supported families in.
from lmforge.models.families import llama  # noqa: F401
from lmforge.models.families import qwen  # noqa: F401
from lmforge.models.families import mistral  # noqa: F401
from lmforge.models.families import phi3  # noqa: F401
from lmforge.models.families import gemma3  # noqa: F401
from lmforge.models.families import moe  # noqa: F401
from lmforge.models.gpt_oss import spec as _gpt_oss  # noqa: F401,E402
