"""Vision-language SFT data: chat records with image parts (a file path, bytes, the record's images column),
the family's image processor, image placeholders expanded to the processor's token counts (against
transformers' Qwen2.5-VL processor on the real Qwen2.5 tokenizer), loss on assistant text only, packing that
keeps each image with its document (packed losses equal the documents' own), and bad images as one line or
a counted skip."""

from __future__ import annotations

import io
import json
from types import SimpleNamespace
from pathlib import Path

import numpy as np
import pytest
import torch

from lmforge.data.chat import chat_format_for
from lmforge.data.image_tokens import image_encoding_for
from lmforge.data.packing import IGNORE_INDEX, collate
from lmforge.data.sft_data import build_sft_dataset, read_sft_records
from lmforge.errors import UserError
from lmforge.models.args import model_args_for
from lmforge.models.spec import spec_for_args
from lmforge.models.tokenizer import ByteTokenizer, load_tokenizer
from lmforge.objectives.next_token import cross_entropy_loss

Image = pytest.importorskip("PIL.Image")
transformers = pytest.importorskip("transformers")

QWEN_TOKENIZER = Path(__file__).parent / "fixtures" / "tokenizers" / "qwen2.5-instruct"


def picture(w: int, h: int, seed: int = 0) -> "Image.Image":
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8))


def png(image: "Image.Image") -> bytes:
    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue()


def chat(image_part: dict, question: str = "colour?", answer: str = "red") -> dict:
    return {"messages": [{"role": "user", "content": [image_part, {"type": "text", "text": question}]},
                         {"role": "assistant", "content": answer}]}


@pytest.fixture(scope="module")
def debug_vlm():
    tok = ByteTokenizer()
    args = model_args_for("qwen2.5-vl-debug", tok.vocab_size)
    torch.manual_seed(0)
    model = spec_for_args(args).build(args)
    model.init_weights(0)
    return tok, args, model.eval()


def write_records(tmp_path: Path, records: list[dict]) -> Path:
    f = tmp_path / "chats.jsonl"
    f.write_text("".join(json.dumps(r) + "\n" for r in records))
    return f


def dataset(tmp_path, tok, args, records, packing=True, seq_len=256, **kw):
    enc = image_encoding_for(args, tok, **kw)
    recs = read_sft_records(write_records(tmp_path, records))
    return build_sft_dataset(recs, "t", tok, chat_format_for(tok), seq_len=seq_len, packing=packing, images=enc)


def test_image_sources_tokens_and_loss_mask(tmp_path, debug_vlm):
    """A path (relative to the data file) and the record's ``images`` column both read; each image's tokens
    are its processor grid's merged patches, with no loss on them or on the question."""
    tok, args, _ = debug_vlm
    picture(84, 56, 1).save(tmp_path / "a.png")
    records = [chat({"type": "image", "path": "a.png"}, answer="red"),
               {**chat({"type": "image"}, answer="blue"), "images": [str(tmp_path / "a.png")]}]
    ds, summary = dataset(tmp_path, tok, args, records, packing=False)
    assert summary.images == 2 and summary.examples == 2
    enc = image_encoding_for(args, tok)
    _, grid = enc.process([picture(84, 56, 1)])
    expected = int(grid.prod()) // 4  # 6x4 patches -> 6 tokens after the 2x2 merge
    for i, answer in enumerate(["red", "blue"]):
        s = ds[i]
        ids = s.input_ids.tolist()
        assert ids.count(args.image_token_id) == expected
        start = ids.index(args.vision_start_token_id)
        assert ids[start + 1 + expected] == args.vision_end_token_id
        targets = s.labels[s.labels != IGNORE_INDEX].tolist()
        assert tok.decode(targets) == answer and targets[-1] == tok.eos_id
        assert torch.equal(s.image_grid_thw, grid) and s.pixel_values.shape[0] == int(grid.prod())


def test_bytes_part(tmp_path, debug_vlm):
    """Encoded bytes in the part, as a datasets ``Image`` column holds them ({"bytes": ...})."""
    tok, args, _ = debug_vlm
    enc = image_encoding_for(args, tok)
    part = {"type": "image", "image": {"bytes": png(picture(56, 56))}}
    records = [("mem:1", {"messages": [{"role": "user", "content": [part, {"type": "text", "text": "q"}]},
                                       {"role": "assistant", "content": "a"}]})]
    from lmforge.data.record_formats import to_sft_record

    records = [(w, to_sft_record(r, "messages")) for w, r in records]
    ds, summary = build_sft_dataset(records, "t", tok, chat_format_for(tok), seq_len=64, packing=False, images=enc)
    assert summary.images == 1 and ds[0].input_ids.tolist().count(args.image_token_id) == 4


