"""GRPO's step source: rollouts buffered for ``num_iterations`` updates each.

Rollouts are a data concern (as in TRL, where input preparation generates and buffers completions):
the first step of every ``num_iterations`` samples a new rollout from the current policy; the steps
in between train on the same rollout again. The shared loop never knows the difference, and rollout
time is its own goodput category (``rollout``), excluded from the step's seconds.

On several ranks each rank samples its share of the prompts from the whole policy: under FSDP2 the
parameters are gathered once per sampling round (:func:`lmforge.distributed.full_parameters`), and
ranks decode in lockstep. With ``grpo.dynamic_sampling`` (DAPO) groups whose rewards are all equal
are dropped and more prompts drawn, round after round, until every rank's share of the batch is full
or ``grpo.max_sampling_rounds`` is reached (the rest is then filled with dropped groups).

Checkpointed state: prompts consumed and the reference model's source. Sampling is seeded by the
prompt position, so a resumed run draws the same completions and scores KL against the same reference.
"""

from __future__ import annotations

import dataclasses
import math
import time
from contextlib import contextmanager, nullcontext
from functools import partial
from typing import Any, Iterator

import torch
from torch import nn

from lmforge import distributed as dist_utils
from lmforge.data.chat import ChatFormat, chat_format_for, stop_token_ids
from lmforge.data.record_formats import prompt_messages
from lmforge.config import ParallelSection
from lmforge.errors import UserError
from lmforge.models.layers.routing_replay import has_moe_layers
from lmforge.models.tokenizer import Tokenizer
from lmforge.objectives.grpo import PolicyBatch
from lmforge.rl.engines.base import RolloutEngine, SamplingSettings
from lmforge.rl.engines.factory import engine_kind, make_engine, rollout_dtype
from lmforge.rl.engines.lmforge_engine import LmforgeEngine
from lmforge.rl.episode_groups import load_environment, sample_episode_groups
from lmforge.rl.image_prompts import check_image_prompts, image_prompt, is_image_prompt
from lmforge.rl.rewards import WeightedReward
from lmforge.rl.partial_rollouts import PartialRolloutQueue, PartialRound, advance_round, finish_round, mask_stale_tokens
from lmforge.rl.rollout_queue import RolloutQueue
from lmforge.rl.rollout import (
    AllTruncatedWarning, PromptSampler, Rollout, RolloutSettings, SampledGroups, build_rollout, sample_groups,
)
from lmforge.training.loop import StepBatch
from lmforge.objectives.reference import FrozenReference
from lmforge.runtime import Runtime


def rollout_settings(g: Any, t: Any) -> RolloutSettings:
    """The rollout's settings from the ``[grpo]`` section ``g`` and the ``[training]`` section ``t``."""
    return RolloutSettings(g.num_generations, g.max_new_tokens, g.temperature, g.top_p, t.micro_batch_size,
                           g.scale_rewards, g.mask_truncated, need_old_logprobs=g.num_iterations > 1,
                           chunk_tokens=t.loss_chunk_tokens, prompts_per_generation=g.prompts_per_generation,
                           need_rollout_logprobs=g.tis_cap > 0, advantage_std=g.advantage_std)


