"""Reading DCP checkpoints without running code from them.

DCP stores its ``.metadata`` as a pickle and non-tensor values (optimizer settings) as
``torch.save`` bytes, both read with unrestricted unpickling by default. A checkpoint directory can
come from anywhere, so lmforge reads the metadata with an unpickler that admits only DCP's plain
data classes, and the non-tensor values with ``weights_only=True``.
"""

from __future__ import annotations

import functools
import io
import pickle
from typing import Any

import torch

_METADATA_CLASSES = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
        "TensorProperties", "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING",
    },
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},
    "torch": {"Size"},
    "pathlib": {"Path", "PosixPath", "WindowsPath", "PurePath", "PurePosixPath", "PureWindowsPath"},
    "collections": {"OrderedDict"},
}


class _MetadataUnpickler(pickle.Unpickler):
    """Reads DCP's ``.metadata`` pickle but refuses every global outside DCP's plain data classes."""

    def find_class(self, module: str, name: str) -> Any:
        if name in _METADATA_CLASSES.get(module, ()):
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"checkpoint metadata refers to {module}.{name}, which is not allowed")


@functools.cache
def safe_loading_classes() -> tuple[type, type]:
    """DCP's file reader and load planner, made code-free. Built on first use: importing
    torch.distributed.checkpoint pulls in DTensor, about a second of startup for every command."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
    from torch.distributed.checkpoint.metadata import StorageMeta

    class SafeReader(FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            rank = kwargs.get("rank")
            name = ".metadata" if rank is None else f"__{rank}.metadata"
            with self.fs.create_stream(self.fs.concat_path(self.path, name), "rb") as f:
                metadata = _MetadataUnpickler(f).load()
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    class WeightsOnlyPlanner(DefaultLoadPlanner):
        """DCP's default planner reads non-tensor values with unrestricted pickle; read them safely.

        The value is decoded with ``weights_only=True`` and handed on re-encoded, so what the default
        planner then decodes holds only what the restricted loader admitted.
        """

        def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
            obj = torch.load(value, weights_only=True)
            clean = io.BytesIO()
            torch.save(obj, clean)
            clean.seek(0)
            super().load_bytes(read_item, clean)

    return SafeReader, WeightsOnlyPlanner
