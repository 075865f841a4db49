"""generate(): equality with transformers' greedy search, KV cache consistency, EOS, sampling,
the fused decode step, length buckets, repeated prompts, and lockstep over two ranks."""

from __future__ import annotations

import pytest
import torch

from lmforge.errors import UserError
from lmforge.models.generate import generate, length_buckets
from lmforge.models.layers.kv_cache import KVCache
from lmforge.models.hf import hf_state_dict_from_lmforge
from lmforge.models.model import ModelArgs, Transformer

transformers = pytest.importorskip("transformers")

PAD = 0


@pytest.fixture(scope="module")
def model() -> Transformer:
    m = Transformer(ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=101, max_seq_len=128))
    m.init_weights(seed=0)
    # Larger weights than the 0.02 init give peaked, input-dependent logits, so greedy
    # paths are not decided by float noise and differ between prompts.
    with torch.no_grad():
        for p in m.parameters():
            if p.dim() == 2:
                p.mul_(4.0)
    return m


def prompts_for(seed: int, n: int, lengths: list[int]) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, 101, (lengths[i % len(lengths)],), generator=g).tolist() for i in range(n)]


def hf_greedy(model: Transformer, prompts: list[list[int]], n: int, eos: int | list[int] | None) -> list[list[int]]:
    a = model.args
    cfg = transformers.LlamaConfig(
        hidden_size=a.dim, num_hidden_layers=a.n_layers, num_attention_heads=a.n_heads,
        num_key_value_heads=a.kv_heads, intermediate_size=a.ffn_dim, vocab_size=a.vocab_size,
        rms_norm_eps=a.norm_eps, rope_theta=a.rope_theta, max_position_embeddings=a.max_seq_len,
        tie_word_embeddings=a.tie_embeddings, pad_token_id=PAD, bos_token_id=None, eos_token_id=eos,
    )
    hf = transformers.LlamaForCausalLM(cfg).eval()
    hf.load_state_dict(hf_state_dict_from_lmforge(model.state_dict(), a))
    P = max(map(len, prompts))
    ids = torch.tensor([[PAD] * (P - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (P - len(p)) + [1] * len(p) for p in prompts])
    out = hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=0, do_sample=False,
                      eos_token_id=eos, pad_token_id=PAD)
    rows = out[:, P:].tolist()
    stops = [eos] if isinstance(eos, int) else eos or []
    ends = [next((i for i, t in enumerate(r) if t in stops), None) for r in rows]
    return [r[: e + 1] if e is not None else r for r, e in zip(rows, ends)]


def test_greedy_matches_transformers_batched_ragged(model):
    prompts = prompts_for(0, 5, [3, 9, 1, 14, 6])
    ours = generate(model, prompts, 12, stop_ids=None, pad_id=PAD, temperature=0.0)
    assert [len(r) for r in ours] == [12] * 5
    assert ours == hf_greedy(model, prompts, 12, eos=None)
    # Padding is invisible: each prompt alone gives the same continuation.
    for p, row in zip(prompts, ours):
        assert generate(model, [p], 12, stop_ids=None, pad_id=PAD, temperature=0.0) == [row]


def test_eos_stops_rows(model):
    prompts = prompts_for(1, 4, [2, 7, 5, 4])
    free = generate(model, prompts, 10, stop_ids=None, pad_id=PAD, temperature=0.0)
    eos = free[0][3]  # row 0 emits this at step 4 (maybe earlier); other rows may too
    ours = generate(model, prompts, 10, stop_ids=eos, pad_id=PAD, temperature=0.0)
    for f, o in zip(free, ours):
        expect = f[: f.index(eos) + 1] if eos in f else f
        assert o == expect
    assert len(ours[0]) <= 4 and ours[0][-1] == eos
    assert ours == hf_greedy(model, prompts, 10, eos=eos)