class RolloutSource:
    """``g`` is the ``[grpo]`` section; ``rewards`` the loaded reward functions; ``prompts`` the
    training prompt records (:mod:`lmforge.data.prompts`)."""

    def __init__(self, rt: Runtime, g: Any, rewards: list[WeightedReward], prompts: list[dict[str, Any]]) -> None:
        t = rt.cfg.training
        self.rt, self.g, self.rewards, self.prompts = rt, g, rewards, prompts
        self.sampler = PromptSampler(len(prompts), t.global_batch_size // g.num_generations, rt.world.dist.batch_share,
                                     rt.world.dist.batch_shares, t.seed)
        self.settings = rollout_settings(g, t)
        self.chat = chat_format_for(rt.model.tokenizer)  # built once: a Jinja template compiles slowly
        self.stop_ids = stop_token_ids(rt.model.tokenizer)
        names = [rt.model.tokenizer.decode([i], skip_special=False) for i in self.stop_ids]
        self.truncation_warning = AllTruncatedWarning(names, g.max_new_tokens, g.mask_truncated)
        self.reference = FrozenReference.for_run(rt) if g.beta > 0 else None
        """The frozen KL reference (only with beta > 0)."""
        self.environment = (load_environment(g.environment, self.chat, max_turns=g.max_turns, prompt_field=g.prompt_field,
                                             answer_field=g.answer_field) if g.environment else None)
        self.engine: RolloutEngine | None = None
        """Built at the first rollout (after a resume has loaded the weights it starts from)."""
        self.partial = g.async_steps > 0 and g.partial_rollouts
        self.queue: RolloutQueue | PartialRolloutQueue | None = (
            PartialRolloutQueue(g.async_steps, self.advance_round, self.finish_round) if self.partial
            else RolloutQueue(g.async_steps) if g.async_steps else None)
        live = engine_kind(g.engine).live_weights
        self.engine_logprobs = not live or self.queue is not None or g.router_replay
        """Keep the sampler's own log-probs: another engine's, older weights', or those of the pass whose
        routing is replayed (the behaviour policy)."""
        if g.router_replay and not has_moe_layers(rt.model.raw):
            raise UserError(f"grpo.router_replay=true: the model ({rt.model.args.hf_model_type or 'llama'}) has no "
                            "mixture-of-experts layers, so there is no routing to replay")
        if g.router_replay:
            check_replay_layout(rt.cfg.parallel)
        self.image_encoding = check_image_prompts(rt.model.args, rt.model.tokenizer, g, prompts)
        """The policy's image encoding when some prompt has images (None: a text run)."""
        if self.queue is not None and live and (_is_fsdp(rt.model.module) or _is_fsdp(rt.model.raw)):
            raise UserError("grpo.async_steps with grpo.engine=lmforge needs whole weights on every rank (one process "
                            "or DDP): under FSDP2 use grpo.engine=vllm")
        self.rollout: Rollout | None = None
        self.uses_left = 0
        """Updates still to be trained on the current rollout (saved with it when > 0)."""
        if self.queue is not None and not g.tis_cap:
            rt.metrics.record_event("async_without_tis", 0, "warning: grpo.async_steps samples from weights up to "
                                    f"{g.async_steps * g.num_iterations} optimizer steps old and grpo.tis_cap=0 "
                                    "leaves that uncorrected; "
                                    "grpo.tis_cap=2 weights each token by pi_old / pi_sampler")
        if g.top_p < 1:
            rt.metrics.record_event("top_p", 0, f"warning: grpo.top_p={g.top_p} samples from the nucleus, but the "
                                    "ratio, the KL and the entropy use the whole distribution at grpo.temperature")

    def next_step(self, step: int) -> StepBatch:
        if self.rollout is None or self.uses_left == 0:
            with self.rt.metrics.timed("rollout"):
                self.rollout = self.sample(version=step - 1)
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
        return self.rt.model.training_flops(lengths)

    def sample(self, version: int) -> Rollout:
        """This rank's share of the next rollout, for the update after ``version`` optimizer steps: one
        sampling round (taken from the queue when sampling runs ahead), or with dynamic sampling as many
        as it takes (at most ``max_sampling_rounds``) to fill every rank's share with groups whose
        rewards differ. The decision to draw again is taken on all ranks together."""
        g, rt = self.g, self.rt
        t0 = time.perf_counter()
        if self.engine is None:
            self.engine = make_engine(rt, g, autocast=self.rollout_autocast(), own_copy=self.queue is not None)
        if self.queue is not None:
            batch = self.sample_ahead(version)
            generated = sum(len(c) for c in batch.completion_ids)
            gen_seconds = batch.gen_seconds
            return self.build(batch, version, t0, gen_seconds, {
                "rollout/tokens_per_sec": generated / gen_seconds if gen_seconds > 0 else 0.0})
        share = self.sampler.per_rollout // self.sampler.world
        kept: list[SampledGroups] = []
        dropped: list[SampledGroups] = []
        rounds = n_kept = generated = 0
        gen_seconds = 0.0
        with self.serving(version):
            while True:
                rounds += 1
                groups = self.sample_round(self.sampler.next_positions())
                gen_seconds += groups.gen_seconds
                generated += sum(len(c) for c in groups.completion_ids)
                if not g.dynamic_sampling:
                    kept.append(groups)
                    break
                spread = groups.has_spread()
                kept.append(groups.take([i for i, s in enumerate(spread) if s]))
                dropped.append(groups.take([i for i, s in enumerate(spread) if not s]))
                n_kept += len(kept[-1])
                short = dist_utils.all_reduce_max(float(share - n_kept))
                if short <= 0 or rounds >= g.max_sampling_rounds:
                    break
        batch = SampledGroups.concat(kept, g.num_generations)
        # every generated token counts, those of dropped groups too
        extra: dict[str, float] = {"rollout/tokens_per_sec": generated / gen_seconds if gen_seconds > 0 else 0.0}
        if g.dynamic_sampling:
            reserve = SampledGroups.concat(dropped, g.num_generations)
            fill = max(share - len(batch), 0)  # the cap was reached: top up with groups plain GRPO would use
            batch = SampledGroups.concat([batch.take(range(min(len(batch), share))), reserve.take(range(fill))],
                                         g.num_generations)
            counts = rt.world.dist.reduce.sum(torch.tensor([float(rounds * share), float(len(reserve) - fill)],
                                                           dtype=torch.float64, device=rt.world.dist.device)).tolist()
            extra |= {"grpo/prompts_drawn": counts[0], "grpo/dropped_groups": counts[1], "grpo/sampling_rounds": rounds}
        return self.build(batch, version, t0, gen_seconds, extra)

    def build(self, batch: SampledGroups, version: int, t0: float, gen_seconds: float,
              extra: dict[str, float]) -> Rollout:
        rt, engine = self.rt, self.engine
        assert engine is not None  # its last weight load: ~0 for lmforge's live engine, which loads nothing
        extra = extra | {"rollout/staleness": float(version - batch.version), "rollout/sync_seconds": engine.sync_seconds,
                         "rollout/sync_bytes": float(getattr(engine, "sync_bytes", 0))}
        if self.queue is not None:  # per-token lag, and tokens past grpo.max_staleness out of the loss
            batch, lags = mask_stale_tokens(batch, version, self.g.max_staleness, rt.world.dist.device,
                                            rt.world.dist.reduce)
            extra |= lags
        reference = self.reference.model_for(rt.model.raw) if self.reference is not None else None
        return build_rollout(rt.model.raw, batch, self.settings, pad_id=rt.model.tokenizer.pad_id, reference=reference,
                             autocast=rt.model.autocast(), rollout_autocast=self.rollout_autocast(), gen_seconds=gen_seconds,
                             started=t0, extra_metrics=extra, reduce=rt.world.dist.reduce)

    @contextmanager
    def serving(self, version: int) -> Iterator[None]:
        """The engine holds the weights of ``version`` within: lmforge's live engine samples from the
        trainer's model itself (gathered once under FSDP2), any other engine gets them loaded when
        ``sync_every`` steps have passed since its last load."""
        engine = self.engine
        if isinstance(engine, LmforgeEngine) and not engine.copy_weights:
            with dist_utils.full_parameters(self.rt.model.raw) as policy:
                engine.load_weights(policy, version)
                yield
            return
        self.sync(version)
        yield

    def sync(self, version: int) -> None:
        engine = self.engine
        assert engine is not None
        if engine.version >= 0 and version - engine.version < self.g.sync_every:
            return
        engine.load_weights(self.rt.model.raw, version)

    def sample_ahead(self, version: int) -> SampledGroups:
        """The oldest round in flight; the engine then takes the current weights and the next round is
        queued (the first call fills the queue, ``async_steps`` rounds deep)."""
        assert self.queue is not None
        if isinstance(self.queue, PartialRolloutQueue):
            return self.sample_ahead_partially(version)
        if not len(self.queue):
            self.sync(version)
            for _ in range(self.queue.depth):
                self.queue.submit(partial(self.sample_round, self.sampler.next_positions()))
        batch = self.queue.take()
        self.queue.wait_idle()
        self.sync(version)
        self.queue.submit(partial(self.sample_round, self.sampler.next_positions()))
        return batch

    def sample_ahead_partially(self, version: int) -> SampledGroups:
        """The oldest round in flight (its last segment just run); the engine then takes the current weights,
        a new round joins, and one segment of every round in flight is queued (the first call fills the
        queue: ``async_steps`` rounds at 1, 2, ... segments, all from the starting weights)."""
        q = self.queue
        assert isinstance(q, PartialRolloutQueue)
        if not len(q):
            self.sync(version)
            for _ in range(q.depth):
                q.add(self.new_round(self.sampler.next_positions()))
                q.run()
        batch = q.take()
        self.sync(version)
        q.add(self.new_round(self.sampler.next_positions()))
        q.run()
        return batch

    def new_round(self, positions: list[int]) -> PartialRound:
        records = [self.prompts[self.sampler.index(p)] for p in positions]
        prompt_ids = [prompt_token_ids(self.rt.model.tokenizer, r[self.g.prompt_field], self.chat) for r in records]
        return PartialRound(positions, records, prompt_ids, self.g.num_generations)

    def sampling_settings(self) -> SamplingSettings:
        return SamplingSettings(self.g.max_new_tokens, self.g.temperature, self.g.top_p, tuple(self.stop_ids))

    def advance_round(self, rnd: PartialRound) -> None:
        """One segment of ``rnd`` (on the queue's thread), each call seeded by its first prompt's position."""
        assert self.engine is not None
        seed = self.rt.cfg.training.seed
        per_call = (self.g.prompts_per_generation or len(rnd.prompt_ids)) * self.g.num_generations
        advance_round(self.engine, rnd, self.sampling_settings(), self.g.async_steps, per_call,
                      lambda position, segment: seed * 1_000_003 + 7919 * position + 104_729 * segment + 1)

    def finish_round(self, rnd: PartialRound) -> SampledGroups:
        return finish_round(rnd, self.rewards, self.sampling_settings(), decode=self.rt.model.tokenizer.decode,
                            prompt_field=self.g.prompt_field)

    def rollout_autocast(self) -> Any:
        """The precision sampling runs in: ``grpo.rollout_dtype``, or the training one (``auto``)."""
        if rollout_dtype(self.rt, self.g) == "bfloat16":
            return torch.autocast(self.rt.world.dist.device.type, dtype=torch.bfloat16)
        return nullcontext()

    def sample_round(self, positions: list[int]) -> SampledGroups:
        """G completions for each prompt at ``positions`` of the prompt order, scored (on the main thread,
        or on the queue's when sampling runs ahead)."""
        rt, field, seed = self.rt, self.g.prompt_field, self.rt.cfg.training.seed
        engine = self.engine
        assert engine is not None
        records = [self.prompts[self.sampler.index(p)] for p in positions]

        def seed_for(offset: int) -> int:
            """From the global position of the call's first prompt: the same at any world size."""
            return seed * 1_000_003 + 7919 * positions[offset] + 1

        if self.environment is not None:
            groups = sample_episode_groups(engine, self.environment, records, self.rewards, self.settings,
                                           chat=self.chat, tokenizer=rt.model.tokenizer, stop_ids=self.stop_ids,
                                           seed=seed_for(0), prompt_field=field, engine_logprobs=self.engine_logprobs,
                                           max_total_tokens=self.g.max_total_tokens)
        else:
            prompts = [self.prompt(r) for r in records]
            images = [im for _, im in prompts] if self.image_encoding is not None else None
            groups = sample_groups(engine, records, [ids for ids, _ in prompts], self.rewards, self.settings,
                                   stop_ids=self.stop_ids, decode=rt.model.tokenizer.decode, seed_for=seed_for,
                                   prompt_field=field, engine_logprobs=self.engine_logprobs, images=images)
        groups.version = engine.version
        return groups

    def prompt(self, record: dict[str, Any]) -> tuple[list[int], Any]:
        """A record's prompt ids and its images (:class:`PromptImages`, None for a text prompt)."""
        prompt = record[self.g.prompt_field]
        if self.image_encoding is not None and is_image_prompt(prompt):
            return image_prompt(prompt, record, self.image_encoding, self.chat)
        return prompt_token_ids(self.rt.model.tokenizer, prompt, self.chat), None

    def state_dict(self) -> dict[str, Any]:
        reference = self.reference.state_dict() if self.reference else {"reference": str(self.rt.model.source)}
        return {**self.sampler.state_dict(), **reference}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.sampler.load_state_dict(state)
        if self.reference is not None:  # resumed with another start configured: the recorded one wins
            self.reference.load_state_dict(state)
        self.rollout, self.uses_left = None, 0

    def rank_state(self) -> dict[str, Any]:
        """The rollout still being trained on (``num_iterations > 1``, stopped part-way through it), and
        the rounds sampled ahead (``async_steps``): a resume must train on the same completions, not
        sample new ones from newer weights."""
        q = self.queue
        ahead = ({"partial": q.drain()} if isinstance(q, PartialRolloutQueue)
                 else {"ahead": [dataclasses.asdict(r) for r in q.drain()]} if q is not None else {})
        if self.rollout is None or self.uses_left == 0:
            return ahead
        r = self.rollout
        return ahead | {"uses_left": self.uses_left, "tokens": r.tokens, "metrics": r.metrics, "lengths": r.sequence_lengths,
                "batches": [{k: v for k, v in vars(b).items()} for b in r.batches]}

    def load_rank_state(self, state: dict[str, Any]) -> None:
        if isinstance(self.queue, PartialRolloutQueue) and state.get("partial"):
            self.queue.restore(state["partial"])
        elif isinstance(self.queue, RolloutQueue) and state.get("ahead"):
            self.queue.restore([SampledGroups(**r) for r in state["ahead"]])
        if "batches" not in state:
            return
        device = self.rt.world.dist.device
        batches = [PolicyBatch(**{k: v.to(device) if torch.is_tensor(v) else v for k, v in b.items()})
                   for b in state["batches"]]
        metrics = {k: v.to(device) if torch.is_tensor(v) else v for k, v in state["metrics"].items()}
        self.rollout = Rollout(batches, [], [], [], {}, metrics, tokens=int(state["tokens"]),
                               sequence_lengths=[int(n) for n in state.get("lengths", [])])
        self.uses_left = int(state["uses_left"])

    def close(self) -> None:
        self.rollout = None
        if self.queue is not None:
            self.queue.close()
        if self.engine is not None:
            self.engine.close()
            self.engine = None


