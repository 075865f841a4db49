"""Models: the shared layers, the decoder built from per-module configs, one folder per family,
tokenizers, generation, FLOP and memory accounting, and loading.

- ``configs``: the per-module configs (norm, RoPE, attention kinds, MLP, router, MoE, block, decoder);
- ``layers/``: the shared building blocks, each built from its config (RMSNorm, rotary tables incl.
  YaRN, grouped-query and latent attention and their kernels, gated MLPs, mixtures of experts with their
  routers, KV caches), one idea per module;
- ``model``: ``Transformer``, the decoder built from a list of block configs, with what only the model
  can name (its tensor-parallel roles, Muon's matrices, its pipeline stages, its init);
- ``args``: ``ModelArgs``, the hyper-parameters checkpoints store, and ``decoder_config()`` from them;
- ``spec``: ``ModelSpec``, what a family provides (config.json both ways, named sizes, tensor names,
  LoRA targets, FLOP hooks, an after-optimizer-step hook), and the registry that finds it;
- ``<family>/`` (``llama``, ``qwen``, ``mistral``, ``phi3``, ``gemma3``, ``qwen3_moe``, ``mixtral``,
  ``olmoe``, ``deepseek_v3``, ...): one folder each, registering its spec; ``families`` lists them; ``common/`` holds
  what several share;
- ``flops`` / ``memory``: FLOPs per token and the planner's memory model, from the blocks' configs;
- ``hf`` / ``hf_config``: Hugging Face directories in and out, always through the family's spec.

``load_model`` (``load``) is the one way to get a model from any source (fresh, a Hugging Face
directory, an lmforge run or checkpoint).
"""

# Registration: the built-in families (each registering its spec, argument class and named sizes) are
# imported by the first lookup (``args.load_families``), not here: the light modules of this package
# (tokenizer, hub, args) are read by the config and ``lmforge --help``, which never load torch.
