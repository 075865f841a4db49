"""Adapter-only weight sync for LoRA RL: lmforge's engine holding its own copy of a LoRA policy
(``grpo.async_steps``) takes only the tensors training can change after the first load, applies them
live (its copy keeps its adapter layers, unmerged), and logs the bytes of every sync."""

from __future__ import annotations

import pytest
import torch

from lmforge.models.model import ModelArgs, Transformer
from lmforge.rl.engines.base import SamplingSettings
from lmforge.rl.engines.lmforge_engine import LmforgeEngine, changing_tensors

pytest.importorskip("peft")

ARGS = ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=256, max_seq_len=64)


def lora_model() -> torch.nn.Module:
    from lmforge.config import LoraSection
    from lmforge.models.lora import apply_lora

    torch.manual_seed(0)
    return apply_lora(Transformer(ARGS), LoraSection(enabled=True, rank=4))


def nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def test_a_lora_policy_syncs_only_its_adapters_and_samples_as_the_policy():
    model = lora_model()
    engine = LmforgeEngine(pad_id=0, copy_weights=True)
    engine.load_weights(model, 0)
    full = nbytes(model.state_dict().values())
    assert engine.sync_bytes == full  # the first load copies everything, the frozen base once
    adapters = [n for n, p in model.named_parameters() if p.requires_grad]
    assert adapters and all("lora_" in n for n in adapters)
    with torch.no_grad():  # an update: only the adapters move
        for n, p in model.named_parameters():
            if p.requires_grad:
                p.add_(0.05 * torch.randn_like(p))
    engine.load_weights(model, 1)
    assert engine.sync_bytes == nbytes(p for p in model.parameters() if p.requires_grad) < full / 10
    mine = engine.model.state_dict()
    assert all(torch.equal(mine[k], v) for k, v in model.state_dict().items())
    prompts = [[5, 6, 7, 8]] * 4
    s = SamplingSettings(8, 1.0)
    live = LmforgeEngine(pad_id=0)
    live.load_weights(model, 1)
    assert [c.token_ids for c in engine.generate(prompts, s, seed=3)] == \
        [c.token_ids for c in live.generate(prompts, s, seed=3)]


def test_without_adapters_every_tensor_is_synced():
    torch.manual_seed(0)
    model = Transformer(ARGS)
    assert changing_tensors(model) is None
    engine = LmforgeEngine(pad_id=0, copy_weights=True)
    engine.load_weights(model, 0)
    engine.load_weights(model, 1)
    assert engine.sync_bytes == nbytes(model.state_dict().values())


def test_async_lora_grpo_logs_adapter_bytes_per_sync(tmp_path):
    """An async GRPO run with LoRA: rollout/sync_bytes is the whole model at the first sync and the
    adapters' bytes after it."""
    from test_grpo import _grpo, tiny_task  # noqa: F401

    (tmp_path / "prompts.jsonl").write_text("".join(f'{{"prompt": "Say something {i}", "id": {i}}}\n' for i in range(8)))
    from test_grpo import TINY_REWARD

    (tmp_path / "tiny_rewards.py").write_text(TINY_REWARD)
    [recs] = _grpo(tmp_path, {"run": dict(training_global_batch_size=8, training_micro_batch_size=8,
                                          grpo_num_generations=4, grpo_max_new_tokens=4, grpo_async_steps=1,
                                          grpo_tis_cap=2.0, training_steps=3, checkpoint_enabled=False,
                                          lora_enabled=True, lora_rank=4, optimizer_lr=1e-2)})
    train = {r["step"]: r for r in recs if r["kind"] == "train"}
    sizes = [train[s]["rollout/sync_bytes"] for s in (1, 2, 3)]
    assert sizes[1] == sizes[2] and 0 < sizes[1] < sizes[0] / 10, sizes


def test_vllm_starts_on_the_unmerged_base_and_adapter_only_sync_falls_back_where_vllm_cannot_serve():
    from types import SimpleNamespace

    from lmforge.config import LoraSection
    from lmforge.models.lora import adapter_weights, base_state
    from lmforge.rl.engines.lora_sync import adapter_sync_plan

    model = lora_model()
    with torch.no_grad():  # trained adapters: a merged base would differ from the plain one
        for a, b in adapter_weights(model).values():
            b.normal_(0, 0.1)
    torch.manual_seed(0)
    plain = Transformer(ARGS).state_dict()
    base = base_state(model)
    assert base.keys() == plain.keys() and all(torch.equal(base[k], v) for k, v in plain.items())

    colocated = SimpleNamespace(engine="vllm", vllm_mode="colocate")
    on = dict(enabled=True, rank=4)
    assert adapter_sync_plan(LoraSection(**on), colocated, ARGS)[0] == 8  # vLLM's smallest max_lora_rank >= 4
    assert adapter_sync_plan(LoraSection(enabled=True, rank=16), colocated, ARGS)[0] == 16
    assert adapter_sync_plan(LoraSection(), colocated, ARGS) == (0, "")
    assert adapter_sync_plan(LoraSection(**on), SimpleNamespace(engine="lmforge", vllm_mode="colocate"), ARGS) == (0, "")
    for lora, g, args, why in [
        (LoraSection(**on, quantize="nf4"), colocated, ARGS, "QLoRA"),
        (LoraSection(**on), SimpleNamespace(engine="vllm", vllm_mode="server"), ARGS, "colocate"),
        (LoraSection(enabled=True, rank=1024), colocated, ARGS, "max_lora_rank"),
        (LoraSection(**on), colocated, ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=256,
                                                 n_experts=4, n_experts_per_token=2), "experts"),
    ]:
        rank, note = adapter_sync_plan(lora, g, args)
        assert rank == 0 and note.startswith("merged full weights") and why in note, note
