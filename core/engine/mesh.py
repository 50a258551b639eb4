"""How DTensor params lie over a device mesh, and the collectives the sharded path runs.

`shard_info(params)` reads the placements: the mesh dim the params are split along (the
shard group), each leaf's row block on this rank (`_Slice`), and on HSDP's (replicate,
shard) mesh the replica group. The `ShardInfo` it returns serves `ops` over shards:
reductions are local partials summed in one `all_reduce` within the shard group (a
replicated leaf counted once), and whole-matrix math is owner-computes (every matrix gets
an owner slot, balanced by Newton-Schulz cost and recomputed from the shapes on every rank;
the blocks travel to their owner in one `all_to_all_single` and the results' rows back in
a second; on HSDP the replicas split the owners and one `all_reduce` across replicas
completes every result).

Other layouts (tensor parallelism alone or beside FSDP2: `Shard(d)` on any mesh dim, FSDP's
`_StridedShard` rows on top of TP, params over a root mesh and its named slices, plain
tensors beside them) are read as blocks (`tp.blocks_info`): the reductions run over every
rank of the root mesh with each block counted once, and owner-computes assembles each matrix
at its owner from the ranks' blocks (`tp.Boxes`: where each lies, by DTensor's own arithmetic).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable

import torch
from torch import Tensor

from .. import _tree as tr
from .dtensor import is_dtensor
from .packed import PackSpec


Unit = Any  # a unit of owner-computes: a leaf index, or (leaf index, first row, end row)


def _order(unit: Unit) -> tuple[int, int]:
    return (unit, 0) if not isinstance(unit, tuple) else unit[:2]


@dataclasses.dataclass(frozen=True)
class _Slice:
    """A leaf as the ranks hold it: rows [starts[r], starts[r] + counts[r]) on rank r."""

    shape: torch.Size  # the whole leaf's
    starts: tuple[int, ...]
    counts: tuple[int, ...]
    sharded: bool  # False: every rank holds all of it (Replicate, or a plain tensor)

    @property
    def row_numel(self) -> int:
        return math.prod(self.shape[1:])


def _shard_dim(path: str, x: Any) -> int | None:
    """The mesh dim along which DTensor `x` is split in row blocks (`Shard(0)`), or None
    when every mesh dim replicates it: FSDP2 on a 1-D mesh, HSDP's (Replicate, Shard(0))
    on a (replicate, shard) mesh, or a replicated param."""
    from torch.distributed.tensor import Replicate, Shard

    placements = tuple(x.placements)
    split = [d for d, p in enumerate(placements) if not isinstance(p, Replicate)]
    if not split:
        return None
    if len(split) > 1 or type(placements[split[0]]) is not Shard or placements[split[0]].dim != 0:
        raise ValueError(
            f"param '{path}' is placed {placements} over a {x.device_mesh.ndim}-D mesh; purestep's sharded step "
            "takes Shard(0) on one mesh dim and Replicate on the others (FSDP2, HSDP)"
        )
    return split[0]


def _slice_of(path: str, x: Any, world: int, rank: int) -> _Slice:
    """How the ranks of the shard group hold `x` (row blocks as torch.chunk cuts them)."""
    if not is_dtensor(x) or _shard_dim(path, x) is None:
        return _Slice(x.shape, (0,) * world, (x.shape[0] if x.dim() else 1,) * world, False)
    rows = x.shape[0]
    chunk = -(-rows // world)  # torch.chunk: ceil(rows / world) rows per rank, the last ones fewer or none
    starts = tuple(min(r * chunk, rows) for r in range(world))
    counts = tuple(min(chunk, rows - s) for s in starts)
    if tuple(x._local_tensor.shape) != (counts[rank], *x.shape[1:]):
        raise ValueError(
            f"param '{path}': this rank holds {tuple(x._local_tensor.shape)} of {tuple(x.shape)}, not torch.chunk's "
            f"{(counts[rank], *x.shape[1:])} rows; purestep's sharded step takes FSDP2's even chunking"
        )
    return _Slice(x.shape, starts, counts, True)


class ShardInfo:
    """How the leaves of a packed tree are spread over the ranks of one process group, and
    the collectives `ops` runs over it. Off (`active=False`) until the layout is planned and
    the state built on its buffers (`init` on the packed params): reductions until then are
    local and communicate nothing."""

    def __init__(
        self,
        group: Any,
        world: int,
        rank: int,
        slices: list[_Slice],
        replicas: tuple[Any, int, int] | None = None,
        copies: tuple[list[tuple[int, ...]], tuple[int, ...]] | None = None,
        boxes: Any = None,
        device: torch.device | None = None,
    ) -> None:
        self.group, self.world, self.rank = group, world, rank
        # Where every payload of its collectives lives: the params' device (NCCL refuses others).
        self.device = device if device is not None else torch.device("cpu")
        self.slices = slices  # by leaf index (flatten order of the params)
        # HSDP: (the group of this rank's replicas, their number, this rank's index among them)
        self.replica_group: Any
        self.replica_group, self.replicas, self.replica = replicas if replicas is not None else (None, 1, 0)
        # Blocks (TP, FSDP beside TP; see `tp.blocks_info`): `(per leaf, the root mesh dims along
        # which the ranks hold copies of one block; this rank's coordinate on the root mesh)`,
        # and this rank weighs 1 in a reduction where it holds the copy at coordinate 0 of
        # each such dim. Rows (FSDP2, HSDP): None; a replicated leaf weighs 1 on rank 0.
        self.copies = copies[0] if copies is not None else None
        if copies is None:
            self.weights = [1.0 if s.sharded or rank == 0 else 0.0 for s in slices]
        else:
            self.weights = [1.0 if all(copies[1][d] == 0 for d in c) else 0.0 for c in copies[0]]
        self.boxes = boxes  # TP blocks: where each rank's block lies (`tp.Boxes`)
        self.active = False
        self._owners: dict[tuple[int, ...], tuple[dict[int, int], dict[int, int]]] = {}

    @property
    def blocks(self) -> bool:
        """Whether leaves lie in blocks other than FSDP2's row blocks (TP): reductions run over
        every rank, owner-computes assembles each matrix from boxes (`tp.owner_computes`)."""
        return self.copies is not None

    def tags(self, index: int) -> tuple:
        """What keeps leaf `index` apart in the layout, the same on every rank: leaves of one
        buffer share their weight in every reduction."""
        return (("sharded", self.slices[index].sharded),) if self.copies is None else (("copies", self.copies[index]),)

    def declines(self, reductions: set[str], per_row_state: bool) -> str | None:
        """Why a transform cannot run on these blocks, or None. On TP blocks, per-row
        statistics (NorMuon: a row may be split over ranks) are not built, and whole-matrix
        math needs every leaf's blocks to tile it (`tp.untiled`)."""
        if self.blocks and per_row_state:
            return "per-row statistics over tensor-parallel blocks (a row split over ranks) are not built: whole DTensors run them"
        if self.blocks and "map_matrices" in reductions:
            from . import tp

            return tp.untiled(self)
        return None

    # -- shapes and weights -----------------------------------------------------
    def full_shape(self, member: Any) -> torch.Size:
        return self.slices[member.index].shape

    def _weight(self, index: int) -> float:
        return self.weights[index]

    def group_weights(self, spec: PackSpec) -> list[float]:
        """Per group: 1, or for a group of replicated leaves 1 on rank 0 and 0 elsewhere, so
        that a sum over ranks counts each element once (groups never mix the two kinds)."""
        return [self._weight(g.members[0].index) for g in spec.groups]

    def member_weights(self, spec: PackSpec, dtype: torch.dtype, device: Any) -> Tensor:
        """`group_weights` per member, in the order `ops.leaf_norms` lays them out."""
        return torch.tensor(
            [self._weight(m.index) for g in spec.groups for m in (g.members if g.is_stack else g.members[:1])],
            dtype=dtype,
            device=device,
        )

    # -- collectives --------------------------------------------------------------
    def all_reduce(self, t: Tensor) -> Tensor:
        if self.world == 1:
            return t
        import torch.distributed._functional_collectives as fc

        return fc.wait_tensor(fc.all_reduce(self._on_device(t), "sum", self.group))

    def _all_to_all(self, x: Tensor, out_splits: list[int], in_splits: list[int]) -> Tensor:
        import torch.distributed._functional_collectives as fc

        return fc.wait_tensor(fc.all_to_all_single(self._on_device(x), out_splits, in_splits, self.group))

    def _on_device(self, t: Tensor) -> Tensor:
        """`t`, checked to live on the params' device: a payload made elsewhere (a CPU 0-d
        beside CUDA params) would fail in NCCL, or cost a copy and a sync: a bug to fix where
        it is made (a static check, free in compiled code)."""
        if t.device.type != self.device.type:
            raise RuntimeError(
                f"purestep internal error: a collective's payload is on {t.device}, the params on {self.device}; "
                "please report it"
            )
        return t

    def unit_slice(self, unit: Unit) -> _Slice:
        """How the ranks hold a unit of owner-computes: a leaf index (the whole leaf), or
        `(leaf index, a, b)`, the matrix of its rows [a, b) (a block of a split leaf)."""
        if not isinstance(unit, tuple):
            return self.slices[unit]
        i, a, b = unit
        s = self.slices[i]
        lo = [min(max(a, start), b) for start in s.starts]
        hi = [max(min(b, start + count), low) for start, count, low in zip(s.starts, s.counts, lo)]
        rel = tuple(low - a for low in lo)
        return _Slice(torch.Size((b - a, *s.shape[1:])), rel, tuple(h - low for low, h in zip(lo, hi)), True)

    def owners(self, units: tuple[Unit, ...]) -> dict[Unit, int]:
        """unit -> owner rank (in the shard group) for the sharded matrices `units` (leaf
        indices, or (leaf, a, b) row blocks: see `unit_slice`)."""
        return self._assign(units)[0]

    def computing_replica(self, units: tuple[Unit, ...]) -> dict[Unit, int]:
        """unit -> the replica whose owner computes it (HSDP; 0 without replicas)."""
        return self._assign(units)[1]

    def _assign(self, indices: tuple[Unit, ...]) -> tuple[dict[Unit, int], dict[Unit, int]]:
        """Owners and computing replicas: largest Newton-Schulz cost (m·n·min(m, n)) first,
        each to the least loaded (replica, rank) slot of the whole mesh (ties: the lowest),
        so with R replicas of S ranks each rank computes about 1/(R·S) of the work; the
        blocks of a split leaf (a fused QKV's q, k, v, or its heads) are units of their own,
        so one large fused leaf spreads over several ranks. A pure function of the shapes:
        every rank computes the same assignment."""
        if indices not in self._owners:

            def cost(u: Unit) -> int:
                s = self.unit_slice(u)
                rows, cols = s.shape[0], s.row_numel
                return rows * cols * min(rows, cols)

            slots = [(q, r) for q in range(self.replicas) for r in range(self.world)]
            load = dict.fromkeys(slots, 0)
            owner, replica = {}, {}
            for i in sorted(indices, key=lambda i: (-cost(i), _order(i))):
                q, r = min(slots, key=lambda s: (load[s], s))
                owner[i], replica[i] = r, q
                load[(q, r)] += cost(i)
            self._owners[indices] = (owner, replica)
        return self._owners[indices]

    def map_matrices(
        self, spec: PackSpec, fn: Callable, xs: list[Tensor], batch: list[int], extra: list | None = None
    ) -> list[Tensor]:
        """`ops.map_matrices` over shards: owner-computes (see the module docstring);
        `batch`: the leading batch dims of each group's leaves; `extra`: a value per group
        handed to `fn` with each of its leaves (`fn(mats, lead, extras)`), when given."""
        blocks: dict[int, Tensor] = {}  # leaf index -> this rank's block
        lead: dict[int, int] = {}  # leaf index -> its batch dims (stacks are unbound here)
        extra_of: dict[int, Any] = {}
        for g, x, b, e in zip(spec.groups, xs, batch, extra if extra is not None else [None] * len(xs)):
            members = g.members
            parts = list(x.unbind(0)) if g.is_stack else [x]
            blocks.update((m.index, p) for m, p in zip(members, parts))
            lead.update((m.index, b) for m in members)
            extra_of.update((m.index, e) for m in members)

        def run(mats: list[Tensor], idx: list[int], extras: list | None = None) -> list[Tensor]:
            """`fn` on the whole matrices of these leaves (`extras`: in place of the leaves' own)."""
            leads = [lead[i] for i in idx]
            if extra is None:
                return fn(mats, leads)
            return fn(mats, leads, extras if extras is not None else [extra_of[i] for i in idx])

        results: dict[int, Tensor] = {}
        replicated = [i for i in sorted(blocks) if not self.slices[i].sharded]
        if self.blocks:  # TP blocks: every leaf split over ranks is assembled whole at its owner
            sharded, by_block = sorted(i for i in blocks if self.slices[i].sharded), []
        else:
            # Row blocks of a leaf whose dim 0 indexes matrices (batch_dims >= 1: experts) are whole
            # matrices: each rank computes its own, with no collective, and an expert leaf's work is
            # split over the ranks as its rows are (blocks, not leaves).
            by_block = [i for i in sorted(blocks) if self.slices[i].sharded and lead[i] >= 1 and blocks[i].shape[0]]
            sharded = sorted(i for i in blocks if self.slices[i].sharded and lead[i] < 1)
            results.update(
                (i, blocks[i]) for i in blocks if self.slices[i].sharded and lead[i] >= 1 and not blocks[i].shape[0]
            )
        local = replicated + by_block
        if local:  # every rank holds these whole (replicated leaves, its own expert matrices): computed where they are
            results.update(zip(local, run([blocks[i] for i in local], local)))
        if sharded and self.blocks:
            from . import tp

            results.update(tp.owner_computes(self, tuple(sharded), blocks, run))
        elif sharded:
            results.update(self._split_owner_computes(sharded, blocks, lead, extra_of, run))
        out = []
        for g, x in zip(spec.groups, xs):
            parts = [results[m.index].reshape(blocks[m.index].shape) for m in g.members]
            out.append(torch.stack(parts) if g.is_stack else parts[0])
        return out

    def _split_owner_computes(
        self,
        leaves: list[int],
        blocks: dict[int, Tensor],
        lead: dict[int, int],
        extra_of: dict[int, Any],
        run: Callable,
    ) -> dict[int, Tensor]:
        """Owner-computes over units: a leaf whose `extra` is its blocks' row sizes (Muon's
        `split`) is one unit per block, each its own matrix at its own owner; any other leaf
        is one unit. Returns this rank's rows of every leaf's result."""
        units: list[Unit] = []
        for i in leaves:
            sizes = extra_of.get(i)
            if lead[i] == 0 and isinstance(sizes, (tuple, list)) and len(sizes) > 1:
                ends = [sum(sizes[: k + 1]) for k in range(len(sizes))]
                units.extend((i, end - size, end) for size, end in zip(sizes, ends))
            else:
                units.append(i)
        local: dict[Unit, Tensor] = {}
        for u in units:
            if not isinstance(u, tuple):
                local[u] = blocks[u]
                continue
            i, a, _ = u
            start, first = self.slices[i].starts[self.rank], self.unit_slice(u).starts[self.rank] + a
            local[u] = blocks[i][first - start : first - start + self.unit_slice(u).counts[self.rank]]

        def run_units(mats: list[Tensor], us: list[Unit]) -> list[Tensor]:  # a block is a whole matrix: no split
            idx = [u[0] if isinstance(u, tuple) else u for u in us]
            return run(mats, idx, [None if isinstance(u, tuple) else extra_of.get(u) for u in us])

        done = self._owner_computes(tuple(units), local, run_units)
        out: dict[int, list[Tensor]] = {}
        for u in units:
            out.setdefault(u[0] if isinstance(u, tuple) else u, []).append(done[u])
        return {i: torch.cat(parts) if len(parts) > 1 else parts[0] for i, parts in out.items()}

    def _owner_computes(
        self, indices: tuple[Unit, ...], blocks: dict[Unit, Tensor], run: Callable
    ) -> dict[Unit, Tensor]:
        owner, me, world = self.owners(indices), self.rank, self.world
        mine = [i for i in indices if owner[i] == me]
        dtype = blocks[indices[0]].dtype
        sl = {u: self.unit_slice(u) for u in indices}
        # Blocks to their owners: to rank d, my rows of every matrix d owns, in leaf order.
        send = [blocks[i].reshape(-1).to(dtype) for d in range(world) for i in indices if owner[i] == d]
        in_splits = [sum(sl[i].counts[me] * sl[i].row_numel for i in indices if owner[i] == d) for d in range(world)]
        out_splits = [sum(sl[i].counts[s] * sl[i].row_numel for i in mine) for s in range(world)]
        got = self._all_to_all(torch.cat(send) if send else blocks[indices[0]].new_zeros(0), out_splits, in_splits)
        pieces = got.split([sl[i].counts[s] * sl[i].row_numel for s in range(world) for i in mine])
        whole = []
        for k, i in enumerate(mine):  # rank s's rows of matrix i sit at s·len(mine) + k
            rows = [pieces[s * len(mine) + k].view(sl[i].counts[s], *sl[i].shape[1:]) for s in range(world)]
            whole.append(torch.cat(rows) if len(rows) > 1 else rows[0])
        done = _replicas_compute(self, indices, mine, whole, run) if whole else []
        # Results back: to rank d, its rows of every matrix I own.
        back = [
            o[sl[i].starts[d] : sl[i].starts[d] + sl[i].counts[d]].reshape(-1)
            for d in range(world)
            for i, o in zip(mine, done)
        ]
        in_splits = [sum(sl[i].counts[d] * sl[i].row_numel for i in mine) for d in range(world)]
        out_splits = [sum(sl[i].counts[me] * sl[i].row_numel for i in indices if owner[i] == s) for s in range(world)]
        ref = done[0] if done else blocks[indices[0]]
        got = self._all_to_all(torch.cat(back) if back else ref.new_zeros(0), out_splits, in_splits)
        order = [i for s in range(world) for i in indices if owner[i] == s]
        parts = got.split([sl[i].counts[me] * sl[i].row_numel for i in order])
        return {i: p.view(blocks[i].shape) for i, p in zip(order, parts)}


