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
- the sharded path (`sharded.sharded_update` compiled, `ShardedEager` eager) runs on the
  proxies: over these placements it sees one row layout of all R·S ranks (`rows._nested`),
  so elementwise math runs on the piece, tree-wide reductions are one all_reduce over all
  ranks and whole-matrix math is owner-computes over all of them;
- the state's (and EMA's) DTensors are re-placed in place, the same objects: each now holds
  its piece (`_StridedShard` on the replicate dim); `full_tensor()` and
  torch.distributed.checkpoint read them as the global tensors they stand for, so a
  checkpoint loads into any layout;
- after the update one `all_gather` across the replicas per dtype puts the pieces together
  into the user's param blocks: every replica's params are bit-identical.

With `shard_state_over_replicas=True` that all_gather moves (R-1)/R of a block of params per
rank across replicas beside FSDP2's all-reduce of the grads (FSDP2's
`set_requires_all_reduce(False)` keeps the partial grads inside FSDP2 and leaves `.grad`
unset, so the all-reduce cannot be traded away there). Given the (replicate, shard) mesh
instead (`OverReplicas(inner, mesh)`), the params are FSDP2's over `mesh["shard"]` in each
replica, the grads each replica's own: the pieces' grads are their mean over the replicas,
one reduce_scatter per dtype, and with the all_gather that is HSDP's all-reduce in bytes.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import Tensor

from .. import _compat as compat
from .. import _tree as tr
from .donate import copy_into
from .dtensor import is_dtensor, local
from .placement import Declined
from .rows import nested_placements


