"""How much memory a training layout needs per device, and which layouts of a mesh fit.

Pure functions of the model's shape (:class:`~lmforge.models.args.ModelArgs`), the batch and a
:class:`ParallelDims` of mesh degrees; nothing is built or allocated. The numbers count what lmforge's own
train step keeps, measured on it (``bench/plan_memory.py``, ``tests/test_planner.py``), not a
paper's formula:

* parameters fp32, gradients fp32, AdamW's two fp32 moments (8-bit AdamW: one byte each plus a
  scale per 256 values; Muon: one fp32 momentum on the block matrices, AdamW on the rest);
* activations: the tensors autograd saves per decoder block (:func:`block_activation_bytes`), the
  final norm and the chunked loss (which holds one chunk of logits at a time, never all of them),
  plus the largest transient of the backward (the gated MLP's gradients);
* the step's peak is the larger of the backward (parameters, optimizer state, activations, and the
  gradients of earlier microbatches) and the optimizer step (parameters, gradients and state: the
  fused AdamW kernel makes no temporaries).

Under bf16 autocast the parameters and the residual stream stay fp32: what the norms save is fp32,
while each linear saves its own bf16 copy of its input (autocast casts per call) and of its weight.

On a mesh (measured per rank, ``bench/plan_memory_layouts.py``, ``tests/test_planner_layouts.py``):
FSDP2 shards over ``dp_shard x cp`` and, while gradients accumulate over microbatches, keeps them
unsharded until the last backward; context parallelism saves each layer's gathered keys and values
(its blockwise attention keeps no ``T/cp x T`` mask); the first pipeline stage holds up to ``pp`` microbatches in flight,
and when every microbatch is in flight at once its peak comes before any gradient exists.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from itertools import product
from typing import Iterator

from lmforge.models.args import ModelArgs
from lmforge.models.layers.causal_attention import EXPLICIT_MAX_LEN
from lmforge.models.memory import ParamCounts, block_activation_bytes, mlp_transient, param_counts
from lmforge.models.model import tp_problem, tp_sizes
from lmforge.parallel.dims import ParallelDims

__all__ = ["MemoryEstimate", "ParamCounts", "param_counts", "block_activation_bytes", "estimate_memory",
           "candidate_layouts", "OPTIMIZERS"]

OPTIMIZERS = ("adamw", "adamw8bit", "muon")
INDEX_BYTES_PER_TOKEN = 40
"""Labels, target positions and their index copies in the loss (int64 and bool per token)."""


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes per device at the step's peak (the worst pipeline stage)."""

    params: float
    grads: float
    optimizer: float
    activations: float
    """Saved activations at the peak, with the loss chunk or the backward's transient."""
    buffers: float
    """FSDP's gathered parameters and unsharded gradients of one block, DDP's gradient buckets, and the
    pipeline schedule's per-microbatch tensors."""
    total: float
    phase: str
    """Where the peak falls: ``loss`` (a chunk of logits), ``backward`` or ``optimizer``."""

    def to_dict(self) -> dict[str, float | str]:
        return asdict(self)


def _optimizer_bytes(args: ModelArgs, counts: ParamCounts, name: str) -> float:
    """Optimizer state bytes for all parameters (before sharding)."""
    total = counts.total
    if name == "adamw":
        return 8.0 * total
    if name == "adamw8bit":  # 2 x (1 byte + a fp32 scale per 256); tensors under 4096 values stay fp32
        small = sum(counts.block_small) + counts.final_norm
        return 2 * (1 + 4 / 256) * (total - small) + 8 * small
    muon = sum(counts.block_dense)  # Muon's momentum on the block projections, AdamW on the rest
    return 4.0 * muon + 8.0 * (total - muon)


def estimate_memory(args: ModelArgs, layout: ParallelDims, seq_len: int, micro_batch: int, dtype: str = "float32",
                    checkpointing: bool = False, *, microbatches: int = 1, optimizer: str = "adamw",
                    loss_chunk_tokens: int = 1024, device: str = "cuda") -> MemoryEstimate:
    """Peak bytes per device of one train step of ``args`` laid out as ``layout``: the larger of the
    first pipeline stage (embedding, ``pp`` microbatches in flight under 1F1B) and the last (output
    projection and loss, one in flight). ``microbatches`` per step and rank (gradient accumulation):
    above one, the gradients of the earlier microbatches are live during each backward. ``device``
    matters under bf16: on ``cuda`` FSDP2 gathers bf16 parameters (its mixed-precision policy, see
    parallel.plans.apply_fsdp), elsewhere it gathers fp32 ones and autocast saves a bf16 copy of each
    weight, as in one process; on ``cpu`` the attention of short sequences runs explicitly and keeps
    its probabilities (lmforge.models.layers.causal_attention), and the loss's log-softmax is in place."""
    stages = [0, layout.pp - 1] if layout.pp > 1 else [0]
    explicit = device == "cpu" and dtype == "bfloat16" and layout.cp == 1 and seq_len <= EXPLICIT_MAX_LEN
    return max((_stage_estimate(args, layout, s, seq_len, micro_batch, dtype, checkpointing, microbatches,
                                optimizer, loss_chunk_tokens, device, seq_len if explicit else 0) for s in stages),
               key=lambda e: e.total)


