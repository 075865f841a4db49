"""Qwen2.5-VL against transformers: logits with images in the batch (two images of different sizes, a
text-only row, a right-padded row, a packed row), text-only logits, the vision tower, multimodal positions,
config.json and tensor names both ways, FLOPs, parameter groups and LoRA targets.

Every model is a tiny random fp32 ``Qwen2_5_VLForConditionalGeneration`` built by transformers from a small
config (no hub); the pixels come from transformers' own Qwen2-VL image processor (its PIL backend, built
offline with its defaults) over small random PIL images.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from lmforge.errors import UserError
from lmforge.models.args import ModelArgs, model_args_for
from lmforge.models.hf import hf_state_dict_from_lmforge, lmforge_state_dict_from_hf, load_hf_model, save_hf_model
from lmforge.models.hf_config import args_from_hf_config, hf_config_from_args
from lmforge.models.qwen2_5_vl import QWEN2_5_VL, Qwen2_5_VLArgs, Qwen2_5_VLModel
from lmforge.models.qwen2_5_vl import vision_flops as qwen2_5_vl_flops
from lmforge.models.qwen3_vl import QWEN3_VL, Qwen3VLArgs, Qwen3VLModel
from lmforge.models.qwen3_vl import vision_flops as qwen3_vl_flops
from lmforge.models.spec import lora_targets_for, parameters_of

transformers = pytest.importorskip("transformers")
Image = pytest.importorskip("PIL.Image")

VOCAB, IMAGE, START, END = 300, 290, 292, 293
TOKENS = dict(image_token_id=IMAGE, video_token_id=291, vision_start_token_id=START, vision_end_token_id=END)
TEXT = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=256, rms_norm_eps=1e-6, bos_token_id=None, eos_token_id=None)
VISION = dict(hidden_size=32, intermediate_size=48, num_heads=2, out_hidden_size=64)
FAMILIES = ["qwen2_5_vl", "qwen3_vl"]
PATCH = {"qwen2_5_vl": 14, "qwen3_vl": 16}
SPECS = {"qwen2_5_vl": QWEN2_5_VL, "qwen3_vl": QWEN3_VL}
FLOPS = {"qwen2_5_vl": qwen2_5_vl_flops, "qwen3_vl": qwen3_vl_flops}


def hf_config(family: str = "qwen2_5_vl", **text) -> "transformers.PretrainedConfig":
    if family == "qwen2_5_vl":
        return transformers.Qwen2_5_VLConfig(
            text_config=dict(**TEXT, num_hidden_layers=2, **text,
                             rope_parameters=dict(rope_type="default", rope_theta=1e4, mrope_section=[2, 3, 3])),
            # window_size 56: windows of 2x2 merged tokens, so window and full attention differ on both images
            vision_config=dict(**VISION, depth=3, fullatt_block_indexes=[1], window_size=56), **TOKENS)
    # head_dim 16 (8 frequencies: T H W T H W T T), a 4x4 position table resampled to every image, DeepStack
    # features from tower blocks 0 and 1 into decoder blocks 0 and 1 of 3
    return transformers.Qwen3VLConfig(
        text_config=dict(**TEXT, num_hidden_layers=3, head_dim=16, **text, rope_parameters=dict(
            rope_type="default", rope_theta=1e4, mrope_section=[4, 2, 2], mrope_interleaved=True)),
        vision_config=dict(**VISION, depth=3, patch_size=16, num_position_embeddings=16,
                           deepstack_visual_indexes=[0, 1]), **TOKENS)


def tiny_hf(family: str = "qwen2_5_vl", seed: int = 0, **text) -> "transformers.PreTrainedModel":
    torch.manual_seed(seed)
    cls = {"qwen2_5_vl": transformers.Qwen2_5_VLForConditionalGeneration,
           "qwen3_vl": transformers.Qwen3VLForConditionalGeneration}[family]
    model = cls(hf_config(family, **text)).eval()
    with torch.no_grad():  # non-trivial norms and biases
        for name, p in model.named_parameters():
            if "norm" in name or "ln_q" in name:
                p.normal_(1.0, 0.2)
            elif name.endswith("bias"):
                p.normal_(0.0, 0.1)
    return model


def images(family: str = "qwen2_5_vl") -> dict[str, torch.Tensor]:
    """Two random images of 4x6 and 8x4 patches (6 and 8 image tokens)."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    rng = np.random.default_rng(0)
    p = PATCH[family]
    pics = [Image.fromarray(rng.integers(0, 255, (h * p, w * p, 3), dtype=np.uint8)) for h, w in ((4, 6), (8, 4))]
    out = Qwen2VLImageProcessorPil(patch_size=p)(images=pics, return_tensors="pt")
    return {"pixel_values": out["pixel_values"], "image_grid_thw": out["image_grid_thw"]}


