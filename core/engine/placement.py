"""What the sharded path asks of a layout: the protocol both placements keep.

A `Placement` says how the leaves of a packed tree lie over the ranks of one process group
and runs the collectives `ops` needs over them. Two layouts implement it, one model each:

- `rows.RowShards`: FSDP2's row blocks (a 1-D mesh) and HSDP's (replicate, shard) mesh;
- `tp.TPBlocks`: any blocks over one root mesh (TP alone, FSDP2 beside TP).

`mesh.placement(params)` reads the params' placements and builds the one that fits. The
protocol, in full:

- `tags(i)`: what keeps leaf `i` apart in the layout (leaves of one buffer share their
  weight in every reduction), the same on every rank;
- `declines(reductions, per_row_state)`: why a transform cannot run on this layout, or None;
- `weights`: per leaf, 1 where this rank's block counts in a sum over ranks, 0 where it is
  a copy counted elsewhere (`group_weights`, `member_weights` lay them out per buffer);
- `all_reduce(t)`: a sum over the ranks;
- `row_range(i)`: (first, count) of the whole leaf `i`'s rows this rank's block holds;
- `row_sums(spec, partials, lead)`: per group, the local sums over each row of its leaves
  (`partials`, shaped up to the row dim) made the sums over whole rows;
- `map_matrices(spec, fn, xs, batch, extra)`: `fn` on whole matrices, owner-computes
  (each matrix gets an owner from the shapes alone, `assign`; its blocks travel there and
  its result's blocks back, `exchange`);
- `leaf_owners()`: per leaf, the global rank that runs its whole-matrix math, computed
  from the shapes (no exchange, no object gather);
- `describe()`: what runs on this layout, for `explain()`.

A placement is off (`active=False`) until the layout is planned and the state built on its
buffers: reductions until then are local and communicate nothing.
"""

from __future__ import annotations

import abc
from typing import Any, Callable, Hashable

import torch
from torch import Tensor

from .packed import PackSpec

Unit = Hashable  # a unit of owner-computes: a leaf index, or (leaf index, first row, end row)


class Declined(ValueError):
    """Params the sharded path does not take (a mesh, a placement, a block it has no model
    for), with the reason: the runners catch this one alone and fall back per leaf, so an
    error in a transform's own code is never taken for a layout."""


def assign(
    units: tuple, cost: Callable[[Any], int], replicas: int, world: int, load: tuple[int, ...] = ()
) -> tuple[dict, dict]:
    """Owners and computing replicas of `units`: largest cost first, each to the least loaded
    (replica, rank) slot (ties: the lowest), so with R replicas of S ranks each rank computes
    about 1/(R·S) of the work. `load`: per rank, the work it computes anyway (matrices it
    holds whole: experts), counted from the start in every replica. A pure function of the
    shapes: every rank computes the same."""

    def order(u: Any) -> tuple[int, int]:
        return (u, 0) if not isinstance(u, tuple) else u[:2]

    slots = [(q, r) for q in range(replicas) for r in range(world)]
    start = dict(enumerate(load))
    load_of = {(q, r): start.get(r, 0) for q, r in slots}
    owner, replica = {}, {}
    for u in sorted(units, key=lambda u: (-cost(u), order(u))):
        q, r = min(slots, key=lambda s: (load_of[s], s))
        owner[u], replica[u] = r, q
        load_of[(q, r)] += cost(u)
    return owner, replica


