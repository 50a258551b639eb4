"""Tensor-parallel blocks: the placement of DTensor params that are not FSDP2's row blocks
(TP alone, FSDP2 beside TP, FSDP2 beside expert parallelism: `Shard(d)` on any mesh dim,
FSDP's `_StridedShard` rows on top of TP, params over a root mesh, its named slices and its
flattened dims, plain tensors beside them).

`placement(pairs)` returns the `TPBlocks` the sharded path runs on: reductions are local
partials times a per-leaf weight in one all_reduce over every rank of the root mesh (a block
repeated along some mesh dims weighs 1 only at coordinate 0 of those dims), and
owner-computes assembles each matrix at its owner from the blocks that count (`Boxes`: where
each rank's block lies, by DTensor's own offset arithmetic) in one all_to_all, then sends
every holder its block of the result in a second (`placement.exchange`).
"""

from __future__ import annotations

import math
from typing import Any, Callable

import torch
from torch import Tensor

from .. import _compat as compat
from . import cache
from .dtensor import is_dtensor
from .packed import PackSpec
from .placement import Declined, Placement, exchange


class TPBlocks(Placement):
    """Leaves in blocks over every rank of one root mesh (see the module docstring)."""

    def __init__(
        self,
        world: int,
        rank: int,
        shapes: list[torch.Size],
        copies: list[tuple[int, ...]],
        coordinate: tuple[int, ...],
        boxes: Boxes,
        device: torch.device | None = None,
        group: Any = None,
    ) -> None:
        # per leaf: the root mesh dims along which the ranks hold copies of one block; this
        # rank weighs 1 in a reduction where it holds the copy at coordinate 0 of each such dim
        sharded = [len(c) < len(coordinate) for c in copies]
        weights = [1.0 if all(coordinate[d] == 0 for d in c) else 0.0 for c in copies]
        super().__init__(group, world, rank, shapes, sharded, weights, device)
        self.copies, self.boxes = copies, boxes

    def tags(self, index: int) -> tuple:
        return (("copies", self.copies[index]),)

    def declines(self, reductions: set[str], per_row_state: bool) -> str | None:
        """Per-row statistics must be taken with `ops.row_sums` (a row may be split over
        ranks), and whole-matrix math needs every leaf's blocks to tile it (`untiled`)."""
        if per_row_state and "row_sums" not in reductions:
            return "per-row statistics not taken with ops.row_sums (a row split over tensor-parallel ranks)"
        if "map_matrices" in reductions or "row_sums" in reductions:
            return self.untiled()
        return None

    def row_range(self, index: int) -> tuple[int, int]:
        offsets, shape = self.boxes.of(index)[self.rank]
        return offsets[0], shape[0]

    def row_sums(self, spec: PackSpec, partials: list[Tensor], lead: list[int]) -> list[Tensor]:
        """Each member's local row sums placed at its block's rows in a zero grid of every
        leaf's whole (batch..., rows), counted once (copies weigh 0), one all_reduce over
        every rank, and this rank's rows read back."""
        places = []  # (member's partial, its slices in its grid, the grid's offset and shape)
        at = 0
        for g, part, b in zip(spec.groups, partials, lead):
            dims = b - int(g.is_stack) + 1  # a member's dims up to its row dim
            for m, x in zip(g.members, part.unbind(0) if g.is_stack else [part]):
                grid = tuple(self.shapes[m.index][:dims])
                box = self.boxes.of(m.index)[self.rank]
                where = tuple(slice(o, o + n) for o, n in zip(box[0][:dims], box[1][:dims]))
                places.append((x, where, at, grid, self.weights[m.index]))
                at += math.prod(grid)
        first = partials[0]
        total = first.new_zeros(at)
        for x, where, offset, grid, weight in places:
            if weight:
                total[offset : offset + math.prod(grid)].view(grid)[where] = x
        total = self.all_reduce(total)
        out, k = [], 0
        for g, part in zip(spec.groups, partials):
            n = len(g.members)
            mine = [total[o : o + math.prod(grid)].view(grid)[where] for _, where, o, grid, _ in places[k : k + n]]
            out.append(torch.stack(mine) if g.is_stack else mine[0])
            k += n
        return out

    def describe(self) -> str:
        return (
            f"tensor-parallel blocks over {self.world} ranks: elementwise math on each rank's blocks; reductions "
            "are one all_reduce over every rank, each block counted once (its copies on other ranks weigh 0); "
            "whole-matrix math is owner-computes over every rank (each matrix assembled from its row x column "
            "blocks at its owner in one all_to_all, its result's blocks back in a second; blocks of whole "
            "experts computed where they lie)"
        )

    def untiled(self) -> str | None:
        """Why some sharded leaf's blocks do not tile it (then no owner can assemble it), or None.

        The blocks that count must be the cells of a grid: along each dim their intervals
        partition it, and there is one block per cell. `_StridedShard` orders whose rows are
        not contiguous give offsets that are no boxes; they fail here, as they must."""
        for i, shape in enumerate(self.shapes):
            if not self.sharded[i]:
                continue
            boxes = self.boxes.of(i)
            counted = {b for r, b in enumerate(boxes) if self.boxes.counts(i, r) and _numel(b) > 0}
            cells = 1
            for d, size in enumerate(shape):
                edges = sorted({(b[0][d], b[0][d] + b[1][d]) for b in counted})
                if [a for a, _ in edges] != [0] + [b for _, b in edges[:-1]] or (edges and edges[-1][1] != size):
                    return f"param {i}'s blocks over the ranks do not tile dim {d}: owner-computes cannot assemble it"
                cells *= len(edges)
            if len(counted) != cells or boxes[self.rank][1] != tuple(_local_shape(self.boxes.leaves[i])):
                return f"param {i}'s blocks over the ranks do not tile it: owner-computes cannot assemble it"
        return None

    def _whole_matrices(self, index: int, lead: int) -> bool:
        """Whether every rank's block of leaf `index` holds whole matrices (its dims after the
        `lead` batch dims unsplit)."""
        tail = tuple(self.shapes[index][lead:])
        return lead >= 1 and all(shape[lead:] == tail for _, shape in self.boxes.of(index))

    def global_rank(self) -> int:
        return self.rank  # the group is the world

    def leaf_owners(self, leaves: tuple[int, ...] | None = None) -> list[int | None]:
        units = tuple(i for i, s in enumerate(self.sharded) if s and (leaves is None or i in leaves))
        owner = self.owners(units) if units else {}
        return [owner.get(i) for i in range(len(self.sharded))]  # the group is the world

    def _cost(self, unit: Any) -> int:
        """Newton-Schulz's cost of a leaf's matrix: m·n·min(m, n)."""
        shape = self.shapes[unit]
        rows, cols = shape[0], math.prod(shape[1:])
        return rows * cols * min(rows, cols)

    def _matrices(
        self, blocks: dict[int, Tensor], lead: dict[int, int], extra_of: dict[int, Any], run: Callable
    ) -> dict[int, Tensor]:
        """Replicated leaves are computed where they are, and so are the blocks of a leaf
        whose leading dims index matrices (batch_dims >= 1: experts) when every block holds
        whole matrices (FSDP2's rows over expert parallelism's `Shard(0)`): each rank computes
        its own, with no collective, an expert's work done once where it lies (again on a
        copy; the owners of the rest are balanced over that work). Every other leaf split over
        ranks is assembled whole at its owner: every rank sends the blocks that count (not the
        copies), the owner places them at their offsets, and every rank gets its block of the
        result (copies too)."""
        results: dict[int, Tensor] = {}
        local = [i for i in sorted(blocks) if not self.sharded[i]]
        whole = [i for i in sorted(blocks) if self.sharded[i] and self._whole_matrices(i, lead[i])]
        local += whole
        results.update((i, blocks[i]) for i in local if not blocks[i].numel())
        local = [i for i in local if blocks[i].numel()]
        if local:
            results.update(zip(local, run([blocks[i] for i in local], local)))
        units = tuple(i for i in sorted(blocks) if i not in results)
        if not units:
            return results
        boxes, dtype = self.boxes, blocks[units[0]].dtype
        # each rank's own whole matrices (from the shapes alone, as every rank computes them): owners balance over them
        load = tuple(sum(_batched_cost(boxes.of(i)[r][1], lead[i]) for i in whole) for r in range(self.world))

        def sent(i: int, r: int) -> int:
            return _numel(boxes.of(i)[r]) if boxes.counts(i, r) else 0

        def held(i: int, r: int) -> int:
            return _numel(boxes.of(i)[r])

        def assemble(i: int, pieces: list[Tensor]) -> Tensor:
            whole = blocks[i].new_empty(self.shapes[i], dtype=dtype)
            for s, piece in enumerate(pieces):
                if boxes.counts(i, s):
                    box = boxes.of(i)[s]
                    whole[_box_slices(box)] = piece.view(box[1])
            return whole

        def cut(i: int, result: Tensor, r: int) -> Tensor:
            return result[_box_slices(boxes.of(i)[r])]

        results.update(exchange(self, units, blocks, sent, held, assemble, cut, run, load if any(load) else ()))
        return results


