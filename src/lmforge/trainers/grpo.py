"""GRPO: reinforcement learning with verifiable rewards on prompts (the embedded tasks by default).

Each rollout samples ``grpo.num_generations`` completions per prompt from the current policy and
scores them with the reward functions; then ``grpo.num_iterations`` optimizer updates train on that
batch through the shared train step (``gradient_computation`` with :class:`GRPOLoss`,
``run_optimizer_step``, ``compute_global_loss``). ``training.steps`` counts optimizer updates and
``training.global_batch_size`` counts completions (prompts per rollout x num_generations).
"""

from __future__ import annotations

import copy
import math
from typing import Any, Callable, Literal

import torch
from pydantic import Field, field_validator, model_validator
from torch import nn

from lmforge.training.checkpoint import load_model_weights, resolve_checkpoint
from lmforge.config import Config, Section
from lmforge.data.sources import read_jsonl_records
from lmforge.data.tasks import DEFAULT_SPLIT_SIZES, TASK_NAMES, TaskExample, task_examples
from lmforge.errors import UserError
from lmforge.training.loop import (
    Guard, StopSignals, do_eval, end_of_step, finish, lr_at, progress_redo, resume, training_steps,
)
from lmforge.rl.grpo_loss import GRPOLoss, loss_normalizer, update_metrics
from lmforge.rl.rewards import WeightedReward, load_rewards
from lmforge.rl.rollout import PromptSampler, Rollout, RolloutSettings, collect_rollout
from lmforge.training.runtime import Runtime, build_runtime
from lmforge.training.train_step import compute_global_loss, gradient_computation


class GRPOSection(Section):
    tasks: list[str] = list(TASK_NAMES)
    """Embedded tasks to train and evaluate on (when ``data.train`` is ``embedded``)."""
    prompt_field: str = "prompt"
    """Column of a ``.jsonl`` prompt file holding the user message; the other columns reach the rewards."""
    num_generations: int = Field(8, ge=2)
    """Completions per prompt (the group size G)."""
    max_new_tokens: int = Field(16, gt=0)
    temperature: float = Field(1.0, gt=0)
    top_p: float = Field(1.0, gt=0, le=1)
    num_iterations: int = Field(1, ge=1)
    """Optimizer updates per rollout batch; past the first, the rollout's log-probs are pi_old."""
    epsilon_low: float = Field(0.2, ge=0, lt=1)
    epsilon_high: float = Field(0.2, ge=0)
    beta: float = Field(0.0, ge=0)
    """KL penalty weight (k3 estimator) to the frozen starting model; 0 loads no reference model."""
    scale_rewards: Literal["group", "batch", "none"] = "group"
    loss_aggregation: Literal["grpo", "dapo", "dr_grpo"] = "grpo"
    mask_truncated: bool = False
    """Leave completions cut off at max_new_tokens out of the loss."""
    rewards: list[str] = ["exact_answer", "format"]
    """Built-in reward names or ``module:function``."""
    rewards_weights: list[float] = []
    """One weight per reward (empty: all 1.0)."""
    eval_examples: int = Field(300, ge=1)
    """Held-out examples for the greedy-decoding accuracy eval."""
    eval_max_new_tokens: int = Field(16, gt=0)
    """Generation budget of the greedy eval (the SFT trainer's default, so before/after numbers compare)."""
    eval_at_start: bool = True
    """Evaluate once before the first update (the "before" number of the run)."""
    log_completions_every: int = Field(50, ge=0)
    """Write one group of sampled completions with their rewards every this many steps (0: never)."""

    @field_validator("rewards", "tasks", mode="before")
    @classmethod
    def _split_names(cls, v: Any) -> Any:
        return [x.strip() for x in v.split(",") if x.strip()] if isinstance(v, str) else v

    @field_validator("rewards_weights", mode="before")
    @classmethod
    def _split_weights(cls, v: Any) -> Any:
        if isinstance(v, (int, float)):
            return [v]
        return [x.strip() for x in v.split(",") if x.strip()] if isinstance(v, str) else v


class GRPOConfig(Config):
    grpo: GRPOSection = GRPOSection()

    @model_validator(mode="before")
    @classmethod
    def _top_level_reward_flags(cls, data: Any) -> Any:
        """``--rewards=a,b --rewards_weights=1,0.2`` on the command line mean the grpo section's keys."""
        if isinstance(data, dict) and ("rewards" in data or "rewards_weights" in data):
            data = dict(data)
            section = dict(data.get("grpo") or {})
            for key in ("rewards", "rewards_weights"):
                if key in data:
                    section[key] = data.pop(key)
            data["grpo"] = section
        return data


