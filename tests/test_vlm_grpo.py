"""GRPO on image prompts: lmforge's engine samples conditioned on the prompt's picture (the same tokens as
``generate --image`` at temperature 0), its behaviour log-probs are the trainer's forwards with the pixels,
``lmforge grpo`` runs on the shapes task's pictures, and what does not take image prompts is one line."""

from __future__ import annotations

import dataclasses
import json
from types import SimpleNamespace

import pytest
import torch

from _helpers import lmforge_in_process, tiny_run_args
from lmforge.data.chat import chat_format_for, stop_token_ids
from lmforge.data.image_tokens import image_encoding_for
from lmforge.data.prompts import read_prompt_records
from lmforge.data.shape_task import shape_examples
from lmforge.errors import UserError
from lmforge.inference import sample_with_images
from lmforge.metrics.records import read_records
from lmforge.models.args import model_args_for
from lmforge.models.spec import spec_for_args
from lmforge.models.tokenizer import ByteTokenizer
from lmforge.rl.engines.lmforge_engine import LmforgeEngine
from lmforge.rl.image_prompts import check_image_prompts, image_prompt
from lmforge.rl.rollout import RolloutSettings, SampledGroups, build_rollout, sample_groups
from lmforge.rl.rewards import load_rewards

pytest.importorskip("transformers")