class Boxes:
    """Where every rank's block of each leaf lies in the whole leaf (TP blocks): per leaf, per
    world rank, `(offsets, shape)` (DTensor's own arithmetic, `_StridedShard` included), and
    whether that rank holds the copy that counts."""

    def __init__(
        self, leaves: list[Any], root: Any, dims: list[tuple[tuple[int, ...], ...]], copies: list[tuple[int, ...]]
    ):
        # dims: per leaf, per dim of its mesh, the root dims it spans (one; several for a
        # flattened mesh, its coordinate their row-major index)
        self.leaves, self.dims, self.copies = leaves, dims, copies
        self.root_shape = tuple(root.mesh.shape)
        self.root = cache.mesh_key(root)
        self.coords = coordinates(root)
        self._boxes: dict[int, list[tuple[tuple[int, ...], tuple[int, ...]]]] = {}

    def of(self, i: int) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
        """Leaf `i`'s block on each rank: (offsets, shape) in the whole leaf. Leaves laid out
        alike (a model's layers) share one list, made once per root mesh (`cache`)."""
        if i not in self._boxes:
            x = self.leaves[i]
            if not is_dtensor(x):
                self._boxes[i] = [((0,) * x.dim(), tuple(x.shape))] * len(self.coords)
            else:
                key = (tuple(x.shape), tuple(x.placements), tuple(x.device_mesh.shape), self.dims[i], self.root)
                self._boxes[i] = cache.get("boxes", key, lambda: self._every_rank(x, self.dims[i]))
        return self._boxes[i]

    def _every_rank(self, x: Any, dims: tuple[tuple[int, ...], ...]) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
        shape, root, boxes = tuple(x.device_mesh.shape), self.root_shape, []
        for c in self.coords:
            at = [_flat_index([c[d] for d in ds], [root[d] for d in ds]) for ds in dims]
            size, offset = compat.local_box(x.shape, shape, at, x.placements)
            boxes.append((tuple(offset), tuple(size)))
        return boxes

    def counts(self, i: int, rank: int) -> bool:
        """Whether `rank`'s block of leaf `i` is the copy that counts (the others repeat it)."""
        return all(self.coords[rank][d] == 0 for d in self.copies[i])


