"""Combinators: chain, masked, partition, apply_if_finite, accumulate (inject_hyperparams: `_hyperparams`)."""

from __future__ import annotations

import math
from typing import Any, Mapping, NamedTuple

import torch
import torch.utils._pytree as pytree
from torch import Tensor

from .engine import ops as lay
from . import _foreach as ls
from . import _tree as tr
from .engine.needs import Needs, Rule, bounded, with_needs
from .engine.per_leaf import apply_in_place
from ._base import (
    check_int,
    EmptyState,
    OptState,
    Params,
    PyTree,
    Transform,
    affine_of,
    leaf_device,
    once,
    with_in_place,
    zero_count,
)


def identity() -> Transform:
    """The transform that returns its grads unchanged.

    Examples:
        >>> import torch, purestep.core as ps
        >>> t = ps.identity()
        >>> t.update({"w": torch.ones(1)}, t.init({"w": torch.ones(1)}))[0]
        {'w': tensor([1.])}
    """

    def init(params: Params) -> EmptyState:
        return EmptyState()

    def update(grads, state, params=None, **extra):
        return grads, state

    return with_needs(
        Transform(init, with_in_place(update, affine=lambda state: (1.0, 0.0, state))), Needs(bounded=True)
    )


def _fold(a: Any, b: Any, x: Any, y: Any) -> tuple[Any, Any]:
    """`a·p + b·(x·u + y·p)` as `a'·p + b'·u`: the coefficients of an affine tail, folded."""
    if not ls.is_zero(y):
        a = a + (y if ls.is_one(b) else b * y)
    if not ls.is_one(x):
        b = x if ls.is_one(b) else b * x
    return a, b


def chain(*transforms: Transform) -> Transform:
    """Apply `transforms` in order; the state is the tuple of their states.

    Examples:
        >>> import torch, purestep.core as ps
        >>> t = ps.chain(ps.scale(2.0), ps.scale(-0.5))
        >>> t.update({"w": torch.ones(1)}, t.init({"w": torch.ones(1)}))[0]
        {'w': tensor([-1.])}
    """
    for i, t in enumerate(transforms):
        if not isinstance(t, Transform):
            raise ValueError(f"chain argument {i} is {type(t).__name__}, not a Transform")

    def init(params: Params) -> tuple:
        return tuple(t.init(params) for t in transforms)

    def update(grads, state, params=None, **extra):
        if len(state) != len(transforms):
            raise ValueError(f"chain state has {len(state)} entries for {len(transforms)} transforms")
        new_state, owned = [], False
        for i, (t, s) in enumerate(zip(transforms, state)):
            x, y, new_s = affine_of(t)(s) if owned else (None, None, None)
            if owned and (params is not None or ls.is_zero(y)):
                # Updates that are the chain's own (fresh tensors from the transform before,
                # aliasing no input: `ls.owned`) take an affine transform in place. In eager
                # mode that saves a new set of update tensors, whose allocation costs more than
                # the math; the chain's inputs are never written.
                leaves, spec = pytree.tree_flatten(grads)
                ps_ = [] if ls.is_zero(y) else tr.check_match(params, grads, "params", "updates", dtype=False)
                new_grads = pytree.tree_unflatten(ls.affine_(x, leaves, y, ps_), spec)
            else:
                new_grads, new_s = t.update(grads, s, params, **extra)
            new_state.append(new_s)
            nxt = transforms[i + 1] if i + 1 < len(transforms) else None
            owned = (
                nxt is not None
                and affine_of(nxt) is not None
                and (owned or ls.owned(tr.tree_leaves(new_grads), grads, s, new_s, params, extra))
            )
            grads = new_grads
        return grads, tuple(new_state)

    def apply_(grads, state, params, a=1.0, b=1.0):
        # p ← a·p + b·u: an affine tail (decay, lr) folds into the coefficients, so the
        # last transform before it applies its own update straight into the params.
        if len(state) != len(transforms):
            raise ValueError(f"chain state has {len(state)} entries for {len(transforms)} transforms")
        new_state, k = list(state), len(transforms)
        while k and affine_of(transforms[k - 1]) is not None:
            x, y, new_state[k - 1] = affine_of(transforms[k - 1])(state[k - 1])
            a, b = _fold(a, b, x, y)
            k -= 1
        for i in range(k - 1):
            grads, new_state[i] = transforms[i].update(grads, state[i], params)
        if k:
            new_state[k - 1] = apply_in_place(transforms[k - 1], grads, state[k - 1], params, a, b)
        else:  # the whole chain is affine (plain SGD): p ← a·p + b·g
            ls.scale_add_(tr.check_match(params, grads, "params", "grads", dtype=False), a, b, tr.tree_leaves(grads))
        return tuple(new_state)

    t = Transform(init, with_in_place(update, apply_=apply_))
    return with_needs(
        t, Needs(parts=lambda tree: [(inner, None) for inner in transforms], bounded=bounded(*transforms))
    )


