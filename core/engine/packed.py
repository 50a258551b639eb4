"""Flat buffers for compiled, donated updates: many leaves, a few contiguous buffers.

A compiled optimizer over a list of 100 tensors runs 100 kernels (and 100 OpenMP
regions on CPU) and compiles a graph that grows with the tensor count. Elementwise
math does not care where one tensor ends and the next begins, so `make_update` with
`compile=True, donate=True` lays params, grads and state out in one flat buffer per
*group* and runs the transform on those buffers as if each were one leaf:

    group = the leaves that share device, dtype and every per-leaf tag the transform
            declared (`needs`: mask values, partition labels, per-leaf multipliers); a
            leaf that needs per-leaf math takes same-shape leaves as one *stack*, a
            buffer of shape (k, *shape) its math runs batched over (Muon's
            orthogonalization, trust ratios, AGC), or is a group alone

The transform sees a `Packed` tree: a dict `group key -> buffer` that also records which
leaves each buffer holds, so `masked`, `partition` and `scale_per_leaf` read their
per-leaf rules on the original leaf names and shapes (`ops.per_leaf`).

This module is the packed tree and the grouping; `needs` plans which grouping a
transform takes, `flat` runs a compiled step over it: the user's tensors (params, state,
grads) are re-pointed (`Tensor.set_`) to views into the buffers, so the trees the user
holds, checkpoints and reads stay the same objects with the same values.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

import torch
import torch.utils._pytree as pytree
from torch import Tensor


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
        self,
        groups: Sequence[_Group],
        orig_spec: pytree.TreeSpec,
        proxy: Sequence[Tensor],
        shard: Any = None,
        *,
        per_row_state: bool = False,
        rule_values: dict | None = None,
    ) -> None:
        self.groups = tuple(groups)
        self.rule_values = rule_values or {}  # per-leaf rule values the planner read: rule key -> leaf index -> value
        self.per_row_state = per_row_state  # a transform declared per-row state (`holds`)
        self.summary = ""  # the grouping in words (`needs.describe`), for `explain()`
        self.phases: list = []  # the branches the planner found known on the host (`clock.Phase`)
        self.shard = shard  # the `placement.Placement` when the leaves are this rank's blocks of DTensors
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
        spec = select_spec(self.pack_spec, keep)
        return Packed(spec, [v for v, k in zip(self.values(), keep) if k])

    def unpack(self) -> Any:
        """The unpacked tree, each leaf a view into its group's tensor."""
        views: dict[int, Tensor] = {}
        for group, value in zip(self.pack_spec.groups, self.values()):
            if not isinstance(value, Tensor) or not holds(group, value.shape, group.shape):
                raise ValueError(
                    f"a state entry of shape {getattr(value, 'shape', value)} per packed buffer of shape "
                    f"{tuple(group.shape)}: its transform must declare Needs(flat=...) (why it cannot run packed)"
                )
            views.update((m.index, v) for m, v in zip(group.members, group.views(value)))
        return pytree.tree_unflatten(
            [views[m.index] for m in self.pack_spec.members_in_order], self.pack_spec.orig_spec
        )


def select_spec(parent: PackSpec, keep: Sequence[bool]) -> PackSpec:
    """The spec of `parent`'s groups where `keep` (one per group) is True, made once (the
    planner makes those its transform will ask for, so a traced step only looks them up)."""

    def sub_spec() -> PackSpec:
        groups = [g for g, k in zip(parent.groups, keep) if k]
        members = sorted((m for g in groups for m in g.members), key=lambda m: m.index)
        by_index = dict(zip((m.index for m in parent.members_in_order), parent.proxy))
        spec = pytree.tree_structure({m.path: 0 for m in members})
        return PackSpec(
            groups,
            spec,
            [by_index[m.index] for m in members],
            parent.shard,
            per_row_state=parent.per_row_state,
            rule_values=parent.rule_values,
        )

    return resolved_on(parent, ("select", tuple(bool(k) for k in keep)), sub_spec)


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