class Placement(abc.ABC):
    """The part of the protocol both layouts share (see the module docstring); `rows` and
    `tp` add how the leaves lie (`tags`, `declines`, `describe`) and their owner-computes
    (`_matrices`)."""

    def __init__(
        self,
        group: Any,
        world: int,
        rank: int,
        shapes: list[torch.Size],
        sharded: list[bool],
        weights: list[float],
        device: torch.device | None,
    ) -> None:
        # the process group of the collectives, or a function that makes it at the first
        # collective (planning and `explain()` create no group)
        self._group = group
        self.world, self.rank = world, rank
        # Where every payload of its collectives lives: the params' device (NCCL refuses others).
        self.device = device if device is not None else torch.device("cpu")
        self.shapes = shapes  # by leaf index (flatten order of the params): the whole leaf's
        self.sharded = sharded  # False: every rank holds all of the leaf (Replicate, a plain tensor)
        self.weights = weights
        self.active = False
        self.replicas = 1  # the (replica, rank) slots owner-computes spreads over: HSDP's replicas
        self._owners: dict[tuple, tuple[dict, dict]] = {}

    # -- what a layout says about itself ------------------------------------------------
    @abc.abstractmethod
    def tags(self, index: int) -> tuple:
        """See the module docstring."""

    @abc.abstractmethod
    def declines(self, reductions: set[str], per_row_state: bool) -> str | None:
        """See the module docstring."""

    @abc.abstractmethod
    def describe(self) -> str:
        """See the module docstring."""

    @abc.abstractmethod
    def row_range(self, index: int) -> tuple[int, int]:
        """See the module docstring."""

    @abc.abstractmethod
    def row_sums(self, spec: PackSpec, partials: list[Tensor], lead: list[int]) -> list[Tensor]:
        """See the module docstring."""

    @abc.abstractmethod
    def _matrices(
        self, blocks: dict[int, Tensor], lead: dict[int, int], extra_of: dict[int, Any], run: Callable
    ) -> dict[int, Tensor]:
        """This rank's block of `fn`'s result for every leaf of `blocks`."""

    @abc.abstractmethod
    def _cost(self, unit: Any) -> int:
        """See the module docstring."""

    @abc.abstractmethod
    def global_rank(self) -> int:
        """This rank's rank in the default group (read from the mesh)."""

    @abc.abstractmethod
    def leaf_owners(self, leaves: tuple[int, ...] | None = None) -> list[int | None]:
        """Per leaf, the global rank that runs its whole-matrix math when each split leaf of
        `leaves` (None: every leaf) is one matrix computed at its owner (`engine.owners`;
        Muon's hidden matrices when `leaves` are those), as `_matrices` assigns it: from the
        shapes alone, the same on every rank; None for a leaf left out or computed by every
        rank (a replicated one)."""

    @property
    def group(self) -> Any:
        if callable(self._group):
            self._group = self._group()
        return self._group

    # -- shapes and weights -----------------------------------------------------
    def full_shape(self, member: Any) -> torch.Size:
        return self.shapes[member.index]

    def group_weights(self, spec: PackSpec) -> list[float]:
        """Per group: the weight of its leaves (groups never mix weights: `tags`)."""
        return [self.weights[g.members[0].index] for g in spec.groups]

    def member_weights(self, spec: PackSpec, dtype: torch.dtype, device: Any) -> Tensor:
        """The weights per member, in the order `ops.leaf_norms` lays them out."""
        return torch.tensor(
            [self.weights[m.index] for g in spec.groups for m in (g.members if g.is_stack else g.members[:1])],
            dtype=dtype,
            device=device,
        )

    # -- collectives --------------------------------------------------------------
    def all_reduce(self, t: Tensor, group: Any = None) -> Tensor:
        """The sum of `t` over the ranks of the group (another group when given: HSDP's replicas)."""
        if group is None and self.world == 1:
            return t
        import torch.distributed._functional_collectives as fc

        return fc.wait_tensor(fc.all_reduce(self.on_device(t), "sum", self.group if group is None else group))

    def all_to_all(self, x: Tensor, out_splits: list[int], in_splits: list[int]) -> Tensor:
        import torch.distributed._functional_collectives as fc

        return fc.wait_tensor(fc.all_to_all_single(self.on_device(x), out_splits, in_splits, self.group))

    def on_device(self, t: Tensor) -> Tensor:
        """`t`, checked to live on the params' device: a payload made elsewhere (a CPU 0-d
        beside CUDA params) would fail in NCCL, or cost a copy and a sync: a bug to fix where
        it is made (a static check, free in compiled code)."""
        if t.device.type != self.device.type:
            raise RuntimeError(
                f"purestep internal error: a collective's payload is on {t.device}, the params on {self.device}; "
                "please report it"
            )
        return t

    # -- owner-computes -------------------------------------------------------------
    def owners(self, units: tuple, load: tuple[int, ...] = ()) -> dict:
        """unit -> owner rank (in the group), from the shapes alone (`assign`; `load`: the
        work each rank computes anyway)."""
        return self._assign(units, load)[0]

    def computing_replica(self, units: tuple, load: tuple[int, ...] = ()) -> dict:
        """unit -> the replica whose owner computes it (HSDP; 0 without replicas)."""
        return self._assign(units, load)[1]

    def _assign(self, units: tuple, load: tuple[int, ...]) -> tuple[dict, dict]:
        if (units, load) not in self._owners:
            self._owners[(units, load)] = assign(units, self._cost, self.replicas, self.world, load)
        return self._owners[(units, load)]

    def map_matrices(
        self, spec: PackSpec, fn: Callable, xs: list[Tensor], batch: list[int], extra: list | None = None
    ) -> list[Tensor]:
        """`ops.map_matrices` over this layout; `batch`: the leading batch dims of each
        group's leaves; `extra`: a value per group handed to `fn` with each of its leaves
        (`fn(mats, lead, extras)`), when given."""
        blocks: dict[int, Tensor] = {}  # leaf index -> this rank's block
        lead: dict[int, int] = {}  # leaf index -> its batch dims (stacks are unbound here)
        extra_of: dict[int, Any] = {}
        for g, x, b, e in zip(spec.groups, xs, batch, extra if extra is not None else [None] * len(xs)):
            parts = list(x.unbind(0)) if g.is_stack else [x]
            blocks.update((m.index, p) for m, p in zip(g.members, parts))
            lead.update((m.index, b) for m in g.members)
            extra_of.update((m.index, e) for m in g.members)

        def run(mats: list[Tensor], idx: list[int], extras: list | None = None) -> list[Tensor]:
            """`fn` on the whole matrices of these leaves (`extras`: in place of the leaves' own)."""
            leads = [lead[i] for i in idx]
            if extra is None:
                return fn(mats, leads)
            return fn(mats, leads, extras if extras is not None else [extra_of[i] for i in idx])

        results = self._matrices(blocks, lead, extra_of, run)
        out = []
        for g in spec.groups:
            parts = [results[m.index].reshape(blocks[m.index].shape) for m in g.members]
            out.append(torch.stack(parts) if g.is_stack else parts[0])
        return out


