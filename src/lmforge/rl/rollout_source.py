"""GRPO's step source: rollouts buffered for ``num_iterations`` updates each.

Rollouts are a data concern (as in TRL, where input preparation generates and buffers completions):
the first step of every ``num_iterations`` samples a new rollout from the current policy; the steps
in between train on the same rollout again. The shared loop never knows the difference, and rollout
time is its own goodput category (``rollout``), excluded from the step's seconds.

Checkpointed state: prompts consumed, every rank's rollout RNG, and the reference model's source, so
a resumed run draws the same completions and scores KL against the same reference.
"""

from __future__ import annotations

import math
from typing import Any, Callable

import torch
from torch import nn

from lmforge.data.chat import chat_format_for, stop_token_ids
from lmforge.data.record_formats import prompt_messages
from lmforge.errors import UserError
from lmforge.inference import chat_prompt_ids
from lmforge.models.load import ModelSource, load_model
from lmforge.models.lora import BaseModelView, has_adapters
from lmforge.models.tokenizer import Tokenizer
from lmforge.rl.grpo_loss import PolicyBatch
from lmforge.rl.rewards import WeightedReward
from lmforge.rl.rollout import AllTruncatedWarning, PromptSampler, Rollout, RolloutSettings, collect_rollout
from lmforge.training.loop import StepBatch
from lmforge.training.runtime import Runtime


