"""optimizer.name (adamw, adamw8bit, muon) and training.activation_offload.

Muon's step is checked against its update written out here (momentum, Nesterov, the quintic
Newton-Schulz iteration, the AdamW-RMS learning-rate scale, decoupled weight decay); each optimizer's
resumed run against an uninterrupted one, bit for bit.
"""

from __future__ import annotations

import json
import math
import sys

import pytest
import torch

from _helpers import lmforge_in_process, tail, tiny_run_args, torchrun
from lmforge.checkpoint import Checkpointer
from lmforge.checkpoint.checkpointer import load_model_weights
from lmforge.config import OptimizerSection
from lmforge.errors import UserError
from lmforge.metrics.records import read_records
from lmforge.models.model import ModelArgs, Transformer
from lmforge.parallel.plans import apply_activation_checkpointing, apply_activation_offload
from lmforge.optim.optimizers import OptimizerGroup, check_optimizer, make_optimizer, muon_parameters, state_bytes
from lmforge.training.train_step import run_optimizer_step

TINY = ModelArgs(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=64, ffn_hidden_dim=48, max_seq_len=16)


def _model(**changes) -> Transformer:
    torch.manual_seed(0)
    return Transformer(ModelArgs(**(TINY.__dict__ | changes)))


def _names(model: torch.nn.Module, params: list[torch.Tensor]) -> set[str]:
    ids = {id(p) for p in params}
    return {n for n, p in model.named_parameters() if id(p) in ids}


def test_muon_takes_the_block_projections_and_adamw_the_rest():
    model = _model()
    apply_activation_checkpointing(model)  # wrapper prefixes in the names change nothing
    muon, rest = muon_parameters(model)
    clean = {n.replace("_checkpoint_wrapped_module.", "") for n in _names(model, muon)}
    assert clean == {f"layers.{i}.{m}.weight" for i in range(2) for m in
                     ("attention.wq", "attention.wk", "attention.wv", "attention.wo",
                      "feed_forward.w1", "feed_forward.w2", "feed_forward.w3")}
    others = {n.replace("_checkpoint_wrapped_module.", "") for n in _names(model, rest)}
    assert others == {"tok_embeddings.weight", "output.weight", "norm.weight"} | {
        f"layers.{i}.{n}_norm.weight" for i in range(2) for n in ("attention", "ffn")}

    moe = _model(n_experts=4, n_experts_per_token=2, moe_ffn_dim=16)
    muon, rest = muon_parameters(moe)
    assert all(".attention.w" in n for n in _names(moe, muon))  # no router, no stacked experts
    assert {n for n in _names(moe, rest) if "feed_forward" in n} == {
        f"layers.{i}.feed_forward.{k}" for i in range(2) for k in
        ("router.weight", "experts.w1", "experts.w2", "experts.w3")}


def _newton_schulz(g: torch.Tensor, steps: int = 5) -> torch.Tensor:
    """X <- a X + (b A + c A^2) X with A = X X^T, from X = G / |G|_F, on the wide side (in float64:
    torch runs it in bf16, about 1% off)."""
    a, b, c = 3.4445, -4.7750, 2.0315
    x = g.double()
    tall = x.shape[0] > x.shape[1]
    x = x.T if tall else x
    x = x / x.norm().clamp(min=1e-7)
    for _ in range(steps):
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x.T if tall else x