def _flat_index(coordinate: list[int], shape: list[int]) -> int:
    at = 0
    for c, n in zip(coordinate, shape):
        at = at * n + c
    return at


def coordinates(root: Any) -> list[tuple[int, ...]]:
    """Every world rank's coordinate in the root mesh, by rank."""
    import itertools

    ranks = root.mesh.flatten().tolist()
    out: list[tuple[int, ...]] = [()] * len(ranks)
    for flat, c in enumerate(itertools.product(*(range(n) for n in root.mesh.shape))):
        out[ranks[flat]] = c
    return out


def _root_dims(mesh: Any, root: Any, coords: list[tuple[int, ...]]) -> tuple[tuple[int, ...], ...] | None:
    """Per dim of `mesh`, the dims of `root` it spans: a named slice of the root, or a
    flattening of some of its dims (`DeviceMesh._flatten`: one dim whose ranks run over those
    root dims in row-major order, the others fixed at this rank's coordinate); None otherwise.
    `coords`: every rank's coordinate in the root (`coordinates`)."""
    names = root.mesh_dim_names
    if mesh is root or mesh == root:
        return tuple((d,) for d in range(root.ndim))
    if mesh.mesh_dim_names and names and all(n in names for n in mesh.mesh_dim_names):
        return tuple((names.index(n),) for n in mesh.mesh_dim_names)
    if mesh.ndim != 1:
        return None
    me = root.get_coordinate()
    ranks = mesh.mesh.flatten().tolist()
    spans = tuple(d for d in range(root.ndim) if len({coords[r][d] for r in ranks}) > 1)
    index = tuple(slice(None) if d in spans else me[d] for d in range(root.ndim))
    return (spans,) if root.mesh[index].flatten().tolist() == ranks else None


