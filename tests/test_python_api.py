"""The Python API (lmforge.train / Trainer / load / generate / export), the CLI over it, and recipe plugins.

Every training here is a few steps of a tiny model: each test compares the API with the CLI (or one
in-memory input with the same input as a file), so a difference in what the API hands the run shows
as a difference in losses.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import lmforge
from _helpers import REPO, cli_env, lmforge_cmd, lmforge_in_process
from lmforge.errors import ConfigError, UserError

FIXTURES = Path(__file__).parent / "fixtures"

TINY = {"model.n_layers": 2, "model.dim": 64, "model.n_heads": 4, "model.n_kv_heads": 2, "data.seq_len": 32,
        "training.global_batch_size": 8, "training.micro_batch_size": 8, "training.threads": 1,
        "metrics.log_every": 1, "metrics.tensorboard": False, "metrics.peak_tflops": 1, "metrics.progress": "off",
        "checkpoint.interval": 0, "training.dtype": "float32"}
"""Overrides of configs/*_debug.toml: a ~140k-parameter model, a line per step, only the final checkpoint."""


def losses(run: lmforge.Run) -> list[tuple[int, float]]:
    return [(r["step"], r["loss"]) for r in run.records("train")]


def flags(overrides: dict) -> list[str]:
    return [f"--{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in overrides.items()]


# ------------------------------------------------------------------ process state: two runs = two CLI runs
def test_two_trainings_in_one_process_match_a_cli_run(tmp_path):
    """The same config trained twice in this process and once by the CLI in a fresh process: identical
    losses, eval loss and final step; the process's thread count, RNG state and sys.path come back."""
    overrides = {**TINY, "training.steps": 3, "eval.interval": 3, "eval.steps": 1}
    threads, rng, path = torch.get_num_threads(), torch.get_rng_state(), list(sys.path)
    torch.set_num_threads(2)
    try:
        runs = [lmforge.train("pretrain", REPO / "configs/debug.toml", {**overrides, "run.dir": tmp_path / n})
                for n in ("a", "b")]
        assert torch.get_num_threads() == 2  # the runs' training.threads=1 was undone
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(torch.get_rng_state(), rng) and sys.path == path
    from lmforge.checkpoint.runlock import holds_run_lock

    assert not holds_run_lock(tmp_path / "a")  # a later process may take the run directory
    cli = subprocess.run(lmforge_cmd("pretrain", "--config", "configs/debug.toml", *flags(overrides),
                                     f"--run.dir={tmp_path / 'c'}"), cwd=REPO, env=cli_env(), capture_output=True,
                         text=True, timeout=300)
    assert cli.returncode == 0, cli.stderr[-2000:]
    from lmforge.api import read_run

    c = read_run("pretrain", tmp_path / "c")
    a, b = runs
    assert len(losses(a)) == 3 and a.step == 3 and a.train["step"] == 3
    assert losses(a) == losses(b) == losses(c)
    assert a.eval["loss"] == b.eval["loss"] == c.eval["loss"]
    assert a.run_dir == tmp_path / "a" and (a.run_dir / "checkpoints").is_dir()


# ------------------------------------------------------------------ errors
def test_config_errors_raise_config_error_not_system_exit(tmp_path):
    with pytest.raises(ConfigError, match=r"unknown config key `training.stepz` \(did you mean `training.steps`\?\)"):
        lmforge.train("pretrain", REPO / "configs/debug.toml", {"training.stepz": 3})
    with pytest.raises(ConfigError, match=r"config: config key `training.steps`"):
        lmforge.train("pretrain", {"training": {"steps": "many"}})
    with pytest.raises(ConfigError, match="config file not found"):
        lmforge.train("pretrain", tmp_path / "missing.toml")
    with pytest.raises(UserError, match="unknown trainer 'pretrian'"):
        lmforge.train("pretrian")
    with pytest.raises(UserError, match="reward_funcs are for the grpo recipe"):
        lmforge.Trainer("sft", reward_funcs=[len])
    assert not (tmp_path / "runs").exists()


def test_help_and_config_errors_load_no_torch():
    """``lmforge --help``, listing the recipes and a config error import neither torch nor the model
    code; the CLI's config error is one ``error:`` line with exit status 2."""
    code = ("import sys, lmforge, lmforge.cli, lmforge.recipes; lmforge.recipes.recipes(); "
            "assert lmforge.cli.main(['--help']) == 0; "
            "rc = lmforge.cli.main(['pretrain', '--config', 'configs/debug.toml', '--training.stepz=3']); "
            "heavy = sorted(m for m in ('torch', 'numpy', 'lmforge.models.model', 'lmforge.training.loop') "
            "if m in sys.modules); print('RC', rc, 'HEAVY', heavy)")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=cli_env(), capture_output=True, text=True,
                         timeout=120)
    assert "RC 2 HEAVY []" in out.stdout, out.stdout + out.stderr
    assert "pretrain  next-token pretraining" in out.stdout
    cli = subprocess.run(lmforge_cmd("pretrain", "--config", "configs/debug.toml", "--training.stepz=3"), cwd=REPO,
                         env=cli_env(), capture_output=True, text=True, timeout=120)
    assert cli.returncode == 2 and cli.stdout == ""
    assert cli.stderr.splitlines() == ["error: configs/debug.toml: unknown config key `training.stepz` "
                                       "(did you mean `training.steps`?)"]


# ------------------------------------------------------------------ in-memory parts
def _sft_records(n: int) -> list[dict]:
    return [{"messages": [{"role": "user", "content": f"Add {i} and {i + 1}."},
                          {"role": "assistant", "content": f"{2 * i + 1}"}]} for i in range(n)]


def test_in_memory_datasets_and_callbacks_match_files(tmp_path):
    """SFT on record lists (one of them a datasets.Dataset) trains exactly as on the same records in
    JSONL files; the callbacks see every train line as written to metrics.jsonl."""
    datasets = pytest.importorskip("datasets")
    train, val = _sft_records(24), _sft_records(30)[24:]
    for name, rows in (("train.jsonl", train), ("val.jsonl", val)):
        (tmp_path / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
    overrides = {**TINY, "training.steps": 2, "eval.interval": 2, "eval.steps": 1, "eval.at_start": False,
                 "model.from_checkpoint": None}
    files = lmforge.train("sft", REPO / "configs/sft_debug.toml", {
        **overrides, "data.train": tmp_path / "train.jsonl", "data.validation": tmp_path / "val.jsonl",
        "run.dir": tmp_path / "files"})
    seen: list[dict] = []
    memory = lmforge.Trainer("sft", REPO / "configs/sft_debug.toml", {**overrides, "run.dir": tmp_path / "memory"},
                             train_dataset=datasets.Dataset.from_list(train), eval_dataset=val,
                             callbacks=[seen.append]).train()
    assert len(losses(memory)) == 2 and losses(memory) == losses(files)
    assert memory.eval["loss"] == files.eval["loss"]
    assert [r["loss"] for r in seen] == [r["loss"] for r in memory.records("train")]
    assert (tmp_path / "memory" / "inputs" / "train.jsonl").read_text() == (tmp_path / "train.jsonl").read_text()
    from lmforge.metrics.logger import RECORD_HOOKS

    assert RECORD_HOOKS == []


def test_preference_records_in_memory_match_files(tmp_path):
    """DPO on lists of conversational prompt/chosen/rejected records (TRL's preference format) trains
    exactly as on the same records' files."""
    data = FIXTURES / "data"
    train = [json.loads(line) for line in (data / "preference_pairs_train.jsonl").read_text().splitlines()]
    val = [json.loads(line) for line in (data / "preference_pairs_test.jsonl").read_text().splitlines()]
    overrides = {**TINY, "data.seq_len": 128, "training.steps": 2, "eval.interval": 2, "eval.steps": 1,
                 "eval.at_start": False, "dpo.task_eval": False, "model.from_checkpoint": None}
    files = lmforge.train("dpo", REPO / "configs/dpo_debug.toml", {
        **overrides, "data.train": data / "preference_pairs_train.jsonl",
        "data.validation": data / "preference_pairs_test.jsonl", "run.dir": tmp_path / "files"})
    memory = lmforge.Trainer("dpo", REPO / "configs/dpo_debug.toml", {**overrides, "run.dir": tmp_path / "memory"},
                             train_dataset=train, eval_dataset=val).train()
    assert len(losses(memory)) == 2 and losses(memory) == losses(files)
    assert memory.eval["loss"] == files.eval["loss"]


def lowercase(prompts, completions, **fields):
    """Fraction of each completion's characters that are lowercase ASCII letters."""
    return [sum("a" <= ch <= "z" for ch in c) / max(len(c), 1) for c in completions]


def test_reward_functions_match_a_module_function(tmp_path, monkeypatch):
    """GRPO with a Python callable trains exactly as with the same function named ``module:function``;
    the callable is registered for the run only."""
    (tmp_path / "prompts.jsonl").write_text("".join(json.dumps({"prompt": f"Say something {i}"}) + "\n"
                                                    for i in range(8)))
    (tmp_path / "api_rewards.py").write_text(
        "def lowercase(prompts, completions, **fields):\n"
        "    return [sum('a' <= ch <= 'z' for ch in c) / max(len(c), 1) for c in completions]\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    overrides = {**TINY, "training.steps": 2, "training.global_batch_size": 16,
                 "training.micro_batch_size": 16, "grpo.num_generations": 4, "grpo.max_new_tokens": 6,
                 "model.from_checkpoint": None, "data.train": tmp_path / "prompts.jsonl", "data.validation": "none",
                 "eval.interval": 0, "schedule.kind": "constant", "schedule.warmup_steps": 0}
    del overrides["data.seq_len"]  # GRPO's lengths: the prompts' and max_new_tokens
    named = lmforge.train("grpo", REPO / "configs/grpo_debug.toml", {
        **overrides, "grpo.rewards": ["api_rewards:lowercase"], "grpo.rewards_weights": [], "run.dir": tmp_path / "n"})
    from lmforge.rl.rewards import BUILTIN_REWARDS

    builtins = dict(BUILTIN_REWARDS)
    called = lmforge.Trainer("grpo", REPO / "configs/grpo_debug.toml", {
        **overrides, "grpo.rewards_weights": [], "run.dir": tmp_path / "c"}, reward_funcs=[lowercase]).train()
    assert BUILTIN_REWARDS == builtins
    assert losses(called) == losses(named) and len(losses(called)) == 2
    assert [r["reward/lowercase"] for r in called.records("train")] == \
        [r["reward/api_rewards:lowercase"] for r in named.records("train")]


def test_in_memory_models_start_the_run(tmp_path):
    """A transformers model (with a transformers tokenizer) and an lmforge Transformer start a run:
    with a vanishing learning rate the run's final weights, exported, are the model's own; generation
    agrees whichever way the model is named (run directory, loaded, exported directory)."""
    transformers = pytest.importorskip("transformers")
    hf_cfg = transformers.LlamaConfig(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                      tie_word_embeddings=False)
    torch.manual_seed(0)
    hf_model = transformers.LlamaForCausalLM(hf_cfg)
    # lr must be positive; 1e-30 moves no float32 weight of this size (nor does its weight decay)
    frozen = {**TINY, "training.steps": 1, "optimizer.lr": 1e-30, "eval.interval": 0, "schedule.warmup_steps": 0}
    from lmforge.exporters import write_tokenizer_files
    from lmforge.models.tokenizer import load_tokenizer

    write_tokenizer_files(load_tokenizer("byte"), tmp_path)  # the byte tokenizer as transformers reads it
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path)
    run = lmforge.Trainer("pretrain", REPO / "configs/debug.toml", {**frozen, "run.dir": tmp_path / "hf"},
                          model=hf_model, tokenizer=hf_tokenizer).train()
    assert (tmp_path / "hf" / "start_model" / "tokenizer.json").is_file()
    out = lmforge.export(run.run_dir, hf=tmp_path / "exported")
    back = transformers.LlamaForCausalLM.from_pretrained(out["hf"])
    want = hf_model.state_dict()
    assert all(torch.equal(v, want[k]) for k, v in back.state_dict().items())

    model, tokenizer = lmforge.load(run.run_dir)
    again = lmforge.Trainer("pretrain", REPO / "configs/debug.toml", {**frozen, "run.dir": tmp_path / "lm"},
                            model=model, tokenizer=tokenizer).train()
    reloaded = lmforge.load(again.run_dir).model.state_dict()
    assert all(torch.equal(v, reloaded[k]) for k, v in model.state_dict().items())

    prompts = ["The quick brown", "Once upon"]
    texts = lmforge.generate(run.run_dir, prompts, max_new_tokens=8)
    assert texts == lmforge.generate((model, tokenizer), prompts, max_new_tokens=8)
    assert texts == lmforge.generate(out["hf"], prompts, max_new_tokens=8)
    assert lmforge.generate(model, prompts[0], tokenizer=tokenizer, max_new_tokens=8) == texts[0]
    assert texts[0] != texts[1]


def test_generate_matches_the_cli(tmp_path, capfd):
    run = lmforge.train("pretrain", REPO / "configs/debug.toml",
                        {**TINY, "training.steps": 1, "eval.interval": 0, "run.dir": tmp_path / "r"})
    capfd.readouterr()
    assert lmforge_in_process("generate", run.run_dir, "--prompt", "abc", "--prompt", "xyz",
                              "--max-new-tokens", "6", "--temperature", "0.8", "--seed", "3") == 0
    cli = capfd.readouterr().out.splitlines()
    assert cli == lmforge.generate(run.run_dir, ["abc", "xyz"], max_new_tokens=6, temperature=0.8, seed=3)


# ------------------------------------------------------------------ plugins
def test_a_plugin_package_adds_a_recipe(tmp_path):
    """A package on the path whose ``lmforge.recipes`` entry point names a Recipe class: its recipe is
    listed by ``lmforge --help``, takes its own config section and trains."""
    code = ("import sys; from lmforge.cli import main; main(['--help']); "
            "sys.exit(main(sys.argv[1:]))")
    env = cli_env({"PYTHONPATH": f"{REPO / 'src'}:{FIXTURES / 'plugin_recipe'}"})
    out = subprocess.run([sys.executable, "-c", code, "toy", "--config", "configs/debug.toml",
                          *flags({**TINY, "training.steps": 2, "eval.interval": 0}), "--toy.note=hi",
                          f"--run.dir={tmp_path / 'toy'}"], cwd=REPO, env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "  toy       a plugin's recipe: pretraining that logs a note" in out.stdout
    from lmforge.api import read_run

    run = read_run("toy", tmp_path / "toy")
    assert run.step == 2 and [r["note"] for r in run.records("toy")] == ["hi"]
    assert run.records("setup")[0]["trainer"] == "toy"


def test_a_plugin_package_adds_a_family_and_a_rollout_engine(tmp_path):
    """The same package's ``lmforge.families`` entry point registers a family (its named size builds a
    model of its own ``model_type``) and its ``lmforge.engines`` entry point an engine GRPO can name;
    without the package, neither is known."""
    code = ("from lmforge.models.args import model_args_for; from lmforge.models.spec import spec_for_args; "
            "from lmforge.rl.engines.factory import engine_kind; a = model_args_for('toy-tiny', 320); "
            "print(spec_for_args(a).name, a.dim, engine_kind('toy').live_weights)")
    with_plugin = cli_env({"PYTHONPATH": f"{REPO / 'src'}:{FIXTURES / 'plugin_recipe'}"})
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=with_plugin, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["toyllama", "64", "True"]
    without = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=cli_env({"PYTHONPATH": str(REPO / "src")}),
                             capture_output=True, text=True, timeout=300)
    assert without.returncode != 0 and "unknown model size 'toy-tiny'" in without.stderr
