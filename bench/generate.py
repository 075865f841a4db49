"""Generation throughput: lmforge's batched KV-cache ``generate`` vs ``transformers`` ``generate``.

    python bench/generate.py                     # debug and small models, batch 8, 2 threads
    python bench/generate.py --batch 16 --new-tokens 128

Both run greedy decoding on the same weights (the lmforge model converted with ``lmforge.models.hf``),
the same prompts (equal lengths, so no padding differences) and the same number of new tokens:
lmforge with ``eos_id=None`` and transformers with ``min_new_tokens == max_new_tokens``, so neither
can stop early; the script checks that both returned the same token counts, and reports how many
of the generated tokens agree (greedy decoding of the same weights should agree almost
everywhere; tiny fp differences may flip a near-tie and change the rest of that row).
Tokens/s counts new tokens only (batch x new tokens / seconds, prefill included).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import append_benchmark, loadavg, machine, markdown_table, median, spread  # noqa: E402

from lmforge.data.corpus import embedded_corpus  # noqa: E402
from lmforge.models.generate import generate  # noqa: E402
from lmforge.models.hf import hf_state_dict_from_lmforge  # noqa: E402
from lmforge.models.model import Transformer, model_args_for  # noqa: E402
from lmforge.models.tokenizer import load_tokenizer  # noqa: E402
from throughput import hf_config  # noqa: E402


def build_pair(size: str, vocab: int, device: torch.device):
    from transformers import LlamaForCausalLM

    args = model_args_for(size, vocab)
    ours = Transformer(args)
    ours.init_weights(seed=0)
    theirs = LlamaForCausalLM(hf_config(args))
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
    return time.perf_counter() - t0, out


def run_hf(model, prompts: list[list[int]], new: int, device: torch.device) -> tuple[float, list[list[int]]]:
    ids = torch.tensor(prompts, device=device)
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new,
                             min_new_tokens=new, do_sample=False, pad_token_id=0)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - t0, out[:, ids.shape[1]:].tolist()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="debug,small")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--no-append", action="store_true")
    a = p.parse_args(argv)
    device = torch.device(a.device)
    if device.type == "cpu":
        torch.set_num_threads(a.threads)
    prompts = prompts_for(a.batch, a.prompt_len)
    vocab = load_tokenizer("byte").vocab_size
    load_before = loadavg()
    rows = []
    for size in a.sizes.split(","):
        ours, theirs = build_pair(size, vocab, device)
        # warm-up: first calls pay for allocation and kernel selection
        run_lmforge(ours, prompts, 4)
        run_hf(theirs, prompts, 4, device)
        times: dict[str, list[float]] = {"lmforge": [], "hf": []}
        agree = total = 0
        for r in range(a.repeats):
            for name in (("lmforge", "hf") if r % 2 == 0 else ("hf", "lmforge")):
                if name == "lmforge":
                    dt, ours_out = run_lmforge(ours, prompts, a.new_tokens)
                else:
                    dt, hf_out = run_hf(theirs, prompts, a.new_tokens, device)
                times[name].append(a.batch * a.new_tokens / dt)
            if [len(x) for x in ours_out] != [len(x) for x in hf_out] or len(ours_out[0]) != a.new_tokens:
                raise RuntimeError("the two generators produced different numbers of tokens")
            if r == 0:
                for x, y in zip(ours_out, hf_out):
                    agree += sum(1 for u, v in zip(x, y) if u == v)
                    total += len(x)
        lf, hf = median(times["lmforge"]), median(times["hf"])
        print(f"{size}: lmforge {lf:,.0f} tokens/s, transformers {hf:,.0f} tokens/s, ratio {lf / hf:.2f}, "
              f"greedy tokens equal {agree}/{total}", flush=True)
        rows.append([size, f"{ours.num_params() / 1e6:.1f}M", f"{lf:,.0f}", spread(times["lmforge"]),
                     f"{hf:,.0f}", spread(times["hf"]), f"{lf / hf:.2f}", f"{agree}/{total}"])
    header = ["size", "params", "lmforge tokens/s", "range", "transformers tokens/s", "range",
              "lmforge / transformers", "same greedy tokens"]
    table = markdown_table(header, rows)
    print()
    print(table)
    body = (f"Machine: {machine(device)}. Load average before/after: {load_before} / {loadavg()}.\n\n"
            f"Settings: batch {a.batch}, prompt {a.prompt_len} tokens, {a.new_tokens} new tokens (greedy, no "
            f"early stop), {a.repeats} interleaved repeats, device {device}"
            + (f", {a.threads} threads" if device.type == "cpu" else "") + ", fp32.\n\n"
            f"Command: `python bench/generate.py {' '.join(sys.argv[1:] if argv is None else argv)}`\n\n"
            + table + "\n")
    if not a.no_append:
        append_benchmark("Generation throughput", body)
        print("appended to BENCHMARKS.md")


if __name__ == "__main__":
    main()
