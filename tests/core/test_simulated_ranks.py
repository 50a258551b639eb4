"""The sharded step at the scale users train, simulated in one process: 16 to 256 ranks of
torch's threaded process group (one thread per rank, real collectives), each family on each
layout the engine models, against one process in float64.

Leaves of 40 and 24 rows do not divide over 16 shards (uneven blocks, some ranks empty); a
vector stays replicated. Every rank's block must equal one process's after three updates to
1e-12, the state must lie where the layout says (`ps.bytes_per_rank`, read from the
placements on rank 0, equal to what each rank holds), and SOAP's and Kron's state must sit
at the leaves' owners, not on every rank. The 2-8 rank runs under torchrun (gloo) with FSDP2
itself are tests/api/test_fsdp_step.py.
"""

from __future__ import annotations

import pytest
import torch

import purestep.core as ps
from tests import threaded_ranks

SHAPES = {"a": (40, 24), "b": (24,), "c": (64, 32), "d": (24, 48)}
STEPS = 3
FAMILIES = {
    "adamw+clip": lambda: ps.apply_if_finite(ps.chain(ps.clip_by_global_norm(0.05), ps.adamw(0.02, weight_decay=0.1))),
    "muon": lambda: ps.muon_adamw(lr=0.02, adamw_lr=0.01, ns_dtype=torch.float64),
    "normuon": lambda: ps.normuon_adamw(lr=0.02, adamw_lr=0.01, ns_dtype=torch.float64),
    "soap": lambda: ps.soap(0.02, weight_decay=0.1, precondition_frequency=2),
    "kron": lambda: ps.kron(0.02, weight_decay=0.1),
}
OWNED = ("soap", "kron")  # state held at each leaf's owner


def _placements(layout: str, x: torch.Tensor) -> list:
    from torch.distributed.tensor import Replicate, Shard

    matrix = x.dim() == 2
    if layout == "fsdp":
        return [Shard(0) if matrix else Replicate()]
    if layout == "hsdp":  # (replicate, shard)
        return [Replicate(), Shard(0) if matrix else Replicate()]
    return [Shard(0), Shard(1)] if matrix else [Replicate(), Shard(0)]  # (dp, tp): row x column blocks


def _case(family: str, layout: str, mesh_shape: tuple[int, ...]) -> None:
    torch.manual_seed(0)
    full = {k: torch.randn(*s, dtype=torch.float64) for k, s in SHAPES.items()}
    grads = [{k: torch.randn(*s, dtype=torch.float64) for k, s in SHAPES.items()} for _ in range(STEPS)]
    opt = FAMILIES[family]()
    ref, state = {k: v.clone() for k, v in full.items()}, opt.init(full)
    update = ps.make_update(opt)
    for g in grads:
        ref, state = update(ref, g, state)
    one_process_bytes = ps.state_bytes(state)
    world = int(torch.tensor(mesh_shape).prod())

    def rank(r: int) -> tuple[float, int, list[int] | None, str, list[int] | None]:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", mesh_shape)
        block = lambda x: threaded_ranks.block(x, mesh, _placements(layout, x))  # noqa: E731
        params = {k: block(v) for k, v in full.items()}
        o = FAMILIES[family]()
        st = o.init(params)
        step = ps.make_update(o, donate=True)
        for g in grads:
            step(params, {k: block(v) for k, v in g.items()}, st)
        err = max(
            (p._local_tensor - threaded_ranks.whole_block(ref[k], p)).abs().max().item() if p._local_tensor.numel() else 0.0
            for k, p in params.items()
        )
        # every leaf at its owner (SOAP's and Kron's), from the shapes
        work = ps.owner_work(params, dict.fromkeys(params, True)) if r == 0 else None
        return err, ps.state_bytes(st), ps.bytes_per_rank(st) if r == 0 else None, step.explain(), work

    out = threaded_ranks.run(world, rank)
    assert max(e for e, *_ in out.values()) < 1e-12
    assert any((ref[k] - full[k]).abs().max() > 1e-3 for k in full)  # the params moved
    held = [out[r][1] for r in range(world)]
    assert out[0][2] == held  # what rank 0 reads from the placements is what every rank holds
    if family in OWNED:
        counters = min(held)  # the plain scalars every rank keeps
        assert sum(h - counters for h in held) <= one_process_bytes  # each leaf's state at one rank
        assert sum(h > counters for h in held) >= 3  # at the three matrices' owners, not on every rank
        # the owners ps.owner_work names (from the shapes, on rank 0) are the ranks holding the state
        work = out[0][4]  # a replicated leaf: computed, and its state kept, on every rank alike
        assert {r for r, w in enumerate(work) if w > min(work)} == {r for r, h in enumerate(held) if h > counters}
    else:
        assert all("sharded" in out[r][3] for r in out), out[0][3]


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("layout, mesh_shape", [("fsdp", (16,)), ("hsdp", (4, 16)), ("tp", (8, 8))])
def test_each_family_on_each_layout_at_16_to_64_simulated_ranks_equals_one_process(family, layout, mesh_shape):
    _case(family, layout, mesh_shape)


@pytest.mark.parametrize("family, mesh_shape", [("adamw+clip", (256,)), ("muon", (16, 16))])
def test_adamw_and_muon_at_256_simulated_ranks_equal_one_process(family, mesh_shape):
    _case(family, "fsdp" if len(mesh_shape) == 1 else "hsdp", mesh_shape)