def test_any_of_several_stop_ids_stops_a_row(model):
    """Rows stop at whichever stop id comes first, as transformers does with a list of eos_token_id."""
    prompts = prompts_for(1, 4, [2, 7, 5, 4])
    free = generate(model, prompts, 10, stop_ids=None, pad_id=PAD, temperature=0.0)
    stops = [free[0][5], free[1][2]]
    ours = generate(model, prompts, 10, stop_ids=stops, pad_id=PAD, temperature=0.0)
    assert len(ours[0]) <= 6 and len(ours[1]) <= 3 and ours[0][-1] in stops and ours[1][-1] in stops
    assert ours == hf_greedy(model, prompts, 10, eos=stops)
    # One id (the eos_id spelling too) is the same as a list of one.
    assert generate(model, prompts, 10, stop_ids=stops[0], pad_id=PAD, temperature=0.0) == generate(
        model, prompts, 10, eos_id=stops[0], pad_id=PAD, temperature=0.0)


def test_all_rows_finish_early(model):
    prompts = prompts_for(2, 3, [4])
    first = generate(model, prompts, 1, stop_ids=None, pad_id=PAD, temperature=0.0)
    eos_rows = [p for p, f in zip(prompts, first) if f[0] == first[0][0]]
    out = generate(model, eos_rows, 50, stop_ids=[first[0][0]], pad_id=PAD, temperature=0.0)
    assert out == [[first[0][0]]] * len(eos_rows)


def test_kv_cache_equals_full_recompute(model):
    prompts = prompts_for(3, 3, [5, 11, 8])
    ours = generate(model, prompts, 8, stop_ids=None, pad_id=PAD, temperature=0.0)
    # Greedy decoding by re-running the whole (unpadded) sequence every step.
    with torch.no_grad():
        for p, row in zip(prompts, ours):
            seq = list(p)
            for _ in range(8):
                seq.append(int(model(torch.tensor([seq]))[0, -1].argmax()))
            assert seq[len(p):] == row

    # Cache logits themselves equal full-sequence logits, chunked prefill included.
    seq = torch.tensor([prompts[1]])
    with torch.no_grad():
        full = model(seq)
        cache = KVCache.for_model(model, 1, 16)
        parts = [model(seq[:, :4], kv_cache=cache), model(seq[:, 4:7], kv_cache=cache)]
        parts += [model(seq[:, i:i + 1], kv_cache=cache) for i in range(7, 11)]
    torch.testing.assert_close(torch.cat(parts, dim=1), full, atol=1e-5, rtol=1e-4)


def test_sampling_reproducible(model):
    prompts = prompts_for(4, 6, [3, 8])
    kw = dict(stop_ids=None, pad_id=PAD, temperature=0.8, top_p=0.9)
    a = generate(model, prompts, 10, generator=torch.Generator().manual_seed(7), **kw)
    b = generate(model, prompts, 10, generator=torch.Generator().manual_seed(7), **kw)
    c = generate(model, prompts, 10, generator=torch.Generator().manual_seed(8), **kw)
    assert a == b and a != c
    # Tiny nucleus = greedy; huge temperature with top_p=1 is far from greedy.
    greedy = generate(model, prompts, 10, stop_ids=None, pad_id=PAD, temperature=0.0)
    assert generate(model, prompts, 10, stop_ids=None, pad_id=PAD, temperature=1.0, top_p=1e-6,
                    generator=torch.Generator().manual_seed(1)) == greedy
    hot = generate(model, prompts, 10, stop_ids=None, pad_id=PAD, temperature=50.0,
                   generator=torch.Generator().manual_seed(1))
    assert hot != greedy


def test_restores_training_mode_and_validates(model):
    model.train()
    generate(model, [[1, 2]], 2, stop_ids=None, pad_id=PAD, temperature=0.0)
    assert model.training
    model.eval()
    assert generate(model, [[1]], 0, stop_ids=None, pad_id=PAD) == [[]]
    with pytest.raises(UserError, match="max_seq_len"):
        generate(model, [[1] * 100], 50, stop_ids=None, pad_id=PAD)
    with pytest.raises(UserError):
        generate(model, [[]], 5, stop_ids=None, pad_id=PAD)


