"""FLOP accounting for model FLOPs utilisation (MFU).

MFU = achieved model FLOP/s / peak FLOP/s of the hardware. The numerator counts only the
FLOPs the model mathematically needs (no recomputation from activation checkpointing),
so MFU stays comparable across memory-saving settings.
"""

from __future__ import annotations

import time
from typing import Iterable

import torch

from lmforge.models.args import ModelArgs
from lmforge.models.configs import AttentionConfig, LatentAttentionConfig, MLPConfig, MoEConfig


def _attention_params(att: AttentionConfig | LatentAttentionConfig) -> int:
    d = att.dim
    if isinstance(att, LatentAttentionConfig):  # q (through its low-rank bottleneck), kv latent + shared key, up, out
        H, qk = att.n_heads, att.qk_head_dim
        q = d * H * qk if att.q_lora_rank is None else d * att.q_lora_rank + att.q_lora_rank * H * qk
        kv = d * (att.kv_lora_rank + att.qk_rope_head_dim) + att.kv_lora_rank * H * (att.qk_nope_head_dim + att.v_head_dim)
        return q + kv + H * att.v_head_dim * d
    return d * att.n_heads * att.head_dim + 2 * d * att.n_kv_heads * att.head_dim + att.n_heads * att.head_dim * d


def _feed_forward_params(ff: MLPConfig | MoEConfig) -> int:
    if isinstance(ff, MLPConfig):
        return 3 * ff.dim * ff.hidden_dim
    active = ff.dim * ff.router.n_experts + ff.router.top_k * 3 * ff.dim * ff.expert.hidden_dim
    return active + (0 if ff.shared is None else 3 * ff.dim * ff.shared.hidden_dim)


def _score_dims(att: AttentionConfig | LatentAttentionConfig) -> int:
    """Features per query of ``QK^T`` plus ``AV`` (``2 * n_heads * head_dim`` for plain attention)."""
    if isinstance(att, LatentAttentionConfig):
        return att.n_heads * (att.qk_head_dim + att.v_head_dim)
    return 2 * att.n_heads * att.head_dim


def matmul_params(args: ModelArgs) -> int:
    """Parameters that take part in a matmul per token: all projections incl. the output head.

    Counted from the blocks' module configs (``args.decoder_config()``), so every family's own modules
    count as they compute. The embedding lookup is a gather, not a matmul, so it is excluded even when
    tied (the tied matrix is then counted once, as the output projection). Norm weights (incl. q/k
    norms), biases and sinks are elementwise and negligible. ``head_dim`` is taken as configured, which
    need not be ``dim / n_heads`` (Qwen3, Gemma). A mixture-of-experts layer counts its *active*
    parameters: the router plus the ``top_k`` experts each token runs through (and a shared expert),
    not all ``n_experts``; latent attention counts its low-rank projections.
    """
    cfg = args.decoder_config()
    blocks = sum(_attention_params(b.attention) + _feed_forward_params(b.feed_forward) for b in cfg.blocks)
    return blocks + cfg.dim * cfg.vocab_size


def weight_flops_per_token(args: ModelArgs, adapter_params: int | None = None) -> float:
    """Training FLOPs per token of the weight matmuls: ``6 * N`` (see :func:`flops_per_token`).

    With LoRA (``adapter_params`` trainable adapter parameters on a frozen base) the backward pass
    computes no gradients for the frozen weights, only for their inputs: ``4 * N`` for the base plus
    ``6 * adapter_params`` for the adapters' own two small matmuls per adapted layer. Counting
    ``6 * N`` there would credit LoRA runs with a third more work than they do.
    """
    if adapter_params is None:
        return 6.0 * matmul_params(args)
    return 4.0 * matmul_params(args) + 6.0 * adapter_params


