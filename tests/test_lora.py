"""LoRA (``[lora]``, through peft): only adapters train and are saved, the base stays exact, resume is
exact, the adapter loads in peft + transformers with lmforge's logits, and the merged export equals
the adapted model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from _helpers import (  # noqa: I001
    assert_losses_match, finish, lmforge_in_process, losses, run_lmforge, start_lmforge, tail, tiny_run_args, torchrun,
    write_corpus,
)

peft = pytest.importorskip("peft")

from lmforge.config import LoraSection  # noqa: E402
from lmforge.models.lora import (  # noqa: E402
    BaseModelView, adapter_weights, adapters_disabled, apply_lora, has_adapters, merge_adapters, trainable_parameters,
)
from lmforge.models.model import ModelArgs, Transformer  # noqa: E402

ARGS = ModelArgs(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=64, max_seq_len=32)
LORA_RUN = dict(lora_enabled=True, lora_rank=4, lora_alpha=8, optimizer_lr=1e-2)


def _model(seed: int = 0) -> Transformer:
    m = Transformer(ARGS)
    m.init_weights(seed=seed)
    return m


def _train_adapters(model: Transformer, steps: int = 3) -> None:
    """A few optimizer steps on random tokens, so the adapters are far from their zero start."""
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=0.05)
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x = torch.randint(0, 64, (2, 12), generator=g)
        loss = torch.nn.functional.cross_entropy(model(x[:, :-1]).flatten(0, 1), x[:, 1:].flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()


def test_only_adapters_train_and_the_adapted_model_starts_equal_to_its_base():
    base, model = _model(), apply_lora(_model(), LoraSection(rank=4, alpha=8))
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    assert len(adapter_weights(model)) == 7 * ARGS.n_layers  # every projection of every layer
    n_train, n_total = trainable_parameters(model)
    assert n_total - n_train == base.num_params()
    assert n_train == sum(4 * (a.shape[1] + b.shape[0]) for a, b in adapter_weights(model).values())
    x = torch.randint(0, 64, (2, 10))
    torch.testing.assert_close(model(x), base(x))  # B starts at zero


def test_adapters_off_is_the_base_and_merging_keeps_the_adapted_model():
    base, model = _model(), apply_lora(_model(), LoraSection(rank=4, alpha=8, target_modules=["wq", "wv", "w2"]))
    _train_adapters(model)
    x = torch.randint(0, 64, (2, 10))
    adapted = model(x).detach()
    assert not torch.allclose(adapted, base(x), atol=1e-3)
    with torch.no_grad(), adapters_disabled(model):
        torch.testing.assert_close(model(x), base(x))
    torch.testing.assert_close(BaseModelView(model)(x), base(x))
    assert all(p.requires_grad for n, p in model.named_parameters() if "lora_" in n)  # restored after
    merged = merge_adapters(model)
    assert not has_adapters(merged)
    torch.testing.assert_close(merged(x), adapted, atol=1e-5, rtol=1e-5)


def test_unknown_target_module_is_one_line():
    from lmforge.errors import UserError

    with pytest.raises(UserError, match="lora.target_modules: unknown module"):
        apply_lora(_model(), LoraSection(target_modules=["wq", "output"]))


def test_lora_without_peft_installed_is_one_line(monkeypatch):
    import sys

    from lmforge.errors import UserError

    monkeypatch.setitem(sys.modules, "peft", None)  # import peft -> ImportError
    with pytest.raises(UserError, match=r"needs the peft package: pip install 'lmforge\[lora\]'"):
        apply_lora(_model(), LoraSection())


def test_flops_count_no_weight_gradients_for_the_frozen_base():
    from lmforge.models.flops import flops_per_token, matmul_params, training_flops

    full, lora = flops_per_token(ARGS, 16), flops_per_token(ARGS, 16, adapter_params=1000)
    assert full - lora == pytest.approx(2 * matmul_params(ARGS) - 6 * 1000)
    assert training_flops(ARGS, [16], 1000) < training_flops(ARGS, [16])


# ---------------------------------------------------------------------------- runs through the CLI
@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    return write_corpus(tmp_path_factory.mktemp("lora_data") / "corpus.txt")


@pytest.fixture(scope="module")
def straight(tmp_path_factory, corpus) -> Path:
    """Eight LoRA steps in one go, continued pretraining from a tiny fresh model."""
    run = tmp_path_factory.mktemp("lora_straight") / "run"
    proc = run_lmforge("pretrain", *tiny_run_args(corpus, training_steps=8, **LORA_RUN), f"--run.dir={run}")
    assert proc.returncode == 0, tail(proc)
    return run


def test_checkpoints_hold_only_the_adapters_and_the_setup_line_says_how_many_train(straight):
    from torch.distributed.checkpoint import FileSystemReader

    ckpt = sorted((straight / "checkpoints").glob("step_*"))[-1]
    keys = {k for k in FileSystemReader(str(ckpt)).read_metadata().state_dict_metadata if k.startswith("model.")}
    assert keys and all("lora_A" in k or "lora_B" in k for k in keys)
    described = json.loads((ckpt / "trainer_state.json").read_text())["model"]
    assert described["lora"]["rank"] == 4 and described["base"].startswith("init:")
    setup = json.loads((straight / "metrics.jsonl").read_text().splitlines()[0])
    assert 0 < setup["trainable_share"] < 0.25
    assert setup["trainable_share"] == round(setup["trainable_parameters"] / setup["parameters"], 6)


def test_resume_continues_exactly(tmp_path, straight, corpus, capfd):
    """Interrupted and resumed through the CLI's entry point in this process; ``straight`` is the real CLI's."""
    run = tmp_path / "run"  # the same 8-step schedule, stopped by a token budget after step 4
    rc = lmforge_in_process("pretrain", *tiny_run_args(corpus, training_steps=8, training_max_tokens=4 * 8 * 32,
                                                       **LORA_RUN), f"--run.dir={run}")
    assert rc == 0, capfd.readouterr().err[-3000:]
    capfd.readouterr()
    rc = lmforge_in_process("pretrain", *tiny_run_args(corpus, training_steps=8, **LORA_RUN), f"--run.dir={run}")
    out, err = capfd.readouterr()
    assert rc == 0, err[-3000:]
    assert "resumed from" in out + err
    assert_losses_match(losses(run), losses(straight), range(1, 9))


def test_resume_with_other_adapters_or_none_is_refused_in_one_line(tmp_path, straight, corpus, capfd):
    import shutil

    run = tmp_path / "run"
    shutil.copytree(straight, run)
    files = lambda: {p: p.read_bytes() for p in run.rglob("*") if p.is_file() and p.name != ".lock"}  # noqa: E731
    before = files()
    for extra, words in ((["--lora.rank=8"], "lora.rank=4"), (["--lora.enabled=false"], "LoRA adapters")):
        args = tiny_run_args(corpus, training_steps=10, **LORA_RUN) + extra
        rc = lmforge_in_process("pretrain", *args, f"--run.dir={run}")
        out, err = capfd.readouterr()
        assert rc == 2, (out[-2000:], err[-2000:])
        assert err.count("error:") == 1 and words in err and "Traceback" not in err, err[-2000:]
    assert files() == before


def test_ddp_and_fsdp2_two_ranks_match_one_process(straight, corpus, tmp_path):
    procs = {}
    for mode in ("ddp", "fsdp"):
        args = tiny_run_args(corpus, training_steps=8, training_micro_batch_size=4, parallel_mode=mode, **LORA_RUN)
        procs[mode] = torchrun("pretrain", *args, f"--run.dir={tmp_path / mode}", timeout=400)
    for mode, proc in procs.items():
        assert proc.returncode == 0, (mode, tail(proc))
        assert_losses_match(losses(tmp_path / mode), losses(straight), range(1, 9), rel=1e-4)


def test_compiled_blocks_train_the_same_adapters(straight, corpus, tmp_path):
    args = tiny_run_args(corpus, training_steps=3, training_compile=True, **LORA_RUN)
    proc = run_lmforge("pretrain", *args, f"--run.dir={tmp_path / 'run'}", timeout=400)
    assert proc.returncode == 0, tail(proc)
    assert_losses_match(losses(tmp_path / "run"), losses(straight), range(1, 4), rel=1e-4)


# ---------------------------------------------------------------------------- a real family, exported
@pytest.fixture(scope="module")
def qwen_lora(tmp_path_factory):
    """LoRA SFT of a tiny Qwen2.5 (real tokenizer) for three steps through the CLI, then both exports
    (through the CLI's entry point in this process)."""
    pytest.importorskip("transformers")
    from _hf_models import hf_start

    base = tmp_path_factory.mktemp("qwen_lora")
    start = hf_start("qwen2.5", base / "hf_start")
    chats = Path(__file__).resolve().parent / "fixtures" / "data" / "fastchat_identity_multiturn.jsonl"
    args = tiny_run_args(chats, model_size=None, model_n_layers=None, model_dim=None, model_n_heads=None,
                         model_n_kv_heads=None, data_seq_len=128, training_steps=3, training_global_batch_size=4,
                         training_micro_batch_size=2, tasks_eval_examples=0, lora_enabled=True, lora_rank=4,
                         lora_alpha=16, optimizer_lr=5e-2)
    rc, out, err = finish(start_lmforge("sft", *args, f"--model.from_hf={start}", f"--run.dir={base / 'run'}"), 400)
    assert rc == 0, err[-3000:]
    for flags in (["--adapter", base / "adapter"], ["--hf", base / "merged"]):  # in this process: no start-up each
        assert lmforge_in_process("export", base / "run", *flags) == 0, flags
    return base


def test_peft_adapter_on_the_base_gives_lmforges_logits(qwen_lora):
    import transformers

    from lmforge.models.load import ModelSource, load_model

    config = json.loads((qwen_lora / "adapter" / "adapter_config.json").read_text())
    assert Path(config["base_model_name_or_path"]) == (qwen_lora / "hf_start").resolve()
    hf = transformers.AutoModelForCausalLM.from_pretrained(config["base_model_name_or_path"])
    with_adapter = peft.PeftModel.from_pretrained(hf, qwen_lora / "adapter").eval()
    ours = load_model(ModelSource.at(qwen_lora / "run"), merge_lora=False).model.eval()
    a, b = next(iter(adapter_weights(ours).values()))
    assert b.abs().max() > 0  # the adapters trained: equal logits are not the base's
    x = torch.tensor([[1, 5, 900, 42, 7000, 3, 151]])
    with torch.no_grad():
        expected = ours(x)
        torch.testing.assert_close(with_adapter(x).logits, expected, atol=1e-4, rtol=1e-4)
        with with_adapter.disable_adapter():
            assert not torch.allclose(with_adapter(x).logits, expected, atol=1e-4)


def test_merged_export_equals_the_adapted_model(qwen_lora):
    import transformers

    from lmforge.models.load import ModelSource, load_model

    merged = transformers.AutoModelForCausalLM.from_pretrained(qwen_lora / "merged").eval()
    ours = load_model(ModelSource.at(qwen_lora / "run"), merge_lora=False).model.eval()
    x = torch.tensor([[1, 5, 900, 42, 7000, 3, 151]])
    with torch.no_grad():
        torch.testing.assert_close(merged(x).logits, ours(x), atol=1e-4, rtol=1e-4)


def test_adapter_export_of_a_full_run_or_without_a_base_is_one_line(straight, tmp_path, capfd):
    rc = lmforge_in_process("export", straight, "--adapter", tmp_path / "a")  # base init: not a HF directory
    err = capfd.readouterr().err
    assert rc == 2 and "add --base DIR" in err and "Traceback" not in err, err[-2000:]
    rc = lmforge_in_process("export", straight, "--adapter", tmp_path / "a", "--base", tmp_path / "b")
    out, err = capfd.readouterr()
    assert rc == 0, (out[-2000:], err[-2000:])
    assert (tmp_path / "a" / "adapter_model.safetensors").is_file() and (tmp_path / "b" / "config.json").is_file()


def test_grpo_with_lora_scores_kl_against_the_base_with_adapters_off(tmp_path):
    """The reference is the policy's own base (no second model): KL is 0 before the first update moves
    the adapters, and positive after."""
    from lmforge.metrics.records import read_records

    (tmp_path / "prompts.jsonl").write_text("".join(json.dumps({"prompt": f"Say {i}"}) + "\n" for i in range(8)))
    (tmp_path / "short.py").write_text("def short(prompts, completions, **f):\n"
                                       "    return [1.0 / (1 + len(c)) for c in completions]\n")
    args = tiny_run_args("prompts.jsonl", data_seq_len=None, schedule_kind="constant", schedule_warmup_steps=0,
                         training_steps=3, training_global_batch_size=8, training_micro_batch_size=8,
                         grpo_num_generations=4, grpo_max_new_tokens=6, grpo_beta=0.1, **LORA_RUN)
    rc, out, err = finish(start_lmforge("grpo", *args, "--rewards=short:short", "--run.dir=run", cwd=tmp_path), 300)
    assert rc == 0, err[-3000:]
    kl = [r["grpo/kl"] for r in read_records(tmp_path / "run") if r["kind"] == "train"]
    assert abs(kl[0]) < 1e-6 and kl[-1] > 0


def test_an_engine_weight_snapshot_folds_the_adapters_and_leaves_the_model_adapted(tmp_path):
    """What vLLM loads after a sync: a plain model's Hugging Face names with the adapters merged in; the
    trained model keeps its adapters (the merge is on a copy)."""
    from safetensors.torch import load_file

    from lmforge.models.hf import hf_state_dict_from_lmforge, lmforge_state_dict_from_hf
    from lmforge.rl.engines.snapshot import WeightSnapshots

    model = apply_lora(_model(), LoraSection(rank=4, alpha=8, target_modules=["wq", "wv", "w2"]))
    _train_adapters(model)
    x = torch.randint(0, 64, (2, 10))
    adapted = model(x).detach()
    path = WeightSnapshots(tmp_path, owned=False).write(model, 3)
    assert path.name == "weights-00000003.safetensors" and has_adapters(model)
    plain = _model(seed=1)
    saved = load_file(str(path))
    assert sorted(saved) == sorted(hf_state_dict_from_lmforge(plain.state_dict(), plain.args))
    plain.load_state_dict(lmforge_state_dict_from_hf(saved, plain.args))
    torch.testing.assert_close(plain(x), adapted, atol=1e-5, rtol=1e-5)
