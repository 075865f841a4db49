"""The log-prob gap between GRPO's trainer and its rollout engine on MoE policies, with and without
routing replay (``grpo.router_replay``).

    python bench/router_replay_gap.py                    # 5 families x 3 seeds, bf16 rollouts (~1 min on 2 CPUs)
    python bench/router_replay_gap.py --rollout-dtype float32 --append

For each MoE family (qwen3_moe, mixtral, olmoe, deepseek_v3, gpt_oss) a tiny random model is built by
transformers (its own initialisation: router weights ~ N(0, 0.02), so router scores lie close together
as in a real model's many near-tied experts) and loaded into lmforge. lmforge's rollout engine samples
``--prompts`` x ``--samples`` completions of ``--new-tokens`` tokens at temperature 1 in the rollout
precision (bf16 autocast) and records the behaviour log-probs and the experts every MoE layer routed each
token to. The fp32 trainer then computes the log-probs of the same sampled tokens (teacher-forced, as the
GRPO loss does) twice: re-routing every token itself, and replaying the engine's experts. Columns:

* ``gap``: mean |log pi_trainer - log pi_engine| over the sampled tokens (``grpo/rollout_logprob_gap``);
* ``max``: the largest per-token gap;
* ``flips``: the share of (token, MoE layer) pairs whose fp32 top-k set differs from the engine's.

With ``--rollout-dtype float32`` the engine and the trainer compute in the same precision: both gaps
are 0 (the control). ``--router-spread S`` makes the routers nearly tie, as a large model's many experts
often do: every expert's row is one shared random direction (std 0.5) plus ``S`` x 0.5 of its own, router
biases 0; the shared part's bf16 rounding then decides between experts far more often.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import append_benchmark, machine, markdown_table  # noqa: E402

FAMILIES = ["qwen3_moe", "mixtral", "olmoe", "deepseek_v3", "gpt_oss"]
VOCAB = 256


def hf_config(family: str):  # noqa: ANN201 - a transformers config
    """A tiny config of ``family``: 2 layers of width 64 (deepseek_v3: 3, its first dense), 4-8 experts, top-2."""
    import transformers

    common = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=128, rms_norm_eps=1e-6,
                  bos_token_id=None, eos_token_id=None, pad_token_id=0)
    rope = dict(rope_type="default", rope_theta=1e4)
    if family == "qwen3_moe":
        return transformers.Qwen3MoeConfig(**common, head_dim=16, num_experts=8, num_experts_per_tok=2,
                                           moe_intermediate_size=32, norm_topk_prob=True, rope_parameters=rope)
    if family == "mixtral":
        return transformers.MixtralConfig(**common, num_local_experts=8, num_experts_per_tok=2, rope_parameters=rope)
    if family == "olmoe":
        return transformers.OlmoeConfig(**common, num_experts=8, num_experts_per_tok=2, rope_parameters=rope)
    if family == "deepseek_v3":
        return transformers.DeepseekV3Config(
            **{**common, "num_hidden_layers": 3, "num_key_value_heads": 4}, moe_intermediate_size=32,
            n_routed_experts=8, num_experts_per_tok=2, n_group=4, topk_group=2, first_k_dense_replace=1,
            q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=12, qk_rope_head_dim=8, v_head_dim=10,
            num_nextn_predict_layers=0, rope_parameters=rope)
    if family == "gpt_oss":
        return transformers.GptOssConfig(**common, head_dim=16, num_local_experts=8, num_experts_per_tok=2,
                                         sliding_window=16, layer_types=["sliding_attention", "full_attention"],
                                         rope_parameters=rope)
    raise ValueError(family)


def tiny_model(family: str, seed: int, where: Path, spread: float) -> torch.nn.Module:
    import transformers

    from lmforge.models.hf import load_hf_model
    from lmforge.models.layers.routing_replay import moe_layers

    torch.manual_seed(seed)
    hf = transformers.AutoModelForCausalLM.from_config(hf_config(family))
    out = where / f"{family}-{seed}"
    hf.save_pretrained(out)
    model = load_hf_model(out)
    if spread:
        with torch.no_grad():
            for m in moe_layers(model):
                w = m.router.weight
                w.copy_(0.5 * (torch.randn(1, w.shape[1]) + spread * torch.randn(w.shape)))
                if m.router.bias is not None:
                    m.router.bias.zero_()
    return model


def measure(model: torch.nn.Module, seed: int, args: argparse.Namespace) -> tuple[float, float, float, float, float]:
    """(gap re-routed, gap replayed, max re-routed, max replayed, flips) of one model."""
    from lmforge.models.layers.routing_replay import recorded_routes
    from lmforge.objectives.grpo import policy_rows, token_logprobs
    from lmforge.rl.engines.base import SamplingSettings
    from lmforge.rl.engines.lmforge_engine import LmforgeEngine
    from lmforge.rl.rollout import dense_logprobs, dense_routes

    autocast = torch.autocast("cpu", dtype=torch.bfloat16) if args.rollout_dtype == "bfloat16" else None
    engine = LmforgeEngine(pad_id=0, autocast=autocast, record_routes=True)
    engine.load_weights(model, 0)
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(1, VOCAB, (args.prompt_tokens,), generator=g).tolist()
               for _ in range(args.prompts) for _ in range(args.samples)]
    comps = engine.generate(prompts, SamplingSettings(args.new_tokens, 1.0), seed=seed, logprobs=True)
    batch = policy_rows(prompts, [c.token_ids for c in comps], [True] * len(comps), 0, torch.zeros(len(comps)),
                        torch.device("cpu"))
    behaviour = dense_logprobs(prompts, [c.logprobs for c in comps], batch.targets.shape, torch.device("cpu"))
    mask = batch.mask > 0
    rerouted = token_logprobs(model, batch, 1.0)
    fp32_routes = recorded_routes(model, len(comps))
    batch.routes = dense_routes([c.routes for c in comps], batch.input_ids.shape, torch.device("cpu"))
    replayed = token_logprobs(model, batch, 1.0)
    real = torch.zeros(batch.input_ids.shape, dtype=torch.bool)
    for i, (p, c) in enumerate(zip(prompts, comps)):
        real[i, : len(p) + len(c.token_ids) - 1] = True
    a, b = fp32_routes.sort(-1).values, batch.routes.sort(-1).values
    flips = (a != b).any(-1)[:, real].float().mean().item()
    gap = lambda lp: (lp - behaviour).abs()[mask]  # noqa: E731
    return gap(rerouted).mean().item(), gap(replayed).mean().item(), gap(rerouted).max().item(), \
        gap(replayed).max().item(), flips


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--families", default=",".join(FAMILIES))
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--samples", type=int, default=4)
    ap.add_argument("--prompt-tokens", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--rollout-dtype", choices=["bfloat16", "float32"], default="bfloat16")
    ap.add_argument("--router-spread", type=float, default=0.0,
                    help="near-tied routers: a shared direction plus this share of each expert's own (0: as initialised)")
    ap.add_argument("--append", action="store_true", help="append the table to BENCHMARKS.md")
    args = ap.parse_args()
    torch.set_num_threads(2)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for family in args.families.split(","):
            runs = [measure(tiny_model(family, s, Path(tmp), args.router_spread), s, args) for s in range(args.seeds)]
            mean = [sum(r[i] for r in runs) / len(runs) for i in range(5)]
            rows.append([family, f"{mean[0]:.2e}", f"{mean[1]:.2e}", f"{max(r[2] for r in runs):.2e}",
                         f"{max(r[3] for r in runs):.2e}", f"{mean[4]:.1%}", f"{mean[0] / mean[1]:.1f}x" if mean[1] else "-"])
    table = markdown_table(["family", "gap re-routed", "gap replayed", "max re-routed", "max replayed",
                            "flips", "gap falls"], rows)
    spread = f" --router-spread {args.router_spread:g}" if args.router_spread else ""
    body = (f"`python bench/router_replay_gap.py --rollout-dtype {args.rollout_dtype}{spread}`: {args.rollout_dtype} rollouts "
            f"vs the fp32 trainer, {args.prompts}x{args.samples} completions of {args.new_tokens} tokens, mean over "
            f"{args.seeds} seeds (max: over all), {machine(torch.device('cpu'))}.\n\n{table}\n")
    print(body)
    if args.append:
        append_benchmark("MoE routing replay: trainer vs rollout log-prob gap", body)


if __name__ == "__main__":
    main()