def check_over_replicas(value: Any, donate: bool) -> None:
    """`make_update`'s `shard_state_over_replicas`: a bool or a 2-D (replicate, shard) mesh, with `donate`."""
    if not isinstance(value, bool) and (getattr(value, "ndim", None) != 2 or not hasattr(value, "get_group")):
        raise ValueError(
            f"shard_state_over_replicas must be True, False or a 2-D (replicate, shard) DeviceMesh, got {value!r}"
        )
    if value is not False and not donate:
        raise ValueError("shard_state_over_replicas needs donate=True (it re-places the state in place)")


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
    `inner` is the sharded runner the proxies go through; `mesh`, when given, the
    (replicate, shard) mesh of params that FSDP2 shards over its shard dim alone."""

    def __init__(self, inner: Any, mesh: Any = None) -> None:
        self.inner = inner
        self.given = mesh
        self.why_not: str | None = None
        self._key: list | None = None
        self._placed: tuple | None = None
        self.proxies: Any = None
        self.grad_proxies: list[Any] = []

    def layout(self) -> Any:
        return self.inner.layout()

    def describe(self, params: Any) -> str:
        return self.inner.describe(self.proxies)

    # -- the proxies -------------------------------------------------------------------
    def _prepare(self, params: Any) -> Any:
        """The proxies of `params`, made once (again when a param block moves)."""
        leaves = pytree.tree_leaves(params)
        key = [(id(x), x._local_tensor.data_ptr() if is_dtensor(x) else x.data_ptr()) for x in leaves]
        if self._key == key:
            return self.proxies
        if self.given is not None:  # FSDP2 within each replica: the grads are each replica's own
            self.mesh, self.rdim, self.sdim = self.given, 0, 1
            self.me = self.mesh.get_local_rank(0)
            self.shard_ranks = self.mesh.mesh[self.me].tolist()
        else:  # HSDP: FSDP2 all-reduced the grads across the replicas
            found = hsdp_replicas(params)
            if found is None:
                raise Declined("shard_state_over_replicas=True: the params are not HSDP row blocks with replicas")
            self.mesh, self.rdim, self.sdim = found
            self.me = self.mesh.get_local_rank(self.rdim)
        self.group, self.replicas = self.mesh.get_group(self.rdim), self.mesh.size(self.rdim)
        # the replicate-dim coordinate of each rank of the group (the collectives' order)
        where = {int(g): (a, b) for a, row in enumerate(self.mesh.mesh.tolist()) for b, g in enumerate(row)}
        self.order = [where[g][self.rdim] for g in torch.distributed.get_process_group_ranks(self.group)]
        self.placements = nested_placements(self.mesh, self.sdim)
        self.blocks = [x._local_tensor if is_dtensor(x) else x for x in leaves]
        self.split = [is_dtensor(x) and self._is_block(x) for x in leaves]
        if self.given is not None and not all(self.split):
            path = tr.tree_flatten_with_path(params)[0][self.split.index(False)][0]
            raise Declined(
                f"shard_state_over_replicas=<mesh>: param '{path}' is not an FSDP2 block over the mesh's shard dim "
                f"(ranks {self.shard_ranks}): fully_shard every module with mesh=mesh['shard']"
            )
        self.rows = [self._rows(b.shape[0], self.me) if s else (0, 0) for b, s in zip(self.blocks, self.split)]
        self.io = self._io()
        spec = pytree.tree_structure(params)
        with torch.no_grad():
            self.proxies = pytree.tree_unflatten(
                [self._piece(x, copy=True) if s else x for x, s in zip(leaves, self.split)], spec
            )
            # The grads' pieces live in tensors of their own, filled each call (the sharded path
            # re-points them into its grad buffer once: the copy then writes there).
            self.grad_proxies = [self._piece(x, copy=True) if s else None for x, s in zip(leaves, self.split)]
        self._key, self._placed = key, None
        return self.proxies

    def _is_block(self, x: Any) -> bool:
        """Whether `x` is placed as the params' blocks (rows over the shard dim; whole over the
        replicas, or on the shard dim's own mesh when the mesh was given)."""
        from torch.distributed.tensor import Replicate, Shard

        p = tuple(x.placements)
        if self.given is not None:
            return (
                len(p) == 1
                and type(p[0]) is Shard
                and p[0].dim == 0
                and x.device_mesh.mesh.tolist() == self.shard_ranks
            )
        return (
            len(p) == 2
            and type(p[self.sdim]) is Shard
            and p[self.sdim].dim == 0
            and isinstance(p[self.rdim], Replicate)
            and x.device_mesh == self.mesh
        )

    def _rows(self, block_rows: int, q: int) -> tuple[int, int]:
        return compat.chunk_range(block_rows, self.replicas, q)

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

    def _io(self) -> list[tuple[list[int], list[list[int]], int]]:
        """Per dtype of the split leaves: their indices, each replica's numel of each piece, and
        the largest total (the padded width of the collectives)."""
        by_dtype: dict[torch.dtype, list[int]] = {}
        for i, s in enumerate(self.split):
            if s:
                by_dtype.setdefault(self.blocks[i].dtype, []).append(i)
        io = []
        for idx in by_dtype.values():
            width = [self.blocks[i][0].numel() if self.blocks[i].shape[0] else 0 for i in idx]
            sizes = [
                [self._rows(self.blocks[i].shape[0], q)[1] * w for i, w in zip(idx, width)]
                for q in range(self.replicas)
            ]
            io.append((idx, sizes, max(sum(s) for s in sizes)))
        return io

    def _places(self, blocks: list, idx: list[int], sizes: list[list[int]], flat: Tensor) -> tuple[list, list]:
        """Every replica's piece of each block in `blocks`, and its place in `flat` (one row of
        the padded width per rank of the group, in the group's order): one foreach copy either way."""
        pieces, places = [], []
        for k, q in enumerate(self.order):
            offset = 0
            for j, i in enumerate(idx):
                n = sizes[q][j]
                if n:
                    a, count = self._rows(self.blocks[i].shape[0], q)
                    pieces.append(blocks[i][a : a + count])
                    places.append(flat[k, offset : offset + n].view(count, *self.blocks[i].shape[1:]))
                offset += n
        return pieces, places

    # -- the runner protocol -------------------------------------------------------------
    def plans(self, params: Any, agree: bool = True) -> bool:
        try:
            proxies = self._prepare(params)
        except Declined as e:
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
        self._grads_in([local(x) for x in grad_leaves])
        g = pytree.tree_unflatten([gp if gp is not None else x for gp, x in zip(self.grad_proxies, grad_leaves)], spec)
        if self._placed != (id(opt_state), id(ema_state)):  # a new state tree: its blocks re-placed as pieces
            self._replace(opt_state)
            if ema_state is not None:
                self._replace(ema_state)
            self._placed = (id(opt_state), id(ema_state))
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
        self._params_out(pytree.tree_leaves(proxies))
        return out

    def _grads_in(self, blocks: list) -> None:
        """This rank's pieces of the grads into the grad proxies: taken from the blocks (equal
        across replicas under HSDP), or their mean over the replicas (one reduce_scatter per
        dtype, when the mesh was given)."""
        if self.given is None:
            mine = [
                (gp._local_tensor, b[a : a + n])
                for gp, b, (a, n) in zip(self.grad_proxies, blocks, self.rows)
                if gp is not None
            ]
            torch._foreach_copy_([d for d, _ in mine], [s for _, s in mine])
            return
        for idx, sizes, most in self.io:
            send = blocks[idx[0]].new_zeros(self.replicas, most)
            pieces, places = self._places(blocks, idx, sizes, send)
            torch._foreach_copy_(places, pieces)
            got = send.new_empty(most)
            compat.reduce_scatter_single(got, send.view(-1), self.group)
            got.mul_(1.0 / self.replicas)
            dst = [self.grad_proxies[i]._local_tensor for i in idx]
            torch._foreach_copy_(
                dst, [v.view(d.shape) for d, v in zip(dst, got[: sum(sizes[self.me])].split(sizes[self.me]))]
            )

    def _params_out(self, proxies: list) -> None:
        """The updated pieces of every replica into the user's param blocks: one all_gather per dtype."""
        for idx, sizes, most in self.io:
            mine = [proxies[i]._local_tensor.reshape(-1) for i in idx]
            send = torch.cat(mine + [mine[0].new_zeros(most - sum(sizes[self.me]))])
            flat = send.new_empty(self.replicas * most)
            compat.all_gather_single(flat, send, self.group)
            pieces, places = self._places(self.blocks, idx, sizes, flat.view(self.replicas, most))
            if pieces:  # into the user's param blocks
                copy_into(pieces, places, "params")
