"""torchft's `Manager` as the communication of `ps.diloco`: replica groups that fail and come
back, each one DiLoCo worker, as torchft's own DiLoCo runs them (docs: the DiLoCo guide).

torchft (meta-pytorch/torchft) is not a dependency: `TorchFT` takes a manager the caller
built (`use_async_quorum=False`, as torchft's DiLoCo requires).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import Tensor

import purestep.core as ps

from . import distributed as D


class TorchFT:
    """torchft's replica groups as `ps.diloco`'s workers.

    Each sync is one step of the manager. `begin(state)`, called before each update, starts
    the manager's quorum when the update will sync (on a replica group that came back, the
    quorum heals it: the manager loads a live group's state into the trees given to `keep`,
    before the step runs); `reduce` averages a pseudo-gradient over the groups in the quorum
    (the manager's allreduce); `commit` is the groups' vote (the manager's `should_commit`):
    a sync that fails is dropped, the params go back to the anchor.

    Args:
      manager: a `torchft.Manager` built with `use_async_quorum=False`.

    Examples:
        ```
        ft = TorchFT(manager)
        opt = ft.diloco(ps.adamw(3e-4), ps.sgd(0.7, momentum=0.9, nesterov=True), 50)
        update = ps.make_update(opt, donate=True)  # eager: the vote is a host call
        params, state = dict(model.named_parameters()), opt.init(...)
        ft.keep("train", params, state)  # what a group that comes back takes from a live one
        for batch in batches:
            ft.begin(state)
            update(params, grads_of(params, batch), state)
        ```
    """

    def __init__(self, manager: Any) -> None:
        if getattr(manager, "_use_async_quorum", False):
            raise ValueError("manager: build it with use_async_quorum=False (DiLoCo's syncs need the quorum first)")
        self.manager = manager
        self.transform: Any = None  # the diloco transform `diloco` built
        self.open = False  # a quorum started whose vote is still to come

    def diloco(self, inner: Any, outer: Any, sync_every: int, **kwargs: Any) -> Any:
        """`ps.diloco(inner, outer, sync_every, reduce=self.reduce, commit=self.commit, **kwargs)`
        (streaming's `fragments`, `delay`, `alpha`; not SparseLoCo's compression, which exchanges
        through an all_gather torchft does not have), the transform `begin` reads the syncs of."""
        if "compression" in kwargs or "reduce" in kwargs or "commit" in kwargs:
            raise ValueError(
                "TorchFT.diloco: the exchange is the manager's allreduce (no compression, reduce or commit)"
            )
        self.transform = ps.diloco(inner, outer, sync_every, reduce=self.reduce, commit=self.commit, **kwargs)
        return self.transform

    def _quiet(self, calls: int) -> bool:
        needs = ps.needs_of(self.transform) if self.transform is not None else None
        phase = needs.phase if needs is not None else None
        if phase is None:
            raise ValueError("TorchFT.begin: build the transform with TorchFT.diloco first")
        return bool(phase.quiet(calls))

    def begin(self, state: Any) -> bool:
        """Before an update of `state` (the diloco state, or a tree holding it): start the
        manager's quorum if this update syncs (one host read of the count); True if it did."""
        found = [s for s in pytree.tree_leaves(state, is_leaf=lambda x: isinstance(x, ps.DiLoCoState))]
        counts = [s.count for s in found if isinstance(s, ps.DiLoCoState)]
        if len(counts) != 1:
            raise ValueError(f"state: expected one ps.DiLoCoState in it, found {len(counts)}")
        if self.open or self._quiet(int(D.local(counts[0])) + 1):
            return False  # between syncs, or a delayed sync's quorum still open
        self.manager.start_quorum()
        self.open = True
        return True

    def reduce(self, tree: Any) -> Any:
        """The mean of a pseudo-gradient over the replica groups in the quorum (in place)."""
        leaves = [x for x in pytree.tree_leaves(tree) if isinstance(x, Tensor)]
        for work in [self.manager.allreduce(x) for x in leaves]:
            work.wait()
        return tree

    def commit(self) -> bool:
        """The replica groups' vote on this sync (the manager's `should_commit`)."""
        self.open = False
        return bool(self.manager.should_commit())

    def keep(self, key: str, *trees: Any) -> None:
        """Register `trees` (params, optimizer state...) with the manager under `key`: a replica
        group that comes back loads a live group's values into them, in place."""

        def save() -> list[Tensor]:
            return [x.detach() for x in pytree.tree_leaves(trees) if isinstance(x, Tensor)]

        def load(values: list[Tensor]) -> None:
            mine = [x for x in pytree.tree_leaves(trees) if isinstance(x, Tensor)]
            if len(values) != len(mine):
                raise ValueError(f"{key}: a live group sent {len(values)} tensors, this one holds {len(mine)}")
            with torch.no_grad():
                for dst, src in zip(mine, values):
                    dst.copy_(src)

        self.manager.register_state_dict_fn(key, load, save)
