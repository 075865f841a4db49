"""Weighted mixtures of prepared sources: proportions, passes, exact resume, config checks."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
import torch

from _helpers import REPO, finish, lmforge_in_process, losses, start_lmforge, tiny_run_args
from lmforge.config import Config, load_config
from lmforge.data.corpus import embedded_corpus
from lmforge.data.loader import StepLoader
from lmforge.data.mixture import MixtureDataset, block_quotas
from lmforge.data.packing import Sample
from lmforge.data.prepare import prepare
from lmforge.errors import UserError
from lmforge.models.tokenizer import ByteTokenizer, load_tokenizer
from lmforge.data.corpora import build_datasets, read_corpora

QWEN = REPO / "tests" / "fixtures" / "tokenizers" / "qwen2.5-instruct"


class Tagged:
    """``size`` one-token samples whose token is ``tag * 100_000 + index``: source and index readable."""

    def __init__(self, tag: int, size: int) -> None:
        self.tag, self.size = tag, size

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, i: int) -> Sample:
        t = torch.tensor([self.tag * 100_000 + i])
        return Sample(input_ids=t, labels=t)


def _drawn(loader: StepLoader, steps: int) -> list[int]:
    return [int(x) for _ in range(steps) for b in loader.next_step() for x in b.input_ids.flatten()]


def test_proportions_follow_the_weights_within_one_percent():
    for weights in ([0.7, 0.3], [1.0, 2.0, 5.0]):
        mix = MixtureDataset([Tagged(k, 50 + 900 * k) for k in range(len(weights))], weights, seed=3)
        loader = StepLoader(mix, 40, 40, 0, 1, prefetch=0)
        counts = Counter(x // 100_000 for x in _drawn(loader, 250))  # 10,000 samples
        for k, w in enumerate(weights):
            assert abs(counts[k] / 10_000 - w / sum(weights)) < 0.01, (weights, counts)
    assert block_quotas([0.7, 0.3], 4096) == [2867, 1229]
    assert block_quotas([1e-9, 1.0], 4096) == [1, 4095]  # every source is drawn


def test_each_pass_over_a_source_visits_every_sample_once_in_a_new_order():
    mix = MixtureDataset([Tagged(0, 37), Tagged(1, 1000)], [3.0, 1.0], seed=0)
    small = [s for s in (mix.locate(i) for i in range(2000)) if s[0] == 0]
    passes = [[j for _, j in small[p * 37:(p + 1) * 37]] for p in range(len(small) // 37)]
    assert len(passes) > 3 and all(sorted(p) == list(range(37)) for p in passes)
    assert passes[0] != passes[1]
    ordered = MixtureDataset([Tagged(0, 37), Tagged(1, 1000)], [3.0, 1.0], shuffle=False)
    assert [j for k, j in map(ordered.locate, range(200)) if k == 0][:40] == [*range(37), 0, 1, 2]


def test_the_same_samples_at_any_world_size_and_after_a_resume():
    def mix():
        return MixtureDataset([Tagged(0, 300), Tagged(1, 500)], [0.4, 0.6], seed=7)

    whole = _drawn(StepLoader(mix(), 8, 2, 0, 1, prefetch=2), 30)
    ranks = [_drawn(StepLoader(mix(), 8, 2, r, 2, prefetch=0), 30) for r in range(2)]
    interleaved = [x for s in range(30) for r in range(2) for x in ranks[r][s * 4:(s + 1) * 4]]
    assert interleaved == whole
    first = StepLoader(mix(), 8, 2, 0, 1)
    _drawn(first, 12)
    resumed = StepLoader(mix(), 8, 4, 0, 1)
    resumed.load_state_dict(first.state_dict())
    assert _drawn(resumed, 18) == whole[12 * 8:]


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("sources")
    out = {}
    for name, split, n in (("stories", "train", 300), ("other", "validation", 200)):
        text = root / f"{name}.txt"
        text.write_text("\n\n".join(embedded_corpus(split, n)))
        out[name] = prepare([text], root / name, ByteTokenizer(), log=lambda line: None).out
    return out


def _mixture_args(sources: dict[str, Path], **overrides) -> list[str]:
    spec = f'[{{path="{sources["stories"]}", weight=3}}, {{path="{sources["other"]}", weight=1}}]'
    return [*tiny_run_args(data_validation=sources["other"], training_steps=8, checkpoint_interval=2,
                           elastic_snapshot_interval=0, **overrides), f"--data.sources={spec}"]


def test_a_killed_mixture_run_resumes_with_identical_losses(sources, tmp_path, capfd):
    """SIGKILLed at step 5 (checkpoint at step 4), the rerun continues from the shards' global sample
    index: every loss equals the uninterrupted run's. The killed run is a real CLI process; the
    uninterrupted and the resumed runs go through the CLI's entry point in this process."""
    run = tmp_path / "killed"
    killed = start_lmforge("pretrain", "--elastic.enabled=true", *_mixture_args(sources), f"--run.dir={run}",
                           extra_env={"LMFORGE_FAULT": "rank=0,step=5,mode=kill"})
    try:  # the uninterrupted run meanwhile
        assert lmforge_in_process("pretrain", "--elastic.enabled=true", *_mixture_args(sources), f"--run.dir={tmp_path / 'straight'}") == 0
    finally:
        rc, _, err = finish(killed)
    assert rc == -9, err[-3000:]
    capfd.readouterr()
    rc = lmforge_in_process("pretrain", "--elastic.enabled=true", *_mixture_args(sources), f"--run.dir={run}")
    out, err = capfd.readouterr()
    assert rc == 0 and "resumed from" in out, err[-3000:]
    want = losses(tmp_path / "straight")
    assert losses(run) == want and sorted(want) == list(range(1, 9))


def _cfg(*overrides: str) -> Config:
    return load_config(Config, None, list(overrides))


def test_mixture_config_is_checked_in_one_line(sources, tmp_path, capfd):
    stories, other = sources["stories"], sources["other"]
    with pytest.raises(UserError, match=r"config key `data.sources.1.weight`: Input should be greater than 0"):
        _cfg(f'--data.sources=[{{path="{stories}"}}, {{path="{other}", weight=0}}]')
    with pytest.raises(UserError, match=r"unknown config key `data.sources.0.wieght`"):
        _cfg(f'--data.sources=[{{path="{stories}", wieght=1}}]')
    with pytest.raises(UserError, match=rf"data.sources\[1\].path={tmp_path}/nope: .*not found"):
        read_corpora(_cfg(f'--data.sources=[{{path="{stories}"}}, {{path="{tmp_path}/nope"}}]'))
    with pytest.raises(UserError, match=r"data.train=x.txt and data.sources are both set"):
        read_corpora(_cfg("--data.train=x.txt", f'--data.sources=[{{path="{stories}"}}]'))
    text = tmp_path / "q.txt"
    text.write_text("\n\n".join(embedded_corpus("train", 100)))
    qwen = prepare([text], tmp_path / "qwen", load_tokenizer(str(QWEN)), log=lambda line: None).out
    cfg = _cfg(f'--data.sources=[{{path="{stories}"}}, {{path="{qwen}"}}]', f"--data.validation={other}")
    with pytest.raises(UserError, match=rf"data.sources\[1\].path={qwen}: prepared with tokenizer"):
        build_datasets(cfg, ByteTokenizer())
    rc = lmforge_in_process("pretrain", *tiny_run_args(), f'--data.sources=[{{path="{stories}", weight=-1}}]',
                            f"--run.dir={tmp_path / 'run'}")
    assert rc == 2 and capfd.readouterr().err.strip().splitlines() == [
        "error: command line: config key `data.sources.0.weight`: Input should be greater than 0 (got -1)"]
