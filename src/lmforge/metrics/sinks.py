"""Extra metric sinks beside the console, JSONL and TensorBoard: Weights & Biases.

A sink receives exactly the named scalars the MetricLogger sends to TensorBoard
(``learning/loss``, ``perf/tokens_per_sec_per_device``, ``eval/loss``, ``goodput/productive``...)
through ``scalars(step, values)``, and ``close()`` at the end of the run.

W&B is optional (``pip install 'lmforge[wandb]'``) and only used with ``metrics.wandb=true``. The
project, entity and mode come from W&B's own environment variables (``WANDB_PROJECT``, default
``lmforge``; ``WANDB_ENTITY``; ``WANDB_MODE=offline`` to log without a network). The W&B run id is
kept in the run directory, so a resumed run keeps logging into the same W&B run.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from lmforge.errors import UserError

WANDB_ID_FILE = "wandb_run_id"


class WandbSink:
    """Forwards the MetricLogger's scalars to one W&B run."""

    def __init__(self, run: Any) -> None:
        self.run = run

    @classmethod
    def start(cls, run_dir: str | Path, config: dict[str, Any]) -> "WandbSink":
        """Start (or resume) the W&B run of ``run_dir``; the full config is stored with it."""
        try:
            import wandb
        except ImportError:
            raise UserError("metrics.wandb=true needs the wandb package: pip install 'lmforge[wandb]' "
                            "(or set metrics.wandb=false)") from None
        run_dir = Path(run_dir)
        id_file = run_dir / WANDB_ID_FILE
        run_id = id_file.read_text().strip() if id_file.is_file() else None  # None: W&B picks one
        run = wandb.init(project=os.environ.get("WANDB_PROJECT", "lmforge"), id=run_id, resume="allow",
                         name=run_dir.resolve().name, dir=str(run_dir), config=config)
        id_file.write_text(run.id)
        return cls(run)

    def scalars(self, step: int, values: dict[str, float]) -> None:
        # W&B drops points whose step is below one it has seen (steps redone after a restart).
        self.run.log(dict(values), step=step)

    def close(self) -> None:
        if self.run is not None:
            self.run.finish()
            self.run = None
