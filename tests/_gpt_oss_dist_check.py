"""Run under torchrun with 2 CPU ranks (see test_gpt_oss.py): gpt-oss under context and expert parallelism
against one process, reusing the checks the other families pass (_cp_check.py, _ep_check.py) with a tiny
gpt-oss: sinks on every layer, alternating sliding (window 5) and full layers, YaRN, biased router and
experts. Sinks and biases are drawn at random after the init (which zeroes them) so a wrong mapping shows.

1. cp=2: a packed batch (documents crossing the ranks' chunks) and a plain causal one; the summed loss,
   the hidden states put back in row order and every gradient summed over the pair equal one process's.
2. ep=2 with FSDP2 over the same two ranks: loss, routing statistics, every gradient (the experts' biases
   among them) and the clipped norm equal one process's.
Rank 0 writes the largest relative errors of part 1 to ``argv[1]``.
"""

import json
import sys

import torch
from torch.distributed.device_mesh import init_device_mesh

import _cp_check
import _ep_check
from lmforge import distributed as dist_utils
from lmforge.runtime.world import init_distributed
from lmforge.models.gpt_oss import GptOssArgs
from lmforge.models.model import Transformer

YARN = dict(rope_type="yarn", factor=4.0, beta_fast=32.0, beta_slow=1.0, truncate=False,
            original_max_position_embeddings=8)
CP_ARGS = GptOssArgs(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, vocab_size=64, max_seq_len=32,
                     ffn_hidden_dim=16, n_experts=4, n_experts_per_token=2, sliding_window=5, swiglu_limit=1.5,
                     rope_scaling=YARN)
EP_ARGS = GptOssArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, vocab_size=256, max_seq_len=64,
                     ffn_hidden_dim=32, n_experts=4, n_experts_per_token=2, sliding_window=5, swiglu_limit=1.5,
                     rope_scaling=YARN)


class RandomSinksAndBiases(Transformer):
    """The model with its sinks and biases drawn (same values on every rank and in the reference)."""

    def init_weights(self, seed=None) -> None:  # type: ignore[override]
        super().init_weights(seed)
        g = torch.Generator().manual_seed(7)
        with torch.no_grad():
            for name, p in self.named_parameters():
                if name.rsplit(".", 1)[-1] in ("sinks", "bias", "b1", "b2", "b3"):
                    p.copy_(0.5 * torch.randn(p.shape, generator=g))


def main() -> None:
    torch.manual_seed(0)
    info = init_distributed("cpu")
    _cp_check.Transformer = RandomSinksAndBiases
    _ep_check.Transformer = RandomSinksAndBiases
    _ep_check.TINY_MOE = EP_ARGS
    errors: dict[str, float] = {}
    cp_mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("cp",))
    _cp_check.part1(CP_ARGS, _cp_check.packed_batch(2, seed=1), cp_mesh["cp"], "gpt_oss_packed", errors)
    _cp_check.part1(CP_ARGS, _cp_check.plain_batch(2, seed=2), cp_mesh["cp"], "gpt_oss_causal", errors)
    pair = init_device_mesh("cpu", (1, 1, 2), mesh_dim_names=("group", "dp_shard_mod_ep", "ep"))
    _ep_check.model_check(pair, seed=0)
    if info.rank == 0:
        with open(sys.argv[1], "w") as f:
            json.dump(errors, f)
        print("gpt-oss distributed check passed")
    dist_utils.shutdown()


if __name__ == "__main__":
    main()