def check_batch_shape(cfg: GRPOConfig, world_size: int) -> None:
    """Refuse batches that cannot hold whole groups before any work is done."""
    t, g = cfg.training, cfg.grpo
    if t.global_batch_size % (g.num_generations * world_size):
        raise UserError(
            f"training.global_batch_size ({t.global_batch_size}) must be a multiple of grpo.num_generations "
            f"({g.num_generations}) x world size ({world_size}): batch sizes count completions, and every "
            "prompt's group of completions must sit whole on one rank")
    if cfg.checkpoint.interval % g.num_iterations:
        raise UserError(f"checkpoint.interval ({cfg.checkpoint.interval}) must be a multiple of "
                        f"grpo.num_iterations ({g.num_iterations}) so that checkpoints fall between rollouts")


def prompt_records(cfg: GRPOConfig, split: Literal["train", "test"]) -> list[dict[str, Any]]:
    """Prompts with their other columns: the embedded tasks or a ``.jsonl`` file."""
    spec = cfg.data.train if split == "train" else cfg.data.validation
    if spec == "embedded":  # a subset of the tasks keeps the default per-task share of each split
        share = DEFAULT_SPLIT_SIZES[split] * len(cfg.grpo.tasks) // len(TASK_NAMES)
        n = share if split == "train" else min(cfg.grpo.eval_examples, share)
        return [{"prompt": e.prompt, "task": e.task, "answer": e.answer}
                for e in task_examples(split, n, tasks=cfg.grpo.tasks)]
    records = read_jsonl_records(spec)
    key = cfg.grpo.prompt_field
    bad = next((i for i, r in enumerate(records) if not isinstance(r.get(key), str)), None)
    if bad is not None:
        raise UserError(f"{spec}: record {bad + 1} has no string `{key}` column (set grpo.prompt_field)")
    return records if split == "train" else records[: cfg.grpo.eval_examples]


def starting_point(cfg: Config) -> str:
    """Where the initial weights come from; the reference model is rebuilt from exactly this."""
    if cfg.model.from_checkpoint:
        return f"checkpoint:{resolve_checkpoint(cfg.model.from_checkpoint).resolve()}"
    if cfg.model.from_hf:
        return f"hf:{cfg.model.from_hf}"
    return f"init:{cfg.training.seed}"


def load_reference(rt: Runtime, spec: str, initial: nn.Module | None) -> nn.Module | None:
    """The frozen reference (only with beta > 0): the run's starting weights, kept across resumes."""
    if rt.cfg.grpo.beta == 0:
        return None
    ref = initial if initial is not None else copy.deepcopy(rt.raw_model)
    if spec != starting_point(rt.cfg):  # resumed with another start configured: keep the recorded one
        kind, _, where = spec.partition(":")
        if kind == "checkpoint":
            load_model_weights(where, ref)
        elif kind == "init":
            ref.init_weights(seed=int(where))
        else:
            from lmforge.models.hf import load_hf_model
            ref.load_state_dict(load_hf_model(where).state_dict())
        rt.metrics.record_event("reference", 0, f"reference model: {spec} (recorded in the checkpoint)")
    return ref.eval().requires_grad_(False)


def rollout_generator(rt: Runtime) -> torch.Generator:
    gen = torch.Generator(device=rt.dist.device)
    gen.manual_seed(rt.cfg.training.seed * 1_000_003 + 7919 * rt.dist.rank + 1)
    return gen


def gather_rng_states(gen: torch.Generator) -> list[list[int]]:
    """Every rank's rollout-generator state (collective), for the checkpoint's JSON trainer state."""
    state = gen.get_state().tolist()
    if not torch.distributed.is_initialized():
        return [state]
    out: list[Any] = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(out, state)
    return out


def run(cfg: GRPOConfig) -> Runtime:
    """Check everything the user can get wrong (batch shape, rewards, prompt data), then train."""
    g = cfg.grpo
    check_batch_shape(cfg, 1)
    rewards = load_rewards(g.rewards, g.rewards_weights)
    data = prompt_records(cfg, "train"), prompt_records(cfg, "test")
    rt = build_runtime(cfg, "grpo")
    try:
        check_batch_shape(cfg, rt.dist.world_size)
        train_loop(rt, rewards, *data)
    finally:
        rt.metrics.close()
    return rt


