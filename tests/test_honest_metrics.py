"""Honest performance numbers: FLOPs of the real tokens of each step, MFU against the peak of the
dtype in use, device waits only at timing boundaries, the memory field, and the checks that keep a
diverged model out of the checkpoints."""

from __future__ import annotations

from contextlib import nullcontext
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from lmforge.data.sft_data import Example, SFTDataset
from lmforge.metrics import MetricLogger
from lmforge.models.flops import flops_per_token, training_flops
from lmforge.models.model import Transformer, model_args_for
from lmforge.rl.rewards import WeightedReward
from lmforge.rl.rollout import RolloutSettings, collect_rollout
from lmforge.recipes.jobs.next_token import LoaderSource


def reference_flops(model: Transformer, documents: list[torch.Tensor]) -> float:
    """Forward + backward FLOPs of each real document run alone (no padding), counted by PyTorch.

    FlopCounterMode counts attention as dense (the math backend computes the whole L x L score
    matrix, ``aten.bmm``); causal kernels skip the masked half, so the attention part is halved,
    the convention lmforge counts with (see test_flops). Weight matmuls (``aten.mm``) are as counted.
    """
    total = 0.0
    for doc in documents:
        counter = FlopCounterMode(display=False)
        with counter, sdpa_kernel(SDPBackend.MATH):
            model(doc.unsqueeze(0)).float().sum().backward()
        counts = {str(k): v for k, v in counter.get_flop_counts()["Global"].items()}
        total += counts.pop("aten.mm") + counts.pop("aten.bmm", 0) / 2
        assert not counts, f"unexpected FLOP-counted ops: {counts}"
        model.zero_grad(set_to_none=True)
    return total


@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    args = model_args_for("debug", 64, n_layers=2, dim=64, n_heads=4, n_kv_heads=2)
    model = Transformer(args)
    model.init_weights(seed=0)
    return args, model


def test_packed_sft_step_flops_match_flop_counter(tiny):
    """A packed SFT step: the loader source's FLOPs equal PyTorch's count of its real documents."""
    args, model = tiny
    rng = np.random.default_rng(0)
    lengths = [40, 9, 70, 23, 55, 31, 12, 60, 18, 44]
    examples = [Example(rng.integers(1, 64, n), rng.integers(1, 64, n)) for n in lengths]
    T = 128
    dataset = SFTDataset(examples, seq_len=T, pad_id=0, packing=True)
    cfg = SimpleNamespace(training=SimpleNamespace(global_batch_size=len(dataset), micro_batch_size=1, seed=0),
                          data=SimpleNamespace(shuffle=False, prefetch=0),
                          checkpoint=SimpleNamespace(on_data_change="error"))
    world = SimpleNamespace(dist=SimpleNamespace(rank=0, world_size=1, batch_share=0, batch_shares=1,
                                                 device=torch.device("cpu")),
                            layout=SimpleNamespace(cp=1), shard_batch=lambda batch: batch)
    rt = SimpleNamespace(cfg=cfg, metrics=SimpleNamespace(console=print), world=world,
                         model=SimpleNamespace(args=args, training_flops=lambda lengths: training_flops(args, lengths),
                                                 image_flops=lambda grids, n_images: 0.0))
    step = LoaderSource(rt, dataset).next_step(1)
    documents = []
    for mb in step.microbatches:  # cut every row at its document boundaries; drop the padding tail
        for row, ids in zip(mb.document_lengths, mb.input_ids):
            at = 0
            for n in row:
                documents.append(ids[at: at + n])
                at += n
    assert sorted(len(d) for d in documents) == sorted(lengths)
    expected = reference_flops(model, documents)
    assert step.flops == pytest.approx(expected, rel=1e-9)
    padded_rows = flops_per_token(args, T) * step.tokens  # the old count: every position at data.seq_len
    assert abs(padded_rows - expected) > 0.05 * expected


