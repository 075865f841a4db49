"""Where each rank sits on the mesh, which batch share it reads, and the groups it sums over."""

import pytest

from lmforge.config import ParallelSection
from lmforge.parallel import ParallelDims


def dims_for(world: int, **section) -> ParallelDims:
    return ParallelDims.from_config(ParallelSection(**section), world)


def test_tp_cp_pp_neighbours_read_the_same_batch_share():
    # 8 ranks: pp=2 x dp_shard=2 x tp=2 -> ranks (row-major) 0..7 = (pp, dp_shard, tp)
    d = dims_for(8, pp=2, tp=2, dp_shard=2)
    assert (d.dp_replicate, d.dp_shard, d.batch_shares, d.reduce_world) == (1, 2, 2, 2)
    assert [d.coords(r)["tp"] for r in range(8)] == [0, 1] * 4
    assert [d.coords(r)["pp"] for r in range(8)] == [0] * 4 + [1] * 4
    assert [d.batch_share(r) for r in range(8)] == [0, 0, 1, 1, 0, 0, 1, 1]
    assert d.kind == "fsdp+tp+pp" and d.describe_mesh() == "pp=2 x dp_shard=2 x tp=2"


def test_context_shards_share_a_batch_but_join_the_gradient_group():
    d = dims_for(4, cp=2, dp_shard=2)
    assert (d.batch_shares, d.reduce_world) == (2, 4)
    assert [d.batch_share(r) for r in range(4)] == [0, 0, 1, 1]
    assert d.fsdp_mesh_names() == ("dp_shard_cp",) and d.reduce_group_name() == "data"
    assert dims_for(2, cp=2).fsdp_mesh_names() == ("cp",)


def test_a_dimension_left_at_zero_or_minus_one_takes_the_rest_as_fsdp_beside_model_splits():
    for spelling in ({"dp_shard": -1, "tp": 2}, {"tp": 2}):
        d = dims_for(8, **spelling)
        assert (d.dp_replicate, d.dp_shard, d.tp) == (1, 4, 2)
    assert (dims_for(4, dp_replicate=2, dp_shard=-1).dp_shard) == 2


def test_expert_parallel_borrows_ranks_from_dp_shard():
    d = dims_for(4, ep=2, mode="fsdp")
    assert d.mesh_shape() == ((2, 2), ("dp_shard_mod_ep", "ep"))
    assert d.describe_mesh() == "dp_shard=4 x ep=2 (in dp_shard)"
    assert dims_for(2, ep=2, mode="fsdp").mesh_shape() == ((1, 2), ("dp_shard_mod_ep", "ep"))
    assert d.batch_shares == d.reduce_world == 4


@pytest.mark.parametrize("world, section, fsdp, group", [
    (4, {"mode": "ddp"}, (), "dp_replicate"),
    (4, {"dp_replicate": 2, "dp_shard": 2}, ("dp_replicate", "dp_shard"), "data"),
    (4, {"tp": 2, "dp_shard": 2}, ("dp_shard",), "dp_shard"),
    (2, {"tp": 2}, (), None),
    (2, {"pp": 2}, (), None),
])
def test_plan_meshes(world, section, fsdp, group):
    d = dims_for(world, **section)
    assert d.fsdp_mesh_names() == fsdp or (not d.shards and fsdp == ())
    assert d.reduce_group_name() == group


# --- impossible layouts: one line naming the key, before anything is written -----------------------

def _args(**kw):
    from lmforge.models.args import ModelArgs

    base = dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=320, max_seq_len=64)
    return ModelArgs(**(base | kw))


@pytest.mark.parametrize("world, section, model, seq_len, message", [
    (4, {"tp": 4}, {}, 32, r"parallel.tp=4"),                                   # 2 kv heads over 4 ranks
    (4, {"cp": 2, "dp_shard": 2}, {}, 30, r"data.seq_len=30 must be divisible by 2 x parallel.cp = 4"),
    (4, {"tp": 2, "dp_shard": 2}, {}, 33, r"data.seq_len=33 / parallel.cp=1 must be divisible by parallel.tp=2"),
    (4, {"ep": 2, "mode": "fsdp"}, {}, 32, r"parallel.ep=2: the model has no mixture-of-experts layers"),
    (2, {"pp": 2}, {"tie_embeddings": True}, 32, r"parallel.pp=2: tied input/output embeddings"),
    (2, {"pp": 2}, {"n_layers": 1}, 32, r"parallel.pp=2"),
])
def test_layouts_the_model_cannot_take_are_one_line(world, section, model, seq_len, message):
    from lmforge.config import Config
    from lmforge.errors import UserError
    from lmforge.parallel.layout_checks import check_layout

    cfg = Config.model_validate({"parallel": section, "data": {"seq_len": seq_len},
                                 "training": {"global_batch_size": 8, "micro_batch_size": 2}})
    with pytest.raises(UserError, match=message) as e:
        check_layout(dims_for(world, **section), _args(**model), cfg)
    assert "\n" not in str(e.value)


def test_pipeline_needs_enough_microbatches():
    from lmforge.config import Config
    from lmforge.errors import UserError
    from lmforge.parallel.layout_checks import check_layout

    cfg = Config.model_validate({"parallel": {"pp": 2}, "data": {"seq_len": 32},
                                 "training": {"global_batch_size": 2, "micro_batch_size": 2}})
    with pytest.raises(UserError, match=r"parallel.pp=2 with pp_schedule=1f1b needs at least 2 microbatches"):
        check_layout(dims_for(2, pp=2), _args(), cfg)


def test_recipes_without_model_splitting_refuse_it_in_one_line(capsys):
    from _helpers import lmforge_in_process, tiny_run_args

    rc = lmforge_in_process("dpo", *tiny_run_args(), "--parallel.tp=2", "--run.dir=/nonexistent/never")
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1
    assert "parallel.tp=2: `lmforge dpo` runs with data parallelism only" in err and "pretrain" in err
    assert "(grpo also parallel.ep)" in err
    rc = lmforge_in_process("grpo", *tiny_run_args(), "--parallel.tp=2", "--parallel.ep=2",
                            "--run.dir=/nonexistent/never")
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1
    assert "parallel.tp=2: `lmforge grpo` runs with data and expert parallelism only" in err, err
    assert "parallel.ep=2:" not in err  # GRPO takes ep (tests/test_router_replay_ep.py runs it)
