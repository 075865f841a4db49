"""The built-in engine: lmforge's KV-cache decoder (:func:`lmforge.models.generate.generate`).

Two ways to hold the weights:

* **live** (``copy_weights=False``, synchronous GRPO): the engine samples from the trainer's own model
  (under FSDP2 the caller gathers it with :func:`lmforge.distributed.full_parameters`); weight sync is
  free, since there is nothing to copy.
* **snapshot** (``copy_weights=True``, asynchronous GRPO): the engine keeps its own full copy, so the
  trainer can update its parameters while a rollout is being sampled from older ones; ``load_weights``
  copies the current ones in. A policy with LoRA adapters has a frozen base that never changes after the
  first copy: later loads copy only the tensors that can change (the adapters, and buffers such as a
  router's correction bias), which the copy's own adapter layers then apply live, unmerged.
  ``sync_bytes`` counts what the last load copied.

Log-probs of the sampled tokens (``SamplingSettings`` asks with ``logprobs=True``) come from one
teacher-forced pass over prompt + completion in the engine's precision, the same numbers the decoder
sampled from up to kernel differences (the decoder itself does not keep them). With ``record_routes``
(``grpo.router_replay``, a mixture-of-experts policy) that pass also records the experts every MoE layer
sent each token to (:func:`lmforge.models.layers.routing_replay.recorded_routes`): the routing the
behaviour log-probs were computed with, which the trainer's forwards then replay.

Prompts with images (``images``, one :class:`lmforge.rl.image_prompts.PromptImages` per row) are sampled
one row at a time by the vision-language decoder (:func:`lmforge.models.vision.generate.generate_with_images`:
the prefill runs the tower, later tokens continue the multimodal positions), all rows of a call drawing
from the call's one seeded generator; their log-probs come from the teacher-forced pass with the pixels.
"""

from __future__ import annotations

import copy
import time
from contextlib import nullcontext
from typing import Any, Sequence

import torch
from torch import nn

from lmforge.models.generate import generate
from lmforge.models.vision.generate import generate_with_images
from lmforge.rl.engines.base import Completion, SamplingSettings
from lmforge.rl.image_prompts import PromptImages, attach_images


