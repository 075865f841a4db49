"""DPO: the loss against hand and TRL-style formulas, per-sequence log-probs against full logits,
microbatch and rank invariance, the LoRA reference, chat masks on a real tokenizer, bad records,
and the CLI end to end (metrics, resume)."""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path

import pytest
import torch

from _helpers import lmforge_in_process, tiny_run_args
from _pairs import (
    Reference, assert_two_ddp_ranks_equal_one_process, full_logit_logprob, grads_and_values, row_sample,
    split_documents, task_pairs, tiny_model,
)
from lmforge.data.chat import ByteChatFormat, chat_format_for
from lmforge.data.packing import IGNORE_INDEX, collate
from lmforge.data.preference_data import build_preference_dataset, pairs_in, read_preference_records
from lmforge.errors import UserError
from lmforge.metrics.records import read_records
from lmforge.models.model import Transformer
from lmforge.models.tokenizer import ByteTokenizer, load_tokenizer
from lmforge.objectives.dpo import DPOObjective, dpo_losses, sequence_logprobs
from lmforge.objectives.reference import FrozenReference

FIXTURES = Path(__file__).resolve().parent / "fixtures"


# ---------------------------------------------------------------------------------------- loss
def trl_style_loss(pc, pr, rc, rr, beta, loss_type, ls=0.0):
    """The DPO losses as TRL writes them, spelled out here with plain math on floats."""
    z = (pc - rc) - (pr - rr)
    if loss_type == "ipo":
        return (z - 1 / (2 * beta)) ** 2
    log_sigmoid = lambda x: -math.log1p(math.exp(-x))  # noqa: E731 (plain floats, not torch)
    return -log_sigmoid(beta * z) * (1 - ls) - log_sigmoid(-beta * z) * ls


@pytest.mark.parametrize("loss_type, ls", [("sigmoid", 0.0), ("sigmoid", 0.2), ("ipo", 0.0)])
def test_loss_and_gradient_match_hand_and_trl_formulas(loss_type, ls):
    g = torch.Generator().manual_seed(0)
    pc, pr, rc, rr = (torch.randn(6, generator=g, dtype=torch.float64) * 3 - 10 for _ in range(4))
    pc.requires_grad_(True)
    beta = 0.5
    losses = dpo_losses((pc - rc) - (pr - rr), beta=beta, loss_type=loss_type, label_smoothing=ls)
    want = [trl_style_loss(*(float(t[i].detach()) for t in (pc, pr, rc, rr)), beta, loss_type, ls) for i in range(6)]
    assert losses.tolist() == pytest.approx(want, rel=1e-12)
    losses.sum().backward()
    z = ((pc - rc) - (pr - rr)).detach()
    if loss_type == "ipo":  # d/dpc (z - 1/(2 beta))^2
        grad = 2 * (z - 1 / (2 * beta))
    else:  # d/dpc of -(1-ls) log s(bz) - ls log s(-bz): -(1-ls) b s(-bz) + ls b s(bz)
        grad = -(1 - ls) * beta * torch.sigmoid(-beta * z) + ls * beta * torch.sigmoid(beta * z)
    assert torch.allclose(pc.grad, grad, rtol=1e-12)
    # one number by hand: z = 0 gives log 2 (sigmoid) and 1 / (4 beta^2) (IPO)
    zero = dpo_losses(torch.zeros(1), beta=beta, loss_type=loss_type, label_smoothing=ls)
    assert float(zero) == pytest.approx(1 / (4 * beta ** 2) if loss_type == "ipo" else math.log(2), rel=1e-6)


# ---------------------------------------------------------------------------------------- data
def plain_sequence_logprobs(model: Transformer, dataset) -> list[float]:
    """Each sequence alone in its own batch, full logits, log_softmax, gather: the reference computation."""
    out = []
    for ex in dataset.examples:
        logits = model(torch.as_tensor(ex.input_ids)[None]).float()
        labels = torch.as_tensor(ex.labels)
        keep = labels != IGNORE_INDEX
        logp = torch.log_softmax(logits[0], -1)[keep].gather(-1, labels[keep, None])
        out.append(float(logp.sum()))
    return out


