"""The recipe layer: every trainer is a registered recipe run by one skeleton; data.validation means the
same in all of them; parallel dimensions resolve the same way from every spelling."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest

from _helpers import tiny_run_args
from lmforge.cli import main
from lmforge.config import Config, ParallelSection
from lmforge.data.inputs import data_spec, validation_spec
from lmforge.errors import UserError
from lmforge.metrics.records import read_records
from lmforge.parallel import ParallelDims
from lmforge.recipes import recipes

RECIPES_DIR = Path(__file__).parents[1] / "src" / "lmforge" / "recipes"


def test_every_recipe_module_registers_a_recipe_and_imports_no_other_recipe():
    found = recipes()
    modules = sorted(p.stem for p in RECIPES_DIR.glob("*.py") if p.stem not in ("__init__", "base", "skeleton"))
    assert sorted(found) == modules  # one recipe per module, named like it
    for name in modules:
        tree = ast.parse((RECIPES_DIR / f"{name}.py").read_text())
        imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
        others = {m for m in imported if m.startswith("lmforge.recipes.") and m.split(".")[-1] in modules}
        assert not others, f"recipes/{name}.py imports {others}"
    for recipe in found.values():
        assert issubclass(recipe.config, Config) and recipe.summary


def test_the_cli_offers_every_registered_recipe(capsys):
    assert main(["--help"]) == 0
    usage = capsys.readouterr().out
    assert all(name in usage for name in recipes())
    assert main(["no-such-trainer"]) == 2
    assert "unknown command 'no-such-trainer'" in capsys.readouterr().err


def test_one_rule_for_data_values():
    cfg = Config()
    assert data_spec("data.train", "none").kind == data_spec("data.train", "").kind == "none"
    assert data_spec("data.train", "embedded").kind == "embedded"
    assert data_spec("data.train", "x.jsonl").kind == "path"
    assert validation_spec(cfg.data) == (data_spec("data.validation", "embedded"), "")
    cfg.data.train = "chats.jsonl"  # embedded validation data only goes with embedded training data
    spec, note = validation_spec(cfg.data)
    assert spec.kind == "none" and "data.validation=embedded" in note
    cfg.data.validation = "val.jsonl"
    assert validation_spec(cfg.data) == (data_spec("data.validation", "val.jsonl"), "")


def test_embedded_validation_next_to_file_data_is_no_validation_and_says_so(tmp_path, capsys):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n\n".join(f"Document {i}: " + "words and more words. " * 20 for i in range(60)))
    run = tmp_path / "run"
    rc = main(["pretrain", *tiny_run_args(training_steps=1, eval_interval=1), f"--data.train={corpus}",
               f"--run.dir={run}", "--checkpoint.enabled=false"])
    assert rc == 0, capsys.readouterr().err[-2000:]
    assert "data.validation=embedded is the embedded training data's held-out split" in capsys.readouterr().out
    assert len(read_records(run, "no_validation")) == 1
    assert not [r for r in read_records(run, "eval") if "loss" in r]


def _pairs(path: Path) -> Path:
    rows = [{"prompt": f"What is {i} plus 3?", "chosen": f" {i + 3}", "rejected": " no"} for i in range(16)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _teacher(tmp: Path) -> list[str]:
    """A one-step pretrained tiny model to distill from."""
    assert main(["pretrain", *tiny_run_args(training_steps=1), f"--run.dir={tmp / 'teacher'}"]) == 0
    return [f"--distill.teacher={tmp / 'teacher'}", "--tasks.train_examples=32", "--tasks.eval_examples=8",
            "--eval.interval=1"]


# What each recipe needs besides tiny_run_args to take one step: a recipe registered without an entry here
# fails the test below, so every trainer is run with data.validation=none.
ONE_STEP = {
    "pretrain": lambda tmp: [],
    "sft": lambda tmp: ["--tasks.train_examples=32", "--tasks.eval_examples=8", "--eval.interval=1"],
    "grpo": lambda tmp: ["--grpo.num_generations=2", "--grpo.max_new_tokens=4", "--tasks.eval_examples=4",
                         "--training.global_batch_size=4", "--data.seq_len=None"],
    "distill": _teacher,
    **{name: lambda tmp: [f"--data.train={_pairs(tmp / 'pairs.jsonl')}", "--data.seq_len=64",
                          "--training.global_batch_size=2", "--training.micro_batch_size=2", "--data.prefetch=0"]
       for name in ("dpo", "kto", "orpo", "simpo", "rm")},
}


@pytest.mark.parametrize("name", sorted(recipes()))
def test_every_recipe_accepts_no_validation_data(name, tmp_path, capsys):
    assert name in ONE_STEP, f"give the {name} recipe a one-step run in ONE_STEP"
    extra = ONE_STEP[name](tmp_path)
    args = [a for a in tiny_run_args(training_steps=1) if not any(a.startswith(e.split("=")[0] + "=") for e in extra)]
    run = tmp_path / "run"
    extra = [e for e in extra if not e.endswith("=None")]
    rc = main([name, *args, *extra, "--data.validation=none", f"--run.dir={run}", "--checkpoint.enabled=false"])
    assert rc == 0, capsys.readouterr().err[-2000:]
    assert [r["step"] for r in read_records(run, "train")] == [1]
    assert not [r for r in read_records(run, "eval") if "loss" in r]  # no validation set, no eval loss


@pytest.mark.parametrize("section, world, want", [
    ({}, 4, (4, 1)),                                     # ddp shorthand: every rank a replica
    ({"mode": "fsdp"}, 4, (1, 4)),                       # fsdp shorthand: every rank a shard
    ({"dp_shard": 2}, 4, (2, 2)),                        # HSDP: the rest of the world replicates
    ({"dp_replicate": 2, "dp_shard": 2}, 4, (2, 2)),
    ({"mode": "fsdp"}, 1, (1, 1)),
])
def test_parallel_dims_from_every_spelling(section, world, want):
    dims = ParallelDims.from_config(ParallelSection(**section), world)
    assert (dims.dp_replicate, dims.dp_shard) == want
    shape, names = dims.mesh_shape()
    assert [n for n in names] == [n for n, d in (("dp_replicate", want[0]), ("dp_shard", want[1])) if d > 1]
    assert dims.kind == ("none" if world == 1 else "hsdp" if min(want) > 1 else "fsdp" if want[1] > 1 else "ddp")


@pytest.mark.parametrize("section, message", [
    ({"tp": 3}, r"tp \(3\) x cp \(1\) x pp \(1\) = 3 does not divide the world size 4"),
    ({"dp_replicate": 3, "dp_shard": 2}, r"dp_replicate \(3\) x dp_shard \(2\) x tp \(1\) x cp \(1\) x pp \(1\) = 6, "
                                         r"but the world size is 4"),
    ({"ep": 4, "dp_shard": 2, "dp_replicate": 2}, r"parallel.ep=4 must divide parallel.dp_shard=2"),
    ({"tp": 2, "mode": "ddp", "dp_replicate": 2}, r"parallel.tp=2 with parallel.dp_replicate=2: .*not with DDP"),
])
def test_parallel_dims_refusals_name_the_key(section, message):
    with pytest.raises(UserError, match=message):
        ParallelDims.from_config(ParallelSection(**section), 4)