class LmforgeEngine:
    name = "lmforge"

    def __init__(self, *, pad_id: int, autocast: Any = None, lockstep: bool = False, copy_weights: bool = False,
                 chunk_tokens: int = 1024, record_routes: bool = False) -> None:
        self.pad_id, self.autocast, self.lockstep = pad_id, autocast, lockstep
        self.record_routes = record_routes
        self.copy_weights, self.chunk_tokens = copy_weights, chunk_tokens
        self.model: nn.Module | None = None
        self.version = -1
        self.sync_seconds = 0.0
        self.sync_bytes = 0
        """Bytes the last ``load_weights`` copied (0 for live weights)."""
        self.changing: list[str] | None = None
        """The state-dict entries a load copies after the first (None: all of them)."""

    def load_weights(self, model: nn.Module, version: int) -> None:
        t0 = time.perf_counter()
        if not self.copy_weights:
            self.model = model
        elif self.model is None:
            self.model = copy.deepcopy(model).requires_grad_(False)
            self.changing = changing_tensors(model)
            self.sync_bytes = sum(_nbytes(t) for t in self.model.state_dict().values())
        else:
            mine, theirs = self.model.state_dict(), model.state_dict()
            names = self.changing if self.changing is not None else list(theirs)
            with torch.no_grad():
                for name in names:
                    mine[name].copy_(theirs[name])
            self.sync_bytes = sum(_nbytes(theirs[n]) for n in names)
        self.version = version
        self.sync_seconds = time.perf_counter() - t0

    def generate(self, prompts: Sequence[list[int]], sampling: SamplingSettings, *, seed: int,
                 logprobs: bool = False, images: Sequence[PromptImages | None] | None = None) -> list[Completion]:
        """``images``: each row's prompt images (a vision-language policy), or None for text prompts."""
        if self.model is None:
            raise RuntimeError("LmforgeEngine.generate before load_weights")
        device = next(self.model.parameters()).device
        generator = torch.Generator(device=device).manual_seed(seed)
        with self.autocast if self.autocast is not None else nullcontext():
            if images is not None:
                ids = [self._one_with_images(p, im, sampling, generator) for p, im in zip(prompts, images)]
            else:
                ids = generate(self.model, [list(p) for p in prompts], sampling.max_new_tokens,
                               stop_ids=list(sampling.stop_ids), pad_id=self.pad_id, temperature=sampling.temperature,
                               top_p=sampling.top_p, generator=generator, lockstep=self.lockstep)
            if logprobs or self.record_routes:
                lps, routes = self.teacher_forced(prompts, ids, sampling.temperature, images)
            else:
                lps, routes = [None] * len(ids), [None] * len(ids)
        return [Completion(c, lp if logprobs else None, r) for c, lp, r in zip(ids, lps, routes)]

    def _one_with_images(self, prompt: list[int], images: PromptImages | None, sampling: SamplingSettings,
                         generator: torch.Generator) -> list[int]:
        """One row's completion: the vision-language decoder with its images, or the text decoder without."""
        if images is None:
            return generate(self.model, [list(prompt)], sampling.max_new_tokens, stop_ids=list(sampling.stop_ids),
                            pad_id=self.pad_id, temperature=sampling.temperature, top_p=sampling.top_p,
                            generator=generator)[0]
        return generate_with_images(self.model, prompt, images.pixel_values, images.image_grid_thw,
                                    sampling.max_new_tokens, list(sampling.stop_ids), sampling.temperature,
                                    sampling.top_p, generator)

    def sampled_logprobs(self, prompts: Sequence[list[int]], completions: list[list[int]],
                         temperature: float) -> list[list[float]]:
        """log p of each completion token under softmax(logits / temperature), teacher-forced."""
        return self.teacher_forced(prompts, completions, temperature)[0]

    @torch.no_grad()
    def teacher_forced(self, prompts: Sequence[list[int]], completions: list[list[int]], temperature: float,
                       images: Sequence[PromptImages | None] | None = None) -> tuple[list[list[float]], list[Any]]:
        """log p of each completion token under softmax(logits / temperature), teacher-forced, and with
        ``record_routes`` each row's experts per MoE layer and input token (else None per row)."""
        from lmforge.models.layers.routing_replay import recorded_routes
        from lmforge.objectives.grpo import policy_rows, token_logprobs

        device = next(self.model.parameters()).device
        out: list[list[float]] = []
        routes: list[Any] = []
        for lo in range(0, len(prompts), 16):
            p, c = [list(x) for x in prompts[lo:lo + 16]], completions[lo:lo + 16]
            if all(len(x) == 0 for x in c) and not self.record_routes:
                out += [[] for _ in c]
                routes += [None] * len(c)
                continue
            batch = policy_rows(p, c, [True] * len(c), self.pad_id, torch.zeros(len(c)), device)
            if images is not None:
                attach_images(batch, images[lo:lo + 16])
            dense = token_logprobs(self.model, batch, temperature, self.chunk_tokens).float().cpu()
            out += [dense[i, len(pi) - 1: len(pi) - 1 + len(ci)].tolist() for i, (pi, ci) in enumerate(zip(p, c))]
            if self.record_routes:
                rec = recorded_routes(self.model, len(c))
                routes += [rec[:, i, : len(pi) + len(ci) - 1].clone() for i, (pi, ci) in enumerate(zip(p, c))]
            else:
                routes += [None] * len(c)
        return out, routes

    def close(self) -> None:
        self.model = None


def changing_tensors(model: nn.Module) -> list[str] | None:
    """The state-dict names of a LoRA policy that training can change: every entry but its frozen
    parameters (the base weights, which ``requires_grad`` says are frozen); None for a policy without
    adapters (all of them: its parameters may be frozen only for a while)."""
    from lmforge.models.lora import has_adapters

    if not has_adapters(model):
        return None
    frozen = {id(p) for p in model.parameters() if not p.requires_grad}
    return [name for name, t in model.state_dict(keep_vars=True).items() if id(t) not in frozen]


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()