def _stage_estimate(args: ModelArgs, layout: ParallelDims, stage: int, seq_len: int, micro_batch: int, dtype: str,
                    checkpointing: bool, microbatches: int, optimizer: str, chunk: int,
                    device: str = "cuda", explicit_len: int = 0) -> MemoryEstimate:
    counts = param_counts(args)
    blocks = args.decoder_config().blocks
    tp, pp, ep, shards = layout.tp, layout.pp, layout.ep, layout.fsdp_shards
    a = 2 if dtype == "bfloat16" else 4
    per_stage = math.ceil(args.n_layers / pp)
    layers = list(range(stage * per_stage, min(args.n_layers, (stage + 1) * per_stage)))
    first, last = stage == 0, stage == pp - 1
    # parameters held by this stage, before FSDP sharding (tp splits the projections and the vocabulary)
    dense = sum(counts.block_dense[i] for i in layers) / tp
    experts = sum(counts.block_experts[i] for i in layers) / tp
    small = sum(counts.block_small[i] for i in layers)
    ends = (counts.embedding / tp if first else 0) + ((counts.output / tp + counts.final_norm) if last else 0)
    stage_params = dense + experts + small + ends
    share = stage_params / max(counts.total, 1)
    params = 4 * stage_params / shards + (4 * counts.buffers if layers else 0)
    grads = 4 * stage_params / shards
    opt = _optimizer_bytes(args, counts, optimizer) * share / shards

    tokens = micro_batch * seq_len / layout.cp
    sp = tokens / tp
    in_flight = min(pp - stage, max(microbatches, 1)) if pp > 1 else 1
    # one block's saved activations; checkpointing keeps each block's input (fp32 residual) instead
    per_block = [block_activation_bytes(blocks[i], tokens, a, tp, layout.cp, seq_len, explicit_len) for i in layers]
    block = max(per_block, default=0.0)
    saved = sum(per_block)
    if checkpointing:
        saved = 4 * args.dim * sp * len(layers)
    weight_copies = 0.0
    gather = a if device == "cuda" else 4  # bytes per value of FSDP2's gathered parameters
    if a == 2 and (shards == 1 or gather == 4):  # autocast's bf16 weight copies, saved by each linear
        weight_copies = 2 * (dense + experts / ep)
        if not checkpointing:
            saved += weight_copies
    saved_one = saved
    saved *= in_flight
    # the backward of one block: recomputed whole under checkpointing (its input is already counted)
    last_block = layers[-1] if layers else 0
    transient = mlp_transient(blocks[last_block], tokens, a, tp) if layers else 0.0
    if checkpointing and layers:
        transient += block - 4 * args.dim * sp + weight_copies / max(len(layers), 1)
    backward = saved + transient
    # gradients of earlier microbatches are live at the peak when a forward or backward runs after the
    # step's first backward with as many microbatches in flight (1F1B's steady state; accumulation)
    accumulating = microbatches > in_flight
    if not accumulating and len(layers) > 1:
        # each block's backward frees what it saved and creates its gradients: when the gradients are the
        # larger (checkpointing, small batches) the peak moves to the last block to run backward
        per_block_grads = 4 * (dense + experts + small) / len(layers) / shards
        backward += (len(layers) - 1) * max(0.0, per_block_grads - saved_one / len(layers))
    loss = saved
    if last:  # final norm, the loss's hidden rows and their gradient, one chunk of fp32 logits
        vocab = args.vocab_size / tp
        head_saved = (4 * args.dim + 4) * sp + 4 * args.dim * tokens + 4 * vocab * args.dim
        c = min(chunk, tokens)
        # a chunk's fp32 logits and their log-softmax (on a CPU written over them; the vocabulary-parallel
        # loss keeps its shifted logits beside them), and under autocast the chunk's bf16 gradient
        per_value = 8 if tp > 1 or device != "cpu" else (4 if a == 4 else 6)
        chunk_bytes = per_value * c * vocab + ((2 * c * args.dim + 2 * vocab * args.dim) if a == 2 else 0)
        loss = saved + head_saved + 8 * args.dim * tokens + chunk_bytes + INDEX_BYTES_PER_TOKEN * tokens
        backward += 4 * vocab * args.dim + INDEX_BYTES_PER_TOKEN * tokens  # the output weight's gradient
    activations = max(loss, backward)
    phase = "loss" if loss >= backward else "backward"
    # FSDP gathers a block's parameters (this one and the next, prefetched) and, in backward, holds its
    # unsharded gradients until they are reduce-scattered; DDP copies every gradient into its buckets.
    buffers = 0.0
    if shards > 1 and layers:
        largest = max((counts.block_dense[i] + counts.block_experts[i] / ep) / tp + counts.block_small[i]
                      for i in layers)
        buffers = largest * (2 * gather + 4)
    elif layout.dp_replicate > 1:
        buffers = grads
    # FSDP2 accumulates unsharded gradients until the step's last backward
    accumulated = 4 * stage_params if shards > 1 else grads
    live_grads = accumulated if accumulating else 0.0
    if not accumulating and in_flight > 1:
        # a first stage whose microbatches are all in flight at once (pp of them under 1F1B): after the
        # first backward, one fewer in flight beside every gradient
        later = saved_one * (in_flight - 1) + transient
        if later + accumulated > activations:
            activations, live_grads, phase = later, accumulated, "backward"
    if pp > 1:  # measured under 1F1B: the first stage's peak grows by about one fp32 hidden-state tensor
        # per microbatch of the step beyond what is in flight (per-microbatch state of the schedule and
        # its sends; not traced to its owner), so one per microbatch is counted
        buffers += microbatches * 4 * args.dim * sp
    step = params + opt + live_grads + activations + buffers
    opt_step = params + opt + grads + (buffers if layout.dp_replicate > 1 and shards == 1 else 0)
    if opt_step > step:
        phase, step = "optimizer", opt_step
    return MemoryEstimate(params, grads, opt, activations, buffers, step, phase)


