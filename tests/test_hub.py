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


# ---------------------------------------------------------------------------------------- datasets
def _cache_dataset(cache: Path, repo_id: str, splits: dict[str, list[dict]]) -> None:
    """Prepare ``repo_id`` into the datasets cache as ``load_dataset`` does after a download: the library's
    own json builder writes the Arrow files and dataset_info.json, under the ``org___name`` directory the
    offline loader looks in."""
    from datasets.packaged_modules.json.json import Json

    org, name = repo_id.split("/")
    raw = cache / "raw" / name
    raw.mkdir(parents=True)
    files = {}
    for split, rows in splits.items():
        files[split] = str(raw / f"{split}.jsonl")
        Path(files[split]).write_text("".join(json.dumps(r) + "\n" for r in rows))
    Json(cache_dir=str(cache / "build"), dataset_name=name, config_name="default", config_id="default",
         hash="0123456789abcdef", data_files=files).download_and_prepare()
    (cache / "build" / name).rename(cache / f"{org}___{name}")


@pytest.fixture
def datasets_cache(tmp_path, monkeypatch) -> Path:
    pytest.importorskip("datasets")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf_home"))
    monkeypatch.delenv("HF_DATASETS_CACHE", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    cache = tmp_path / "hf_home" / "datasets"
    rows = lambda n: [{"prompt": f"What is {i} plus 1?", "completion": f" {i + 1}", "text": f"doc {i}"} for i in range(n)]  # noqa: E731
    _cache_dataset(cache, "org/chats", {"train": rows(12), "test": rows(4)})
    _cache_dataset(cache, "org/one", {"train": rows(3)})
    return cache


def test_a_cached_hub_dataset_is_read_by_name(datasets_cache, tmp_path, capfd):
    from lmforge.data.sources import read_documents, read_records

    recs = read_records("org/chats:test")
    assert [r for _, r in recs] == [{"prompt": f"What is {i} plus 1?", "completion": f" {i + 1}", "text": f"doc {i}"}
                                    for i in range(4)]
    assert recs[2][0] == "org/chats:test: row 2"
    assert read_documents("org/one") == ["doc 0", "doc 1", "doc 2"]  # one split: no need to name it
    run = tmp_path / "run"
    args = tiny_run_args(training_steps=1, training_global_batch_size=2, training_micro_batch_size=2,
                         checkpoint_enabled=False)
    assert lmforge_in_process("sft", *args, "--data.train=org/chats:train", "--data.validation=org/chats:test",
                              f"--run.dir={run}") == 0, capfd.readouterr().err[-2000:]
    lines = [r["message"] for r in read_records_of(run) if r["kind"] == "sft_data"]
    assert lines[0].startswith("sft data org/chats:train: 12 records") and "org/chats:test: 4 records" in lines[1]


def read_records_of(run: Path) -> list[dict]:
    from lmforge.metrics.records import read_records

    return read_records(run)


def test_hub_dataset_errors_are_one_line(datasets_cache, tmp_path, monkeypatch):
    from lmforge.data.sources import read_records

    with pytest.raises(UserError, match=r"^org/chats: the Hub dataset org/chats has splits train, test; name one, "
                                        r"e\.g\. org/chats:train$"):
        read_records("org/chats")
    with pytest.raises(UserError) as e:
        read_records("org/missing")
    assert "\n" not in str(e.value) and str(datasets_cache) in str(e.value) and "HF_HUB_OFFLINE=0" in str(e.value)
    with pytest.raises(UserError, match="data file not found"):  # a missing file is not a Hub name
        read_records("org/chats.jsonl")
    local = tmp_path / "org" / "chats"
    local.mkdir(parents=True)
    (local / "a.jsonl").write_text('{"prompt": "local", "completion": " wins"}\n')
    monkeypatch.chdir(tmp_path)
    assert [r for _, r in read_records("org/chats")] == [{"prompt": "local", "completion": " wins"}]
