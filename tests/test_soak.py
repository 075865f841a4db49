"""A short soak (bench/soak.py): a pretraining job SIGKILLed, preempted with SIGTERM and starved of
disk at seeded random moments, restarted until it ends, then compared bit for bit (every step's loss
and grad norm, every tensor of the final checkpoint) with the same job run without interruption.

Marked slow (a few minutes on 2 CPUs): ``make test`` skips it; run it with
``pytest -m slow tests/test_soak.py``.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))


@pytest.mark.slow
def test_faulted_rounds_match_the_uninterrupted_run(tmp_path):
    import soak

    rounds, _, _ = soak.soak(tmp_path / "soak", minutes=0, rounds=2, steps=30, nprocs=[1, 2], seed=3, max_delay=4)
    for r in rounds:
        assert r.result.startswith("identical"), r.result
        assert not [a.outcome for a in r.attempts if a.outcome.startswith("UNEXPECTED")]
        assert len(r.attempts) >= 2 and any(a.injected for a in r.attempts)  # at least one fault, one restart
