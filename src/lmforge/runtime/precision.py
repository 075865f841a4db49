"""The device's arithmetic: its peak FLOP/s (what MFU divides by) and the autocast dtype a run trains in.

The peak comes from an explicit ``metrics.peak_tflops``, the spec table of known GPUs, or a measured
matmul peak (:func:`peak_flops_per_device`); it belongs to the device, not to the model, and the dtype
rule below reads the same measurement. ``training.dtype = "auto"`` picks bf16 where it is faster.

On a GPU with bf16 support bf16 autocast is always the faster choice. On a CPU it depends on the
CPU and on the model, and neither alone decides it:

- CPUs differ in how fast their bf16 matmuls are, even among those that advertise native bf16. On a
  2-core AMD EPYC with AVX512-BF16 bf16 matmuls measured ~4x the fp32 rate; on a 2-core Intel Xeon
  that also lists AVX512-BF16 (and no AMX), 0.55x, so a bf16 ``small`` step ran at 0.66x the fp32
  speed there (docs/performance.md). The rule therefore measures both rates (the same matmul peak
  MFU is measured against, cached for the process) and asks bf16 to be clearly faster.
- Autocast adds casts around every op; they only pay off when the matmuls are big enough. On the
  AMD CPU bf16 ran a step at 0.58x the fp32 speed for the ``debug`` model (0.8M non-embedding
  parameters) and 1.9x for ``small`` (6.5M), hence a parameter threshold between the two.

Every rank of a run must train in the same dtype, so the measured ratio is the minimum over ranks.
"""

from __future__ import annotations

import time
from functools import lru_cache

import torch
import torch.distributed as dist

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


CPU_BF16_MIN_PARAMS = 4_000_000
"""Non-embedding parameters from which bf16 autocast beats fp32 on a CPU with fast bf16 matmuls."""

CPU_BF16_MIN_SPEEDUP = 1.5
"""How much faster than fp32 a CPU's measured bf16 matmuls must be for ``auto`` to pick bf16.

Break-even is near 1.0-1.1 for ``small`` (half of an fp32 step is matmuls; bf16 adds ~4% casts);
the margin keeps a noisy measurement from choosing the slower dtype."""

CPU_BF16_SLOW_RATIO = 0.8
"""Under this bf16/fp32 matmul rate an explicit ``training.dtype=bfloat16`` on a CPU gets a warning: its
steps are then likely slower than fp32 ones (0.55x the rate made a ``small`` step 0.66x as fast)."""


@lru_cache(maxsize=1)
def cpu_has_fast_bf16() -> bool:
    """Whether this CPU has native bf16 instructions (AVX512-BF16 or AMX-BF16, from /proc/cpuinfo)."""
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    return bool(flags & {"avx512_bf16", "amx_bf16"})
    except OSError:
        pass
    return False


def cpu_bf16_matmul_rates(device: torch.device) -> tuple[float, float]:
    """Measured (bf16, fp32) matmul FLOP/s on this CPU, bf16's as the lowest bf16/fp32 ratio of any rank."""
    bf16 = peak_flops_per_device(device, torch.bfloat16)[0]
    fp32 = peak_flops_per_device(device, torch.float32)[0]
    if dist.is_available() and dist.is_initialized():
        ratio = torch.tensor([bf16 / fp32], dtype=torch.float64)
        dist.all_reduce(ratio, op=dist.ReduceOp.MIN)
        bf16 = float(ratio) * fp32
    return bf16, fp32


def choose_dtype(setting: str, device: torch.device, non_embedding_params: int) -> tuple[str, str]:
    """The autocast dtype (``"float32"`` or ``"bfloat16"``) for ``training.dtype = setting`` and why."""
    if device.type == "cpu" and setting in ("auto", "bfloat16"):
        return _cpu_dtype(setting, device, non_embedding_params)
    if setting != "auto":
        return setting, "training.dtype"
    if device.type == "cuda":
        if torch.cuda.is_bf16_supported():
            return "bfloat16", "auto: the GPU supports bf16"
        return "float32", "auto: the GPU has no bf16"
    return "float32", f"auto: no bf16 rule for {device.type}"


def _cpu_dtype(setting: str, device: torch.device, non_embedding_params: int) -> tuple[str, str]:
    """``auto`` or ``bfloat16`` on a CPU, where the answer depends on this CPU's measured matmul rates
    (measured here, once): ``auto`` picks bf16 only for a model large enough on a CPU whose bf16 is clearly
    faster; an explicit bf16 is kept, with a warning where bf16 matmuls measured clearly slower than fp32
    (the user asked for bf16 expecting speed, and on such a CPU fp32 is the faster choice)."""
    millions = non_embedding_params / 1e6
    if setting == "auto":
        if not cpu_has_fast_bf16():
            return "float32", "auto: this CPU has no native bf16 (AVX512-BF16/AMX)"
        if non_embedding_params < CPU_BF16_MIN_PARAMS:
            return "float32", (f"auto: {millions:.1f}M non-embedding parameters, under the "
                               f"{CPU_BF16_MIN_PARAMS / 1e6:g}M from which bf16 is faster on CPU")
    bf16, fp32 = cpu_bf16_matmul_rates(device)
    measured = f"({bf16 / 1e12:.3f} vs {fp32 / 1e12:.3f} TFLOP/s measured)"
    if setting == "bfloat16":
        if bf16 >= CPU_BF16_SLOW_RATIO * fp32:
            return setting, "training.dtype"
        return setting, (f"training.dtype; warning: bf16 matmuls run at {bf16 / fp32:.2f}x the fp32 rate on this "
                         f"CPU {measured}, so bf16 steps are likely slower than fp32 here (training.dtype=auto or "
                         f"float32 trains in fp32)")
    rates = f"bf16 matmuls {bf16 / fp32:.2f}x the fp32 rate on this CPU {measured}"
    if bf16 < CPU_BF16_MIN_SPEEDUP * fp32:
        return "float32", f"auto: {rates}, under the {CPU_BF16_MIN_SPEEDUP:g}x bf16 needs"
    return "bfloat16", f"auto: {millions:.1f}M non-embedding parameters; {rates}"
