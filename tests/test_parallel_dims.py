"""Where each rank sits on the mesh, which batch share it reads, and the groups it sums over."""

import pytest

from lmforge.config import ParallelSection
from lmforge.parallel import ParallelDims


def dims_for(world: int, **section) -> ParallelDims:
    return ParallelDims.from_config(ParallelSection(**section), world)


def test_tp_cp_pp_neighbours_read_the_same_batch_share():
    # 8 ranks: pp=2 x dp_shard=2 x tp=2 -> ranks (row-major) 0..7 = (pp, dp_shard, tp)
    d = dims_for(8, pp=2, tp=2, dp_shard=2)
    assert (d.dp_replicate, d.dp_shard, d.data_world, d.gradient_world) == (1, 2, 2, 2)
    assert [d.coords(r)["tp"] for r in range(8)] == [0, 1] * 4
    assert [d.coords(r)["pp"] for r in range(8)] == [0] * 4 + [1] * 4
    assert [d.data_rank(r) for r in range(8)] == [0, 0, 1, 1, 0, 0, 1, 1]
    assert d.kind == "fsdp+tp+pp" and d.describe_mesh() == "pp=2 x dp_shard=2 x tp=2"


def test_context_shards_share_a_batch_but_join_the_gradient_group():
    d = dims_for(4, cp=2, dp_shard=2)
    assert (d.data_world, d.gradient_world) == (2, 4)
    assert [d.data_rank(r) for r in range(4)] == [0, 0, 1, 1]
    assert d.fsdp_mesh_names() == ("dp_shard_cp",) and d.gradient_group_name() == "data"
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
    assert d.data_world == d.gradient_world == 4


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
    assert d.gradient_group_name() == group
