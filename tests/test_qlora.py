"""QLoRA (``lora.quantize = "nf4"``): the base's projections are NF4 within its rounding bound, only
the adapters train, checkpoints hold the adapters, resume is exact, and the merged export equals
the adapted model (base dequantized, not quantized again)."""

from __future__ import annotations

import sys

import pytest
import torch
from torch import nn

from _helpers import lmforge_in_process, tiny_run_args
from lmforge.config import LoraSection
from lmforge.errors import UserError
from lmforge.metrics.records import read_records
from lmforge.models.model import ModelArgs, Transformer

pytest.importorskip("peft")
pytest.importorskip("bitsandbytes")

from lmforge.models.lora import apply_lora, merge_adapters, trainable_parameters  # noqa: E402
from lmforge.models.qlora import dequantized_weight, is_4bit  # noqa: E402

ARGS = ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=64, max_seq_len=32)
NF4 = [-1.0, -0.6962, -0.5251, -0.3949, -0.2844, -0.1848, -0.0911, 0.0,
       0.0796, 0.1609, 0.2461, 0.3379, 0.4407, 0.5626, 0.7230, 1.0]
"""The 16 NF4 code values (quantiles of a standard normal, scaled to [-1, 1])."""


def _model() -> Transformer:
    m = Transformer(ARGS)
    m.init_weights(seed=0)
    return m


def _qlora(model: Transformer, targets: list[str] | None = None) -> Transformer:
    chosen = {"target_modules": targets} if targets else {}
    lora = LoraSection(enabled=True, rank=4, alpha=8, quantize="nf4", **chosen)
    return apply_lora(model, lora)


def _linears(model: nn.Module) -> dict[str, nn.Module]:
    return {n.replace(".base_layer", ""): m for n, m in model.named_modules() if is_4bit(m)}


def test_nf4_base_is_within_the_rounding_bound_and_only_adapters_train():
    plain, quant = _model(), _qlora(_model(), targets=["wq", "w2"])
    layers = _linears(quant)
    assert len(layers) == 2 * 7  # every projection is quantized, adapters or not
    half_gap = max(b - a for a, b in zip(NF4, NF4[1:])) / 2
    for name, layer in layers.items():
        w = plain.get_submodule(name).weight.detach()
        blocks = w.reshape(-1, 64)  # one scale per 64 values: |w - q(w)| <= half the widest code gap x absmax
        err = (dequantized_weight(layer).reshape(-1, 64) - blocks).abs()
        bound = half_gap * blocks.abs().amax(1, keepdim=True) * 1.02  # + the 8-bit error of the scale itself
        assert (err <= bound).all(), name
        assert 0 < err.norm() / blocks.norm() < 0.15, name
    tokens = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a, b = plain(tokens), quant(tokens)
    assert (a - b).norm() / a.norm() < 0.15  # close to the unquantized model, within NF4's error
    trainable = {n for n, p in quant.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    assert {n.split(".lora_")[0] for n in trainable} == {f"layers.{i}.{m}" for i in range(2)
                                                         for m in ("attention.wq", "feed_forward.w2")}
    assert trainable_parameters(quant)[0] == sum(p.numel() for p in quant.parameters() if p.requires_grad)


def test_merged_export_is_the_dequantized_base_plus_adapters():
    model = _qlora(_model())
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=0.05)
    tokens = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    for _ in range(2):  # adapters away from their zero start
        model(tokens).float().logsumexp(-1).mean().backward()
        opt.step()
        opt.zero_grad()
    with torch.no_grad():
        want = model(tokens)
        merge_adapters(model)
        got = model(tokens)
    assert not _linears(model) and all(type(m) is nn.Linear for n, m in model.named_modules() if n.endswith(".wq"))
    assert torch.allclose(got, want, atol=1e-5)
    assert set(model.state_dict()) == set(_model().state_dict())  # a plain lmforge model again


def test_qlora_resume_equals_uninterrupted_and_checkpoints_hold_adapters(tmp_path, capfd):
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    args = tiny_run_args(lora_enabled=True, lora_quantize="nf4", optimizer_lr=1e-2, training_steps=4,
                         checkpoint_interval=2)  # 256 target tokens a step
    for run, extra in ((straight, []), (resumed, ["--training.max_tokens=512"]), (resumed, [])):
        assert lmforge_in_process("pretrain", *args, f"--run.dir={run}", *extra) == 0, capfd.readouterr().err[-2000:]
    a = {r["step"]: r["loss"] for r in read_records(straight, "train")}
    b = {r["step"]: r["loss"] for r in read_records(resumed, "train")}
    assert sorted(a) == [1, 2, 3, 4] and a == b  # bit for bit
    from torch.distributed.checkpoint import FileSystemReader

    keys = FileSystemReader(str(straight / "checkpoints" / "step_00000004")).read_metadata().state_dict_metadata
    model_keys = [k for k in keys if k.startswith("model.")]
    assert model_keys and all(".lora_A." in k or ".lora_B." in k for k in model_keys)


def test_bad_qlora_config_is_one_line(tmp_path, capfd, monkeypatch):
    rc = lmforge_in_process("pretrain", *tiny_run_args(lora_quantize="nf4"), f"--run.dir={tmp_path}/a")
    assert rc == 2 and capfd.readouterr().err.strip() == (
        "error: lora.quantize=nf4 quantizes the frozen base under LoRA adapters: set lora.enabled=true")
    monkeypatch.setitem(sys.modules, "bitsandbytes", None)  # import bitsandbytes -> ImportError
    args = tiny_run_args(lora_enabled=True, lora_quantize="nf4")
    rc = lmforge_in_process("pretrain", *args, f"--run.dir={tmp_path}/b")
    assert rc == 2 and capfd.readouterr().err.strip() == (
        "error: lora.quantize=nf4 needs the bitsandbytes package: pip install 'lmforge[quant]'")
    monkeypatch.undo()
    assert not any(tmp_path.iterdir())
    moe = Transformer(ModelArgs(**(ARGS.__dict__ | dict(n_experts=4, n_experts_per_token=2, moe_ffn_dim=16))))
    with pytest.raises(UserError, match=r"^lora.quantize=nf4 does not support mixtures of experts"):
        _qlora(moe)


def test_an_eval_forward_leaves_the_training_gradients_as_they_were():
    """bitsandbytes repacks a Linear4bit's weight for its CPU inference kernel on the first forward in
    eval mode without grad (on CPUs with AVX512-BF16), and that kernel passes no gradient back to the
    input: an eval before training would cut every adapter below the last block off its gradient (and
    crash on a biased projection). lmforge's NF4 layers keep the training layout."""
    tokens = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(2))

    def adapter_grads(evaluate_first: bool) -> dict[str, torch.Tensor]:
        torch.manual_seed(0)  # peft draws lora_A from the global generator
        model = _qlora(_model())
        for n, p in model.named_parameters():
            if ".lora_B." in n:  # away from zero, so every adapter's gradient reaches lora_A too
                nn.init.normal_(p, std=0.02, generator=torch.Generator().manual_seed(3))
        if evaluate_first:
            model.eval()
            with torch.no_grad():
                model(tokens)
            model.train()
        model(tokens).float().logsumexp(-1).mean().backward()
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}

    straight, after_eval = adapter_grads(False), adapter_grads(True)
    assert straight.keys() == after_eval.keys()
    for name in straight:
        assert torch.equal(straight[name], after_eval[name]), name
