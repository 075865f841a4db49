"""Shared pieces of the benchmark scripts: machine description, medians, BENCHMARKS.md output."""

from __future__ import annotations

import datetime
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Callable, Iterator

import torch

ROOT = Path(__file__).resolve().parent.parent
BENCHMARKS_FILE = ROOT / "BENCHMARKS.md"
sys.path.insert(0, str(ROOT / "src"))  # run from a checkout without installing


def loadavg() -> str:
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "n/a"


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def machine(device: torch.device) -> str:
    """One line naming the hardware and software the numbers were measured on."""
    parts = []
    if device.type == "cuda":
        parts.append(torch.cuda.get_device_name(device))
    parts.append(f"{cpu_name()} ({os.cpu_count()} CPUs)")
    parts.append(f"torch {torch.__version__}")
    try:
        import transformers

        parts.append(f"transformers {transformers.__version__}")
    except ImportError:
        pass
    parts.append(f"Python {platform.python_version()}")
    return ", ".join(parts)


def interleaved(names: list[str], repeats: int) -> Iterator[tuple[int, str]]:
    """(repeat, name) in rotated order (A B C, B C A, ...): a shared machine's drift hits every one alike."""
    for r in range(repeats):
        for i in range(len(names)):
            yield r, names[(r + i) % len(names)]


def median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def spread(xs: list[float]) -> str:
    """min-max of the repeats, to show how noisy the machine was."""
    return f"{min(xs):,.0f}-{max(xs):,.0f}" if xs else "-"


def markdown_table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def append_benchmark(title: str, body: str) -> None:
    """Append one dated section to BENCHMARKS.md (created with a short preface if missing)."""
    if not BENCHMARKS_FILE.exists():
        BENCHMARKS_FILE.write_text(
            "# Benchmarks\n\nAppended by `bench/throughput.py` and `bench/generate.py` (see "
            "docs/performance.md). Numbers on a shared machine are noisy: compare the ratios, which "
            "come from interleaved repeats in the same process, rather than absolute tokens/s.\n"
        )
    stamp = datetime.datetime.now().strftime("%Y-%m-%d %H:%M")
    with open(BENCHMARKS_FILE, "a", encoding="utf-8") as f:
        f.write(f"\n## {title} ({stamp})\n\n{body.rstrip()}\n")


def _status_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def step_peak_and_seconds(step: Callable[[], None], steps: int, dev: torch.device) -> tuple[float, float]:
    """Peak memory growth (MB) over ``steps`` calls of ``step`` after a warm-up call, and the median seconds
    of one call: the GPU allocator's peak, or on CPU the process's peak RSS (VmHWM, reset first)."""
    step()  # warm-up: allocates what persists across steps (e.g. parameter gradients)
    if dev.type == "cuda":
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    else:
        Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current RSS
        base = _status_kb("VmRSS") * 1024
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        step()
        if dev.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    peak = torch.cuda.max_memory_allocated() if dev.type == "cuda" else _status_kb("VmHWM") * 1024
    return (peak - base) / 2**20, sorted(times)[len(times) // 2]
