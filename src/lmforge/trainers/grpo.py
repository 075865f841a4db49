"""GRPO: reinforcement learning with verifiable rewards on prompts (the embedded tasks by default, or
prompt records of ``.jsonl``/``.parquet`` files read by the same reader as SFT data).

GRPO runs the shared loop (:func:`lmforge.training.loop.train`) like every trainer. What differs is
its step source, :class:`lmforge.rl.rollout_source.RolloutSource` (a rollout of
``grpo.num_generations`` completions per prompt, scored by the reward functions, reused for
``grpo.num_iterations`` updates), and its objective, :class:`lmforge.rl.grpo_loss.GRPOObjective`.
``training.steps`` counts optimizer updates and ``training.global_batch_size`` counts completions
(prompts per rollout x num_generations).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from lmforge.config import Config, Section, StartEvalSection, TasksSection, comma_separated
from lmforge.data.record_formats import prompt_messages
from lmforge.data.sources import read_records
from lmforge.data.tasks import TaskExample, task_examples, task_share
from lmforge.errors import UserError
from lmforge.evaluation.tasks import TaskEval, record_task_summary
from lmforge.rl.grpo_loss import GRPOObjective
from lmforge.evaluation.downstream import with_downstream
from lmforge.rl.rewards import load_rewards, probe_rewards
from lmforge.rl.rollout_source import RolloutSource
from lmforge.training.loop import train
from lmforge.training.runtime import Runtime, build_runtime


class GRPOSection(Section):
    prompt_field: str = "prompt"
    """Column of a ``.jsonl``/``.parquet`` prompt file holding the prompt: a string (the user message)
    or a list of chat messages. The other columns reach the rewards."""
    answer_field: str = "answer"
    """Column holding the reference answer; the rewards receive it as ``answer``."""
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
    log_completions_every: int = Field(50, ge=0)
    """Write one group of sampled completions with their rewards every this many steps (0: never)."""
    dynamic_sampling: bool = False
    """DAPO's dynamic sampling: drop groups whose rewards are all equal and draw more prompts until
    the batch is full of groups that carry a signal."""
    max_sampling_rounds: int = Field(3, ge=1)
    """With dynamic sampling, the most sampling rounds per rollout; a batch still short after them
    is filled with dropped groups."""
    overlong_buffer: int = Field(0, ge=0)
    """Tokens before max_new_tokens over which the ``overlong_penalty`` reward falls from 0 to -1."""
    tis_cap: float = Field(0.0, ge=0)
    """Truncated importance sampling: weight each token by min(pi_old / pi_rollout, tis_cap), pi_rollout
    being the sampler's own log-probs (in ``rollout_dtype``); 0 is off."""
    rollout_dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    """Precision of sampling (and of the rollout's log-probs for ``tis_cap``); auto: training.dtype."""
    prompts_per_generation: int = Field(0, ge=0)
    """Prompts per generate call (0: a rank's whole share of a sampling round). Each call samples from
    a stream seeded by its first prompt's position, so calls of the same size draw the same completions
    at any world size."""

    @field_validator("rewards", mode="before")
    @classmethod
    def _split_names(cls, v: Any) -> Any:
        return comma_separated(v)

    @field_validator("rewards_weights", mode="before")
    @classmethod
    def _split_weights(cls, v: Any) -> Any:
        if isinstance(v, (int, float)):
            return [v]
        return comma_separated(v)


class GRPOConfig(Config):
    grpo: GRPOSection = GRPOSection()
    tasks: TasksSection = TasksSection()
    eval: StartEvalSection = StartEvalSection()

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


def read_prompt_records(spec: str, prompt_field: str = "prompt", answer_field: str = "answer") -> list[dict[str, Any]]:
    """Prompt records of a ``.jsonl``/``.parquet`` file or directory, checked, with the
    ``answer_field`` column's value under ``answer`` (what the rewards receive)."""
    rows = read_records(spec)
    with_answers = any(answer_field in r for _, r in rows)
    if not with_answers and answer_field != "answer":
        raise UserError(f"{spec}: no record has the answer column `{answer_field}` (grpo.answer_field)")
    out = []
    for k, (where, record) in enumerate(rows, start=1):
        prompt = record.get(prompt_field)
        if isinstance(prompt, list):
            try:
                prompt_messages(prompt)
            except ValueError as e:
                raise UserError(f"{where}: `{prompt_field}`: {e}") from None
        elif not isinstance(prompt, str):
            raise UserError(f"{where}: record {k} has no string `{prompt_field}` column (a prompt is a string "
                            "or a list of messages; set grpo.prompt_field)")
        if with_answers:
            if answer_field not in record:
                raise UserError(f"{where}: missing answer column `{answer_field}` (grpo.answer_field)")
            answer = record[answer_field]
            if isinstance(answer, bool) or not isinstance(answer, (str, int, float, type(None))):
                raise UserError(f"{where}: `{answer_field}` must be a string or a number, got {type(answer).__name__}")
            record = {**record, "answer": answer}
        out.append(record)
    return out


def prompt_records(cfg: GRPOConfig, split: Literal["train", "test"]) -> list[dict[str, Any]]:
    """Prompts with their other columns: the embedded tasks or a prompt file (none for ``test`` when
    ``data.validation`` is ``none``)."""
    spec = cfg.data.train if split == "train" else cfg.data.validation
    if spec == "embedded":  # a subset of the tasks keeps the default per-task share of each split
        share = task_share(split, cfg.tasks.names)
        n = share if split == "train" else min(cfg.tasks.eval_examples, share)
        return [{"prompt": e.prompt, "task": e.task, "answer": e.answer}
                for e in task_examples(split, n, tasks=cfg.tasks.names)]
    if split == "test" and spec in ("", "none"):
        return []
    records = read_prompt_records(spec, cfg.grpo.prompt_field, cfg.grpo.answer_field)
    return records if split == "train" else records[: cfg.tasks.eval_examples]


def run(cfg: GRPOConfig) -> Runtime:
    """Check everything the user can get wrong (batch shape, rewards, prompt data), then train."""
    g = cfg.grpo
    check_batch_shape(cfg, 1)
    rewards = load_rewards(g.rewards, g.rewards_weights, max_new_tokens=g.max_new_tokens,
                           overlong_buffer=g.overlong_buffer)
    data = prompt_records(cfg, "train"), prompt_records(cfg, "test")
    probe_rewards(rewards, data[0][0], g.prompt_field)
    rt = build_runtime(cfg, "grpo")
    try:
        check_batch_shape(cfg, rt.dist.world_size)
        train_set, eval_set = data
        objective = GRPOObjective(eps_low=g.epsilon_low, eps_high=g.epsilon_high, beta=g.beta,
                                  aggregation=g.loss_aggregation, max_new_tokens=g.max_new_tokens,
                                  temperature=g.temperature, chunk_tokens=cfg.training.loss_chunk_tokens,
                                  tis_cap=g.tis_cap)
        evaluate = TaskEval([TaskExample(r.get("task", "file"), r[g.prompt_field], str(r["answer"]))
                             for r in eval_set if r.get("answer") is not None and isinstance(r[g.prompt_field], str)],
                            cfg.tasks.eval_max_new_tokens)
        state = train(rt, RolloutSource(rt, rewards, train_set), objective,
                      with_downstream(evaluate if evaluate else None, cfg))
        record_task_summary(rt, state.step)
    finally:
        rt.metrics.close()
    return rt
