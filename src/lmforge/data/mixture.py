"""Several packed datasets mixed by weight, as a pure function of the global sample index.

The global sample order is cut into blocks of ``BLOCK`` samples. Every block gives each source the
same quota (its weight's share of the block, largest remainders rounded up) at the same slots, spread
evenly by smooth weighted round-robin. So sample ``i`` is block ``i // BLOCK``, slot ``i % BLOCK``: the
slot names the source, and the source's own running sample number is ``block * quota + (the slot's
rank among that source's slots)``. No iterator state exists: a resumed run (at any world size) asks
for the same indices and gets the same samples, and any ``BLOCK`` consecutive samples match the
weights to within one sample per source.

A source is read in passes: pass ``p`` visits all its samples once, in a permutation seeded by
``(seed, source, p)`` when shuffling (in order otherwise). A small source with a large weight is thus
repeated, in a new order each time; a large one with a small weight is not seen whole in one epoch.
The mixture orders itself, so the step loader does not permute it again (``orders_itself``).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from lmforge.data.packing import Sample, SampleDataset
from lmforge.errors import UserError

__all__ = ["MixtureDataset", "BLOCK"]

BLOCK = 4096


def block_quotas(weights: Sequence[float], block: int) -> list[int]:
    """Each source's slots per block: its share of ``block``, largest remainders first, at least 1."""
    total = float(sum(weights))
    exact = [block * w / total for w in weights]
    quotas = [max(1, int(x)) for x in exact]
    order = sorted(range(len(weights)), key=lambda k: exact[k] - int(exact[k]), reverse=True)
    for k in order[: block - sum(quotas)]:
        quotas[k] += 1
    return quotas


def _slots(quotas: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """(source of each slot, rank of the slot among its source's slots), evenly interleaved."""
    block = sum(quotas)
    current = [0] * len(quotas)
    source = np.empty(block, np.int64)
    rank = np.empty(block, np.int64)
    seen = [0] * len(quotas)
    for s in range(block):
        current = [c + q for c, q in zip(current, quotas)]
        k = max(range(len(quotas)), key=lambda j: current[j])
        current[k] -= block
        source[s], rank[s] = k, seen[k]
        seen[k] += 1
    return source, rank


class MixtureDataset:
    """Samples of ``datasets`` in the proportions of ``weights`` (see the module docstring)."""

    orders_itself = True

    def __init__(self, datasets: Sequence[SampleDataset], weights: Sequence[float], seed: int = 0,
                 shuffle: bool = True, block: int = BLOCK) -> None:
        if len(datasets) != len(weights) or not datasets:
            raise ValueError("one weight per dataset, at least one dataset")
        if any(not w > 0 for w in weights):
            raise UserError(f"data.sources: every weight must be positive, got {list(weights)}")
        self.datasets, self.seed, self.shuffle = list(datasets), int(seed), shuffle
        self.weights = [float(w) for w in weights]
        self.quotas = block_quotas(self.weights, max(block, len(datasets)))
        self.block = sum(self.quotas)
        self._source, self._rank = _slots(self.quotas)
        self._perms: dict[tuple[int, int], np.ndarray] = {}

    def __len__(self) -> int:
        """Nominal epoch: as many samples as all sources hold (the index may run past it)."""
        return sum(len(d) for d in self.datasets)

    def locate(self, i: int) -> tuple[int, int]:
        """(source, that source's sample index) of global sample ``i``."""
        b, s = divmod(int(i), self.block)
        k = int(self._source[s])
        n = b * self.quotas[k] + int(self._rank[s])
        size = len(self.datasets[k])
        p, j = divmod(n, size)
        return k, (int(self._perm(k, p, size)[j]) if self.shuffle else j)

    def _perm(self, k: int, p: int, size: int) -> np.ndarray:
        perm = self._perms.get((k, p))
        if perm is None:
            if len(self._perms) >= 2 * len(self.datasets):  # two passes per source at most: flat memory
                self._perms.pop(next(iter(self._perms)))
            perm = np.random.default_rng([self.seed, k, p]).permutation(size)
            self._perms[(k, p)] = perm
        return perm

    def __getitem__(self, i: int) -> Sample:
        k, j = self.locate(i)
        return self.datasets[k][j]
