"""lmforge: compact, PyTorch-native training of Llama-style language models."""

__version__ = "0.1.0"
