#!/usr/bin/env bash
# Tokens/s and MFU of the ~1B model (the `1b` preset: dim 2048, 16 layers, GQA 32/8, SwiGLU 8192;
# ~0.97B non-embedding parameters) in bf16 with torch.compile on ONE GPU: lmforge's trainer vs a
# bare PyTorch loop, in a few minutes. Runs unattended; needs no network if torch (CUDA build),
# numpy, pydantic, tokenizers, safetensors are importable.
#
#   bash bench/gpu.sh                    # lmforge + bare, seq 2048, batch 8, 30 steps each
#   GPU_BENCH_HF=1 bash bench/gpu.sh     # also the Hugging Face Trainer (needs transformers+accelerate)
#   PYTHON=/path/to/python bash bench/gpu.sh
#
# Output: the table on stdout, a section appended to BENCHMARKS.md, and (when $OUT is set, as on
# a lent machine) gpu_bench.log, BENCHMARKS.md and nvidia-smi.txt copied into $OUT.
set -uo pipefail
cd "$(dirname "$0")/.."

OUT_DIR="${OUT:-}"
LOG="$(mktemp /tmp/lmforge-gpu-bench.XXXXXX.log)"
finish() {
  sleep 1  # let tee flush the log
  if [ -n "$OUT_DIR" ]; then
    mkdir -p "$OUT_DIR"
    cp "$LOG" "$OUT_DIR/gpu_bench.log" 2>/dev/null || true
    cp BENCHMARKS.md "$OUT_DIR/" 2>/dev/null || true
  fi
}
trap finish EXIT
exec > >(tee -a "$LOG") 2>&1

# 1. A Python whose torch sees a GPU: $PYTHON, the project venv, then python3/python on PATH.
PY=""
for cand in "${PYTHON:-}" .venv/bin/python python3 python; do
  [ -z "$cand" ] && continue
  command -v "$cand" >/dev/null 2>&1 || continue
  if "$cand" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" >/dev/null 2>&1; then
    PY="$cand"; break
  fi
done
if [ -z "$PY" ]; then
  echo "gpu.sh: no Python with a CUDA-enabled torch and a visible GPU found (set PYTHON=...)" >&2
  exit 2
fi
echo "python: $PY ($("$PY" -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda)'))"
[ -n "$OUT_DIR" ] && mkdir -p "$OUT_DIR"
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,power.limit --format=csv 2>/dev/null \
  | tee "${OUT_DIR:-/tmp}/nvidia-smi.txt" || true

# 2. lmforge's own dependencies: install only what is missing (fails harmlessly offline).
missing=$("$PY" - <<'EOF'
import importlib.util
need = {"numpy": "numpy", "pydantic": "pydantic>=2.5", "tokenizers": "tokenizers>=0.15",
        "safetensors": "safetensors>=0.4", "jinja2": "jinja2"}
print(" ".join(spec for mod, spec in need.items() if importlib.util.find_spec(mod) is None))
EOF
)
if [ -n "$missing" ]; then
  echo "installing: $missing"
  "$PY" -m pip install -q $missing || { echo "gpu.sh: cannot install $missing" >&2; exit 2; }
fi
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
# TensorBoard is part of lmforge's normal logging; keep it when importable, else log without it.
SETS=()
if ! "$PY" -c "import torch.utils.tensorboard" >/dev/null 2>&1; then
  echo "tensorboard not importable: lmforge runs with --set metrics.tensorboard=false"
  SETS+=(--set metrics.tensorboard=false)
fi
SYSTEMS="lmforge,bare"
if [ "${GPU_BENCH_HF:-0}" = "1" ]; then
  if "$PY" -c "import transformers, accelerate" >/dev/null 2>&1; then SYSTEMS="$SYSTEMS,hf"
  else echo "GPU_BENCH_HF=1 but transformers/accelerate are missing: skipping hf"; fi
fi
export TORCHINDUCTOR_CACHE_DIR="${TORCHINDUCTOR_CACHE_DIR:-/tmp/lmforge-inductor-cache}"

# 3. The measurement: 10 warm-up steps (compilation happens here), then 20 timed steps per system.
# Tokens per step: batch 8 x 2048 = 16,384. Memory: fp32 weights + AdamW state ~16 GB, bf16
# activations of 16 layers well under the 141 GB of an H200 (lower BATCH on smaller GPUs).
set -x
timeout "${GPU_BENCH_TIMEOUT:-540}" "$PY" bench/throughput.py --device cuda --sizes "${SIZE:-1b}" \
  --dtype bfloat16 --compile --systems "$SYSTEMS" --seq-len "${SEQ_LEN:-2048}" --batch "${BATCH:-8}" \
  --steps 30 --warmup 10 --repeats "${REPEATS:-1}" ${SETS[@]+"${SETS[@]}"}
rc=$?
set +x
[ $rc -eq 124 ] && echo "gpu.sh: timed out after ${GPU_BENCH_TIMEOUT:-540}s (raise GPU_BENCH_TIMEOUT or lower BATCH)"
exit $rc