def test_packed_sequence_logprobs_equal_full_logits_and_padded_rows():
    tok = ByteTokenizer()
    recs = task_pairs(11)
    packed, summary = build_preference_dataset(recs, "t", tok, ByteChatFormat(tok), seq_len=96)
    padded, _ = build_preference_dataset(recs, "t", tok, ByteChatFormat(tok), seq_len=96, packing=False)
    assert summary.pairs == 11 and len(packed) < len(padded) == 11
    model = tiny_model(0).eval()
    want = plain_sequence_logprobs(model, packed)
    with torch.no_grad():
        for dataset in (packed, padded):
            batch = collate([dataset[i] for i in range(len(dataset))])
            assert pairs_in(batch) == 11
            got = sequence_logprobs(model, batch, chunk_tokens=7)
            assert got.tolist() == pytest.approx(want, rel=1e-5)


def test_chat_masks_on_a_real_tokenizer_cover_only_the_responses():
    tok = load_tokenizer(str(FIXTURES / "tokenizers" / "qwen2.5-instruct"))
    chat = chat_format_for(tok)
    rec = {"prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Sky colour?"},
                      {"role": "assistant", "content": "Which sky?"}, {"role": "user", "content": "Ours."}],
           "chosen": [{"role": "assistant", "content": "Blue, mostly."}],
           "rejected": [{"role": "assistant", "content": "Green"}]}
    dataset, _ = build_preference_dataset([("p.jsonl:1", rec)], "p", tok, chat, seq_len=256)
    chosen, rejected = dataset.examples
    decode = lambda ex: tok.decode([int(t) for t in ex.labels if t != IGNORE_INDEX], skip_special=False)  # noqa: E731
    assert decode(chosen) == "Blue, mostly.<|im_end|>"  # not "Which sky?" (a prompt turn), not the prompt
    assert decode(rejected) == "Green<|im_end|>"
    # the sequences are the template's own rendering of prompt + response
    full = chat.encode(rec["prompt"] + rec["chosen"]).ids
    assert list(chosen.input_ids) == full[:-1]


# ---------------------------------------------------------------------------------------- gradients
def objective_and_batch(reference: FrozenReference, rows: int = 6):
    tok = ByteTokenizer()
    dataset, _ = build_preference_dataset(task_pairs(13), "t", tok, ByteChatFormat(tok), seq_len=64)
    assert len(dataset) >= rows
    batch = collate([dataset[i] for i in range(rows)])
    return DPOObjective(reference, beta=0.3, loss_type="sigmoid", label_smoothing=0.1), batch


def test_microbatch_split_gives_the_same_gradient_and_metrics_as_a_hand_computation():
    policy, ref_model = tiny_model(1), tiny_model(2).requires_grad_(False)
    objective, batch = objective_and_batch(Reference(ref_model))
    whole, values = grads_and_values(policy, objective, [batch])
    rows = batch.input_ids.shape[0]
    parts = [collate([row_sample(batch, i) for i in idx]) for idx in ([0], [1, 2, 3], list(range(4, rows)))]
    split, split_values = grads_and_values(policy, objective, parts)
    for name in whole:
        assert torch.allclose(whole[name], split[name], rtol=1e-5, atol=1e-7), name
    for key in values:
        assert float(values[key]) == pytest.approx(float(split_values[key]), rel=1e-5, abs=1e-7), key
    # the logged values against a hand computation from per-sequence full-logit log-probs
    with torch.no_grad():
        p, r = sequence_logprobs(policy, batch).double(), sequence_logprobs(ref_model, batch).double()
    beta, n = 0.3, pairs_in(batch)
    chosen, rejected = beta * (p[0::2] - r[0::2]), beta * (p[1::2] - r[1::2])
    want_loss = sum(trl_style_loss(float(p[2 * j]), float(p[2 * j + 1]), float(r[2 * j]), float(r[2 * j + 1]), beta,
                                   "sigmoid", 0.1) for j in range(n)) / n
    assert float(values["loss"]) == pytest.approx(want_loss, rel=1e-5)
    assert float(values["rewards/chosen"]) == pytest.approx(float(chosen.mean()), rel=1e-4, abs=1e-6)
    assert float(values["rewards/margins"]) == pytest.approx(float((chosen - rejected).mean()), rel=1e-4, abs=1e-6)
    assert float(values["rewards/accuracies"]) == pytest.approx(float((chosen > rejected).double().mean()))
    assert float(values["logps/rejected"]) == pytest.approx(float(p[1::2].mean()), rel=1e-5)
    assert float(values["pairs"]) == n and float(values["total_weights"]) == int((batch.labels != IGNORE_INDEX).sum())
    # the gradient against autograd through full logits, each sequence alone, the formula written out
    policy.zero_grad()
    dataset_rows = [row_sample(batch, i) for i in range(rows)]
    seqs = [split_documents(row) for row in dataset_rows]
    logps = [full_logit_logprob(policy, ids, labels) for row in seqs for ids, labels in row]
    with torch.no_grad():
        refs = [full_logit_logprob(ref_model, ids, labels) for row in seqs for ids, labels in row]
    z = [(logps[2 * j] - refs[2 * j]) - (logps[2 * j + 1] - refs[2 * j + 1]) for j in range(n)]
    loss = sum(-0.9 * torch.nn.functional.logsigmoid(beta * zj) - 0.1 * torch.nn.functional.logsigmoid(-beta * zj)
               for zj in z) / n
    loss.backward()
    for name, p in policy.named_parameters():
        assert torch.allclose(whole[name], p.grad, rtol=1e-4, atol=1e-6), name