# --------------------------------------------------------------------------- #
# Routing leaves: masked and partition.
# --------------------------------------------------------------------------- #


def _rule(spec_tree: Any, what: str, kind: type) -> Rule:
    """A bool/str tree (or `callable(tree)`) that must match the tree leaf for leaf, as a
    per-leaf rule (`Needs.rules`; one value per buffer on flat buffers: `ops.per_leaf`)."""
    return Rule(what, spec_tree, lambda tree: _leaf_values(spec_tree, tree, what, kind))


def _leaf_values(spec_tree: Any, tree: PyTree, what: str, kind: type) -> list:
    if callable(spec_tree):
        spec_tree = spec_tree(tree)
    leaves, spec = pytree.tree_flatten(tree)
    if isinstance(spec_tree, kind):
        return [spec_tree] * len(leaves)  # one value for every leaf
    tags, tag_spec = pytree.tree_flatten(spec_tree)
    if tag_spec != spec:
        raise ValueError(
            f"{what} must have the structure of params ({len(leaves)} leaves: "
            f"{', '.join(tr.tree_paths(tree)[:4])}...), got {len(tags)} leaves"
        )
    for path, tag in zip(tr.tree_paths(tree), tags):
        if not isinstance(tag, kind):
            raise ValueError(f"{what} leaf '{path}' is {tag!r}, expected a {kind.__name__}")
    return tags


def _subtree(tree: PyTree, keep: list[bool]) -> dict[str, Any]:
    return lay.select(tree, keep)


def _sub_extra(extra: dict, spec: pytree.TreeSpec, keep: list[bool]) -> dict:
    """Extra keyword trees shaped like the grads are routed the same way."""
    out = {}
    for k, v in extra.items():
        if pytree.tree_structure(v) == spec and spec.num_leaves > 0:
            v = _subtree(v, keep)
        out[k] = v
    return out


class MaskedState(NamedTuple):
    """State of `masked`: the inner state over the selected leaves."""

    inner_state: OptState


def masked(inner: Transform, mask: Any) -> Transform:
    """Apply `inner` to the leaves where `mask` is True; pass the others through.

    `inner` sees the selected leaves as a flat `dict(path -> tensor)`.

    Args:
      inner: the transform to apply.
      mask: a bool pytree with the structure of params, or `callable(params) -> bool pytree`.

    Examples:
        >>> import torch, purestep.core as ps
        >>> t = ps.masked(ps.scale(0.0), {"w": True, "b": False})
        >>> p = {"w": torch.ones(1), "b": torch.ones(1)}
        >>> t.update(p, t.init(p))[0]
        {'w': tensor([0.]), 'b': tensor([1.])}
    """

    rule = _rule(mask, "mask", bool)

    def init(params: Params) -> MaskedState:
        keep = lay.per_leaf(params, rule)
        return MaskedState(inner.init(_subtree(params, keep)))

    def update(grads, state, params=None, **extra):
        keep = lay.per_leaf(params if params is not None else grads, rule)
        leaves, spec = pytree.tree_flatten(grads)
        paths = tr.tree_paths(grads)
        sub_params = None if params is None else _subtree(params, keep)
        sub_updates, inner_state = inner.update(
            _subtree(grads, keep), state.inner_state, sub_params, **_sub_extra(extra, spec, keep)
        )
        out = [sub_updates[p] if k else g for p, k, g in zip(paths, keep, leaves)]
        return pytree.tree_unflatten(out, spec), MaskedState(inner_state)

    return with_needs(
        Transform(init, update),
        Needs(rules=(rule,), parts=lambda tree: [(inner, rule.values(tree))], bounded=bounded(inner)),
    )


