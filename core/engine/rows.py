"""FSDP2's row blocks: the placement of a 1-D mesh and of HSDP's (replicate, shard) mesh.

Every DTensor is `Shard(0)` along one mesh dim (the shard group) and `Replicate` on the
others; each rank of the shard group holds a contiguous block of rows of every leaf
(`RowSlice`, cut as `torch.chunk` cuts). Reductions are local partials summed in one
`all_reduce` within the shard group (a replicated leaf counted on rank 0 only); whole-matrix
math is owner-computes over the rows (`placement.exchange`). On HSDP's mesh each replica is
a shard group holding every param whole between its ranks, with grads equal across replicas
(FSDP2 all-reduces them): reductions run within the shard group, so every replica computes
the same values by the same ops; owner-computes splits the matrices over every
(replica, rank) slot, and one `all_reduce` across replicas completes every result.

Rows split over both dims of a 2-D mesh (`nested`): the layout of optimizer state sharded
across HSDP's replicas (`replicas.OverReplicas`). Each FSDP2 block of rows is cut again,
as `torch.chunk` cuts, between the replicas: `(_StridedShard(0, split_factor=S), Shard(0))`
on a (replicate, shard) mesh, DTensor's spelling of "blocks over shard, pieces of a block
over replicate". Every rank of the mesh then holds a distinct row range: it is one row
layout over all R·S ranks (a group of its own), with no replicas.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable

import torch
from torch import Tensor

from .. import _compat as compat
from . import cache
from .dtensor import is_dtensor
from .packed import PackSpec
from .placement import Declined, Placement, exchange


@dataclasses.dataclass(frozen=True)
class RowSlice:
    """A leaf as the ranks hold it: rows [starts[r], starts[r] + counts[r]) on rank r."""

    shape: torch.Size  # the whole leaf's
    starts: tuple[int, ...]
    counts: tuple[int, ...]
    sharded: bool  # False: every rank holds all of it (Replicate, or a plain tensor)

    @property
    def row_numel(self) -> int:
        return math.prod(self.shape[1:])


def why_not(pairs: list[tuple[str, Any]]) -> str | None:
    """Why these (path, leaf) pairs are not row blocks over one mesh, or None when they are:
    DTensors of one mesh, each `Shard(0)` along the same mesh dim (or replicated), the
    other mesh dims `Replicate`; plain tensors beside them count as replicated."""
    from torch.distributed.tensor import Replicate, Shard

    dtensors = [(p, x) for p, x in pairs if is_dtensor(x)]
    if len({cache.mesh_key(x.device_mesh) for _, x in dtensors}) != 1:
        return "the params' DTensors do not live on one device mesh"
    kinds = {nested_order(x) is not None for _, x in dtensors if not _replicated(x)}
    if kinds == {True}:
        return None  # every split leaf's rows over both mesh dims
    if len(kinds) > 1:
        return "some params' rows are split over both mesh dims and some over one"
    dims = set()
    for path, x in dtensors:
        placements = tuple(x.placements)
        split = [d for d, p in enumerate(placements) if not isinstance(p, Replicate)]
        if len(split) > 1 or (split and (type(placements[split[0]]) is not Shard or placements[split[0]].dim != 0)):
            return f"param '{path}' is placed {placements} over a {x.device_mesh.ndim}-D mesh, not in row blocks"
        dims.update(split)
    if len(dims) > 1:
        return f"the params are split along mesh dims {sorted(dims)}, not one"
    return None


def _replicated(x: Any) -> bool:
    from torch.distributed.tensor import Replicate

    return all(isinstance(p, Replicate) for p in x.placements)


def nested_order(x: Any) -> tuple[int, int] | None:
    """(outer, inner) mesh dims when `x`'s rows are split over both dims of a 2-D mesh: blocks
    over `outer`, each block's pieces over `inner` (`nested_placements`); else None."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    p = tuple(x.placements)
    if len(p) != 2 or any(type(q) not in (Shard, _StridedShard) or q.dim != 0 for q in p):
        return None
    if type(p[0]) is _StridedShard and type(p[1]) is Shard and p[0].split_factor == x.device_mesh.size(1):
        return (1, 0)
    if type(p[0]) is Shard and type(p[1]) is Shard:
        return (0, 1)
    return None


