"""Models: the Llama-style transformer, its tokenizers, generation, FLOP counting and loading.

``load_model`` is the one way to get a model from any source (fresh, a Hugging Face directory, an
lmforge run or checkpoint); ``hf`` converts to and from Hugging Face model directories (Llama, Qwen, Mistral families).
"""
