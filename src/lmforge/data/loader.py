"""Step-oriented data loading whose position does not depend on the world size.

The loader hands out whole optimizer steps. Global sample index ``i`` lives in epoch
``i // len(dataset)`` and maps to a dataset index through that epoch's permutation, so the
global batch of step ``k`` is always samples ``[k*G, (k+1)*G)`` of one fixed global order.
Each data-parallel rank takes a contiguous slice of that batch and splits it into
microbatches. Because nothing depends on how many ranks there are, a run can be resumed at a
different world size and still see exactly the same data, and the checkpointed state is just
``samples_consumed``. A dataset with ``orders_itself = True`` (a weighted mixture) maps global
indices to samples itself and is read in index order.
"""

from __future__ import annotations

import queue
import threading
from typing import Iterator

import numpy as np
import torch

from lmforge.data.packing import Batch, SampleDataset, collate
from lmforge.errors import UserError

__all__ = ["StepLoader", "eval_batches"]

_POLL_S = 0.1  # how often a blocked producer re-checks for shutdown


class _GlobalOrder:
    """Maps global sample indices to dataset indices; caches the current epochs' permutations."""

    def __init__(self, size: int, seed: int, shuffle: bool) -> None:
        self.size, self.seed, self.shuffle = size, seed, shuffle
        self._perms: dict[int, np.ndarray] = {}

    def _perm(self, epoch: int) -> np.ndarray:
        perm = self._perms.get(epoch)
        if perm is None:
            if len(self._perms) >= 2:  # a step spans at most a few epochs; keep memory flat
                self._perms.pop(min(self._perms))
            perm = np.random.default_rng([self.seed, epoch]).permutation(self.size)
            self._perms[epoch] = perm
        return perm

    def __call__(self, start: int, stop: int) -> list[int]:
        if not self.shuffle:
            return [i % self.size for i in range(start, stop)]
        return [int(self._perm(i // self.size)[i % self.size]) for i in range(start, stop)]


class StepLoader:
    """This rank's microbatches for each optimizer step, prefetched in a background thread.

    ``state_dict()`` counts only the steps already returned by :meth:`next_step`, so batches
    sitting in the prefetch queue at checkpoint time are produced again after a resume.
    """

    def __init__(
        self,
        dataset: SampleDataset,
        global_batch_size: int,
        micro_batch_size: int,
        dp_rank: int,
        dp_world_size: int,
        seed: int = 0,
        shuffle: bool = True,
        prefetch: int = 2,
        device: torch.device | str = "cpu",
    ) -> None:
        G, m, W = global_batch_size, micro_batch_size, dp_world_size
        if G < 1 or m < 1 or W < 1:
            raise UserError(
                f"training.global_batch_size ({G}), training.micro_batch_size ({m}) and the "
                f"world size ({W}) must all be positive"
            )
        if G % (W * m) != 0:
            raise UserError(
                f"training.global_batch_size ({G}) must be divisible by "
                f"training.micro_batch_size ({m}) x data-parallel world size ({W}) = {W * m}"
            )
        if not 0 <= dp_rank < W:
            raise ValueError(f"dp_rank {dp_rank} out of range for world size {W}")
        if len(dataset) == 0:
            raise UserError("the training dataset is empty")
        self.dataset = dataset
        self.global_batch_size = G
        self.micro_batch_size = m
        self.dp_rank = dp_rank
        self.dp_world_size = W
        # A dataset that orders itself (a weighted mixture) is read in its own order, never re-permuted.
        self.shuffle = shuffle and not getattr(dataset, "orders_itself", False)
        self.prefetch = max(0, int(prefetch))
        self.device = torch.device(device)
        self._seed = int(seed)
        self._order = _GlobalOrder(len(dataset), self._seed, self.shuffle)
        self.samples_consumed = 0
        self._thread: threading.Thread | None = None
        self._queue: queue.Queue | None = None
        self._stop = threading.Event()

    @property
    def grad_accum_steps(self) -> int:
        return self.global_batch_size // (self.dp_world_size * self.micro_batch_size)

    @property
    def steps_per_epoch(self) -> int:
        """Full global batches in one pass over the dataset (at least 1)."""
        return max(1, len(self.dataset) // self.global_batch_size)

    # -- producing ---------------------------------------------------------------------------

    def _build_step(self, start: int) -> list[Batch]:
        """This rank's microbatches for the global batch that begins at sample ``start``."""
        per_rank = self.global_batch_size // self.dp_world_size
        lo = start + self.dp_rank * per_rank
        indices = self._order(lo, lo + per_rank)
        m = self.micro_batch_size
        batches = []
        for j in range(0, per_rank, m):
            batch = collate([self.dataset[i] for i in indices[j : j + m]])
            if self.device.type == "cuda":
                batch = batch.pin_memory()
            batches.append(batch)
        return batches

    def _produce(self, start: int, q: queue.Queue, stop: threading.Event) -> None:
        pos = start
        try:
            while not stop.is_set():
                item = (pos, self._build_step(pos))
                pos += self.global_batch_size
                while not stop.is_set():
                    try:
                        q.put(item, timeout=_POLL_S)
                        break
                    except queue.Full:
                        continue
        except BaseException as e:  # handed to the consumer, which re-raises it
            while not stop.is_set():
                try:
                    q.put((pos, e), timeout=_POLL_S)
                    return
                except queue.Full:
                    continue

    def _start(self) -> None:
        self._stop = threading.Event()
        self._queue = queue.Queue(maxsize=self.prefetch)
        self._thread = threading.Thread(
            target=self._produce,
            args=(self.samples_consumed, self._queue, self._stop),
            name=f"lmforge-prefetch-rank{self.dp_rank}",
            daemon=True,
        )
        self._thread.start()

    def _stop_thread(self) -> None:
        if self._thread is None:
            return
        self._stop.set()
        self._thread.join()
        self._thread = None
        self._queue = None

    # -- public API --------------------------------------------------------------------------

    def next_step(self) -> list[Batch]:
        """This rank's ``grad_accum_steps`` microbatches for the next optimizer step."""
        if self.prefetch == 0:
            batches = self._build_step(self.samples_consumed)
        else:
            if self._thread is None:
                self._start()
            assert self._queue is not None
            pos, payload = self._queue.get()
            if isinstance(payload, BaseException):
                self._stop_thread()
                raise payload
            assert pos == self.samples_consumed, "prefetch thread out of sync"
            batches = payload
        self.samples_consumed += self.global_batch_size
        if self.device.type != "cpu":
            batches = [b.to(self.device, non_blocking=True) for b in batches]
        return batches

    def state_dict(self) -> dict:
        return {"samples_consumed": self.samples_consumed, "seed": self._seed}

    def load_state_dict(self, state: dict) -> None:
        """Continue from a saved position; any prefetched steps are discarded."""
        self._stop_thread()
        self.samples_consumed = int(state["samples_consumed"])
        self._seed = int(state.get("seed", self._seed))
        self._order = _GlobalOrder(len(self.dataset), self._seed, self.shuffle)

    def close(self) -> None:
        self._stop_thread()

    def __enter__(self) -> "StepLoader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:  # best effort; daemon threads die with the process anyway
        try:
            self._stop.set()
        except Exception:
            pass


def eval_batches(
    dataset: SampleDataset,
    batch_size: int,
    num_batches: int | None,
    dp_rank: int,
    dp_world_size: int,
) -> Iterator[Batch]:
    """The first ``num_batches`` global batches of ``dataset`` in order, sliced for this rank.

    Every call starts from the beginning, so evaluations at different steps (and at different
    world sizes) score exactly the same samples. ``num_batches`` is capped at the number of
    full batches available; ``None`` means all of them.
    """
    W = dp_world_size
    if batch_size < 1 or batch_size % W != 0:
        raise UserError(
            f"eval batch size ({batch_size}) must be a positive multiple of the data-parallel "
            f"world size ({W})"
        )
    available = len(dataset) // batch_size
    if available == 0:
        raise UserError(
            f"validation set has {len(dataset)} samples, fewer than one eval batch of {batch_size}"
        )
    n = available if num_batches is None else min(int(num_batches), available)
    per_rank = batch_size // W

    # Checks above run at call time; only the batches themselves are produced lazily.
    def batches() -> Iterator[Batch]:
        for k in range(n):
            lo = k * batch_size + dp_rank * per_rank
            yield collate([dataset[i] for i in range(lo, lo + per_rank)])

    return batches()