def nested_placements(mesh: Any, outer: int) -> tuple:
    """The placements of rows in blocks over dim `outer` of the 2-D `mesh`, each block's
    pieces over the other dim (`torch.chunk` both times)."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    return (Shard(0), Shard(0)) if outer == 0 else (_StridedShard(0, split_factor=mesh.size(1)), Shard(0))


def nested_rows(rows: int, outer: int, inner: int, o: int, i: int) -> tuple[int, int]:
    """(start, count) of piece `i` of `inner` of block `o` of `outer`, `torch.chunk` both times."""
    start, count = compat.chunk_range(rows, outer, o)
    first, n = compat.chunk_range(count, inner, i)
    return start + first, n


def placement(pairs: list[tuple[str, Any]]) -> RowShards:
    """The row blocks of these (path, leaf) pairs (`why_not` says None for them). Where this
    rank lies is read from the mesh (its coordinate), never from a process group's rank."""
    from torch.distributed.tensor import Replicate

    dtensors = [x for _, x in pairs if is_dtensor(x)]
    mesh = dtensors[0].device_mesh
    order = next((o for x in dtensors if (o := nested_order(x)) is not None), None)
    if order is not None:
        return _nested(pairs, mesh, order, dtensors[0].device)
    dims = {d for x in dtensors for d, p in enumerate(x.placements) if not isinstance(p, Replicate)}
    dim = dims.pop() if dims else mesh.ndim - 1
    group = mesh.get_group(dim) if mesh.ndim > 1 else mesh.get_group()
    coordinate = mesh.get_coordinate()
    world, rank = mesh.size(dim), coordinate[dim]
    grid = mesh.mesh
    replicas = None
    ranks: list[list[int]] = [grid.tolist()]
    if mesh.ndim == 2:  # HSDP: the other mesh dim holds the replicas
        other = 1 - dim
        ranks = [grid.select(other, q).tolist() for q in range(mesh.size(other))]
        if mesh.size(other) > 1:
            replicas = (mesh.get_group(other), mesh.size(other), coordinate[other])
    slices = [_slice_of(p, x, world, rank) for p, x in pairs]
    return RowShards(group, world, rank, slices, replicas, device=dtensors[0].device, ranks=ranks)


def _nested(pairs: list[tuple[str, Any]], mesh: Any, order: tuple[int, int], device: Any) -> RowShards:
    """Rows over both dims of a 2-D mesh: one row layout over the group of all its ranks (in
    the order of their global ranks)."""
    key = cache.mesh_key(mesh)
    ranks = sorted(key[2])  # global rank by group rank

    def group() -> Any:  # made at the first collective, by the members alone (local synchronization), once per mesh
        return cache.get("group", key, lambda: torch.distributed.new_group(ranks, use_local_synchronization=True))

    where = {int(g): (a, b) for a, row in enumerate(mesh.mesh.tolist()) for b, g in enumerate(row)}
    coords = [where[g] for g in ranks]  # (mesh dim 0, mesh dim 1) coordinates by group rank
    outer, inner = order
    n_outer, n_inner = mesh.size(outer), mesh.size(inner)
    world, rank = len(ranks), coords.index(tuple(mesh.get_coordinate()))

    def slice_of(path: str, x: Any) -> RowSlice:
        if not is_dtensor(x) or _replicated(x):
            return RowSlice(x.shape, (0,) * world, (x.shape[0] if x.dim() else 1,) * world, False)
        rows = x.shape[0]
        cuts = [nested_rows(rows, n_outer, n_inner, c[outer], c[inner]) for c in coords]
        s = RowSlice(x.shape, tuple(a for a, _ in cuts), tuple(n for _, n in cuts), True)
        _check_local(path, x, s.counts[rank])
        return s

    info = RowShards(group, world, rank, [slice_of(p, x) for p, x in pairs], None, device=device, ranks=[ranks])
    info.nested = (n_inner, n_outer)
    return info


def _check_local(path: str, x: Any, rows: int) -> None:
    if tuple(x._local_tensor.shape) != (rows, *x.shape[1:]):
        raise Declined(
            f"param '{path}': this rank holds {tuple(x._local_tensor.shape)} of {tuple(x.shape)}, not torch.chunk's "
            f"{(rows, *x.shape[1:])} rows; purestep's sharded step takes FSDP2's even chunking"
        )


def _slice_of(path: str, x: Any, world: int, rank: int) -> RowSlice:
    """How the ranks of the shard group hold `x` (row blocks as torch.chunk cuts them)."""
    if not is_dtensor(x) or _replicated(x):
        return RowSlice(x.shape, (0,) * world, (x.shape[0] if x.dim() else 1,) * world, False)
    rows = x.shape[0]
    cuts = [compat.chunk_range(rows, world, r) for r in range(world)]
    starts, counts = tuple(a for a, _ in cuts), tuple(n for _, n in cuts)
    _check_local(path, x, counts[rank])
    return RowSlice(x.shape, starts, counts, True)