class RolloutSource:
    def __init__(self, rt: Runtime, rewards: list[WeightedReward], prompts: list[dict[str, Any]]) -> None:
        g, t = rt.cfg.grpo, rt.cfg.training
        self.rt, self.g, self.rewards, self.prompts = rt, g, rewards, prompts
        self.sampler = PromptSampler(len(prompts), t.global_batch_size // g.num_generations, rt.dist.rank,
                                     rt.dist.world_size, t.seed)
        self.generator = torch.Generator(device=rt.dist.device)
        self.generator.manual_seed(t.seed * 1_000_003 + 7919 * rt.dist.rank + 1)
        self.settings = RolloutSettings(g.num_generations, g.max_new_tokens, g.temperature, g.top_p,
                                        t.micro_batch_size, g.scale_rewards, g.mask_truncated,
                                        need_old_logprobs=g.num_iterations > 1,
                                        chunk_tokens=t.loss_chunk_tokens)
        self.stop_ids = stop_token_ids(rt.tokenizer)
        names = [rt.tokenizer.decode([i], skip_special=False) for i in self.stop_ids]
        self.truncation_warning = AllTruncatedWarning(names, g.max_new_tokens, g.mask_truncated)
        self.reference_source = rt.model_source
        self.reference = self._load_reference(self.reference_source)
        self.rollout: Rollout | None = None
        self.uses_left = 0
        """Updates still to be trained on the current rollout (saved with it when > 0)."""

    def _load_reference(self, source: ModelSource) -> Callable[..., Any] | None:
        """The frozen KL reference (only with beta > 0): the run's starting weights, loaded afresh, or
        under LoRA the policy itself with its adapters off (its frozen base: no second copy)."""
        if self.g.beta == 0:
            return None
        rt = self.rt
        if has_adapters(rt.raw_model):
            return BaseModelView(rt.raw_model)
        ref = load_model(source, args=rt.model_args, tokenizer=rt.model_description["tokenizer"]).model
        ref = ref.to(rt.dist.device)
        return ref.eval().requires_grad_(False)

    def next_step(self, step: int) -> StepBatch:
        if self.rollout is None or self.uses_left == 0:
            with self.rt.metrics.timed("rollout"):
                self.rollout = self.sample(self.sampler.next_indices())
            self.uses_left = self.g.num_iterations
            warning = self.truncation_warning.check(self.rollout.metrics)
            if warning:
                self.rt.metrics.record_event("all_truncated", step, warning)
            every = self.g.log_completions_every
            if every and (step == 1 or step % every == 0):
                self.rt.metrics.record_text(step, "completions", completions_table(self.rollout, self.g.num_generations))
        r = self.rollout
        self.uses_left -= 1
        return StepBatch(r.batches, tokens=r.tokens, metrics=r.metrics, flops=self.update_flops(r))

    def update_flops(self, r: Rollout) -> float:
        """Training FLOPs of one update pass over rollout ``r``: its rows' real lengths, padding excluded
        (a rollout restored from an older checkpoint without lengths counts its full rows)."""
        lengths = r.sequence_lengths or [n for b in r.batches for n in [b.input_ids.shape[1]] * b.input_ids.shape[0]]
        return self.rt.training_flops(lengths)

    def sample(self, indices: list[int]) -> Rollout:
        """G completions for each of this rank's prompts from the current (unwrapped) policy, scored."""
        rt, field = self.rt, self.g.prompt_field
        records = [self.prompts[i] for i in indices]
        prompt_ids = [prompt_token_ids(rt.tokenizer, r[field]) for r in records]
        return collect_rollout(rt.raw_model, records, prompt_ids, self.rewards, self.settings,
                               stop_ids=self.stop_ids, pad_id=rt.tokenizer.pad_id, decode=rt.tokenizer.decode,
                               generator=self.generator, reference=self.reference, autocast=rt.autocast(),
                               prompt_field=field)

    def state_dict(self) -> dict[str, Any]:
        """Collective (gathers every rank's RNG state): called by the checkpoint save on every rank."""
        return {**self.sampler.state_dict(), "rollout_rng": gather_rng_states(self.generator),
                "reference": str(self.reference_source)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.sampler.load_state_dict(state)
        states = state.get("rollout_rng")
        if states:
            self.generator.set_state(torch.tensor(states[min(self.rt.dist.rank, len(states) - 1)], dtype=torch.uint8))
        saved = ModelSource.parse(state.get("reference", str(self.reference_source)))
        if saved != self.reference_source:  # resumed with another start configured: keep the recorded one
            self.reference_source = saved
            self.reference = self._load_reference(saved)
            if self.reference is not None:
                self.rt.metrics.record_event("reference", 0, f"reference model: {saved} (recorded in the checkpoint)")
        self.rollout, self.uses_left = None, 0

    def rank_state(self) -> dict[str, Any]:
        """The rollout still being trained on (``num_iterations > 1``, stopped part-way through it): a
        resume must train on the same completions, not sample new ones from newer weights."""
        if self.rollout is None or self.uses_left == 0:
            return {}
        r = self.rollout
        return {"uses_left": self.uses_left, "tokens": r.tokens, "metrics": r.metrics, "lengths": r.sequence_lengths,
                "batches": [{k: v for k, v in vars(b).items()} for b in r.batches]}

    def load_rank_state(self, state: dict[str, Any]) -> None:
        if not state:
            return
        device = self.rt.dist.device
        batches = [PolicyBatch(**{k: v.to(device) if torch.is_tensor(v) else v for k, v in b.items()})
                   for b in state["batches"]]
        metrics = {k: v.to(device) if torch.is_tensor(v) else v for k, v in state["metrics"].items()}
        self.rollout = Rollout(batches, [], [], [], {}, metrics, tokens=int(state["tokens"]),
                               sequence_lengths=[int(n) for n in state.get("lengths", [])])
        self.uses_left = int(state["uses_left"])

    def close(self) -> None:
        self.rollout = None


def prompt_token_ids(tokenizer: Tokenizer, prompt: str | list[dict[str, str]]) -> list[int]:
    """A prompt (a user message string, or a list of chat messages) in the chat format, ending in the
    generation prompt."""
    if isinstance(prompt, str):
        return chat_prompt_ids(tokenizer, prompt)
    try:
        return chat_format_for(tokenizer).prompt_ids(prompt_messages(prompt))
    except ValueError as e:  # a template's raise_exception
        raise UserError(str(e)) from None


def gather_rng_states(gen: torch.Generator) -> list[list[int]]:
    """Every rank's rollout-generator state (collective), for the checkpoint's JSON trainer state."""
    state = gen.get_state().tolist()
    if not torch.distributed.is_initialized():
        return [state]
    out: list[Any] = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(out, state)
    return out


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