class PartitionState(NamedTuple):
    """State of `partition`: each label's inner state."""

    inner_states: dict[str, OptState]


def partition(transforms: Mapping[str, Transform], labels: Any) -> Transform:
    """Route each leaf to the transform named by its label.

    Each transform sees its leaves as a flat `dict(path -> tensor)`.

    Args:
      transforms: label -> transform.
      labels: a str pytree with the structure of params, or `callable(params) -> str pytree`.

    Examples:
        >>> import torch, purestep.core as ps
        >>> t = ps.partition({"a": ps.scale(2.0), "b": ps.scale(0.0)}, {"w": "a", "v": "b"})
        >>> p = {"w": torch.ones(1), "v": torch.ones(1)}
        >>> t.update(p, t.init(p))[0]
        {'w': tensor([2.]), 'v': tensor([0.])}
    """
    transforms = dict(transforms)

    def checked(tree: PyTree) -> list[str]:
        out = _leaf_values(labels, tree, "labels", str)
        for path, label in zip(tr.tree_paths(tree), out):
            if label not in transforms:
                raise ValueError(
                    f"labels leaf '{path}' is {label!r}, which is not one of the transforms {sorted(transforms)}"
                )
        return out

    rule = Rule("labels", labels, checked)

    def tags(tree: PyTree) -> list[str]:
        return lay.per_leaf(tree, rule)

    def init(params: Params) -> PartitionState:
        lab = tags(params)
        return PartitionState(
            {name: t.init(_subtree(params, [x == name for x in lab])) for name, t in transforms.items()}
        )

    def update(grads, state, params=None, **extra):
        lab = tags(params if params is not None else grads)
        leaves, spec = pytree.tree_flatten(grads)
        paths = tr.tree_paths(grads)
        out = list(leaves)
        new_states = {}
        for name, t in transforms.items():
            keep = [x == name for x in lab]
            sub_params = None if params is None else _subtree(params, keep)
            sub_updates, new_states[name] = t.update(
                _subtree(grads, keep), state.inner_states[name], sub_params, **_sub_extra(extra, spec, keep)
            )
            for i, k in enumerate(keep):
                if k:
                    out[i] = sub_updates[paths[i]]
        return pytree.tree_unflatten(out, spec), PartitionState(new_states)

    def parts(tree: PyTree) -> list:
        lab = tags(tree)
        return [(t, [x == name for x in lab]) for name, t in transforms.items()]

    return with_needs(Transform(init, update), Needs(rules=(rule,), parts=parts, bounded=bounded(*transforms.values())))


# --------------------------------------------------------------------------- #
# Skipping and accumulating.
# --------------------------------------------------------------------------- #


def _select_tree(cond: Tensor, new: PyTree, old: PyTree) -> PyTree:
    return pytree.tree_map(lambda a, b: torch.where(cond, a, b), new, old)


class ApplyIfFiniteState(NamedTuple):
    """State of `apply_if_finite`: skip counters and the inner state."""

    notfinite_count: Tensor  # (), int64: consecutive non-finite steps
    last_finite: Tensor  # (), bool
    total_notfinite: Tensor  # (), int64
    inner_state: OptState


