"""SFT data and trainer: packing equals unpacked, loss tokens, bad input, tasks, the CLI end to end."""

from __future__ import annotations

import json

import pytest
import torch

from _helpers import run_lmforge, tiny_run_args
from lmforge.data.chat import ByteChatFormat
from lmforge.data.packing import IGNORE_INDEX, collate
from lmforge.data.sft_data import build_sft_dataset, read_sft_records, task_records
from lmforge.data.tasks import TASK_NAMES, extract_answer, format_ok, is_correct, task_examples
from lmforge.errors import UserError
from lmforge.metrics.records import read_records
from lmforge.models.model import ModelArgs, Transformer
from lmforge.models.tokenizer import ByteTokenizer
from lmforge.objectives.next_token import cross_entropy_loss

SFT_RUN = {"data_seq_len": 64, "training_global_batch_size": 4, "data_prefetch": 0, "schedule_warmup_steps": None}
"""Overrides of tiny_run_args common to the SFT runs (the warm-up left at its default)."""


def records(n: int = 13):
    recs = task_records(task_examples("train", n))
    recs.append(("x:1", {"prompt": "Say hi:", "completion": " hi"}))
    recs.append(("x:2", {"text": "plain text trains on every token"}))
    recs.append(("x:3", {"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "q1"},
                                      {"role": "assistant", "content": "a1"}, {"role": "user", "content": "q2"},
                                      {"role": "assistant", "content": "answer two"}]}))
    return recs


def expected_loss_tokens(recs) -> int:
    n = 0
    for _, r in recs:
        if "messages" in r:  # assistant content + the EOS closing each assistant turn
            n += sum(len(m["content"].encode()) + 1 for m in r["messages"] if m["role"] == "assistant")
        elif "prompt" in r:
            n += len(r["completion"].encode()) + 1
        else:  # every token but the first is a target (plus EOS)
            n += len(r["text"].encode())
    return n


def summed_loss(model, dataset, batch_size=4):
    total, weights, correct = 0.0, 0, 0
    for lo in range(0, len(dataset), batch_size):
        batch = collate([dataset[i] for i in range(lo, min(lo + batch_size, len(dataset)))])
        with torch.no_grad():
            loss, stats = cross_entropy_loss(model, batch)
        total += float(loss)
        weights += int(stats.target_tokens)
        correct += int(stats.sums["correct"])
    return total, weights, correct


def test_packed_loss_equals_unpacked_and_weights_are_exact():
    tok = ByteTokenizer()
    chat = ByteChatFormat(tok)
    recs = records()
    packed, summary = build_sft_dataset(recs, "t", tok, chat, seq_len=96, packing=True)
    padded, _ = build_sft_dataset(recs, "t", tok, chat, seq_len=96, packing=False)
    assert len(packed) < len(padded) == len(recs)
    assert summary.loss_tokens == expected_loss_tokens(recs)
    model = Transformer(ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=tok.vocab_size,
                                  max_seq_len=128))
    model.init_weights(seed=0)
    with torch.no_grad():  # peaked logits make any leak between examples visible in the loss
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(4.0)
    model.eval()
    lp, wp, cp = summed_loss(model, packed)
    lu, wu, cu = summed_loss(model, padded)
    assert wp == wu == expected_loss_tokens(recs)
    assert lp == pytest.approx(lu, rel=1e-5)
    assert cp == cu
    # Positions restart per example, and no example's first token is a target of the previous one.
    s = packed[0]
    starts = [t for t in range(1, 96) if s.document_ids[t] != s.document_ids[t - 1]]
    assert starts and all(int(s.position_ids[t]) == 0 for t in starts)
    assert all(int(s.labels[t - 1]) in (IGNORE_INDEX, tok.eos_id) for t in starts)


def test_loss_on_all_and_skip_truncate_summary():
    tok = ByteTokenizer()
    chat = ByteChatFormat(tok)
    recs = records(4) + [
        ("x:4", {"messages": [{"role": "user", "content": "no answer here"}]}),
        ("x:5", {"prompt": "long " * 40, "completion": "y"}),
    ]
    ds, summary = build_sft_dataset(recs, "x", tok, chat, seq_len=64, overlong="skip")
    assert (summary.no_loss_tokens, summary.too_long, summary.truncated) == (1, 1, 0)
    assert summary.examples == len(recs) - 2
    assert "skipped 1 without loss tokens; 1 of 9 records (11.1%) longer than 65 tokens: SKIPPED" in summary.line()
    ds, summary = build_sft_dataset(recs, "x", tok, chat, seq_len=64, overlong="truncate")
    # The prompt loses its start; the completion stays whole (tests/test_overlong.py has the details).
    assert (summary.no_loss_tokens, summary.too_long, summary.truncated) == (1, 0, 1)
    all_ds, all_summary = build_sft_dataset(recs[:4], "x", tok, chat, seq_len=64, loss_on="all")
    assert all_summary.loss_tokens == sum(len(chat.encode(r["messages"]).ids) - 1 for _, r in recs[:4])