def test_expansion_matches_transformers_processor(tmp_path):
    """On the real Qwen2.5 tokenizer and its chat template, lmforge's ids and pixels for a chat with two images
    of different sizes equal what transformers' Qwen2.5-VL processor gives for the same rendered text."""
    from transformers import AutoTokenizer, Qwen2_5_VLProcessor
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    tok = load_tokenizer(str(QWEN_TOKENIZER))
    args = model_args_for("qwen2.5-vl-3b", 151936)
    pics = [picture(84, 56, 1), picture(112, 140, 2)]
    for i, p in enumerate(pics):
        p.save(tmp_path / f"{i}.png")
    parts = [{"type": "image", "path": "0.png"}, {"type": "text", "text": "and"},
             {"type": "image", "path": "1.png"}, {"type": "text", "text": "?"}]
    record = {"messages": [{"role": "user", "content": parts},
                           {"role": "assistant", "content": "two"}]}
    ds, _ = dataset(tmp_path, tok, args, [record], packing=False, seq_len=512)
    fmt = chat_format_for(tok)
    marker = "<|vision_start|><|image_pad|><|vision_end|>"
    text = fmt.render([{"role": "user", "content": f"{marker}and{marker}?"}, {"role": "assistant", "content": "two"}])
    # the processor's own expansion rule (its __call__ needs torchvision's video processor, not installed here)
    image_processor = Qwen2VLImageProcessorPil()
    pixels = image_processor(images=pics, return_tensors="pt")
    ns = SimpleNamespace(image_processor=image_processor, image_token="<|image_pad|>")
    for i in range(len(pics)):
        expansion = Qwen2_5_VLProcessor.replace_image_token(ns, pixels, i)
        text = text.replace("<|image_pad|>", expansion.replace("<|image_pad|>", "\0"), 1)
    text = text.replace("\0", "<|image_pad|>")
    ref = {"input_ids": AutoTokenizer.from_pretrained(str(QWEN_TOKENIZER))(text, return_tensors="pt")["input_ids"],
           **pixels}
    n = int(ref["input_ids"].shape[1])
    s = ds[0]
    assert s.input_ids[: n - 1].tolist() == ref["input_ids"][0, :-1].tolist()
    assert torch.equal(s.image_grid_thw, ref["image_grid_thw"])
    assert torch.equal(s.pixel_values, ref["pixel_values"])