def apply_if_finite(inner: Transform, max_consecutive: int | None = None) -> Transform:
    """Skip the update (zeros, inner state unchanged) when any grad, or any value of the
    inner state it would produce, is non-finite.

    The state check catches a huge but finite grad that overflows the state: g = 1e30
    makes Adam's float32 second moment inf, after which every update would be 0. Skipped
    steps are counted in `notfinite_count` (in a row) and `total_notfinite`, and do not
    advance the inner state's step counter (`ps.step_count`). After more than
    `max_consecutive` non-finite steps in a row the update is applied anyway (as
    `optax.apply_if_finite`), so a run that only produces NaNs fails visibly; `None`
    skips forever.

    How it checks: over an inner transform that declares its state bounded by its grads
    (`ps.Needs(bounded=True)`: Adam's and Lion's moments, SGD's momentum, clipping, decay,
    schedules, and chains, masks and injected hyperparameters of those), the grads alone,
    from their global norm, the value a clip reads too (compiled: one reduction for both;
    eagerly: computed once): the step is applied when Σ g² is finite and at most m, the
    largest value of the state's narrowest float dtype, so neither a square nor a norm the
    state keeps can overflow (1e30 in float32 is skipped). Over any other inner transform
    (or state in float16, whose range bounds each element, not the norm), the grads and
    every float of the new inner state are checked (one more read of the new
    state per step). Eagerly on the CPU over a bounded transform, the inner transform runs
    in place (its own kernels) or not at all, the check read first (the CPU has it at hand).

    Warning:
        Unlike `optax.apply_if_finite`, which looks at the grads only, a finite grad that
        would overflow the inner state is skipped too.

    Examples:
        >>> import torch, purestep.core as ps
        >>> opt = ps.apply_if_finite(ps.adam(1e-3))
        >>> params = {"w": torch.zeros(2)}
        >>> _, state = opt.update({"w": torch.full((2,), 1e30)}, opt.init(params), params)
        >>> int(state.total_notfinite), bool(torch.isfinite(ps.tree_get(state, "nu")["w"]).all())
        (1, True)
    """
    if max_consecutive is not None and (isinstance(max_consecutive, bool) or max_consecutive < 0):
        raise ValueError(f"max_consecutive must be an int >= 0 or None, got {max_consecutive!r}")

    def init(params: Params) -> ApplyIfFiniteState:
        z = zero_count(leaf_device(pytree.tree_leaves(params)))
        return ApplyIfFiniteState(z, torch.ones((), dtype=torch.bool, device=z.device), z.clone(), inner.init(params))

    lean = bounded(inner)  # the grads tell: no read of the new state

    def grads_decide(floats: list[Tensor]) -> bool:  # float16 state takes the full check (see `_fits`)
        return lean and not any(x.dtype == torch.float16 for x in floats)

    def update(grads, state, params=None, **extra):
        updates, inner_state = inner.update(grads, state.inner_state, params, **extra)
        floats = [x for x in pytree.tree_leaves(inner_state) if isinstance(x, Tensor) and x.is_floating_point()]
        # Over FSDP2 shards: one count on every rank, summed in one collective.
        if grads_decide(floats):
            finite = _fits(grads, floats)
        else:
            finite = lay.all_finite(grads, pytree.tree_leaves(grads) + floats)
        finite = finite.to(state.last_finite.device)
        notfinite = torch.where(finite, torch.zeros_like(state.notfinite_count), state.notfinite_count + 1)
        apply = finite if max_consecutive is None else finite | (notfinite > max_consecutive)
        # Realized once per step (as a float: `once` keeps those out of a CPU kernel's loop);
        # inlined, the flag's math would run per vector of the step's kernel.
        apply = once(apply.to(torch.float32)) > 0
        updates = pytree.tree_map(lambda u: torch.where(apply, u, 0.0), updates)
        inner_state = _select_tree(apply, inner_state, state.inner_state)
        total = state.total_notfinite + (~finite).to(torch.int64)
        return updates, ApplyIfFiniteState(notfinite, finite, total, inner_state)

    def apply_(grads, state, params, a=1.0, b=1.0):
        # The in-place form (eager): over a bounded inner transform on the CPU, the grads'
        # check comes first and the inner transform runs in place (its own in-place kernels)
        # or not at all. Reading the flag there waits on nothing: the CPU computed it already.
        leaves = pytree.tree_leaves(grads)
        floats = [x for x in pytree.tree_leaves(state.inner_state) if isinstance(x, Tensor) and x.is_floating_point()]
        if not grads_decide(floats) or any(x.device.type != "cpu" for x in leaves + floats):  # decided on the device
            updates, new_state = update(grads, state, params)
            ls.scale_add_(
                tr.check_match(params, updates, "params", "updates", dtype=False), a, b, tr.tree_leaves(updates)
            )
            return new_state
        finite = _fits(grads, floats).to(state.last_finite.device)
        notfinite = torch.where(finite, torch.zeros_like(state.notfinite_count), state.notfinite_count + 1)
        apply = bool(finite) or (max_consecutive is not None and int(notfinite) > max_consecutive)
        if apply:
            inner_state = apply_in_place(inner, grads, state.inner_state, params, a, b)
        else:  # a zero update: p <- a·p (the decay a chain folds in after it still applies)
            inner_state = state.inner_state
            if not ls.is_one(a):
                for x in tr.tree_leaves(params):
                    x.mul_(a)
        total = state.total_notfinite + (~finite).to(torch.int64)
        return ApplyIfFiniteState(notfinite, finite, total, inner_state)

    return with_needs(
        Transform(init, with_in_place(update, apply_=apply_)),
        Needs(reductions=("all_finite",), parts=lambda tree: [(inner, None)], bounded=lean),
    )


