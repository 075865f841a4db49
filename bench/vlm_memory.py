"""Peak memory of one vision-language SFT step with images against the same tokens as text.

    PYTHONPATH=src python bench/vlm_memory.py              # both shapes
    PYTHONPATH=src python bench/vlm_memory.py --append     # and append the table to BENCHMARKS.md

Why: a step with images holds what text does (weights, gradients, AdamW's moments, the decoder's
activations) plus the tower's activations over every patch, which can be many more than the image
tokens they merge into (Qwen merges 2x2 patches into one token). This measures how much that adds.

Each case runs in a fresh process (one thread): the embedded shapes task's chats (``shape_task.py``)
tokenized and packed by the SFT data path, one batch of ``rows x seq_len`` tokens, a random model of the
named shape, fp32, torch's AdamW. ``images``: the batch as SFT makes it; ``text``: the same batch with
every image token replaced by a text token and no pixels (the same token count and loss positions, so
the difference is the tower). A warm-up step first (AdamW's moments exist), then the measured step
(zero_grad, forward, backward, optimizer step).

Columns: **live tensors** (``LiveTensorMemory``: every storage an operator returns, counted until freed,
weights, gradients and moments included; blind to workspace inside one kernel), the **peak RSS growth**
over the step (VmHWM reset before it; the allocator's caching included), and the image tokens' share of
the batch's tokens.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import ROOT, append_benchmark, machine, markdown_table  # noqa: E402

SHAPES: dict[str, dict[str, Any]] = {
    "qwen2.5-vl-debug": dict(overrides={}, image_side=56, rows=8, seq_len=256),
    # wider and deeper in both parts, on 4x larger pictures (16x16 patches: 64 image tokens each)
    "wide-224px": dict(overrides=dict(dim=512, n_layers=8, n_heads=8, n_kv_heads=4, ffn_hidden_dim=1536,
                                                  vision_dim=256, vision_depth=4, vision_heads=4, vision_ffn_dim=512,
                                                  vision_full_attention_layers=[3], mrope_section=[8, 12, 12]),
                                   image_side=224, rows=4, seq_len=512),
}
"""name -> the ``qwen2.5-vl-debug`` overrides, the pictures' side in pixels, rows and tokens per row."""


def _status_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(field)


def _batch(shape: dict[str, Any], args: Any, tok: Any, with_images: bool) -> Any:
    """One packed batch of the shapes task; without images, the image tokens become a text token."""
    from lmforge.data.chat import chat_format_for
    from lmforge.data.image_tokens import image_encoding_for
    from lmforge.data.packing import collate
    from lmforge.data.sft_data import build_sft_dataset
    from lmforge.data.shape_task import shape_examples, shape_records

    side = shape["image_side"]
    records = shape_records(shape_examples("train", 64 * shape["rows"]), "train")
    for _, rec in records:  # nearest-neighbour upscale keeps the drawing, grows the patches
        part = rec["messages"][0]["content"][0]
        part["image"] = part["image"].resize((side, side), 0)
    ds, _ = build_sft_dataset(records, "bench", tok, chat_format_for(tok), seq_len=shape["seq_len"],
                              packing=True, images=image_encoding_for(args, tok))
    batch = collate([ds[i] for i in range(shape["rows"])])
    if not with_images:
        ids = batch.input_ids.clone()
        ids[ids == args.image_token_id] = ord("x")
        batch = type(batch)(**{**batch.__dict__, "input_ids": ids, "pixel_values": None, "image_grid_thw": None})
    return batch


def worker(name: str, with_images: bool) -> dict[str, Any]:
    """The measured step of one case in this process."""
    import torch

    from lmforge.models.args import model_args_for
    from lmforge.models.spec import spec_for_args
    from lmforge.models.tokenizer import ByteTokenizer
    from lmforge.objectives.next_token import cross_entropy_loss
    from lmforge.planning.memory_probe import LiveTensorMemory

    torch.set_num_threads(1)
    shape = SHAPES[name]
    tok = ByteTokenizer()
    args = model_args_for("qwen2.5-vl-debug", tok.vocab_size, **shape["overrides"])
    model = spec_for_args(args).build(args)
    model.init_weights(0)
    model.train()
    image_batch = _batch(shape, args, tok, True)
    image_tokens = int((image_batch.input_ids == args.image_token_id).sum())
    batch = image_batch if with_images else _batch(shape, args, tok, False)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=False)

    def step() -> None:
        opt.zero_grad(set_to_none=False)
        loss, stats = cross_entropy_loss(model, batch)
        (loss / stats.target_tokens).backward()
        opt.step()

    step()  # warm-up: gradients and AdamW's moments exist from here on
    mem = LiveTensorMemory()
    state = [p for p in model.parameters()] + [p.grad for p in model.parameters()]
    state += [t for s in opt.state.values() for t in s.values() if torch.is_tensor(t)]
    mem.track(state)
    state_bytes = mem.peak
    Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current RSS
    rss0 = _status_kb("VmRSS")
    with mem:
        step()
    return {"live": mem.peak, "state": state_bytes, "rss": (_status_kb("VmHWM") - rss0) * 1024,
            "tokens": batch.input_ids.numel(), "image_tokens": image_tokens, "images": image_batch.image_count,
            "params": sum(p.numel() for p in model.parameters())}


def measure(name: str, with_images: bool) -> dict[str, Any]:
    cmd = [sys.executable, __file__, "--worker", name, "--images" if with_images else "--text"]
    env = {"PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"}
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        raise SystemExit(f"{name} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default=",".join(SHAPES))
    p.add_argument("--append", action="store_true", help="append the table to BENCHMARKS.md")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--images", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--text", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.worker:
        print(json.dumps(worker(a.worker, a.images)), flush=True)
        return
    import torch

    mb = 2**20
    rows = []
    for name in a.shapes.split(","):
        img, txt = measure(name, True), measure(name, False)
        shape = SHAPES[name]
        for label, r in (("images", img), ("text, same tokens", txt)):
            rows.append([name, f"{r['params']:,}", f"{shape['rows']} x {shape['seq_len']}", label,
                         f"{r['image_tokens'] / r['tokens']:.1%} ({r['images']} images)" if label == "images" else "-",
                         f"{r['state'] / mb:,.1f}", f"{r['live'] / mb:,.1f}", f"{(r['live'] - r['state']) / mb:,.1f}",
                         f"{r['rss'] / mb:,.1f}"])
            print(" | ".join(rows[-1]), flush=True)
        rows.append([name, "", "", "images / text", "", "", f"{img['live'] / txt['live']:.2f}x",
                     f"{(img['live'] - img['state']) / max(txt['live'] - txt['state'], 1):.2f}x",
                     f"{img['rss'] / max(txt['rss'], 1):.2f}x"])
    table = markdown_table(["model", "parameters", "batch", "step", "image tokens", "weights+grads+AdamW MB",
                            "peak live tensors MB", "peak live - state MB", "peak RSS growth MB"], rows)
    body = (f"`PYTHONPATH=src python bench/vlm_memory.py {' '.join(sys.argv[1:])}` on "
            f"{machine(torch.device('cpu'))}, one thread per case, each case its own process. One SFT step "
            f"(forward, backward, AdamW; after a warm-up step) of a random Qwen2.5-VL-shaped model, fp32, on "
            f"one packed batch of the embedded shapes task, vs the same batch with its image tokens as text "
            f"and no pixels.\n\n{table}\n")
    print(body)
    if a.append:
        append_benchmark("Vision-language SFT step: peak memory with images vs text", body)


if __name__ == "__main__":
    main()
