"""Generation with images: the KV-cache decode after an image continues from the multimodal positions
(transformers' ``rope_deltas``), so its greedy tokens equal transformers' ``generate`` on the same weights and
a full forward per token; ``lmforge generate --image`` reads the image and refuses a missing one in one line."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from lmforge.data.chat import chat_format_for
from lmforge.data.image_tokens import image_encoding_for
from lmforge.data.sft_data import build_sft_dataset
from lmforge.models.args import model_args_for
from lmforge.models.spec import spec_for_args
from lmforge.models.tokenizer import ByteTokenizer
from lmforge.models.vision.generate import generate_with_images

transformers = pytest.importorskip("transformers")
Image = pytest.importorskip("PIL.Image")
NEW = 10


@pytest.fixture(scope="module")
def prompt():
    tok = ByteTokenizer()
    args = model_args_for("qwen2.5-vl-debug", tok.vocab_size)
    torch.manual_seed(0)
    model = spec_for_args(args).build(args)
    model.init_weights(0)
    torch.manual_seed(1)
    with torch.no_grad():  # larger weights than the init's: sharp attention and logits, so positions change picks
        for name, p in model.named_parameters():
            if p.dim() > 1 and not name.startswith("visual"):
                p.normal_(0.0, 0.08)
    enc = image_encoding_for(args, tok)
    # a 112x168 picture: 24 image tokens over 4x6 merged rows and columns, so the decode's positions sit 18
    # below the text numbering's
    pic = Image.fromarray(np.random.default_rng(0).integers(0, 255, (112, 168, 3), dtype=np.uint8))
    parts = [{"type": "image", "image": pic}, {"type": "text", "text": "what?"}]
    record = {"messages": [{"role": "user", "content": parts},
                           {"role": "assistant", "content": "x"}]}
    ds, _ = build_sft_dataset([("mem:1", record)], "t", tok, chat_format_for(tok), seq_len=64, packing=False,
                              images=enc)
    s = ds[0]
    end = int((s.labels != -100).nonzero()[0]) + 1  # the prompt: up to the assistant token
    return tok, args, model.eval(), s.input_ids[:end].tolist(), s.pixel_values, s.image_grid_thw


def test_kv_cache_decode_equals_full_forwards_and_transformers(prompt, tmp_path):
    tok, args, model, ids, pixels, grid = prompt
    got = generate_with_images(model, ids, pixels, grid, NEW)
    seq = list(ids)
    with torch.no_grad():
        for _ in range(NEW):  # the reference: every token from a full forward with the image
            seq.append(int(model(torch.tensor([seq]), pixel_values=pixels, image_grid_thw=grid)[0, -1].argmax()))
    assert got == seq[len(ids):]

    from transformers import AutoModelForImageTextToText

    from lmforge.exporters.run_export import write_hf_dir

    write_hf_dir(model, tok, tmp_path)
    theirs = AutoModelForImageTextToText.from_pretrained(tmp_path).eval()
    input_ids = torch.tensor([ids])
    out = theirs.generate(input_ids=input_ids, pixel_values=pixels, image_grid_thw=grid, max_new_tokens=NEW,
                          mm_token_type_ids=(input_ids == args.image_token_id).int(), do_sample=False,
                          eos_token_id=None, min_new_tokens=NEW)
    assert out[0, len(ids):].tolist() == got
