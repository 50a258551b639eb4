"""What a transform declares it needs of the engine, and the layout planned from that.

A transform says, once, how its math treats the leaves (`Needs`); the planner reads the
declarations of a whole transform (a chain, a `masked`, an `inject_hyperparams`...) on the
params and returns the grouping of leaves into flat buffers, or why there is none. No
transform runs while planning, so `explain()` can answer before the first call.

- `Needs()` (nothing declared but the object itself): elementwise math, or reductions
  through `engine.ops` (`global_norm`, `all_finite`, `global_sums`), over leaves whose
  names and number it does not look at: any grouping will do.
- `whole_leaves=True`: math per leaf (a norm, a matrix function). Each leaf the transform
  sees is one leaf or, with `stacks`, a (k, *shape) stack of same-shape leaves its math
  batches over (`ops.stacked`); `stacks` may be a function `(path, leaf) -> bool` (leaves
  it says False for are buffers of their own).
- `rules`: per-leaf rules (a mask, labels, multipliers, batch dims), each a `Rule`: what it
  is, the user's value it comes from, and a function of the tree the transform sees (meta
  tensors with the whole leaves' shapes) giving one hashable value per leaf. Leaves whose
  values differ never share a buffer; the planner keeps the values, and at run time
  `ops.per_leaf(tree, rule)` gives them per leaf, or per buffer on flat buffers.
- `per_row_state`: state entries that hold a statistic per row of each whole leaf (a
  leading part of its shape, as NorMuon's second moment), viewed per member.
- `reductions`: the tree-wide reductions it runs (named in `explain()`).
- `flat`: why it cannot run on flat buffers at all (a string, or a function of the tree
  giving one or None), as state that is not shaped like the params.
- `sharded`: why it cannot run on this rank's blocks of FSDP2 shards (math that needs a
  row's place in the whole leaf): the sharded path declines, whole DTensors run it.
- `bounded`: its new state is finite whenever its old state was and the sum of the grads'
  squares fits the narrowest float dtype the state holds (moments, momenta, norms, clocks:
  nothing it keeps sums grads up without bound). `apply_if_finite` over a bounded
  transform checks the grads' norm alone, the value a clip reads anyway, instead of
  reading the new state once more (`bounded(t)`: whether a transform and all its parts are).
- `phase`: a branch its update takes on some calls only, a function of its call count
  alone (`clock.Phase`: DiLoCo's syncs). A donated step on flat buffers counts calls on
  the host and tells the update which calls are quiet (`clock.quiet`): those run a
  program with no branch (and no `torch.cond`, whose outputs copy the state it carries).
- `parts(tree)`: for a transform built of others, each inner transform with the leaves it
  sees: None for the same tree, a list of bools for `{path: leaf}` of the leaves kept
  (what `masked` and `partition` hand their inner transforms).

The rule for a transform that declares nothing (a `Transform(init, update)` of the user's
own, or one rebuilt around a new `update`): it may do anything per leaf, look at names, or
keep state of any shape, so the whole update runs leaf by leaf (the per-leaf paths, which
give it the user's tree), and `explain()` names it. `with_needs(t, Needs())` moves it onto
flat buffers.
"""

from __future__ import annotations

import dataclasses
import weakref
from typing import Any, Callable, NamedTuple, Sequence

import torch
import torch.utils._pytree as pytree
from torch import Tensor

from .. import _tree as tr
from .clock import Phase
from .packed import STACK, NotPacked, PackSpec, group_leaves, rule_on, select_spec


class Rule(NamedTuple):
    """A per-leaf rule: `values(tree)` gives one hashable value per leaf of `tree`. Known by
    `(what, id(source))` (a constant source by its value), so a transform rebuilt from the same arguments (as
    `inject_hyperparams` does each step) reads the values planned for the first."""

    what: str  # "mask", "labels", "multipliers", "batch_dims", ...
    source: Any  # the user's value the rule reads (a tree, a callable, a constant)
    values: Callable[[Any], Sequence[Any]]

    @property
    def key(self) -> tuple[str, Any]:
        # A constant names itself, by kind and value (1 and True apart): Dynamo before 2.12 can
        # trace neither id() of an int nor a type's __name__, so the kind is found by isinstance.
        s = self.source
        kinds = ((bool, "bool"), (int, "int"), (float, "float"), (str, "str"))
        kind = "none" if s is None else next((name for t, name in kinds if isinstance(s, t)), None)
        return (self.what, ("=", kind, s) if kind is not None else id(s))