def exchange(
    placement: Placement,
    units: tuple,
    blocks: dict[Any, Tensor],
    sent: Callable[[Any, int], int],
    held: Callable[[Any, int], int],
    assemble: Callable[[Any, list[Tensor]], Tensor],
    cut: Callable[[Any, Tensor, int], Tensor],
    compute: Callable[[list[Tensor], list], list[Tensor]],
    load: tuple[int, ...] = (),
) -> dict[Any, Tensor]:
    """Owner-computes, the exchange both layouts run: every rank sends its block of each unit
    to the unit's owner in one all_to_all (`sent(u, r)`: how many elements rank r sends, 0 for
    none: an empty block, a copy counted elsewhere); the owner puts the whole matrix together
    (`assemble(u, the flat pieces by rank)`), runs `compute(wholes, units)` on all it owns,
    and sends every rank its block of each result (`cut(u, result, r)`, `held(u, r)` elements)
    in a second all_to_all (owners balanced over `load`, the work each rank computes
    anyway). Returns this rank's block of every unit's result."""
    owner, me, world = placement.owners(units, load), placement.rank, placement.world
    mine = [u for u in units if owner[u] == me]
    dtype = blocks[units[0]].dtype
    send = [blocks[u].reshape(-1).to(dtype) for d in range(world) for u in units if owner[u] == d and sent(u, me)]
    in_splits = [sum(sent(u, me) for u in units if owner[u] == d) for d in range(world)]
    out_splits = [sum(sent(u, s) for u in mine) for s in range(world)]
    got = placement.all_to_all(torch.cat(send) if send else blocks[units[0]].new_zeros(0), out_splits, in_splits)
    pieces = got.split([sent(u, s) for s in range(world) for u in mine])
    # rank s's piece of the k-th unit I own sits at s·len(mine) + k
    whole = [assemble(u, [pieces[s * len(mine) + k] for s in range(world)]) for k, u in enumerate(mine)]
    done = compute(whole, mine) if whole else []
    back = [cut(u, o, d).reshape(-1) for d in range(world) for u, o in zip(mine, done)]
    in_splits = [sum(held(u, d) for u in mine) for d in range(world)]
    out_splits = [sum(held(u, me) for u in units if owner[u] == s) for s in range(world)]
    ref = done[0] if done else blocks[units[0]]
    got = placement.all_to_all(torch.cat(back) if back else ref.new_zeros(0), out_splits, in_splits)
    order = [u for s in range(world) for u in units if owner[u] == s]
    parts = got.split([held(u, me) for u in order])
    return {u: p.view(blocks[u].shape) for u, p in zip(order, parts)}