def _divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


def layout_problem(args: ModelArgs, layout: ParallelDims, seq_len: int) -> str | None:
    """Why the model cannot take ``layout`` (None: it can): the runtime's own checks (mesh rules such as
    no tp beside DDP, tp dividing the heads and vocabulary, what pp and ep refuse), then the shape rules
    below."""
    from lmforge.config import ParallelSection
    from lmforge.errors import UserError
    from lmforge.parallel.dims import ParallelDims
    from lmforge.parallel.layout_checks import check_layout_of_model

    world = layout.dp_replicate * layout.dp_shard * layout.tp * layout.cp * layout.pp
    try:
        section = ParallelSection(dp_replicate=layout.dp_replicate, dp_shard=layout.dp_shard, tp=layout.tp,
                                  cp=layout.cp, ep=layout.ep, pp=layout.pp)
        check_layout_of_model(ParallelDims.from_config(section, world), args, seq_len)
    except UserError as e:
        return str(e)
    if layout.tp > 1:
        for block in args.decoder_config().blocks:
            problem = tp_problem(block)
            uneven = sorted(f"{k}={v}" for k, v in tp_sizes(block).items() if v % layout.tp)
            if problem or uneven:
                return f"tp={layout.tp}: {problem or 'does not divide ' + ', '.join(uneven)}"
    if layout.pp > args.n_layers:
        return f"pp={layout.pp} exceeds n_layers={args.n_layers}"
    if seq_len % (2 * layout.cp):
        return f"cp={layout.cp}: seq_len={seq_len} does not split into 2*cp equal chunks"
    if layout.ep > 1 and (not args.n_experts or args.n_experts % layout.ep or layout.dp_shard % layout.ep):
        return f"ep={layout.ep} must divide n_experts={args.n_experts} and dp_shard={layout.dp_shard}"
    return None


def candidate_layouts(args: ModelArgs, devices: int, seq_len: int) -> Iterator[ParallelDims]:
    """Every layout whose degrees multiply to ``devices`` and that the model can take (see
    :func:`layout_problem`); ``ep`` > 1 only for a mixture of experts."""
    divs = _divisors(devices)
    for pp, tp, cp, rep in product(divs, repeat=4):
        if devices % (pp * tp * cp * rep):
            continue
        shard = devices // (pp * tp * cp * rep)
        for ep in (_divisors(shard) if args.n_experts else [1]):
            layout = ParallelDims.of(dp_replicate=rep, dp_shard=shard, tp=tp, cp=cp, pp=pp, ep=ep)
            if layout_problem(args, layout, seq_len) is None:
                yield layout
