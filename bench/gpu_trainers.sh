#!/usr/bin/env bash
# Every trainer through the one loop on ONE GPU, in bf16: pretrain -> SFT -> GRPO (with a KL
# reference and num_iterations=2) -> resume of each, a few dozen steps each, on the debug model.
# Checks that the run finishes, that each stage logs its lines, and prints the last metrics line of
# each stage. Needs a CUDA build of torch with lmforge's dependencies importable.
#
#   bash bench/gpu_trainers.sh            # a minute or two on a GPU
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
R="$(mktemp -d /tmp/lmforge-gpu-trainers.XXXXXX)"
common=(--training.dtype=bfloat16 --metrics.progress=off --metrics.tensorboard=false --metrics.log_every=10)

"$PY" -c 'import os, torch; assert torch.cuda.is_available() or os.environ.get("ALLOW_CPU"), "no GPU"
print("device:", torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu", "torch", torch.__version__)'
set -x
"$PY" -m lmforge pretrain --config configs/debug.toml "${common[@]}" --training.steps=60 --eval.interval=30 \
  --checkpoint.interval=30 --run.dir="$R/pretrain"
"$PY" -m lmforge sft --config configs/sft_debug.toml "${common[@]}" --model.from_checkpoint="$R/pretrain" \
  --training.steps=40 --eval.interval=20 --checkpoint.interval=20 --tasks.eval_examples=60 --run.dir="$R/sft"
"$PY" -m lmforge grpo --config configs/grpo_debug.toml "${common[@]}" --model.from_checkpoint="$R/sft" \
  --training.steps=8 --grpo.beta=0.05 --grpo.num_iterations=2 --eval.interval=4 --checkpoint.interval=4 \
  --tasks.eval_examples=60 --run.dir="$R/grpo"
# Resume each finished run for more steps: the loop restores model, optimizer, data position and RNG.
"$PY" -m lmforge pretrain --config configs/debug.toml "${common[@]}" --training.steps=70 --eval.interval=30 \
  --checkpoint.interval=30 --run.dir="$R/pretrain"
"$PY" -m lmforge grpo --config configs/grpo_debug.toml "${common[@]}" --model.from_checkpoint="$R/sft" \
  --training.steps=12 --grpo.beta=0.05 --grpo.num_iterations=2 --eval.interval=4 --checkpoint.interval=4 \
  --tasks.eval_examples=60 --run.dir="$R/grpo"
set +x
"$PY" - "$R" <<'EOF'
import sys
from lmforge.metrics.records import read_records
for stage in ("pretrain", "sft", "grpo"):
    recs = read_records(f"{sys.argv[1]}/{stage}")
    kinds = [r["kind"] for r in recs]
    train = [r for r in recs if r["kind"] == "train"]
    assert train and "resume" in kinds or stage == "sft", (stage, kinds)
    last = train[-1]
    keep = ("step", "loss", "tokens_per_sec_per_device", "mfu", "reward/mean", "grpo/kl", "exact_match")
    print(stage, {k: last[k] for k in keep if k in last},
          "evals:", [(r["step"], round(r.get("exact_match", r.get("loss", 0)), 3)) for r in recs if r["kind"] == "eval"])
print("all trainers ran on the GPU through the shared loop")
EOF
