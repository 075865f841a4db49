"""lmforge models in the lm-evaluation-harness: the same numbers as the harness's own ``hf`` model on the
exported directory, the same exact match as lmforge's own eval, the CLI, and downstream scores in training."""

from __future__ import annotations

import builtins
import json
import sys

import pytest

from _chat_fixtures import REAL_TOKENIZERS, make_hf_model_dir
from _helpers import small_corpus, tiny_run_args
from lmforge.cli import main
from lmforge.data.tasks import TaskExample, extract_answer, task_examples
from lmforge.evaluation.harness import SHIPPED_TASKS, LMForgeLM, evaluate_tasks, flat_scores
from lmforge.evaluation.tasks import task_accuracy
from lmforge.exporters import export_hf
from lmforge.inference import load_for_inference, sample_texts
from lmforge.metrics.records import read_records

pytest.importorskip("lm_eval")
pytest.importorskip("transformers")

from lm_eval import simple_evaluate  # the harness itself, for its own `hf` model type
from lm_eval.api.instance import Instance
from lm_eval.models.huggingface import HFLM
from lm_eval.tasks import TaskManager

# One SFT step at a high learning rate: a byte model whose greedy replies are short and often non-empty.
SFT_ONE_STEP = ["--tasks.train_examples=32", "--tasks.eval_examples=0", "--data.validation=none",
                "--training.steps=1", "--model.max_seq_len=128", "--optimizer.lr=1e-2"]
REQUESTS = [("", "hello world"), ("The cat", " sat on the mat"), ("What is 2 + 2?", "\n4"),
            ("a trailing space ", "moves to the continuation"), ("x", "y"), ("<|im_start|>user\nhi", " there")]
LONG_TEXT = "the model reads a long text in windows of its context length; " * 12


@pytest.fixture(scope="module")
def byte_run(tmp_path_factory):
    run = tmp_path_factory.mktemp("harness") / "run"
    assert main(["sft", *tiny_run_args(), *SFT_ONE_STEP, f"--run.dir={run}"]) == 0
    return run


@pytest.fixture(scope="module")
def byte_hf(byte_run, tmp_path_factory):
    return export_hf(byte_run, tmp_path_factory.mktemp("harness") / "hf")


@pytest.fixture(scope="module")
def bpe_hf(tmp_path_factory):
    """A transformers-written Llama with a BPE tokenizer and a ChatML template (another family)."""
    return make_hf_model_dir(tmp_path_factory.mktemp("harness") / "bpe")


@pytest.fixture(scope="module")
def mistral_hf(tmp_path_factory):
    """A tiny random Llama with Mistral's tokenizer, which adds BOS to plain text (as the hf model does)."""
    import torch
    import transformers

    out = tmp_path_factory.mktemp("harness") / "mistral"
    out.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (out / name).write_bytes((REAL_TOKENIZERS / "mistral-7b-instruct-v0.1" / name).read_bytes())
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                                   num_key_value_heads=1, vocab_size=32000, max_position_embeddings=64,
                                   tie_word_embeddings=True, initializer_range=0.3)
    transformers.LlamaForCausalLM(cfg).save_pretrained(str(out))
    return out


def _hf(directory) -> HFLM:
    return HFLM(pretrained=str(directory), device="cpu", batch_size=1, dtype="float32")


@pytest.mark.parametrize("family", ["byte", "bpe", "mistral"])
def test_loglikelihoods_equal_the_hf_model(family, request, byte_run, byte_hf):
    """Same (context, continuation) split and scores as ``--model hf`` on the exported directory, empty
    contexts, trailing spaces and special-token text included; rolling windows past the context too."""
    hf_dir = request.getfixturevalue(f"{family}_hf")
    ours_from = byte_run if family == "byte" else hf_dir  # lmforge's checkpoint vs its export
    lm = LMForgeLM(*load_for_inference(ours_from), batch_size=4)
    hf = _hf(hf_dir)
    assert lm.add_bos == (family == "mistral")
    requests = [Instance("loglikelihood", {}, r, i) for i, r in enumerate(REQUESTS)]
    ours, theirs = lm.loglikelihood(requests), hf.loglikelihood(requests)
    assert [g for _, g in ours] == [g for _, g in theirs]
    assert [s for s, _ in ours] == pytest.approx([s for s, _ in theirs], abs=1e-4)

    assert len(lm.tok_encode(LONG_TEXT)) > lm.max_length  # several windows
    rolling = [Instance("loglikelihood_rolling", {}, (t,), i) for i, t in enumerate([LONG_TEXT, "short text"])]
    assert lm.loglikelihood_rolling(rolling) == pytest.approx(hf.loglikelihood_rolling(rolling), abs=1e-3)


