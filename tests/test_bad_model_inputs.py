"""Bad inputs around models, in one line: a LoRA base moved or changed, degenerate preference pairs,
bad task YAMLs for ``lmforge eval``, exports onto existing places or cut off, and a router that sends
every token to one expert or produces NaN.

Everything runs through the CLI's entry point in this process (``lmforge_in_process``) and checks what
``tests/test_bad_inputs.py`` checks of every bad input: exit status 2, exactly one ``error:`` line
naming the problem, no traceback, and the files already saved unchanged.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from _helpers import lmforge_in_process, tiny_run_args, write_corpus
from test_bad_inputs import digest

LORA = dict(lora_enabled=True, lora_rank=4, lora_alpha=8, optimizer_lr=1e-2)


def _one_error_line(rc: int, err: str) -> str:
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert rc == 2 and len(lines) == 1 and "Traceback" not in err, (rc, err[-3000:])
    return lines[0]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    return write_corpus(tmp_path_factory.mktemp("corpus") / "corpus.txt")


@pytest.fixture(scope="module")
def tiny_run(corpus, tmp_path_factory) -> Path:
    """A finished one-step pretraining run to evaluate and export."""
    run = tmp_path_factory.mktemp("tiny") / "run"
    assert lmforge_in_process("pretrain", *tiny_run_args(corpus, training_steps=1), f"--run.dir={run}") == 0
    return run


# ---------------------------------------------------------------------------- LoRA on a moved or changed base
def _base(corpus: Path, run: Path, seed: int) -> Path:
    assert lmforge_in_process("pretrain", *tiny_run_args(corpus, training_steps=2, training_seed=seed),
                              f"--run.dir={run}") == 0
    return run / "checkpoints" / "step_00000002"


def test_a_lora_base_is_known_by_its_weights_not_its_path(corpus, tmp_path, capfd):
    """Moved: the resume finds it again at its new path (same weights); an export that still looks at
    the old path says which base it needs. Replaced by other weights at the same path: the resume and
    the export are refused in one line, nothing written."""
    base = _base(corpus, tmp_path / "base", seed=0)
    lora_args = lambda steps, start: [*tiny_run_args(corpus, training_steps=steps, **LORA),  # noqa: E731
                                      f"--model.from_checkpoint={start}", f"--run.dir={tmp_path / 'lora'}"]
    assert lmforge_in_process("pretrain", *lora_args(2, base)) == 0
    moved = tmp_path / "moved"
    shutil.move(tmp_path / "base", moved)
    capfd.readouterr()
    assert lmforge_in_process("export", "--hf", tmp_path / "hf", tmp_path / "lora") == 2
    line = _one_error_line(2, capfd.readouterr().err)
    assert f"base model checkpoint:{base}" in line and "no longer exists" in line, line
    assert not (tmp_path / "hf").exists()

    rc = lmforge_in_process("pretrain", *lora_args(4, moved / "checkpoints" / "step_00000002"))
    out, err = capfd.readouterr()
    assert rc == 0 and "resumed from" in out, err[-3000:]

    shutil.rmtree(moved)
    other = _base(corpus, moved, seed=1)  # the same shape, other weights, at the path the run now names
    before = digest(tmp_path / "lora")
    capfd.readouterr()
    line = _one_error_line(lmforge_in_process("pretrain", *lora_args(6, other)), capfd.readouterr().err)
    assert "holds adapters for the base model" in line and "has other weights" in line, line
    assert digest(tmp_path / "lora") == before
    line = _one_error_line(lmforge_in_process("export", "--hf", tmp_path / "hf", tmp_path / "lora"),
                           capfd.readouterr().err)
    assert f"base model checkpoint:{other}, whose weights changed since" in line, line
    assert not (tmp_path / "hf").exists()


# ---------------------------------------------------------------------------- degenerate preference pairs
def test_empty_or_identical_preference_pairs_are_skipped_and_counted(tmp_path, capfd):
    """A pair with no response text, or whose chosen and rejected are the same, teaches nothing (the
    loss of an identical pair is constant: zero gradient, only a diluted normalizer and accuracy).
    Public preference sets hold a few such rows, so they are skipped and counted on the data line and
    in the ``dpo_data`` record rather than failing the whole file; a file of nothing else stops in one line."""
    from _pairs import task_pairs
    from lmforge.metrics.records import read_records

    user = lambda text: [{"role": "user", "content": text}]  # noqa: E731
    bot = lambda text: [{"role": "assistant", "content": text}]  # noqa: E731
    bad = [{"prompt": "p", "chosen": "", "rejected": " no"}, {"prompt": "p", "chosen": " yes", "rejected": "  \n"},
           {"prompt": user("p"), "chosen": bot(""), "rejected": bot("no")},
           {"prompt": "p", "chosen": " same", "rejected": " same"},
           {"prompt": user("p"), "chosen": bot("same"), "rejected": bot("same")}]
    good = [r for _, r in task_pairs(8)]
    data = tmp_path / "pairs.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in good + bad))
    args = [*tiny_run_args(data, data_seq_len=96, training_steps=1, training_global_batch_size=4,
                                  training_micro_batch_size=4), "--dpo.beta=0.5"]
    capfd.readouterr()
    rc = lmforge_in_process("dpo", *args, f"--run.dir={tmp_path / 'run'}")
    out, err = capfd.readouterr()
    assert rc == 0, err[-3000:]
    assert ("13 records -> 8 pairs" in out and "skipped 3 pairs with an empty response; "
            "skipped 2 pairs whose chosen and rejected are identical" in out), out[-3000:]
    record = [r for r in read_records(tmp_path / "run") if r["kind"] == "dpo_data"][0]  # the training data's
    assert (record["pairs"], record["skipped_no_loss_tokens"], record["skipped_identical"]) == (8, 3, 2)

    data.write_text("".join(json.dumps(r) + "\n" for r in bad))
    line = _one_error_line(lmforge_in_process("dpo", *args, f"--run.dir={tmp_path / 'none'}"), capfd.readouterr().err)
    assert "skipped 2 pairs whose chosen and rejected are identical: no pairs left to train on" in line, line
    assert [f.name for f in (tmp_path / "none").rglob("*")] == [".lock"]  # the run's lock, released


# ---------------------------------------------------------------------------- lmforge eval on bad task YAMLs
def test_eval_on_a_missing_or_malformed_task_yaml_is_one_line(tiny_run, tmp_path, capfd, monkeypatch):
    """Each names what is wrong (the harness itself skips a YAML that does not parse without a word,
    leaving the task merely unknown: the line names the broken file and line too); no results written.
    The harness's own ~15k tasks are left out of the index (seconds to build; test_harness.py's
    unknown-task case builds it)."""
    pytest.importorskip("lm_eval")
    from lmforge.evaluation import harness

    index = harness._index.__wrapped__
    monkeypatch.setattr(harness, "_index", lambda paths, include_defaults: index(paths, False))
    run = tiny_run
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    (tasks / "broken.yaml").write_text("task: broken_task\n  dataset_path: [json\n")
    body = ("dataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\ntest_split: test\n"
            "output_type: generate_until\ndoc_to_text: '{{{{prompt}}}}'\ndoc_to_target: '{{{{answer}}}}'\n"
            "metric_list:\n  - metric: exact_match\n")
    (tasks / "data.jsonl").write_text('{"prompt": "1+1", "answer": "2"}\n')
    (tasks / "no_data.yaml").write_text("task: no_data\n" + body.format(data=tasks / "nope.jsonl"))
    (tasks / "no_module.yaml").write_text("task: no_module\n" + body.format(data=tasks / "data.jsonl")
                                          + "process_results: !function no_such_module.results\n")
    out = tmp_path / "results.json"
    for name, include, words in (
            ("broken_task", tasks, ["unknown task(s) broken_task", f"{tasks / 'broken.yaml'}:2: not valid YAML"]),
            ("no_data", tasks, ["task no_data:", "nope.jsonl"]),
            ("no_module", tasks, ["task no_module:", "Cannot import module 'no_such_module'"]),
            ("no_data", tmp_path / "nowhere", [f"--include-path {tmp_path / 'nowhere'}: not a directory"])):
        capfd.readouterr()
        rc = lmforge_in_process("eval", run, "--tasks", name, "--include-path", include, "--limit", "1", "--out", out)
        line = _one_error_line(rc, capfd.readouterr().err)
        assert all(w in line for w in words), (name, line)
    assert not out.exists() and not (run / "eval").exists()


# ---------------------------------------------------------------------------- exports onto existing places, cut off
def test_hf_export_refuses_a_foreign_directory_and_replaces_an_earlier_export_whole(tiny_run, tmp_path, capfd,
                                                                                   monkeypatch):
    """A non-empty directory that is not an earlier export is refused (no --force: deleting a user's
    files is never implied); an earlier export is replaced by a swap once the new one is complete, so
    an export cut off (Ctrl-C) or failing (a full disk) leaves the earlier one byte-identical and no
    temporary directory. (A file in the way: tests/test_inference.py.)"""
    import lmforge.exporters.run_export as export_mod

    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("my files")
    capfd.readouterr()
    line = _one_error_line(lmforge_in_process("export", "--hf", mine, tiny_run), capfd.readouterr().err)
    assert f"--hf {mine}: exists and is not an earlier export" in line, line
    assert [p.name for p in mine.iterdir()] == ["notes.txt"]

    out = tmp_path / "hf"
    assert lmforge_in_process("export", "--hf", out, tiny_run) == 0
    before = digest(out)
    real = export_mod.write_hf_dir

    def cut_off(model, tokenizer, where):
        real(model, tokenizer, where)  # every file written, the swap not yet done
        raise KeyboardInterrupt

    monkeypatch.setattr(export_mod, "write_hf_dir", cut_off)
    capfd.readouterr()
    assert lmforge_in_process("export", "--hf", out, tiny_run) == 130
    assert capfd.readouterr().err.strip() == "interrupted"

    def disk_full(model, tokenizer, where):
        (where / "config.json").write_text("{")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(export_mod, "write_hf_dir", disk_full)
    line = _one_error_line(lmforge_in_process("export", "--hf", out, tiny_run), capfd.readouterr().err)
    assert f"--hf {out}: cannot write the export (No space left on device)" in line, line
    assert digest(out) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf", "mine"]


def test_gguf_export_after_a_killed_one(tiny_run, tmp_path, capfd):
    """A killed export (no Python cleanup) leaves only its hidden ``.FILE.XXXXXXXX.partial``, never a
    half-written FILE; the next export writes FILE whole under a name of its own, and a user's file that
    happens to be called ``FILE.partial`` is never touched. An existing FILE is refused (Ctrl-C,
    a full disk, the other refusals: tests/test_gguf_export.py::test_bad_gguf_exports_are_one_line_and_write_nothing)."""
    pytest.importorskip("gguf")
    from lmforge.models.gguf import load_gguf_model

    out = tmp_path / "m.gguf"
    (tmp_path / ".m.gguf.k1ll3d00.partial").write_bytes(b"GGUF" + b"\0" * 100)  # what a SIGKILL mid-write leaves
    (tmp_path / "m.gguf.partial").write_bytes(b"the user's own")
    capfd.readouterr()
    assert lmforge_in_process("export", "--gguf", out, "--gguf-type", "f32", tiny_run) == 0, capfd.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == [".m.gguf.k1ll3d00.partial", "m.gguf", "m.gguf.partial"]
    assert (tmp_path / "m.gguf.partial").read_bytes() == b"the user's own"
    assert load_gguf_model(out).args.n_layers == 2
    before = out.read_bytes()
    line = _one_error_line(lmforge_in_process("export", "--gguf", out, tiny_run), capfd.readouterr().err)
    assert f"--gguf {out}: exists" in line and out.read_bytes() == before, line


# ---------------------------------------------------------------------------- a router gone wrong
@pytest.fixture(scope="module")
def top1_moe(tmp_path_factory) -> Path:
    """A tiny Mixtral with 4 experts and one expert per token (so one expert can take every slot)."""
    transformers = pytest.importorskip("transformers")
    import torch

    from _hf_models import REAL_TOKENIZERS, SHAPE

    out = tmp_path_factory.mktemp("moe") / "top1"
    tok = REAL_TOKENIZERS / "mistral-7b-instruct-v0.1"
    real = json.loads((tok / "config.json").read_text())
    config = transformers.MixtralConfig(vocab_size=real["vocab_size"], bos_token_id=real["bos_token_id"],
                                        eos_token_id=real["eos_token_id"], num_local_experts=4,
                                        num_experts_per_tok=1, **SHAPE)
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(out)
    for f in tok.iterdir():
        if f.name != "config.json":
            shutil.copy(f, out / f.name)
    return out


def _route(monkeypatch, change) -> None:
    """Every MoE layer's router logits pass through ``change(logits, forward number)``."""
    from lmforge.models.layers.moe import MoEFeedForward

    real, calls = MoEFeedForward.forward, [0]

    def forward(self, x):
        if not getattr(self, "_test_hook", False):
            self._test_hook = True

            def hook(module, inputs, logits):
                calls[0] += 1
                return change(logits, calls[0])
            self.router.register_forward_hook(hook)
        return real(self, x)

    monkeypatch.setattr(MoEFeedForward, "forward", forward)


