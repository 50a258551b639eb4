"""Optimizer state sharded across HSDP's replicas: `make_update(..., shard_state_over_replicas=True)`.

Under HSDP (`fully_shard` on a (replicate, shard) mesh) every replica holds its shard
group's blocks of the params, of the grads (FSDP2 all-reduces them across the replicas)
and, on the plain sharded path, of the whole optimizer state: with R replicas the state
costs R times what it must. `OverReplicas` keeps 1/R of each block per rank instead, so
each rank holds 1/(R·S) of every state leaf:

- each param gets a proxy: a DTensor whose rows are this rank's piece of its block
  (`torch.chunk` of the block's rows over the replicas, `rows.nested_placements`), its
  local tensor a copy owned here; the grads' pieces are read from the user's grad blocks
  (equal across replicas: no communication);
- the sharded path (`sharded.ShardedUpdate` compiled, `ShardedEager` eager) runs on the
  proxies: over these placements it sees one row layout of all R·S ranks (`rows._nested`),
  so elementwise math runs on the piece, tree-wide reductions are one all_reduce over all
  ranks and whole-matrix math is owner-computes over all of them;
- the state's (and EMA's) DTensors are re-placed in place, the same objects: each now holds
  its piece (`_StridedShard` on the replicate dim); `full_tensor()` and
  torch.distributed.checkpoint read them as the global tensors they stand for, so a
  checkpoint loads into any layout;
- after the update one `all_gather` across the replicas per dtype puts the pieces together
  into the user's param blocks: every replica's params are bit-identical.

The cost: that all_gather moves (R-1)/R of a block of params per rank across replicas,
beside FSDP2's all-reduce of the grads (FSDP2's `set_requires_all_reduce(False)` keeps the
partial grads inside FSDP2, so a reduce-scatter in its place is not reachable).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.utils._pytree as pytree

from .. import _tree as tr
from .dtensor import is_dtensor
from .rows import _chunk, nested_placements


def hsdp_replicas(params: Any) -> tuple[Any, int, int] | None:
    """(mesh, replicate dim, shard dim) when `params` are HSDP row blocks with more than one
    replica (`Replicate` on one dim of a 2-D mesh, `Shard(0)` or `Replicate` on the other),
    else None."""
    from torch.distributed.tensor import Replicate, Shard

    meshes: set[tuple] = set()
    shard_dims: set[int] = set()
    mesh = None
    for x in pytree.tree_leaves(params):
        if not is_dtensor(x):
            continue
        mesh = x.device_mesh
        meshes.add((tuple(mesh.mesh.shape), tuple(mesh.mesh.flatten().tolist())))
        p = tuple(x.placements)
        if mesh.ndim != 2 or any(type(q) not in (Replicate, Shard) or (type(q) is Shard and q.dim != 0) for q in p):
            return None
        shard_dims.update(d for d, q in enumerate(p) if type(q) is Shard)
    if mesh is None or len(meshes) != 1 or len(shard_dims) != 1:
        return None
    shard = shard_dims.pop()
    if mesh.size(1 - shard) < 2:
        return None
    return mesh, 1 - shard, shard


class OverReplicas:
    """The sharded path on proxies holding 1/R of each block (see the module docstring).
    `inner` is the sharded runner the proxies go through."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.why_not: str | None = None
        self._key: list | None = None
        self.proxies: Any = None

    def layout(self) -> Any:
        return self.inner.layout()

    @property
    def bound(self) -> Any:
        return getattr(self.inner, "bound", None)

    # -- the proxies -------------------------------------------------------------------
    def _prepare(self, params: Any) -> Any:
        """The proxies of `params`, made once (again when a param block moves)."""
        leaves = pytree.tree_leaves(params)
        key = [(id(x), x._local_tensor.data_ptr() if is_dtensor(x) else x.data_ptr()) for x in leaves]
        if self._key == key:
            return self.proxies
        found = hsdp_replicas(params)
        if found is None:
            raise ValueError("shard_state_over_replicas=True: the params are not HSDP row blocks with replicas")
        self.mesh, self.rdim, self.sdim = found
        group = self.mesh.get_group(self.rdim)
        self.group, self.replicas = group, self.mesh.size(self.rdim)
        self.me = self.mesh.get_local_rank(self.rdim)
        # the replicate-dim coordinate of each rank of the group (the all_gather's order)
        where = {int(g): (a, b) for a, row in enumerate(self.mesh.mesh.tolist()) for b, g in enumerate(row)}
        self.order = [where[g][self.rdim] for g in torch.distributed.get_process_group_ranks(group)]
        self.placements = nested_placements(self.mesh, self.sdim)
        self.blocks = [x._local_tensor if is_dtensor(x) else x for x in leaves]
        self.split = [is_dtensor(x) and self._is_block(x) for x in leaves]
        with torch.no_grad():
            self.proxies = pytree.tree_unflatten(
                [self._piece(x, copy=True) if s else x for x, s in zip(leaves, self.split)],
                pytree.tree_structure(params),
            )
        self._key = key
        return self.proxies

    def _is_block(self, x: Any) -> bool:
        """Whether `x` is placed as the params' blocks (rows over the shard dim, whole over the replicas)."""
        from torch.distributed.tensor import Replicate, Shard

        p = tuple(x.placements)
        return (
            x.device_mesh == self.mesh
            and len(p) == 2
            and type(p[self.sdim]) is Shard
            and p[self.sdim].dim == 0
            and isinstance(p[self.rdim], Replicate)
        )

    def _rows(self, block_rows: int, q: int) -> tuple[int, int]:
        return _chunk(block_rows, self.replicas, q)

    def _piece(self, x: Any, copy: bool) -> Any:
        """This rank's piece of block DTensor `x` as a DTensor over the nested placements."""
        from torch.distributed.tensor import DTensor

        block = x._local_tensor
        a, n = self._rows(block.shape[0], self.me)
        local = block[a : a + n]
        local = local.clone(memory_format=torch.contiguous_format) if copy else local
        return DTensor.from_local(local, self.mesh, self.placements, run_check=False, shape=x.shape, stride=x.stride())

    def _replace(self, tree: Any) -> None:
        """Every block DTensor of a state tree re-placed, in place, as its piece (idempotent)."""
        for x in pytree.tree_leaves(tree):
            if is_dtensor(x) and self._is_block(x):
                with torch.no_grad():
                    piece = self._piece(x, copy=True)
                x._local_tensor, x._spec = piece._local_tensor, piece._spec

    # -- the runner protocol -------------------------------------------------------------
    def plans(self, params: Any, agree: bool = True) -> bool:
        try:
            proxies = self._prepare(params)
        except ValueError as e:
            self.why_not = str(e)
            return False
        ok = self.inner.plans(proxies, agree=agree)
        self.why_not = self.inner.why_not
        return ok

    def __call__(
        self, params: Any, grads: Any, opt_state: Any, ema_state: Any = None, amp: Any = None, extra: Any = None
    ) -> Any:
        proxies = self._prepare(params)
        grad_leaves = tr.check_match(grads, params, "grads", "params")
        spec = pytree.tree_structure(params)
        g = pytree.tree_unflatten(
            [self._piece(x, copy=False) if s else x for x, s in zip(grad_leaves, self.split)], spec
        )
        self._replace(opt_state)
        if ema_state is not None:
            self._replace(ema_state)
        if extra:  # the transform's own inputs shaped like the params: their pieces
            extra = {
                k: pytree.tree_unflatten(
                    [self._piece(x, copy=False) if s else x for x, s in zip(pytree.tree_leaves(v), self.split)], spec
                )
                if pytree.tree_structure(v) == spec
                else v
                for k, v in extra.items()
            }
        out = self.inner(proxies, g, opt_state, ema_state, amp, extra)
        self._gather(pytree.tree_leaves(proxies))
        return out

    def _gather(self, proxies: list) -> None:
        """The updated pieces of every replica into the user's param blocks: one all_gather per dtype."""
        by_dtype: dict[torch.dtype, list[int]] = {}
        for i, s in enumerate(self.split):
            if s:
                by_dtype.setdefault(self.blocks[i].dtype, []).append(i)
        for idx in by_dtype.values():
            rows = [self.blocks[i].shape[0] for i in idx]
            width = [self.blocks[i][0].numel() if self.blocks[i].shape[0] else 0 for i in idx]
            sizes = [[self._rows(r, q)[1] * w for r, w in zip(rows, width)] for q in range(self.replicas)]
            most = max(sum(s) for s in sizes)
            mine = [proxies[i]._local_tensor.reshape(-1) for i in idx]
            send = torch.cat(mine + [mine[0].new_zeros(most - sum(sizes[self.me]))])
            flat = send.new_empty(self.replicas * most)
            torch.distributed.all_gather_into_tensor(flat, send, group=self.group)
            got = flat.view(self.replicas, most)
            dst, src = [], []
            for k, q in enumerate(self.order):  # group rank k holds replica q's pieces
                offset = 0
                for j, i in enumerate(idx):
                    n = sizes[q][j]
                    if n:
                        a, count = self._rows(rows[j], q)
                        dst.append(self.blocks[i][a : a + count])
                        src.append(got[k, offset : offset + n].view(count, *self.blocks[i].shape[1:]))
                    offset += n
            if dst:
                torch._foreach_copy_(dst, src)
