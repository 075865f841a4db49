"""Pipeline parallelism: the decoder's layers split into stages over the ``pp`` ranks.

Each of the ``pp`` ranks owns ``stages_per_rank`` stages (more than one for the interleaved schedule,
in looped order: rank r holds stages r, r + pp, r + 2 pp, ...); a stage owns a contiguous range of
layers, the first stage also the embedding, the last one the final norm and the output projection.
A stage is the model itself with the pieces it does not own set to None (``layers`` stays a
ModuleList), so its state dict keeps the whole model's names: the union of the stages' state dicts
is the whole model's, and DCP checkpoints reshard between pipeline layouts and to one process.

Tied input/output embeddings are refused (the output weight would live on the first stage and its
gradient on the last), as are mixtures of experts (their load-balancing loss couples every layer's
routing in one nonlinear term, which no single stage can compute).

The schedules are ``torch.distributed.pipelining``'s; :class:`Pipeline` builds their stage objects
per microbatch shape (the stages' receive buffers have fixed shapes). The train step and eval over a
pipeline are in :mod:`lmforge.parallel.pipeline_step`.
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any

import torch
from torch import nn

from lmforge.errors import UserError

SCHEDULES = ("1f1b", "interleaved_1f1b", "gpipe")
"""``1f1b`` and ``gpipe``: one stage per rank; ``interleaved_1f1b``: ``stages_per_rank`` stages per rank."""


def split_layers(n_layers: int, pp: int, stages_per_rank: int = 1) -> list[range]:
    """The layers of each of the ``pp x stages_per_rank`` stages, in stage order: contiguous ranges as
    even as possible, the earlier stages taking one more layer where they cannot be equal."""
    stages = pp * stages_per_rank
    if n_layers < stages:
        raise UserError(f"parallel.pp={pp} with {stages_per_rank} stage(s) per rank needs at least {stages} "
                        f"layers, but model.n_layers is {n_layers}")
    base, extra = divmod(n_layers, stages)
    bounds = [0]
    for s in range(stages):
        bounds.append(bounds[-1] + base + (1 if s < extra else 0))
    return [range(a, b) for a, b in zip(bounds, bounds[1:])]


def stage_ids(pp_rank: int, pp: int, stages_per_rank: int = 1) -> list[int]:
    """The stages rank ``pp_rank`` of the pipeline holds, in the looped order torch's schedules use."""
    return [pp_rank + k * pp for k in range(stages_per_rank)]


def min_microbatches(pp: int, schedule: str) -> int:
    """The fewest microbatches per step the schedule runs with (GPipe: any number)."""
    return 1 if schedule == "gpipe" else pp