def skipped_updates(opt_state: OptState) -> tuple[Tensor, Tensor] | None:
    """`(skipped, total)` of the outermost `apply_if_finite` in `opt_state`: whether its
    last update was skipped for non-finite values (0-d bool) and how many it has skipped
    so far (0-d int64), copies read from the state with no host sync; None when the state
    holds none, or several at the same depth (`partition` of two wrapped groups).

    Examples:
        >>> import torch, purestep.core as ps
        >>> opt = ps.apply_if_finite(ps.adam(1e-3))
        >>> params = {"w": torch.zeros(2)}
        >>> _, state = opt.update({"w": torch.full((2,), float("nan"))}, opt.init(params), params)
        >>> ps.skipped_updates(state)
        (tensor(True), tensor(1))
    """
    level = [opt_state]
    while level:
        found = [node for node in level if isinstance(node, ApplyIfFiniteState)]
        if found:
            if len(found) > 1:
                return None
            return torch.logical_not(found[0].last_finite), found[0].total_notfinite.clone()
        level = [child for node in level for _, child in tr.children(node)]
    return None


def _fits(grads: PyTree, state_floats: list[Tensor]) -> Tensor:
    """A 0-d bool: every grad finite and Σ g² within the largest value of the state's
    narrowest float dtype (so no square, nor their sum, overflows what a bounded transform
    keeps), read from the grads' global norm: the value a clip reads too (compiled, one
    reduction; eagerly, computed once). Without float state, every grad finite. (Float16
    state takes the full check instead: √65504 would bound the norm, not each element.)"""
    leaves = pytree.tree_leaves(grads)
    if not state_floats:
        return lay.all_finite(grads, leaves)
    largest = min(torch.finfo(x.dtype).max for x in state_floats)
    return lay.global_norm(grads).to(torch.float64) <= math.sqrt(largest)


class AccumulateState(NamedTuple):
    """State of `accumulate`: the grads summed so far and the inner state."""

    mini_step: Tensor  # (), int64: grads accumulated since the last update
    acc_grads: PyTree
    inner_state: OptState


def accumulate(inner: Transform, every: int) -> Transform:
    """Gradient accumulation: apply `inner` to the mean of every `every` grads.

    Calls in between return zero updates and leave the inner state unchanged.
    """
    check_int("every", every, 1)

    def init(params: Params) -> AccumulateState:
        leaves = pytree.tree_leaves(params)
        return AccumulateState(zero_count(leaf_device(leaves)), tr.tree_zeros_like(params), inner.init(params))

    def update(grads, state, params=None, **extra):
        gs = tr.check_match(grads, state.acc_grads, "grads", "params")
        acc, spec = pytree.tree_flatten(state.acc_grads)
        summed = ls.add(acc, gs)
        ready = state.mini_step == every - 1
        mean = pytree.tree_unflatten(ls.mul(summed, 1.0 / every), spec)
        updates, inner_state = inner.update(mean, state.inner_state, params, **extra)
        updates = pytree.tree_map(lambda u: torch.where(ready, u, torch.zeros_like(u)), updates)
        inner_state = _select_tree(ready, inner_state, state.inner_state)
        acc = [torch.where(ready, torch.zeros_like(s), s) for s in summed]
        mini = torch.where(ready, torch.zeros_like(state.mini_step), state.mini_step + 1)
        return updates, AccumulateState(mini, pytree.tree_unflatten(acc, spec), inner_state)

    return with_needs(Transform(init, update), Needs(parts=lambda tree: [(inner, None)], bounded=bounded(inner)))
