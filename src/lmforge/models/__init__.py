"""Models: the shared layers, the dense decoder, the families built from them, tokenizers, generation,
FLOP counting and loading.

- ``layers/``: the building blocks (RMSNorm, rotary embeddings, attention and its kernels, the
  SwiGLU MLP, the KV cache), one idea per module;
- ``model``: ``Transformer``, the dense decoder every built-in family builds from those layers;
- ``args``: ``ModelArgs``, the hyper-parameters checkpoints store, and the named sizes;
- ``spec``: ``ModelSpec``, what a family provides (Hugging Face config and tensor-name mapping,
  ``build``, parallel plan, fused-decode support, FLOP hooks), and the registry that finds it;
- ``families/``: one module per family (Llama incl. SmolLM2, Qwen2/Qwen3, Mistral), each
  registering its spec;
- ``hf`` / ``hf_config``: Hugging Face directories in and out, always through the family's spec.

``load_model`` (``load``) is the one way to get a model from any source (fresh, a Hugging Face
directory, an lmforge run or checkpoint).
"""