@dataclasses.dataclass(frozen=True)
class Needs:
    """What a transform's math needs of the engine (see the module docstring).

    Examples:
        >>> import torch, purestep.core as ps
        >>> def init(params):
        ...     return ()
        >>> def update(grads, state, params=None, **extra):
        ...     return ps.tree_map(lambda g: -0.1 * torch.sign(g), grads), state
        >>> t = ps.with_needs(ps.Transform(init, update), ps.Needs())  # elementwise: flat buffers are fine
        >>> step = ps.make_update(t, compile=True, donate=True)
        >>> step.explain({"w": torch.zeros(2, 2), "b": torch.zeros(2)})  # before any call
        'flat: compile=True, donate=True: one buffer per device and dtype'
    """

    whole_leaves: bool = False
    stacks: bool | Callable[[str, Any], bool] = True
    rules: tuple[Rule, ...] = ()
    per_row_state: bool = False
    reductions: tuple[str, ...] = ()
    flat: str | Callable[[Any], str | None] | None = None
    sharded: str | None = None
    parts: Callable[[Any], Sequence[tuple[Any, Sequence[bool] | None]]] | None = None
    bounded: bool = False
    phase: Phase | None = None


# Declarations keyed by the update function (as `with_in_place`'s forms: a transform rebuilt
# around a new update declares nothing until it says so).
_NEEDS: "weakref.WeakKeyDictionary[Callable, Needs]" = weakref.WeakKeyDictionary()


def with_needs(transform: Any, needs: Needs) -> Any:
    """`transform`, declared to need `needs` of the engine (returns it).

    Examples:
        >>> import torch, purestep.core as ps
        >>> t = ps.with_needs(ps.Transform(lambda p: (), lambda g, s, p=None, **e: (g, s)), ps.Needs())
        >>> ps.needs_of(t)
        Needs(whole_leaves=False, stacks=True, rules=(), per_row_state=False, reductions=(), flat=None, sharded=None, parts=None, bounded=False, phase=None)
    """
    if not isinstance(needs, Needs):
        raise ValueError(f"needs must be a ps.Needs, got {type(needs).__name__}")
    update = getattr(transform, "update", None)
    if not callable(update):
        raise ValueError(f"with_needs takes a ps.Transform, got {type(transform).__name__}")
    if torch.compiler.is_compiling():  # built inside a compiled step: planning is done by then
        return transform
    try:
        _NEEDS[update] = needs
    except TypeError:
        raise ValueError(
            f"with_needs: the transform's update must be a function, got {type(update).__name__}"
        ) from None
    return transform


def needs_of(transform: Any) -> Needs | None:
    """What `transform` declared (`with_needs`), or None."""
    try:
        return _NEEDS.get(transform.update)
    except TypeError:
        return None


def bounded(*transforms: Any) -> bool:
    """Whether every one of `transforms` declared `Needs(bounded=True)` (a combinator
    declares it when its inner transforms all do). False inside compiled code, where a
    transform a step builds (`inject_hyperparams`' factory) declares nothing."""
    if torch.compiler.is_compiling():
        return False
    return all(getattr(needs_of(t), "bounded", False) for t in transforms)


def _factory(transform: Any) -> str:
    """The function a transform's update was made in ("scale_by_adam" for
    "scale_by_adam.<locals>.update")."""
    update = transform.update
    parts = getattr(update, "__qualname__", type(update).__name__).split(".<locals>.")
    return parts[-2] if len(parts) > 1 and parts[-1] in ("<lambda>", "update") else parts[-1]


def _name(transform: Any) -> str:
    name = _factory(transform)
    return "a transform of your own" if name in ("<lambda>", "update") else f"'{name}'"


