"""Reward models: the Bradley-Terry loss and its gradient against the formula written out, scores at the
last token against each sequence alone, microbatch and rank invariance, LoRA keeping the head trainable,
the CLI end to end (metrics, resume), the Hugging Face export against transformers, the GRPO reward,
and bad records."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from _helpers import lmforge_in_process, tiny_run_args
from _pairs import assert_two_ddp_ranks_equal_one_process, grads_and_values, row_sample, task_pairs
from lmforge.data.chat import ByteChatFormat
from lmforge.data.packing import collate
from lmforge.data.preference_data import pair_values, pairs_in
from lmforge.data.reward_data import build_reward_dataset, read_reward_records
from lmforge.data.sources import Record
from lmforge.errors import UserError
from lmforge.metrics.records import read_records
from lmforge.models.heads import attach_head
from lmforge.models.model import ModelArgs, Transformer
from lmforge.models.tokenizer import ByteTokenizer
from lmforge.objectives.reward import RewardObjective, bradley_terry_losses, sequence_scores


def log_sigmoid(x: float) -> float:
    return -math.log1p(math.exp(-x)) if x > 0 else x - math.log1p(math.exp(x))


def sigmoid(x: float) -> float:
    return math.exp(log_sigmoid(x))


# ---------------------------------------------------------------------------------------- loss
def test_loss_and_gradient_match_the_formula_written_out():
    g = torch.Generator().manual_seed(0)
    rc, rr, m = (torch.randn(7, generator=g, dtype=torch.float64) * 2 for _ in range(3))
    rc.requires_grad_(True)
    rr.requires_grad_(True)
    coef = 0.3
    losses = bradley_terry_losses(rc, rr, m, coef)
    c, r, mm = rc.tolist(), rr.tolist(), m.tolist()
    want = [-log_sigmoid(c[i] - r[i] - mm[i]) + coef * (c[i] + r[i]) ** 2 for i in range(7)]
    assert losses.tolist() == pytest.approx(want, rel=1e-12)
    losses.sum().backward()
    # d/drc = -sigmoid(-(rc - rr - m)) + 2 coef (rc + rr); d/drr = +sigmoid(-(rc - rr - m)) + 2 coef (rc + rr)
    want_c = [-sigmoid(-(c[i] - r[i] - mm[i])) + 2 * coef * (c[i] + r[i]) for i in range(7)]
    want_r = [sigmoid(-(c[i] - r[i] - mm[i])) + 2 * coef * (c[i] + r[i]) for i in range(7)]
    assert rc.grad.tolist() == pytest.approx(want_c, rel=1e-10)
    assert rr.grad.tolist() == pytest.approx(want_r, rel=1e-10)
    assert float(bradley_terry_losses(torch.zeros(1), torch.zeros(1))) == pytest.approx(math.log(2))


# ---------------------------------------------------------------------------------------- data, scores
def rm_pairs(n: int, margins: bool = True) -> list[Record]:
    """The preference tests' pairs of varied lengths, some with a margin."""
    out = task_pairs(n)
    for i, (_, rec) in enumerate(out):
        if margins and i % 3:
            rec["margin"] = 0.25 * (i % 4)
    return out


def tiny_model(seed: int, head_seed: int | None = 5) -> Transformer:
    model = Transformer(ModelArgs(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=320, max_seq_len=128))
    model.init_weights(seed=seed)
    attach_head(model, "score")
    if head_seed is not None:
        with torch.no_grad():
            model.score.weight.normal_(0, 1.0, generator=torch.Generator().manual_seed(head_seed))
    return model


def dataset(n: int = 11, seq_len: int = 96, packing: bool = True, margins: bool = True):
    tok = ByteTokenizer()
    return build_reward_dataset(rm_pairs(n, margins), "t", tok, ByteChatFormat(tok), seq_len=seq_len, packing=packing)


def test_scores_at_the_last_token_equal_each_sequence_alone():
    packed, summary = dataset()
    padded, _ = dataset(packing=False)
    assert summary.pairs == 11 and len(packed) < len(padded) == 11
    model = tiny_model(0).eval()
    with torch.no_grad():
        want = [float(model.hidden_states(torch.as_tensor(ex.input_ids)[None])[0, -1] @ model.score.weight[0])
                for ex in packed.examples]
        for data in (packed, padded):
            batch = collate([data[i] for i in range(len(data))])
            assert pairs_in(batch) == 11
            assert sequence_scores(model, batch).tolist() == pytest.approx(want, rel=1e-5, abs=1e-6)
    # the whole sequence is read: a chat sequence ends in the template's end of turn, plain text in EOS
    tok = ByteTokenizer()
    assert packed.examples[0].input_ids[-1] == tok.eos_id
    margins = [0.25 * (i % 4) if i % 3 else 0.0 for i in range(11)]
    assert [ex.value for ex in packed.examples[0::2]] == margins
    batch = collate([packed[i] for i in range(len(packed))])
    assert pair_values(batch, torch.device("cpu")).tolist() == margins  # packed rows keep the data order