def test_packing_keeps_images_with_their_documents(tmp_path, debug_vlm):
    """Packed rows (images of several documents, and a text-only document) give each document the loss it
    has alone: the pixel rows follow their documents and the positions restart per document."""
    tok, args, model = debug_vlm
    for i, (w, h) in enumerate([(84, 56), (56, 112), (56, 56)]):
        picture(w, h, i).save(tmp_path / f"{i}.png")
    records = [chat({"type": "image", "path": f"{i}.png"}, answer=a) for i, a in enumerate(["red", "a square", "3"])]
    records.insert(2, {"messages": [{"role": "user", "content": "text only"}, {"role": "assistant", "content": "ok"}]})
    packed, summary = dataset(tmp_path, tok, args, records, packing=True, seq_len=128)
    alone, _ = dataset(tmp_path, tok, args, records, packing=False, seq_len=128)
    assert len(packed) == 1 and len(alone) == 4 and summary.images == 3
    with torch.no_grad():
        loss_packed, stats = cross_entropy_loss(model, collate([packed[0]]))
        loss_alone = sum(cross_entropy_loss(model, collate([alone[i]]))[0] for i in range(4))
    assert int(stats.loss_weight) == summary.loss_tokens
    one = alone[0]  # the loss sees the images: it is the model's own forward with them
    with torch.no_grad():
        logits = model(one.input_ids[None], pixel_values=one.pixel_values, image_grid_thw=one.image_grid_thw)
        want = torch.nn.functional.cross_entropy(logits[0], one.labels, reduction="sum")
        torch.testing.assert_close(cross_entropy_loss(model, collate([one]))[0], want, atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(loss_packed, loss_alone, atol=1e-4, rtol=1e-5)
    batch = collate([alone[0], alone[2], alone[1]])  # a text row between two image rows
    assert batch.image_count == 2 and torch.equal(batch.image_grid_thw, torch.cat([alone[0].image_grid_thw,
                                                                                      alone[1].image_grid_thw]))


def test_fingerprint_sees_the_images(tmp_path, debug_vlm):
    """A resume on the same chats with other pictures is a data change."""
    from lmforge.data.fingerprint import dataset_fingerprint

    tok, args, _ = debug_vlm
    prints = []
    for seed in (0, 1, 0):
        picture(56, 56, seed).save(tmp_path / "a.png")
        prints.append(dataset_fingerprint(dataset(tmp_path, tok, args, [chat({"type": "image", "path": "a.png"})])[0]))
    assert prints[0] == prints[2] != prints[1]


def test_bad_images_are_one_line_or_a_counted_skip(tmp_path, debug_vlm):
    tok, args, _ = debug_vlm
    with pytest.raises(UserError, match=r"chats.jsonl:1: image .*missing.png: no such file"):
        dataset(tmp_path, tok, args, [chat({"type": "image", "path": "missing.png"})])
    (tmp_path / "bad.png").write_bytes(png(picture(56, 56))[:60])  # truncated
    with pytest.raises(UserError, match=r"chats.jsonl:2: image .*bad.png: (corrupt|not a readable)"):
        dataset(tmp_path, tok, args, [chat({"type": "text", "text": "x"}), chat({"type": "image", "path": "bad.png"})])
    (tmp_path / "big.png").write_bytes(png(picture(200, 200)))
    (tmp_path / "ok.png").write_bytes(png(picture(56, 56)))
    _, summary = dataset(tmp_path, tok, args, [chat({"type": "image", "path": "big.png"}),
                                              chat({"type": "image", "path": "ok.png"})], max_pixels=100 * 100)
    assert summary.image_too_large == 1 and summary.examples == 1 and "over sft.max_image_pixels" in summary.line()
    with pytest.raises(UserError, match=r"chats.jsonl:1: .*images' has 2 images but only 1"):
        dataset(tmp_path, tok, args, [{**chat({"type": "image"}), "images": ["ok.png", "ok.png"]}])


def test_text_model_refuses_image_parts(tmp_path):
    tok = ByteTokenizer()
    recs = read_sft_records(write_records(tmp_path, [chat({"type": "image", "path": "x.png"})]))
    with pytest.raises(UserError, match=r"chats.jsonl:1: the record has image parts and the model reads text only"):
        build_sft_dataset(recs, "t", tok, chat_format_for(tok), seq_len=64, images=None)


def test_gemma3_images_pack_with_their_documents(tmp_path):
    """Gemma 3: a fixed ``mm_tokens_per_image`` between its start and end of image, [images, 3, H, W] pixels
    of the family's processor, and packed rows giving each document its own loss (bidirectional attention
    within each image, per document)."""
    from lmforge.models.hf_config import args_from_hf_config

    cfg = transformers.Gemma3Config(
        text_config=dict(vocab_size=320, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=24,
                         sliding_window=3, layer_types=["sliding_attention", "full_attention"],
                         max_position_embeddings=256, bos_token_id=None, eos_token_id=None, pad_token_id=0),
        vision_config=dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=2,
                           image_size=32, patch_size=8, vision_use_head=False),
        mm_tokens_per_image=4, image_token_index=290, boi_token_index=291, eoi_token_index=292)
    args = args_from_hf_config(cfg.to_dict(), "config.json")
    model = spec_for_args(args).build(args)
    model.init_weights(0)
    model.eval()
    tok = ByteTokenizer()
    for i, (w, h) in enumerate([(40, 50), (64, 24)]):
        picture(w, h, i).save(tmp_path / f"{i}.png")
    records = [chat({"type": "image", "path": f"{i}.png"}, answer=a) for i, a in enumerate(["red", "two"])]
    packed, summary = dataset(tmp_path, tok, args, records, packing=True, seq_len=64)
    alone, _ = dataset(tmp_path, tok, args, records, packing=False, seq_len=64)
    assert len(packed) == 1 and summary.images == 2
    ids = alone[0].input_ids.tolist()
    start = ids.index(291)
    assert ids[start: start + 6] == [291, 290, 290, 290, 290, 292] and alone[0].pixel_values.shape == (1, 3, 32, 32)
    assert packed[0].pixel_values.shape == (2, 3, 32, 32) and packed[0].image_grid_thw is None
    with torch.no_grad():
        loss_packed = cross_entropy_loss(model, collate([packed[0]]))[0]
        loss_alone = sum(cross_entropy_loss(model, collate([alone[i]]))[0] for i in range(2))
        logits = model(alone[0].input_ids[None], pixel_values=alone[0].pixel_values)
        want = torch.nn.functional.cross_entropy(logits[0], alone[0].labels, reduction="sum")
    torch.testing.assert_close(loss_packed, loss_alone, atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(cross_entropy_loss(model, collate([alone[0]]))[0], want, atol=1e-4, rtol=1e-5)