def check_replay_layout(p: ParallelSection) -> None:
    """Routing replay hands every MoE layer the routes of whole sequences: a layout whose MoE layers see a
    shard of each sequence (context or pipeline parallel, tensor parallel with sequence parallelism) is
    refused in one line rather than failing on a shape inside the first forward."""
    shards = [f"parallel.{k}={getattr(p, k)}" for k in ("cp", "pp") if getattr(p, k) > 1]
    if p.tp > 1 and p.sequence_parallel:
        shards.append(f"parallel.tp={p.tp} with parallel.sequence_parallel")
    if shards:
        raise UserError(f"grpo.router_replay with {', '.join(shards)} is not supported: the MoE layers see shards "
                        "of each sequence, and the recorded routes are of whole sequences")


def _is_fsdp(model: nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


def prompt_token_ids(tokenizer: Tokenizer, prompt: str | list[dict[str, str]],
                     chat: ChatFormat | None = None) -> list[int]:
    """A prompt (a user message string, or a list of chat messages) in the chat format, ending in the
    generation prompt. ``chat``: the tokenizer's chat format, when the caller has it built already."""
    try:
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt_messages(prompt)
        return (chat or chat_format_for(tokenizer)).prompt_ids(messages)
    except ValueError as e:  # a template's raise_exception
        raise UserError(str(e)) from None


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
