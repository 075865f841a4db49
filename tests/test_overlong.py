"""``data.overlong``: records longer than a row, truncated (the default) or skipped, the same way for SFT
(and distillation, which reads SFT data) and every preference recipe, with count and share on the data
summary line."""

from __future__ import annotations

import json

import pytest

from _helpers import lmforge_in_process, tiny_run_args
from lmforge.config import DataSection, load_config
from lmforge.data.chat import ByteChatFormat
from lmforge.data.overlong import fit_pair, fit_sequence
from lmforge.data.packing import IGNORE_INDEX
from lmforge.data.preference_data import build_preference_dataset
from lmforge.data.reward_data import build_reward_dataset
from lmforge.data.sft_data import build_sft_dataset
from lmforge.errors import UserError
from lmforge.metrics.records import read_records
from lmforge.models.tokenizer import ByteTokenizer

TOK = ByteTokenizer()


def _seq(prompt: int, response: int) -> tuple[list[int], list[bool]]:
    return list(range(prompt + response)), [False] * prompt + [True] * response


def test_the_prompt_is_cut_from_the_left_then_the_response_from_the_right():
    ids, mask = _seq(10, 4)
    assert fit_sequence((ids, mask), 20) == ((ids, mask), False)
    assert fit_sequence((ids, mask), 8) == ((ids[6:], mask[6:]), False)  # the last 8 tokens: response whole
    ids, mask = _seq(10, 12)
    assert fit_sequence((ids, mask), 8) == ((ids[9:17], mask[9:17]), True)  # one prompt token stays
    ids, mask = _seq(0, 12)  # no prompt (text records, loss on all): the tail goes
    assert fit_sequence((ids, mask), 8) == ((ids[:8], mask[:8]), True)


def test_a_pair_is_cut_together():
    (c, cm), (r, rm) = _seq(10, 3), _seq(10, 5)
    (c2, cm2), (r2, rm2), cut = fit_pair((c, cm), (r, rm), 16)
    assert not cut and len(c2) + len(r2) == 16 and c2 == c[6:] and r2 == r[6:]  # both prompts keep 4 tokens
    (c2, cm2), (r2, rm2), cut = fit_pair(_seq(10, 12), _seq(6, 20), 16)  # one prompt token each, tails cut
    assert cut and (sum(cm2), sum(rm2), len(c2) + len(r2)) == (7, 7, 16) and not cm2[0] and not rm2[0]
    (c2, cm2), (r2, rm2), cut = fit_pair(_seq(10, 2), _seq(10, 30), 16)  # the short response stays whole
    assert cut and (sum(cm2), sum(rm2)) == (2, 12)


def _sft_records(n_long: int, n_short: int) -> list:
    long = [(f"x:{i}", {"prompt": "context " * 8, "completion": f" answer {i}"}) for i in range(n_long)]
    return long + [(f"y:{i}", {"prompt": "q", "completion": " a"}) for i in range(n_short)]


def test_sft_truncation_keeps_the_response_and_the_last_tokens():
    recs = _sft_records(2, 3)
    ds, summary = build_sft_dataset(recs, "x", TOK, None, seq_len=32, packing=False)
    assert (summary.truncated, summary.too_long, summary.examples) == (2, 0, 5)
    assert ("; 2 of 5 records (40.0%) longer than 33 tokens: TRUNCATED (data.overlong=truncate: prompt cut from "
            "the left; every response kept whole)") in summary.line()
    for k in range(2):
        full = TOK.encode(recs[k][1]["prompt"]) + TOK.encode(recs[k][1]["completion"], add_eos=True)
        ex = ds.examples[k]
        assert ex.input_ids.tolist() == full[-33:-1]  # the last 33 tokens, shifted
        assert [t for t in ex.labels.tolist() if t != IGNORE_INDEX] == TOK.encode(recs[k][1]["completion"],
                                                                                   add_eos=True)
    _, skipped = build_sft_dataset(recs, "x", TOK, None, seq_len=32, overlong="skip")
    assert (skipped.too_long, skipped.examples) == (2, 3)
    assert "2 of 5 records (40.0%) longer than 33 tokens: SKIPPED (data.overlong=skip" in skipped.line()