def train_loop(rt: Runtime, rewards: list[WeightedReward], train_set: list[dict[str, Any]],
               eval_set: list[dict[str, Any]]) -> None:
    """Rollout, then num_iterations updates through the shared train step; eval/checkpoint on schedule."""
    cfg, g, metrics = rt.cfg, rt.cfg.grpo, rt.metrics
    sampler = PromptSampler(len(train_set), cfg.training.global_batch_size // g.num_generations,
                            rt.dist.rank, rt.dist.world_size, cfg.training.seed)
    generator, start = rollout_generator(rt), starting_point(cfg)
    initial = copy.deepcopy(rt.raw_model) if g.beta > 0 else None  # before resume overwrites the weights
    progress = resume(rt, sampler)
    saved = rt.extras.get("resumed_state", {}).get("extra", {})
    if "rollout_rng" in saved:
        states = saved["rollout_rng"]
        generator.set_state(torch.tensor(states[min(rt.dist.rank, len(states) - 1)], dtype=torch.uint8))
    sample = make_sampler(rt, rewards, train_set, generator, load_reference(rt, saved.get("reference", start), initial))
    loss_fn = GRPOLoss(eps_low=g.epsilon_low, eps_high=g.epsilon_high, beta=g.beta, aggregation=g.loss_aggregation,
                       max_new_tokens=g.max_new_tokens, temperature=g.temperature)
    run_eval = make_eval(eval_set, g.prompt_field)
    extra_state = lambda: {"rollout_rng": gather_rng_states(generator),  # noqa: E731
                           "reference": saved.get("reference", start)}
    if g.eval_at_start and progress.step == 0 and cfg.eval.interval:
        do_eval(rt, progress, run_eval)
    guard = Guard(rt)
    guard.spike_factor = 0.0  # the GRPO loss hovers around 0 with either sign: a ratio test means nothing
    rollout: Rollout | None = None
    with StopSignals(progress):
        for step in training_steps(rt, progress):
            if rollout is None or (step - 1) % g.num_iterations == 0:
                with metrics.timed("rollout"):
                    rollout = sample(sampler.next_indices())
                if g.log_completions_every and (step == 1 or step % g.log_completions_every == 0):
                    metrics.record_text(step, "completions", completions_table(rollout, g.num_generations))
            normalizer = loss_normalizer(rollout.batches, g.loss_aggregation, g.max_new_tokens)
            stats = gradient_computation(rt.model, rollout.batches, loss_fn, normalizer, rt.autocast())
            grad_norm = guard.optimizer_step(step, lr := lr_at(rt, step))
            progress.step = step
            totals = compute_global_loss(stats)
            values = {k: v for k, v in totals.items() if not k.endswith(("_sum", "_count"))} | update_metrics(totals) \
                | rollout.metrics | {"lr": lr, "grad_norm": grad_norm}
            record = metrics.record_step(step, tokens=rollout.tokens, metrics=values, lost=step <= progress_redo(rt))
            guard.after_step(step, values, record)
            end_of_step(rt, progress, sampler, totals["completion_tokens"], record is not None, run_eval, extra_state)
        finish(rt, progress, sampler, run_eval, extra_state)


def make_sampler(rt: Runtime, rewards: list[WeightedReward], train_set: list[dict[str, Any]],
                 generator: torch.Generator, reference: nn.Module | None) -> Callable[[list[int]], Rollout]:
    """``sample(prompt_indices) -> Rollout`` with the run's settings, from the current (unwrapped) policy."""
    from lmforge.inference import chat_prompt_ids

    g = rt.cfg.grpo
    settings = RolloutSettings(g.num_generations, g.max_new_tokens, g.temperature, g.top_p,
                               rt.cfg.training.micro_batch_size, g.scale_rewards, g.mask_truncated,
                               need_old_logprobs=g.num_iterations > 1)
    tok = rt.tokenizer

    def sample(indices: list[int]) -> Rollout:
        records = [train_set[i] for i in indices]
        prompt_ids = [chat_prompt_ids(tok, r[g.prompt_field]) for r in records]
        return collect_rollout(rt.raw_model, records, prompt_ids, rewards, settings, stop_id=tok.eos_id,
                               pad_id=tok.pad_id, decode=tok.decode, generator=generator, reference=reference,
                               autocast=rt.autocast(), prompt_field=g.prompt_field)

    return sample


def make_eval(eval_set: list[dict[str, Any]], prompt_field: str):
    """Held-out exact-match accuracy with greedy decoding, overall and per task (needs an ``answer`` column)."""
    examples = [TaskExample(r.get("task", "file"), r[prompt_field], str(r["answer"]))
                for r in eval_set if r.get("answer") is not None]

    def run_eval(rt: Runtime) -> dict[str, float]:
        from lmforge.inference import task_accuracy

        if not examples:
            return {}
        acc = task_accuracy(rt.raw_model, rt.tokenizer, examples, max_new_tokens=rt.cfg.grpo.eval_max_new_tokens,
                            batch_size=rt.cfg.eval.batch_size)
        return {"exact_match": acc.pop("all")} | {f"exact_match_{task}": v for task, v in acc.items()}

    return run_eval


def completions_table(rollout: Rollout, group_size: int) -> str:
    """The first group of the rollout as a Markdown table: completion, each reward, weighted total."""
    names = list(rollout.per_function)
    head = "| completion | " + " | ".join(names) + " | reward |\n|---|" + "---|" * (len(names) + 1)
    rows = []
    for i in range(min(group_size, len(rollout.completions))):
        text = rollout.completions[i].replace("|", "\\|").replace("\n", "\\n")
        vals = " | ".join("-" if math.isnan(rollout.per_function[n][i]) else f"{rollout.per_function[n][i]:g}"
                          for n in names)
        rows.append(f"| `{text}` | {vals} | {rollout.rewards[i]:g} |")
    return f"prompt: `{rollout.prompts[0]}`\n\n" + head + "\n" + "\n".join(rows)