class RowShards(Placement):
    """Row blocks over one shard group, and HSDP's replicas of it (see the module docstring)."""

    def __init__(
        self,
        group: Any,
        world: int,
        rank: int,
        slices: list[RowSlice],
        replicas: tuple[Any, int, int] | None = None,
        device: torch.device | None = None,
        ranks: list[list[int]] | None = None,
    ) -> None:
        # a replicated leaf weighs 1 on rank 0 only
        weights = [1.0 if s.sharded or rank == 0 else 0.0 for s in slices]
        super().__init__(group, world, rank, [s.shape for s in slices], [s.sharded for s in slices], weights, device)
        self.slices = slices
        # HSDP: (the group of this rank's replicas, their number, this rank's index among them)
        self.replica_group: Any
        self.replica_group, self.replicas, self.replica = replicas if replicas is not None else (None, 1, 0)
        self.nested: tuple[int, int] | None = None  # (replicas, shards) when rows lie over both (`_nested`)
        # the global rank of each (replica, group rank) slot
        self.ranks = ranks if ranks is not None else [list(range(world))] * self.replicas

    def tags(self, index: int) -> tuple:
        return (("sharded", self.sharded[index]),)

    def declines(self, reductions: set[str], per_row_state: bool) -> str | None:
        return None  # a row block holds whole rows: per-row statistics and owner-computes both run

    def row_sums(self, spec: PackSpec, partials: list[Tensor], lead: list[int]) -> list[Tensor]:
        return partials  # whole rows on every rank: their sums are local

    def row_range(self, index: int) -> tuple[int, int]:
        s = self.slices[index]
        return (s.starts[self.rank], s.counts[self.rank]) if s.sharded else (0, s.shape[0])

    def describe(self) -> str:
        if self.nested is not None:
            r, n = self.nested
            return (
                f"HSDP with the optimizer state over its {r} replicas x {n} shards: every rank holds 1/{r * n} of each "
                f"split leaf; reductions are one all_reduce over all {r * n} ranks; whole-matrix math is "
                "owner-computes over them (an all_to_all each way)"
            )
        if self.replicas > 1:
            return (
                f"HSDP, {self.replicas} replicas x {self.world} shards: reductions are one all_reduce within each "
                f"replica's {self.world} ranks; whole-matrix math is owner-computes over all "
                f"{self.replicas * self.world} ranks (an all_to_all each way within a replica, one all_reduce across "
                "replicas; a split leaf's blocks are matrices of their own)"
            )
        return (
            f"FSDP over {self.world} rank(s): reductions are one all_reduce each; whole-matrix math is owner-computes "
            "(an all_to_all each way; a split leaf's blocks are matrices of their own)"
        )

    def unit_slice(self, unit: Any) -> RowSlice:
        """How the ranks hold a unit of owner-computes: a leaf index (the whole leaf), or
        `(leaf index, a, b)`, the matrix of its rows [a, b) (a block of a split leaf)."""
        if not isinstance(unit, tuple):
            return self.slices[unit]
        i, a, b = unit
        s = self.slices[i]
        lo = [min(max(a, start), b) for start in s.starts]
        hi = [max(min(b, start + count), low) for start, count, low in zip(s.starts, s.counts, lo)]
        rel = tuple(low - a for low in lo)
        return RowSlice(torch.Size((b - a, *s.shape[1:])), rel, tuple(h - low for low, h in zip(lo, hi)), True)

    def global_rank(self) -> int:
        return self.ranks[self.replica][self.rank]

    def leaf_owners(self, leaves: tuple[int, ...] | None = None) -> list[int | None]:
        units = tuple(i for i, s in enumerate(self.sharded) if s and (leaves is None or i in leaves))
        owner, replica = self._assign(units, ()) if units else ({}, {})
        return [self.ranks[replica[i]][owner[i]] if i in owner else None for i in range(len(self.sharded))]

    def _cost(self, unit: Any) -> int:
        """Newton-Schulz's cost of a unit's matrix: m·n·min(m, n)."""
        s = self.unit_slice(unit)
        rows, cols = s.shape[0], s.row_numel
        return rows * cols * min(rows, cols)

    def _matrices(
        self, blocks: dict[int, Tensor], lead: dict[int, int], extra_of: dict[int, Any], run: Callable
    ) -> dict[int, Tensor]:
        """Replicated leaves are computed where they are. Row blocks of a leaf whose dim 0
        indexes matrices (batch_dims >= 1: experts) are whole matrices: each rank computes its
        own, with no collective, and an expert leaf's work is split over the ranks as its rows
        are. Every other sharded leaf is owner-computed: a leaf whose `extra` is its blocks' row
        sizes (Muon's `split`) as one unit per block, each its own matrix at its own owner."""
        results: dict[int, Tensor] = {}
        sharded = [i for i in sorted(blocks) if self.sharded[i]]
        local = [i for i in sorted(blocks) if not self.sharded[i]]
        local += [i for i in sharded if lead[i] >= 1 and blocks[i].shape[0]]
        results.update((i, blocks[i]) for i in sharded if lead[i] >= 1 and not blocks[i].shape[0])
        if local:
            results.update(zip(local, run([blocks[i] for i in local], local)))
        owned = [i for i in sharded if lead[i] < 1]
        if not owned:
            return results
        units: list[Any] = []
        for i in owned:
            sizes = extra_of.get(i)
            if isinstance(sizes, (tuple, list)) and len(sizes) > 1:
                ends = [sum(sizes[: k + 1]) for k in range(len(sizes))]
                units.extend((i, end - size, end) for size, end in zip(sizes, ends))
            else:
                units.append(i)
        mine: dict[Any, Tensor] = {}  # this rank's rows of every unit
        for u in units:
            if not isinstance(u, tuple):
                mine[u] = blocks[u]
                continue
            i, a, _ = u
            start, first = self.slices[i].starts[self.rank], self.unit_slice(u).starts[self.rank] + a
            mine[u] = blocks[i][first - start : first - start + self.unit_slice(u).counts[self.rank]]

        def run_units(mats: list[Tensor], us: list[Any]) -> list[Tensor]:  # a block is a whole matrix: no split
            idx = [u[0] if isinstance(u, tuple) else u for u in us]
            return run(mats, idx, [None if isinstance(u, tuple) else extra_of.get(u) for u in us])

        done = self._owner_computes(tuple(units), mine, run_units)
        out: dict[int, list[Tensor]] = {}
        for u in units:
            out.setdefault(u[0] if isinstance(u, tuple) else u, []).append(done[u])
        results.update((i, torch.cat(parts) if len(parts) > 1 else parts[0]) for i, parts in out.items())
        return results

    def _owner_computes(self, units: tuple, blocks: dict[Any, Tensor], run: Callable) -> dict[Any, Tensor]:
        sl = {u: self.unit_slice(u) for u in units}

        def rows(u: Any, r: int) -> int:
            return sl[u].counts[r] * sl[u].row_numel

        def assemble(u: Any, pieces: list[Tensor]) -> Tensor:  # in row order (nested: not the ranks')
            order = sorted(range(len(pieces)), key=lambda s: sl[u].starts[s])
            parts = [pieces[s].view(sl[u].counts[s], *sl[u].shape[1:]) for s in order]
            return torch.cat(parts) if len(parts) > 1 else parts[0]

        def cut(u: Any, result: Tensor, r: int) -> Tensor:
            return result[sl[u].starts[r] : sl[u].starts[r] + sl[u].counts[r]]

        def compute(whole: list[Tensor], mine: list) -> list[Tensor]:
            return self._replicas_compute(units, mine, whole, run)

        return exchange(self, units, blocks, rows, rows, assemble, cut, compute)

    def _replicas_compute(self, units: tuple, mine: list, whole: list[Tensor], run: Callable) -> list[Tensor]:
        """`run` on the whole matrices this rank owns. Without replicas, on all of them. With
        HSDP's replicas, each replica's owner computes its share (`computing_replica`) and one
        all_reduce over the replicas (zeros where another computed: the sum is exact) gives
        every replica every result."""
        if self.replica_group is None:
            return run(whole, mine)
        replica = self.computing_replica(units)
        todo = [k for k, u in enumerate(mine) if replica[u] == self.replica]
        results = dict(zip(todo, run([whole[k] for k in todo], [mine[k] for k in todo]))) if todo else {}
        flat = torch.cat(
            [results[k].reshape(-1) if k in results else torch.zeros_like(w).reshape(-1) for k, w in enumerate(whole)]
        )
        flat = self.all_reduce(flat, self.replica_group)
        return [part.view(w.shape) for part, w in zip(flat.split([w.numel() for w in whole]), whole)]