def _moe_args(corpus: Path, start: Path, run: Path) -> list[str]:
    return ["pretrain", *tiny_run_args(corpus, model_size=None, model_n_layers=None, model_dim=None,
                                       model_n_heads=None, model_n_kv_heads=None, training_steps=3),
            f"--model.from_hf={start}", f"--run.dir={run}"]


def test_every_token_routed_to_one_expert_trains_and_shows_in_the_router_statistics(corpus, top1_moe, tmp_path,
                                                                                     monkeypatch, capfd):
    """Three experts get no token (empty groups in the grouped matmul): no crash, and the logged load
    says it: the busiest expert has all slots (4x an even share), the idlest none."""
    from lmforge.metrics.records import read_records

    _route(monkeypatch, lambda logits, n: logits + logits.new_tensor([1e4, 0.0, 0.0, 0.0]))
    rc = lmforge_in_process(*_moe_args(corpus, top1_moe, tmp_path / "run"))
    assert rc == 0, capfd.readouterr().err[-3000:]
    records = read_records(tmp_path / "run", "train")
    assert len(records) == 3
    for r in records:
        assert r["expert_load_max"] == pytest.approx(4.0) and r["expert_load_min"] == 0.0, r
        assert r["router_aux_loss"] == pytest.approx(4.0, rel=1e-3)  # E * f_0 * P_0 with f_0 = P_0 = 1


def test_nan_router_logits_stop_the_run_with_the_nonfinite_line(corpus, top1_moe, tmp_path, monkeypatch, capfd):
    """NaN logits at the second step's forward (top-k picks among NaNs): the step's loss is NaN and the
    non-finite guard stops the run in one line (training.nonfinite=stop); the last checkpoint stays as saved."""
    layers = 2  # the router runs once per MoE layer per forward

    _route(monkeypatch, lambda logits, n: logits * float("nan") if n > layers else logits)
    capfd.readouterr()
    rc = lmforge_in_process(*_moe_args(corpus, top1_moe, tmp_path / "run"))
    line = _one_error_line(rc, capfd.readouterr().err)
    assert "non-finite loss (nan) at step 2" in line and "training.nonfinite=skip" in line, line
    assert not list((tmp_path / "run" / "checkpoints").glob("step_*"))
