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
