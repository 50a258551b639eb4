"""Flat buffers for compiled, donated updates: many leaves, a few contiguous buffers.

A compiled optimizer over a list of 100 tensors runs 100 kernels (and 100 OpenMP
regions on CPU) and compiles a graph that grows with the tensor count. Elementwise
math does not care where one tensor ends and the next begins, so `make_update` with
`compile=True, donate=True` lays params, grads and state out in one flat buffer per
*group* and runs the transform on those buffers as if each were one leaf:

    group = the leaves that share device, dtype and every per-leaf rule of the transform
            (mask values, partition labels, per-leaf multipliers); a leaf that needs
            per-leaf math takes same-shape leaves as one *stack*, a buffer of shape
            (k, *shape) its math runs batched over (Muon's orthogonalization, trust
            ratios, AGC), or, if its math cannot batch, is a group alone

The transform sees a `Packed` tree: a dict `group key -> buffer` that also records which
leaves each buffer holds, so `masked`, `partition` and `scale_per_leaf` resolve their
per-leaf rules on the original leaf names and shapes, and ask for a finer grouping when a
group is not uniform (`Regroup`). The grouping is planned once, by running `init` and
`update` on tiny stand-in tensors until no rule asks for a split; then one update on small
random stand-ins, packed and per leaf, must agree (a transform that reduces per leaf
without saying so keeps the per-leaf path).

This module is the layout: the packed tree and its planning. `_flat_step` runs a
compiled step over it: the user's tensors (params, state, grads) are re-pointed
(`Tensor.set_`) to views into the buffers, so the trees the user holds, checkpoints and
reads stay the same objects with the same values; only their storage moved.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

import torch
import torch.utils._pytree as pytree
from torch import Tensor

from . import _tree as tr


# --------------------------------------------------------------------------- #
# The packed tree.
# --------------------------------------------------------------------------- #


@dataclasses.dataclass(frozen=True)
class _Member:
    index: int  # position among the params' leaves (flatten order)
    path: str
    shape: torch.Size
    offset: int  # in elements, within its group's buffer

    @property
    def numel(self) -> int:
        return self.shape.numel()


@dataclasses.dataclass(frozen=True)
class _Group:
    key: str
    members: tuple[_Member, ...]
    dtype: torch.dtype
    device: torch.device
    stacked: bool = False  # same-shape members asked for as one (k, *shape) stack

    @property
    def numel(self) -> int:
        return sum(m.numel for m in self.members)

    @property
    def is_stack(self) -> bool:
        return self.stacked and len(self.members) > 1

    @property
    def shape(self) -> torch.Size:
        """The shape the transform sees: a lone leaf keeps its own, a stack is (k, *shape),
        any other buffer of several is 1-D."""
        if len(self.members) == 1:
            return self.members[0].shape
        if self.is_stack:
            return torch.Size([len(self.members), *self.members[0].shape])
        return torch.Size([self.numel])

    def views(self, buffer: Tensor) -> list[Tensor]:
        """Each member's view into `buffer`: a tensor of this group's shape, or per-row state
        of a lone leaf or a stack (a leading part of the shape, see `holds`)."""
        if len(self.members) == 1:
            return [buffer]
        if buffer.shape != self.shape:  # a stack's per-member rows, (k, *rows)
            return list(buffer.unbind(0))
        flat = buffer.reshape(-1)
        return [flat[m.offset : m.offset + m.numel].view(m.shape) for m in self.members]


def holds(group: _Group, shape: Sequence[int], full: Sequence[int]) -> bool:
    """Whether a state entry of `shape` can stand for `group`'s leaves, `full` being the
    shape the group's buffers have: that shape, or, for a lone leaf or a stack, a leading
    part of it (a statistic per row, as NorMuon's second moment: (rows,) per leaf, (k, rows)
    per stack), viewed per member."""
    shape, full = tuple(shape), tuple(full)
    if shape == full:
        return True
    lead = 2 if group.is_stack else 1
    whole = len(group.members) == 1 or group.is_stack
    return whole and lead <= len(shape) < len(full) and shape == full[: len(shape)]


class PackSpec:
    """What a `Packed` node holds: its groups and the structure of the leaves they pack.

    Compared by value (group keys and member paths), so trees packed from the same
    layout (params, grads, state entries) have equal pytree specs."""

    def __init__(
        self, groups: Sequence[_Group], orig_spec: pytree.TreeSpec, proxy: Sequence[Tensor], shard: Any = None
    ) -> None:
        self.groups = tuple(groups)
        self.shard = shard  # `_sharded.ShardInfo` when the leaves are this rank's FSDP2 shards
        self.orig_spec = orig_spec  # structure of the unpacked leaves, in `members_in_order`
        self.members_in_order = tuple(sorted((m for g in self.groups for m in g.members), key=lambda m: m.index))
        self.proxy = tuple(proxy)  # meta tensors like the unpacked leaves, in the same order
        self._sig = (tuple(g.key for g in self.groups), tuple(m.path for m in self.members_in_order))
        # Per-leaf rules resolved once, eagerly while planning: traced steps only look them up.
        self.resolved: dict[Any, Any] = {}

    def __eq__(self, other: object) -> bool:
        return isinstance(other, PackSpec) and self._sig == other._sig

    def __hash__(self) -> int:
        return hash(self._sig)

    def __repr__(self) -> str:
        return f"PackSpec({len(self.groups)} groups of {len(self.members_in_order)} leaves)"


class Packed(dict):
    """`group key -> tensor`, a pytree node that remembers the leaves each tensor packs."""

    def __init__(self, spec: PackSpec, values: Sequence[Any]) -> None:
        super().__init__(zip((g.key for g in spec.groups), values))
        self.pack_spec = spec

    def proxy(self) -> Any:
        """The unpacked tree as meta tensors: what per-leaf rules are evaluated on."""
        return pytree.tree_unflatten(list(self.pack_spec.proxy), self.pack_spec.orig_spec)

    def select(self, keep: Sequence[bool]) -> "Packed":
        """The groups where `keep` is True, as the packed form of `{path: leaf}` of their leaves."""
        parent = self.pack_spec

        def sub_spec() -> PackSpec:
            groups = [g for g, k in zip(parent.groups, keep) if k]
            members = sorted((m for g in groups for m in g.members), key=lambda m: m.index)
            by_index = dict(zip((m.index for m in parent.members_in_order), parent.proxy))
            spec = pytree.tree_structure({m.path: 0 for m in members})
            return PackSpec(groups, spec, [by_index[m.index] for m in members], parent.shard)

        spec = resolved(self, ("select", tuple(keep)), sub_spec)
        return Packed(spec, [v for v, k in zip(self.values(), keep) if k])

    def unpack(self) -> Any:
        """The unpacked tree, each leaf a view into its group's tensor."""
        views: dict[int, Tensor] = {}
        for group, value in zip(self.pack_spec.groups, self.values()):
            if not isinstance(value, Tensor) or not holds(group, value.shape, group.shape):
                raise Regroup.unsupported(f"a state entry of shape {getattr(value, 'shape', value)} per packed group")
            views.update((m.index, v) for m, v in zip(group.members, group.views(value)))
        return pytree.tree_unflatten(
            [views[m.index] for m in self.pack_spec.members_in_order], self.pack_spec.orig_spec
        )


