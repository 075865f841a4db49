"""``lmforge report RUN_DIR [RUN_DIR ...] [--out DIR]``: plots and a summary from metrics.jsonl.

The report reads nothing but each run's ``metrics.jsonl``, so it works on a finished run and on one
still training (a half-written last line is skipped). Several runs are drawn on the same axes, one
colour per run, for comparison.

Records of a previous attempt that a restart redid are dropped: at a ``resume`` record of step R,
earlier train/eval records past step R are discarded, so every curve shows the steps whose results
the run kept.

Goodput is accounted per process. A run resumed by a new process (each one starts with a ``setup``
record) is summed over its attempts: the newest goodput record of each attempt, added up.

Tokens on the x axis are target tokens, added up from the logged ``total_weights`` (the target
tokens of the logged step) times the steps since the previous log line. With packed pretraining
every step has the same count and this is exact; with variable-length data it is an estimate.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path
from statistics import median
from typing import Any, Callable

from lmforge.errors import UserError
from lmforge.metrics.logger import GOODPUT_CATEGORIES
from lmforge.metrics.records import RunRecords, read_run

REWARD_KEY = "reward/mean"
GOODPUT_COLORS = {
    "productive": "#2ca02c", "setup": "#7f7f7f", "first_step": "#bcbd22", "data_wait": "#17becf",
    "checkpoint_save": "#1f77b4", "checkpoint_restore": "#aec7e8", "eval": "#9467bd", "rollout": "#ff7f0e",
    "lost_progress": "#d62728", "recovery": "#e377c2", "other": "#c7c7c7",
}


def _finite(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _series(records: list[dict[str, Any]], key: str, skip_first: bool = False) -> tuple[list[int], list[float]]:
    xs, ys = [], []
    for r in records:
        if skip_first and r.get("first_step"):
            continue
        if _finite(r.get(key)):
            xs.append(r["step"])
            ys.append(float(r[key]))
    return xs, ys


# ---------------------------------------------------------------------- panels
Panel = Callable[[Any, list[RunRecords]], bool]
"""Draws one plot on a matplotlib Axes; returns False when no run has data for it."""


def _color(i: int) -> str:
    return f"C{i % 10}"


def panel_loss_vs_step(ax: Any, runs: list[RunRecords]) -> bool:
    drawn = False
    for i, run in enumerate(runs):
        xs, ys = _series(run.train, "loss")
        if xs:
            ax.plot(xs, ys, color=_color(i), label=f"{run.name} train")
            drawn = True
        xs, ys = _series(run.eval, "loss")
        if xs:
            ax.plot(xs, ys, color=_color(i), linestyle="--", marker="o", markersize=3, label=f"{run.name} eval")
            drawn = True
    ax.set(title="loss vs step", xlabel="step", ylabel="loss")
    return drawn


def panel_loss_vs_tokens(ax: Any, runs: list[RunRecords]) -> bool:
    drawn = False
    for i, run in enumerate(runs):
        curve = run.cumulative_tokens()
        if not curve:
            continue
        steps = [s for s, _ in curve]
        tokens = dict(curve)
        xs, ys = _series(run.train, "loss")
        ax.plot([tokens[s] for s in xs], ys, color=_color(i), label=f"{run.name} train")
        ex, ey = _series(run.eval, "loss")
        if ex:
            import numpy as np

            et = np.interp(ex, [0] + steps, [0.0] + [t for _, t in curve])
            ax.plot(et, ey, color=_color(i), linestyle="--", marker="o", markersize=3, label=f"{run.name} eval")
        drawn = True
    ax.set(title="loss vs target tokens", xlabel="target tokens", ylabel="loss")
    return drawn


def _line_panel(key: str, title: str, ylabel: str, *, log: bool = False, skip_first: bool = False) -> Panel:
    def draw(ax: Any, runs: list[RunRecords]) -> bool:
        drawn = False
        for i, run in enumerate(runs):
            xs, ys = _series(run.train, key, skip_first)
            if xs:
                ax.plot(xs, ys, color=_color(i), label=run.name)
                drawn = True
        ax.set(title=title, xlabel="step", ylabel=ylabel)
        if log and drawn:
            ax.set_yscale("log")
        return drawn
    return draw


def panel_reward(ax: Any, runs: list[RunRecords]) -> bool:
    """GRPO: mean reward of each step's rollouts, and of the eval prompts where eval logged one."""
    drawn = False
    for i, run in enumerate(runs):
        xs, ys = _series(run.train, REWARD_KEY)
        if xs:
            ax.plot(xs, ys, color=_color(i), label=f"{run.name} rollouts")
            drawn = True
        xs, ys = _series(run.eval, REWARD_KEY)
        if xs:
            ax.plot(xs, ys, color=_color(i), linestyle="--", marker="o", markersize=3, label=f"{run.name} eval")
            drawn = True
    ax.set(title="GRPO reward (mean)", xlabel="step", ylabel="reward")
    return drawn