def describe(params: Any) -> str:
    """What the sharded path runs on these params' mesh, for `explain()`."""
    try:
        info = shard_info(params)
    except ValueError as e:
        return str(e)
    if info.blocks:
        return (
            f"tensor-parallel blocks over {info.world} ranks: elementwise math on each rank's blocks; reductions "
            "are one all_reduce over every rank, each block counted once (its copies on other ranks weigh 0); "
            "whole-matrix math is owner-computes over every rank (each matrix assembled from its row x column "
            "blocks at its owner in one all_to_all, its result's blocks back in a second)"
        )
    if info.replicas > 1:
        return (
            f"HSDP, {info.replicas} replicas x {info.world} shards: reductions are one all_reduce within each "
            f"replica's {info.world} ranks; whole-matrix math is owner-computes over all {info.replicas * info.world} "
            "ranks (an all_to_all each way within a replica, one all_reduce across replicas; a split leaf's blocks "
            "are matrices of their own)"
        )
    return (
        f"FSDP over {info.world} rank(s): reductions are one all_reduce each; whole-matrix math is owner-computes "
        "(an all_to_all each way; a split leaf's blocks are matrices of their own)"
    )


def _replicas_compute(
    info: ShardInfo, indices: tuple[int, ...], mine: list[int], whole: list[Tensor], run: Callable
) -> list[Tensor]:
    """`fn` on the whole matrices this rank owns. Without replicas, on all of them. With
    HSDP's replicas, each replica's owner computes its share (`computing_replica`) and one
    all_reduce over the replicas (zeros where another computed: the sum is exact) gives
    every replica every result."""
    if info.replica_group is None:
        return run(whole, mine)
    replica = info.computing_replica(indices)
    todo = [k for k, i in enumerate(mine) if replica[i] == info.replica]
    results = dict(zip(todo, run([whole[k] for k in todo], [mine[k] for k in todo]))) if todo else {}
    flat = torch.cat(
        [results[k].reshape(-1) if k in results else torch.zeros_like(w).reshape(-1) for k, w in enumerate(whole)]
    )
    import torch.distributed._functional_collectives as fc

    flat = fc.wait_tensor(fc.all_reduce(info._on_device(flat), "sum", info.replica_group))
    return [part.view(w.shape) for part, w in zip(flat.split([w.numel() for w in whole]), whole)]


