"""One MetricLogger for every trainer: console line, JSONL file and TensorBoard, plus goodput.

Step-time rules (the same for every trainer):

* The training clock starts in :meth:`MetricLogger.start_clock`, called immediately before the first
  step, so setup time (imports, model build, checkpoint restore) is never part of a step.
* A step's seconds run from the end of the previous step (or the clock start) to the end of this
  step: data wait plus compute. Work done *between* steps under :meth:`MetricLogger.timed` —
  checkpoint saves, eval, restores — is measured, recorded under its own name and subtracted, so it
  never inflates or deflates a step's throughput.
* The first step after the clock starts (warm-up, lazy init, compilation) is flagged
  ``first_step: true`` and is always logged on its own; later lines average over the steps since the
  previous logged line.
* No host-device synchronization per step: metrics arrive as device tensors and are only converted
  to Python numbers on a log step (every ``log_every`` steps), in one transfer. On an accelerator the
  clock start and both ends of every :meth:`MetricLogger.timed` block wait for the device (one
  synchronize each): kernels a step queued are then charged to the steps, not to the eval or
  checkpoint that happens to follow them, and a timed block's own kernels are inside its time.
* TFLOP/s and MFU count the FLOPs of each step's real tokens (given by the step source, see
  :func:`lmforge.models.flops.training_flops`) over the window's seconds, against the peak of the
  dtype in use.
* ``memory_gb``: the peak memory of the log window (GPU: peak allocated by the caching allocator,
  reset after each log line; CPU: the process's peak resident set size, which never resets).

Goodput: every second of wall-clock time since process start falls into exactly one category
(``GOODPUT_CATEGORIES``); ``other`` is whatever no category claimed.
"""

from __future__ import annotations

import json
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator

import torch

from lmforge.checkpoint.layout import RunDir
from lmforge.metrics.lines import PROCESS_START, format_train_line, format_value, to_python  # noqa: F401
from lmforge.errors import UserError
from lmforge.metrics.device_stats import device_synchronizer, peak_memory_bytes
from lmforge.metrics.progress import progress_bar
from lmforge.metrics.sinks import WandbSink

if TYPE_CHECKING:  # pragma: no cover
    from lmforge.config import MetricsSection



GOODPUT_CATEGORIES = (
    "setup", "first_step", "productive", "data_wait", "checkpoint_save", "checkpoint_restore",
    "eval", "rollout", "lost_progress", "recovery", "other",
)
_PERF_KEYS = {"seconds", "tflops_per_device", "tokens_per_sec_per_device", "mfu", "data_wait_seconds", "memory_gb"}


RECORD_HOOKS: list[Callable[[dict[str, Any]], None]] = []
"""Called with every record rank 0 writes (setup, train, eval, events), as it is made: how the Python
API's ``callbacks`` see each metrics line without a sink of their own."""


