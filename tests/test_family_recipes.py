"""Gemma 3 and the mixtures of experts (Qwen3-MoE, OLMoE, gpt-oss; Mixtral below) through the trainers a user runs on them: LoRA SFT (experts
adapted too), DPO and GRPO from a Hugging Face directory with the family's real chat template, each
for one step; and a LoRA run on an MoE exported merged, loaded by transformers with equal logits."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from _helpers import tiny_run_args
from _hf_models import hf_start
from lmforge.cli import main
from lmforge.metrics.records import read_records

transformers = pytest.importorskip("transformers")
pytest.importorskip("peft")

CHATS = Path(__file__).resolve().parent / "fixtures" / "data" / "fastchat_identity_multiturn.jsonl"
SHAPE_FLAGS = dict(model_size=None, model_n_layers=None, model_dim=None, model_n_heads=None, model_n_kv_heads=None)


@pytest.fixture(scope="module")
def starts(tmp_path_factory):
    base = tmp_path_factory.mktemp("family_starts")
    return {f: hf_start(f, base / f) for f in ("gemma3", "qwen3_moe", "mixtral", "olmoe", "gpt_oss")}


def _pairs(path: Path) -> Path:
    rows = [{"prompt": f"What is {i} plus 3?", "chosen": f" {i + 3}", "rejected": " no"} for i in range(8)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


RECIPES = {
    "sft": lambda tmp: [f"--data.train={CHATS}", "--data.seq_len=128", "--lora.enabled=true", "--lora.rank=4"],
    "dpo": lambda tmp: [f"--data.train={_pairs(tmp / 'pairs.jsonl')}", "--data.seq_len=64", "--data.prefetch=0"],
    "grpo": lambda tmp: ["--grpo.num_generations=2", "--grpo.max_new_tokens=4", "--tasks.eval_examples=0"],
}


@pytest.mark.parametrize("recipe", list(RECIPES))
@pytest.mark.parametrize("family", ["gemma3", "qwen3_moe", "olmoe", "gpt_oss"])
def test_family_trains_one_step_in_every_trainer(starts, family, recipe, tmp_path, capsys):
    run = tmp_path / "run"
    args = tiny_run_args(training_steps=1, training_global_batch_size=2, training_micro_batch_size=2, **SHAPE_FLAGS)
    rc = main([recipe, *args, *RECIPES[recipe](tmp_path), f"--model.from_hf={starts[family]}",
               "--data.validation=none", f"--run.dir={run}", "--checkpoint.enabled=false"])
    assert rc == 0, capsys.readouterr().err[-2000:]
    (record,) = read_records(run, "train")
    assert record["step"] == 1 and torch.isfinite(torch.tensor(record["loss"]))
    if family != "gemma3":  # SFT trains with the router terms and logs them; DPO and GRPO without, and say so
        (setup,) = read_records(run, "setup")
        if recipe == "sft":
            assert {"router_aux_loss", "expert_load_max", "expert_load_min"} <= record.keys()
            assert setup["router_losses"].startswith("aux ") and "padding excluded" in setup["router_losses"]
        else:
            assert "router_aux_loss" not in record
            assert setup["router_losses"] == f"off ({recipe} trains MoE models without router terms)"


@pytest.mark.parametrize("family", ["mixtral", "gpt_oss"])
def test_lora_on_experts_exports_merged_with_equal_logits(starts, family, tmp_path, capsys):
    from lmforge.inference import load_for_inference

    run = tmp_path / "run"
    args = tiny_run_args(CHATS, training_steps=2, training_global_batch_size=2, training_micro_batch_size=2,
                         data_seq_len=128, tasks_eval_examples=0, **SHAPE_FLAGS)
    rc = main(["sft", *args, f"--model.from_hf={starts[family]}", f"--run.dir={run}", "--lora.enabled=true",
               "--lora.rank=4", "--lora.target_modules=wq,w1,w2,w3", "--optimizer.lr=0.05"])
    assert rc == 0, capsys.readouterr().err[-2000:]
    assert main(["export", str(run), "--hf", str(tmp_path / "hf")]) == 0, capsys.readouterr().err[-2000:]
    model, _ = load_for_inference(run)
    base = transformers.AutoModelForCausalLM.from_pretrained(starts[family]).eval()
    exported = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    x = torch.randint(10, 1000, (1, 16))
    with torch.no_grad():
        ours = model.eval()(x)
        torch.testing.assert_close(exported(x).logits, ours, atol=1e-4, rtol=1e-4)
        assert (base(x).logits - ours).abs().max() > 1e-3  # the expert adapters trained and were merged
    moved = [n for n, p in exported.named_parameters() if "experts" in n
             and not torch.equal(p, dict(base.named_parameters())[n])]
    assert moved, "no expert weight changed"


@pytest.mark.parametrize("family, mode", [("qwen3_moe", "fsdp")])
def test_two_ranks_match_one_process(starts, family, mode, tmp_path):
    """Real torchrun, 2 CPU ranks, FSDP2 sharding the stacked expert weights: the same losses and the
    same global router statistics as one process."""
    from _helpers import assert_losses_match, losses, run_lmforge, tail, torchrun

    def run(name: str, nproc: int, micro: int):
        args = ("sft", *tiny_run_args(CHATS, training_steps=3, training_global_batch_size=4,
                                      training_micro_batch_size=micro, data_seq_len=128, tasks_eval_examples=0,
                                      parallel_mode=mode, **SHAPE_FLAGS),
                f"--model.from_hf={starts[family]}", f"--run.dir={tmp_path / name}", "--checkpoint.enabled=false")
        proc = run_lmforge(*args) if nproc == 1 else torchrun(*args, nproc=nproc)
        assert proc.returncode == 0, tail(proc)
        return tmp_path / name

    one, two = run("one", 1, 2), run("two", 2, 2)
    assert_losses_match(losses(two), losses(one), range(1, 4))
    if family == "qwen3_moe":
        for a, b in zip(read_records(one, "train"), read_records(two, "train")):
            assert a["expert_load_max"] == pytest.approx(b["expert_load_max"], rel=1e-5)
            assert a["router_aux_loss"] == pytest.approx(b["router_aux_loss"], rel=1e-5)
