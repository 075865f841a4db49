"""Prompt records for RL (GRPO): the embedded tasks, or ``.jsonl``/``.parquet`` files read by the shared
record reader, each prompt a string or a list of chat messages, with the reference answer the rewards
receive as ``answer``."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from lmforge.data.chat import validate_messages
from lmforge.data.image_chat import has_images, record_directory
from lmforge.data.inputs import train_spec, validation_spec
from lmforge.data.record_formats import prompt_messages
from lmforge.data.sources import read_records
from lmforge.data.tasks import task_examples, task_share
from lmforge.errors import UserError


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
                if has_images([m for m in prompt if isinstance(m, dict)]):  # a vision-language prompt
                    record = {**record, prompt_field: _absolute_paths(validate_messages(prompt, images=True), where)}
                else:
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


def prompt_records(data: Any, tasks: Any, split: Literal["train", "test"], prompt_field: str = "prompt",
                   answer_field: str = "answer") -> list[dict[str, Any]]:
    """Prompts with their other columns for ``split``, from ``data.train`` / ``data.validation`` by the
    rule of :mod:`lmforge.data.inputs`: the embedded tasks, a prompt file, or none (``test`` only).
    ``tasks`` is the ``[tasks]`` section (which embedded tasks, how many held-out prompts)."""
    spec = train_spec(data) if split == "train" else validation_spec(data)[0]
    if spec.kind == "none":
        if split == "train":
            raise UserError(f"data.train={data.train!r}: GRPO needs prompts (embedded, or a .jsonl/.parquet file)")
        return []
    if spec.kind == "embedded" and tasks.images:
        raise UserError("tasks.names=[\"shapes\"] is the image task: it trains with `lmforge sft` (GRPO reads image "
                        "prompts from a .jsonl file: docs/vlm.md)")
    if spec.kind == "embedded":  # a subset of the tasks keeps the default per-task share of each split
        share = task_share(split, tasks.names)
        n = share if split == "train" else min(tasks.eval_examples, share)
        return [{"prompt": e.prompt, "task": e.task, "answer": e.answer}
                for e in task_examples(split, n, tasks=tasks.names)]
    records = read_prompt_records(spec.value, prompt_field, answer_field)
    return records if split == "train" else records[: tasks.eval_examples]


def _absolute_paths(messages: list[dict[str, Any]], where: str) -> list[dict[str, Any]]:
    """Image parts' relative ``path`` read against the record's file's directory (as SFT reads them), so the
    prompt can be prepared later without knowing where it came from."""
    base = record_directory(where)
    if base is None:
        return messages
    out = []
    for m in messages:
        content = m["content"]
        if isinstance(content, list):
            content = [{**p, "path": str(base / p["path"])} if isinstance(p, dict) and p.get("type") == "image"
                       and isinstance(p.get("path"), str) and not Path(p["path"]).is_absolute() else p
                       for p in content]
        out.append({**m, "content": content})
    return out
