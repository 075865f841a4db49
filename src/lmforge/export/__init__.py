"""Writing a run out: Hugging Face directories, PEFT adapters and llama.cpp GGUF files."""

import sys
import types

from lmforge.export.exporters import (
    byte_tokenizer_json, export_adapter, export_gguf, export_hf, write_hf_dir, write_tokenizer_files,
)

__all__ = ["byte_tokenizer_json", "export_adapter", "export_gguf", "export_hf", "write_hf_dir",
           "write_tokenizer_files"]


class _CallableModule(types.ModuleType):
    """``lmforge.export`` names both this package and the Python API's ``export`` function: once the
    package is imported it is ``lmforge``'s attribute, so calling it calls :func:`lmforge.api.export`."""

    def __call__(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        from lmforge.api import export

        return export(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule
