"""Model-splitting layouts end to end (real torchrun, 4 CPU processes, gloo): tensor, context, pipeline
and expert parallelism, each beside FSDP2, reproduce one process's losses and gradient norms, and their
checkpoints continue in another layout.

Each layout trains steps 1-4 of the tiny run (saving a checkpoint on a token budget) and the run then
continues in a different layout for steps 5-8; every step's loss and pre-clip gradient norm must equal
the uninterrupted single-process run's (fp32, 1e-5 relative: sums in another order round differently in
the last bits only). The module-level checks of each dimension (gradients of every parameter against
one process) are in test_tensor_parallel.py, test_context_parallel.py, test_pipeline_parallel.py and
test_expert_parallel.py. One-process runs go through the CLI's entry point in the test process
(``lmforge_in_process``), torchrun's through the real CLI.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from _helpers import STEPS, TOKENS_PER_STEP, lmforge_in_process, tail, tiny_run_args, torchrun
from lmforge.metrics.records import read_records

HALF = STEPS // 2


def curves(run: Path) -> dict[int, tuple[float, float]]:
    """(loss, grad norm) per step; a step logged twice must agree."""
    out: dict[int, tuple[float, float]] = {}
    for r in read_records(run, "train"):
        out.setdefault(r["step"], (r["loss"], r["grad_norm"]))
    return out


def assert_curves_match(got: dict[int, tuple[float, float]], want: dict[int, tuple[float, float]], steps,
                        rel: float = 1e-5) -> None:
    for s in steps:
        assert s in got, f"step {s} missing from {sorted(got)}"
        for name, g, w in zip(("loss", "grad_norm"), got[s], want[s]):
            assert abs(g - w) <= rel * abs(w), f"step {s} {name}: {g} vs {w}"


@pytest.fixture(scope="module")
def reference(reference_curve_run) -> dict[int, tuple[float, float]]:
    """The session's uninterrupted one-process run (conftest.py; the distributed and elastic tests
    compare with the same run, so a worker trains it once)."""
    return curves(reference_curve_run)


def exported_weights(run: Path, out: Path) -> dict:
    from safetensors.torch import load_file

    assert lmforge_in_process("export", "--hf", str(out), str(run)) == 0
    return {k: v for f in sorted(out.glob("*.safetensors")) for k, v in load_file(f).items()}


@pytest.fixture(scope="module")
def reference_weights(tmp_path_factory, reference_curve_run) -> dict:
    """The reference run's export, read-only: made once for the layouts that compare with it."""
    return exported_weights(reference_curve_run, tmp_path_factory.mktemp("layouts") / "reference_hf")


def train(run: Path, corpus: Path, nproc: int, layout: dict, *extra: str, half: bool = False, **overrides) -> None:
    budget = {"training_max_tokens": HALF * TOKENS_PER_STEP} if half else {}
    args = ("pretrain", *tiny_run_args(corpus, training_micro_batch_size=2, **budget, **overrides,
                                       **{f"parallel_{k}": v for k, v in layout.items()}), *extra, f"--run.dir={run}")
    if nproc == 1:  # one process: the CLI's entry point in this one (a subprocess would only add imports)
        assert lmforge_in_process(*args) == 0
        return
    proc = torchrun(*args, nproc=nproc)
    assert proc.returncode == 0, tail(proc)


def check_layout_then_resume(run: Path, corpus: Path, reference, first, then, *extra: str, rel: float = 1e-5,
                             **overrides) -> None:
    (n1, layout1), (n2, layout2) = first, then
    train(run, corpus, n1, layout1, *extra, half=True, **overrides)
    setup = read_records(run, "setup")[0]
    assert setup["world_size"] == n1 and all(f"{k}={v}" in setup["mesh"] for k, v in layout1.items() if k != "mode")
    assert_curves_match(curves(run), reference, range(1, HALF + 1), rel)
    train(run, corpus, n2, layout2, *extra, **overrides)
    assert read_records(run, "resume")[-1]["step"] == HALF
    assert read_records(run, "setup")[-1]["world_size"] == n2
    assert_curves_match(curves(run), reference, range(1, STEPS + 1), rel)


@pytest.mark.parametrize("first, then", [
    ((4, {"cp": 2, "dp_shard": 2}), (1, {})),
    ((4, {"tp": 2, "dp_shard": 2}), (2, {"pp": 2})),
    ((4, {"pp": 2, "dp_shard": 2}), (2, {"tp": 2})),
    ((4, {"pp": 2, "tp": 2}), (2, {"cp": 2})),
], ids=["cp2xdp_shard2-then-one-process", "tp2xdp_shard2-then-pp2", "pp2xdp_shard2-then-tp2", "pp2xtp2-then-cp2"])
def test_layout_matches_one_process_and_continues_in_another(tmp_path, corpus, reference, request, first, then):
    check_layout_then_resume(tmp_path / "run", corpus, reference, first, then)
    if then[1]:  # the final checkpoint was saved split over the second layout: export reads it whole
        import torch

        got, want = exported_weights(tmp_path / "run", tmp_path / "hf"), request.getfixturevalue("reference_weights")
        assert got.keys() == want.keys()
        for k in want:  # 8 AdamW steps amplify last-bit gradient differences where v is tiny: ~1e-4 of the scale
            scale = float(want[k].abs().max())
            assert float((got[k] - want[k]).abs().max()) <= 5e-4 * scale, k


def test_expert_parallel_moe_matches_one_process_and_continues_on_one(tmp_path, corpus):
    """A Mixtral-shaped MoE (4 experts, top-2) with its experts over ep=2 inside dp_shard=4 (dp_shard_mod_ep=2
    x ep=2). The router's load-balancing term is off: it is computed per microbatch, so it differs with
    the microbatch split whatever the layout. The grad norms of FSDP2 runs of this MoE (with or without
    ep) differ from one process's in the 6th digit, hence the wider tolerance; a wrong expert gradient
    scale (ep times too large) is off by far more."""
    from _hf_models import hf_start

    start = hf_start("mixtral", tmp_path / "start")
    moe = dict(model_size=None, model_n_layers=None, model_dim=None, model_n_heads=None, model_n_kv_heads=None)
    extra = (f"--model.from_hf={start}", "--training.router_aux_loss_coef=0")
    ref = tmp_path / "reference"
    assert lmforge_in_process("pretrain", *tiny_run_args(corpus, training_micro_batch_size=8, **moe), *extra,
                              f"--run.dir={ref}") == 0
    check_layout_then_resume(tmp_path / "run", corpus, curves(ref), (4, {"ep": 2, "mode": "fsdp"}), (1, {}), *extra,
                             rel=1e-4, **moe)


def test_sft_with_tensor_and_context_parallel_together_matches_one_process(tmp_path):
    """SFT on real multi-turn chats (prompt tokens masked) at tp=2 x cp=2: every rank holds a quarter of
    each sequence's work, and the loss over the response tokens is the one process's."""
    chats = Path(__file__).resolve().parent / "fixtures" / "data" / "fastchat_identity_multiturn.jsonl"
    sft = dict(data_seq_len=64, data_prefetch=0)
    ref, run = tmp_path / "reference", tmp_path / "run"
    assert lmforge_in_process("sft", *tiny_run_args(chats, training_micro_batch_size=8, **sft), f"--run.dir={ref}") == 0
    proc = torchrun("sft", *tiny_run_args(chats, training_micro_batch_size=2, parallel_tp=2, parallel_cp=2, **sft),
                    f"--run.dir={run}", nproc=4)
    assert proc.returncode == 0, tail(proc)
    assert read_records(run, "setup")[0]["mesh"] == "cp=2 x tp=2"
    assert_curves_match(curves(run), curves(ref), range(1, STEPS + 1))


def test_ranks_started_with_different_layouts_stop_in_one_line(tmp_path, corpus):
    """Rank 1 gets one more flag than rank 0: the ranks would build different meshes and wait in different
    collectives; instead the ranks stop at start-up with one line, before the run directory exists."""
    import subprocess
    import sys

    from _helpers import REPO, cli_env

    runner = tmp_path / "runner.py"
    runner.write_text("import os, sys\nfrom lmforge.cli import main\n"
                      "extra = ['--parallel.mode=fsdp'] if os.environ['RANK'] == '1' else []\n"
                      "sys.exit(main(sys.argv[1:] + extra))\n")
    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", str(runner),
           "pretrain", *tiny_run_args(corpus), f"--run.dir={run}"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=REPO, env=cli_env())
    assert proc.returncode != 0
    line = "error: the ranks were started with different layouts: parallel.mode=ddp on rank 0 but fsdp on rank 1"
    assert line in proc.stderr, tail(proc)  # (torchrun stops the other rank once one exits; its summary follows)
    assert "lmforge/" not in proc.stderr and not run.exists()  # no traceback of lmforge's; nothing written