def test_one_muon_step_is_the_written_out_update():
    model = _model()
    o = OptimizerSection(name="muon", lr=0.02, weight_decay=0.1, muon_lr_ratio=0.5)
    opt = make_optimizer(model, o)
    assert isinstance(opt, OptimizerGroup) and len(opt.optimizers) == 2
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    torch.manual_seed(1)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    lr = 0.01  # the schedule's value this step: Muon's groups get lr x muon_lr_ratio
    run_optimizer_step(model, opt, lr, max_grad_norm=0.0)
    assert [g["lr"] for g in opt.param_groups] == [lr * 0.5, lr, lr]

    muon_lr, mu = lr * 0.5, 0.95
    for name in ("layers.0.attention.wk.weight", "layers.1.feed_forward.w2.weight"):
        g, w = grads[name], before[name]
        buf = (1 - mu) * g  # momentum buffer after one step from zero: lerp(0, g, 1 - mu)
        update = _newton_schulz((1 - mu) * g + mu * buf)  # Nesterov: g lerped towards buf by mu
        scale = 0.2 * math.sqrt(max(w.shape))  # match_rms_adamw
        decayed = w * (1 - muon_lr * 0.1)
        got = dict(model.named_parameters())[name].detach() - decayed
        want = -muon_lr * scale * update.float()
        assert (got - want).norm() < 0.02 * want.norm(), name
    # AdamW's first step moves every weight by lr * sign(g) (bias-corrected m / sqrt(v) = g / |g|)
    emb = "tok_embeddings.weight"
    want = before[emb] * (1 - lr * 0.1) - lr * torch.sign(grads[emb])
    assert torch.allclose(dict(model.named_parameters())[emb], want, atol=1e-6)
    muon_names = _names(model, muon_parameters(model)[0])  # a momentum buffer; AdamW: 2 moments + a step
    assert state_bytes(opt) == sum(4 * p.numel() if n in muon_names else 8 * p.numel() + 4
                                   for n, p in model.named_parameters())


def test_adamw8bit_keeps_a_quarter_of_the_state():
    pytest.importorskip("bitsandbytes")
    model = _model(dim=128, ffn_hidden_dim=256)
    sizes = {}
    for name in ("adamw", "adamw8bit"):
        opt = make_optimizer(model, OptimizerSection(name=name))
        for p in model.parameters():
            p.grad = torch.ones_like(p)
        opt.step()
        sizes[name] = state_bytes(opt)
    assert 0.25 <= sizes["adamw8bit"] / sizes["adamw"] < 0.30  # 1-byte codes + a scale per 256 values


def test_activation_offload_leaves_gradients_and_names_unchanged():
    tokens = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    grads = []
    for offload in (False, True):
        model = _model()
        if offload:
            apply_activation_offload(model, pin_memory=False)
            assert set(model.state_dict()) == set(_model().state_dict())
        model(tokens).float().logsumexp(-1).sum().backward()
        grads.append({n.replace("_checkpoint_wrapped_module.", ""): p.grad for n, p in model.named_parameters()})
    assert grads[0].keys() == grads[1].keys()
    for n in grads[0]:
        assert torch.equal(grads[0][n], grads[1][n]), n


def test_activation_offload_sends_every_block_activation_through_the_host_hooks(monkeypatch):
    """Where it acts: inside each block every tensor saved for backward is packed by ``save_on_cpu``'s
    hook (on CUDA that hook copies it to pinned host memory; on CPU, where the run turns offload off,
    it is a copy), and the ones saved outside the blocks (embedding, final norm, output) are not. The
    device-memory saving itself needs a GPU and is not measured by the suite."""
    tokens = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    offloaded: list[torch.Size] = []
    real = torch.autograd.graph.save_on_cpu

    class Counting(real):  # save_on_cpu, counting what its pack hook receives
        def __init__(self, pin_memory: bool = False, device_type: str = "cuda") -> None:
            super().__init__(pin_memory, device_type)
            pack = self.pack_hook
            self.pack_hook = lambda t: (offloaded.append(t.shape), pack(t))[1]

    monkeypatch.setattr(torch.autograd.graph, "save_on_cpu", Counting)
    outside: dict[bool, int] = {}
    for offload in (False, True):
        model = _model()
        if offload:
            apply_activation_offload(model, pin_memory=False)
        seen = [0]

        def count(t: torch.Tensor) -> torch.Tensor:
            seen[0] += 1
            return t

        with torch.autograd.graph.saved_tensors_hooks(count, lambda t: t):  # blocks' own hooks take precedence
            model(tokens).float().logsumexp(-1).sum().backward()
        outside[offload] = seen[0]
    assert len(offloaded) > 0 and outside[True] > 0
    assert outside[True] + len(offloaded) == outside[False]  # every block tensor went to the host, none else


