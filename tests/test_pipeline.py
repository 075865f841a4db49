"""Pipeline parallelism: the stage split, its checks, stages chained in one process, and (under torchrun)
every schedule's loss and gradients against one process, alone and with FSDP2 on the stages."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lmforge.errors import UserError
from lmforge.models.model import ModelArgs, Transformer
from lmforge.parallel.pipeline import check_pp, split_layers, split_model, stage_ids

from _helpers import cli_env

ARGS = ModelArgs(dim=32, n_layers=5, n_heads=4, n_kv_heads=2, vocab_size=64, max_seq_len=32)


def test_split_layers_contiguous_even_and_looped_order():
    assert split_layers(5, 2) == [range(0, 3), range(3, 5)]
    assert split_layers(8, 2, 2) == [range(0, 2), range(2, 4), range(4, 6), range(6, 8)]
    assert split_layers(4, 4) == [range(i, i + 1) for i in range(4)]
    assert stage_ids(1, 2, 2) == [1, 3] and stage_ids(0, 4) == [0]


@pytest.mark.parametrize("kwargs, words", [
    ({"pp": 2, "stages_per_rank": 3, "schedule": "interleaved_1f1b"}, ("parallel.pp=2", "model.n_layers is 5")),
    ({"pp": 2, "microbatches": 1}, ("parallel.pp=2", "training.micro_batch_size", "is 1")),
    ({"pp": 2, "stages_per_rank": 2, "microbatches": 5, "schedule": "interleaved_1f1b"},
     ("parallel.pp=2", "not a multiple of 2", "training.micro_batch_size")),
    ({"pp": 2, "stages_per_rank": 2}, ("parallel.pp_schedule='1f1b'", "interleaved_1f1b")),
    ({"pp": 2, "schedule": "zero_bubble"}, ("parallel.pp_schedule='zero_bubble'",)),
])
def test_check_pp_one_line_errors(kwargs, words):
    with pytest.raises(UserError) as e:
        check_pp(ARGS, **kwargs)
    assert all(w in str(e.value) for w in words) and "\n" not in str(e.value), str(e.value)


def test_check_pp_refuses_tied_embeddings_and_experts_and_accepts_the_rest():
    tied = ModelArgs(**{**vars(ARGS), "tie_embeddings": True})
    moe = ModelArgs(**{**vars(ARGS), "n_experts": 4, "n_experts_per_token": 2})
    for args, field in ((tied, "model.tie_embeddings"), (moe, "model.n_experts")):
        with pytest.raises(UserError, match=field):
            check_pp(args, 2, microbatches=4)
    check_pp(ARGS, 2, microbatches=2)
    check_pp(ARGS, 2, 2, microbatches=4, schedule="interleaved_1f1b")
    check_pp(ARGS, 4, microbatches=1, schedule="gpipe")
    check_pp(tied, 1)  # no pipeline: nothing to refuse


def test_stages_chained_in_one_process_equal_the_model():
    """Three stages on one 'rank' (pp=1, 3 stages) run one after another give the whole model's logits and
    gradients, and their state dicts use its names: the model's forward skips absent pieces exactly."""
    torch.manual_seed(0)
    model = Transformer(ARGS)
    model.init_weights(seed=0)
    tokens = torch.randint(0, 64, (2, 9))
    want = model(tokens)
    want.square().sum().backward()
    want_grads = {k: p.grad.clone() for k, p in model.named_parameters()}
    model.zero_grad()
    parts = split_model(model, 0, 1, 3)
    assert [p.tok_embeddings is not None for p in parts] == [True, False, False]
    assert [p.output is not None for p in parts] == [False, False, True]
    assert [[i for i, b in enumerate(p.layers) if b is not None] for p in parts] == [[0, 1], [2, 3], [4]]
    h = tokens
    for part in parts:
        h = part(h)
    torch.testing.assert_close(h, want, rtol=0, atol=0)
    h.square().sum().backward()
    got = {k: p.grad for part in parts for k, p in part.named_parameters()}
    assert got.keys() == want_grads.keys()
    for k in got:
        torch.testing.assert_close(got[k], want_grads[k], rtol=0, atol=0)
    assert sorted(k for p in parts for k in p.state_dict()) == sorted(model.state_dict())


def _assert_matches(results: dict, prefix: str, n_params: int) -> None:
    assert results[f"{prefix}/params"] == n_params, results  # every parameter was compared, on every data rank
    for key in ("grad", "loss_sum", "target_tokens", "correct"):
        assert results[f"{prefix}/{key}"] < 1e-5, (key, results)


def test_pipeline_matches_one_process(tmp_path):
    """4 ranks, mesh pp=2 x dp_shard=2 (tests/_pp_check.py). Each pp pair alone: 1F1B (its normalizer
    all-reduced over every rank, scaled by the world), GPipe and interleaved 1F1B (2 stages per rank)
    over 4 packed microbatches; another shape, also under bf16 autocast; eval; the gradient norm. Then
    FSDP2 per stage over dp_shard, each data rank half the batch. Losses and every gradient against one
    process."""
    out = tmp_path / "pp.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=4",
           str(Path(__file__).with_name("_pp_check.py")), str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=cli_env())
    assert proc.returncode == 0, proc.stderr[-4000:]
    r = json.loads(out.read_text())
    n_params = 2 * len(list(Transformer(ModelArgs(dim=32, n_layers=4, vocab_size=64)).parameters()))
    for prefix in ("1f1b", "gpipe", "interleaved_1f1b", "fsdp"):
        _assert_matches(r, prefix, n_params)
    assert all(r[f"{s}/stats_keys_match"] == 1.0 for s in ("1f1b", "gpipe", "interleaved_1f1b"))
    for prefix in ("1f1b_reshaped", "1f1b_bf16"):  # a step of another shape; one under bf16 autocast
        assert r[f"{prefix}/grad"] < 1e-5 and r[f"{prefix}/params"] == n_params, r
    assert max(r["eval/loss_sum"], r["eval/target_tokens"], r["eval/correct"]) < 1e-5
    assert r["state_dict_cover"] == 1.0
    assert max(r["1f1b/grad_norm"], r["fsdp/grad_norm"], r["fsdp/clip"]) < 1e-5
    assert r["fsdp/clip_returns_preclip"] == 0.0
