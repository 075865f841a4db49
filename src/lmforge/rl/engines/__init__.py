"""Rollout engines: what samples completions for GRPO.

An engine turns prompt token ids into completions (token ids, and the log-probs of the sampled tokens
where the engine reports them) and takes new policy weights after optimizer steps. The trainer never
knows which engine it talks to:

* ``lmforge`` (:mod:`.lmforge_engine`): the built-in KV-cache decoder on the trainer's own model.
* ``vllm`` (:mod:`.vllm_engine`): vLLM, in the trainer's process (``grpo.vllm_mode=colocate``) or as one
  or several servers (``grpo.vllm_mode=server``: vLLM's own API server with lmforge's worker extension and
  routes, :mod:`.vllm_api`; or lmforge's small :mod:`.vllm_server`), spread over by :mod:`.server_pool`,
  synced by file or in memory (:mod:`.weight_transfer`).
"""

from lmforge.rl.engines.base import Completion, RolloutEngine, SamplingSettings

__all__ = ["Completion", "RolloutEngine", "SamplingSettings"]
