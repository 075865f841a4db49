"""A trained reward model as a GRPO reward: ``grpo.rewards = ["rm:PATH"]``.

``PATH`` is an ``lmforge rm`` run or checkpoint, or its ``lmforge export --hf`` directory. Each prompt
and completion is rendered as the reward model was trained to read it: the prompt as chat messages
(a string is one user turn, as GRPO's policy sees it) answered by the completion, with the reward
model's own tokenizer and chat template (:func:`lmforge.data.reward_data.rendered_sequence`); the
reward is the model's score at the last token. So a reward model for GRPO is trained on
conversational preference records.

The model runs without gradients on the trainer's device (the CUDA device the process was bound
to, else the CPU), ``batch_size`` sequences per forward, right-padded: causal attention never lets
a real token see padding. A sequence longer than the model allows keeps its last ``max_seq_len``
tokens (the completion and the end of the prompt).
"""

from __future__ import annotations

from typing import Any

import torch

from lmforge.data.chat import chat_format_for
from lmforge.data.reward_data import rendered_sequence
from lmforge.errors import UserError
from lmforge.models.heads import ScoreHead, head_of
from lmforge.models.load import ModelSource, load_model

PREFIX = "rm:"


def trainer_device() -> torch.device:
    """The CUDA device this process is bound to (``init_distributed`` binds each rank), else the CPU."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


class RewardModelReward:
    """``reward(prompts, completions, **fields) -> scores``: a reward model's score of each completion."""

    def __init__(self, path: str, batch_size: int = 16) -> None:
        self.name = f"{PREFIX}{path}"
        loaded = load_model(ModelSource.at(path))
        if head_of(loaded.model) != "score":
            raise UserError(f"reward `{self.name}`: {path} is not a reward model (no score head); train one with "
                            "`lmforge rm` or export one with `lmforge export --hf`")
        self.model = loaded.model.eval().requires_grad_(False)
        self.tokenizer, self.batch_size = loaded.tokenizer, batch_size
        self.chat = chat_format_for(loaded.tokenizer)

    def __call__(self, prompts: list[Any], completions: list[str], **fields: Any) -> list[float]:
        ids = [rendered_sequence(self.tokenizer, self.chat, p, c) for p, c in zip(prompts, completions)]
        return self.score(ids).tolist()

    @torch.no_grad()
    def score(self, sequences: list[list[int]]) -> torch.Tensor:
        """Scores of token sequences, float32 on the CPU."""
        device = trainer_device()
        if next(self.model.parameters()).device != device:
            self.model.to(device)
        limit = self.model.args.max_seq_len
        out = []
        for lo in range(0, len(sequences), self.batch_size):
            rows = [s[-limit:] for s in sequences[lo:lo + self.batch_size]]
            T = max(len(r) for r in rows)
            ids = torch.full((len(rows), T), self.tokenizer.pad_id, dtype=torch.long)
            for i, r in enumerate(rows):
                ids[i, :len(r)] = torch.tensor(r, dtype=torch.long)
            ends = torch.tensor([i * T + len(r) - 1 for i, r in enumerate(rows)], device=device)
            out.append(self.model(ids.to(device), head=ScoreHead(self.model.score, ends)).cpu())
        return torch.cat(out) if out else torch.zeros(0)