def contains(transform: Any, factory: Callable, params: Any) -> bool:
    """Whether `transform`, or a transform it is built of, was made by `factory`.

    The parts are the ones `transform` declares (`Needs.parts`: a chain's links, a
    `masked`'s inner transform, what `inject_hyperparams` builds...), read on meta tensors
    of `params`' shapes: nothing runs, nothing is allocated. A transform that declares
    nothing shows no parts.

    Examples:
        >>> import torch, purestep.core as ps
        >>> t = ps.chain(ps.clip_by_global_norm(1.0), ps.adamw(1e-3))
        >>> params = {"w": torch.zeros(2, 2)}
        >>> ps.contains(t, ps.clip_by_global_norm, params), ps.contains(ps.adamw(1e-3), ps.clip_by_global_norm, params)
        (True, False)
    """
    name = getattr(factory, "__name__", None)
    if not callable(factory) or name is None:
        raise ValueError(f"factory must be a function that makes transforms, got {type(factory).__name__}")
    return any(_factory(t) == name for t, _ in _walk(transform, _meta(params)))


def takes_parts(transform: Any, params: Any) -> bool:
    """Whether `transform` can be handed a part of `params` (some of its leaves) in place of
    the whole tree: no declared rule of it or its parts reads a tree of the params' structure
    (a mask, labels, batch dims given as a tree; functions and constants read any tree).
    Read from the declarations on meta tensors, as `contains`; a transform that declares
    nothing may look at anything, so it does not.

    Examples:
        >>> import torch, purestep.core as ps
        >>> params = {"w": torch.zeros(2, 2), "b": torch.zeros(2)}
        >>> ps.takes_parts(ps.adamw(1e-3), params)
        True
        >>> ps.takes_parts(ps.masked(ps.adamw(1e-3), {"w": True, "b": False}), params)
        False
    """
    for t, _ in _walk(transform, _meta(params)):
        needs = needs_of(t)
        if needs is None:
            return False
        if any(_is_tree(rule.source) for rule in needs.rules):
            return False
    return True


def _is_tree(source: Any) -> bool:
    return isinstance(source, (dict, list, tuple))


def _meta(params: Any) -> Any:
    return pytree.tree_map(lambda x: torch.empty(x.shape, dtype=x.dtype, device="meta"), params)


def _walk(t: Any, tree: Any) -> Any:
    """`(transform, the tree it sees)` for `t` and every part it declares, depth first."""
    yield t, tree
    needs = needs_of(t)
    if needs is None or needs.parts is None:
        return
    pairs = tr.tree_flatten_with_path(tree)[0]
    for inner, keep in needs.parts(tree):
        yield from _walk(inner, tree if keep is None else {p: x for (p, x), k in zip(pairs, keep) if k})


@dataclasses.dataclass
class Resolved:
    """The declarations of a whole transform read on one tree of params."""

    tags: list[tuple]  # per leaf: leaves of one buffer share every tag
    not_flat: str | None = None  # why no flat layout
    not_sharded: str | None = None  # why not over shards
    per_row_state: bool = False
    reductions: set[str] = dataclasses.field(default_factory=set)
    whole_leaves: bool = False
    rule_values: dict[tuple, dict[int, Any]] = dataclasses.field(default_factory=dict)  # rule key -> leaf -> value
    phases: list[Phase] = dataclasses.field(default_factory=list)  # the branches known on the host


def _tag(value: Any) -> Any:
    if isinstance(value, Tensor):  # a per-leaf hyperparameter given as a 0-d tensor: by value
        return ("tensor", float(value)) if value.numel() == 1 and value.device.type != "meta" else ("tensor", id(value))
    return value


def resolve(transform: Any, tree: Any) -> Resolved:
    """Read `transform`'s declarations on `tree` (the params as it sees them; meta tensors do)."""
    pairs = tr.tree_flatten_with_path(tree)[0]
    out = Resolved([() for _ in pairs])
    _resolve(transform, tree, list(range(len(pairs))), out)
    return out