def forced(token: int, vocab_size: int = 101) -> Transformer:
    """A tiny model that always emits ``token`` (a large bias on its logit)."""
    m = Transformer(ModelArgs(dim=16, n_layers=1, n_heads=2, n_kv_heads=1, vocab_size=vocab_size, max_seq_len=64))
    m.init_weights(seed=0)
    bias = torch.zeros(vocab_size)
    bias[token] = 1e4
    m.output.register_forward_hook(lambda _m, _i, out: out + bias)
    return m


def test_rollout_truncation_uses_every_stop_id_and_warns_once():
    from contextlib import nullcontext

    from lmforge.rl.rewards import WeightedReward
    from lmforge.rl.rollout import AllTruncatedWarning, RolloutSettings, collect_rollout

    s = RolloutSettings(num_generations=2, max_new_tokens=5, temperature=1.0, top_p=1.0, micro_batch_size=4,
                        advantage_scale="group", mask_truncated=True, need_old_logprobs=False)
    reward = [WeightedReward("len", lambda prompts, completions, **kw: [float(len(c)) for c in completions], 1.0)]

    def rollout(policy):
        return collect_rollout(policy, [{"prompt": "a"}, {"prompt": "b"}], [[1, 2], [3]], reward, s,
                               stop_ids=[7, 9], pad_id=PAD, decode=str, seed=0,
                               reference=None, autocast=nullcontext())

    # The second stop id ends every completion: nothing is truncated and every completion is in the loss.
    stopped = rollout(forced(9))
    assert stopped.metrics["completion/truncated"] == 0.0 and stopped.metrics["completion/mean_length"] == 1.0
    assert all(bool(b.mask.sum(dim=1).gt(0).all()) for b in stopped.batches)
    warn = AllTruncatedWarning(["<|im_end|>", "<|endoftext|>"], 5, mask_truncated=True)
    assert warn.check(stopped.metrics) is None
    # No stop id emitted: all truncated (masked out), and one warning line naming the stop tokens, only once.
    cut = rollout(forced(4))
    assert cut.metrics["completion/truncated"] == 1.0 and all(float(b.mask.sum()) == 0 for b in cut.batches)
    line = warn.check(cut.metrics)
    assert line and "\n" not in line and "<|im_end|>, <|endoftext|>" in line and "max_new_tokens=5" in line
    assert warn.check(cut.metrics) is None