def _final_weights(run) -> dict[str, torch.Tensor]:
    args = ModelArgs.from_dict(json.loads((run / "model_args.json").read_text())["model_args"])
    model = Transformer(args)
    load_model_weights(Checkpointer(run).latest(), model)
    return model.state_dict()


def _losses(run) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_records(run, "train")}


@pytest.mark.parametrize("name", ["adamw8bit", "muon"])
def test_resume_equals_uninterrupted(name, tmp_path, capfd):
    if name == "adamw8bit":
        pytest.importorskip("bitsandbytes")
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    args = tiny_run_args(optimizer_name=name, training_steps=6, checkpoint_interval=3)  # 256 tokens a step
    for run, extra in ((straight, []), (resumed, ["--training.max_tokens=768"]), (resumed, [])):
        assert lmforge_in_process("pretrain", *args, f"--run.dir={run}", *extra) == 0, capfd.readouterr().err[-2000:]
    assert [r["step"] for r in read_records(resumed, "resume")] == [3]
    a, b = _losses(straight), _losses(resumed)
    assert sorted(a) == sorted(b) == list(range(1, 7)) and a == b  # bit for bit
    weights = [_final_weights(run) for run in (straight, resumed)]
    for k in weights[0]:
        assert torch.equal(weights[0][k], weights[1][k]), k
    setup = [r for r in read_records(straight) if r["kind"] == "setup"][0]
    assert setup["optimizer"] == name


def test_muon_under_fsdp_equals_one_process(tmp_path, corpus, capfd):
    """Muon steps FSDP2's sharded DTensor parameters (its Newton-Schulz matmuls gather what they need),
    and its state goes through DCP like AdamW's."""
    one, two = tmp_path / "one", tmp_path / "two"
    args = tiny_run_args(corpus, optimizer_name="muon", training_steps=3, checkpoint_interval=2)
    assert lmforge_in_process("pretrain", *args, f"--run.dir={one}") == 0, capfd.readouterr().err[-2000:]
    proc = torchrun("pretrain", *args, "--training.micro_batch_size=2", "--parallel.mode=fsdp", f"--run.dir={two}")
    assert proc.returncode == 0, tail(proc)
    a, b = _losses(one), _losses(two)
    assert sorted(a) == sorted(b) == [1, 2, 3]
    for step in a:  # Newton-Schulz runs in bf16, its sums split differently over shards
        assert b[step] == pytest.approx(a[step], rel=1e-4), step
    assert (two / "checkpoints" / "step_00000002").is_dir()


def _refused(capfd, *args) -> str:
    """The error line of a run that must stop with status 2."""
    rc = lmforge_in_process("pretrain", *args)
    err = capfd.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1, err
    return err


def test_bad_optimizer_config_is_one_line(tmp_path, capfd, monkeypatch):
    err = _refused(capfd, *tiny_run_args(optimizer_name="muon", lora_enabled=True), f"--run.dir={tmp_path}/a")
    assert err == "error: optimizer.name=muon trains full weight matrices; with lora.enabled use adamw or adamw8bit"
    assert "optimizer.name" in _refused(capfd, *tiny_run_args(optimizer_name="sgd"), f"--run.dir={tmp_path}/b")
    monkeypatch.setitem(sys.modules, "bitsandbytes", None)  # import bitsandbytes -> ImportError
    err = _refused(capfd, *tiny_run_args(optimizer_name="adamw8bit"), f"--run.dir={tmp_path}/c")
    assert err == "error: optimizer.name=adamw8bit needs the bitsandbytes package: pip install 'lmforge[quant]'"
    assert not any(tmp_path.iterdir())  # refused before the run directory was made
    monkeypatch.undo()
    with pytest.raises(UserError, match=r"^optimizer.name=adamw8bit does not support FSDP \(parallel.dp_shard > 1\)"):
        check_optimizer(OptimizerSection(name="adamw8bit"), lora=False, sharded=True)
