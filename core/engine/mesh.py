"""Which placement DTensor params lie in: `placement(params)` reads their placements.

FSDP2's row blocks (a 1-D mesh) and HSDP's (replicate, shard) mesh are `rows.RowShards`;
any other blocks over one root mesh (TP alone, FSDP2 beside TP) are `tp.TPBlocks`. Both keep
the protocol of `placement.Placement`, which is all the sharded path and `ops` ask of them.
"""

from __future__ import annotations

from typing import Any

from .. import _tree as tr
from . import rows, tp
from .placement import Declined, Placement


def placement(params: Any) -> Placement:
    """How `params` lie over the ranks: row blocks when every DTensor is `Shard(0)` along one
    dim of one mesh (`rows.why_not` reads that from the placements), else blocks over one
    root mesh; a `placement.Declined` names what neither takes."""
    pairs, _ = tr.tree_flatten_with_path(params)
    if rows.why_not(pairs) is None:
        return rows.placement(pairs)
    return tp.placement(pairs)


def describe(params: Any) -> str:
    """What the sharded path runs on these params' mesh, for `explain()`."""
    try:
        return placement(params).describe()
    except Declined as e:
        return str(e)


def owner_work(params: Any, leaves: Any = None) -> list[int]:
    """Per global rank, the whole-matrix work (Newton-Schulz's cost, m·n·min(m, n), a vector
    as one row) it computes when each split leaf where `leaves` is True (a bool tree like the
    params, or `callable(params)`; None: every leaf of 2 dims or more, Muon's) runs at its
    owner, as owner-computes assigns them on these params' layout (Muon and NorMuon: their
    matrices; SOAP and Kron: every leaf); a leaf every rank holds whole is computed on every
    rank. From the shapes alone: no collective."""
    import math

    import torch

    import torch.utils._pytree as pytree

    pairs, _ = tr.tree_flatten_with_path(params)
    chosen = [x.dim() >= 2 for _, x in pairs]
    if leaves is not None:
        mask = leaves(params) if callable(leaves) else leaves
        chosen = [bool(m) for m in pytree.tree_structure(params).flatten_up_to(mask)]
    info = placement(params)
    dist = torch.distributed
    work = [0] * (dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1)
    owners = info.leaf_owners(tuple(i for i, c in enumerate(chosen) if c))
    for i, (c, owner) in enumerate(zip(chosen, owners)):
        if not c:
            continue
        shape = info.shapes[i] if len(info.shapes[i]) else torch.Size([1])
        rows, cols = shape[0], math.prod(shape[1:])
        cost = rows * cols * min(rows, cols)
        for r in [owner] if owner is not None else range(len(work)):
            work[r] += cost
    return work
