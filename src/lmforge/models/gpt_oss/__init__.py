"""gpt-oss (``model_type`` ``gpt_oss``): its arguments and named sizes (:mod:`.args`), config.json mapping
(:mod:`.config_json`), tensor layout (:mod:`.state_dict`) with the MXFP4 dequantizer (:mod:`.mxfp4`), and
its spec (:mod:`.spec`, registered by ``lmforge.models.families``). Its modules are the shared layers:
attention with sinks, YaRN RoPE, the top-k-softmax router and biased clamped-SwiGLU experts."""

from lmforge.models.gpt_oss.args import GPT_OSS_SIZES, GptOssArgs, gpt_oss_args_for

__all__ = ["GPT_OSS_SIZES", "GptOssArgs", "gpt_oss_args_for"]