def test_grpo_step_flops_match_flop_counter(tiny):
    """A GRPO update pass: real prompt + completion lengths, padding excluded."""
    args, model = tiny
    prompts = [[5, 6, 7, 8, 9, 10, 11], [12, 13, 14]]
    settings = RolloutSettings(num_generations=3, max_new_tokens=24, temperature=1.0, top_p=1.0, micro_batch_size=4,
                               advantage_scale="group", mask_truncated=False, need_old_logprobs=False)
    reward = WeightedReward("length", lambda prompts, completions, **kw: [float(len(c)) for c in completions], 1.0)
    gen = torch.Generator().manual_seed(3)
    rollout = collect_rollout(model, [{"prompt": "a"}, {"prompt": "b"}], prompts, [reward], settings,
                              stop_ids=[1, 2, 3], pad_id=0, decode=lambda ids: "x" * len(ids), seed=3,
                              reference=None, autocast=nullcontext())
    rows = [row for b in rollout.batches for row in b.input_ids]
    assert len(set(rollout.sequence_lengths)) > 1, "the test needs completions of different lengths"
    documents = [row[:n] for row, n in zip(rows, rollout.sequence_lengths)]
    assert all(len(d) == n for d, n in zip(documents, rollout.sequence_lengths))
    ours = training_flops(args, rollout.sequence_lengths)
    assert ours == pytest.approx(reference_flops(model, documents), rel=1e-9)
    T = rollout.batches[0].input_ids.shape[1]
    assert ours < flops_per_token(args, T) * rollout.tokens


class CountingSync:
    def __init__(self) -> None:
        self.calls: list[str] = []
        self.where = "?"

    def __call__(self) -> None:
        self.calls.append(self.where)


def test_device_waits_at_clock_start_and_timed_edges_only(tmp_path):
    sync = CountingSync()
    m = MetricLogger(tmp_path, log_every=2, tensorboard=False, console=lambda line: None, synchronize=sync)
    sync.where = "start"
    m.start_clock()
    sync.where = "steps"
    for step in range(1, 6):
        m.record_step(step, tokens=10, flops=100.0, metrics={"loss": torch.tensor(1.0)})
    sync.where = "eval"
    with m.timed("eval"):
        pass
    assert sync.calls == ["start", "eval", "eval"]


def test_device_wait_only_on_accelerators(tmp_path):
    from lmforge.metrics.device_stats import device_synchronizer

    m = MetricLogger(tmp_path, tensorboard=False, console=lambda line: None, device="cpu")
    assert m._synchronize is None
    assert device_synchronizer("cuda:0") is not None  # built, not called: this machine may have no GPU


def test_tflops_from_step_flops_and_memory_field(tmp_path):
    lines: list[str] = []
    m = MetricLogger(tmp_path, log_every=1, flops_per_token=1e9, peak_flops=1e6, tensorboard=False,
                     console=lines.append, device="cpu")
    m.start_clock()
    rec = m.record_step(1, tokens=1000, flops=500.0, metrics={"loss": torch.tensor(1.0)})
    assert rec["tflops_per_device"] == pytest.approx(500.0 / rec["seconds"] / 1e12)
    assert rec["mfu"] == pytest.approx(500.0 / rec["seconds"] / 1e6)
    assert rec["memory_gb"] > 0.01  # a Python process with torch loaded holds well over 10 MB
    assert "mem: " in lines[-1] and " GB" in lines[-1]