def test_sft_a_response_longer_than_the_row_loses_its_end_and_says_so():
    recs = [("x:0", {"prompt": "q", "completion": "z" * 50})]
    ds, summary = build_sft_dataset(recs, "x", TOK, None, seq_len=32)
    assert summary.responses_cut == 1 and "1 with the response's end cut too" in summary.line()
    assert len(ds.examples[0]) == 32 and ds.examples[0].input_ids[0] == TOK.encode("q")[-1]


def _pairs(n_long: int, n_short: int, chat: bool = False) -> list:
    def rec(prompt: str, i: int) -> dict:
        if chat:
            return {"prompt": [{"role": "user", "content": prompt}], "chosen": [{"role": "assistant", "content": f"yes {i}"}],
                    "rejected": [{"role": "assistant", "content": "no, never"}]}
        return {"prompt": prompt, "chosen": f" yes {i}", "rejected": " no, never"}
    return [(f"p:{i}", rec("long context " * 6, i)) for i in range(n_long)] + \
        [(f"s:{i}", rec("q", i)) for i in range(n_short)]


def _response(ex) -> list[int]:
    return [t for t in ex.labels.tolist() if t != IGNORE_INDEX]


@pytest.mark.parametrize("chat", [False, True])
def test_pairs_fit_one_row_with_whole_responses(chat):
    recs, seq_len, fmt = _pairs(3, 1, chat), 64, ByteChatFormat(TOK) if chat else None
    ds, summary = build_preference_dataset(recs, "x", TOK, fmt, seq_len=seq_len)
    assert (summary.truncated, summary.responses_cut, summary.pairs) == (3, 0, 4)
    assert "3 of 4 pairs (75.0%) longer than a row of 64 tokens (both sequences): TRUNCATED" in summary.line()
    for j in range(3):
        c, r = ds.examples[2 * j], ds.examples[2 * j + 1]
        assert len(c) + len(r) <= seq_len
        untruncated = build_preference_dataset([recs[j]], "x", TOK, fmt, seq_len=1000)[0].examples
        assert _response(c) == _response(untruncated[0]) and _response(r) == _response(untruncated[1])
        assert c.input_ids.tolist() == untruncated[0].input_ids.tolist()[-len(c):]  # the last tokens stay
    _, skipped = build_preference_dataset(recs, "x", TOK, fmt, seq_len=seq_len, overlong="skip")
    assert (skipped.too_long, skipped.pairs) == (3, 1) and "3 of 4 pairs (75.0%)" in skipped.line()


def test_reward_pairs_fit_one_row_whole():
    recs = _pairs(2, 0)
    ds, summary = build_reward_dataset(recs, "x", TOK, None, seq_len=48)
    assert summary.truncated == 2 and all(len(ds.examples[2 * j]) + len(ds.examples[2 * j + 1]) <= 48 for j in range(2))
    assert ds.examples[0].input_ids.tolist()[-1] == TOK.eos_id  # a reward model scores the sequence's last token


def test_the_default_is_truncate_and_the_old_key_is_named():
    assert DataSection().overlong == "truncate"
    from lmforge.recipes.sft import SFTConfig

    with pytest.raises(UserError, match=r"config key `sft.too_long` is now `data.overlong`"):
        load_config(SFTConfig, None, ["--sft.too_long=skip"])


@pytest.mark.parametrize("overlong", ["truncate", "skip"])
def test_dpo_run_reports_its_overlong_pairs(tmp_path, overlong, capfd):
    data = tmp_path / "pairs.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for _, r in _pairs(2, 6)))
    run = tmp_path / "run"
    args = tiny_run_args(data, training_steps=1, training_global_batch_size=2, training_micro_batch_size=2,
                         data_seq_len=48, checkpoint_enabled=False)
    assert lmforge_in_process("dpo", *args, f"--data.overlong={overlong}", f"--run.dir={run}") == 0, \
        capfd.readouterr().err[-2000:]
    (line,) = [r["message"] for r in read_records(run) if r["kind"] == "dpo_data" and r.get("split") == "train"]
    assert f"2 of 8 pairs (25.0%) longer than a row of 48 tokens (both sequences): {overlong.upper()}" in line