def pack_like(packed: Packed, tree: Any) -> Packed:
    """`tree` (unpacked, like `packed.unpack()`) packed the way `packed` is: one
    concatenation per group (inside a compiled step, grads of the per-leaf views)."""
    leaves = pytree.tree_leaves(tree)
    by_index = {m.index: x for m, x in zip(packed.pack_spec.members_in_order, leaves)}
    values = []
    for group in packed.pack_spec.groups:
        parts = [by_index[m.index] for m in group.members]
        values.append(parts[0] if len(parts) == 1 else torch.cat([x.reshape(-1) for x in parts]).view(group.shape))
    return Packed(packed.pack_spec, values)


pytree.register_pytree_node(
    Packed,
    lambda p: (list(p.values()), p.pack_spec),
    lambda values, spec: Packed(spec, list(values)),
    serialized_type_name="purestep.Packed",
    flatten_with_keys_fn=lambda p: ([(pytree.MappingKey(k), v) for k, v in p.items()], p.pack_spec),
)


def is_packed(tree: Any) -> bool:
    return isinstance(tree, Packed)


class Regroup(Exception):
    """Raised while planning: a per-leaf rule needs leaves told apart.

    `tags` maps a leaf's index to a hashable tag; leaves of one group must share tags.
    `reason` set instead means the transform cannot run on packed buffers at all."""

    def __init__(self, tags: dict[int, Any] | None = None, reason: str | None = None) -> None:
        super().__init__(reason or "regroup")
        self.tags, self.reason = tags or {}, reason

    @classmethod
    def unsupported(cls, reason: str) -> "Regroup":
        return cls(reason=reason)


def resolved(packed: Packed, key: Any, compute: Callable[[], Any]) -> Any:
    """`compute()`, once per packed spec and `key` (a per-leaf rule's identity)."""
    cache = packed.pack_spec.resolved
    if key not in cache:
        cache[key] = compute()
    return cache[key]