def test_no_checkpoint_of_a_diverged_step_between_log_steps(tmp_path, monkeypatch):
    """On an accelerator the non-finite guard reads the loss on log steps only; a save on a step in
    between must still check first: the run stops without saving, and says nothing untrue."""
    import lmforge.runtime.build as build
    import lmforge.training.loop as loop
    from lmforge.checkpoint import RunDir, list_checkpoints
    from lmforge.config import Config, validate_config
    from lmforge.data.corpus import embedded_corpus
    from lmforge.data.packing import PackedTokenDataset
    from lmforge.runtime.guard import Guard, NonFiniteLoss
    from lmforge.recipes.jobs.next_token import NextTokenObjective
    from lmforge.runtime import build_runtime
    from lmforge.objectives.next_token import cross_entropy_loss

    class LogStepsOnly(Guard):  # what a GPU run does: no per-step read
        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            self.every_step = False

    monkeypatch.setattr(build, "Guard", LogStepsOnly)
    calls = {"n": 0}

    def nan_at_step_3(model, batch):
        calls["n"] += 1
        objective, stats = cross_entropy_loss(model, batch)
        return (objective * float("nan") if calls["n"] == 3 else objective), stats

    run = tmp_path / "run"
    cfg = validate_config(Config, {
        "model": {"n_layers": 2, "dim": 64}, "data": {"seq_len": 32, "prefetch": 0},
        "training": {"steps": 8, "global_batch_size": 4, "micro_batch_size": 4, "dtype": "float32"},
        "schedule": {"warmup_steps": 0}, "eval": {"interval": 0}, "checkpoint": {"interval": 3},
        "metrics": {"log_every": 4, "tensorboard": False, "peak_tflops": 1.0, "progress": "off"},
        "run": {"dir": str(run)}})
    rt = build_runtime(cfg, "pretrain")
    source = LoaderSource(rt, PackedTokenDataset(embedded_corpus("train", num_docs=200), rt.model.tokenizer, 32))
    objective = NextTokenObjective()
    objective.loss_fn = nan_at_step_3
    with pytest.raises(NonFiniteLoss) as error:
        try:
            loop.train(rt, source, objective, None)
        finally:
            source.close()
            rt.metrics.close()
    assert "at step 3 (checked before saving it)" in str(error.value)
    assert "intact" not in str(error.value)
    assert list_checkpoints(RunDir(run).checkpoints) == []


def _pretrain_in_process(run, steps: int, size: str, **training):
    from lmforge.config import Config, validate_config
    from lmforge.data.corpus import embedded_corpus
    from lmforge.data.packing import PackedTokenDataset
    from lmforge.metrics.records import read_records
    from lmforge.training.loop import train
    from lmforge.recipes.jobs.next_token import NextTokenObjective
    from lmforge.runtime import build_runtime

    cfg = validate_config(Config, {
        "model": {"size": size}, "data": {"seq_len": 64, "prefetch": 0},
        "training": {"steps": steps, "global_batch_size": 4, "micro_batch_size": 4, **training},
        "schedule": {"warmup_steps": 0}, "eval": {"interval": 0}, "checkpoint": {"enabled": False},
        "metrics": {"log_every": 1, "tensorboard": False, "progress": "off"}, "run": {"dir": str(run)}})
    rt = build_runtime(cfg, "pretrain")
    source = LoaderSource(rt, PackedTokenDataset(embedded_corpus("train", num_docs=200), rt.model.tokenizer, 64))
    try:
        train(rt, source, NextTokenObjective(), None)
    finally:
        source.close()
        rt.metrics.close()
    return rt, read_records(run)


def test_bf16_on_cpu_mfu_against_the_bf16_peak(tmp_path):
    rt, records = _pretrain_in_process(tmp_path / "run", 4, "small", dtype="bfloat16")
    setup = next(r for r in records if r["kind"] == "setup")
    assert setup["dtype"] == "bfloat16" and "bfloat16" in setup["peak_source"]
    train = [r for r in records if r["kind"] == "train"]
    assert len(train) == 4
    peak = setup["peak_tflops_per_device"] * 1e12
    for r in train:  # each step: 4 rows of 64 tokens at the model's FLOPs per token, over its time and the peak
        want = setup["flops_per_token"] * 4 * 64 / r["seconds"] / peak
        assert r["mfu"] == pytest.approx(want, rel=1e-6), (r["mfu"], want)


