"""Fault injection for elastic drills and tests: make one rank die at a chosen step.

A fault is described by four numbers and a mode, from the ``[elastic]`` config section or from the
environment variable ``LMFORGE_FAULT`` (which wins, so a drill needs no config edit)::

    LMFORGE_FAULT="rank=1,step=5,mode=kill"            # SIGKILL rank 1 at the end of step 5
    LMFORGE_FAULT="rank=0,step=3,mode=raise,attempt=0" # raise InjectedFault on rank 0
    LMFORGE_FAULT="rank=1,step=3;rank=0,step=6,mode=raise,attempt=1"  # one fault per attempt
    LMFORGE_FAULT="rank=1,step=4,when=mid"             # SIGKILL rank 1 inside step 4's forward pass

The fault fires at the end of step ``step`` (after the optimizer update and the step's metrics,
before any snapshot of that step), or with ``when=mid`` in the middle of it (as the step's first
forward pass starts, its batch read: the other ranks are then inside the step's collectives, a tensor-
or pipeline-parallel neighbour waiting on the dead rank's activations). It fires only on attempt
``attempt`` (torchrun's ``TORCHELASTIC_RESTART_COUNT``), so the restarted group does not die again at
the same step.

Modes:

* ``kill`` — ``SIGKILL`` to this process: no Python cleanup runs, as when a machine disappears or the
  OOM killer strikes.
* ``raise`` — raise :class:`InjectedFault`: ``finally`` blocks run and the process exits non-zero
  with a traceback, as with a software bug or a device error.
"""

from __future__ import annotations

import os
import signal
from dataclasses import dataclass
from typing import Literal

from lmforge.errors import UserError

FAULT_ENV = "LMFORGE_FAULT"
FaultMode = Literal["kill", "raise"]
FaultWhen = Literal["end", "mid"]


class InjectedFault(RuntimeError):
    """Raised by a ``raise``-mode fault; deliberately not a UserError (it must look like a crash)."""


@dataclass(frozen=True)
class FaultPlan:
    rank: int
    step: int
    mode: FaultMode = "kill"
    attempt: int = 0
    when: FaultWhen = "end"

    def due(self, rank: int, step: int, attempt: int) -> bool:
        return self.step > 0 and rank == self.rank and step == self.step and attempt == self.attempt

    def describe(self) -> str:
        mid = ",when=mid" if self.when == "mid" else ""
        return f"rank={self.rank},step={self.step},mode={self.mode},attempt={self.attempt}{mid}"


def parse_fault(spec: str) -> FaultPlan:
    """Parse ``rank=R,step=S[,mode=kill|raise][,attempt=A][,when=end|mid]``; raise UserError on anything else."""
    fields: dict[str, str] = {}
    for part in filter(None, (p.strip() for p in spec.split(","))):
        key, sep, value = part.partition("=")
        if not sep or key not in ("rank", "step", "mode", "attempt", "when"):
            raise UserError(f"{FAULT_ENV}={spec!r}: expected "
                            f"rank=R,step=S[,mode=kill|raise][,attempt=A][,when=end|mid]")
        fields[key] = value
    if "rank" not in fields or "step" not in fields:
        raise UserError(f"{FAULT_ENV}={spec!r}: rank= and step= are required")
    mode = fields.get("mode", "kill")
    if mode not in ("kill", "raise"):
        raise UserError(f"{FAULT_ENV}={spec!r}: mode must be kill or raise (got {mode!r})")
    when = fields.get("when", "end")
    if when not in ("end", "mid"):
        raise UserError(f"{FAULT_ENV}={spec!r}: when must be end or mid (got {when!r})")
    try:
        return FaultPlan(int(fields["rank"]), int(fields["step"]), mode,  # type: ignore[arg-type]
                         int(fields.get("attempt", "0")), when)  # type: ignore[arg-type]
    except ValueError:
        raise UserError(f"{FAULT_ENV}={spec!r}: rank, step and attempt must be integers") from None


def fault_plans(rank: int, step: int, mode: FaultMode, attempt: int, when: FaultWhen = "end") -> list[FaultPlan]:
    """The faults in effect: ``LMFORGE_FAULT`` (``;``-separated) if set, else the config values
    (``step=0``: none)."""
    spec = os.environ.get(FAULT_ENV, "").strip()
    if spec:
        return [parse_fault(part) for part in spec.split(";") if part.strip()]
    return [FaultPlan(rank, step, mode, attempt, when)] if step > 0 else []


def current_attempt() -> int:
    """torchrun's restart count for this worker group (0 outside torchrun or on the first attempt)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def inject(plan: FaultPlan) -> None:
    """Make this process fail now, the way ``plan.mode`` says."""
    if plan.mode == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    raise InjectedFault(f"injected fault ({plan.describe()})")