class MetricLogger:
    """Records train/eval metrics and timing for one run; only rank 0 writes anything."""

    def __init__(
        self,
        run_dir: str | Path,
        *,
        rank: int = 0,
        world_size: int = 1,
        log_every: int = 10,
        flops_per_token: float = 0.0,
        peak_flops: float = 0.0,
        tensorboard: bool = True,
        console: Callable[[str], None] | None = None,
        process_start: float | None = None,
        sinks: list[Any] | None = None,
        progress: Any = None,
        defer: bool = False,
        device: torch.device | str | None = None,
        synchronize: Callable[[], None] | None = None,
    ) -> None:
        """``process_start`` earlier than this process's own start (an elastic restart passes the time
        its predecessor failed) makes goodput cover the gap as ``recovery``. ``sinks`` receive every
        scalar (``.scalars(step, dict)``, ``.close()``, e.g. W&B); ``progress`` observes every step
        (``.update(step, metrics)``, ``.close()``, e.g. the progress bar). ``defer`` holds every record
        in memory until :meth:`open` (a trainer opens once its start-up checks have passed). ``device``
        is the training device (memory field, and the default ``synchronize``: see
        :func:`device_synchronizer`); ``synchronize`` replaces that wait."""
        self.run_dir = Path(run_dir)
        self.rank = rank
        self.world_size = world_size
        self.log_every = log_every
        self.flops_per_token = flops_per_token
        self.peak_flops = peak_flops
        self.device = torch.device(device) if device is not None else None
        self._synchronize = synchronize if synchronize is not None else device_synchronizer(device)
        self.writes = rank == 0
        self._console = console or (lambda line: print(line, flush=True))
        self.process_start = PROCESS_START
        self.goodput = {c: 0.0 for c in GOODPUT_CATEGORIES}
        if process_start is not None:
            self.process_start = process_start
            self.goodput["recovery"] = max(PROCESS_START - process_start, 0.0)
        self._clock_start: float | None = None
        self._last_mark = 0.0
        self._excluded = 0.0  # seconds of timed() work since the last step ended
        self._nested: list[float] = []  # per open timed() block: seconds claimed by blocks inside it
        self._window: list[tuple[float, int, float, float | None]] = []  # (seconds, tokens, data_wait, flops)
        self._steps_seen = 0
        self._jsonl = None
        self._tb = None
        self._tensorboard = tensorboard
        self._opened = False
        self._pending: list[tuple[str, tuple[Any, ...]]] = []  # ("jsonl", (record,)) or (tb method, args)
        self.sinks: list[Any] = list(sinks or []) if rank == 0 else []
        self.progress: Any = progress
        if not defer:
            self.open()

    @classmethod
    def from_section(cls, section: "MetricsSection", run_dir: Path, *, rank: int, world_size: int,
                     device: torch.device, steps: int, max_tokens: int, flops_per_token: float, peak_flops: float,
                     config: dict[str, Any], process_start: float | None = None) -> "MetricLogger":
        """A run's logger as its ``[metrics]`` section asks: the progress bar (``progress``), W&B (``wandb``,
        rank 0, given the run's ``config``), TensorBoard, the log interval; records held until :meth:`open`
        (a trainer opens once its start-up checks have passed). ``steps`` and ``max_tokens`` are the run's
        budgets the progress bar counts towards; ``flops_per_token`` and ``peak_flops`` give MFU."""
        is_main = rank == 0
        bar = progress_bar(section.progress, steps, max_tokens, is_main=is_main)
        sinks = [WandbSink.start(run_dir, config)] if section.wandb and is_main else []
        return cls(run_dir, rank=rank, world_size=world_size, log_every=section.log_every,
                   flops_per_token=flops_per_token, peak_flops=peak_flops, tensorboard=section.tensorboard,
                   console=bar.write if bar else None, process_start=process_start, sinks=sinks, progress=bar,
                   defer=True, device=device)

    def open(self) -> None:
        """Start writing the run directory's metrics.jsonl and TensorBoard files.

        Until then records are held in memory (the console still prints them): a run that fails its
        start-up checks (bad data, a checkpoint it refuses) exits without touching the run directory.
        """
        if self._opened:
            return
        self._opened = True
        if not self.writes:
            return
        path = RunDir(self.run_dir).metrics
        try:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            self._jsonl = open(path, "a", encoding="utf-8")
            if self._tensorboard:
                from torch.utils.tensorboard import SummaryWriter

                self._tb = SummaryWriter(log_dir=str(RunDir(self.run_dir).tensorboard))
        except OSError as e:
            raise UserError(f"cannot write the run's metrics in {self.run_dir} ({e.strerror or e})") from None
        pending, self._pending = self._pending, []
        for what, args in pending:
            if what == "jsonl":
                self._append(*args)
            elif self._tb is not None:
                getattr(self._tb, what)(*args)

    # ------------------------------------------------------------------ output
    def console(self, line: str) -> None:
        if self.writes:
            self._console(line)

    def _write(self, record: dict[str, Any]) -> None:
        if not self.writes:
            return
        record = {"time": round(time.time(), 3), **record}
        for hook in RECORD_HOOKS:
            hook(record)
        if self._opened:
            self._append(record)
        else:
            self._pending.append(("jsonl", (record,)))

    def _append(self, record: dict[str, Any]) -> None:
        if self._jsonl is None:
            return
        try:
            self._jsonl.write(json.dumps(record) + "\n")
            self._jsonl.flush()
        except OSError as e:
            raise UserError(f"cannot write {RunDir(self.run_dir).metrics} ({e.strerror or e})") from None

    def _tb_call(self, method: str, *args: Any) -> None:
        if self._tb is not None:
            getattr(self._tb, method)(*args)
        elif not self._opened and self.writes and self._tensorboard:
            self._pending.append((method, args))

    def _scalars(self, step: int, values: dict[str, float], group: str | None = None) -> None:
        named = {}
        for k, v in values.items():
            if not isinstance(v, (int, float)) or isinstance(v, bool):
                continue
            if "/" in k:
                name = k
            elif group:
                name = f"{group}/{k}"
            else:
                name = f"perf/{k}" if k in _PERF_KEYS else f"learning/{k}"
            named[name] = v
        for name, v in named.items():
            self._tb_call("add_scalar", name, v, step)
        for sink in self.sinks:
            sink.scalars(step, named)

    # ------------------------------------------------------------------ setup
    def log_setup(self, info: dict[str, Any], config_toml: str) -> None:
        """Write the one-off setup facts (parameters, FLOPs per token, peak, config)."""
        if not self.writes:
            return
        self._write({"kind": "setup", **info})
        self.console("setup: " + ", ".join(f"{k}={format_value(v)}" for k, v in info.items()))
        self._tb_call("add_text", "config", "```toml\n" + config_toml + "\n```", 0)
        self._tb_call("add_text", "setup", "\n".join(f"* {k}: {v}" for k, v in info.items()), 0)

    # ------------------------------------------------------------------ timing
    def start_clock(self) -> None:
        """Call immediately before the first step: everything earlier counts as setup."""
        self._sync()
        if self.device is not None and self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        now = time.perf_counter()
        self.goodput["setup"] += time.time() - self.process_start - self._accounted()
        self._clock_start = now
        self._last_mark = now
        self._excluded = 0.0

    def _sync(self) -> None:
        if self._synchronize is not None:
            self._synchronize()

    @property
    def training_seconds(self) -> float:
        """Seconds on the training clock (since start_clock), including eval and checkpoints."""
        return 0.0 if self._clock_start is None else time.perf_counter() - self._clock_start

    @contextmanager
    def timed(self, category: str) -> Iterator[None]:
        """Time non-step work (eval, checkpoint_save, checkpoint_restore, rollout, recovery...).

        Inside the training clock the time is excluded from the surrounding step's seconds. Blocks
        may nest (a restore inside recovery): each second goes to the innermost open category only.
        """
        if category not in self.goodput:
            raise ValueError(f"unknown goodput category {category!r}; known: {', '.join(GOODPUT_CATEGORIES)}")
        self._sync()  # the previous step's queued kernels belong to that step, not to this block
        t0 = time.perf_counter()
        self._nested.append(0.0)
        try:
            yield
        finally:
            self._sync()
            dt = time.perf_counter() - t0
            self.goodput[category] += dt - self._nested.pop()
            if self._nested:
                self._nested[-1] += dt
            elif self._clock_start is not None:
                self._excluded += dt

    @contextmanager
    def waiting_for_data(self) -> Iterator["DataWait"]:
        """Measure how long a step waits for its input; time spent inside :meth:`timed` blocks meanwhile
        (e.g. a GRPO rollout) belongs to their own category and is not counted as waiting."""
        wait = DataWait()
        t0, excluded0 = time.perf_counter(), self._excluded
        try:
            yield wait
        finally:
            wait.seconds = max(time.perf_counter() - t0 - (self._excluded - excluded0), 0.0)

    def add_time(self, category: str, seconds: float) -> None:
        """Attribute seconds measured elsewhere (e.g. recovery before this process existed)."""
        self.goodput[category] += seconds

    def _accounted(self) -> float:
        return sum(v for k, v in self.goodput.items() if k != "other")

    # ------------------------------------------------------------------ steps
    def record_step(
        self,
        step: int,
        tokens: int,
        metrics: dict[str, torch.Tensor | float],
        *,
        flops: float | None = None,
        data_wait: float = 0.0,
        force_log: bool = False,
        lost: bool = False,
        console_keys: tuple[str, ...] = ("accuracy",),
    ) -> dict[str, Any] | None:
        """Close the timing of ``step`` and log it on log steps.

        ``tokens`` is this device's processed tokens (inputs, padding included) — the throughput
        numerator; ``flops`` the training FLOPs of the step's real tokens on this device (without it,
        ``flops_per_token`` x ``tokens``); ``metrics`` holds device tensors (loss, total_weights, lr, grad_norm, ...) that are
        only read on log steps; ``console_keys`` are the trainer's fields shown on the console line
        (every field goes to JSONL and TensorBoard). ``lost`` marks a step redone after a restart (goodput
        ``lost_progress``). Returns the logged record, or None on a non-log step.
        """
        now = time.perf_counter()
        seconds = max(now - self._last_mark - self._excluded, 0.0)
        self._last_mark = now
        self._excluded = 0.0
        self._steps_seen += 1
        first = self._steps_seen == 1
        if first:
            self.goodput["first_step"] += seconds
        elif lost:
            self.goodput["lost_progress"] += seconds
        else:
            self.goodput["productive"] += seconds - data_wait
            self.goodput["data_wait"] += data_wait
        self._window.append((seconds, tokens, data_wait, flops))
        if self.progress is not None and self.writes:
            self.progress.update(step, metrics)
        if not (first or force_log or step % self.log_every == 0):
            return None
        return self._flush(step, metrics, first, console_keys)

    def _flush(self, step: int, metrics: dict[str, torch.Tensor | float], first: bool,
               console_keys: tuple[str, ...]) -> dict[str, Any]:
        n = len(self._window)
        seconds = sum(w[0] for w in self._window) / n
        tokens = sum(w[1] for w in self._window) / n
        wait = sum(w[2] for w in self._window) / n
        step_flops = sum(w[3] if w[3] is not None else self.flops_per_token * w[1] for w in self._window) / n
        self._window.clear()
        values = to_python(metrics)
        tps = tokens / seconds if seconds > 0 else 0.0
        flops = step_flops / seconds if seconds > 0 else 0.0
        memory = peak_memory_bytes(self.device, reset=True)
        rec: dict[str, Any] = {
            "kind": "train", "step": step, "seconds": seconds, "steps_averaged": n,
            "tflops_per_device": flops / 1e12, "tokens_per_sec_per_device": tps,
            "mfu": flops / self.peak_flops if self.peak_flops else 0.0,
            "data_wait_seconds": wait, "memory_gb": memory / 1e9, "world_size": self.world_size,
            "first_step": first, **values,
        }
        if self.writes:
            self._write(rec)
            self._scalars(step, {k: v for k, v in rec.items() if k not in ("step", "kind", "steps_averaged")})
            self.console(format_train_line(rec, console_keys))
            self.log_goodput(step)
        return rec

    # ------------------------------------------------------------------ eval, events
    def record_eval(self, step: int, metrics: dict[str, torch.Tensor | float], seconds: float) -> dict[str, Any]:
        values = to_python(metrics)
        rec = {"kind": "eval", "step": step, **values, "eval_seconds": seconds}
        if self.writes:
            self._write(rec)
            self._scalars(step, {k: v for k, v in values.items()} | {"seconds": seconds}, group="eval")
            parts = ", ".join(f"{k}={format_value(v)}" for k, v in values.items())
            self.console(f"eval metrics after step: {step}, {parts}, eval_seconds={seconds:.3f}")
        return rec

    def record_event(self, kind: str, step: int, message: str | None = None, **fields: Any) -> None:
        """Stop reasons, restarts, warnings: one JSONL record and (with a message) a console line."""
        if not self.writes:
            return
        self._write({"kind": kind, "step": step, **({"message": message} if message else {}), **fields})
        numeric = {k: v for k, v in fields.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
        if numeric:
            self._scalars(step, numeric, group=kind)
        if message:
            self.console(message)

    def record_text(self, step: int, tag: str, text: str) -> None:
        if not self.writes:
            return
        self._write({"kind": "text", "step": step, "tag": tag, "text": text})
        self._tb_call("add_text", tag, text, step)

    # ------------------------------------------------------------------ goodput
    def goodput_summary(self) -> dict[str, float]:
        """Seconds per category; ``other`` closes the gap to the wall time since process start."""
        wall = time.time() - self.process_start
        out = dict(self.goodput)
        out["other"] = max(wall - self._accounted(), 0.0)
        out["wall"] = wall
        return out

    def log_goodput(self, step: int, final: bool = False) -> dict[str, float]:
        g = self.goodput_summary()
        wall = g["wall"]
        if self.writes:
            self._write({"kind": "goodput", "step": step, "final": final, **g})
            self._scalars(step, {k: 100.0 * v / wall for k, v in g.items() if k != "wall"}, group="goodput")
            if final:
                parts = ", ".join(f"{k} {100.0 * v / wall:.1f}" for k, v in g.items() if k != "wall" and v > 0)
                self.console(f"goodput {100.0 * g['productive'] / wall:.1f}% of {wall:.1f}s wall: {parts}")
        return g

    def close(self) -> None:
        if self._jsonl is not None:
            self._jsonl.close()
            self._jsonl = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        for sink in self.sinks:
            sink.close()
        self.sinks = []
        if self.progress is not None:
            self.progress.close()
            self.progress = None


class DataWait:
    seconds: float = 0.0


def stderr(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)
