"""Writing a run out: Hugging Face directories, PEFT adapters and llama.cpp GGUF files
(``lmforge export``; the Python API's :func:`lmforge.export`)."""

from lmforge.exporters.run_export import (
    byte_tokenizer_json, export_adapter, export_gguf, export_hf, write_hf_dir, write_tokenizer_files,
)

__all__ = ["byte_tokenizer_json", "export_adapter", "export_gguf", "export_hf", "write_hf_dir",
           "write_tokenizer_files"]
