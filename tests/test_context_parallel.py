"""Context parallelism: the shard order and its refusals here; exactness against one process under torchrun."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lmforge.data.packing import Batch
from lmforge.errors import UserError
from lmforge.parallel.context_parallel import check_cp, shard_batch, unshard_tokens

from _helpers import REPO, cli_env


def test_check_cp_names_both_keys() -> None:
    check_cp(16, 4)
    with pytest.raises(UserError, match=r"data\.seq_len=12 .*2 x parallel\.cp = 8") as err:
        check_cp(12, 4)
    assert "\n" not in str(err.value)
    with pytest.raises(UserError, match=r"parallel\.cp=0"):
        check_cp(16, 0)
    with pytest.raises(UserError, match=r"data\.seq_len=6"):
        shard_batch(Batch(torch.zeros(1, 6, dtype=torch.long), torch.zeros(1, 6, dtype=torch.long)), 0, 2)


def test_shard_batch_order_and_reassembly() -> None:
    B, T, cp = 2, 12, 3
    ids = torch.arange(B * T).view(B, T)
    batch = Batch(ids, ids + 100, document_lengths=[[T], [5, 7]], document_values=[[1.0], [2.0, 3.0]])
    shards = [shard_batch(batch, r, cp) for r in range(cp)]
    # 6 chunks of 2: rank r keeps chunks r and 5 - r
    assert shards[0].input_ids[0].tolist() == [0, 1, 10, 11]
    assert shards[1].input_ids[1].tolist() == [14, 15, 20, 21]
    assert shards[2].position_ids.tolist() == [[4, 5, 6, 7]] * B  # global positions for RoPE
    for s in shards:
        assert s.document_ids.tolist() == [[0] * 4] * B
        assert s.document_lengths is batch.document_lengths and s.document_values is batch.document_values
    assert torch.equal(unshard_tokens([s.input_ids for s in shards]), ids)
    assert torch.equal(unshard_tokens([s.labels for s in shards]), ids + 100)
    assert torch.equal(unshard_tokens([s.position_ids for s in shards]), torch.arange(T).expand(B, T))
    # explicit ids and positions are split the same way, and cp=1 is the identity
    packed = Batch(ids, ids, position_ids=ids % 5, document_ids=ids // 5)
    halves = [shard_batch(packed, r, 2) for r in range(2)]
    assert torch.equal(unshard_tokens([h.document_ids for h in halves]), ids // 5)
    assert torch.equal(unshard_tokens([h.position_ids for h in halves]), ids % 5)
    assert torch.equal(shard_batch(packed, 0, 1).input_ids, ids)


def test_context_parallel_matches_one_process(tmp_path: Path) -> None:
    """Packed, causal and sliding-window models on cp=2, and FSDP2 over dp_shard=2 x cp=2: losses,
    hidden states and every gradient equal one process's (see _cp_check.py)."""
    out = tmp_path / "errors.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=4",
           str(Path(__file__).with_name("_cp_check.py")), str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=cli_env(), cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    errors = json.loads(out.read_text())
    for case in ("packed", "causal", "sliding_packed", "sliding_causal", "blocks3_matmul"):
        for what in ("loss", "hidden", "grad"):
            assert errors[f"{case}.{what}"] < 1e-5
    assert errors["fsdp_dp_shard_cp.grad"] < 1e-5