def text(n: int, seed: int) -> list[int]:
    return torch.randint(1, 280, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def with_image(tokens_per_image: int) -> list[int]:
    return [START] + [IMAGE] * tokens_per_image + [END]


def batch(grid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows: [text, image 0, text, image 1, text] / text only / right-padded text; (ids, attention mask)."""
    n0, n1 = (int(g.prod()) // 4 for g in grid)
    rows = [text(3, 1) + with_image(n0) + text(4, 2) + with_image(n1) + text(5, 3), text(20, 4), text(12, 5)]
    T = max(len(r) for r in rows)
    ids = torch.zeros(len(rows), T, dtype=torch.long)
    mask = torch.zeros(len(rows), T, dtype=torch.long)
    for b, r in enumerate(rows):
        ids[b, :len(r)] = torch.tensor(r)
        mask[b, :len(r)] = 1
    return ids, mask


@pytest.fixture(scope="module", params=FAMILIES)
def pair(request, tmp_path_factory):
    """(transformers model, its directory, lmforge's model loaded from it); ``pair.family`` names the family."""
    hf = tiny_hf(request.param)
    path = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(path)
    return Pair(hf, path, load_hf_model(path).eval(), request.param)


class Pair(tuple):
    def __new__(cls, hf, path, model, family):
        pair = super().__new__(cls, (hf, path, model))
        pair.family = family
        return pair


def hf_logits(hf, ids, mask, pix=None) -> torch.Tensor:
    kwargs = {} if pix is None else {**pix, "mm_token_type_ids": (ids == IMAGE).int()}
    with torch.no_grad():
        return hf(input_ids=ids, attention_mask=mask, **kwargs).logits


def test_loads_as_the_family(pair):
    _, path, model = pair
    assert model.args.mrope_section == ([2, 3, 3] if pair.family == "qwen2_5_vl" else [4, 2, 2])
    if pair.family == "qwen2_5_vl":
        assert isinstance(model, Qwen2_5_VLModel) and isinstance(model.args, Qwen2_5_VLArgs)
        assert model.args.vision_full_attention_layers == [1] and model.args.window_tokens == 2
    else:
        assert isinstance(model, Qwen3VLModel) and isinstance(model.args, Qwen3VLArgs)
        assert model.args.deepstack_layers == [0, 1] and model.args.head_dim == 16


def test_logits_with_images_equal_transformers(pair):
    hf, _, model = pair
    pix = images(pair.family)
    assert pix["image_grid_thw"].tolist() == [[1, 4, 6], [1, 8, 4]]
    ids, mask = batch(pix["image_grid_thw"])
    ref = hf_logits(hf, ids, mask, pix)
    with torch.no_grad():
        got = model(ids, **pix)
    real = mask.bool()
    diff = (got - ref)[real].abs().max().item()
    assert diff < 1e-5, diff
    # the images matter: without them (their tokens embedded as text) the first row changes
    with torch.no_grad():
        plain = model(ids)
    assert (plain[0] - ref[0]).abs().max() > 1e-2


def test_text_only_logits_equal_transformers(pair):
    hf, _, model = pair
    ids = torch.tensor([text(24, 7), text(24, 8)])
    with torch.no_grad():
        got = model(ids)
    assert (got - hf_logits(hf, ids, torch.ones_like(ids))).abs().max() < 1e-5


def test_vision_tower_equals_transformers(pair):
    hf, _, model = pair
    pix = images(pair.family)
    with torch.no_grad():
        ref = hf.model.visual(pix["pixel_values"], grid_thw=pix["image_grid_thw"])
        got, deepstack = model.visual(pix["pixel_values"], pix["image_grid_thw"])
    assert got.shape == (14, 64)
    assert (got - ref.pooler_output).abs().max() < 1e-5
    refs = getattr(ref, "deepstack_features", None) or []
    assert len(deepstack) == len(refs) == (2 if pair.family == "qwen3_vl" else 0)
    assert all((a - b).abs().max() < 1e-5 for a, b in zip(deepstack, refs))


def test_positions_equal_get_rope_index(pair):
    hf, _, model = pair
    pix = images(pair.family)
    ids, mask = batch(pix["image_grid_thw"])
    ref, _ = hf.model.get_rope_index(ids, (ids == IMAGE).int(), pix["image_grid_thw"], attention_mask=mask)
    got = model.position_ids(ids, pix["image_grid_thw"])
    real = mask.bool()
    assert torch.equal(got[:, real], ref[:, real])
    # back-to-back images (no separator) are numbered one image at a time
    n0, n1 = (int(g.prod()) // 4 for g in pix["image_grid_thw"])
    joined = torch.tensor([[5] + [IMAGE] * (n0 + n1) + [6]])
    split = torch.tensor([[5] + [IMAGE] * n0 + [7] + [IMAGE] * n1 + [6]])
    got = model.position_ids(joined, pix["image_grid_thw"])
    ref, _ = hf.model.get_rope_index(split, (split == IMAGE).int(), pix["image_grid_thw"])
    assert torch.equal(got[:, 0, 1:1 + n0], ref[:, 0, 1:1 + n0])
    assert torch.equal(got[:, 0, 1 + n0:], ref[:, 0, 2 + n0:] - 1)


def test_packed_row_with_an_image_equals_separate_rows(pair):
    hf, _, model = pair
    pix = images(pair.family)
    n0, n1 = (int(g.prod()) // 4 for g in pix["image_grid_thw"])
    docs = [text(2, 11) + with_image(n0) + text(3, 12), text(6, 13), with_image(n1) + text(4, 14)]
    ids = torch.tensor([sum(docs, [])])
    document_ids = torch.tensor([sum(([i] * len(d) for i, d in enumerate(docs)), [])])
    with torch.no_grad():
        got = model(ids, document_ids=document_ids, **pix)[0]
    refs, start = [], 0
    for i, d in enumerate(docs):
        row = torch.tensor([d])
        has = IMAGE in d
        one = {"pixel_values": pix["pixel_values"][:24] if i == 0 else pix["pixel_values"][24:],  # 4x6 patches
               "image_grid_thw": pix["image_grid_thw"][[0 if i == 0 else 1]]} if has else None
        refs.append(hf_logits(hf, row, torch.ones_like(row), one)[0])
    assert (got - torch.cat(refs)).abs().max() < 1e-5


def test_state_dict_round_trip_gives_transformers_tensors(pair):
    hf, _, model = pair
    ref = hf.state_dict()
    out = hf_state_dict_from_lmforge(model.state_dict(), model.args)
    assert set(out) == set(ref)
    assert all(torch.equal(out[k], ref[k]) for k in ref)
    # the published layout (model.layers.*, visual.*) reads to the same model
    old = {("visual." + k[len("model.visual."):] if k.startswith("model.visual.") else
            "model." + k[len("model.language_model."):] if k.startswith("model.language_model.") else k): t
           for k, t in ref.items()}
    state = lmforge_state_dict_from_hf(old, model.args)
    assert set(state) == set(model.state_dict())


def test_saved_directory_loads_in_transformers_with_the_same_logits(pair, tmp_path):
    hf, _, model = pair
    save_hf_model(model.state_dict(), model.args, tmp_path)
    back = type(hf).from_pretrained(tmp_path).eval()
    pix = images(pair.family)
    ids, mask = batch(pix["image_grid_thw"])
    assert (hf_logits(back, ids, mask, pix) - hf_logits(hf, ids, mask, pix)).abs().max() == 0


@pytest.mark.parametrize("family", FAMILIES)
def test_tied_embeddings_round_trip(tmp_path, family):
    hf = tiny_hf(family, seed=1)
    hf.config.tie_word_embeddings = True
    hf.tie_weights()
    hf.save_pretrained(tmp_path)
    model = load_hf_model(tmp_path).eval()
    assert model.args.tie_embeddings and model.output.weight is model.tok_embeddings.weight
    out = hf_state_dict_from_lmforge(model.state_dict(), model.args)
    assert "lm_head.weight" not in out and torch.equal(out["model.language_model.embed_tokens.weight"],
                                                       hf.state_dict()["model.language_model.embed_tokens.weight"])


def test_config_round_trip_builds_the_same_transformers_model(pair, tmp_path):
    hf, path, model = pair
    cfg = hf_config_from_args(model.args, torch_dtype="float32")
    assert args_from_hf_config(json.loads(json.dumps(cfg)), "config.json") == model.args
    rebuilt = type(hf)(type(hf.config)(**cfg))
    assert {k: v.shape for k, v in rebuilt.state_dict().items()} == {k: v.shape for k, v in hf.state_dict().items()}
    assert ModelArgs.from_dict(model.args.to_dict()) == model.args  # checkpoints rebuild the family's args


def test_published_flat_config_reads():
    cfg = {"model_type": "qwen2_5_vl", "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
           "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": VOCAB, "rms_norm_eps": 1e-6,
           "rope_theta": 1e6, "rope_scaling": {"type": "mrope", "mrope_section": [2, 3, 3]},
           "tie_word_embeddings": True, "vision_config": {"depth": 2, "hidden_size": 32, "intermediate_size": 48,
                                                          "num_heads": 2, "out_hidden_size": 64}}
    args = args_from_hf_config(cfg, "config.json")
    assert (args.rope_theta, args.mrope_section, args.tie_embeddings, args.vision_depth) == (1e6, [2, 3, 3], True, 2)
    assert args.vision_full_attention_layers == []  # the default [7, 15, 23, 31] is past a depth of 2


@pytest.mark.parametrize("family, change, named", [
    ("qwen2_5_vl", {"text_config": {"use_sliding_window": True}}, "use_sliding_window"),
    ("qwen2_5_vl", {"vision_config": {"hidden_act": "gelu"}}, "vision_config.hidden_act"),
    ("qwen3_vl", {"text_config": {"attention_bias": True}}, "attention_bias"),
    ("qwen3_vl", {"vision_config": {"hidden_act": "silu"}}, "vision_config.hidden_act"),
    *[(f, {"vision_config": {"out_hidden_size": 32}}, "out_hidden_size") for f in FAMILIES],
    *[(f, {"text_config": {"rope_parameters": {"rope_type": "yarn", "factor": 2.0}}}, "rope type") for f in FAMILIES],
])
def test_unsupported_configs_are_refused_in_one_line(family, change, named):
    cfg = json.loads(hf_config(family).to_json_string())
    for section, keys in change.items():
        cfg[section].update(keys)
    with pytest.raises(UserError, match=named) as e:
        args_from_hf_config(cfg, "config.json")
    assert "\n" not in str(e.value) and str(e.value).startswith("config.json")


def test_vision_flops_equal_torch_counter(pair):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    _, _, model = pair
    pix = images(pair.family)
    # the math kernel: its matmuls are counted (the CPU's fused attention kernel is not)
    with torch.no_grad(), sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        model.visual(pix["pixel_values"], pix["image_grid_thw"])
    vision_flops = FLOPS[pair.family]
    assert vision_flops(model.args, pix["image_grid_thw"], training=False) == counter.get_total_flops()
    assert vision_flops(model.args, pix["image_grid_thw"]) == 3 * counter.get_total_flops()


def test_parameter_groups_cover_the_model_once(pair):
    _, _, model = pair
    spec = SPECS[pair.family]
    groups = {g: {n for n, _ in parameters_of(model, spec, g)} for g in spec.parameter_groups}
    assert all(groups.values())
    assert sum(len(v) for v in groups.values()) == len(dict(model.named_parameters()))
    assert all(n.startswith(("visual.merger.", "visual.deepstack_merger_list.")) for n in groups["projector"])
    with pytest.raises(UserError, match="vision_tower, projector, language_model"):
        parameters_of(model, spec, "vision")


def test_lora_targets_only_the_language_model(pair):
    peft = pytest.importorskip("peft")
    from lmforge.models.lora import apply_lora

    _, _, model = pair
    spec = SPECS[pair.family]
    hf_module = spec.state_dict_adapter.hf_module_name("layers.1.attention.wq")
    assert hf_module == "model.language_model.layers.1.self_attn.q_proj"
    section = type("Lora", (), dict(rank=2, alpha=4, dropout=0.0, target_modules=None, quantize=None))()
    adapted = apply_lora(spec.build(model.args), section)
    trained = [n for n, p in adapted.named_parameters() if p.requires_grad]
    assert trained and all(n.startswith("layers.") and "lora_" in n for n in trained)
    assert lora_targets_for(model.args, None) == dict(spec.lora_targets)
    _ = peft


def test_named_sizes_build_the_family():
    args = model_args_for("qwen2.5-vl-3b", vocab_size=151936)
    assert isinstance(args, Qwen2_5_VLArgs) and args.vision_dim == 1280 and args.mrope_section == [16, 24, 24]
    with torch.device("meta"):
        model = Qwen2_5_VLModel(args)
    # Qwen/Qwen2.5-VL-3B-Instruct: 3.75B parameters (tied embeddings counted once)
    assert abs(model.num_params() / 1e9 - 3.75) < 0.01
    args = model_args_for("qwen3-vl-8b", vocab_size=151936)
    assert isinstance(args, Qwen3VLArgs) and args.deepstack_layers == [8, 16, 24]


def test_init_from_scratch_and_gradients_reach_the_tower(pair):
    _, _, loaded = pair
    spec = SPECS[pair.family]
    with torch.device("meta"):
        model = spec.build(loaded.args)
    model.to_empty(device="cpu")
    model.tie_weights()  # to_empty gives the tied output its own (uninitialised) tensor
    model.init_weights(seed=0)
    pix = images(pair.family)
    ids, _ = batch(pix["image_grid_thw"])
    logits = model(ids, **pix)
    assert torch.isfinite(logits).all()
    logits.logsumexp(-1).mean().backward()
    grads = {n: p.grad for n, p in model.named_parameters()}
    assert all(g is not None and g.abs().sum() > 0 for n, g in grads.items() if n.startswith("visual.blocks.0."))
    assert grads["visual.patch_embed.proj.weight"].abs().sum() > 0