def test_shipped_tasks_score_as_the_hf_model(byte_run, byte_hf):
    """Every shipped task (chat-formatted): equal scores, equal generated text, equal log-likelihoods."""
    model, tok = load_for_inference(byte_run)
    ours = evaluate_tasks(model, tok, ["lmforge_tasks"], limit=3, log_samples=True, batch_size=4)
    theirs = simple_evaluate(model=_hf(byte_hf), tasks=["lmforge_tasks"], limit=3, apply_chat_template=True,
                             log_samples=True, bootstrap_iters=0,
                             task_manager=TaskManager(include_path=str(SHIPPED_TASKS), include_defaults=False))
    scores = flat_scores(ours)
    assert {"lmforge_add/exact_match", "lmforge_choice/acc", "lmforge_generate/exact_match"} <= set(scores)
    assert scores == pytest.approx(flat_scores(theirs))
    for task, samples in ours["samples"].items():
        for mine, hers in zip(samples, theirs["samples"][task], strict=True):
            assert mine["arguments"] == hers["arguments"]
            if task == "lmforge_choice":
                assert [s for s, _ in mine["filtered_resps"]] == pytest.approx(
                    [s for s, _ in hers["filtered_resps"]], abs=1e-4)
            else:
                assert mine["filtered_resps"] == hers["filtered_resps"]


def test_generation_task_scores_as_lmforge_exact_match(byte_run, tmp_path):
    """The harness's exact match is lmforge's: on the shipped task (same replies as lmforge's eval) and on a
    user task with local data_files whose answers the model gets right half the time."""
    model, tok = load_for_inference(byte_run)
    examples = [e for e in task_examples("test", 24) if e.task == "add"][:6]
    results = evaluate_tasks(model, tok, ["lmforge_add"], limit=6, log_samples=True)
    replies = sample_texts(model, tok, [e.prompt for e in examples], max_new_tokens=16, chat=True)
    assert [s["doc"]["prompt"] for s in results["samples"]["lmforge_add"]] == [e.prompt for e in examples]
    assert [s["filtered_resps"][0] for s in results["samples"]["lmforge_add"]] == replies
    assert flat_scores(results)["lmforge_add/exact_match"] == task_accuracy(model, tok, examples, max_new_tokens=16)["add"]

    # A user task: half the answers are the model's own replies, so the score is not trivially 0.
    answers = [extract_answer(r) if i % 2 == 0 else "no such answer" for i, r in enumerate(replies)]
    assert any(answers[::2]), "some of the model's replies should be non-empty"
    mine = [TaskExample("add", e.prompt, a) for e, a in zip(examples, answers)]
    (tmp_path / "data.jsonl").write_text("".join(json.dumps({"prompt": e.prompt, "answer": e.answer}) + "\n" for e in mine))
    (tmp_path / "score.py").write_text("from lmforge.data.tasks import is_correct\n\n\ndef results(doc, out):\n"
                                       "    return {'exact_match': float(is_correct(out[0], doc['answer']))}\n")
    (tmp_path / "my_task.yaml").write_text(
        f"task: my_task\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {tmp_path / 'data.jsonl'}\n"
        "test_split: test\noutput_type: generate_until\ndoc_to_text: '{{prompt}}'\ndoc_to_target: '{{answer}}'\n"
        "generation_kwargs:\n  until: []\n  max_gen_toks: 16\n  do_sample: false\n"
        "process_results: !function score.results\nmetric_list:\n  - metric: exact_match\n    aggregation: mean\n"
        "    higher_is_better: true\n")
    user = evaluate_tasks(model, tok, ["my_task"], include_path=tmp_path, apply_chat_template=True)
    assert flat_scores(user)["my_task/exact_match"] == task_accuracy(model, tok, mine, max_new_tokens=16)["all"] == 0.5


