"""The engine a GRPO run samples with (``grpo.engine``), built from the run's policy (the engines and
their capabilities are listed in :mod:`lmforge.rl.engines.kinds`)."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import torch.distributed as dist

from lmforge.errors import UserError
from lmforge.rl.engines.base import RolloutEngine
from lmforge.rl.engines.kinds import ENGINES, EngineKind, engine_kind, resolve  # noqa: F401 (re-exported)
from lmforge.rl.engines.lmforge_engine import LmforgeEngine
from lmforge.rl.engines.snapshot import WeightSnapshots, default_sync_dir, full_cpu_state
from lmforge.runtime import Runtime


def rollout_dtype(rt: Runtime, g: Any) -> str:
    """``grpo.rollout_dtype`` with ``auto`` resolved to the training precision."""
    return rt.model.dtype if g.rollout_dtype == "auto" else g.rollout_dtype


def write_model_dir(rt: Runtime, out: Path, base_only: bool = False) -> None:
    """A Hugging Face directory of the current policy for an engine to start on (main rank writes);
    ``base_only``: a LoRA policy's base without its adapters (the engine applies those itself)."""
    from lmforge.data.chat import stop_token_ids
    from lmforge.exporters import write_tokenizer_files
    from lmforge.models.hf import save_hf_model
    from lmforge.models.lora import base_state

    # full_cpu_state is a collective under FSDP2: every rank (adapter-only sync runs without FSDP2)
    state = base_state(rt.model.raw) if base_only else full_cpu_state(rt.model.raw)
    if rt.world.dist.is_main:
        stops = stop_token_ids(rt.model.tokenizer)
        save_hf_model(state, rt.model.args, out, bos_token_id=rt.model.tokenizer.bos_id, pad_token_id=rt.model.tokenizer.pad_id,
                      eos_token_id=stops if len(stops) > 1 else stops[0])
        write_tokenizer_files(rt.model.tokenizer, out)
    if dist.is_initialized():
        dist.barrier()


def build_lmforge_engine(rt: Runtime, g: Any, autocast: Any, own_copy: bool) -> RolloutEngine:
    return LmforgeEngine(pad_id=rt.model.tokenizer.pad_id, autocast=autocast, copy_weights=own_copy,
                         lockstep=rt.world.dist.world_size > 1 and not own_copy,
                         chunk_tokens=rt.cfg.training.loss_chunk_tokens, record_routes=g.router_replay)


def build_vllm_engine(rt: Runtime, g: Any, autocast: Any, own_copy: bool) -> RolloutEngine:
    dtype = rollout_dtype(rt, g)
    seed = rt.cfg.training.seed + 7919 * rt.world.dist.rank
    where = [str(g.vllm_sync_dir or (default_sync_dir() if rt.world.dist.is_main else ""))]
    if dist.is_initialized():  # one directory for all ranks
        dist.broadcast_object_list(where, src=0)
    snapshots = WeightSnapshots(Path(where[0]), owned=not g.vllm_sync_dir, writes=rt.world.dist.is_main)
    try:
        return _vllm_engine(rt, g, snapshots, dtype, seed)
    except BaseException:  # no engine to close it later: the snapshot directory goes now
        snapshots.close()
        raise


def make_engine(rt: Runtime, g: Any, *, autocast: Any, own_copy: bool) -> RolloutEngine:
    """``own_copy``: the engine must not sample from the trainer's parameters as they change (async)."""
    return resolve(engine_kind(g.engine).build)(rt, g, autocast, own_copy)


def _vllm_engine(rt: Runtime, g: Any, snapshots: WeightSnapshots, dtype: str, seed: int) -> RolloutEngine:
    if g.vllm_mode == "server" and g.vllm_url:
        from lmforge.rl.engines.openai_backend import connect

        return _served(rt, g, snapshots, dtype, [connect(u, timeout_s=g.vllm_timeout_s) for u in g.vllm_url])
    model_dir = rt.world.run_dir / "engine_model"
    try:
        return _started_engine(rt, g, snapshots, dtype, seed, model_dir)
    except BaseException:  # a full copy of the model must not stay behind in the run directory
        if rt.world.dist.is_main:
            shutil.rmtree(model_dir, ignore_errors=True)
        raise


def _served(rt: Runtime, g: Any, snapshots: WeightSnapshots, dtype: str, servers: list[Any]) -> RolloutEngine:
    """An engine over rollout servers: each checked to serve this policy's model and tokenizer, and with
    ``grpo.weight_sync=memory`` joined to rank 0 by a weight-transfer group."""
    import torch

    from lmforge.rl.engines import vllm_engine
    from lmforge.rl.engines.openai_backend import VllmApiBackend, check_served_model
    from lmforge.rl.engines.server_pool import ServerPool

    pool = ServerPool(servers)
    try:
        for server in servers:
            if isinstance(server, VllmApiBackend):
                check_served_model(server, rt.model.args, rt.model.tokenizer)
            elif g.weight_sync == "memory":
                raise UserError(f"grpo.weight_sync=memory: {server.url} is not vLLM's API server with lmforge's "
                                "routes (python -m lmforge.rl.engines.vllm_api)")
        memory_dtype = None
        if g.weight_sync == "memory":
            memory_dtype = getattr(torch, dtype) if dtype != "auto" else torch.float32
            if rt.world.dist.is_main:
                pool.init_transfer(rt.world.dist.device if rt.world.dist.device.type == "cuda" else torch.device("cpu"))
        return vllm_engine.VllmEngine(pool, snapshots, loads=rt.world.dist.is_main, shared=True, memory_dtype=memory_dtype)
    except BaseException:
        pool.close()
        raise


def _started_engine(rt: Runtime, g: Any, snapshots: WeightSnapshots, dtype: str, seed: int,
                    model_dir: Path) -> RolloutEngine:
    """An engine lmforge starts on ``model_dir``, a copy of the current policy written for it."""
    from lmforge.rl.engines import vllm_engine
    from lmforge.rl.engines.openai_backend import VllmApiBackend, start_server

    from lmforge.rl.engines.lora_sync import adapter_sync_plan

    max_len = rt.model.args.max_seq_len
    lora_rank = adapter_sync_plan(rt.cfg.lora, g, rt.model.args)[0]
    write_model_dir(rt, model_dir, base_only=bool(lora_rank))
    if g.vllm_mode == "server":
        backend = None
        if rt.world.dist.is_main:
            backend = start_server(vllm_engine.python_for_server(g.vllm_python), model_dir,
                                   weights_dir=snapshots.dir, dtype=dtype, seed=seed,
                                   max_model_len=max_len, log=rt.world.run_dir / "vllm_server.log")
        url = [(backend.url, backend.secret) if backend else None]
        if dist.is_initialized():  # the other ranks sample from it too, with its secret
            dist.broadcast_object_list(url, src=0)
        backend = backend or VllmApiBackend(str(url[0][0]), secret=url[0][1])
        return _served(rt, g, snapshots, dtype, [backend])
    runner = vllm_engine.colocated_runner(model_dir, dtype=dtype, seed=seed, max_model_len=max_len,
                                          gpu_memory_utilization=g.vllm_gpu_memory_utilization, max_lora_rank=lora_rank)
    adapters = (rt.cfg.lora.model_dump(), str(model_dir.resolve())) if lora_rank else None
    return vllm_engine.VllmEngine(runner, snapshots, loads=True, shared=False, adapters=adapters)
