"""The sharded path's pieces in one process: owners, row blocks, FSDP2's storage rule.

The 2-rank equality with one process (AdamW + clip, Muon, LAMB, AGC, apply_if_finite, resume
across world sizes) runs under torchrun in tests/api/test_fsdp_step.py.
"""

from __future__ import annotations


import torch

import purestep.core as ps
from purestep.core.engine import rows, tp


def _slice(shape: tuple[int, ...], world: int) -> rows.RowSlice:
    n = shape[0]
    chunk = -(-n // world)
    starts = tuple(min(r * chunk, n) for r in range(world))
    return rows.RowSlice(torch.Size(shape), starts, tuple(min(chunk, n - s) for s in starts), True)


def test_owners_balance_newton_schulz_cost_and_agree_on_every_rank():
    shapes = [(512, 512)] * 3 + [(64, 512)] * 6 + [(512, 2048), (8, 8)]
    infos = [rows.RowShards(None, 4, r, [_slice(s, 4) for s in shapes]) for r in range(4)]
    owners = [info.owners(tuple(range(len(shapes)))) for info in infos]
    assert all(o == owners[0] for o in owners)  # recomputed from the shapes alone, the same everywhere
    cost = lambda s: s[0] * s[1] * min(s)  # noqa: E731
    load = [sum(cost(shapes[i]) for i, r in owners[0].items() if r == rank) for rank in range(4)]
    total = sum(cost(s) for s in shapes)
    # Greedy largest-first: no rank above the biggest matrix plus its fair share.
    assert max(load) <= total / 4 + max(cost(s) for s in shapes)
    assert sorted(set(owners[0].values())) == [0, 1, 2, 3]  # every rank gets work


def test_owners_balance_over_the_work_each_rank_computes_anyway():
    from purestep.core.engine.placement import assign

    cost = [8, 4, 4].__getitem__
    assert assign((0, 1, 2), cost, 1, 2)[0] == {0: 0, 1: 1, 2: 1}
    # rank 0 computes 12 where it lies (its experts): the owned matrices go to rank 1 first
    assert assign((0, 1, 2), cost, 1, 2, load=(12, 0))[0] == {0: 1, 1: 1, 2: 0}
    # with replicas, every replica's rank 0 carries that load
    owner, replica = assign((0, 1, 2), cost, 2, 2, load=(12, 0))
    assert owner == {0: 1, 1: 1, 2: 1} and replica == {0: 0, 1: 1, 2: 1}


def test_row_blocks_follow_torch_chunk_with_empty_ranks():
    s = _slice((5, 3), 4)  # chunk 2: rows 2, 2, 1, 0
    assert s.starts == (0, 2, 4, 5) and s.counts == (2, 2, 1, 0)
    assert [c.shape[0] for c in torch.arange(15).view(5, 3).chunk(4)] + [0] == list(s.counts)


def test_fsdp2_all_gathers_the_updated_params_from_the_flat_buffer(one_rank_group):
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    ref = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 2))
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 2))
    model.load_state_dict(ref.state_dict())
    fully_shard(model[0])
    fully_shard(model)
    opt = ps.apply_if_finite(ps.chain(ps.clip_by_global_norm(0.1), ps.adamw(0.05, weight_decay=0.1)))
    params = dict(model.named_parameters())
    ref_params = {k: p.detach().clone() for k, p in ref.named_parameters()}
    state, ref_state = opt.init(params), opt.init(ref_params)
    update = ps.make_update(opt, donate=True)
    x = torch.randn(7, 6)
    for _ in range(3):
        model(x).square().sum().backward()
        update(params, {k: p.grad for k, p in params.items()}, state)
        model.zero_grad()
        grads = torch.func.grad(lambda p: torch.func.functional_call(ref, p, (x,)).square().sum())(ref_params)
        ref_params, ref_state = ps.make_update(opt)(ref_params, grads, ref_state)
    assert update.explain().startswith("sharded")
    assert all(p is params[k] for k, p in model.named_parameters())  # the same DTensors
    # FSDP2's own sharded storage now is the flat buffer: the next forward sees the update.
    fsdp_param = model[0]._get_fsdp_state()._fsdp_param_group.fsdp_params[0]
    assert fsdp_param._sharded_param_data.data_ptr() == params[fsdp_param._param_fqn]._local_tensor.data_ptr()
    torch.testing.assert_close(model(x), torch.func.functional_call(ref, ref_params, (x,)), rtol=1e-5, atol=1e-6)
    for k, p in params.items():
        torch.testing.assert_close(p.full_tensor(), ref_params[k], rtol=1e-5, atol=1e-6)