def close(a: torch.Tensor, b: torch.Tensor, rel: float) -> bool:
    """Equal up to ``rel`` of the tensor's largest entry (float32 sums in another order)."""
    return float((a - b).abs().max()) <= rel * float(a.abs().max())


def test_microbatch_split_gradient_and_metrics_equal_the_formula():
    data, _ = dataset(13, seq_len=64)
    rows = 6
    batch = collate([data[i] for i in range(rows)])
    model, objective, coef = tiny_model(1), RewardObjective(0.1), 0.1
    whole, values = grads_and_values(model, objective, [batch])
    parts = [collate([row_sample(batch, i) for i in idx]) for idx in ([0], [1, 2, 3], list(range(4, rows)))]
    split, split_values = grads_and_values(model, objective, parts)
    assert "output.weight" not in whole and whole["score.weight"].abs().sum() > 0  # the vocabulary layer is frozen
    for name in whole:
        assert close(whole[name], split[name], 1e-5), name
    for key in values:
        assert float(values[key]) == pytest.approx(float(split_values[key]), rel=1e-5, abs=1e-7), key
    # by hand: each sequence alone, score at its last token, the loss written out
    model.zero_grad()
    seqs = []
    for i in range(rows):
        s, at = row_sample(batch, i), 0
        for n, value in zip(s.document_lengths, s.document_values):
            seqs.append((s.input_ids[at:at + n], value))
            at += n
    scores = [model.hidden_states(ids[None])[0, -1] @ model.score.weight[0] for ids, _ in seqs]
    n = pairs_in(batch)
    terms = [-torch.nn.functional.logsigmoid(scores[2 * j] - scores[2 * j + 1] - seqs[2 * j][1])
             + coef * (scores[2 * j] + scores[2 * j + 1]) ** 2 for j in range(n)]
    (sum(terms) / n).backward()
    for name, p in model.named_parameters():
        if p.grad is not None:
            assert close(whole[name], p.grad, 1e-4), name
    c = [float(scores[2 * j].detach()) for j in range(n)]
    r = [float(scores[2 * j + 1].detach()) for j in range(n)]
    assert float(values["loss"]) == pytest.approx(float(sum(terms).detach()) / n, rel=1e-5)
    assert float(values["pair_accuracy"]) == pytest.approx(sum(a > b for a, b in zip(c, r)) / n)
    assert float(values["score/chosen"]) == pytest.approx(sum(c) / n, rel=1e-4, abs=1e-6)
    assert float(values["score/margin"]) == pytest.approx((sum(c) - sum(r)) / n, rel=1e-4, abs=1e-6)
    assert float(values["pairs"]) == n


def test_lora_keeps_the_score_head_trainable():
    pytest.importorskip("peft")
    from lmforge.config import LoraSection
    from lmforge.models.lora import apply_lora

    model = tiny_model(3)
    apply_lora(model, LoraSection(enabled=True, rank=4))  # freezes everything it does not add...
    attach_head(model, "score")  # ...and the runtime adds the head after it (training/runtime.py)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.1)
    data, _ = dataset(6, seq_len=64)
    grads, _ = grads_and_values(model, RewardObjective(), [collate([data[i] for i in range(len(data))])])
    assert "score.weight" in grads and all("lora_" in n or n == "score.weight" for n in grads)


# ---------------------------------------------------------------------------------------- bad input
def test_bad_margin_is_one_line_naming_file_and_line(tmp_path, capsys):
    path = tmp_path / "pairs.jsonl"
    path.write_text('{"prompt": "p", "chosen": "a", "rejected": "b", "margin": 1}\n'
                    '{"prompt": "p", "chosen": "a", "rejected": "b", "margin": "big"}\n')
    with pytest.raises(UserError) as e:
        read_reward_records(str(path))
    assert str(e.value).startswith(f"{path}:2: 'margin' must be a finite number") and "\n" not in str(e.value)
    from lmforge.cli import main

    rc = main(["rm", f"--data.train={path}", f"--run.dir={tmp_path / 'run'}", "--training.threads=0"])
    err = capsys.readouterr().err
    assert rc == 2 and err.startswith(f"error: {path}:2: 'margin'") and err.count("\n") == 1
    assert not (tmp_path / "run").exists()  # refused before the run directory was made


