"""Tensor-parallel blocks: how DTensor params lie when they are not FSDP2's row blocks (TP
alone, FSDP2 beside TP: `Shard(d)` on any mesh dim, FSDP's `_StridedShard` rows on top of TP,
params over a root mesh and its named slices, plain tensors beside them), and the
owner-computes that assembles a matrix from them.

`blocks_info(params)` returns the `mesh.ShardInfo` the sharded path runs on: reductions are
local partials times a per-leaf weight in one all_reduce over every rank of the root mesh
(a block repeated along some mesh dims weighs 1 only at coordinate 0 of those dims), and
`owner_computes` assembles each matrix at its owner from the blocks that count (`Boxes`:
where each rank's block lies, by DTensor's own offset arithmetic) in one all_to_all, then
sends every holder its block of the result in a second.
"""

from __future__ import annotations

import math
from typing import Any, Callable

import torch
from torch import Tensor

from .. import _compat as compat
from .. import _tree as tr
from .dtensor import is_dtensor
from .mesh import ShardInfo, _Slice


def untiled(info: ShardInfo) -> str | None:
    """Why some sharded leaf's blocks do not tile it (then no owner can assemble it), or None.

    The blocks that count must be the cells of a grid: along each dim their intervals
    partition it, and there is one block per cell. `_StridedShard` orders whose rows are
    not contiguous give offsets that are no boxes; they fail here, as they must."""
    assert info.boxes is not None
    for i, s in enumerate(info.slices):
        if not s.sharded:
            continue
        boxes = info.boxes.of(i)
        counted = {b for r, b in enumerate(boxes) if info.boxes.counts(i, r) and _numel(b) > 0}
        cells = 1
        for d, size in enumerate(s.shape):
            edges = sorted({(b[0][d], b[0][d] + b[1][d]) for b in counted})
            if [a for a, _ in edges] != [0] + [b for _, b in edges[:-1]] or (edges and edges[-1][1] != size):
                return f"param {i}'s blocks over the ranks do not tile dim {d}: owner-computes cannot assemble it"
            cells *= len(edges)
        if len(counted) != cells or boxes[info.rank][1] != tuple(_local_shape(info.boxes.leaves[i])):
            return f"param {i}'s blocks over the ranks do not tile it: owner-computes cannot assemble it"
    return None


def owner_computes(
    info: ShardInfo, indices: tuple[int, ...], blocks: dict[int, Tensor], run: Callable
) -> dict[int, Tensor]:
    """Owner-computes over TP blocks: every rank sends the blocks that count (not the copies)
    of each matrix to its owner in one all_to_all over all ranks; the owner places them at
    their offsets (`Boxes`), runs `fn` on the whole matrices, and sends every rank its
    block of each result (copies too) in a second all_to_all."""
    assert info.boxes is not None
    owner, me, world, boxes = info.owners(indices), info.rank, info.world, info.boxes
    mine = [i for i in indices if owner[i] == me]
    dtype = blocks[indices[0]].dtype
    sent = [[i for i in indices if owner[i] == d and boxes.counts(i, me)] for d in range(world)]
    send = [blocks[i].reshape(-1).to(dtype) for d in range(world) for i in sent[d]]
    in_splits = [sum(_numel(boxes.of(i)[me]) for i in sent[d]) for d in range(world)]
    came = [[i for i in mine if boxes.counts(i, s)] for s in range(world)]
    out_splits = [sum(_numel(boxes.of(i)[s]) for i in came[s]) for s in range(world)]
    got = info._all_to_all(torch.cat(send) if send else blocks[indices[0]].new_zeros(0), out_splits, in_splits)
    pieces = iter(got.split([_numel(boxes.of(i)[s]) for s in range(world) for i in came[s]]))
    whole = {i: blocks[i].new_empty(info.slices[i].shape, dtype=dtype) for i in mine}
    for s in range(world):
        for i in came[s]:
            box = boxes.of(i)[s]
            whole[i][_box_slices(box)] = next(pieces).view(box[1])
    done = run([whole[i] for i in mine], mine) if mine else []
    back = [o[_box_slices(boxes.of(i)[d])].reshape(-1) for d in range(world) for i, o in zip(mine, done)]
    in_splits = [sum(_numel(boxes.of(i)[d]) for i in mine) for d in range(world)]
    order = [i for s in range(world) for i in indices if owner[i] == s]
    out_splits = [sum(_numel(boxes.of(i)[me]) for i in indices if owner[i] == s) for s in range(world)]
    ref = done[0] if done else blocks[indices[0]]
    got = info._all_to_all(torch.cat(back) if back else ref.new_zeros(0), out_splits, in_splits)
    parts = got.split([_numel(boxes.of(i)[me]) for i in order])
    return {i: p.view(blocks[i].shape) for i, p in zip(order, parts)}


