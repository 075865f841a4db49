"""Tensor (+ sequence) parallelism: the layout checks in process, and two torchrun launches (gloo, CPU) of
tests/_tp_check.py that compare logits, losses, hits and every gradient with the one-process model."""

import subprocess
import sys
from pathlib import Path

import pytest

from lmforge.errors import UserError
from lmforge.models.args import ModelArgs
from lmforge.parallel.tensor_parallel import check_tp

from _helpers import cli_env

SCRIPT = Path(__file__).with_name("_tp_check.py")
SMALL = dict(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=64, ffn_hidden_dim=64)


@pytest.mark.parametrize("change, tp, field", [
    ({}, 3, "n_heads=4"),
    ({"n_heads": 8}, 4, "n_kv_heads=2"),
    ({"vocab_size": 65}, 2, "vocab_size=65"),
    ({"ffn_hidden_dim": 66, "n_kv_heads": 4}, 4, "ffn_hidden_dim=66"),
    ({"qk_norm": True, "qk_norm_per_head": False}, 2, "qk_norm_per_head=False"),
])
def test_check_tp_refuses_uneven_layouts(change, tp, field):
    with pytest.raises(UserError, match=f"parallel.tp={tp}: .*{field}"):
        check_tp(ModelArgs(**(SMALL | change)), tp)


def test_check_tp_accepts_even_layouts():
    check_tp(ModelArgs(**SMALL), 2)
    check_tp(ModelArgs(**(SMALL | {"n_heads": 4, "n_kv_heads": 4})), 4)
    # experts stay whole under tensor parallelism: an all-MoE model's ffn size need not divide
    check_tp(ModelArgs(**(SMALL | {"ffn_hidden_dim": 66, "n_experts": 4, "n_experts_per_token": 2})), 2)
    check_tp(ModelArgs(**(SMALL | {"vocab_size": 65})), 1)


def _launch(mode: str, nproc: int) -> str:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           "--monitor-interval=0.2", str(SCRIPT), mode]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=cli_env())
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-6000:]
    return proc.stdout


def test_tp2_equals_one_process():
    """The vocabulary-parallel loss kernel against full logits; then tp=2, with and without sequence parallelism: dense GQA with q/k/v bias, Qwen3-like per-head q/k norm
    (tied), Gemma-like sandwich norms (tied), a mixture of experts; packed batch."""
    out = _launch("tp", 2)
    assert out.count("OK vocab-parallel kernel") == 1, out
    assert out.count("OK tp=2") == 8, out


def test_fsdp_over_tp_equals_one_process():
    """dp_shard=2 x tp=2: FSDP2 over the tensor-parallel model, 2 microbatches per data rank."""
    out = _launch("2d", 4)
    assert out.count("OK dp_shard=2 x tp=2") == 2, out