def test_lockstep_ranks_run_the_same_number_of_forwards(tmp_path):
    """Real torchrun, 2 gloo ranks whose rows finish at different steps: with lockstep both ranks
    run as many decode steps as the slower one, and every output equals lockstep=False."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    from _helpers import cli_env

    script = Path(__file__).with_name("_generate_lockstep.py")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", str(script),
           str(tmp_path)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=180, env=cli_env())
    assert proc.returncode == 0, proc.stderr[-3000:]
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    for r in (r0, r1):
        assert r["greedy_True"] == r["greedy_False"] and r["sampled_True"] == r["sampled_False"]
    assert all(len(row) <= 2 for row in r0["greedy_False"])  # rank 0 stops within two tokens
    assert r0["steps_False"] <= 1 < r1["steps_False"]        # and so runs fewer decode steps alone
    assert r0["steps_True"] == r1["steps_True"] >= r1["steps_False"]


@pytest.mark.parametrize("window", [None, 6])
def test_fixed_shape_step_equals_the_default_step(model, monkeypatch, window):
    """compile=True's step (static cache length, device-tensor slot, full-length masked attention),
    run here uncompiled: same tokens as the default step, with padding and a sliding window."""
    import lmforge.models.generate as gen
    from lmforge.models.decode_step import decode_step_static

    m = model
    if window is not None:
        m = Transformer(ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=101, max_seq_len=128,
                                  sliding_window=window))
        m.load_state_dict(model.state_dict())
    monkeypatch.setattr(gen, "_compiled_step", lambda device_type: decode_step_static)
    prompts = prompts_for(5, 5, [3, 9, 1, 14, 6])
    want = generate(m, prompts, 12, stop_ids=None, pad_id=PAD, temperature=0.0)
    assert generate(m, prompts, 12, stop_ids=None, pad_id=PAD, temperature=0.0, compile=True) == want
    assert generate(m, prompts[:2], 12, stop_ids=None, pad_id=PAD, temperature=0.0, compile=True) == want[:2]


def _bucket_cost(groups, lengths, new, step_rows):
    return sum(len(g) * max(lengths[i] for i in g) + new * (len(g) + step_rows) for g in groups)


def test_length_buckets_minimise_the_cost_model():
    """Exhaustive reference: every split of the length-sorted rows into contiguous groups."""
    import itertools

    g = torch.Generator().manual_seed(0)
    for trial in range(30):
        n = int(torch.randint(1, 9, (1,), generator=g))
        lengths = torch.randint(1, 200, (n,), generator=g).tolist()
        new = int(torch.randint(1, 64, (1,), generator=g))
        got = length_buckets(lengths, new, step_rows=4)
        assert sorted(i for b in got for i in b) == list(range(n))
        order = sorted(range(n), key=lambda i: -lengths[i])
        best = min(
            _bucket_cost([order[a:b] for a, b in zip((0, *cuts), (*cuts, n))], lengths, new, 4)
            for k in range(n) for cuts in itertools.combinations(range(1, n), k)
        )
        assert _bucket_cost(got, lengths, new, 4) == best
    # Similar lengths stay one batch; a few long prompts among many short ones get their own.
    assert length_buckets([30, 31, 29, 32] * 8, 64) == [list(range(32))]
    assert length_buckets([500, 500] + [5] * 30, 8) == [[0, 1], list(range(2, 32))]


def test_split_batches_and_repeated_prompts_give_the_same_tokens(model):
    prompts = prompts_for(6, 2, [60]) + prompts_for(7, 20, [2, 3])  # split into two batches
    assert len(length_buckets([len(p) for p in prompts], 4)) == 2
    ours = generate(model, prompts, 4, stop_ids=None, pad_id=PAD, temperature=0.0)
    assert ours == hf_greedy(model, prompts, 4, eos=None)

    # Repeated prompts are prefilled once (4 distinct rows reach the model's forward) and give
    # the same tokens as each prompt alone; sampling stays reproducible.
    few = prompts_for(8, 4, [3, 7])
    batch_sizes = []
    handle = model.register_forward_pre_hook(lambda _m, args, kwargs: batch_sizes.append(args[0].shape[0]),
                                             with_kwargs=True)
    try:
        rep = generate(model, [p for p in few for _ in range(3)], 6, stop_ids=None, pad_id=PAD, temperature=0.0)
    finally:
        handle.remove()
    assert batch_sizes[0] == 4 and set(batch_sizes[1:]) == {12}
    assert rep == [r for r in generate(model, few, 6, stop_ids=None, pad_id=PAD, temperature=0.0) for _ in range(3)]
    kw = dict(stop_ids=None, pad_id=PAD, temperature=1.0)
    a = generate(model, few * 3, 6, generator=torch.Generator().manual_seed(3), **kw)
    assert a == generate(model, few * 3, 6, generator=torch.Generator().manual_seed(3), **kw)


def test_fused_step_only_for_plain_models(model):
    """Hooks and adapters act through module calls, which the fused step skips: such models run
    their own forward per step (and give the same tokens as their forward would)."""
    from lmforge.models.decode_step import supports

    assert supports(model)
    handle = model.layers[0].feed_forward.register_forward_hook(lambda *_: None)
    assert not supports(model)
    handle.remove()
    peft = pytest.importorskip("peft")
    adapted = Transformer(model.args)
    adapted.load_state_dict(model.state_dict())
    cfg = peft.LoraConfig(r=2, lora_alpha=4, target_modules=["wq", "w2"], init_lora_weights=False)
    adapted = peft.inject_adapter_in_model(cfg, adapted)
    assert not supports(adapted)
    prompts = prompts_for(9, 3, [4, 6])
    out = generate(adapted, prompts, 6, stop_ids=None, pad_id=PAD, temperature=0.0)
    with torch.no_grad():
        for p, row in zip(prompts, out):  # greedy by full recompute with the adapters active
            seq = list(p)
            for _ in range(6):
                seq.append(int(adapted(torch.tensor([seq]))[0, -1].argmax()))
            assert seq[len(p):] == row