def check_pp(args: Any, pp: int, stages_per_rank: int = 1, microbatches: int | None = None,
             schedule: str = "1f1b") -> None:
    """One-line UserError for a model or batch layout the pipeline cannot run. ``microbatches`` is the
    number of microbatches of one step on one pipeline (global batch / (data-parallel ranks x
    ``training.micro_batch_size``)); None skips that check."""
    if pp < 1 or stages_per_rank < 1:
        raise UserError(f"parallel.pp={pp} with {stages_per_rank} stage(s) per rank: both must be at least 1")
    if schedule not in SCHEDULES:
        raise UserError(f"parallel.pp_schedule={schedule!r}: expected one of {', '.join(SCHEDULES)}")
    if stages_per_rank > 1 and schedule != "interleaved_1f1b":
        raise UserError(f"parallel.pp_schedule={schedule!r} runs one stage per rank, but {stages_per_rank} "
                        "stages per rank were asked for; use interleaved_1f1b")
    if pp == 1 and stages_per_rank == 1:
        return
    split_layers(args.n_layers, pp, stages_per_rank)
    if args.tie_embeddings:
        raise UserError(f"parallel.pp={pp}: tied input/output embeddings (model.tie_embeddings, e.g. SmolLM2 and "
                        "small Qwen models) are not supported with pipeline parallelism")
    if args.n_experts:
        raise UserError(f"parallel.pp={pp}: mixture-of-experts models (model.n_experts={args.n_experts}) are not "
                        "supported with pipeline parallelism (the router loss couples every layer)")
    if microbatches is None:
        return
    need = min_microbatches(pp, schedule)
    if microbatches < need:
        raise UserError(f"parallel.pp={pp} with pp_schedule={schedule} needs at least {need} microbatches per step, "
                        f"but training.global_batch_size / (data-parallel ranks x training.micro_batch_size) "
                        f"is {microbatches}")
    rounds = max(1, microbatches // pp)
    if schedule == "interleaved_1f1b" and microbatches % rounds:
        raise UserError(f"parallel.pp={pp} with pp_schedule=interleaved_1f1b: {microbatches} microbatches per step "
                        f"is not a multiple of {rounds} (microbatches // pp); change training.micro_batch_size "
                        "or training.global_batch_size")


def split_model(model: nn.Module, pp_rank: int, pp: int, stages_per_rank: int = 1) -> list[nn.Module]:
    """This rank's stages of ``model`` (a :class:`~lmforge.models.model.Transformer`), in stage order.

    Each stage is a new module of the model's class sharing the model's submodules (no copy): the
    layers it owns at their own indices of ``layers`` (None elsewhere), the embedding on the first
    stage, the final norm and output on the last, the RoPE tables everywhere. Use the stages, not
    ``model``, from here on (wrappers go on the stages). Initialise the whole model before the split
    to get the one-process weights (a stage's ``init_weights`` draws only its own pieces).
    """
    check_pp(model.args, pp, stages_per_rank, schedule="interleaved_1f1b" if stages_per_rank > 1 else "1f1b")
    ranges = split_layers(len(model.layers), pp, stages_per_rank)
    n_stages = len(ranges)
    parts = []
    for sid in stage_ids(pp_rank, pp, stages_per_rank):
        part = model.pipeline_stage(ranges[sid], first=sid == 0, last=sid == n_stages - 1)
        part.pp_stage = sid  # read by Pipeline; a plain attribute, not in the state dict
        parts.append(part)
    return parts


def _stage_class() -> type:
    from torch.distributed.pipelining import PipelineStage

    class AutocastStage(PipelineStage):
        """A stage whose forwards (and shape inference) run under the step's autocast, as the
        one-process forward does, while its backward runs outside it, as there."""

        autocast: Any = None

        def forward_maybe_with_nosync(self, *args: Any, **kwargs: Any) -> Any:
            with self.autocast or nullcontext():
                return super().forward_maybe_with_nosync(*args, **kwargs)

        def _compute_outputs(self, *args: Any, module: nn.Module, **kwargs: Any) -> Any:
            with self.autocast or nullcontext():
                return super()._compute_outputs(*args, module=module, **kwargs)

    return AutocastStage


def _identity_loss(output: torch.Tensor, target: Any) -> torch.Tensor:
    """The schedule's loss: the last stage's forward already returned the scaled objective."""
    return output


class Pipeline(nn.Module):
    """This rank's stages (``parts``, wrapped each on its own) and the schedule that runs them over the
    ``pp`` process group.

    As a module it holds the union of its stages' pieces under the whole model's names (``layers.<i>``
    for the blocks it owns, None for the others'; the embedding, final norm and output where it has
    them), so the optimizer, ``state_dict`` and DCP checkpoints see this rank's parameters by the names
    they have in one process, and a checkpoint reshards to any other layout. It is not called: the
    train step runs it through :mod:`lmforge.parallel.pipeline_step`.

    The schedule's stage objects hold receive buffers of one activation shape, so they are built for
    the microbatch shape of a step and rebuilt when it changes (the newest one of each of train and
    eval is kept); building costs one forward (and backward) of the first microbatch to infer the
    shapes, run by torch with the RNG forked, so training is unchanged.
    """

    def __init__(self, parts: list[nn.Module], pp_group: Any, device: torch.device, schedule: str = "1f1b") -> None:
        import torch.distributed as dist

        super().__init__()
        layers = nn.ModuleList()
        for i in range(len(parts[0].layers)):
            layers._modules[str(i)] = next((p.layers[i] for p in parts if p.layers[i] is not None), None)
        self.layers = layers
        for name in (*parts[0].FIRST_STAGE_MODULES, *parts[0].LAST_STAGE_MODULES):
            self._modules[name] = next((getattr(p, name) for p in parts if getattr(p, name) is not None), None)
        self.args = parts[0].args
        self.parts, self.group, self.device, self.schedule_name = parts, pp_group, device, schedule
        self.pp = dist.get_world_size(pp_group)
        self.stage_ids = [p.pp_stage for p in parts]
        self.num_stages = self.pp * len(parts)
        self.has_first_stage = 0 in self.stage_ids
        self.has_last_stage = self.num_stages - 1 in self.stage_ids
        self.last_stage_rank = dist.get_global_rank(pp_group, (self.num_stages - 1) % self.pp)
        self._runners: dict[bool, tuple[Any, Any, list]] = {}

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("a pipeline is run by lmforge.parallel.pipeline_step, not called")

    def runner(self, train: bool, microbatches: list[Any]) -> tuple[Any, list]:
        """(schedule, stages) for ``microbatches`` of one shape, with (``train``) or without backward."""
        shapes = {tuple(mb.input_ids.shape) for mb in microbatches}
        if len(shapes) != 1:
            raise ValueError(f"pipeline parallelism needs the microbatches of a step to share one shape, got {shapes}")
        key = (len(microbatches), shapes.pop())
        cached = self._runners.get(train)
        if cached is not None and cached[0] == key:
            return cached[1], cached[2]
        from torch.distributed import pipelining as pl

        stage_cls = _stage_class()
        stages = [stage_cls(part, sid, self.num_stages, self.device, group=self.group)
                  for part, sid in zip(self.parts, self.stage_ids)]
        n, loss = len(microbatches), _identity_loss if train else None
        if len(stages) > 1:  # forward only: the looped breadth-first order has no microbatch constraint
            kind = pl.ScheduleInterleaved1F1B if train else pl.ScheduleLoopedBFS
            schedule = kind(stages, n, loss_fn=loss, scale_grads=False)
        else:  # forward only: GPipe has no microbatch minimum
            kind = pl.Schedule1F1B if train and self.schedule_name != "gpipe" else pl.ScheduleGPipe
            schedule = kind(stages[0], n, loss_fn=loss, scale_grads=False)
        self._runners[train] = (key, schedule, stages)
        return schedule, stages

    def run(self, train: bool, microbatches: list[Any], kwargs: list[dict], autocast: Any) -> None:
        """One schedule step over ``microbatches``: the first stage embeds ``input_ids``, every stage's
        forward gets its microbatch's ``kwargs`` (metadata and the last stage's head). Calls the
        schedule's per-microbatch entry, since these are lmforge's microbatches, not a batch to split."""
        schedule, stages = self.runner(train, microbatches)
        for stage in stages:
            stage.autocast = autocast
            stage.has_backward = train
            stage.clear_runtime_states()
        args = [(mb.input_ids,) for mb in microbatches]
        targets = [torch.zeros((), device=self.device) for _ in microbatches] if train else None
        schedule._step_microbatches(args, kwargs, targets, None, return_outputs=False)