def rule_per_group(packed: Packed, rule: Any, per_leaf: Callable[[Any], list[Any]]) -> list[Any]:
    """One value per group of a per-leaf `rule` (a mask, labels, multipliers), where
    `per_leaf(unpacked meta tree)` gives its values leaf by leaf."""
    return resolved(packed, ("rule", id(rule)), lambda: group_values(packed, per_leaf(packed.proxy())))


def group_values(packed: Packed, per_leaf: list[Any]) -> list[Any]:
    """One value per group from one value per unpacked leaf (in `members_in_order`);
    raises `Regroup` when a group's leaves disagree."""
    members = packed.pack_spec.members_in_order
    value_of = {m.index: v for m, v in zip(members, per_leaf)}
    out = []
    for group in packed.pack_spec.groups:
        values = [value_of[m.index] for m in group.members]
        if any(not _same(values[0], v) for v in values[1:]):
            raise Regroup({m.index: _tag(v) for m, v in zip(members, per_leaf)})
        out.append(values[0])
    return out


def _tag(value: Any) -> Any:
    return ("tensor", id(value)) if isinstance(value, Tensor) else value


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, Tensor) or isinstance(b, Tensor):
        return a is b
    return a == b


def need_whole_leaves(tree: Any, *, stacks: bool = False) -> None:
    """Called by transforms with per-leaf math (norms, matrix functions) on their input:
    under a packed layout every leaf they see must be a group of its own or, with
    `stacks=True` (math batched over a leading dim, see `stacked_leaves`), a stack of
    same-shape leaves."""
    if not isinstance(tree, Packed):
        return
    groups = tree.pack_spec.groups
    if any(len(g.members) > 1 and not (stacks and g.is_stack) for g in groups):
        tag = (lambda m: (_STACK, tuple(m.shape))) if stacks else (lambda m: ("alone", m.index))
        raise Regroup({m.index: tag(m) for m in tree.pack_spec.members_in_order})


def stacked_leaves(tree: Any) -> list[bool]:
    """Per leaf of `tree` (flatten order): whether it is a stack, a (k, *shape) buffer of
    k same-shape leaves whose per-leaf math runs batched over its first dim."""
    if isinstance(tree, Packed):
        return [g.is_stack for g in tree.pack_spec.groups]
    return [False] * len(pytree.tree_leaves(tree))


_STACK = "stack"  # the tag kind that makes a group a stack


# --------------------------------------------------------------------------- #
# Planning a layout.
# --------------------------------------------------------------------------- #


def _layout(leaves: list[tuple[str, Tensor]], tags: list[tuple]) -> list[_Group]:
    keys: dict[tuple, list[int]] = {}
    for i, (_, leaf) in enumerate(leaves):
        keys.setdefault((str(leaf.device), str(leaf.dtype), tags[i]), []).append(i)
    groups = []
    for n, (key, indices) in enumerate(keys.items()):
        # Same-shape leaves side by side: a later batched path can view a run as (k, *shape).
        indices = sorted(indices, key=lambda i: (tuple(leaves[i][1].shape), i))
        members, offset = [], 0
        for i in indices:
            path, leaf = leaves[i]
            members.append(_Member(i, path, leaf.shape, offset))
            offset += leaf.numel()
        first = leaves[indices[0]][1]
        stacked = any(isinstance(t, tuple) and t[:1] == (_STACK,) for t in key[2])
        groups.append(_Group(f"group{n}", tuple(members), first.dtype, first.device, stacked))
    return groups


def plan(
    transform: Any, params: Any, *, tags: list[tuple] | None = None, shard: Any = None, max_rounds: int = 8
) -> PackSpec:
    """The grouping of `params`' leaves under which `transform` runs on packed buffers.

    Runs `init` and one `update` on tiny stand-ins; each `Regroup` refines the tags
    (`tags`: per leaf, where the caller's leaves must be told apart from the start).
    `shard` (inactive while planning) is attached to the result.
    Raises `Regroup` with a `reason` when the transform cannot run packed. The dry runs
    happen on the CPU, under a forked RNG: a transform that draws from the global RNG
    leaves the caller's stream where it was."""
    with torch.random.fork_rng(devices=[]):
        return _plan(transform, params, tags, shard, max_rounds)


