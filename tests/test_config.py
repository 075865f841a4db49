"""Config loading, overrides and one-line validation errors."""

from pathlib import Path

import pytest

from lmforge.config import Config, dump_toml, load_config, parse_overrides, read_toml
from lmforge.errors import UserError

CONFIGS = Path(__file__).resolve().parents[1] / "configs"


def test_overrides_parse_types_and_nesting():
    out = parse_overrides(["--training.steps=50", "--optimizer.lr", "1e-3", "--run.dir=runs/x",
                           "--training.compile=true", "--data.seq-len=64"])
    assert out == {"training": {"steps": 50, "compile": True}, "optimizer": {"lr": 1e-3},
                   "run": {"dir": "runs/x"}, "data": {"seq_len": 64}}


def test_file_then_overrides(tmp_path):
    f = tmp_path / "c.toml"
    f.write_text("[training]\nsteps = 7\nseed = 3\n")
    cfg = load_config(Config, f, ["--training.steps=9"])
    assert cfg.training.steps == 9 and cfg.training.seed == 3


def test_unknown_key_suggests_closest(tmp_path):
    with pytest.raises(UserError, match=r"unknown config key `training.stpes` \(did you mean `training.steps`\?\)"):
        load_config(Config, None, ["--training.stpes=3"])
    with pytest.raises(UserError, match=r"did you mean `training.steps`"):
        load_config(Config, None, ["--optimizer.steps=3"])


def test_wrong_type_and_range_name_the_key(tmp_path):
    with pytest.raises(UserError, match=r"command line: config key `training.steps`: .*integer.*'many'"):
        load_config(Config, None, ["--training.steps=many"])
    with pytest.raises(UserError, match=r"config key `optimizer.lr`: .*greater than 0"):
        load_config(Config, None, ["--optimizer.lr=-1"])
    with pytest.raises(UserError, match=r"config key `schedule.kind`"):
        load_config(Config, None, ["--schedule.kind=exp"])


@pytest.mark.parametrize("override, key", [("--parallel.tp=true", "parallel.tp"), ("--parallel.dp_shard=false", "parallel.dp_shard"),
                                           ("--training.steps=true", "training.steps"), ("--optimizer.lr=true", "optimizer.lr")])
def test_a_boolean_is_not_a_number(override, key):
    """pydantic's lax mode reads true as 1: every numeric key of every section refuses a boolean instead."""
    with pytest.raises(UserError, match=rf"config key `{key}`: Value error, expected a number, got the boolean"):
        load_config(Config, None, [override])
    assert load_config(Config, None, ["--parallel.sequence_parallel=false"]).parallel.sequence_parallel is False


def test_lora_without_target_modules_is_refused():
    with pytest.raises(UserError, match=r"lora.target_modules is empty: name at least one of the model's"):
        load_config(Config, None, ["--lora.enabled=true", "--lora.target_modules=[]"])
    assert load_config(Config, None, ["--lora.enabled=true"]).lora.target_modules is None  # left out: all
    with pytest.raises(UserError, match=r"lora.target_modules is empty"):
        load_config(Config, None, ["--lora.enabled=true", "--lora.target_modules=,"])
    assert load_config(Config, None, ["--lora.target_modules=[]"]).lora.target_modules == []  # off: unused


def test_bad_toml_names_file_and_line(tmp_path):
    f = tmp_path / "bad.toml"
    f.write_text("[training]\nsteps = = 3\n")
    with pytest.raises(UserError, match=r"bad.toml: invalid TOML: .*line 2"):
        load_config(Config, f)
    with pytest.raises(UserError, match="config file not found"):
        load_config(Config, tmp_path / "missing.toml")


def test_resolved_config_roundtrips_through_toml(tmp_path):
    cfg = load_config(Config, CONFIGS / "debug.toml", ["--training.steps=5"])
    f = tmp_path / "resolved.toml"
    f.write_text(dump_toml(cfg.to_dict()))
    again = load_config(Config, f)
    assert again == cfg and read_toml(f)["training"]["steps"] == 5


@pytest.mark.parametrize("name", sorted(p.name for p in CONFIGS.glob("*.toml")))
def test_shipped_configs_validate(name):
    """Each shipped config validates against the recipe whose section it has ([sft], [grpo], ...; none:
    pretrain)."""
    from lmforge.recipes import recipes

    text = read_toml(CONFIGS / name)
    kind = next((name for name in recipes() if name in text), "pretrain")
    load_config(recipes()[kind].config, CONFIGS / name)