def panel_goodput(ax: Any, runs: list[RunRecords]) -> bool:
    rows = [(run, run.goodput) for run in runs if run.goodput and run.goodput.get("wall", 0) > 0]
    seen: set[str] = set()
    for y, (run, g) in enumerate(rows):
        left = 0.0
        for cat in GOODPUT_CATEGORIES:
            pct = 100.0 * g.get(cat, 0.0) / g["wall"]
            if pct <= 0:
                continue
            ax.barh(y, pct, left=left, height=0.5, color=GOODPUT_COLORS[cat], edgecolor="white", linewidth=0.5,
                    label=cat if cat not in seen else None)
            seen.add(cat)
            if pct >= 6:
                ax.text(left + pct / 2, y, f"{pct:.0f}", ha="center", va="center", fontsize=7)
            left += pct
    if rows:
        ax.set_yticks(range(len(rows)), [f"{r.name}\n{g['wall']:.0f} s" for r, g in rows], fontsize=8)
        ax.set_ylim(len(rows) + 0.5, -0.6)  # first run on top, room for the legend below the bars
        ax.legend(fontsize=6, loc="lower center", ncol=4)
    ax.set(title="goodput: share of wall-clock time", xlabel="% of wall time", xlim=(0, 100))
    return bool(rows)


PANELS: list[tuple[str, Panel]] = [
    ("loss_vs_step", panel_loss_vs_step),
    ("loss_vs_tokens", panel_loss_vs_tokens),
    ("throughput", _line_panel("tokens_per_sec_per_device", "throughput (first step left out)",
                               "tokens/s/device", skip_first=True)),
    ("learning_rate", _line_panel("lr", "learning rate", "lr")),
    ("grad_norm", _line_panel("grad_norm", "grad norm (before clipping)", "global L2 norm", log=True)),
    ("goodput", panel_goodput),
    ("reward", panel_reward),
]


# ---------------------------------------------------------------------- output
def _matplotlib() -> Any:
    try:
        import matplotlib
    except ImportError:
        raise UserError("lmforge report needs matplotlib: pip install 'lmforge[report]'") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _legend(ax: Any) -> None:
    if ax.get_legend() is None and ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7)


def write_plots(runs: list[RunRecords], out: Path) -> list[Path]:
    """One PNG per panel that has data, plus ``overview.png`` with all of them."""
    plt = _matplotlib()
    written, drawn_panels = [], []
    for name, panel in PANELS:
        fig, ax = plt.subplots(figsize=(7, 4.2))
        if panel(ax, runs):
            ax.grid(alpha=0.3)
            _legend(ax)
            fig.tight_layout()
            path = out / f"{name}.png"
            fig.savefig(path, dpi=110)
            written.append(path)
            drawn_panels.append(panel)
        plt.close(fig)
    if drawn_panels:
        cols = 3 if len(drawn_panels) > 4 else 2
        nrows = math.ceil(len(drawn_panels) / cols)
        fig, axes = plt.subplots(nrows, cols, figsize=(5.2 * cols, 3.6 * nrows), squeeze=False)
        flat = [a for row in axes for a in row]
        for ax, panel in zip(flat, drawn_panels):
            panel(ax, runs)
            ax.grid(alpha=0.3)
            _legend(ax)
        for ax in flat[len(drawn_panels):]:
            ax.set_visible(False)
        fig.suptitle("lmforge report: " + ", ".join(r.name for r in runs))
        fig.tight_layout()
        path = out / "overview.png"
        fig.savefig(path, dpi=100)
        plt.close(fig)
        written.append(path)
    return written


def _num(v: Any, fmt: str = "{:.4f}") -> str:
    return fmt.format(v) if _finite(v) else "–"