class NotPacked(Exception):
    """The transform cannot run on flat buffers: `reason` says why (from its declarations)."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def resolved(packed: Packed, key: Any, compute: Callable[[], Any]) -> Any:
    """`compute()`, once per packed spec and `key` (a per-leaf rule's identity)."""
    return resolved_on(packed.pack_spec, key, compute)


def resolved_on(spec: PackSpec, key: Any, compute: Callable[[], Any]) -> Any:
    cache = spec.resolved
    if key not in cache:
        cache[key] = compute()
    return cache[key]


def rule_per_group(packed: Packed, rule: Any) -> list[Any]:
    """One value per group of a per-leaf `rule` (`needs.Rule`), as the planner read it."""
    return rule_on(packed.pack_spec, rule)


def rule_on(spec: PackSpec, rule: Any) -> list[Any]:
    key = rule.key
    if key not in spec.rule_values:
        # Traced by Dynamo before 2.12, id() of a callable source is not the planner's: there,
        # and only there, the one declared rule of that name is this one.
        named = [k for k in spec.rule_values if k[0] == rule.what] if torch.compiler.is_compiling() else []
        if len(named) != 1:
            raise ValueError(
                f"a per-leaf rule ({rule.what}) read on flat buffers that its transform did not declare (Needs(rules=...))"
            )
        key = named[0]
    table = spec.rule_values[key]
    return resolved_on(spec, ("rule", key), lambda: [table[g.members[0].index] for g in spec.groups])


def check_whole_leaves(tree: Any, what: str) -> None:
    """Per-leaf math (`ops`' leaf norms, matrices) on a packed tree: every buffer must be
    one leaf or a stack, which its transform declared (`Needs(whole_leaves=True)`)."""
    if isinstance(tree, Packed) and any(len(g.members) > 1 and not g.is_stack for g in tree.pack_spec.groups):
        raise ValueError(f"{what} needs whole leaves: its transform must declare Needs(whole_leaves=True)")


def stacked_leaves(tree: Any) -> list[bool]:
    """Per leaf of `tree` (flatten order): whether it is a stack, a (k, *shape) buffer of
    k same-shape leaves whose per-leaf math runs batched over its first dim."""
    if isinstance(tree, Packed):
        return [g.is_stack for g in tree.pack_spec.groups]
    return [False] * len(pytree.tree_leaves(tree))


STACK = "stack"  # the tag kind that makes a group a stack


# --------------------------------------------------------------------------- #
# Planning a layout.
# --------------------------------------------------------------------------- #


def group_leaves(leaves: list[tuple[str, Tensor]], tags: list[tuple]) -> list[_Group]:
    """The groups of `leaves` (path, tensor): one per device, dtype and tags, in first-seen order."""
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
        stacked = any(isinstance(t, tuple) and t[:1] == (STACK,) for t in key[2])
        groups.append(_Group(f"group{n}", tuple(members), first.dtype, first.device, stacked))
    return groups


def check_viewable(state: Any, packed: Packed) -> None:
    """Every packed entry of `state` must be shaped like the params, or hold per-row state
    of whole leaves (`holds`; over FSDP2 shards, the rows this rank holds), so that each
    leaf's part can be a view (a per-leaf scalar, say, cannot)."""
    spec = packed.pack_spec
    groups = {g.key: (g, v.shape) for g, v in zip(spec.groups, packed.values())}
    for node in pytree.tree_leaves(state, is_leaf=is_packed):
        if not is_packed(node):
            continue
        for key, v in node.items():
            group, full = groups[key]
            shape = getattr(v, "shape", None)
            if shape is None or not holds(group, shape, full) or (shape != full and not spec.per_row_state):
                raise ValueError(
                    f"a state entry of shape {tuple(shape) if shape is not None else v!r} for a flat buffer of shape "
                    f"{tuple(full)}: a transform whose state is not shaped like the params must declare "
                    "Needs(flat=<why>) (or Needs(per_row_state=True) for per-row statistics of whole leaves)"
                )