def test_cli_prints_the_table_and_writes_json(byte_run, tmp_path, capsys):
    assert main(["eval", str(byte_run), "--tasks", "lmforge_choice,lmforge_sort", "--limit", "2"]) == 0
    out = capsys.readouterr().out
    assert "|    Tasks     |" in out and "lmforge_choice" in out and "exact_match" in out
    [written] = (byte_run / "eval").glob("results_*.json")
    assert f"results: {written}" in out
    saved = json.loads(written.read_text())
    assert set(saved["results"]) == {"lmforge_choice", "lmforge_sort"} and saved["n-samples"]["lmforge_sort"]["effective"] == 2

    target = tmp_path / "scores.json"
    assert main(["eval", str(byte_run), "--tasks", "lmforge_choice", "--limit", "16", "--out", str(target)]) == 0
    model, tok = load_for_inference(byte_run)  # the file holds the harness's score of the same 16 questions
    want = flat_scores(evaluate_tasks(model, tok, ["lmforge_choice"], limit=16))["lmforge_choice/acc"]
    assert json.loads(target.read_text())["results"]["lmforge_choice"]["acc,none"] == want
    assert 0 < want < 1  # neither all wrong nor all right

    capsys.readouterr()
    assert main(["eval", str(byte_run), "--tasks", "no_such_task"]) == 2  # after indexing the harness's tasks
    assert capsys.readouterr().err.startswith("error: unknown task(s) no_such_task")


def test_without_lm_eval_the_command_says_how_to_install_it(byte_run, monkeypatch, capsys):
    real_import = builtins.__import__

    def no_lm_eval(name, *args, **kwargs):
        if name == "lm_eval" or name.startswith("lm_eval."):
            raise ImportError(f"No module named {name!r}")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_lm_eval)
    monkeypatch.delitem(sys.modules, "lm_eval", raising=False)
    assert main(["eval", str(byte_run), "--tasks", "lmforge_tasks"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "pip install 'lmforge[eval]'" in err


def test_training_logs_downstream_scores_on_schedule(tmp_path):
    run = tmp_path / "run"
    assert main(["sft", *tiny_run_args(), *SFT_ONE_STEP, "--training.steps=4", "--eval.interval=2",
                 "--eval.tasks=lmforge_choice", "--eval.tasks_interval=4", "--eval.tasks_limit=2",
                 "--metrics.tensorboard=true", f"--run.dir={run}"]) == 0
    scored = {r["step"]: r for r in read_records(run, "eval")}
    assert sorted(scored) == [0, 2, 4]
    assert "eval/lmforge_choice/acc" in scored[0] and "eval/lmforge_choice/acc" in scored[4]
    assert not any(k.startswith("eval/") for k in scored[2])  # step 2 is not a multiple of 4

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run / "tensorboard")).Reload()
    assert [e.step for e in events.Scalars("eval/lmforge_choice/acc")] == [0, 4]


def test_pretraining_logs_downstream_scores(tmp_path):
    run = tmp_path / "run"
    assert main(["pretrain", *tiny_run_args(**small_corpus(tmp_path)), "--training.steps=2", "--eval.interval=2",
                 "--eval.steps=1", "--eval.batch_size=8", "--eval.tasks=lmforge_choice", "--eval.tasks_limit=16",
                 f"--run.dir={run}"]) == 0
    [final] = read_records(run, "eval")
    model, tok = load_for_inference(run)  # the final checkpoint: the weights step 2's eval scored
    want = flat_scores(evaluate_tasks(model, tok, ["lmforge_choice"], limit=16))["lmforge_choice/acc"]
    assert final["step"] == 2 and "loss" in final and final["eval/lmforge_choice/acc"] == want
    assert 0 < want < 1  # neither all wrong nor all right: a wrong count or model would show


@pytest.mark.parametrize("flags, message", [
    (["--eval.tasks_interval=3"], "must be a multiple of eval.interval=2"),
    (["--eval.tasks=no_such_task"], "unknown task(s) no_such_task"),
])
def test_a_downstream_schedule_that_cannot_run_is_refused(tmp_path, capsys, flags, message):
    args = ["sft", *tiny_run_args(), *SFT_ONE_STEP, "--eval.interval=2", "--eval.tasks=lmforge_choice",
            *flags, f"--run.dir={tmp_path / 'run'}"]
    assert main(args) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
