"""Expert parallelism: the configurations it refuses, and (under torchrun, 4 gloo ranks) EP against
one process: outputs, router statistics, every gradient, the clipped norm (_ep_check.py)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from lmforge.errors import UserError
from lmforge.models.model import ModelArgs
from lmforge.parallel.expert_parallel import check_ep

from _helpers import REPO, cli_env

MOE = ModelArgs(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=64, n_experts=4, n_experts_per_token=2)


@pytest.mark.parametrize("args, ep, dp_shard, needle", [
    (ModelArgs(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=64), 2, 2, "no mixture-of-experts layers"),
    (MOE, 3, 3, "n_experts=4 is not divisible by ep"),
    (MOE, 2, 3, "must divide parallel.dp_shard=3"),
])
def test_check_ep_refuses_with_one_line(args, ep, dp_shard, needle):
    with pytest.raises(UserError) as err:
        check_ep(args, ep, dp_shard)
    message = str(err.value)
    assert message.startswith(f"parallel.ep={ep}") and needle in message and "\n" not in message


def test_check_ep_accepts():
    check_ep(MOE, 2, 4)
    check_ep(MOE, 4, 4)
    check_ep(ModelArgs(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=64), 1, 2)  # no EP: nothing to check


def test_expert_parallel_equals_one_process():
    """4 gloo ranks: ep=2 on each pair of ranks (mesh dp_shard_mod_ep=1 x ep=2), then dp_shard=4 as
    dp_shard_mod_ep=2 x ep=2 with activation checkpointing; FSDP2 on the rest of the model in both."""
    script = Path(__file__).with_name("_ep_check.py")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=4",
           "--monitor-interval=0.2", str(script)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, cwd=REPO, env=cli_env())
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "ep check passed on 4 ranks" in proc.stdout