def _prompts(tmp_path, n: int = 3) -> list[dict]:
    """``n`` pictures of the shapes task as PNG files and a prompt file naming them by relative path."""
    lines = []
    for i, ex in enumerate(shape_examples("train", n)):
        ex.image().save(tmp_path / f"{i}.png")
        lines.append({"prompt": [{"role": "user", "content": [{"type": "image", "path": f"{i}.png"},
                                                             {"type": "text", "text": ex.prompt}]}],
                      "answer": ex.answer})
    (tmp_path / "prompts.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    return lines


def _model():
    tok = ByteTokenizer()
    args = model_args_for("qwen2.5-vl-debug", tok.vocab_size)
    model = spec_for_args(args).build(args)
    model.init_weights(0)
    return tok, args, model.eval()


def _settings(temperature: float, G: int = 2) -> RolloutSettings:
    return RolloutSettings(num_generations=G, max_new_tokens=6, temperature=temperature, top_p=1.0, micro_batch_size=4,
                           advantage_scale="group", mask_truncated=False, need_old_logprobs=True)


def test_greedy_engine_tokens_are_generate_with_image(tmp_path):
    _prompts(tmp_path, 2)
    tok, args, model = _model()
    records = read_prompt_records(str(tmp_path / "prompts.jsonl"))
    chat, enc = chat_format_for(tok), image_encoding_for(args, tok)
    prompts = [image_prompt(r["prompt"], r, enc, chat) for r in records]
    engine = LmforgeEngine(pad_id=tok.pad_id)
    engine.load_weights(model, 0)
    groups = sample_groups(engine, records, [p for p, _ in prompts], load_rewards(["exact_answer"]), _settings(0.0),
                           stop_ids=stop_token_ids(tok), decode=tok.decode, seed_for=lambda _: 0,
                           images=[im for _, im in prompts])
    for i, ex in enumerate(shape_examples("train", 2)):
        want = sample_with_images(model, tok, ex.prompt, [str(tmp_path / f"{i}.png")], max_new_tokens=6)
        assert groups.completions[2 * i] == groups.completions[2 * i + 1] == want
    assert set(groups.total) <= {0.0, 1.0}


def test_behaviour_logprobs_are_the_trainers_with_the_pixels(tmp_path):
    """At temperature 1 the engine's log-probs of its sampled tokens equal the trainer's recomputation (old
    log-probs over the rollout's microbatches) and a forward of each row alone with its own image."""
    _prompts(tmp_path, 2)
    tok, args, model = _model()
    records = read_prompt_records(str(tmp_path / "prompts.jsonl"))
    chat, enc = chat_format_for(tok), image_encoding_for(args, tok)
    prompts = [image_prompt(r["prompt"], r, enc, chat) for r in records]
    engine = LmforgeEngine(pad_id=tok.pad_id)
    engine.load_weights(model, 0)
    s = _settings(1.0, G=3)
    groups = sample_groups(engine, records, [p for p, _ in prompts], load_rewards(["exact_answer"]), s,
                           stop_ids=stop_token_ids(tok), decode=tok.decode, seed_for=lambda _: 5,
                           engine_logprobs=True, images=[im for _, im in prompts])
    saved = SampledGroups(**dataclasses.asdict(groups))  # as a checkpoint's rank state holds rounds sampled ahead
    rollout = build_rollout(model, saved, s, pad_id=tok.pad_id, reference=None,
                            autocast=torch.autocast("cpu", enabled=False))
    old = torch.cat([b.old_logprobs for b in rollout.batches])
    behaviour = torch.cat([b.rollout_logprobs for b in rollout.batches])
    mask = torch.cat([b.mask for b in rollout.batches]) > 0
    assert mask.sum() > 0 and (old - behaviour)[mask].abs().max() < 1e-5
    for r, (c, lps) in enumerate(zip(groups.completion_ids, groups.logprobs)):
        ids, images = prompts[r // 3]
        with torch.no_grad():
            logits = model(torch.tensor([ids + c]), pixel_values=images.pixel_values,
                           image_grid_thw=images.image_grid_thw)
        want = torch.log_softmax(logits[0, len(ids) - 1: len(ids) - 1 + len(c)].float(), -1)
        want = want.gather(1, torch.tensor(c)[:, None])[:, 0]
        assert torch.allclose(torch.tensor(lps), want, atol=1e-5)


def test_grpo_runs_on_image_prompts(tmp_path, monkeypatch):
    """Two steps of ``lmforge grpo`` on four pictures; every forward over image tokens (the engine's
    prefills, the loss's, without and with grad) has the pictures."""
    from lmforge.models.vision.model import VisionLanguageModel

    seen: list[tuple[bool, bool, bool]] = []  # (image tokens in the input, pixels given, grad enabled)
    forward = VisionLanguageModel.forward

    def spy(self, input_ids, *a, **kw):  # noqa: ANN001, ANN202
        seen.append((bool((input_ids == self.args.image_token_id).any()), kw.get("pixel_values") is not None,
                     torch.is_grad_enabled()))
        return forward(self, input_ids, *a, **kw)

    monkeypatch.setattr(VisionLanguageModel, "forward", spy)
    _prompts(tmp_path, 4)
    args = ["grpo", *tiny_run_args("prompts.jsonl", data_seq_len=None, model_size="qwen2.5-vl-debug",
                                   model_n_layers=None, model_dim=None, model_n_heads=None, model_n_kv_heads=None,
                                   model_tokenizer="byte", training_steps=2, training_global_batch_size=4,
                                   schedule_kind="constant", schedule_warmup_steps=0, grpo_num_generations=2,
                                   grpo_max_new_tokens=4),
            "--rewards=exact_answer", "--run.dir=run"]
    assert lmforge_in_process(*args, cwd=tmp_path) == 0
    train = read_records(tmp_path / "run", "train")
    assert [r["step"] for r in train] == [1, 2] and all("reward/mean" in r for r in train)
    with_images = [(pixels, grad) for tokens, pixels, grad in seen if tokens]
    assert with_images and all(pixels for pixels, _ in with_images)
    assert {grad for _, grad in with_images} == {True, False}


def test_what_takes_no_image_prompts_is_one_line(tmp_path):
    records = [{"prompt": _prompts(tmp_path, 1)[0]["prompt"], "answer": "x"}]
    tok = ByteTokenizer()
    vl, text = model_args_for("qwen2.5-vl-debug", tok.vocab_size), model_args_for("debug", tok.vocab_size)
    g = dict(prompt_field="prompt", engine="lmforge", async_steps=0, partial_rollouts=False, environment="",
             router_replay=False)
    assert check_image_prompts(vl, tok, SimpleNamespace(**g), [{"prompt": "text"}]) is None
    assert check_image_prompts(vl, tok, SimpleNamespace(**g), records) is not None
    with pytest.raises(UserError, match="reads text only"):
        check_image_prompts(text, tok, SimpleNamespace(**g), records)
    for bad, match in [(dict(engine="vllm"), "grpo.engine=vllm"), (dict(async_steps=1, partial_rollouts=True),
                       "partial_rollouts"), (dict(environment="m:f"), "environment"),
                       (dict(router_replay=True), "router_replay")]:
        with pytest.raises(UserError, match=match):
            check_image_prompts(vl, tok, SimpleNamespace(**(g | bad)), records)


def test_image_prompts_to_a_text_model_stop_the_run_in_one_line(tmp_path, capfd):
    _prompts(tmp_path, 1)
    args = ["grpo", *tiny_run_args("prompts.jsonl", data_seq_len=None, training_steps=1, training_global_batch_size=2,
                                   grpo_num_generations=2, grpo_max_new_tokens=2), "--rewards=exact_answer",
            "--run.dir=run"]
    assert lmforge_in_process(*args, cwd=tmp_path) == 2
    err = capfd.readouterr().err.strip().splitlines()
    assert err[-1] == ("error: a GRPO prompt has image parts and the model reads text only (train a vision-language "
                       "model: qwen2_5_vl, qwen3_vl, gemma3)")
