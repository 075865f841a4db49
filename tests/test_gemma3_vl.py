"""Gemma 3 with images (``gemma3``) against transformers: logits with images in the batch (bidirectional
attention within each image, in full and sliding layers), text-only logits, a packed row, the SigLIP tower
and projector, config.json and tensor names both ways, parameter groups and LoRA targets.

Every model is a tiny random fp32 ``Gemma3ForConditionalGeneration`` built by transformers from a small
config; the pixels come from transformers' own Gemma 3 image processor (PIL backend) over random images.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from lmforge.errors import UserError
from lmforge.models.gemma3_vl import GEMMA3_VL, Gemma3VLArgs, Gemma3VLModel, vision_flops
from lmforge.models.hf import hf_state_dict_from_lmforge, load_hf_model, save_hf_model
from lmforge.models.hf_config import args_from_hf_config, hf_config_from_args
from lmforge.models.spec import parameters_of

transformers = pytest.importorskip("transformers")
Image = pytest.importorskip("PIL.Image")

VOCAB, IMAGE, BOI, EOI = 300, 290, 291, 292
PER_IMAGE = 4  # mm_tokens_per_image: 4x4 patches of 8 pixels pooled 2x2
WINDOW = 3  # shorter than an image's run of tokens: the band cuts into the bidirectional block


def hf_config(**vision) -> "transformers.Gemma3Config":
    return transformers.Gemma3Config(
        text_config=dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=24,
                         sliding_window=WINDOW, layer_types=["sliding_attention", "full_attention"],
                         max_position_embeddings=256, bos_token_id=None, eos_token_id=None, pad_token_id=0),
        vision_config=dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=2,
                           image_size=32, patch_size=8, **{"vision_use_head": False, **vision}),
        mm_tokens_per_image=PER_IMAGE, image_token_index=IMAGE, boi_token_index=BOI, eoi_token_index=EOI)


def tiny_hf(seed: int = 0, **vision) -> "transformers.PreTrainedModel":
    torch.manual_seed(seed)
    model = transformers.Gemma3ForConditionalGeneration(hf_config(**vision)).eval()
    with torch.no_grad():  # non-trivial norms, biases and projection (transformers starts it at zero)
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(0.0 if "language_model" in name or "soft_emb" in name else 1.0, 0.2)
            elif name.endswith("bias") or "mm_input_projection" in name:
                p.normal_(0.0, 0.3)
    return model


def pixels() -> torch.Tensor:
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    rng = np.random.default_rng(0)
    pics = [Image.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8)) for h, w in ((40, 50), (24, 64))]
    return Gemma3ImageProcessorPil(size={"height": 32, "width": 32})(images=pics, return_tensors="pt")["pixel_values"]


def text(n: int, seed: int) -> list[int]:
    return torch.randint(1, 280, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


IMG = [BOI] + [IMAGE] * PER_IMAGE + [EOI]


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    rows = [text(3, 1) + IMG + text(4, 2) + IMG + text(5, 3), text(20, 4), text(12, 5)]
    T = max(len(r) for r in rows)
    ids, mask = torch.zeros(len(rows), T, dtype=torch.long), torch.zeros(len(rows), T, dtype=torch.long)
    for b, r in enumerate(rows):
        ids[b, :len(r)], mask[b, :len(r)] = torch.tensor(r), 1
    return ids, mask


def hf_logits(hf, ids, mask, pix=None) -> torch.Tensor:
    kwargs = {} if pix is None else {"pixel_values": pix, "token_type_ids": (ids == IMAGE).long()}
    with torch.no_grad():
        return hf(input_ids=ids, attention_mask=mask, **kwargs).logits


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    hf = tiny_hf()
    path = tmp_path_factory.mktemp("gemma3")
    hf.save_pretrained(path)
    return hf, path, load_hf_model(path).eval()


def test_loads_as_the_family(pair):
    _, _, model = pair
    assert isinstance(model, Gemma3VLModel) and isinstance(model.args, Gemma3VLArgs)
    assert model.args.layer_types == ["sliding_attention", "full_attention"] and model.args.sliding_window == WINDOW
    assert model.args.mm_tokens_per_image == PER_IMAGE and model.args.embed_scale


def test_logits_with_images_equal_transformers(pair):
    hf, _, model = pair
    pix = pixels()
    ids, mask = batch()
    ref = hf_logits(hf, ids, mask, pix)
    with torch.no_grad():
        got = model(ids, pixel_values=pix)
    assert (got - ref)[mask.bool()].abs().max() < 1e-5
    # the image tokens attend to each other both ways: causal attention over them gives other logits
    from lmforge.models.vision.mrope import scatter_image_features

    with torch.no_grad():
        embeds = scatter_image_features(model.embed(ids), ids, model.image_features(pix), IMAGE)
        causal = model.output(model.hidden_states(ids, embeds=embeds))
    assert (causal - ref)[0].abs().max() > 1e-3


def test_text_only_logits_equal_transformers(pair):
    hf, _, model = pair
    ids = torch.tensor([text(24, 7), text(24, 8)])
    with torch.no_grad():
        got = model(ids)
    assert (got - hf_logits(hf, ids, torch.ones_like(ids))).abs().max() < 1e-5


def test_image_features_equal_transformers(pair):
    hf, _, model = pair
    pix = pixels()
    with torch.no_grad():
        ref = hf.model.get_image_features(pix).pooler_output.flatten(0, 1)
        got = model.image_features(pix)
    assert got.shape == (2 * PER_IMAGE, 64) and (got - ref).abs().max() < 1e-5


def test_packed_row_with_images_equals_separate_rows(pair):
    hf, _, model = pair
    pix = pixels()
    docs = [text(2, 11) + IMG + text(3, 12), text(6, 13), IMG + text(4, 14)]
    ids = torch.tensor([sum(docs, [])])
    document_ids = torch.tensor([sum(([i] * len(d) for i, d in enumerate(docs)), [])])
    position_ids = torch.tensor([sum((list(range(len(d))) for d in docs), [])])
    with torch.no_grad():
        got = model(ids, position_ids, document_ids, pixel_values=pix)[0]
    refs = []
    for i, d in enumerate(docs):
        row = torch.tensor([d])
        refs.append(hf_logits(hf, row, torch.ones_like(row), {0: pix[:1], 2: pix[1:]}.get(i))[0])
    assert (got - torch.cat(refs)).abs().max() < 1e-5


def test_state_dict_and_config_round_trip(pair, tmp_path):
    hf, path, model = pair
    ref = hf.state_dict()
    out = hf_state_dict_from_lmforge(model.state_dict(), model.args)
    assert set(out) == set(ref) - {"lm_head.weight"}  # tied, as save_pretrained writes it
    assert all(torch.equal(out[k], ref[k]) for k in out)
    cfg = hf_config_from_args(model.args, torch_dtype="float32")
    assert args_from_hf_config(json.loads(json.dumps(cfg)), "config.json") == model.args
    save_hf_model(model.state_dict(), model.args, tmp_path)
    back = transformers.Gemma3ForConditionalGeneration.from_pretrained(tmp_path).eval()
    ids, mask = batch()
    pix = pixels()
    assert (hf_logits(back, ids, mask, pix) - hf_logits(hf, ids, mask, pix)).abs().max() == 0


def test_a_tower_with_a_pooling_head_reads_without_it(tmp_path):
    hf = tiny_hf(seed=1, vision_use_head=True)
    hf.save_pretrained(tmp_path)
    model = load_hf_model(tmp_path).eval()
    ids, mask = batch()
    pix = pixels()
    with torch.no_grad():
        got = model(ids, pixel_values=pix)
    assert (got - hf_logits(hf, ids, mask, pix))[mask.bool()].abs().max() < 1e-5


def test_unsupported_tower_is_refused_in_one_line(pair):
    _, path, _ = pair
    cfg = json.loads((path / "config.json").read_text())
    cfg["vision_config"]["hidden_act"] = "gelu"
    with pytest.raises(UserError, match="vision_config.hidden_act") as e:
        args_from_hf_config(cfg, "config.json")
    assert "\n" not in str(e.value)


def test_parameter_groups_and_lora_targets(pair):
    pytest.importorskip("peft")
    from lmforge.models.lora import apply_lora

    _, _, model = pair
    groups = {g: {n for n, _ in parameters_of(model, GEMMA3_VL, g)} for g in GEMMA3_VL.parameter_groups}
    assert all(groups.values()) and sum(map(len, groups.values())) == len(dict(model.named_parameters()))
    section = type("Lora", (), dict(rank=2, alpha=4, dropout=0.0, target_modules=None, quantize=None))()
    adapted = apply_lora(GEMMA3_VL.build(model.args), section)
    trained = [n for n, p in adapted.named_parameters() if p.requires_grad]
    assert trained and all(n.startswith("layers.") and "lora_" in n for n in trained)


def test_vision_flops_equal_torch_counter(pair):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    _, _, model = pair
    # the math kernel: its matmuls are counted (the CPU's fused attention kernel is not)
    with torch.no_grad(), sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        model.image_features(pixels())
    assert vision_flops(model.args, 2, training=False) == counter.get_total_flops()
    assert vision_flops(model.args, 2) == 3 * counter.get_total_flops()


def test_init_from_scratch_and_gradients_reach_the_tower(pair):
    _, _, loaded = pair
    with torch.device("meta"):
        model = GEMMA3_VL.build(loaded.args)
    model.to_empty(device="cpu")
    model.tie_weights()  # to_empty gives the tied output its own (uninitialised) tensor
    model.init_weights(seed=0)
    ids, _ = batch()
    logits = model(ids, pixel_values=pixels())
    assert torch.isfinite(logits).all()
    logits.logsumexp(-1).mean().backward()
    tower = {n: p.grad for n, p in model.named_parameters() if n.startswith("visual.")}
    # every tower tensor gets a gradient; the key biases' is zero (a softmax ignores a shift of all its logits)
    assert tower and all(g is not None for g in tower.values())
    assert all(g.abs().sum() > 0 for n, g in tower.items() if not n.endswith("k_proj.bias"))