def summary_markdown(runs: list[RunRecords], images: list[Path]) -> str:
    """The Markdown summary: final losses, throughput, goodput and warnings of every run."""
    lines = ["# lmforge run report", "",
             "| run | status | last step | target tokens | final train loss | final eval loss | "
             "median tokens/s/device | median MFU | goodput |",
             "|---|---|---|---|---|---|---|---|---|"]
    for run in runs:
        last = run.train[-1] if run.train else {}
        ev = run.eval[-1] if run.eval else {}
        tokens = run.cumulative_tokens()
        stop = next((e for e in reversed(run.events) if e.get("kind") == "stop"), None)
        if stop and _finite(stop.get("tokens_seen")):
            n_tokens = stop["tokens_seen"]
        else:
            n_tokens = tokens[-1][1] if tokens else None
        steady = [r for r in run.train if not r.get("first_step")]
        tps = [r["tokens_per_sec_per_device"] for r in steady if _finite(r.get("tokens_per_sec_per_device"))]
        mfu = [r["mfu"] for r in steady if _finite(r.get("mfu"))]
        g = run.goodput
        good = f"{100 * g['productive'] / g['wall']:.1f}%" if g and g.get("wall") else "–"
        status = "finished" if run.finished else ("stopped" if any(
            e.get("kind") == "nonfinite_stop" for e in run.events) else "running or interrupted")
        lines.append(f"| {run.name} | {status} | {last.get('step', '–')} | {_num(n_tokens, '{:,.0f}')} | "
                     f"{_num(last.get('loss'))} | {_num(ev.get('loss'))} | "
                     f"{_num(median(tps) if tps else None, '{:,.0f}')} | "
                     f"{_num(100 * median(mfu) if mfu else None, '{:.1f}%')} | {good} |")
    lines += ["", "## Goodput (percent of wall-clock time since process start)", "",
              "| run | wall s | " + " | ".join(GOODPUT_CATEGORIES) + " |",
              "|---|---|" + "---|" * len(GOODPUT_CATEGORIES)]
    for run in runs:
        g = run.goodput
        if not g or not g.get("wall"):
            continue
        cells = " | ".join(f"{100 * g.get(c, 0.0) / g['wall']:.1f}" for c in GOODPUT_CATEGORIES)
        note = "" if run.finished else " (so far)"
        if g["attempts"] > 1:
            note += f" ({g['attempts']} processes)"
        lines.append(f"| {run.name}{note} | {g['wall']:.1f} | {cells} |")
    warnings = [(run, e) for run in runs for e in run.events
                if e.get("kind") in ("loss_spike", "nonfinite_skip", "nonfinite_stop")]
    if warnings:
        lines += ["", "## Warnings", ""]
        for run, e in warnings:
            lines.append(f"- {run.name}, step {e.get('step')}: {e.get('message') or e.get('kind')}")
    stops = [(run, e) for run in runs for e in run.events if e.get("kind") == "stop"]
    if stops:
        lines += ["", "## Stop reasons", ""]
        lines += [f"- {run.name}: after step {e.get('step')}: {e.get('reason')}" for run, e in stops]
    lines += ["", "## Plots", ""]
    lines += [f"![{p.stem}]({p.name})" for p in images]
    return "\n".join(lines) + "\n"


def _unique_names(paths: list[str]) -> list[str]:
    names = [Path(p).resolve().name for p in paths]
    if len(set(names)) == len(names):
        return names
    return [str(Path(p)) for p in paths]


def make_report(run_dirs: list[str | Path], out: str | Path | None = None) -> list[Path]:
    """Write the plots and ``report.md`` for ``run_dirs`` into ``out``; returns the files written."""
    if not run_dirs:
        raise UserError("lmforge report: give at least one run directory")
    names = _unique_names([str(p) for p in run_dirs])
    runs = [read_run(p, n) for p, n in zip(run_dirs, names)]
    if not any(r.train or r.eval or r.goodput for r in runs):
        raise UserError("no train, eval or goodput records yet in " + ", ".join(str(p) for p in run_dirs))
    out_dir = Path(out) if out else runs[0].path / "report"
    where = f"--out {out_dir}" if out else f"{out_dir} (the default; choose another place with --out DIR)"
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        images = write_plots(runs, out_dir)
        md = out_dir / "report.md"
        md.write_text(summary_markdown(runs, images), encoding="utf-8")
    except OSError as e:
        raise UserError(f"cannot write the report to {where}: {e.strerror or e}") from None
    return images + [md]


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="lmforge report",
                                description="Plot one or more runs from their metrics.jsonl (finished or running).")
    p.add_argument("run_dirs", nargs="+", metavar="RUN_DIR")
    p.add_argument("--out", help="output directory (default: RUN_DIR/report of the first run)")
    a = p.parse_args(argv)
    written = make_report(a.run_dirs, a.out)
    print(f"report: {written[-1]}")
    for f in written[:-1]:
        print(f"  {f}")
    return 0
