"""Held-out exact match on tasks with known answers: greedy decoding, overall and per task.

One evaluator for every recipe with a ``[tasks]`` config section (SFT, GRPO, the preference recipes): it
runs with every eval, at the start too when ``eval.at_start`` is on; :func:`record_task_summary` states
the run's "before -> after".
On several ranks (DDP or FSDP2) each rank decodes its share of the examples and the hits are summed,
so every rank reports the scores of all of them.
"""

from __future__ import annotations

import math
from typing import Sequence

import torch

from lmforge import distributed as dist_utils
from lmforge.distributed import EVERY_RANK, ReduceGroup
from lmforge.config import TasksSection
from lmforge.data.chat import chat_format_for, stop_token_ids
from lmforge.data.tasks import TaskExample, is_correct, task_examples, task_share
from lmforge.errors import UserError
from lmforge.metrics.records import read_records
from lmforge.models.generate import generate
from lmforge.models.model import Transformer
from lmforge.models.tokenizer import Tokenizer
from lmforge.runtime import Runtime


def task_accuracy(model: Transformer, tokenizer: Tokenizer, examples: Sequence[TaskExample], *,
                  max_new_tokens: int = 32, batch_size: int = 32, rank: int = 0,
                  world_size: int = 1, reduce: ReduceGroup = EVERY_RANK) -> dict[str, float]:
    """Greedy exact-match accuracy overall (``"all"``) and per task, from one generation pass.

    With ``world_size > 1`` every rank calls this with the same examples and decodes only its
    contiguous share, padded to the same size (so all ranks run the same batches, decoding in
    lockstep); the hits are summed over the ranks of ``reduce`` and every rank returns the scores of all
    examples.
    """
    if not examples:
        return {"all": 0.0}
    chat = chat_format_for(tokenizer)
    try:
        ids = [chat.prompt_ids([{"role": "user", "content": e.prompt}]) for e in examples]
    except ValueError as e:  # a template's raise_exception
        raise UserError(str(e)) from None
    n = min(max_new_tokens, model.args.max_seq_len - max(len(i) for i in ids))  # the same on every rank
    per_rank = math.ceil(len(examples) / world_size)
    mine = list(range(rank * per_rank, min((rank + 1) * per_rank, len(examples))))
    padded = mine + [mine[-1] if mine else 0] * (per_rank - len(mine))  # repeats, not counted
    stops, device = stop_token_ids(tokenizer), next(model.parameters()).device
    tasks = ["all", *sorted({e.task for e in examples})]
    counts = torch.zeros(2, len(tasks), dtype=torch.float64)
    for lo in range(0, per_rank, batch_size):
        batch = padded[lo:lo + batch_size]
        rows = generate(model, [ids[i] for i in batch], n, stop_ids=stops, pad_id=tokenizer.pad_id,
                        temperature=0.0, lockstep=True)
        for k, (i, row) in enumerate(zip(batch, rows)):
            if lo + k >= len(mine):
                continue
            ok = float(is_correct(tokenizer.decode(row, skip_special=True), examples[i].answer))
            for t in (0, tasks.index(examples[i].task)):
                counts[0, t] += ok
                counts[1, t] += 1
    counts = reduce.sum(counts.to(device)).cpu()
    return {task: float(counts[0, t] / counts[1, t]) for t, task in enumerate(tasks)}


def held_out_examples(tasks: TasksSection) -> list[TaskExample]:
    """The held-out embedded task examples a run is scored on: ``tasks.eval_examples`` of them, at most
    the selected tasks' share of the test split, so SFT and GRPO on the same tasks score the same set."""
    if tasks.images:  # the image task is scored by lmforge.evaluation.image_tasks
        return []
    n = min(tasks.eval_examples, task_share("test", tasks.names))
    return task_examples("test", n, tasks.names) if n else []


class TaskEval:
    """``evaluate(rt, step) -> {"exact_match": ..., "exact_match_<task>": ...}`` on fixed held-out examples."""

    def __init__(self, examples: Sequence[TaskExample], max_new_tokens: int, batch_size: int = 32) -> None:
        self.examples = list(examples)
        self.max_new_tokens = max_new_tokens
        self.batch_size = batch_size

    def __bool__(self) -> bool:
        return bool(self.examples)

    def __call__(self, rt: Runtime, step: int = 0) -> dict[str, float]:
        if not self.examples:
            return {}
        with dist_utils.full_parameters(rt.model.raw) as model:  # FSDP2: gathered once for the whole pass
            acc = task_accuracy(model, rt.model.tokenizer, self.examples, max_new_tokens=self.max_new_tokens,
                                batch_size=self.batch_size, rank=rt.world.dist.batch_share,
                                world_size=rt.world.dist.batch_shares, reduce=rt.world.dist.reduce)
        return {"exact_match": acc.pop("all")} | {f"exact_match_{task}": v for task, v in acc.items()}


def record_task_summary(rt: Runtime, step: int) -> None:
    """One ``task_accuracy`` event: exact match of the starting model (the step-0 eval) and the last one,
    read from the run's metrics, so a resumed run still reports its real "before"."""
    if not rt.world.dist.is_main:
        return
    scores = {r["step"]: r["exact_match"] for r in read_records(rt.world.run_dir, "eval") if "exact_match" in r}
    if 0 not in scores or step == 0 or len(scores) < 2:
        return
    before, after = scores[0], scores[max(scores)]
    rt.metrics.record_event("task_accuracy", step, f"held-out exact match (greedy): {before:.3f} before "
                            f"-> {after:.3f} after {step} steps", before=before, after=after)