def test_nll_weight_adds_the_chosen_per_token_nll():
    policy, ref_model = tiny_model(1), tiny_model(2).requires_grad_(False)
    plain, batch = objective_and_batch(Reference(ref_model))
    with_nll = DPOObjective(Reference(ref_model), beta=0.3, loss_type="sigmoid", label_smoothing=0.1, nll_weight=0.5)
    with torch.no_grad():
        base, _ = plain.loss_fn(policy, batch)
        total, stats = with_nll.loss_fn(policy, batch)
        logps = sequence_logprobs(policy, batch)
    chosen_tokens = []
    for i in range(batch.input_ids.shape[0]):
        for k, (_, labels) in enumerate(split_documents(row_sample(batch, i))):
            if k % 2 == 0:
                chosen_tokens.append(int((labels != IGNORE_INDEX).sum()))
    want = float(base) + 0.5 * sum(-float(logps[2 * j]) / n for j, n in enumerate(chosen_tokens))
    assert float(total) == pytest.approx(want, rel=1e-5)
    assert float(stats.sums["dpo_loss_sum"]) == pytest.approx(float(base), rel=1e-6)  # logged as loss/dpo


def test_lora_reference_is_the_base_model_without_a_copy():
    pytest.importorskip("peft")
    from lmforge.config import LoraSection
    from lmforge.models.lora import apply_lora

    base = tiny_model(3)
    policy = apply_lora(copy.deepcopy(base), LoraSection(enabled=True, rank=4))
    with torch.no_grad():  # trained adapters: the policy now differs from its base
        for name, p in policy.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5)
    objective, batch = objective_and_batch(Reference(None))
    with torch.no_grad():
        base_logps = sequence_logprobs(base, batch)
        policy_logps = sequence_logprobs(policy, batch)
    with torch.no_grad():
        ref_logps = sequence_logprobs(objective.loss_fn.reference.model_for(policy), batch)
    assert torch.allclose(ref_logps, base_logps, rtol=1e-5)
    assert not torch.allclose(policy_logps, base_logps, rtol=1e-3)
    grads, values = grads_and_values(policy, objective, [batch])
    assert grads and all("lora_" in name for name in grads)  # only the adapters train
    assert float(values["rewards/margins"]) != 0.0


# ---------------------------------------------------------------------------------------- bad input
@pytest.mark.parametrize("line, message", [
    ('{"prompt": "p", "chosen": "a"}', "missing key 'rejected'"),
    ('{"prompt": "p", "chosen": "a", "rejected": [{"role": "assistant", "content": "b"}]}', "all strings or all"),
    (('{"prompt": [{"role": "user", "content": "p"}], "chosen": [{"role": "user", "content": "a"}], '
      '"rejected": [{"role": "assistant", "content": "b"}]}'), "'chosen' has no assistant message"),
    ('{"prompt": "p", "chosen": "a", "rejected": ', "invalid JSON"),
])
def test_bad_records_name_file_and_line(tmp_path, line, message):
    path = tmp_path / "pairs.jsonl"
    path.write_text('{"prompt": "p", "chosen": "a", "rejected": "b"}\n\n' + line + "\n")
    with pytest.raises(UserError) as e:
        read_preference_records(str(path))
    assert str(e.value).startswith(f"{path}:3: ") and message in str(e.value) and "\n" not in str(e.value)


