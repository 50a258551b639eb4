"""State that lives where its leaf's whole-matrix math runs (SOAP's and Kron's factors).

On DTensor params whose placement the sharded path models (`mesh.placement`: FSDP2's and
HSDP's row blocks, TP blocks), each sharded leaf's matrix math runs at one rank, its owner,
exactly as `ops.map_matrices` runs Muon's (owners balanced by cost, HSDP's replicas splitting
them). A transform whose per-leaf state is only ever read by that math (SOAP's moments in
the eigenbasis, its factors and bases; Kron's momentum and factors) keeps it there:

- `of(params)`: their `Owners`, made once per layout: which rank runs each leaf is computed
  from the shapes alone (`Placement.leaf_owners`, the assignment owner-computes makes), with
  no exchange and no group made;
- `owners.zeros(i, shape, dtype)`: leaf `i`'s state tensor, a DTensor on the owner's own
  one-rank mesh (`Replicate`; `cache.owner_mesh`, made without a process group): the owner
  holds the whole tensor, every other rank an empty one, and a checkpoint saves it as the whole tensor it stands for (it resumes on any mesh,
  or in one process, where that state is a plain tensor). A leaf every rank computes (a
  replicated one) keeps plain tensors;
- `owners.run(fn, xs, states)`: `fn(i, whole x, its states) -> (result, new states)` on each
  leaf at its owner, given the whole of each `xs` leaf there (one exchange each way, as
  Muon's); returns this rank's block of every result, placed as `xs`, and the new states.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import Tensor

from . import cache
from .dtensor import at_owner, is_dtensor, local
from .mesh import placement
from .placement import Declined


def takes(leaves: list[Any]) -> bool:
    """Whether the leaves are DTensors the engine has a placement for (else: per leaf, as given)."""
    return any(is_dtensor(x) for x in leaves) and of(leaves) is not None


def of(leaves: list[Any]) -> "Owners | None":
    """The `Owners` of leaves laid out as these (made once per layout; every rank asks at the
    same point: the ranks agree in one all_reduce that every one of them takes the layout),
    or None where the engine has no placement for them, or their compute dtypes differ (one
    exchange carries one dtype)."""
    key = tuple(
        (tuple(x.shape), x.dtype, tuple(x.placements), cache.mesh_key(x.device_mesh))
        if is_dtensor(x)
        else (tuple(x.shape), x.dtype)
        for x in leaves
    )

    def make() -> "Owners | None":
        if len({torch.promote_types(x.dtype, torch.float32) for x in leaves}) != 1:
            return None
        found = Owners(list(leaves))
        return found if found.layout is not None else None

    return cache.get("owners", key, make)


def holds(state_leaves: list[Any]) -> bool:
    """Whether a state was placed at its leaves' owners (by `Owners.zeros`): its update runs there too."""
    return any(at_owner(x) for x in state_leaves)


class Owners:
    """Which rank runs each leaf's whole-matrix math, and that leaf's state placed there."""

    def __init__(self, params: list[Any]) -> None:
        self.shapes = [tuple(x.shape) for x in params]
        self.device = next(local(x).device for x in params if is_dtensor(x))
        # Every rank takes the layout or none does (a block one rank holds unevenly declines there).
        try:
            found: Any = placement(list(params))
            why = found.declines({"map_matrices"}, False)  # leaves whose blocks do not tile them
        except Declined as e:
            found, why = None, str(e)
        agreed = torch.tensor([0 if why is None else 1], device=self.device)
        torch.distributed.all_reduce(agreed)
        self.layout = found if int(agreed) == 0 else None
        if self.layout is None:
            return
        # Who runs each leaf, from the shapes alone, as the layout's owner-computes assigns it
        # (None: every rank runs it, a replicated leaf, its state plain as in one process).
        self.owner = self.layout.leaf_owners()
        self.me = self.layout.global_rank()

    def zeros(self, i: int, shape: tuple[int, ...], dtype: torch.dtype, fill: float = 0.0) -> Tensor:
        """Leaf `i`'s state tensor of `shape` (the whole tensor), filled with `fill`."""
        owner = self.owner[i]
        if owner is None:
            return torch.full(shape, fill, dtype=dtype, device=self.device)
        here = torch.full(shape if owner == self.me else (0,), fill, dtype=dtype, device=self.device)
        return self.placed(i, here, shape)

    def placed(self, i: int, whole: Tensor, shape: tuple[int, ...]) -> Tensor:
        """`whole` (the owner's; an empty tensor elsewhere) as leaf `i`'s owner-resident DTensor."""
        from torch.distributed.tensor import DTensor, Replicate

        owner = self.owner[i]
        if owner is None:
            return whole
        stride = torch.empty(shape, device="meta").stride()
        here = whole.contiguous() if owner == self.me else torch.empty((0,), dtype=whole.dtype, device=self.device)
        mesh = cache.owner_mesh(self.device.type, owner)
        return DTensor.from_local(here, mesh, [Replicate()], shape=torch.Size(shape), stride=stride, run_check=False)

    def run(
        self, fn: Callable[[int, Tensor, list[Tensor]], tuple[Tensor, list[Tensor]]], xs: list[Any], states: list
    ) -> tuple[list[Tensor], list[list[Tensor]]]:
        """`fn(i, whole x_i, leaf i's whole states) -> (result shaped like x_i, new states)` at each
        leaf's owner; this rank's block of each result (placed as `xs`) and the new states."""
        new_states: dict[int, list[Tensor]] = {}

        def compute(mats: list[Tensor], idx: list[int], extras: Any = None) -> list[Tensor]:
            out = []
            for m, i in zip(mats, idx):
                result, new = fn(i, m, [local(s) for s in states[i]])
                new_states[i] = new
                out.append(result)
            return out

        assert self.layout is not None, "Owners.run on a layout `of` declined"
        blocks = {i: local(x) for i, x in enumerate(xs)}
        results = self.layout._matrices(blocks, dict.fromkeys(blocks, 0), {}, compute)
        placed = [_like(results[i], x) for i, x in enumerate(xs)]
        out_states = []
        for i, olds in enumerate(states):
            if i in new_states:
                out_states.append([self.placed(i, s, tuple(old.shape)) for s, old in zip(new_states[i], olds)])
            else:  # another rank's: this rank's empty parts, as they were
                out_states.append(list(olds))
        return placed, out_states


def _like(block: Tensor, x: Any) -> Tensor:
    """This rank's `block` with `x`'s placements (no collective)."""
    if not is_dtensor(x):
        return block
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(
        block.reshape(local(x).shape), x.device_mesh, x.placements, shape=x.shape, stride=x.stride(), run_check=False
    )
