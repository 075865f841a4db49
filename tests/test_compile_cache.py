"""``training.compile``: the caches' directory, the ``auto`` rule, and the config's accepted values."""

from __future__ import annotations

import os

import pytest
import torch

from lmforge.config import Config, validate_config
from lmforge.errors import UserError
from lmforge.runtime import compile_cache as cc


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("LMFORGE_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    return tmp_path


def test_cache_dir_per_torch_version_and_both_caches_on(cache, monkeypatch) -> None:
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config

    monkeypatch.setattr(inductor_config, "fx_graph_cache", False)
    monkeypatch.setattr(functorch_config, "enable_autograd_cache", False)
    want = cache / "compile" / f"torch-{torch.__version__}"
    assert cc.compile_cache_dir() == want
    assert cc.enable_compile_caches() == str(want) == os.environ["TORCHINDUCTOR_CACHE_DIR"]
    assert inductor_config.fx_graph_cache and functorch_config.enable_autograd_cache
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(cache / "mine"))  # the user's choice is kept
    assert cc.enable_compile_caches() == str(cache / "mine")


def test_auto_compiles_when_the_saving_beats_the_cost(cache) -> None:
    peak = 1e12  # at ASSUMED_MFU 0.3: a 3e11-FLOP step takes 1 s, and 1.2x saves 1/6 of it
    assert cc.choose_compile(True, 1, 1.0, peak, 0, "k") == (True, "training.compile")
    assert cc.choose_compile(False, 10**6, 3e11, peak, 0, "k") == (False, "training.compile")
    cold_breakeven = cc.COLD_SECONDS / (1 - 1 / cc.SPEEDUP)  # 270 steps of 1 s
    on, why = cc.choose_compile("auto", int(cold_breakeven) + 2, 3e11, peak, 0, "k")
    assert on and why.startswith("auto: ") and "cache cold" in why
    assert not cc.choose_compile("auto", int(cold_breakeven) - 2, 3e11, peak, 0, "k")[0]
    # a time budget caps the run's estimate
    assert not cc.choose_compile("auto", 10**6, 3e11, peak, cold_breakeven / 2, "k")[0]
    # the same shapes compiled before: the warm cost decides
    steps = int(cc.WARM_SECONDS / (1 - 1 / cc.SPEEDUP)) + 2
    assert not cc.choose_compile("auto", steps, 3e11, peak, 0, "k")[0]
    cc.enable_compile_caches()
    cc.mark_compiled("k")
    on, why = cc.choose_compile("auto", steps, 3e11, peak, 0, "k")
    assert on and "cache warm" in why
    assert not cc.choose_compile("auto", steps, 3e11, peak, 0, "other shapes")[0]
    assert cc.shape_key(1, "a") != cc.shape_key(1, "b") and len(cc.shape_key(1)) == 16


def test_config_takes_auto_and_refuses_other_words() -> None:
    assert validate_config(Config, {"training": {"compile": "auto"}}).training.compile == "auto"
    assert validate_config(Config, {"training": {"compile": True}}).training.compile is True
    with pytest.raises(UserError) as err:
        validate_config(Config, {"training": {"compile": "sometimes"}})
    assert "training.compile" in str(err.value) and "\n" not in str(err.value)
