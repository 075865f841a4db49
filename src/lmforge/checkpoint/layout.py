"""Where things live on disk: the run directory's files and the checkpoint directories in it.

Every module that needs a path in a run directory asks here, so the layout is known in one place::

    RUN_DIR/config.toml  model_args.json  metrics.jsonl  tensorboard/  .lock  report/
    RUN_DIR/checkpoints/step_00000100/   (see lmforge.checkpoint.checkpointer)
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

STATE_FILE = "trainer_state.json"
MANIFEST_FILE = "manifest.json"
_STEP_DIR = re.compile(r"step_(\d+)")


def step_dir_name(step: int) -> str:
    return f"step_{step:08d}"


def _step_of(p: Path) -> int | None:
    m = _STEP_DIR.fullmatch(p.name)
    return int(m.group(1)) if m else None


def list_checkpoints(ckpt_root: Path) -> list[Path]:
    """Committed checkpoint directories, oldest first, damaged or not.

    ``.partial`` (interrupted save), ``.old`` (being replaced) and ``.damaged`` (set aside) never count.
    """
    if not ckpt_root.is_dir():
        return []
    found = [p for p in ckpt_root.iterdir() if p.is_dir() and _step_of(p) is not None]
    return sorted(found, key=lambda p: _step_of(p))


class RunDir:
    """The paths of one run directory."""

    CONFIG = "config.toml"
    MODEL_ARGS = "model_args.json"
    METRICS = "metrics.jsonl"

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)

    @property
    def config(self) -> Path:
        return self.root / self.CONFIG

    @property
    def model_args(self) -> Path:
        return self.root / self.MODEL_ARGS

    @property
    def metrics(self) -> Path:
        return self.root / self.METRICS

    @property
    def tensorboard(self) -> Path:
        return self.root / "tensorboard"

    @property
    def checkpoints(self) -> Path:
        return self.root / "checkpoints"

    @property
    def report(self) -> Path:
        return self.root / "report"

    @classmethod
    def of_checkpoint(cls, checkpoint: str | Path) -> "RunDir":
        """The run directory a checkpoint directory belongs to (``RUN/checkpoints/step_X``)."""
        return cls(Path(checkpoint).parent.parent)

    def is_run(self) -> bool:
        return self.model_args.is_file()


def fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_json(path: Path, obj: Any) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(obj, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def write_text(path: Path, text: str) -> None:
    """Replace ``path`` atomically: a crash leaves the old or the new file, never a half-written one."""
    tmp = path.with_suffix(path.suffix + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
