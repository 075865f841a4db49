"""Max abs differences of lmforge's vision-language families against transformers, fp32, on the tiny random
models and images of ``tests/test_qwen_vl.py`` and ``tests/test_gemma3_vl.py`` (the same builders): a batch
with two images of different sizes, a text-only row and a right-padded row; text-only rows; the image
features. Run: ``PYTHONPATH=src python bench/vlm_parity.py`` (docs/vlm.md quotes its output)."""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import test_gemma3_vl as gemma  # noqa: E402
import test_qwen_vl as qwen  # noqa: E402

from lmforge.models.hf import load_hf_model  # noqa: E402


def loaded(hf):  # type: ignore[no-untyped-def]
    path = tempfile.mkdtemp()
    hf.save_pretrained(path)
    return load_hf_model(path).eval()


@torch.no_grad()
def main() -> None:
    text = torch.tensor([qwen.text(24, 7), qwen.text(24, 8)])
    for family in qwen.FAMILIES:
        hf = qwen.tiny_hf(family)
        model = loaded(hf)
        pix = qwen.images(family)
        ids, mask = qwen.batch(pix["image_grid_thw"])
        ref = qwen.hf_logits(hf, ids, mask, pix)
        images = (model(ids, **pix) - ref)[mask.bool()].abs().max().item()
        plain = (model(text) - qwen.hf_logits(hf, text, torch.ones_like(text))).abs().max().item()
        tower = (model.image_features(**pix) - hf.model.visual(pix["pixel_values"], grid_thw=pix["image_grid_thw"])
                 .pooler_output).abs().max().item()
        print(f"{family}: images batch {images:.3g}, text only {plain:.3g}, image features {tower:.3g}")
    hf = gemma.tiny_hf()
    model = loaded(hf)
    pix = gemma.pixels()
    ids, mask = gemma.batch()
    images = (model(ids, pixel_values=pix) - gemma.hf_logits(hf, ids, mask, pix))[mask.bool()].abs().max().item()
    plain = (model(text) - gemma.hf_logits(hf, text, torch.ones_like(text))).abs().max().item()
    ref_features = hf.model.get_image_features(pix).pooler_output.flatten(0, 1)
    tower = (model.image_features(pix) - ref_features).abs().max().item()
    print(f"gemma3: images batch {images:.3g}, text only {plain:.3g}, image features {tower:.3g}")


if __name__ == "__main__":
    main()