def shard_info(params: Any) -> ShardInfo:
    """How `params` lie over the ranks: FSDP2's or HSDP's row blocks (`_rows_info`), else
    any blocks of DTensors over one root mesh (`tp.blocks_info`: TP, FSDP beside TP)."""
    try:
        return _rows_info(params)
    except ValueError as rows_error:
        try:
            from .tp import blocks_info

            return blocks_info(params)
        except ValueError as e:
            raise ValueError(f"{rows_error}; nor as blocks: {e}") from None


def _rows_info(params: Any) -> ShardInfo:
    """How `params` (DTensors of one mesh, or plain tensors: replicated) lie over the ranks.

    The shard group is the mesh dim the params are split along (the whole mesh when it is
    1-D). On HSDP's (replicate, shard) mesh each replica is a shard group holding every
    param whole between its ranks, with grads equal across replicas (FSDP2 all-reduces
    them): reductions and owner-computes run within the shard group, so every replica
    computes the same values by the same ops and the replicas stay bitwise identical."""
    pairs, _ = tr.tree_flatten_with_path(params)
    # One mesh (fully_shard per block makes equal mesh objects: compared by their ranks).
    meshes = {
        (
            x.device_mesh.device_type,
            tuple(x.device_mesh.mesh.shape),
            tuple(x.device_mesh.mesh.flatten().tolist()),
        ): x.device_mesh
        for _, x in pairs
        if is_dtensor(x)
    }
    if len(meshes) != 1:
        raise ValueError(f"the params' DTensors live on {len(meshes)} device meshes; purestep's sharded step takes one")
    mesh = next(iter(meshes.values()))
    dims = {d for p, x in pairs if is_dtensor(x) for d in [_shard_dim(p, x)] if d is not None}
    if len(dims) > 1:
        raise ValueError(
            f"the params are split along mesh dims {sorted(dims)}; purestep's sharded step takes one shard dim"
        )
    dim = dims.pop() if dims else mesh.ndim - 1
    group = mesh.get_group(dim) if mesh.ndim > 1 else mesh.get_group()
    world, rank = torch.distributed.get_world_size(group), torch.distributed.get_rank(group)
    replicas = None
    if mesh.ndim == 2:  # HSDP: the other mesh dim holds the replicas
        other = mesh.get_group(1 - dim)
        if torch.distributed.get_world_size(other) > 1:
            replicas = (other, torch.distributed.get_world_size(other), torch.distributed.get_rank(other))
    device = next(x for _, x in pairs if is_dtensor(x)).device
    return ShardInfo(group, world, rank, [_slice_of(p, x, world, rank) for p, x in pairs], replicas, device=device)
