"""Fixtures shared by several test modules; plain helpers are in _helpers.py.

The session-scoped ones are real CLI runs, made once however many modules read them.
"""

from __future__ import annotations

import atexit
import os
import random
import shutil
import tempfile
from pathlib import Path

import numpy as np
import pytest
import torch

from _helpers import (Reference, grad_norms, losses, lmforge_cmd, lmforge_in_process, run_in_terminal, small_corpus,
                      tiny_run_args, write_corpus, write_fault_runner)

# Raw data files of test runs are prepared into token shards in a cache: one per test session, not the
# user's ~/.cache (every CLI run inherits this environment).
if "LMFORGE_CACHE" not in os.environ:
    os.environ["LMFORGE_CACHE"] = tempfile.mkdtemp(prefix="lmforge-test-cache-")
    atexit.register(shutil.rmtree, os.environ["LMFORGE_CACHE"], ignore_errors=True)

_DIST_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


class _ProcessState:
    """What an in-process run (``lmforge.cli.main``, a trainer's ``run``) changes in this process for
    every later test: torch's intra-op thread count (``training.threads``), the global RNG states of
    torch, numpy and ``random`` (``torch.manual_seed``, a resume restoring saved RNG states) and the
    process-group environment variables. Taken once, when the test session starts; :meth:`restore`
    puts it back after every test, so each test starts from the same state whatever ran before it
    (a module or session fixture's in-process run included).

    It runs after every test, so it must cost microseconds: the torch and ``random`` states are set
    back unconditionally (one copy each); numpy's legacy global RandomState is compared through its
    MT19937 state's raw bytes (about a microsecond) and set back only when they differ (a
    ``np.random.set_state`` costs tens of microseconds)."""

    def __init__(self) -> None:
        self.threads = torch.get_num_threads()
        self.torch_rng = torch.get_rng_state()
        self.numpy_rng = np.random.get_state()
        self.python_rng = random.getstate()
        self.env = {k: os.environ.get(k) for k in _DIST_ENV}
        self._numpy_raw = self._numpy_state_bytes
        try:  # numpy's global MT19937 in place: its 624 uint32 key and its position
            import ctypes

            address = np.random.mtrand._rand._bit_generator.ctypes.state_address
            self._numpy_raw = lambda: ctypes.string_at(address, 624 * 4 + 4)
        except (AttributeError, TypeError):  # another numpy layout: compare the whole state instead
            pass
        self.numpy_raw = self._numpy_raw()

    @staticmethod
    def _numpy_state_bytes() -> tuple:
        state = np.random.get_state()
        return state[0], state[1].tobytes(), *state[2:]

    def restore(self) -> None:
        if torch.get_num_threads() != self.threads:
            torch.set_num_threads(self.threads)
        torch.set_rng_state(self.torch_rng)
        if self._numpy_raw() != self.numpy_raw:
            np.random.set_state(self.numpy_rng)
        random.setstate(self.python_rng)
        for k, v in self.env.items():
            if v is None:
                os.environ.pop(k, None)
            elif os.environ.get(k) != v:
                os.environ[k] = v


_PROCESS_STATE = _ProcessState()


@pytest.fixture(autouse=True)
def _restore_process_state():
    """After every test, the process state of :class:`_ProcessState` as the session started."""
    yield
    _PROCESS_STATE.restore()


@pytest.fixture(scope="session")
def corpus(tmp_path_factory) -> Path:
    """The small text file the distributed and elastic runs train on."""
    return write_corpus(tmp_path_factory.mktemp("corpus") / "corpus.txt")


@pytest.fixture(scope="session")
def reference_curve_run(tmp_path_factory, corpus) -> Path:
    """One process, the whole global batch in one microbatch, no interruption: the run whose losses and
    gradient norms the distributed and elastic runs must reproduce. Through the CLI's entry point in this
    process: a subprocess would only add its imports."""
    run = tmp_path_factory.mktemp("reference_losses") / "run"
    assert lmforge_in_process("pretrain", *tiny_run_args(corpus, training_micro_batch_size=8), f"--run.dir={run}") == 0
    return run


@pytest.fixture(scope="session")
def reference_losses(reference_curve_run) -> dict[int, float]:
    """Loss per step of the reference run."""
    return losses(reference_curve_run)


@pytest.fixture(scope="session")
def reference_grad_norms(reference_curve_run) -> dict[int, float]:
    """Pre-clip gradient norm per step of the reference run (losses alone miss a gradient scaled on
    the way: AdamW's update and clipping hide the scale, so the loss curve barely moves)."""
    return grad_norms(reference_curve_run)


@pytest.fixture(scope="session")
def fault_runner(tmp_path_factory) -> Path:
    """The script that runs the CLI with LMFORGE_TEST_FAULT injected (see _helpers.FAULT_RUNNER)."""
    return write_fault_runner(tmp_path_factory.mktemp("fault_runner"))


@pytest.fixture(scope="session")
def reference_run(tmp_path_factory, fault_runner) -> Reference:
    """A finished RELIABLE_RUN with checkpoints at steps 10 and 12 (the reliability tests compare
    crashed runs with it; the bad-input tests start from copies of it). Started at once: other work
    overlaps it until a test asks for its ``path()``."""
    return Reference(tmp_path_factory.mktemp("reference"), fault_runner)


@pytest.fixture(scope="session")
def observed_run(tmp_path_factory) -> tuple[Path, float, float, str]:
    """(run_dir, launch time, exit time, terminal output) of a 12-step CLI pretraining with eval and
    checkpoints, its stdout on a pseudo-terminal (so the progress bar is on); read by the
    observability and report tests."""
    base = tmp_path_factory.mktemp("observed")
    run_dir = base / "run"
    args = tiny_run_args(training_global_batch_size=4, training_micro_batch_size=4, training_steps=12,
                         metrics_log_every=4, metrics_progress=None, eval_interval=6, eval_steps=2,
                         eval_batch_size=4, checkpoint_interval=6, schedule_warmup_steps=None, **small_corpus(base))
    launched, exited, out = run_in_terminal(lmforge_cmd("pretrain", *args, f"--run.dir={run_dir}"))
    return run_dir, launched, exited, out