def flops_per_token(args: ModelArgs, seq_len: int, adapter_params: int | None = None) -> float:
    """Training FLOPs per token (forward + backward) at sequence length ``seq_len``.

    * Weight matmuls: a token does 2 FLOPs (multiply + add) per matmul parameter in the
      forward pass and twice that in the backward pass (grads w.r.t. inputs and weights),
      so ``6 * N`` with ``N = matmul_params(args)``.
    * Attention scores: per layer a query does ``QK^T`` against ``T`` keys and ``AV``
      against ``T`` values, each ``2 * T * d`` FLOPs (``d = n_heads * head_dim``), i.e.
      ``4 * T * d`` forward and ``12 * T * d`` for training. With a causal mask a query
      only needs the keys up to itself, ``T/2`` on average, and flash / causal SDPA
      kernels really do skip the masked tiles, so we count the causal half:
      ``6 * n_layers * T * d``. Counting the full square would credit the run with work
      the kernel never performs and inflate MFU.
    * A sliding window (Mistral; Gemma 3's local layers) shrinks what a query needs further once
      ``T`` exceeds the window ``W``: the band's area per query is ``T/2 - (T - W)^2 / (2T)`` keys
      instead of ``T/2`` (the same continuous count as the causal half, and equal to it at ``T = W``).
      Each layer counts with its own window.
    """
    return weight_flops_per_token(args, adapter_params) + 6.0 * _score_flop_units(args, seq_len)


def _keys(window: int | None, T: float) -> float:
    return T / 2 if window is None or T <= window else T / 2 - (T - window) ** 2 / (2 * T)


def attended_keys(args: ModelArgs, seq_len: int) -> float:
    """Average number of keys a query needs at sequence length ``seq_len``, averaged over the layers
    (see ``flops_per_token``)."""
    blocks = args.decoder_config().blocks
    return sum(_keys(b.attention.window, float(seq_len)) for b in blocks) / len(blocks)


def _score_flop_units(args: ModelArgs, seq_len: int, layers: list[tuple[int | None, int]] | None = None) -> float:
    """Sum over layers of attended keys times score features per query (each unit is 2 FLOPs forward
    and 4 backward: ``6 *`` this is a token's training FLOPs in ``QK^T`` and ``AV``). ``layers``: each
    layer's (window, score features), when the caller has them already."""
    if layers is None:
        layers = [(b.attention.window, _score_dims(b.attention)) for b in args.decoder_config().blocks]
    return sum(_keys(window, float(seq_len)) * dims for window, dims in layers)


def training_flops(args: ModelArgs, document_lengths: Iterable[int], adapter_params: int | None = None) -> float:
    """Training FLOPs (forward + backward) of the real tokens of a batch, given as document lengths.

    Each document is a run of real tokens that attend causally among themselves only: a packed
    SFT example, a GRPO row's prompt + completion, or a whole pretraining window. Padding is not a
    document, so it costs nothing here even though the kernels run over it: MFU measures useful
    work. Per document of ``L`` tokens: ``6 * N * L`` for the weight matmuls plus
    ``12 * n_layers * d * L * attended_keys(L)`` for the attention scores, the same convention as
    :func:`flops_per_token` (a packed row of several documents costs less than one document of the
    row's length, since a query never looks past its own document). Pure host arithmetic on lengths
    known when the batch is built: no device sync.
    """
    tokens, units = 0, 0.0
    layers = [(b.attention.window, _score_dims(b.attention)) for b in args.decoder_config().blocks]
    for length in document_lengths:
        if length > 0:
            tokens += length
            units += length * _score_flop_units(args, length, layers)
    return weight_flops_per_token(args, adapter_params) * tokens + 6.0 * units


# Dense (no structured sparsity) peak FLOP/s from vendor spec sheets: (bf16/fp16, tf32, fp32).
# Order matters: the first key contained in the device name wins, so more specific names
# (e.g. "H100 PCIE", "A100", "L40S") come before names they contain ("H100", "A10", "L4").
_GPU_PEAKS: list[tuple[tuple[str, ...], tuple[float, float, float]]] = [
    (("B200",), (2250e12, 1100e12, 80e12)),
    (("GH200",), (989e12, 494.5e12, 67e12)),
    (("H200", "NVL"), (835e12, 417.5e12, 60e12)),
    (("H200",), (989e12, 494.5e12, 67e12)),
    (("H100", "PCIE"), (756e12, 378e12, 51e12)),
    (("H100", "NVL"), (835e12, 417.5e12, 60e12)),
    (("H100",), (989e12, 494.5e12, 67e12)),
    (("H800",), (989e12, 494.5e12, 67e12)),
    (("A100",), (312e12, 156e12, 19.5e12)),
    (("A800",), (312e12, 156e12, 19.5e12)),
    (("A10G",), (70e12, 35e12, 31.2e12)),
    (("A10",), (125e12, 62.5e12, 31.2e12)),
    (("L40S",), (362e12, 183e12, 91.6e12)),
    (("L40",), (181e12, 90.5e12, 90.5e12)),
    (("L4",), (121e12, 60e12, 30.3e12)),
    (("A6000",), (154.8e12, 77.4e12, 38.7e12)),
    (("V100",), (125e12, 15.7e12, 15.7e12)),  # fp16 tensor cores; no bf16 / tf32
    (("T4",), (65e12, 8.1e12, 8.1e12)),
]

