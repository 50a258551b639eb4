"""What a transform calls on the tree it is given, whatever path runs it.

A transform sees one of three kinds of trees: the user's leaves (the per-leaf paths),
a `Packed` tree of flat buffers (one process), or a `Packed` tree over this rank's FSDP2
shards (`sharded`). What it needs is declared once (`needs.Needs`); math that is not
elementwise then calls these and never looks at the layout itself:

- `per_leaf(tree, rule, fn)`: a per-leaf rule's values, one per leaf the transform sees
  (one per buffer on a packed tree: the planner kept leaves that differ apart);
  `select(tree, keep)`: the leaves kept, as `{path: leaf}` (what `masked` hands on);
- `stacked`, `global_shapes`: per leaf, whether it is a (k, *shape) stack and the whole
  leaf's shape (declared `whole_leaves`);
- `global_norm`, `all_finite`, `global_sums`, `leaf_norms`, `leaf_sums`: reductions over
  the tree, computed on what this process holds and then, over shards, summed across
  ranks: one batched collective per call, whatever the number of tensors;
- `held_rows(tree)`: per leaf, the rows of the whole leaf this process holds (QK-clip's
  per-head rows);
- `row_sums(tree, xs, lead)`: per leaf, the sums over each row of whole matrices (NorMuon's
  per-row statistics); a row split over ranks (a tensor-parallel column block) is summed
  across them in one collective;
- `map_matrices(tree, fn, xs)`: `fn` on whole matrices. Over shards, each matrix is
  assembled on one owner rank (all-to-all), `fn` runs there once, and each rank gets its
  rows of the result back.

On plain trees these are the ordinary per-leaf computations.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch
import torch.utils._pytree as pytree
from torch import Tensor

from . import packed as _flat
from .. import _foreach as ls
from .. import _tree as tr


def _shard(tree: Any) -> Any:
    """The shard description of a packed tree over FSDP2 shards (collectives on), or None."""
    spec = getattr(tree, "pack_spec", None)
    shard = getattr(spec, "shard", None)
    return shard if shard is not None and shard.active else None


def per_leaf(tree: Any, rule: Any) -> list[Any]:
    """The values of a per-leaf `rule` (`needs.Rule`: a mask, labels, multipliers, which its
    transform declared in `Needs.rules`), one per leaf of `tree`: `rule.values(tree)` on a
    plain tree; on a packed one, one value per buffer, as the planner read them."""
    if _flat.is_packed(tree):
        return _flat.rule_per_group(tree, rule)
    return list(rule.values(tree))


def is_packed(tree: Any) -> bool:
    """Whether `tree` is a tree of flat buffers (one process or shards): for the engine's
    own code, such as the step's metrics; a transform never needs to ask."""
    return _flat.is_packed(tree)


def select(tree: Any, keep: Sequence[bool]) -> Any:
    """The leaves of `tree` where `keep` is True, as `{path: leaf}` (packed: its buffers)."""
    if _flat.is_packed(tree):
        return tree.select(keep)
    pairs, _ = tr.tree_flatten_with_path(tree)
    return {p: x for (p, x), k in zip(pairs, keep) if k}


def is_sharded(tree: Any) -> bool:
    """Whether `tree`'s leaves are this rank's FSDP2 shards of larger leaves."""
    return getattr(getattr(tree, "pack_spec", None), "shard", None) is not None


def stacked(tree: Any) -> list[bool]:
    """Per leaf of `tree`: whether it is a (k, *shape) stack of k same-shape leaves."""
    _flat.check_whole_leaves(tree, "stacked")
    return _flat.stacked_leaves(tree)


def global_shapes(tree: Any) -> list[torch.Size]:
    """Per leaf of `tree`: the shape of the whole leaf it stands for (of one member, for a
    stack): a shard's full shape under FSDP2, the leaf's own shape otherwise."""
    spec = getattr(tree, "pack_spec", None)
    if spec is None:
        return [x.shape for x in pytree.tree_leaves(tree)]
    _flat.check_whole_leaves(tree, "global_shapes")
    # Whole shapes over active shards; the local leaves' own until the layout is planned.
    full = spec.shard.full_shape if _shard(tree) is not None else (lambda m: m.shape)
    return [full(g.members[0]) if (len(g.members) == 1 or g.is_stack) else torch.Size([g.numel]) for g in spec.groups]