def test_auto_dtype_rule(monkeypatch):
    from lmforge.runtime import precision

    cpu = torch.device("cpu")
    assert precision.choose_dtype("float32", cpu, 10**9) == ("float32", "training.dtype")
    bf16, fp32 = precision.cpu_bf16_matmul_rates(cpu)  # measured here, then replaced to test the rule
    assert bf16 > 0 and fp32 > 0
    monkeypatch.setattr(precision, "cpu_has_fast_bf16", lambda: True)
    monkeypatch.setattr(precision, "cpu_bf16_matmul_rates", lambda device: (4e11, 1e11))
    dtype, why = precision.choose_dtype("auto", cpu, 140_000)
    assert dtype == "float32" and "0.1M non-embedding parameters" in why
    dtype, why = precision.choose_dtype("auto", cpu, precision.CPU_BF16_MIN_PARAMS)
    assert dtype == "bfloat16" and "4.00x the fp32 rate" in why
    # a CPU that lists AVX512-BF16 but runs bf16 matmuls slower than fp32 (measured on an Intel Xeon)
    monkeypatch.setattr(precision, "cpu_bf16_matmul_rates", lambda device: (1.4e11, 2.6e11))
    dtype, why = precision.choose_dtype("auto", cpu, 10**9)
    assert dtype == "float32" and "0.54x the fp32 rate" in why
    monkeypatch.setattr(precision, "cpu_bf16_matmul_rates", lambda device: (1.4e11, 1e11))
    assert precision.choose_dtype("auto", cpu, 10**9)[0] == "float32"  # faster, but not by the margin
    monkeypatch.setattr(precision, "cpu_has_fast_bf16", lambda: False)
    assert precision.choose_dtype("auto", cpu, 10**9)[0] == "float32"
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    assert precision.choose_dtype("auto", torch.device("cuda", 0), 1000) == ("bfloat16", "auto: the GPU supports bf16")


def test_explicit_bf16_warns_where_cpu_bf16_matmuls_are_slow(monkeypatch):
    from lmforge.runtime import precision

    cpu = torch.device("cpu")
    # an Intel Xeon with AVX512-BF16 and no AMX: bf16 matmuls at 0.54x the fp32 rate
    monkeypatch.setattr(precision, "cpu_bf16_matmul_rates", lambda device: (1.4e11, 2.6e11))
    dtype, why = precision.choose_dtype("bfloat16", cpu, 10**9)
    assert dtype == "bfloat16"  # the user's choice stands; only a warning is added
    assert "warning" in why and "0.54x the fp32 rate" in why and "0.140 vs 0.260 TFLOP/s" in why
    monkeypatch.setattr(precision, "cpu_bf16_matmul_rates", lambda device: (4e11, 1e11))  # fast bf16: no warning
    assert precision.choose_dtype("bfloat16", cpu, 10**9) == ("bfloat16", "training.dtype")
    monkeypatch.setattr(precision, "cpu_bf16_matmul_rates", lambda device: (0.9e11, 1e11))  # near even: no warning
    assert precision.choose_dtype("bfloat16", cpu, 10**9) == ("bfloat16", "training.dtype")
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    assert precision.choose_dtype("bfloat16", torch.device("cuda", 0), 10**9) == ("bfloat16", "training.dtype")


def test_explicit_bf16_warning_on_the_setup_line(tmp_path, monkeypatch, capsys):
    from lmforge.runtime import precision

    monkeypatch.setattr(precision, "cpu_bf16_matmul_rates", lambda device: (1.4e11, 2.6e11))
    _pretrain_in_process(tmp_path / "run", 1, "debug", dtype="bfloat16")
    setup = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("setup:"))
    assert "dtype=bfloat16" in setup
    assert "warning: bf16 matmuls run at 0.54x the fp32 rate" in setup and "(0.140 vs 0.260 TFLOP/s measured)" in setup


def test_auto_dtype_in_the_setup_record(tmp_path, monkeypatch):
    monkeypatch.setenv("LMFORGE_CACHE_DIR", str(tmp_path / "cache"))
    rt, records = _pretrain_in_process(tmp_path / "run", 1, "debug", compile="auto")
    setup = next(r for r in records if r["kind"] == "setup")
    assert setup["dtype"] == rt.model.dtype == "float32"  # debug is far under the CPU threshold
    assert setup["dtype_reason"].startswith("auto: ")
    # one step of debug cannot repay a compile: off, and the estimate is on the line
    assert setup["compile"] == "off" and setup["compile_reason"].startswith("auto: ~")
    assert "1 steps" in setup["compile_reason"] and "cache cold" in setup["compile_reason"]
