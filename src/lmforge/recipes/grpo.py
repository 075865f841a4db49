"""GRPO: reinforcement learning with verifiable rewards on prompts (the embedded tasks by default, or
prompt records of ``.jsonl``/``.parquet`` files: :mod:`lmforge.data.prompts`).

What differs from the other recipes is the step source, :class:`lmforge.rl.rollout_source.RolloutSource`
(a rollout of ``grpo.num_generations`` completions per prompt, scored by the reward functions, reused
for ``grpo.num_iterations`` updates), and the objective, :class:`lmforge.objectives.grpo.GRPOObjective`.
``training.steps`` counts optimizer updates and ``training.global_batch_size`` counts completions
(prompts per rollout x num_generations).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from pydantic import Field, field_validator, model_validator

from lmforge.config import (
    Config,
    StartEvalSection,
    TasksSection,
    comma_separated,
)
from lmforge.data.inputs import train_spec
from lmforge.errors import UserError
from lmforge.objectives.policy_losses import PolicyLoss, check_policy_loss
from lmforge.recipes.base import Recipe, register
from lmforge.rl.engines.settings import EngineKeys
from lmforge.rl.judge import DEFAULT_RUBRIC

if TYPE_CHECKING:  # recipe modules import no torch until a run starts (lmforge --help stays fast)
    from lmforge.objectives.grpo import GRPOObjective
    from lmforge.rl.rewards import WeightedReward
    from lmforge.runtime import RecipeServices, Runtime
    from lmforge.training.loop import Job


class GRPOSection(EngineKeys):
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
    epsilon_low: float = Field(0.2, ge=0, le=1)
    """Clip range [1 - epsilon_low, 1 + epsilon_high] of the importance ratio (per token; per completion
    for gspo; of the IS weight for cispo); 1 puts no lower bound."""
    epsilon_high: float = Field(0.2, ge=0)
    policy_loss: PolicyLoss = "ppo"
    """The policy term (formulas: :mod:`lmforge.objectives.policy_losses`):

    * ``ppo``: the token-level clipped surrogate of PPO/GRPO/DAPO; a token whose ratio pi/pi_old left
      the clip range in the direction its advantage pushes gets no gradient.
    * ``gspo``: Group Sequence Policy Optimization, one length-normalized importance ratio per completion
      (the geometric mean of its token ratios), clipped as a whole, so one noisy token cannot drop or
      inflate a completion's update (the paper reports steadier training, notably of MoE models). Needs
      ``loss_aggregation = "grpo"`` (a mean over completions). Its ratio stays much closer to 1 than a
      token's: the paper clips at 3e-4 / 4e-4 (``epsilon_low`` / ``epsilon_high``); at the token-level 0.2
      far fewer completions are clipped than tokens would be.
    * ``cispo``: MiniMax-M1's clipped IS-weight policy optimization: -sg(clip(ratio)) * A * log pi per token,
      the clip bounds the weight and never drops a token's gradient (rare "fork" tokens keep learning).
      MiniMax sets no lower bound (``epsilon_low = 1``), tunes ``epsilon_high`` only, and averages over
      all tokens (``loss_aggregation = "dapo"``). TRL caps the weight at its ``epsilon_high`` itself
      (5.0 recommended) with no lower bound: ``epsilon_low = 1``, ``epsilon_high = 4`` here.
    """
    beta: float = Field(0.0, ge=0)
    """KL penalty weight (k3 estimator) to the frozen starting model; 0 loads no reference model."""
    scale_rewards: Literal["group", "batch", "none"] = "group"
    advantage_std: Literal["population", "sample"] = "population"
    """The reward standard deviation that ``scale_rewards`` divides by: population (over G) or sample
    (over G - 1, Bessel's correction: TRL's and verl's, larger by sqrt(G / (G - 1))). The GRPO paper
    does not say which; docs/parity.md."""
    loss_aggregation: Literal["grpo", "dapo", "dr_grpo"] = "grpo"
    mask_truncated: bool = False
    """Leave completions cut off at max_new_tokens out of the loss."""
    rewards: list[str] = ["exact_answer", "format"]
    """Built-in reward names, ``rm:PATH``, ``judge:URL`` (an LLM judge; the ``judge_*`` keys) or ``module:function``."""
    judge_model: str = "judge"
    """The model name sent to a ``judge:URL`` endpoint."""
    judge_rubric: str = DEFAULT_RUBRIC
    """The judge's prompt, or a file holding it: a template of ``{prompt}``, ``{completion}`` and ``{answer}``
    asking for a last line ``SCORE: <number>``."""
    judge_max_score: float = Field(10.0, gt=0)
    """The rubric's top score: the judge's score divided by it (and clipped to [0, 1]) is the reward."""
    judge_timeout_s: float = Field(30.0, gt=0)
    """Seconds one judge request may take."""
    judge_retries: int = Field(2, ge=0)
    """Further attempts after a failed request (timeouts, connection errors, 429, 5xx)."""
    judge_max_failed: float = Field(0.5, ge=0, le=1)
    """The share of a batch's completions the judge may fail to score before the run stops."""
    judge_concurrency: int = Field(8, ge=1)
    """Requests to the judge in flight at once."""
    judge_api_key_env: str = ""
    """The environment variable holding the judge endpoint's API key (empty: none sent)."""
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

    @model_validator(mode="after")
    def _keys_agree(self) -> "GRPOSection":
        check_policy_loss(self.policy_loss, self.loss_aggregation)
        if self.async_steps and self.dynamic_sampling:
            raise ValueError("grpo.async_steps with grpo.dynamic_sampling is not supported: dynamic sampling "
                             "decides on all ranks together between sampling rounds")
        return self

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


def check_expert_parallel_engine(cfg: GRPOConfig) -> None:
    """``parallel.ep`` only with lmforge's engine sampling from the live policy: its expert-parallel modules,
    every rank decoding in lockstep (the MoE layers' all-to-alls are collectives). No other engine has run
    with the experts split over ranks, and sampling ahead (``async_steps``) needs whole weights per rank."""
    from lmforge.rl.engines.kinds import engine_kind

    ep, g = cfg.parallel.ep, cfg.grpo
    if ep > 1 and not engine_kind(g.engine).live_weights:
        raise UserError(f"parallel.ep={ep} with grpo.engine={g.engine} is not supported: under expert parallelism "
                        "GRPO samples from the live policy's own modules (grpo.engine=lmforge)")
    if ep > 1 and g.async_steps:
        raise UserError(f"parallel.ep={ep} with grpo.async_steps is not supported: lmforge's engine samples ahead "
                        "from a whole copy of the weights on every rank, and expert parallelism splits the experts")


@dataclass
class GRPOInputs:
    rewards: list[WeightedReward]
    train: list[dict[str, Any]]
    eval: list[dict[str, Any]]


@register
class GRPO(Recipe):
    name = "grpo"
    config = GRPOConfig
    summary = "GRPO/DAPO reinforcement learning with verifiable rewards"
    expert_parallel = True

    def check(self, cfg: GRPOConfig) -> GRPOInputs:
        """Everything the user can get wrong (batch shape, rewards, prompt data), before any work."""
        from lmforge.data.prompts import prompt_records
        from lmforge.rl.engines.preflight import check_engine_settings
        from lmforge.rl.episode_groups import environment_class
        from lmforge.rl.judge import JudgeSettings
        from lmforge.rl.rewards import load_rewards, probe_rewards

        g = cfg.grpo
        check_batch_shape(cfg, 1)
        check_expert_parallel_engine(cfg)
        named = not g.environment or "rewards" in g.model_fields_set  # an environment brings its own reward
        judge = JudgeSettings(g.judge_model, g.judge_rubric, g.judge_timeout_s, g.judge_retries, g.judge_max_score,
                              g.judge_max_failed, g.judge_concurrency, g.judge_api_key_env)
        rewards = load_rewards(g.rewards, g.rewards_weights, max_new_tokens=g.max_new_tokens,
                               overlong_buffer=g.overlong_buffer, judge=judge) if named else []
        env_cls = environment_class(g.environment) if g.environment else None
        own = getattr(env_cls, "embedded_records", None)
        if own is not None and train_spec(cfg.data).kind == "embedded":  # the environment's own task
            train, test = own("train"), own("test")[: cfg.tasks.eval_examples]
        else:
            train, test = (prompt_records(cfg.data, cfg.tasks, split, g.prompt_field, g.answer_field)
                           for split in ("train", "test"))
        check = getattr(env_cls, "check_records", None)
        if callable(check):  # an environment that reads columns of its own
            check(train)
        if rewards:
            probe_rewards(rewards, train[0], g.prompt_field)
        check_engine_settings(g)  # last: it may ask a server or an interpreter, once everything else holds
        return GRPOInputs(rewards, train, test)

    def services(self, cfg: GRPOConfig, inputs: GRPOInputs) -> "RecipeServices":
        """The setup line's ``lora_sync`` entry (a LoRA policy sampled by vLLM): adapters only, or merged
        full weights and why (:mod:`lmforge.rl.engines.lora_sync`)."""
        from lmforge.rl.engines.lora_sync import adapter_sync_plan
        from lmforge.runtime import RecipeServices

        def notes(args: Any) -> dict[str, str]:
            note = adapter_sync_plan(cfg.lora, cfg.grpo, args)[1]
            return {"lora_sync": note} if note else {}

        return RecipeServices(setup_notes=notes)

    @staticmethod
    def objective(cfg: GRPOConfig) -> GRPOObjective:
        """The run's objective from its config alone (what tests check each key against)."""
        from lmforge.objectives.grpo import GRPOObjective

        g = cfg.grpo
        return GRPOObjective(eps_low=g.epsilon_low, eps_high=g.epsilon_high, beta=g.beta,
                             aggregation=g.loss_aggregation, max_new_tokens=g.max_new_tokens,
                             temperature=g.temperature, chunk_tokens=cfg.training.loss_chunk_tokens,
                             tis_cap=g.tis_cap, policy_loss=g.policy_loss)

    def build(self, rt: Runtime, cfg: GRPOConfig, inputs: GRPOInputs) -> Job:
        from lmforge.data.tasks import TaskExample
        from lmforge.evaluation.tasks import TaskEval
        from lmforge.rl.rollout_source import RolloutSource
        from lmforge.training.loop import Job

        g = cfg.grpo
        check_batch_shape(cfg, rt.world.dist.batch_shares)
        objective = self.objective(cfg)
        tasks = TaskEval([TaskExample(r.get("task", "file"), r[g.prompt_field], str(r["answer"]))
                          for r in inputs.eval if r.get("answer") is not None and isinstance(r[g.prompt_field], str)],
                         cfg.tasks.eval_max_new_tokens)
        return Job(RolloutSource(rt, g, inputs.rewards, inputs.train), objective, tasks if tasks else None)
