"""What the ``[sft]`` keys mean and a run's SFT train/validation sets, for every recipe that trains on
SFT records (supervised fine-tuning, and distillation on the same records and loss masks).

The section and the dataset builder live here, below the recipes, so that no recipe imports another.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Literal

from pydantic import Field

from lmforge.config import Section
from lmforge.data.inputs import DataSpec, train_and_validation
from lmforge.data.tasks import task_examples, task_share

if TYPE_CHECKING:  # the section is read by recipe configs, which load without torch
    from lmforge.data.chat import ChatFormat
    from lmforge.data.image_tokens import ImageEncoding
    from lmforge.data.sft_data import DataSummary, SFTDataset
    from lmforge.data.sources import Record
    from lmforge.models.tokenizer import Tokenizer


class SFTSection(Section):
    loss_on: Literal["assistant", "all"] = "assistant"
    """``assistant``: loss on assistant turns / completions only; ``all``: on every token."""
    packing: bool = True
    """Pack several examples per sequence (isolated by document masks); false: one padded example each."""
    chat_template: str | None = None
    """A jinja file to use instead of the tokenizer's own chat template."""
    max_image_pixels: int = Field(4096 * 4096, gt=0)
    """Records with an image of more pixels are skipped (and counted in the data summary)."""


def _records(spec: DataSpec, split: str, cfg: Any) -> tuple[list[Record], str]:
    from lmforge.data.sft_data import read_sft_records, task_records

    if spec.kind == "embedded" and cfg.tasks.images:
        from lmforge.data.shape_task import shape_examples, shape_records

        n = (cfg.tasks.train_examples or None) if split == "train" else None
        return shape_records(shape_examples(split, n), split), f"embedded shapes ({split})"
    if spec.kind == "embedded":
        # a subset of the tasks keeps each task's default share of each split, as GRPO's prompts do
        share = task_share(split, cfg.tasks.names)
        n = (cfg.tasks.train_examples or share) if split == "train" else share
        return task_records(task_examples(split, n, cfg.tasks.names), split), f"embedded tasks ({split})"
    return read_sft_records(spec.value, cfg.data.format), spec.value


def sft_datasets(cfg: Any, tokenizer: Tokenizer, chat: ChatFormat | None,
                 report: Callable[[str, DataSummary], None],
                 images: ImageEncoding | None = None) -> tuple[SFTDataset, SFTDataset | None]:
    """Train and validation sets of a config with ``data``, ``sft`` and ``tasks`` sections; each
    summary (counts of skipped/truncated examples) goes to ``report(split, summary)``. ``images``: the
    model's image encoding, for a vision-language model."""
    from lmforge.data.sft_data import build_sft_dataset

    d, s = cfg.data, cfg.sft

    def build(spec: DataSpec, split: str) -> SFTDataset:
        records, source = _records(spec, split, cfg)
        dataset, summary = build_sft_dataset(records, source, tokenizer, chat, seq_len=d.seq_len,
                                             loss_on=s.loss_on, overlong=d.overlong, packing=s.packing,
                                             images=images)
        report(split, summary)
        return dataset

    return train_and_validation(d, build, validation_split="test")