def global_norm(tree: Any) -> Tensor:
    """‖tree‖₂ over every leaf, a 0-d tensor accumulated in float32 at least.

    A packed tree's norm is computed once (a clip and `apply_if_finite` over it read the
    same value: one pass, one collective): eagerly while its buffers are unchanged, in a
    compiled step for the tree object the step made (its values never change there)."""
    xs = pytree.tree_leaves(tree)
    compiling = torch.compiler.is_compiling()
    # (inference tensors keep no version counter: never memoized eagerly)
    memo = _flat.is_packed(tree) and (compiling or not any(x.is_inference() for x in xs))
    versions = None if compiling or not memo else tuple(x._version for x in xs)
    if memo and getattr(tree, "norm_memo", (0, None))[0] == versions:
        return tree.norm_memo[1]
    shard = _shard(tree)
    if shard is None:
        norm = ls.global_norm(xs)
    else:
        acc = torch.float64 if any(x.dtype == torch.float64 for x in xs) else torch.float32
        # Σ x² per buffer; a buffer of replicated leaves is counted on rank 0 only.
        weights = shard.group_weights(tree.pack_spec)
        if xs and not torch.compiler.is_compiling():  # one foreach pass, no squares held
            per = torch.stack(ls.norms(xs, acc))
            total = (per * per * torch.tensor(weights, dtype=acc, device=per.device)).sum()
        else:
            parts = [torch.sum(torch.square(x.to(acc))) * w for x, w in zip(xs, weights)]
            total = torch.stack(parts).sum() if parts else torch.zeros((), dtype=acc, device=shard.device)
        norm = torch.sqrt(shard.all_reduce(total))
    if memo:
        tree.norm_memo = (versions, norm)
    return norm


def global_sums(tree: Any, *lists: Sequence[Tensor]) -> list[Tensor]:
    """Σ of every element of each list of values shaped like `tree`'s leaves, a 0-d tensor
    per list accumulated in float32 at least (float64 where a value is). Elementwise over
    the tree, so flat buffers need no regrouping; over shards, the sums of the whole
    leaves (replicated leaves counted once), all lists in one collective."""
    every = [x for xs in lists for x in xs]
    acc = torch.float64 if any(x.dtype == torch.float64 for x in every) else torch.float32
    shard = _shard(tree)
    weights = shard.group_weights(tree.pack_spec) if shard is not None else None
    parts = []
    for xs in lists:
        sums = [torch.sum(x, dtype=acc) for x in xs]
        if shard is None and sums:  # plain leaves, or whole DTensors of any meshes (the per-leaf path)
            parts.append(ls.sum_scalars(sums))
            continue
        if weights is not None:  # a buffer of replicated leaves is counted on rank 0 only
            sums = [s * w for s, w in zip(sums, weights)]
        parts.append(
            torch.stack(sums).sum()
            if sums
            else torch.zeros(
                (), dtype=acc, device=shard.device if shard is not None else (every[0].device if every else None)
            )
        )
    total = torch.stack(parts)
    if shard is not None:
        total = shard.all_reduce(total)
    return list(total.unbind(0))


def all_finite(tree: Any, xs: Sequence[Tensor]) -> Tensor:
    """A 0-d bool: every element of `xs` is finite on every rank (`tree` says the layout)."""
    shard = _shard(tree)
    if shard is None:
        return ls.all_finite(list(xs))
    count = ls.nonfinite_count(list(xs)) if xs else torch.zeros((), dtype=torch.int64, device=shard.device)
    return shard.all_reduce(count) == 0


def leaf_norms(tree: Any, *lists: Sequence[Tensor]) -> list[Tensor] | list[list[Tensor]]:
    """‖x‖₂ of each leaf of `tree`, for each list of values shaped like its leaves (one
    list: its norms; several: a list per list); a stack gives its members' norms shaped
    (k, 1, ...). Over shards, the norms of whole leaves, all lists in one collective."""
    flags = stacked(tree)
    shard = _shard(tree)
    if shard is None:
        out = [ls.member_norms(list(xs), flags) for xs in lists]
        return out[0] if len(lists) == 1 else out
    every = [x for xs in lists for x in xs]
    if not every:  # an empty selection (a masked or partition branch with no leaves)
        empty: list[list[Tensor]] = [[] for _ in lists]
        return empty if len(lists) > 1 else []
    acc = torch.float64 if any(x.dtype == torch.float64 for x in every) else torch.float32
    weights = shard.member_weights(tree.pack_spec, acc, every[0].device)
    parts = [
        torch.sum(torch.square(x.to(acc)), dim=tuple(range(1, x.dim())))
        if s
        else torch.sum(torch.square(x.to(acc))).reshape(1)
        for xs in lists
        for x, s in zip(xs, flags)
    ]
    total = torch.sqrt(shard.all_reduce(torch.cat(parts) * weights.repeat(len(lists))))
    out, at = [], 0
    for xs in lists:
        norms = []
        for x, s in zip(xs, flags):
            k = x.shape[0] if s else 1
            n = total[at : at + k]
            at += k
            norms.append(n.reshape((k,) + (1,) * (x.dim() - 1)).to(x.dtype) if s else n.reshape(()).to(x.dtype))
        out.append(norms)
    return out[0] if len(lists) == 1 else out