def _plan(transform: Any, params: Any, tags: list[tuple] | None, shard: Any, max_rounds: int) -> PackSpec:
    pairs, spec = tr.tree_flatten_with_path(params)
    leaves = [(p, x) for p, x in pairs]
    tags = list(tags) if tags is not None else [() for _ in leaves]
    # Per-leaf rules see the leaves as the user does: over shards, the whole leaves' shapes.
    shapes = [shard.slices[i].shape if shard is not None else x.shape for i, (_, x) in enumerate(leaves)]
    meta = [torch.empty(shape, dtype=x.dtype, device="meta") for shape, (_, x) in zip(shapes, leaves)]
    for _ in range(max_rounds):
        groups = _layout(leaves, tags)
        pack = PackSpec(groups, spec, meta, shard)
        # Tiny CPU stand-ins (rank kept for lone leaves): the dry run only has to reach the
        # rules that ask for a split, and meta tensors cannot run every kernel.
        fake = Packed(pack, [torch.zeros((1,) * len(g.shape), dtype=g.dtype) for g in groups])
        try:
            state = transform.init(fake)
            _, state = transform.update(fake, state, fake)
            _check_viewable(state, fake)
        except Regroup as e:
            if e.reason is not None or not e.tags:
                raise
            tags = [t + (e.tags.get(i),) for i, t in enumerate(tags)]
            continue
        _check_packed_equals_per_leaf(transform, leaves, spec, tags, shard)
        return pack
    raise Regroup.unsupported(f"no stable grouping after {max_rounds} rounds")


def _check_packed_equals_per_leaf(
    transform: Any, leaves: list[tuple[str, Tensor]], spec: pytree.TreeSpec, tags: list[tuple], shard: Any
) -> None:
    """One update on small random stand-ins (each dim at most 3; every leaf its own offset
    and scale, so per-leaf statistics differ), packed and per leaf: the results must agree.
    A transform with per-leaf math that does not say so (a norm per leaf in a user's own
    transform) disagrees, and keeps the per-leaf path instead of mixing leaves silently."""
    gen = torch.Generator().manual_seed(0)

    def stand_ins(seed: int) -> list[tuple[str, Tensor]]:
        gen.manual_seed(seed)
        out = []
        for i, (path, x) in enumerate(leaves):
            shape = tuple(min(d, 3) for d in x.shape)
            value = torch.randn(shape, generator=gen, dtype=torch.float64) * (1 + i % 3) + (i % 5 - 2)
            out.append((path, value.to(x.dtype)))
        return out

    small_p, small_g = stand_ins(1), stand_ins(2)
    meta = [torch.empty(x.shape, dtype=x.dtype, device="meta") for _, x in small_p]
    same_devices = [t + (str(x.device),) for t, (_, x) in zip(tags, leaves)]  # stand-ins live on the CPU
    shell = Packed(PackSpec(_layout(small_p, same_devices), spec, meta, shard), [])
    trees = [pytree.tree_unflatten([x for _, x in t], spec) for t in (small_p, small_g)]
    packed = [pack_like(shell, t) for t in trees]
    try:
        with torch.no_grad():
            u_packed, s_packed = transform.update(packed[1], transform.init(packed[0]), packed[0])
            u_leaf, s_leaf = transform.update(trees[1], transform.init(trees[0]), trees[0])
    except Regroup:
        raise
    except Exception as e:  # the stand-ins are not real params: the per-leaf path will tell
        raise Regroup.unsupported(f"the transform failed on small stand-ins ({type(e).__name__}: {e})") from e
    unpack = lambda t: pytree.tree_map(lambda x: x.unpack() if is_packed(x) else x, t, is_leaf=is_packed)  # noqa: E731
    got, want = pytree.tree_leaves(unpack((u_packed, s_packed))), pytree.tree_leaves((u_leaf, s_leaf))
    same = len(got) == len(want) and all(_close(a, b) for a, b in zip(got, want))
    if not same:
        raise Regroup.unsupported("the transform gives other results on packed buffers than per leaf")


def _close(a: Any, b: Any) -> bool:
    if isinstance(a, Tensor) != isinstance(b, Tensor):
        return False
    if not isinstance(a, Tensor):
        return a == b
    if a.shape != b.shape:
        return False
    if not a.is_floating_point():
        return bool(torch.equal(a, b))
    # Loose: stochastic rounding may draw other bits per position; mixing leaves is far off.
    return bool(torch.allclose(a.double(), b.double(), rtol=2e-2, atol=1e-4, equal_nan=True))


def _check_viewable(state: Any, fake: Packed) -> None:
    """Every packed entry of `state` must be shaped like the params, or hold per-row state
    of whole leaves (`holds`; over FSDP2 shards, the rows this rank holds), so that each
    leaf's part can be a view (a per-leaf scalar, say, cannot)."""
    spec = fake.pack_spec
    groups = {g.key: (g, v.shape) for g, v in zip(spec.groups, fake.values())}
    for node in pytree.tree_leaves(state, is_leaf=is_packed):
        if not is_packed(node):
            continue
        for key, v in node.items():
            group, full = groups[key]
            shape = getattr(v, "shape", None)
            if shape is None or not holds(group, shape, full):
                raise Regroup.unsupported("the state holds per-leaf entries that are not shaped like the params")