@pytest.mark.parametrize("margin", ["1e400", "1" + "0" * 400, "1e308", "-3e38", "20000"])
def test_margins_beyond_any_score_are_refused_at_data_check(tmp_path, capsys, margin):
    """1e400 is infinite once read, a 400-digit integer overflows float(), and 1e308 is finite but makes an
    infinite loss at step 1: each is the line's error before the run directory exists."""
    from lmforge.cli import main

    path = tmp_path / "pairs.jsonl"
    path.write_text('{"prompt": "p", "chosen": "a", "rejected": "b", "margin": 2.5}\n'
                    '{"prompt": "p", "chosen": "a", "rejected": "b", "margin": %s}\n' % margin)
    rc = main(["rm", f"--data.train={path}", f"--run.dir={tmp_path / 'run'}", "--training.threads=0"])
    err = capsys.readouterr().err
    assert rc == 2 and err.startswith(f"error: {path}:2: 'margin' must be a finite number within") and err.count("\n") == 1
    assert not (tmp_path / "run").exists()


# ---------------------------------------------------------------------------------------- the CLI
RM_RUN = {"data_seq_len": 96, "training_global_batch_size": 4, "training_micro_batch_size": 2, "data_prefetch": 0,
          "optimizer_lr": 1e-2, "schedule_kind": "constant", "schedule_warmup_steps": 0}


@pytest.fixture(scope="module")
def pairs_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("rm") / "pairs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for _, r in rm_pairs(24)))
    return path


def rm_args(data: Path, run: Path, **overrides) -> list[str]:
    return ["rm", *tiny_run_args(data, **{**RM_RUN, **overrides}), "--rm.center_rewards_coefficient=0.01",
            f"--run.dir={run}"]


def picked(run: Path) -> dict[int, list[float]]:
    keys = ("loss", "pair_accuracy", "score/chosen", "score/margin", "grad_norm")
    return {r["step"]: [r[k] for k in keys] for r in read_records(run, "train")}


@pytest.fixture(scope="module")
def rm_run(tmp_path_factory, pairs_file) -> Path:
    """A finished 4-step run with evals at steps 0, 2 and 4 (in this process, through the CLI's entry point)."""
    run = tmp_path_factory.mktemp("rm") / "straight"
    args = rm_args(pairs_file, run, training_steps=4, eval_interval=2, eval_steps=2, eval_batch_size=4)
    assert lmforge_in_process(*args) == 0
    return run


def test_cli_run_logs_rm_metrics_and_resume_equals_uninterrupted(tmp_path, pairs_file, rm_run):
    interrupted = tmp_path / "interrupted"
    for args in (rm_args(pairs_file, interrupted, training_steps=2, checkpoint_interval=2),
                 rm_args(pairs_file, interrupted, training_steps=4, checkpoint_interval=2)):  # the resume
        assert lmforge_in_process(*args) == 0, args[-1]
    assert [r["step"] for r in read_records(interrupted, "resume")] == [2]
    a, b = picked(rm_run), picked(interrupted)
    assert sorted(a) == sorted(b) == [1, 2, 3, 4]
    for step in (3, 4):
        assert b[step] == pytest.approx(a[step], rel=1e-5), step
    train = read_records(rm_run, "train")
    evals = read_records(rm_run, "eval")
    # a zero head scores every sequence 0: the starting loss is the mean of -log sigmoid(-margin) over the
    # evaluated pairs (the first 8 rows), log 2 where a pair has no margin
    data, _ = dataset(24, seq_len=96)
    margins = [data.examples[j].value for row in data.bins[:8] for j in row[0::2]]
    assert evals[0]["loss"] == pytest.approx(sum(-log_sigmoid(-m) for m in margins) / len(margins), rel=1e-6)
    assert 0.0 in margins and len(set(margins)) > 1
    for key in ("score/rejected", "loss/bt", "pairs", "total_weights", "lr", "grad_norm", "tflops_per_device"):
        assert key in train[-1], key
    assert [e["step"] for e in evals] == [0, 2, 4]
    assert evals[0]["pair_accuracy"] == 0.5 and evals[-1]["loss"] < evals[0]["loss"]
    assert evals[-1]["pair_accuracy"] > 0.5
    data = [r for r in read_records(rm_run) if r["kind"] == "rm_data"]
    assert data[0]["pairs"] == 24 and "rm data" in data[0]["message"]
    state = json.loads((interrupted / "checkpoints" / "step_00000004" / "trainer_state.json").read_text())
    assert state["model"]["head"] == "score"


