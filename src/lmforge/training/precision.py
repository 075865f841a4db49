"""Which autocast dtype a run trains in: ``training.dtype = "auto"`` picks bf16 where it is faster.

On a GPU with bf16 support bf16 autocast is always the faster choice. On a CPU it depends on the
model: bf16 matmuls only pay off when the CPU has native bf16 instructions (AVX512-BF16 or AMX) and
the matmuls are large enough for them to outweigh the casts autocast adds around every op. Measured
on a 2-core AVX512-BF16 CPU (docs/performance.md, 2026-11-30, before bf16 attention on CPU ran as
explicit matmuls), bf16 ran a step at 0.58x the fp32 speed for the ``debug`` model (0.8M non-embedding
parameters) and 1.9x for ``small`` (6.5M), so the CPU rule is a parameter threshold between the two.
"""

from __future__ import annotations

from functools import lru_cache

import torch

CPU_BF16_MIN_PARAMS = 4_000_000
"""Non-embedding parameters from which bf16 autocast beats fp32 on a CPU with native bf16."""


@lru_cache(maxsize=1)
def cpu_has_fast_bf16() -> bool:
    """Whether this CPU executes bf16 matmuls natively (AVX512-BF16 or AMX-BF16, from /proc/cpuinfo)."""
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    return bool(flags & {"avx512_bf16", "amx_bf16"})
    except OSError:
        pass
    return False


def choose_dtype(setting: str, device: torch.device, non_embedding_params: int) -> tuple[str, str]:
    """The autocast dtype (``"float32"`` or ``"bfloat16"``) for ``training.dtype = setting`` and why."""
    if setting != "auto":
        return setting, "training.dtype"
    if device.type == "cuda":
        if torch.cuda.is_bf16_supported():
            return "bfloat16", "auto: the GPU supports bf16"
        return "float32", "auto: the GPU has no bf16"
    if device.type != "cpu":
        return "float32", f"auto: no bf16 rule for {device.type}"
    if not cpu_has_fast_bf16():
        return "float32", "auto: this CPU has no native bf16 (AVX512-BF16/AMX)"
    millions = non_embedding_params / 1e6
    if non_embedding_params < CPU_BF16_MIN_PARAMS:
        return "float32", (f"auto: {millions:.1f}M non-embedding parameters, under the "
                           f"{CPU_BF16_MIN_PARAMS / 1e6:g}M from which bf16 is faster on CPU")
    return "bfloat16", f"auto: {millions:.1f}M non-embedding parameters on a CPU with native bf16"
