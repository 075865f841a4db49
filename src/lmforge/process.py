"""When this process started: what goodput's ``setup`` counts from. Light (no torch), so the command
line can read it before anything heavy is imported."""

from __future__ import annotations

import os
import time


def process_start_time() -> float:
    """Wall-clock time this process started (Linux: from /proc, ~10 ms resolution).

    Interpreter start-up and ``import torch`` take seconds before any lmforge code runs; goodput
    counts them as ``setup``. Elsewhere the import time of this module is the best available.
    """
    try:
        with open("/proc/self/stat", encoding="ascii") as f:
            stat = f.read()
        start_ticks = int(stat[stat.rindex(")") + 2:].split()[19])  # field 22: starttime since boot
        age = time.clock_gettime(time.CLOCK_BOOTTIME) - start_ticks / os.sysconf("SC_CLK_TCK")
        if 0 <= age < 7 * 86400:
            return time.time() - age
    except (OSError, ValueError, IndexError, AttributeError):
        pass
    return time.time()


PROCESS_START = process_start_time()
