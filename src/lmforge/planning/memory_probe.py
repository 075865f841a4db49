"""Measure the peak of live tensor memory of a real train step in this process (what the planner's
estimate is checked against).

RSS is useless for small models (allocator caching, the interpreter, libraries) and a CPU has no
allocator statistics, so :class:`LiveTensorMemory` counts storages instead: a dispatch mode sees
every tensor an operator returns, counts each new storage's bytes once, and a weak reference to the
storage takes them off again when it is freed (torch keeps a storage's Python object alive exactly as
long as the storage). Tensor subclasses (DTensor) are counted by their local tensors, and storages
resized in place (FSDP2's gathered parameters) by their current size where ``watch_resizes`` is on.
What it cannot see: workspace a kernel (or a collective's backend) allocates and frees inside one
operator.

:func:`measure_train_step` runs the library's own train-step pieces (the model as the family builds
it, activation checkpointing as the decoder plan applies it, the chunked cross-entropy, gradient
accumulation, clipping and AdamW) for a few steps and reports the peak of the last one, when the
optimizer state exists.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from lmforge.models.args import ModelArgs

__all__ = ["LiveTensorMemory", "MeasuredPeak", "measure_train_step"]


def _plain_tensors(t: Any) -> list[torch.Tensor]:
    """The plain tensors holding ``t``'s data: itself, or the inner tensors of a wrapper subclass (a
    DTensor's local shard, FSDP2's parameters) found through ``__tensor_flatten__``."""
    if not isinstance(t, torch.Tensor):
        return []
    if hasattr(t, "__tensor_flatten__"):
        names, _ = t.__tensor_flatten__()
        return [x for n in names for x in _plain_tensors(getattr(t, n))]
    return [t]


class LiveTensorMemory(TorchDispatchMode):
    """Bytes of live tensor storage: those of ``track``-ed tensors plus every storage an op creates.

    Tensor subclasses (DTensor) are seen below their own dispatch: an op on a subclass is handed back
    to the subclass (``NotImplemented``), which runs it on its plain local tensors with this mode still
    active, so the local shards, the collectives' buffers and whatever the subclass allocates are
    counted. ``watch_resizes``: storages can also grow and shrink in place (FSDP2 frees a block's
    gathered parameters with ``resize_(0)`` and gathers into the same storage again), outside any op;
    each op then re-reads every live storage's size before and after it runs (slower, exact)."""

    def __init__(self, watch_resizes: bool = False) -> None:
        super().__init__()
        self._entries: dict[int, list] = {}  # id(weakref) -> [weakref, bytes counted]
        self._seen: weakref.WeakSet = weakref.WeakSet()
        self.watch_resizes = watch_resizes
        self.current = 0
        self.peak = 0

    def _add(self, t: Any) -> None:
        for p in _plain_tensors(t):
            if p.device.type == "meta" or _is_fake(p):
                continue
            st = p.untyped_storage()
            if st in self._seen:
                continue
            self._seen.add(st)
            entry = [None, st.nbytes()]

            def freed(ref: weakref.ref, entry: list = entry) -> None:
                self.current -= entry[1]
                self._entries.pop(id(ref), None)

            entry[0] = weakref.ref(st, freed)
            self._entries[id(entry[0])] = entry
            self.current += entry[1]
        self.peak = max(self.peak, self.current)

    def _resync(self) -> None:
        for ref, counted in list(self._entries.values()):
            st = ref()
            if st is not None and (n := st.nbytes()) != counted:
                self._entries[id(ref)][1] = n
                self.current += n - counted
        self.peak = max(self.peak, self.current)

    def track(self, tensors: Any) -> None:
        """Count tensors that exist already (parameters, buffers, the batch)."""
        for t in tree_flatten(tensors)[0]:
            self._add(t)

    def reset_peak(self) -> None:
        if self.watch_resizes:
            self._resync()
        self.peak = self.current

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if any(t is not torch.Tensor and t is not torch.nn.Parameter for t in types):
            if not any(_is_fake_type(t) for t in types):
                return NotImplemented  # the subclass runs the op on its inner tensors, seen here
            return func(*args, **(kwargs or {}))  # fake tensors (DTensor's shape propagation): no memory
        if self.watch_resizes:
            self._resync()
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            self._add(t)
        if self.watch_resizes:
            self._resync()
        return out


def _is_fake_type(t: type) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor

    return issubclass(t, FakeTensor)


def _is_fake(t: torch.Tensor) -> bool:
    return _is_fake_type(type(t))


@dataclass(frozen=True)
class MeasuredPeak:
    """Peak live tensor bytes of the last measured train step, and what was live before it."""

    peak: int
    before_step: int
    params: int
    optimizer_state: int


def measure_train_step(args: ModelArgs, *, seq_len: int, micro_batch: int, dtype: str = "float32",
                       checkpointing: bool = False, microbatches: int = 1, steps: int = 2,
                       chunk_tokens: int = 1024, seed: int = 0) -> MeasuredPeak:
    """Peak live tensor memory (bytes) of train step ``steps`` of ``args`` on the CPU."""
    from lmforge.data.packing import Batch
    from lmforge.models.spec import spec_for_args
    from lmforge.objectives.next_token import NextTokenObjective
    from lmforge.parallel.plans import apply_activation_checkpointing
    from lmforge.optim.optimizers import state_bytes
    from lmforge.optim.adamw import build_optimizer
    from lmforge.training.train_step import gradient_computation, run_optimizer_step

    torch.manual_seed(seed)
    model = spec_for_args(args).build(args)
    model.init_weights(seed=seed)
    if checkpointing:
        apply_activation_checkpointing(model)
    optimizer = build_optimizer(model, 1e-3, 0.1, (0.9, 0.95), 1e-8)
    objective = NextTokenObjective(chunk_tokens)
    autocast = torch.autocast("cpu", dtype=torch.bfloat16) if dtype == "bfloat16" else None
    g = torch.Generator().manual_seed(seed)
    tracker = LiveTensorMemory()
    with tracker:
        tracker.track([list(model.parameters()), list(model.buffers())])
        params = tracker.current
        for _ in range(steps):
            ids = torch.randint(0, args.vocab_size, (microbatches, micro_batch, seq_len + 1), generator=g)
            mbs = [Batch(row[:, :-1], row[:, 1:]) for row in ids]
            tracker.track([(mb.input_ids, mb.labels) for mb in mbs])
            before = tracker.current
            tracker.reset_peak()
            stats = gradient_computation(model, mbs, objective.loss_fn, objective.normalizer(mbs), autocast)
            run_optimizer_step(model, optimizer, 1e-3, 1.0)
            del stats, mbs, ids
    return MeasuredPeak(tracker.peak, before, params, state_bytes(optimizer))