_measured: dict[tuple[str, torch.dtype], float] = {}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def default_peak_shapes(device_type: str, size: int) -> list[tuple[int, int, int]]:
    """``(m, k, n)`` matmul shapes tried when measuring a peak.

    Square matrices alone under-report a CPU: at 2 threads a 2048-cube runs at about a third
    of what the tall-skinny ``tokens x dim @ dim x hidden`` products of a small model reach,
    because those fit in cache. So the set mixes squares with the transformer shapes
    (many rows, narrow inner dimensions) and the peak is the best of all of them.
    """
    if device_type == "cuda":
        return [(size, size, size), (2 * size, 2 * size, 2 * size), (4 * size, size, 4 * size)]
    return [(size, size, size), (4 * size, size // 4, size), (4 * size, size, size // 4)]


def measure_matmul_peak(
    device: torch.device | str, dtype: torch.dtype, size: int = 1024, iters: int = 10,
    shapes: list[tuple[int, int, int]] | None = None, budget_s: float = 1.0,
) -> float:
    """Best observed FLOP/s of matmuls on ``device`` over several shapes.

    Each shape gets two warm-up calls (allocator, kernel selection, AMX/TF32 tile setup),
    then up to ``iters`` timed calls; the answer is the fastest single call over all shapes.
    Taking the best rather than the mean is deliberate: on a shared machine most calls are
    slowed by other processes, and MFU should be measured against what the hardware can do,
    not against what it happened to do. ``budget_s`` bounds the timed part per shape.
    """
    device = torch.device(device)
    shapes = shapes or default_peak_shapes(device.type, size)
    best_rate = 0.0
    for m, k, n in shapes:
        a = torch.randn(m, k, device=device, dtype=dtype)
        b = torch.randn(k, n, device=device, dtype=dtype)
        for _ in range(2):
            torch.matmul(a, b)
        _sync(device)
        spent = 0.0
        for _ in range(max(1, iters)):
            t0 = time.perf_counter()
            torch.matmul(a, b)
            _sync(device)
            dt = time.perf_counter() - t0
            spent += dt
            best_rate = max(best_rate, 2.0 * m * k * n / max(dt, 1e-9))
            if spent > budget_s:
                break
    return best_rate


def _gpu_table_peak(name: str, dtype: torch.dtype) -> tuple[float, str] | None:
    upper = name.upper().replace("-", " ")
    for keys, (half, tf32, fp32) in _GPU_PEAKS:
        if all(k in upper for k in keys):
            if dtype in (torch.bfloat16, torch.float16):
                return half, f"spec table: {name} {dtype} dense"
            if dtype == torch.float32:
                if torch.backends.cuda.matmul.allow_tf32 or torch.get_float32_matmul_precision() != "highest":
                    return tf32, f"spec table: {name} tf32 dense"
                return fp32, f"spec table: {name} fp32"
            return None
    return None


def peak_flops_per_device(
    device: torch.device | str, dtype: torch.dtype, configured: float | None = None
) -> tuple[float, str]:
    """Peak FLOP/s of one device for ``dtype`` and where the number came from.

    Priority: an explicitly configured value; the spec table for known CUDA GPUs; otherwise
    a measured matmul peak (cached per device/dtype for the process). On CPU the measurement
    uses the current ``torch.get_num_threads()`` and the training dtype, since CPU peaks
    depend on core count and ISA and no table could be right.
    """
    if configured is not None:
        if configured <= 0:
            raise ValueError(f"configured peak FLOP/s must be positive, got {configured}")
        return float(configured), "configured"
    device = torch.device(device)
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        hit = _gpu_table_peak(name, dtype)
        if hit is not None:
            return hit
    key = (f"{device}:{torch.get_num_threads()}", dtype)
    if key not in _measured:
        size = 4096 if device.type != "cpu" else 1024
        _measured[key] = measure_matmul_peak(device, dtype, size=size, iters=10, budget_s=0.15)
    where = f"{torch.get_num_threads()} threads" if device.type == "cpu" else str(device)
    return _measured[key], f"measured {dtype} matmul peak on {device.type} ({where})"
