"""MoE routing replay (``grpo.router_replay``): the trainer's forwards send every token to the experts the
rollout engine recorded, the router keeps its gradient, activation checkpointing recomputes with the same
experts, the trainer-engine log-prob gap falls, and the key's bad combinations are one line each."""

from __future__ import annotations

import pytest
import torch

from lmforge.models.hf import load_hf_model
from lmforge.models.layers.routing_replay import moe_layers, recorded_routes, replay_disagreement, replay_routes
from lmforge.objectives.grpo import policy_rows, token_logprobs
from lmforge.rl.engines.base import SamplingSettings
from lmforge.rl.engines.lmforge_engine import LmforgeEngine
from lmforge.rl.rollout import dense_logprobs, dense_routes

from test_families import VOCAB, tiny_hf
from test_grpo import tiny_task  # noqa: F401 - the fixture is used by name

transformers = pytest.importorskip("transformers")
FAMILIES = ["qwen3_moe", "mixtral", "olmoe", "deepseek_v3", "gpt_oss"]


@pytest.fixture(scope="module", params=FAMILIES)
def moe(request, tmp_path_factory):
    """A tiny random model of one MoE family whose routers nearly tie: every expert's row is one shared
    direction plus 0.5% of its own and the biases are 0, so a score's bf16 rounding error (of the shared part)
    is as large as the differences between experts, and bf16 and fp32 route many tokens differently (as the
    many near-tied experts of a large model do now and then)."""
    d = tmp_path_factory.mktemp(request.param)
    tiny_hf(request.param).save_pretrained(d)
    model = load_hf_model(d)
    torch.manual_seed(1)
    with torch.no_grad():
        for m in moe_layers(model):
            w = m.router.weight
            w.copy_(0.5 * torch.randn(1, w.shape[1]) + 0.0025 * torch.randn(w.shape))
            if m.router.bias is not None:
                m.router.bias.zero_()
    return request.param, model


def bf16_rollout(model, n: int = 8, new_tokens: int = 16):
    """``n`` completions sampled by lmforge's engine in bf16, with their log-probs and recorded experts."""
    engine = LmforgeEngine(pad_id=0, autocast=torch.autocast("cpu", dtype=torch.bfloat16), record_routes=True)
    engine.load_weights(model, 0)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(1, VOCAB, (12,), generator=g).tolist() for _ in range(n)]
    comps = engine.generate(prompts, SamplingSettings(new_tokens, 1.0), seed=3, logprobs=True)
    batch = policy_rows(prompts, [c.token_ids for c in comps], [True] * n, 0, torch.zeros(n), torch.device("cpu"))
    for p, c in zip(prompts, comps):
        assert c.routes.shape == (len(moe_layers(model)), len(p) + len(c.token_ids) - 1, 2)
    behaviour = dense_logprobs(prompts, [c.logprobs for c in comps], batch.targets.shape, torch.device("cpu"))
    routes = dense_routes([c.routes for c in comps], batch.input_ids.shape, torch.device("cpu"))
    return batch, behaviour, routes


def test_trainer_forward_uses_exactly_the_engines_experts(moe):
    """Every MoE layer of the fp32 trainer forward sends every token to the experts the bf16 engine chose,
    where re-routing would have chosen others for some."""
    _, model = moe
    batch, _, routes = bf16_rollout(model)
    token_logprobs(model, batch, 1.0)
    natural = recorded_routes(model, batch.input_ids.shape[0])
    assert not torch.equal(natural.sort(-1).values, routes.sort(-1).values)  # fp32 alone flips some
    batch.routes = routes
    token_logprobs(model, batch, 1.0)
    assert torch.equal(recorded_routes(model, batch.input_ids.shape[0]), routes)
    # what grpo/route_flips logs: where a router would have chosen otherwise (the first MoE layer's input
    # is the same with and without replay: its re-routing is the plain forward's)
    differs = (natural.sort(-1).values != routes.sort(-1).values).any(-1)
    first = moe_layers(model)[0].router.disagreement.reshape(batch.input_ids.shape)
    assert torch.equal(first, differs[0])
    flips = replay_disagreement(model, batch.input_ids.shape)
    assert flips.shape == batch.input_ids.shape and 0 < flips.mean() < 1
    assert all(m.replay is None for m in moe_layers(model))  # cleared after the forward


def test_replay_gap_falls(moe):
    """The trainer-engine log-prob gap over the sampled tokens (bf16 engine, fp32 trainer) is smaller with
    replay, on average and at its worst token (bench/router_replay_gap.py measures it)."""
    _, model = moe
    batch, behaviour, routes = bf16_rollout(model)
    mask = batch.mask > 0
    rerouted = (token_logprobs(model, batch, 1.0) - behaviour).abs()[mask]
    batch.routes = routes
    replayed = (token_logprobs(model, batch, 1.0) - behaviour).abs()[mask]
    assert replayed.mean() < rerouted.mean() and replayed.max() < rerouted.max(), (replayed.max(), rerouted.max())