def test_cli_refuses_embedded_data_with_one_line(tmp_path, capsys):
    from lmforge.cli import main

    rc = main(["dpo", f"--run.dir={tmp_path / 'run'}", "--dpo.loss_type=ipo", "--dpo.label_smoothing=0.1"])
    assert rc == 2 and "label_smoothing applies to the sigmoid loss only" in capsys.readouterr().err
    rc = main(["dpo", f"--run.dir={tmp_path / 'run'}", "--training.threads=0"])
    err = capsys.readouterr().err
    assert rc == 2 and err.startswith("error: data.train=embedded: DPO trains on preference records") and err.count("\n") == 1
    assert not (tmp_path / "run").exists()  # refused before the run directory was made


# ---------------------------------------------------------------------------------------- the CLI
DPO_RUN = {"data_seq_len": 96, "training_global_batch_size": 4, "training_micro_batch_size": 2, "data_prefetch": 0,
           "optimizer_lr": 1e-2, "schedule_kind": "constant", "schedule_warmup_steps": 0}
DPO_FLAGS = ("--dpo.beta=0.5",)


@pytest.fixture(scope="module")
def pairs_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("dpo") / "pairs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for _, r in task_pairs(24)))
    return path


def dpo_args(data: Path, run: Path, **overrides) -> list[str]:
    return ["dpo", *tiny_run_args(data, **{**DPO_RUN, **overrides}), *DPO_FLAGS, f"--run.dir={run}"]


def picked(run: Path) -> dict[int, list[float]]:
    keys = ("loss", "rewards/chosen", "rewards/margins", "rewards/accuracies", "logps/chosen", "grad_norm")
    return {r["step"]: [r[k] for k in keys] for r in read_records(run, "train")}


def test_cli_run_logs_dpo_metrics_and_resume_equals_uninterrupted(tmp_path, pairs_file):
    """Through the CLI's entry point in this process (test_two_ddp_ranks_equal_one_process runs the
    real CLI, under torchrun too)."""
    straight, interrupted = tmp_path / "straight", tmp_path / "interrupted"
    for args in (dpo_args(pairs_file, straight, training_steps=4, eval_interval=2, eval_steps=2, eval_batch_size=4),
                 dpo_args(pairs_file, interrupted, training_steps=2, checkpoint_interval=2),
                 dpo_args(pairs_file, interrupted, training_steps=4, checkpoint_interval=2)):  # the resume
        assert lmforge_in_process(*args) == 0, args[-1]  # what it printed is in the captured output
    assert [r["step"] for r in read_records(interrupted, "resume")] == [2]
    a, b = picked(straight), picked(interrupted)
    assert sorted(a) == sorted(b) == [1, 2, 3, 4]
    for step in (3, 4):
        assert b[step] == pytest.approx(a[step], rel=1e-5), step
    assert a[4][2] > 0  # the margin moved: the reference is live and differs from the policy
    train = read_records(straight, "train")
    assert train[0]["loss"] == pytest.approx(math.log(2), rel=1e-5)  # policy == reference at step 1
    for key in ("rewards/rejected", "logps/rejected", "pairs", "total_weights", "lr", "grad_norm", "tflops_per_device"):
        assert key in train[-1], key
    evals = read_records(straight, "eval")
    assert [e["step"] for e in evals] == [0, 2, 4]
    assert evals[0]["loss"] == pytest.approx(math.log(2), rel=1e-5) and evals[-1]["loss"] < evals[0]["loss"]
    assert {"rewards/accuracies", "rewards/margins", "logps/chosen"} <= set(evals[-1])
    data = [r for r in read_records(straight) if r["kind"] == "dpo_data"]
    assert data[0]["pairs"] == 24 and "24 records -> 24 pairs" in data[0]["message"]
    state = json.loads((interrupted / "checkpoints" / "step_00000004" / "trainer_state.json").read_text())
    assert state["data"]["reference"] == "init:0"


def test_two_ddp_ranks_equal_one_process(tmp_path, pairs_file):
    assert_two_ddp_ranks_equal_one_process(lambda run, **kw: dpo_args(pairs_file, run, **kw), picked, tmp_path)
