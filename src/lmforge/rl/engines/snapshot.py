"""Policy weights as files vLLM reads: a whole Hugging Face model directory to start an engine on, and a
safetensors snapshot per weight sync (or, for a LoRA policy, a PEFT adapter directory: :mod:`.lora_sync`).

Snapshots are written next to each other under one directory (``/dev/shm`` by default: a file there is
shared memory, so a sync is one copy out of the trainer and one memory-mapped read in the engine), under
a temporary name renamed into place, and the previous one is removed once the engine has loaded the new.
"""

from __future__ import annotations

import copy
import os
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn

from lmforge.errors import UserError
from lmforge.models.hf import hf_state_dict_from_lmforge, savable_tensors


def full_cpu_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every weight of ``model`` whole and on the CPU, as an inference engine needs it: also when FSDP2
    shards it (then a collective: every rank must call it), and with LoRA adapters folded into their
    base weights (on a copy: the trained model keeps its adapters)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from lmforge.models.lora import has_adapters, merge_adapters

    if has_adapters(model):
        from torch.distributed.fsdp import FSDPModule

        if isinstance(model, FSDPModule):
            raise UserError("grpo.engine=vllm with [lora] under FSDP2 is not supported: use DDP or one process")
        with torch.no_grad():
            return {k: v.detach().cpu() for k, v in merge_adapters(copy.deepcopy(model)).state_dict().items()}
    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def default_sync_dir() -> Path:
    shm = Path("/dev/shm")
    base = shm if shm.is_dir() and os.access(shm, os.W_OK) else Path(tempfile.gettempdir())
    return Path(tempfile.mkdtemp(prefix="lmforge-weights-", dir=base))


class WeightSnapshots:
    """Numbered safetensors snapshots of a policy under ``directory``."""

    def __init__(self, directory: Path, *, owned: bool, writes: bool = True) -> None:
        """``owned``: the directory was made for this run and goes with it; ``writes``: this rank writes
        the files (one rank of several does: the others read them)."""
        self.owned, self.writes = owned, writes
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.current: Path | None = None

    def write(self, model: nn.Module, version: int) -> Path:
        """The Hugging Face-named weights of ``model`` as one file; returns its path. Every rank calls it
        (gathering the weights is a collective under FSDP2); only the writing rank writes."""
        state = full_cpu_state(model)
        path = self.dir / f"weights-{version:08d}.safetensors"
        if not self.writes:
            return path
        tensors = savable_tensors(hf_state_dict_from_lmforge(state, model.args))
        tmp = path.with_name(f".{path.name}.{os.getpid()}.partial")  # not a name a user file could have by chance
        save_file(tensors, str(tmp), metadata={"format": "pt", "version": str(version)})
        os.replace(tmp, path)
        return path

    def write_adapter(self, model: nn.Module, version: int, lora: dict, base_name: str) -> Path:
        """The adapters of ``model`` alone as a PEFT directory (Hugging Face module names, for vLLM's LoRA;
        ``base_name``: the model directory the engine started on); returns its path. Only the writing rank
        writes."""
        from lmforge.exporters.run_export import write_peft_adapter

        path = self.dir / f"adapter-{version:08d}"
        if not self.writes:
            return path
        tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=".partial", dir=self.dir))
        write_peft_adapter(model, lora, base_name, tmp)
        shutil.rmtree(path, ignore_errors=True)  # a resumed run may sync a version again
        os.replace(tmp, path)
        return path

    def loaded(self, path: Path) -> None:
        """The engine has loaded ``path``: the snapshot before it can go."""
        if self.current is not None and self.current != path:
            _remove(self.current)
        self.current = path

    def close(self) -> None:
        if not self.writes:
            return
        if self.owned:
            shutil.rmtree(self.dir, ignore_errors=True)
        elif self.current is not None:
            _remove(self.current)


def _remove(path: Path) -> None:
    """A snapshot: a safetensors file, or an adapter's directory."""
    if path.is_dir():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)