class Boxes:
    """Where every rank's block of each leaf lies in the whole leaf (TP blocks): per leaf, per
    world rank, `(offsets, shape)` (DTensor's own arithmetic, `_StridedShard` included), and
    whether that rank holds the copy that counts."""

    def __init__(self, leaves: list[Any], root: Any, dims: list[tuple[int, ...]], copies: list[tuple[int, ...]]):
        self.leaves, self.dims, self.copies = leaves, dims, copies
        self.coords = [tuple(int(c) for c in (root.mesh == r).nonzero()[0]) for r in range(root.mesh.numel())]
        self._boxes: dict[int, list[tuple[tuple[int, ...], tuple[int, ...]]]] = {}

    def of(self, i: int) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
        """Leaf `i`'s block on each rank: (offsets, shape) in the whole leaf."""
        if i not in self._boxes:
            x = self.leaves[i]
            if not is_dtensor(x):
                self._boxes[i] = [((0,) * x.dim(), tuple(x.shape))] * len(self.coords)
            else:
                shape, dims = tuple(x.device_mesh.shape), self.dims[i]
                self._boxes[i] = []
                for c in self.coords:
                    size, offset = compat.local_box(x.shape, shape, [c[d] for d in dims], x.placements)
                    self._boxes[i].append((tuple(offset), tuple(size)))
        return self._boxes[i]

    def counts(self, i: int, rank: int) -> bool:
        """Whether `rank`'s block of leaf `i` is the copy that counts (the others repeat it)."""
        return all(self.coords[rank][d] == 0 for d in self.copies[i])


def _local_shape(x: Any) -> torch.Size:
    return x._local_tensor.shape if is_dtensor(x) else x.shape


def _numel(box: tuple[tuple[int, ...], tuple[int, ...]]) -> int:
    return math.prod(box[1])


def _box_slices(box: tuple[tuple[int, ...], tuple[int, ...]]) -> tuple[slice, ...]:
    return tuple(slice(o, o + n) for o, n in zip(*box))


def blocks_info(params: Any) -> ShardInfo:
    """Leaves in any blocks over one root mesh (TP's `Shard(d)`, FSDP's `_StridedShard` on top
    of TP, submeshes of it, plain tensors: replicated): elementwise math is local whatever
    the blocks; a reduction sums local partials over every rank of the root mesh, each
    block counted once. A leaf's copies lie along the root dims it is not split on (its
    `Replicate` dims and the root dims its submesh leaves out): the rank at coordinate 0 of
    those weighs 1, the others 0."""
    from torch.distributed.tensor import Partial, Replicate

    pairs, _ = tr.tree_flatten_with_path(params)
    dtensors = [(p, x) for p, x in pairs if is_dtensor(x)]
    roots = {id(compat.root_mesh(x.device_mesh)): compat.root_mesh(x.device_mesh) for _, x in dtensors}
    if len(roots) != 1:
        raise ValueError(f"the params' DTensors live under {len(roots)} root device meshes; one is needed")
    root = next(iter(roots.values()))
    world = torch.distributed.get_world_size()
    if root.mesh.numel() != world:
        raise ValueError(f"the params' root mesh holds {root.mesh.numel()} of the world's {world} ranks")
    names = root.mesh_dim_names
    all_dims = tuple(range(root.ndim))
    copies: list[tuple[int, ...]] = []
    slices: list[_Slice] = []
    mesh_dims: list[tuple[int, ...]] = []  # per leaf: the root dims its mesh spans
    for path, x in pairs:
        if not is_dtensor(x):
            copies.append(all_dims)
            mesh_dims.append(())
            slices.append(_Slice(x.shape, (0,) * world, (x.shape[0] if x.dim() else 1,) * world, False))
            continue
        mesh = x.device_mesh
        if mesh is root or mesh == root:
            dims = all_dims
        elif mesh.mesh_dim_names and names and all(n in names for n in mesh.mesh_dim_names):
            dims = tuple(names.index(n) for n in mesh.mesh_dim_names)
        else:
            raise ValueError(f"param '{path}': its mesh {mesh.mesh_dim_names} is no named slice of the root mesh")
        mesh_dims.append(dims)
        split = set()
        for d, placement in zip(dims, x.placements):
            if isinstance(placement, Partial):
                raise ValueError(f"param '{path}' is placed {tuple(x.placements)}: a Partial value is no block")
            if not isinstance(placement, Replicate):
                split.add(d)
        copies.append(tuple(d for d in all_dims if d not in split))
        slices.append(_Slice(x.shape, (0,) * world, (0,) * world, bool(split)))
    spanned = {d for dims in mesh_dims for d in dims}
    if spanned != set(all_dims):  # a dim no leaf spans holds other params (pipeline stages), not copies
        left = [names[d] if names else d for d in all_dims if d not in spanned]
        raise ValueError(
            f"no param spans the root mesh's dims {left} (pipeline stages?): reductions over them are not built"
        )
    coordinate = tuple(root.get_coordinate())
    boxes = Boxes([x for _, x in pairs], root, mesh_dims, copies)
    return ShardInfo(
        torch.distributed.group.WORLD,
        world,
        torch.distributed.get_rank(),
        slices,
        copies=(copies, coordinate),
        boxes=boxes,
        device=next(x for _, x in pairs if is_dtensor(x)).device,
    )
