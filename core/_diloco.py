"""The outer loop of local-SGD training as a transform around another: DiLoCo.

Each worker runs the inner optimizer on its own data; every `sync_every` updates the workers
agree on a common point again: the anchor (the params of the last sync) moves by an outer
optimizer's step along the workers' mean pseudo-gradient Δ̄ = mean(anchor − θ), and every
worker's params land on the new anchor. Communication is the one `reduce` per sync.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import torch.utils._pytree as pytree
from torch import Tensor

from . import _tree as tr
from ._base import OptState, Params, PyTree, Transform, check_int, leaf_device, require_params, zero_count
from ._cond import as_is, cond, fresh, plain_branch
from .engine.needs import Needs, with_needs


class DiLoCoState(NamedTuple):
    """State of `diloco`."""

    count: Tensor  # type: ignore[assignment]  # (), int64: updates so far (optax's name shadows tuple.count)
    inner_state: OptState
    anchor: PyTree  # the params as of the last sync (the global params, equal on every worker)
    outer_state: OptState


def diloco(
    inner: Transform,
    outer: Transform,
    sync_every: int,
    reduce: Callable[[PyTree], PyTree] | None = None,
) -> Transform:
    """DiLoCo: `inner` on every update, an outer step on the workers' mean every `sync_every`.

    Each update applies `inner`. On every `sync_every`-th call (the H-th, 2H-th, ...) it then
    takes the pseudo-gradient Δ = anchor − θ (θ: the params after this call's inner update),
    averages it over the workers with `reduce`, steps the anchor with the outer optimizer,
    anchor ← anchor + outer.update(Δ̄, outer_state, anchor), and returns the update that puts
    the params on the new anchor (`p + (anchor − p)`: the anchor itself up to the rounding
    of that sum; the next sync starts from the anchor, so the rounding never accumulates).
    The inner state is never reset. With `outer = ps.sgd(1.0)` a sync is a plain average
    of the workers' params (local SGD); DiLoCo's own outer is
    `ps.sgd(0.7, momentum=0.9, nesterov=True)`.

    Args:
      inner: the optimizer each worker runs on its own grads (AdamW in the paper; Muon:
        MuLoCo).
      outer: the transform that steps the anchor: any transform (its grads are Δ̄, its
        params the anchor).
      sync_every: H, the inner updates between syncs.
      reduce: the mean over workers, a function on trees (`Δ ↦ Δ̄`, e.g. an all_reduce
        average over the data-parallel group); None for one worker. It runs once per sync,
        on the whole tree (the leaves it gets may be flat buffers of many params: it must
        treat elements alike, as a mean does), and never between syncs: in compiled code
        the sync is a `torch.cond` branch, so the steps between syncs communicate nothing.

    Examples:
        >>> import torch, purestep.core as ps
        >>> opt = ps.diloco(ps.sgd(0.1), ps.sgd(1.0), sync_every=2)
        >>> params = {"w": torch.ones(2)}
        >>> state = opt.init(params)
        >>> for _ in range(2):
        ...     updates, state = opt.update({"w": torch.ones(2)}, state, params)
        ...     params = ps.apply_updates(params, updates)
        >>> params["w"], state.anchor["w"]
        (tensor([0.8000, 0.8000]), tensor([0.8000, 0.8000]))

    References:
        Douillard et al., DiLoCo: Distributed Low-Communication Training of Language Models, 2023.
    """
    check_int("sync_every", sync_every, 1)
    if reduce is not None and not callable(reduce):
        raise ValueError(f"reduce must be a function on trees or None, got {type(reduce).__name__}")

    def init(params: Params) -> DiLoCoState:
        leaves = pytree.tree_leaves(params)
        anchor = pytree.tree_map(lambda p: p.detach().clone(), params)
        return DiLoCoState(zero_count(leaf_device(leaves)), inner.init(params), anchor, outer.init(params))

    def update(grads, state, params=None, **extra):
        require_params(params, "diloco", "the pseudo-gradient is anchor - params")
        tr.check_match(grads, state.anchor, "grads", "params")
        updates, inner_state = inner.update(grads, state.inner_state, params, **extra)
        spec = pytree.tree_structure(params)
        anchor, ps_, us = (spec.flatten_up_to(t) for t in (state.anchor, params, updates))
        outer_leaves, outer_spec = pytree.tree_flatten(state.outer_state)
        n = len(anchor)
        sync = (state.count + 1) % sync_every == 0
        out_ = as_is if plain_branch(sync) else fresh  # cond outputs are copies; plain branches' need not be

        def synced(*ops):
            a, p, u, o = ops[:n], ops[n : 2 * n], ops[2 * n : 3 * n], ops[3 * n :]
            delta = pytree.tree_unflatten([ai - (pi + ui) for ai, pi, ui in zip(a, p, u)], spec)
            if reduce is not None:
                delta = reduce(delta)
            step, new_outer = outer.update(delta, pytree.tree_unflatten(list(o), outer_spec), _unflat(a, spec))
            new_anchor = [ai + si.to(ai.dtype) for ai, si in zip(a, spec.flatten_up_to(step))]
            moves = [(ai - pi).to(ui.dtype) for ai, pi, ui in zip(new_anchor, p, u)]
            return tuple(out_(x) for x in (*moves, *new_anchor, *pytree.tree_leaves(new_outer)))

        def local(*ops):
            a, u, o = ops[:n], ops[2 * n : 3 * n], ops[3 * n :]
            return tuple(out_(x) for x in (*u, *a, *o))

        out = cond(sync, synced, local, (*anchor, *ps_, *us, *outer_leaves))
        moved, new_anchor, new_outer = out[:n], out[n : 2 * n], out[2 * n :]
        return _unflat(moved, spec), DiLoCoState(
            state.count + 1, inner_state, _unflat(new_anchor, spec), pytree.tree_unflatten(list(new_outer), outer_spec)
        )

    return with_needs(Transform(init, update), Needs(parts=lambda tree: [(inner, None), (outer, None)]))


def _unflat(leaves: Any, spec: Any) -> PyTree:
    return pytree.tree_unflatten(list(leaves), spec)