def leaf_sums(tree: Any, xs: Sequence[Tensor]) -> list[Tensor]:
    """Σx of each leaf of `tree` (`xs` shaped like its leaves) in float64, 0-d; a stack gives
    its members' sums shaped (k, 1, ...). Over shards, the sums of whole leaves (one collective)."""
    flags = stacked(tree)
    shard = _shard(tree)
    if shard is None:
        return ls.member_sums(list(xs), flags)
    if not xs:  # an empty selection
        return []
    parts = [
        torch.sum(x, dim=tuple(range(1, x.dim())), dtype=torch.float64)
        if s
        else torch.sum(x, dtype=torch.float64).reshape(1)
        for x, s in zip(xs, flags)
    ]
    total = shard.all_reduce(torch.cat(parts) * shard.member_weights(tree.pack_spec, torch.float64, xs[0].device))
    out, at = [], 0
    for x, s in zip(xs, flags):
        k = x.shape[0] if s else 1
        out.append(total[at : at + k].reshape((k,) + (1,) * (x.dim() - 1)) if s else total[at].reshape(()))
        at += k
    return out


def held_rows(tree: Any) -> list[tuple[int, int, int] | None]:
    """Per leaf of `tree` (per buffer of a packed one): `(first, count, rows)`, the rows
    `[first, first + count)` of the whole leaf's `rows` that this process holds (a buffer of
    several leaves: None). All of them on plain trees and in one process; over shards, this
    rank's block's (a tensor-parallel column block holds every row)."""
    if not _flat.is_packed(tree):
        return [(0, x.shape[0], x.shape[0]) if x.dim() else None for x in pytree.tree_leaves(tree)]
    shard = _shard(tree)
    out: list[tuple[int, int, int] | None] = []
    for g in tree.pack_spec.groups:
        if len(g.members) != 1 or not len(g.members[0].shape):
            out.append(None)
            continue
        m = g.members[0]
        whole = shard.shapes[m.index][0] if shard is not None else m.shape[0]
        out.append((*shard.row_range(m.index), whole) if shard is not None else (0, whole, whole))
    return out


def row_sums(tree: Any, xs: Sequence[Tensor], lead: Sequence[int]) -> list[Tensor]:
    """Per leaf, x summed over the dims after its row dim (`lead[i]`: the dims before it, a
    stack's and batch dims), shaped `x.shape[: lead + 1]`. Over shards, the sums of whole
    rows: a row split over ranks (TP's column blocks) is summed across them, all leaves in
    one collective; row blocks (FSDP2, HSDP) hold whole rows and need none."""
    local = [torch.sum(x, dim=tuple(range(b + 1, x.dim()))) for x, b in zip(xs, lead)]
    shard = _shard(tree)
    if shard is None or not local:
        return local
    return shard.row_sums(tree.pack_spec, local, list(lead))


def map_matrices(
    tree: Any,
    fn: Callable[..., list[Tensor]],
    xs: Sequence[Tensor],
    *,
    batch_dims: Sequence[int] | None = None,
    extra: Sequence[Any] | None = None,
) -> list[Tensor]:
    """`fn(leaves, lead) -> results` (same shapes) on whole leaves.

    `xs` are values shaped like `tree`'s leaves. `fn` is called with whole leaves and, per
    leaf, how many leading dims index separate matrices: 1 for a (k, *shape) stack, plus
    the leaf's `batch_dims` (one int per leaf of `tree`, default 0); with `extra` (one value
    per leaf of `tree`), also each leaf's value: `fn(leaves, lead, extras)`. Over FSDP2
    shards, each rank calls it once with the whole leaves it owns (owners balanced by cost,
    see `mesh`), and gets back its rows of every result."""
    batch = list(batch_dims) if batch_dims is not None else [0] * len(xs)
    shard = _shard(tree)
    if shard is None:
        lead = [int(k) + b for k, b in zip(stacked(tree), batch)]
        return fn(list(xs), lead) if extra is None else fn(list(xs), lead, list(extra))
    return shard.map_matrices(tree.pack_spec, fn, list(xs), batch, None if extra is None else list(extra))
