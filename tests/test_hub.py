"""Models named as on the Hugging Face Hub, read offline (``HF_HUB_OFFLINE=1``) from a Hugging Face cache
the test lays out itself: ``models--org--tiny/refs/<rev>`` holding commit hashes and
``snapshots/<commit>/`` holding a tiny model's files."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from _helpers import lmforge_in_process, tiny_run_args
from _hf_models import hf_start
from lmforge.errors import UserError
from lmforge.models.hf import load_hf_model
from lmforge.models.load import ModelSource, load_model

pytest.importorskip("huggingface_hub")
pytest.importorskip("transformers")

MAIN, V1 = "a" * 40, "b" * 40
SHAPE_FLAGS = dict(model_size=None, model_n_layers=None, model_dim=None, model_n_heads=None, model_n_kv_heads=None)


@pytest.fixture(scope="module")
def hf_home(tmp_path_factory) -> Path:
    """An HF_HOME whose hub cache holds org/tiny at two commits: ``main`` -> MAIN, tag ``v1`` -> V1 (other weights)."""
    from safetensors.torch import load_file, save_file

    home = tmp_path_factory.mktemp("hf_home")
    repo = home / "hub" / "models--org--tiny"
    main = hf_start("smollm2", repo / "snapshots" / MAIN)
    other = repo / "snapshots" / V1
    shutil.copytree(main, other)
    weights = load_file(other / "model.safetensors")
    weights["model.norm.weight"] = weights["model.norm.weight"] + 0.5
    save_file(weights, other / "model.safetensors", metadata={"format": "pt"})
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(MAIN)
    (repo / "refs" / "v1").write_text(V1)
    return home


@pytest.fixture
def offline(hf_home, monkeypatch) -> Path:
    monkeypatch.setenv("HF_HOME", str(hf_home))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return hf_home


def _logits(model: torch.nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model.eval()(torch.arange(10, 26).unsqueeze(0))


def test_hub_name_resolves_to_the_cached_commit(offline):
    snapshots = offline / "hub" / "models--org--tiny" / "snapshots"
    source = ModelSource.from_hf("org/tiny")
    assert source == ModelSource("hub", f"org/tiny@{MAIN}") and ModelSource.parse(str(source)) == source
    loaded = load_model(source)
    assert loaded.tokenizer_spec == str((snapshots / MAIN).resolve())
    torch.testing.assert_close(_logits(loaded.model), _logits(load_hf_model(snapshots / MAIN)))
    assert ModelSource.at("org/tiny") == source  # generate / export / eval name models the same way


@pytest.mark.parametrize("name", ["org/tiny@v1", f"org/tiny@{V1}"])
def test_a_revision_is_a_tag_or_a_commit(offline, name):
    source = ModelSource.from_hf(name)
    assert source.where == f"org/tiny@{V1}"
    at_main = load_model(ModelSource.from_hf("org/tiny")).model
    assert not torch.allclose(_logits(load_model(source).model), _logits(at_main))  # the other weights


def test_a_name_not_in_the_cache_is_one_line(offline):
    with pytest.raises(UserError) as e:
        ModelSource.from_hf("org/missing")
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("model.from_hf=org/missing: ")
    assert str(offline / "hub") in msg and "hf download org/missing" in msg and "HF_HUB_OFFLINE=0" in msg
    with pytest.raises(UserError, match=r"org/tiny@v9.*not in the Hugging Face cache.*--revision v9"):
        ModelSource.at("org/tiny@v9")


def test_a_local_directory_wins(offline, tmp_path, monkeypatch):
    local = tmp_path / "org" / "tiny"
    shutil.copytree(offline / "hub" / "models--org--tiny" / "snapshots" / V1, local)
    monkeypatch.chdir(tmp_path)
    assert ModelSource.from_hf("org/tiny") == ModelSource("hf", "org/tiny")
    assert ModelSource.at("org/tiny") == ModelSource("hf", "org/tiny")


def test_checkpoints_keep_the_commit_a_reference_was_loaded_from(offline, tmp_path, capfd):
    """DPO from ``org/tiny``: its checkpoint names the commit; after ``main`` moves, the resumed run still
    scores against the weights it started with (and says so)."""
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text("".join(json.dumps({"prompt": f"{i} plus 3 is", "chosen": f" {i + 3}", "rejected": " no"}) + "\n"
                             for i in range(4)))
    run = tmp_path / "run"

    def dpo(steps: int) -> None:
        args = tiny_run_args(pairs, training_steps=steps, training_global_batch_size=2, training_micro_batch_size=2,
                             data_seq_len=32, data_validation="none", **SHAPE_FLAGS)
        assert lmforge_in_process("dpo", *args, "--model.from_hf=org/tiny", f"--run.dir={run}",
                                  "--checkpoint.interval=1") == 0, capfd.readouterr().err[-2000:]

    dpo(1)
    state = json.loads(next((run / "checkpoints").glob("step_*/trainer_state.json")).read_text())
    assert state["data"]["reference"] == f"hub:org/tiny@{MAIN}"
    (offline / "hub" / "models--org--tiny" / "refs" / "main").write_text(V1)
    try:
        dpo(2)
    finally:
        (offline / "hub" / "models--org--tiny" / "refs" / "main").write_text(MAIN)
    events = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert any(f"reference model: hub:org/tiny@{MAIN}" in str(e.get("message", "")) for e in events)