def _resolve(transform: Any, tree: Any, index: list[int], out: Resolved) -> None:
    if out.not_flat is not None:
        return
    needs = needs_of(transform)
    if needs is None:
        out.not_flat = f"{_name(transform)} declares no needs (ps.with_needs): it runs leaf by leaf"
        return
    pairs = tr.tree_flatten_with_path(tree)[0]
    flat = needs.flat(tree) if callable(needs.flat) else needs.flat
    if flat is not None:
        out.not_flat = flat
        return
    if needs.whole_leaves:
        out.whole_leaves = True
        for j, (path, x) in enumerate(pairs):
            stack = needs.stacks(path, x) if callable(needs.stacks) else needs.stacks
            out.tags[index[j]] += ((STACK, tuple(x.shape)) if stack else ("alone", index[j]),)
    for rule in needs.rules:
        values = list(rule.values(tree))
        table = out.rule_values.setdefault(rule.key, {})
        for j, v in enumerate(values):
            out.tags[index[j]] += (_tag(v),)
            table[index[j]] = v
    out.per_row_state |= needs.per_row_state
    if needs.sharded is not None and out.not_sharded is None:
        out.not_sharded = needs.sharded
    out.reductions |= set(needs.reductions)
    if needs.phase is not None and needs.phase not in out.phases:
        out.phases.append(needs.phase)
    if needs.parts is not None:
        for inner, keep in needs.parts(tree):
            if keep is None:
                _resolve(inner, tree, index, out)
            else:
                sub = {p: x for (p, x), k in zip(pairs, keep) if k}
                _resolve(inner, sub, [i for i, k in zip(index, keep) if k], out)


def plan(transform: Any, params: Any, *, tags: list[tuple] | None = None, shard: Any = None) -> PackSpec:
    """The grouping of `params`' leaves into flat buffers under which `transform` runs, read
    from its declarations; `tags` (per leaf) keeps leaves apart from the start (the caller's
    own reasons: shards and whole leaves). Raises `NotPacked` with the reason when there is
    none. `shard` (a `placement.Placement`) is attached to the result."""
    pairs, spec = tr.tree_flatten_with_path(params)
    # Per-leaf rules see the leaves as the user does: over shards, the whole leaves' shapes.
    shapes = [shard.shapes[i] if shard is not None else x.shape for i, (_, x) in enumerate(pairs)]
    meta = [torch.empty(shape, dtype=x.dtype, device="meta") for shape, (_, x) in zip(shapes, pairs)]
    res = resolve(transform, pytree.tree_unflatten(meta, spec))
    if res.not_flat is not None:
        raise NotPacked(res.not_flat)
    if shard is not None and res.not_sharded is not None:
        raise NotPacked(res.not_sharded)
    if shard is not None and (why := shard.declines(res.reductions, res.per_row_state)) is not None:
        raise NotPacked(why)
    extra = list(tags) if tags is not None else [() for _ in pairs]
    groups = group_leaves(pairs, [a + b for a, b in zip(extra, res.tags)])
    pack = PackSpec(groups, spec, meta, shard, per_row_state=res.per_row_state, rule_values=res.rule_values)
    pack.summary = describe(res, groups, pairs)
    pack.phases = res.phases
    _prepare(transform, pack)
    return pack


def _prepare(transform: Any, spec: PackSpec) -> None:
    """Make, now, what `transform` will look up on trees packed by `spec` at run time: each
    declared rule's values per buffer and the sub-layouts `masked`/`partition` select, so a
    traced step finds them all (looking up, never adding: no guard on a cache that grows)."""
    needs = needs_of(transform)
    if needs is None:
        return
    for rule in needs.rules:
        rule_on(spec, rule)
    if needs.parts is None:
        return
    tree = pytree.tree_unflatten(list(spec.proxy), spec.orig_spec)
    position = {m.index: i for i, m in enumerate(spec.members_in_order)}
    for inner, keep in needs.parts(tree):
        if keep is None:
            _prepare(inner, spec)
        else:
            per_group = [bool(keep[position[g.members[0].index]]) for g in spec.groups]
            _prepare(inner, select_spec(spec, per_group))


def describe(res: Resolved, groups: list, pairs: list) -> str:
    """The grouping in words, for `explain()`."""
    kinds = {(str(x.device), x.dtype) for _, x in pairs}
    if len(groups) == len(kinds) and not res.whole_leaves:
        text = "one buffer per device and dtype"
    else:
        text = f"{len(groups)} buffers (per device, dtype and per-leaf rule"
        text += "; whole leaves, same-shape ones stacked)" if res.whole_leaves else ")"
    if res.per_row_state:
        text += "; per-row state"
    if res.reductions:
        text += "; tree-wide " + ", ".join(sorted(res.reductions))
    return text
