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
import warnings
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import torch

from lmforge.errors import UserError

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


def checkpoint_exception() -> type[BaseException]:
    from torch.distributed.checkpoint.api import CheckpointException  # a BaseException, not an Exception
    return CheckpointException


@contextmanager
def quiet_dcp() -> Iterator[None]:
    with warnings.catch_warnings():  # single-process saves/loads are intended here
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def safe_dcp_load(state: dict[str, Any], path: str | Path) -> None:
    """``dcp.load`` into ``state`` without executing code from the checkpoint (see module doc)."""
    import torch.distributed.checkpoint as dcp

    reader, planner = safe_loading_classes()
    _check_metadata(Path(path))
    try:
        with quiet_dcp():
            dcp.load(state, storage_reader=reader(str(path)), planner=planner())
    except (Exception, checkpoint_exception()) as e:
        if isinstance(e, UserError):
            raise
        raise UserError(f"checkpoint {path} could not be loaded: {one_line(e)}") from None


def _check_metadata(path: Path) -> None:
    """Read ``.metadata`` with the restricted unpickler first: a refused or unreadable file becomes one
    line here, before DCP's own fallback (per-rank metadata) prints tracebacks of its own."""
    try:
        with open(path / ".metadata", "rb") as f:
            _MetadataUnpickler(f).load()
    except OSError as e:
        raise UserError(f"checkpoint {path}: cannot read .metadata ({e.strerror or e})") from None
    except Exception as e:  # noqa: BLE001 - any unpickling failure means the file cannot be trusted
        raise UserError(f"checkpoint {path}: refused .metadata: {one_line(e)}") from None


def one_line(e: BaseException) -> str:
    """The root cause of an error in one line: DCP wraps the real OSError in per-rank tracebacks."""
    failures = getattr(e, "failures", None)
    if isinstance(failures, dict) and failures:
        inner = next(iter(failures.values()))
        return one_line(inner[0] if isinstance(inner, tuple) else inner)
    while isinstance(e.__cause__, BaseException) and not isinstance(e, OSError):
        e = e.__cause__
    if isinstance(e, OSError) and e.strerror:
        where = f" ({e.filename})" if e.filename else ""
        return f"{e.strerror}{where}"
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[-1] if text else ''}".strip()