def random_routes(model, B: int, T: int, seed: int = 0) -> torch.Tensor:
    """k distinct random experts per token and MoE layer: routing no router would choose."""
    g = torch.Generator().manual_seed(seed)
    layers = moe_layers(model)
    E, k = layers[0].n_experts, layers[0].top_k
    return torch.stack([torch.rand(B, T, E, generator=g).argsort(-1)[..., :k] for _ in layers]).to(torch.int16)


def test_replaying_own_routing_is_bit_identical_and_the_router_learns(moe):
    """Replaying the experts a forward chose itself changes no logit and no gradient (the replay is the
    routing, not an approximation); replaying other experts changes the output and still trains the router."""
    _, model = moe
    x = torch.randint(1, VOCAB, (2, 16), generator=torch.Generator().manual_seed(5))

    def run(routes):
        model.zero_grad()
        with replay_routes(model, routes):
            out = model(x)
        out.square().mean().backward()
        return out.detach(), [p.grad.clone() for p in model.parameters() if p.grad is not None]

    plain, g_plain = run(None)
    own = recorded_routes(model, 2)
    again, g_again = run(own)
    assert torch.equal(plain, again)
    assert all(torch.equal(a, b) for a, b in zip(g_plain, g_again))
    other, _ = run(random_routes(model, 2, 16))
    assert not torch.allclose(other, plain)
    assert all(m.router.weight.grad.abs().sum() > 0 for m in moe_layers(model))


def test_activation_checkpointing_recomputes_with_the_replayed_experts(moe, tmp_path):
    """Under activation checkpointing the blocks' forwards run again inside backward, after the replay's
    context has closed: they must route as the replayed forward did (else other experts' gradients)."""
    from lmforge.parallel.plans import apply_activation_checkpointing

    family, model = moe
    x = torch.randint(1, VOCAB, (2, 16), generator=torch.Generator().manual_seed(6))
    routes = random_routes(model, 2, 16, seed=1)

    def grads(m):
        m.zero_grad()
        with replay_routes(m, routes):
            out = m(x)
        out.square().mean().backward()
        return {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}

    want = grads(model)
    tiny_hf(family).save_pretrained(tmp_path)
    ac = load_hf_model(tmp_path)
    ac.load_state_dict(model.state_dict())
    apply_activation_checkpointing(ac)
    got = grads(ac)
    assert len(got) == len(want)
    for (n, a), b in zip(want.items(), got.values()):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6, msg=n)


def test_replay_of_the_wrong_shape_is_refused(moe):
    _, model = moe
    x = torch.randint(1, VOCAB, (2, 8))
    with pytest.raises(ValueError, match="routing replay of"):
        with replay_routes(model, random_routes(model, 2, 9)):
            model(x)
    with pytest.raises(ValueError, match="MoE layers for a model with"):
        with replay_routes(model, random_routes(model, 2, 8)[:0]):
            pass


def test_router_replay_refusals_are_one_line():
    from lmforge.config import load_config
    from lmforge.errors import UserError
    from lmforge.recipes.grpo import GRPOConfig

    with pytest.raises(UserError, match="engine .vllm. does not report them") as e:
        load_config(GRPOConfig, None, ["--grpo.router_replay=true", "--grpo.engine=vllm"])
    assert "\n" not in str(e.value)
    with pytest.raises(UserError, match="router_replay with grpo.environment"):
        load_config(GRPOConfig, None, ["--grpo.router_replay=true", "--grpo.environment=gsm8k_calculator"])
    assert load_config(GRPOConfig, None, ["--grpo.router_replay=true"]).grpo.router_replay


@pytest.fixture(scope="module")
def moe_start(tmp_path_factory):
    """A tiny random Mixtral with its real tokenizer: a ``model.from_hf`` directory GRPO can start on."""
    from _hf_models import hf_start

    return hf_start("mixtral", tmp_path_factory.mktemp("mixtral_start"))


