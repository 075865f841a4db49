"""The one reader of ``metrics.jsonl``: used by the report, by resume and elastic restarts, and by tests.

Every reader tolerates what a live or killed run leaves behind: a half-written last line, or any
line that is not a JSON object, is skipped (and counted in ``ReadStats``), never fatal.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

from lmforge.checkpoint.layout import RunDir
from lmforge.errors import UserError
from lmforge.metrics.logger import GOODPUT_CATEGORIES

METRICS_FILE = RunDir.METRICS


def metrics_file(path: str | Path) -> Path:
    """``path`` itself if it is a file, else ``path/metrics.jsonl`` (a run directory)."""
    p = Path(path)
    return p if p.is_file() else p / METRICS_FILE


def iter_records(path: str | Path, kind: str | None = None, *, tail_bytes: int | None = None,
                 skipped: list[str] | None = None) -> Iterator[dict[str, Any]]:
    """The records of a metrics file in order (only ``kind`` ones if given); unreadable lines are
    appended to ``skipped``. ``tail_bytes`` reads only the end of the file (e.g. its last record)."""
    f = metrics_file(path)
    if not f.is_file():
        return
    with open(f, "rb") as fh:
        if tail_bytes is not None:
            fh.seek(0, os.SEEK_END)
            fh.seek(max(fh.tell() - tail_bytes, 0))
        data = fh.read().decode("utf-8", errors="replace")
    for line in data.splitlines():
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:  # e.g. the line a running or killed process was writing
            rec = None
        if not isinstance(rec, dict):
            if skipped is not None and line.strip():
                skipped.append(line)
            continue
        if kind is None or rec.get("kind") == kind:
            yield rec


def read_records(path: str | Path, kind: str | None = None) -> list[dict[str, Any]]:
    """All records of a run directory or metrics file (only ``kind`` ones if given)."""
    return list(iter_records(path, kind))


def last_logged_step(path: str | Path) -> int:
    """The highest train step any process logged in this run (0 if none): steps up to it that a
    resumed run computes again are lost progress."""
    return max((int(r["step"]) for r in iter_records(path, "train") if isinstance(r.get("step"), int)), default=0)


def last_record_time(path: str | Path) -> float | None:
    """The ``time`` of the newest complete record (reads only the file's tail)."""
    times = [r["time"] for r in iter_records(path, tail_bytes=65536) if isinstance(r.get("time"), (int, float))]
    return float(times[-1]) if times else None


@dataclass
class RunRecords:
    """What one run's metrics.jsonl says, with superseded records of redone steps removed."""

    name: str
    path: Path
    train: list[dict[str, Any]] = field(default_factory=list)
    eval: list[dict[str, Any]] = field(default_factory=list)
    events: list[dict[str, Any]] = field(default_factory=list)
    setup: dict[str, Any] | None = None
    attempt_goodput: list[dict[str, Any] | None] = field(default_factory=list)
    """Per process that wrote to the run (in order): its newest goodput record, if any."""

    @property
    def goodput(self) -> dict[str, Any] | None:
        """Seconds per category and ``wall`` summed over attempts; ``final`` from the newest one."""
        records = [g for g in self.attempt_goodput if g]
        if not records:
            return None
        total = {k: sum(g.get(k, 0.0) for g in records) for k in (*GOODPUT_CATEGORIES, "wall")}
        return {**total, "final": bool(self.attempt_goodput[-1] and self.attempt_goodput[-1].get("final")),
                "attempts": len(self.attempt_goodput)}

    @property
    def finished(self) -> bool:
        return bool(self.goodput and self.goodput.get("final"))

    def cumulative_tokens(self) -> list[tuple[int, float]]:
        """(step, target tokens trained on up to that step) for each train record with weights."""
        out, total, prev = [], 0.0, 0
        for r in self.train:
            if "total_weights" not in r:
                return []
            total += r["total_weights"] * (r["step"] - prev)
            prev = r["step"]
            out.append((r["step"], total))
        return out


def read_run(path: str | Path, name: str | None = None) -> RunRecords:
    """Read a run directory (or a metrics.jsonl file) into :class:`RunRecords`."""
    p = Path(path)
    f = metrics_file(p)
    if not f.is_file():
        raise UserError(f"{p}: no {METRICS_FILE} (not an lmforge run directory?)")
    run = RunRecords(name=name or (f.parent.resolve().name), path=f.parent)
    for rec in read_records(f):
        kind = rec.get("kind")
        if kind == "resume":
            keep = rec.get("step", 0)
            run.train = [r for r in run.train if r["step"] <= keep]
            run.eval = [r for r in run.eval if r["step"] <= keep]
        if kind == "train" and "step" in rec:
            run.train.append(rec)
        elif kind == "eval" and "step" in rec:
            run.eval.append(rec)
        elif kind == "setup":
            run.setup = rec
            run.attempt_goodput.append(None)
        elif kind == "goodput":
            if not run.attempt_goodput:
                run.attempt_goodput.append(None)
            run.attempt_goodput[-1] = rec
        elif kind not in ("text", "train", "eval"):
            run.events.append(rec)
    for attr in ("train", "eval"):
        by_step = {r["step"]: r for r in getattr(run, attr)}
        setattr(run, attr, [by_step[s] for s in sorted(by_step)])
    return run


