"""Generation throughput: lmforge's batched KV-cache ``generate`` vs ``transformers`` ``generate``.

    python bench/generate.py                     # debug and small models, batch 8 and 64, 1 thread
    python bench/generate.py --batch 16 --new-tokens 128

Three systems decode greedily from the same weights (the lmforge model converted with
``lmforge.models.hf``), the same prompts (equal lengths, so no padding differences) and the same
number of new tokens, interleaved in one process: ``lmforge`` (the fused decode step),
``lmforge-modules`` (the same ``generate`` made to run the model's own forward every step, as it
does for models with adapters or FSDP; a no-op forward hook is enough to select that path) and
``transformers``. Neither has a stop token (lmforge ``eos_id=None``; the transformers model's
``eos_token_id`` is cleared), so none stops early; the script checks the token counts and reports
how many generated tokens equal transformers'. (``min_new_tokens`` must not be used for this: it
works by forbidding the EOS id, which LlamaConfig sets to 2 by default, and so changes the greedy
path whenever token 2 would win.) ``--weight-scale`` multiplies the 2-D weights after the 0.02
init (default 1, the plain init). Tokens/s counts new tokens only (batch x new tokens / seconds,
prefill included).
"""

from __future__ import annotations

import argparse
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import append_benchmark, loadavg, machine, markdown_table, median, spread  # noqa: E402

from lmforge.data.corpus import embedded_corpus  # noqa: E402
from lmforge.models.generate import generate  # noqa: E402
from lmforge.models.hf import hf_state_dict_from_lmforge  # noqa: E402
from lmforge.models.model import Transformer, model_args_for  # noqa: E402
from lmforge.models.tokenizer import load_tokenizer  # noqa: E402
from throughput import hf_config  # noqa: E402


def build_pair(size: str, vocab: int, device: torch.device, weight_scale: float):
    from transformers import LlamaForCausalLM

    args = model_args_for(size, vocab)
    ours = Transformer(args)
    ours.init_weights(seed=0)
    with torch.no_grad():
        for p in ours.parameters():
            if p.dim() == 2:
                p.mul_(weight_scale)
    theirs = LlamaForCausalLM(hf_config(args))
    theirs.config.eos_token_id = theirs.generation_config.eos_token_id = None  # no stop token, nothing banned
    missing, unexpected = theirs.load_state_dict(hf_state_dict_from_lmforge(ours.state_dict(), args), strict=False)
    if unexpected or [k for k in missing if k != "lm_head.weight"]:
        raise RuntimeError(f"weight conversion mismatch: missing {missing}, unexpected {unexpected}")
    return ours.to(device).eval(), theirs.to(device).eval()


def prompts_for(batch: int, length: int) -> list[list[int]]:
    tok = load_tokenizer("byte")
    docs = [d for d in embedded_corpus("train") if len(tok.encode(d)) >= length]
    return [tok.encode(docs[i % len(docs)])[:length] for i in range(batch)]


def run_lmforge(model: Transformer, prompts: list[list[int]], new: int) -> tuple[float, list[list[int]]]:
    t0 = time.perf_counter()
    out = generate(model, prompts, new, eos_id=None, pad_id=0, temperature=0.0)
    if model.tok_embeddings.weight.device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - t0, out


@contextmanager
def module_path(model: Transformer) -> Iterator[None]:
    """Make ``generate`` run the model's own forward per step (any forward hook rules out the fused step)."""
    handle = model.register_forward_hook(lambda *_: None)
    try:
        yield
    finally:
        handle.remove()


def run_hf(model, prompts: list[list[int]], new: int, device: torch.device) -> tuple[float, list[list[int]]]:
    ids = torch.tensor(prompts, device=device)
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new,
                             do_sample=False, pad_token_id=0)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - t0, out[:, ids.shape[1]:].tolist()


SYSTEMS = ("lmforge", "lmforge-modules", "transformers")


def run_system(name: str, ours: Transformer, theirs, prompts: list[list[int]], new: int,
               device: torch.device) -> tuple[float, list[list[int]]]:
    if name == "transformers":
        return run_hf(theirs, prompts, new, device)
    if name == "lmforge-modules":
        with module_path(ours):
            return run_lmforge(ours, prompts, new)
    return run_lmforge(ours, prompts, new)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="debug,small")
    p.add_argument("--batch", default="8,64", help="comma-separated batch sizes")
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--weight-scale", type=float, default=1.0)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--no-append", action="store_true")
    a = p.parse_args(argv)
    device = torch.device(a.device)
    if device.type == "cpu":
        torch.set_num_threads(a.threads)
    vocab = load_tokenizer("byte").vocab_size
    load_before = loadavg()
    rows = []
    for size in a.sizes.split(","):
        ours, theirs = build_pair(size, vocab, device, a.weight_scale)
        for batch in (int(b) for b in a.batch.split(",")):
            prompts = prompts_for(batch, a.prompt_len)
            for name in SYSTEMS:  # warm-up: first calls pay for allocation and kernel selection
                run_system(name, ours, theirs, prompts, 4, device)
            speed: dict[str, list[float]] = {n: [] for n in SYSTEMS}
            outs: dict[str, list[list[int]]] = {}
            for r in range(a.repeats):
                order = SYSTEMS[r % len(SYSTEMS):] + SYSTEMS[:r % len(SYSTEMS)]  # rotate who goes first
                for name in order:
                    dt, outs[name] = run_system(name, ours, theirs, prompts, a.new_tokens, device)
                    speed[name].append(batch * a.new_tokens / dt)
                if any([len(x) for x in o] != [a.new_tokens] * batch for o in outs.values()):
                    raise RuntimeError("the generators produced different numbers of tokens")
            hf = median(speed["transformers"])
            ref = outs["transformers"]
            for name in SYSTEMS:
                same = sum(u == v for x, y in zip(outs[name], ref) for u, v in zip(x, y))
                rows.append([size, f"{ours.num_params() / 1e6:.1f}M", str(batch), name,
                             f"{median(speed[name]):,.0f}", spread(speed[name]), f"{median(speed[name]) / hf:.2f}",
                             f"{same}/{batch * a.new_tokens}"])
                print(" | ".join(rows[-1]), flush=True)
    header = ["size", "params", "batch", "system", "tokens/s (median)", "range", "vs transformers",
              "greedy tokens equal to transformers'"]
    table = markdown_table(header, rows)
    print()
    print(table)
    body = (f"Machine: {machine(device)}. Load average before/after: {load_before} / {loadavg()}.\n\n"
            f"Settings: prompt {a.prompt_len} tokens, {a.new_tokens} new tokens (greedy, no early stop), weights "
            f"x{a.weight_scale:g} after init, {a.repeats} interleaved repeats, device {device}"
            + (f", {a.threads} threads" if device.type == "cpu" else "") + ", fp32.\n\n"
            f"Command: `python bench/generate.py {' '.join(sys.argv[1:] if argv is None else argv)}`\n\n"
            + table + "\n")
    if not a.no_append:
        append_benchmark("Generation throughput", body)
        print("appended to BENCHMARKS.md")


if __name__ == "__main__":
    main()