def test_bad_jsonl_names_file_and_line(tmp_path):
    f = tmp_path / "chats.jsonl"
    f.write_text('{"prompt": "a", "completion": "b"}\n\n{"prompt": "a", "completion": \n')
    with pytest.raises(UserError, match=r"chats.jsonl:3: invalid JSON"):
        read_sft_records(f)
    f.write_text('{"prompt": "a", "completion": "b"}\n{"question": "a"}\n')
    with pytest.raises(UserError, match=r"chats.jsonl:2: record has none of"):
        build_sft_dataset(read_sft_records(f), str(f), ByteTokenizer(), None, seq_len=32)
    f.write_text('{"messages": [{"role": "user", "content": 3}]}\n')
    with pytest.raises(UserError, match=r"chats.jsonl:1: message 0 needs string"):
        build_sft_dataset(read_sft_records(f), str(f), ByteTokenizer(), ByteChatFormat(ByteTokenizer()), seq_len=32)


def test_parquet_records(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    rows = [{"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}] * 3
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "d.parquet")
    recs = read_sft_records(tmp_path)
    tok = ByteTokenizer()
    _, summary = build_sft_dataset(recs, "p", tok, ByteChatFormat(tok), seq_len=32)
    assert summary.examples == 3 and summary.loss_tokens == 3 * 2


def test_tasks_are_deterministic_disjoint_and_scored():
    train, test = task_examples("train", 3000), task_examples("test")
    assert task_examples("train", 30) == train[:30] and task_examples("test", 9) == test[:9]
    assert {e.task for e in train[:3]} == set(TASK_NAMES)
    assert not {e.prompt for e in train} & {e.prompt for e in test}
    for e in train[:30]:
        if e.task == "add":
            a, b = map(int, e.prompt.replace("?", "").replace(".", "").replace("and", "+").split()[-3::2])
            assert e.answer == str(a + b)
        assert format_ok(e.answer) and is_correct(f" {e.answer}\n", e.answer)
    assert extract_answer("\n 42.\nmore") == "42" and not is_correct("4 2", "42")
    assert not format_ok("the answer is 42") and not format_ok("42\n43")
    assert task_examples("train", 5, tasks=["sort"])[0].task == "sort"


def test_sft_cli_end_to_end(tmp_path):
    data = tmp_path / "chats.jsonl"
    lines = [json.dumps(r) for _, r in records(40)]
    lines.append(json.dumps({"messages": [{"role": "user", "content": "nobody answers"}]}))
    lines.append(json.dumps({"prompt": "x" * 300, "completion": "too long"}))
    data.write_text("\n".join(lines) + "\n")
    run = tmp_path / "run"
    r = run_lmforge("sft", *tiny_run_args(data, **SFT_RUN, training_steps=4, training_micro_batch_size=2,
                                          eval_interval=2, eval_steps=2, eval_batch_size=4, metrics_log_every=2),
                    f"--run.dir={run}")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "skipped 1 without loss tokens; 1 of 45 records (2.2%) longer than 65 tokens: TRUNCATED" in r.stdout
    recs = read_records(run)
    train = [x for x in recs if x["kind"] == "train"]
    assert train and all(k in train[-1] for k in ("loss", "total_weights", "accuracy", "tokens_per_sec_per_device"))
    evals = [x for x in recs if x["kind"] == "eval"]
    assert [e["step"] for e in evals] == [0, 2, 4] and "accuracy" in evals[-1]
    assert any(x["kind"] == "sft_data" and x["truncated"] == 1 and x["skipped_too_long"] == 0 for x in recs)
    assert (run / "checkpoints").is_dir()


def test_embedded_tasks_report_exact_match(tmp_path, capsys):
    """In-process (the CLI's main), to save an interpreter start; the subprocess path is tested above."""
    from lmforge.cli import main

    run = tmp_path / "run"
    rc = main(["sft", *tiny_run_args(**SFT_RUN, training_steps=2, training_micro_batch_size=4, tasks_train_examples=64,
                                     tasks_eval_examples=6, eval_interval=2, eval_steps=1, checkpoint_enabled=False,
                                     training_threads=None),  # in-process: leave pytest's torch threads as they are
               f"--run.dir={run}"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "exact_match=" in out and "held-out exact match (greedy):" in out
    evals = read_records(run, "eval")
    assert [e["step"] for e in evals] == [0, 2]
    assert {"exact_match", "exact_match_add", "exact_match_reverse", "exact_match_sort", "loss"} <= set(evals[0])


def test_missing_starting_checkpoint_is_one_line(tmp_path, capsys):
    from lmforge.cli import main

    rc = main(["sft", f"--model.from_checkpoint={tmp_path / 'nothing'}", f"--run.dir={tmp_path / 'run'}"])
    err = capsys.readouterr().err
    assert rc == 2
    assert err.startswith("error: model.from_checkpoint=") and "lmforge pretrain" in err


def test_a_subset_of_the_embedded_tasks_keeps_their_share_of_each_split():
    """SFT on `add` alone trains on add's 4,000 train problems and scores add's 200 held-out ones (as GRPO
    does), instead of asking add for the whole split's 12,000 or taking 600 test problems, 400 of them
    beyond add's held-out share."""
    from lmforge.data.sft_inputs import sft_datasets
    from lmforge.recipes.sft import SFTConfig

    cfg = SFTConfig()
    cfg.tasks.names = ["add"]
    tok = ByteTokenizer()
    seen = {}
    sft_datasets(cfg, tok, ByteChatFormat(tok), lambda split, summary: seen.setdefault(split, summary.records))
    assert seen == {"train": 4000, "test": 200}
    test = {e.prompt for e in task_examples("test", 600)} & {e.prompt for e in task_examples("test", 200, ["add"])}
    assert len(test) == 200  # the held-out add problems are the full split's add problems