def test_two_ddp_ranks_equal_one_process(tmp_path, pairs_file):
    assert_two_ddp_ranks_equal_one_process(lambda run, **kw: rm_args(pairs_file, run, **kw), picked, tmp_path)


# ---------------------------------------------------------------------------------------- export, GRPO
def test_grpo_reward_is_the_score_of_the_rendered_sequence(rm_run):
    from lmforge.models.load import ModelSource, load_model
    from lmforge.rl.rewards import load_rewards, score_completions

    (reward,) = load_rewards([f"rm:{rm_run}"])
    prompts = ["What is 2 plus 5?", [{"role": "user", "content": "Name a colour."}]]
    completions = ["7", "Blue, mostly."]
    got = score_completions([reward], prompts, completions, {}).total
    model = load_model(ModelSource.at(rm_run)).model.eval()
    tok = ByteTokenizer()
    records = [(f"r:{i}", {"prompt": [{"role": "user", "content": p}] if isinstance(p, str) else p,
                           "chosen": [{"role": "assistant", "content": c}],
                           "rejected": [{"role": "assistant", "content": "x"}]})
               for i, (p, c) in enumerate(zip(prompts, completions))]
    data, _ = build_reward_dataset(records, "r", tok, ByteChatFormat(tok), seq_len=96, packing=False)
    with torch.no_grad():
        want = sequence_scores(model, collate([data[i] for i in range(len(data))]))[0::2]
    assert got == pytest.approx(want.tolist(), rel=1e-5, abs=1e-6) and len(set(got)) == 2
    # the run exported (lmforge export --hf) gives the same rewards
    from lmforge.exporters import export_hf

    out = export_hf(rm_run, rm_run.parent / "exported")
    (exported,) = load_rewards([f"rm:{out}"])
    assert score_completions([exported], prompts, completions, {}).total == pytest.approx(got, rel=1e-5, abs=1e-6)


def test_a_language_model_is_refused_as_a_reward(tmp_path):
    from lmforge.exporters import write_hf_dir

    plain = Transformer(ModelArgs(dim=32, n_layers=1, n_heads=4, vocab_size=320, max_seq_len=64))
    write_hf_dir(plain, ByteTokenizer(), tmp_path)
    with pytest.raises(UserError, match="is not a reward model"):
        load_rewards_named(f"rm:{tmp_path}")


def load_rewards_named(name: str):
    from lmforge.rl.rewards import load_rewards

    return load_rewards([name])


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_hf_export_scores_equal_transformers(tmp_path, family):
    transformers = pytest.importorskip("transformers")
    from lmforge.exporters import write_hf_dir
    from lmforge.models.hf import load_hf_model
    from lmforge.rl.reward_model import RewardModelReward

    common = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=320, max_position_embeddings=128, rms_norm_eps=1e-6)
    cfg = (transformers.LlamaConfig(**common, tie_word_embeddings=False) if family == "llama"
           else transformers.Qwen2Config(**common, tie_word_embeddings=True))
    torch.manual_seed(0)
    start = tmp_path / "start"
    hf = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.normal_(1.0 if "norm" in name else 0.0, 0.3)
    hf.save_pretrained(start)
    model = load_hf_model(start)
    attach_head(model, "score")
    with torch.no_grad():
        model.score.weight.normal_(0, 1.0, generator=torch.Generator().manual_seed(1))
    out = tmp_path / "rm"
    tok = ByteTokenizer()
    write_hf_dir(model, tok, out)
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"][0].endswith("ForSequenceClassification") and config["pad_token_id"] == tok.pad_id
    classifier = transformers.AutoModelForSequenceClassification.from_pretrained(out).eval()
    assert classifier.config.num_labels == 1 and classifier.score.weight.shape == (1, 32)
    data, _ = dataset(9, seq_len=64, packing=False)
    batch = collate([data[i] for i in range(len(data))])  # one sequence per row, right-padded with pad_id
    with torch.no_grad():
        ours = sequence_scores(model, batch)
        padded = torch.full((len(data) * 2, 64), tok.pad_id)
        for k, ex in enumerate(data.examples):
            padded[k, :len(ex)] = torch.as_tensor(ex.input_ids)
        theirs = classifier(padded).logits[:, 0]
        torch.testing.assert_close(theirs, ours, atol=1e-5, rtol=1e-5)
        # and back: lmforge reads the exported directory (GRPO's rm:DIR) with the same scores
        again = load_hf_model(out)
        torch.testing.assert_close(sequence_scores(again, batch), ours, atol=1e-6, rtol=1e-6)
    reward = RewardModelReward(str(out))
    assert reward.score([list(data.examples[0].input_ids)]).tolist() == pytest.approx([float(ours[0])], abs=1e-5)
