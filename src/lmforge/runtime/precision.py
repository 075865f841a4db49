"""Which autocast dtype a run trains in: ``training.dtype = "auto"`` picks bf16 where it is faster.

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

from functools import lru_cache

import torch
import torch.distributed as dist

from lmforge.models.flops import peak_flops_per_device

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