def _local_shape(x: Any) -> torch.Size:
    return x._local_tensor.shape if is_dtensor(x) else x.shape


def _batched_cost(shape: tuple[int, ...], lead: int) -> int:
    """Newton-Schulz's cost of a block of `prod(shape[:lead])` matrices of `shape[lead:]`."""
    rows, cols = shape[lead], math.prod(shape[lead + 1 :])
    return math.prod(shape[:lead]) * rows * cols * min(rows, cols)


def _numel(box: tuple[tuple[int, ...], tuple[int, ...]]) -> int:
    return math.prod(box[1])


def _box_slices(box: tuple[tuple[int, ...], tuple[int, ...]]) -> tuple[slice, ...]:
    return tuple(slice(o, o + n) for o, n in zip(*box))


def placement(pairs: list[tuple[str, Any]]) -> TPBlocks:
    """Leaves in any blocks over one root mesh (TP's `Shard(d)`, FSDP's `_StridedShard` on top
    of TP, submeshes of it, plain tensors: replicated): elementwise math is local whatever
    the blocks; a reduction sums local partials over every rank of the root mesh, each
    block counted once. A leaf's copies lie along the root dims it is not split on (its
    `Replicate` dims and the root dims its submesh leaves out): the rank at coordinate 0 of
    those weighs 1, the others 0."""
    from torch.distributed.tensor import Partial, Replicate

    dtensors = [(p, x) for p, x in pairs if is_dtensor(x)]
    roots = {id(compat.root_mesh(x.device_mesh)): compat.root_mesh(x.device_mesh) for _, x in dtensors}
    if len(roots) != 1:
        raise Declined(f"the params' DTensors live under {len(roots)} root device meshes; one is needed")
    root = next(iter(roots.values()))
    world = torch.distributed.get_world_size()
    if root.mesh.numel() != world:
        raise Declined(f"the params' root mesh holds {root.mesh.numel()} of the world's {world} ranks")
    names = root.mesh_dim_names
    all_dims = tuple(range(root.ndim))
    copies: list[tuple[int, ...]] = []
    mesh_dims: list[tuple[tuple[int, ...], ...]] = []  # per leaf, per dim of its mesh: the root dims it spans
    coords = coordinates(root)
    dims_of: dict[int, Any] = {}  # by mesh: its root dims, read once (hundreds of leaves share a few meshes)
    for path, x in pairs:
        if not is_dtensor(x):
            copies.append(all_dims)
            mesh_dims.append(())
            continue
        mesh = x.device_mesh
        if id(mesh) not in dims_of:
            dims_of[id(mesh)] = _root_dims(mesh, root, coords)
        dims = dims_of[id(mesh)]
        if dims is None:
            raise Declined(
                f"param '{path}': its mesh {mesh.mesh_dim_names} is neither a named slice of the root mesh nor a "
                "flattening of its dims"
            )
        mesh_dims.append(dims)
        split: set[int] = set()
        for ds, p in zip(dims, x.placements):
            if isinstance(p, Partial):
                raise Declined(f"param '{path}' is placed {tuple(x.placements)}: a Partial value is no block")
            if not isinstance(p, Replicate):
                split.update(ds)
        copies.append(tuple(d for d in all_dims if d not in split))
    spanned = {d for dims in mesh_dims for ds in dims for d in ds}
    if spanned != set(all_dims):  # a dim no leaf spans holds other params (pipeline stages), not copies
        left = [names[d] if names else d for d in all_dims if d not in spanned]
        raise Declined(
            f"no param spans the root mesh's dims {left} (pipeline stages?): reductions over them are not built"
        )
    coordinate = tuple(root.get_coordinate())
    me = int(root.mesh[coordinate])  # this rank, read from the mesh (its coordinate)
    boxes = Boxes([x for _, x in pairs], root, mesh_dims, copies)
    for i in range(len(pairs)):  # now, not inside a traced step (DTensor's offset arithmetic does not trace)
        boxes.of(i)
    return TPBlocks(
        world,
        me,
        [x.shape for _, x in pairs],
        copies,
        coordinate,
        boxes,
        device=dtensors[0][1].device,
        group=torch.distributed.group.WORLD,
    )