def test_grpo_with_router_replay_logs_the_gap_and_resumes_exactly(tiny_task, moe_start):
    """A GRPO run of a MoE policy with bf16 rollouts replays the engine's routing (the gap between the
    trainer's and the engine's log-probs is logged), and 3 steps + resume to 4 of num_iterations=2
    (the checkpoint at 3 holds a rollout and its routes mid-use) logs what 4 straight steps log."""
    from test_grpo import _grpo

    common = dict(model_size=None, model_n_layers=None, model_dim=None, model_n_heads=None, model_n_kv_heads=None,
                  training_global_batch_size=8, training_micro_batch_size=4, grpo_num_generations=4,
                  grpo_max_new_tokens=5, grpo_num_iterations=2, optimizer_lr=1e-2, grpo_router_replay=True,
                  grpo_rollout_dtype="bfloat16", grpo_tis_cap=2.0, checkpoint_interval=3, tasks_eval_examples=0)
    common = {**common, "model_from_hf": str(moe_start)}
    straight, _ = _grpo(tiny_task, {"a": dict(common, training_steps=4, checkpoint_enabled=False),
                                    "b": dict(common, training_steps=3)})
    [resumed] = _grpo(tiny_task, {"b": dict(common, training_steps=4)})
    train = {r["step"]: r for r in straight if r["kind"] == "train"}
    assert all(0 < train[s]["grpo/rollout_logprob_gap"] < 0.05 for s in train)  # bf16 vs fp32, same routing
    # the loss's forward replays the engine's routes: at a rollout's first update (the engine's weights) few
    # tokens would be routed otherwise, at its second (after an update at lr 1e-2) many would
    assert train[1]["grpo/route_flips"] < 0.2 and train[2]["grpo/route_flips"] > 0.2
    after = {r["step"]: r for r in resumed if r["kind"] == "train"}
    keys = ("loss", "reward/mean", "grad_norm", "grpo/rollout_logprob_gap")
    assert [after[4][k] for k in keys] == pytest.approx([train[4][k] for k in keys], rel=1e-5)


def test_async_rollouts_replay_the_samplers_routes_and_resume_exactly(tiny_task, moe_start):
    """async_steps=1: the engine's copy (one update older) records the routes; 2 steps + resume to 3 (a
    round and its routes in flight at the checkpoint) logs what 3 straight steps log."""
    from test_grpo import _grpo

    common = dict(model_size=None, model_n_layers=None, model_dim=None, model_n_heads=None, model_n_kv_heads=None,
                  training_global_batch_size=8, training_micro_batch_size=8, grpo_num_generations=4,
                  grpo_max_new_tokens=4, grpo_async_steps=1, grpo_tis_cap=2.0, optimizer_lr=1e-2,
                  grpo_router_replay=True, checkpoint_interval=2, tasks_eval_examples=0, model_from_hf=str(moe_start))
    straight, _ = _grpo(tiny_task, {"a": dict(common, training_steps=3, checkpoint_enabled=False),
                                    "b": dict(common, training_steps=2)})
    [resumed] = _grpo(tiny_task, {"b": dict(common, training_steps=3)})
    a = {r["step"]: r for r in straight if r["kind"] == "train"}
    b = {r["step"]: r for r in resumed if r["kind"] == "train"}
    assert a[3]["rollout/staleness"] == 1.0 and a[3]["grpo/route_flips"] > 0  # older weights' routes replayed
    keys = ("loss", "reward/mean", "grad_norm", "grpo/rollout_logprob_gap", "grpo/route_flips")
    assert [b[3][k] for k in keys] == pytest.approx([a[3][k] for k in keys], rel=1e-5)


def test_router_replay_on_a_dense_model_is_one_line(tiny_task, capfd):
    from _helpers import lmforge_in_process
    from test_grpo import _grpo_args

    rc = lmforge_in_process(*_grpo_args("dense", grpo_router_replay=True, training_steps=1), cwd=tiny_task)
    err = capfd.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert rc == 2 and len(lines) == 1 and "has no mixture-of-experts layers" in lines[0], err[-1500:]


def test_a_lora_policys_reference_view_replays_too(moe):
    """Under LoRA the KL reference is the policy with its adapters off (BaseModelView, not a module of its
    own): its forward over a rollout replays the same experts."""
    import copy

    pytest.importorskip("peft")
    from lmforge.config import LoraSection
    from lmforge.models.lora import BaseModelView, apply_lora

    _, model = moe
    with torch.no_grad():  # the routing an earlier test's forward left holds its graph, which deepcopy refuses
        model(torch.ones(1, 2, dtype=torch.long))
    policy = apply_lora(copy.deepcopy(model), LoraSection(enabled=True, rank=2))
    batch, _, routes = bf16_rollout(policy, n=4, new_tokens=8)
    batch.routes = routes
    token_logprobs(BaseModelView(policy), batch, 1.0)
    assert torch.equal(recorded_routes(policy, 4), routes)


def test_router_replay_with_a_sharded_sequence_layout_is_one_line():
    from lmforge.config import ParallelSection
    from lmforge.errors import UserError
    from lmforge.rl.rollout_source import check_replay_layout

    check_replay_layout(ParallelSection())
    check_replay_layout(ParallelSection(tp=2, sequence_parallel=False))
    for kwargs, named in ((dict(cp=2), "parallel.cp=2"), (dict(pp=2), "parallel.pp=2"),
                          (dict(tp=2), "parallel.tp=2 with parallel.sequence_parallel")):
        with pytest.raises(UserError, match=f"grpo.router_replay with {named} is not supported"):
            check_replay_layout(ParallelSection(**kwargs))
