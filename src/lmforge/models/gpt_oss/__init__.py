"""gpt-oss (``model_type`` ``gpt_oss``): its arguments and named sizes (:mod:`.args`), config.json mapping
(:mod:`.config_json`), tensor layout (:mod:`.state_dict`) with the MXFP4 dequantizer (:mod:`.mxfp4`), and
its spec (:mod:`.spec`), registered when this package is imported (``lmforge.models.families`` lists it).
Its modules are the shared layers: attention with sinks, YaRN RoPE, the top-k-softmax router and biased
clamped-SwiGLU experts."""

from lmforge.models.gpt_oss.args import GPT_OSS_SIZES, GptOssArgs, gpt_oss_args_for
from lmforge.models.gpt_oss.spec import GPT_OSS

__all__ = ["GPT_OSS", "GPT_OSS_SIZES", "GptOssArgs", "gpt_oss_args_for"]