def test_owner_computes_splits_the_matrices_over_every_rank_of_an_hsdp_mesh():
    """Owners and computing replicas from the shapes alone: with 2 replicas of 2 ranks each
    of the 4 (replica, rank) slots computes about a quarter of the Newton-Schulz work, the
    largest matrices first, and every matrix exactly once."""
    shapes = [(64, 64)] * 4 + [(32, 32)] * 8 + [(16, 16)] * 3
    slices = [rows.RowSlice(torch.Size(s), (0, s[0] // 2), (s[0] // 2, s[0] - s[0] // 2), True) for s in shapes]
    info = rows.RowShards(None, 2, 0, slices, replicas=(None, 2, 0))
    indices = tuple(range(len(shapes)))
    owner, replica = info.owners(indices), info.computing_replica(indices)
    cost = lambda i: shapes[i][0] ** 3  # noqa: E731
    per_slot = {}
    for i in indices:
        per_slot[(replica[i], owner[i])] = per_slot.get((replica[i], owner[i]), 0) + cost(i)
    assert sorted(per_slot) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    total = sum(cost(i) for i in indices)
    assert max(per_slot.values()) <= total / 4 + max(cost(i) for i in indices)
    assert [owner[i] for i in range(4)] == [0, 1, 0, 1] and [replica[i] for i in range(4)] == [0, 0, 1, 1]
    alone = rows.RowShards(None, 2, 0, slices)  # FSDP on one mesh dim: no replicas
    assert set(alone.computing_replica(indices).values()) == {0}


def test_the_blocks_of_a_split_leaf_are_units_of_their_own_owned_apart():
    """A fused (3·d, d) QKV leaf split into q, k, v: three matrices, three owners on three
    ranks (as one leaf it would be all on one rank), each block's rows found on the ranks
    that hold them."""
    info = rows.RowShards(None, 3, 0, [_slice((48, 16), 3), _slice((16, 16), 3)])
    units = ((0, 0, 16), (0, 16, 32), (0, 32, 48))
    owner = info.owners(units)
    assert sorted(owner.values()) == [0, 1, 2]
    whole = info.owners((0, 1))
    assert whole[0] != whole[1]  # as leaves: the fused one on one rank, the other elsewhere
    # rows [16, 32) of a 48-row leaf in chunks of 16: all on rank 1
    k = info.unit_slice((0, 16, 32))
    assert k.shape == torch.Size((16, 16)) and k.counts == (0, 16, 0) and k.starts[1] == 0
    # an uneven split over 2 ranks (5 rows as 2 + 3; rank 0 holds rows 0-2, rank 1 rows 3-4)
    two = rows.RowShards(None, 2, 0, [_slice((5, 4), 2)])
    first, second = two.unit_slice((0, 0, 2)), two.unit_slice((0, 2, 5))
    assert first.counts == (2, 0) and second.counts == (1, 2) and second.starts == (0, 1)


class _FakeMesh:
    device_type = "cpu"

    def __init__(self, shape: tuple[int, ...]) -> None:
        self.mesh = torch.arange(int(torch.tensor(shape).prod())).view(shape)


def _blocks(leaf_shape, placements, mesh_shape=(2, 2), rank=0) -> tp.TPBlocks:
    """TP blocks of one leaf on a fake root mesh (no process group): where
    each rank's block lies, by `local_box` (DTensor's own offset arithmetic, FSDP2's chunks)."""
    from purestep.core._compat import local_box as box

    dims = tuple(range(len(mesh_shape)))
    boxes = tp.Boxes([torch.empty(leaf_shape)], _FakeMesh(mesh_shape), [dims], [()])
    boxes._boxes[0] = [tuple(map(tuple, reversed(box(leaf_shape, mesh_shape, list(c), placements)))) for c in boxes.coords]
    boxes.leaves = [torch.empty(boxes._boxes[0][rank][1])]
    return tp.TPBlocks(4, rank, [torch.Size(leaf_shape)], [()], (0, 0), boxes)


def test_tp_blocks_tile_a_matrix_only_where_they_are_boxes():
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    # FSDP2 on top of TP: TP's row chunks, each cut in FSDP's; contiguous: an owner can assemble it.
    assert _blocks((8, 6), [_StridedShard(0, split_factor=2), Shard(0)]).untiled() is None
    assert _blocks((8, 6), [Shard(0), Shard(1)]).untiled() is None  # rows x columns
    assert _blocks((5, 3), [_StridedShard(0, split_factor=2), Shard(0)]).untiled() is None  # uneven
    # The other order strides the rows (0, 2 | 1, 3 | ...): no boxes; owner-computes declines.
    bad = _blocks((8, 4), [Shard(0), _StridedShard(0, split_factor=2)]).untiled()
    assert bad is not None and "do not tile" in bad


def test_local_boxes_in_closed_form_equal_dtensors_own_and_fsdp2s_chunks():
    """`_compat.local_box` computes FSDP2's, HSDP's and TP's placements itself: the same
    (local shape, offset) as DTensor's arithmetic at every coordinate, uneven and empty blocks
    included; a strided shard (FSDP2's rows over TP's) as FSDP2 lays it out, torch.chunk of
    the TP chunk, which DTensor's arithmetic agrees with where the rows divide evenly."""
    import itertools

    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset
    from torch.distributed.tensor.placement_types import _StridedShard

    from purestep.core import _compat as compat

    cases = [
        ((4,), [Shard(0)]),
        ((4, 3), [Replicate(), Shard(0)]),
        ((4, 3), [Shard(0), Shard(1)]),
        ((2, 3), [Shard(0), Shard(0)]),
        ((4, 3), [Shard(1), Shard(0)]),
        ((4, 3), [_StridedShard(0, split_factor=3), Shard(0)]),  # FSDP2 rows over TP's (dp, tp)
        ((2, 4, 3), [Replicate(), _StridedShard(0, split_factor=3), Shard(0)]),  # HSDP + TP
    ]
    checked = 0
    for (mesh_shape, placements), n in itertools.product(cases, (1, 5, 7, 13, 24, 40)):
        shape = (n, 6)
        strided = any(hasattr(p, "split_factor") for p in placements)
        for coordinate in itertools.product(*(range(n) for n in mesh_shape)):
            got = compat._chunked_box(shape, mesh_shape, list(coordinate), placements)
            assert got is not None
            if not strided or n % 12 == 0:
                want = _compute_local_shape_and_global_offset(shape, mesh_shape, list(coordinate), placements)
                assert (tuple(got[0]), tuple(got[1])) == (tuple(want[0]), tuple(want[1])), (placements, n, coordinate)
            if strided:  # TP's chunk, then FSDP2's chunk of it
                def chunks(x, n):  # torch.chunk, with the empty chunks it leaves out
                    return list(x.chunk(n)) + [x[:0]] * (n - len(x.chunk(n))) if len(x) else [x] * n

                held = chunks(chunks(torch.arange(n), 3)[coordinate[-1]], 4)[coordinate[-2]]
                assert got[0][0] == len(held) and (not len(held) or got[1][0] == int(held[0])), (n, coordinate)
            checked += 1
    assert checked > 400
    # a strided shard not followed by its Shard is left to DTensor
    assert compat._chunked_box((8, 6), (2, 2), [0, 1], [_StridedShard(0, split_factor=2), Replicate()]) is None
