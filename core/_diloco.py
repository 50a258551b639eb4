"""The outer loop of local-SGD training as a transform around another: DiLoCo.

Each worker runs the inner optimizer on its own data; every `sync_every` updates the workers
agree on a common point again: the anchor (the params of the last sync) moves by an outer
optimizer's step along the workers' mean pseudo-gradient Δ̄ = mean(anchor − θ), and every
worker's params land on the new anchor. Communication is the one `reduce` per sync.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import torch
import torch.utils._pytree as pytree
from torch import Tensor

from . import _tree as tr
from ._base import OptState, Params, PyTree, Transform, check_int, leaf_device, require_params, zero_count
from ._cond import as_is, cond, fresh, plain_branch
from ._sparse import TopK
from .engine import ops as lay
from .engine.clock import Phase, quiet
from .engine.needs import Needs, Rule, with_needs


class DiLoCoState(NamedTuple):
    """State of `diloco`."""

    count: Tensor  # type: ignore[assignment]  # (), int64: calls so far, synced or not (optax's name shadows tuple.count)
    inner_state: OptState
    anchor: PyTree  # the params as of each fragment's last sync (the global params, equal on every worker)
    outer_state: OptState  # the outer transform's; with fragments, a tuple of one per fragment
    pending: PyTree  # delay > 0: the averaged pseudo-gradients waiting for their outer step; else ()
    error: PyTree  # compression: what each worker has not sent yet (error feedback); else ()


def diloco(
    inner: Transform,
    outer: Transform,
    sync_every: int,
    reduce: Callable[[PyTree], PyTree] | None = None,
    *,
    fragments: int = 1,
    delay: int = 0,
    alpha: float = 0.0,
    compression: TopK | None = None,
    gather: Callable[[PyTree], PyTree] | None = None,
    commit: Callable[[], bool] | None = None,
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

    Streaming DiLoCo (`fragments`, `delay`, `alpha`, with torchft's meanings): the leaves are
    cut into `fragments` runs in flatten order, of about equal size; fragment f syncs at
    calls (f + 1)·H/F + m·H (one fragment every H/F calls, each every H), so the traffic of
    one sync is 1/F of the params. Its pseudo-gradient is taken and averaged `delay` calls
    before its outer step (at the outer step the params have moved on by that many inner
    updates), and the fragment's params become `lerp(new anchor, θ, alpha)`
    (α = 0: the new anchor; the local steps since the pseudo-gradient are dropped).

    Args:
      inner: the optimizer each worker runs on its own grads (AdamW in the paper; Muon:
        MuLoCo).
      outer: the transform that steps the anchor: any transform (its grads are Δ̄, its
        params the anchor; with fragments, one state per fragment over its leaves).
      sync_every: H, the inner updates between two syncs of the same leaves.
      reduce: the mean over workers, a function on trees (`Δ ↦ Δ̄`, e.g. an all_reduce
        average over the data-parallel group); None for one worker. It runs once per sync,
        on the fragment's tree (the leaves it gets may be flat buffers of many params: it
        must treat elements alike, as a mean does), and never between syncs: in compiled
        code the sync is a `torch.cond` branch, so the steps between syncs communicate nothing.
      fragments: F, the number of fragments (F divides H; at most one per leaf).
      delay: τ, the calls between a fragment's pseudo-gradient and its outer step
        (0 <= τ < H/F).
      alpha: α in [0, 1], the share of the worker's own params a synced fragment keeps.
      compression: SparseLoCo (`ps.TopK`): each worker sends only the top-k entries of each
        tile of e ← β·e + Δ, quantized to a few bits, and keeps the rest in e (error
        feedback, in the state); the mean is per entry over the workers that sent it.
        The workers exchange the compressed form through `gather` (`reduce` is not used).
      gather: with `compression`, the exchange: a function on trees giving each leaf with a
        new leading dim of workers (an all_gather); None for one worker.
      commit: the workers' vote on a sync, taken at its outer step, after its exchange
        (torchft's `Manager.should_commit`: `purestep.api.TorchFT`). False drops the sync as
        torchft's DiLoCo does: the anchor and the outer state stay, and the params go back to
        the anchor (this worker's steps since the last sync are lost). A host function: the
        syncs are then decided on the host (the count read, eagerly; not under compile).

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
        Douillard et al., Streaming DiLoCo with overlapping communication, 2025.
        Sarfi et al., SparseLoCo: Communication-efficient LLM training, 2025.
    """
    check_int("sync_every", sync_every, 1)
    check_int("fragments", fragments, 1)
    if sync_every % fragments:
        raise ValueError(f"fragments must divide sync_every (each fragment syncs every H/F calls), got {fragments}")
    period = sync_every // fragments
    check_int("delay", delay, 0, below=period, why="a fragment's outer step lands before the next fragment's sync")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha must be a number in [0, 1], got {alpha!r}")
    for name, fn in (("reduce", reduce), ("gather", gather)):
        if fn is not None and not callable(fn):
            raise ValueError(f"{name} must be a function on trees or None, got {type(fn).__name__}")
    if compression is not None and not isinstance(compression, TopK):
        raise ValueError(f"compression must be a ps.TopK or None, got {type(compression).__name__}")
    if compression is not None and reduce is not None:
        raise ValueError("reduce is not used with compression: the workers exchange the compressed form through gather")
    if compression is None and gather is not None:
        raise ValueError("gather exchanges compressed pseudo-gradients: it needs compression=ps.TopK(...)")
    if commit is not None and not callable(commit):
        raise ValueError(f"commit must be a function returning a bool or None, got {type(commit).__name__}")
    mean = _Mean(reduce, compression, gather)
    rule = Rule("fragments", fragments, lambda tree: _fragment_of(tree, fragments))
    streaming = fragments > 1
    dues = [((f + 1) * period) % sync_every for f in range(fragments)]  # calls % H at fragment f's outer step

    def quiet_at(calls: int) -> bool:
        """Whether call `calls` neither takes a pseudo-gradient nor lands an outer step."""
        return all((calls + delay) % sync_every != d and calls % sync_every != d for d in dues)

    # A donated step on flat buffers knows the quiet calls on the host (`engine.clock`).
    phase = Phase(("diloco", sync_every, fragments, delay), DiLoCoState, quiet_at)

    def parts_of(tree: PyTree) -> list[tuple[list[int], PyTree]]:
        """Per fragment: its leaves' indices and its tree (the whole tree without fragments)."""
        if not streaming:
            return [(list(range(len(pytree.tree_leaves(tree)))), tree)]
        frag = lay.per_leaf(tree, rule)
        return [
            ([j for j, k in enumerate(frag) if k == f], lay.select(tree, [k == f for k in frag]))
            for f in range(fragments)
        ]

    def init(params: Params) -> DiLoCoState:
        leaves = pytree.tree_leaves(params)
        anchor = pytree.tree_map(lambda p: p.detach().clone(), params)
        outer_state = tuple(outer.init(t) for _, t in parts_of(params)) if streaming else outer.init(params)
        pending = tr.tree_zeros_like(params) if delay else ()
        error = tr.tree_zeros_like(params) if compression is not None else ()
        return DiLoCoState(zero_count(leaf_device(leaves)), inner.init(params), anchor, outer_state, pending, error)

    def update(grads, state, params=None, **extra):
        require_params(params, "diloco", "the pseudo-gradient is anchor - params")
        tr.check_match(grads, state.anchor, "grads", "params")
        updates, inner_state = inner.update(grads, state.inner_state, params, **extra)
        calls = state.count + 1
        if commit is not None and torch.compiler.is_compiling():
            raise ValueError("diloco's commit is a host vote: run it eagerly (make_update(..., compile=False))")
        if quiet(phase.key):  # the host knows no fragment syncs on this call: no branch, nothing copied
            return updates, state._replace(count=calls, inner_state=inner_state)
        spec = pytree.tree_structure(params)
        anchor, ps_, us = (spec.flatten_up_to(t) for t in (state.anchor, params, updates))
        pending = spec.flatten_up_to(state.pending) if delay else []
        error = spec.flatten_up_to(state.error) if compression is not None else []
        moves, outers = list(us), list(state.outer_state) if streaming else [state.outer_state]
        for f, (idx, sub) in enumerate(parts_of(params)):
            due = dues[f]
            o, o_spec = pytree.tree_flatten(outers[f])
            host = commit is not None or plain_branch(calls)  # a host vote: the branch is taken on the host
            sync = _Sync(pytree.tree_structure(sub), o_spec, outer, mean, alpha, len(idx), host, delay, commit)
            a, p, u = ([xs[j] for j in idx] for xs in (anchor, ps_, us))
            e = [error[j] for j in idx] if error else []
            if delay:  # the pseudo-gradient averaged `delay` calls before its outer step
                took = (calls + delay) % sync_every == due
                carried = cond(took, sync.average, sync.last, (*a, *p, *u, *[pending[j] for j in idx], *e), host)
                for j, x in zip(idx, carried):
                    pending[j] = x
                for j, x in zip(idx, carried[len(idx) :]):
                    error[j] = x
                ops = (*a, *p, *u, *o, *carried[: len(idx)])
                out = cond(calls % sync_every == due, sync.step_averaged, sync.keep, ops, host)
            else:
                out = cond(calls % sync_every == due, sync.step, sync.keep, (*a, *p, *u, *o, *e), host)
            n, k = len(idx), len(o)
            for i, j in enumerate(idx):
                moves[j], anchor[j] = out[i], out[n + i]
            outers[f] = pytree.tree_unflatten(list(out[2 * n : 2 * n + k]), o_spec)
            for j, x in zip(idx, out[2 * n + k :]):
                error[j] = x
        new_state = DiLoCoState(
            calls,
            inner_state,
            pytree.tree_unflatten(anchor, spec),
            tuple(outers) if streaming else outers[0],
            pytree.tree_unflatten(pending, spec) if delay else (),
            pytree.tree_unflatten(error, spec) if compression is not None else (),
        )
        return pytree.tree_unflatten(moves, spec), new_state

    needs = Needs(
        rules=(rule,) if streaming else (),
        parts=lambda tree: [(inner, None), (outer, None)],
        # the tiles of top-k are tiles of whole leaves: one leaf per buffer, not this rank's rows
        whole_leaves=compression is not None,
        stacks=compression is None,
        sharded="top-k tiles of whole leaves" if compression is not None else None,
        phase=phase,
    )
    return with_needs(Transform(init, update), needs)


def _fragment_of(tree: PyTree, fragments: int) -> list[int]:
    """Each leaf's fragment: runs of leaves in flatten order of about equal size (a leaf
    goes to the fragment its middle element falls in), none empty."""
    sizes = [x.numel() for x in pytree.tree_leaves(tree)]
    n = len(sizes)
    if n < fragments:
        raise ValueError(f"fragments={fragments} is more than the {n} leaves of the params")
    total, before = max(sum(sizes), 1), 0
    out: list[int] = []
    for j, size in enumerate(sizes):
        f = min(fragments - 1, int(fragments * (before + size / 2) / total))
        if out:  # in order, one fragment at a time, and enough leaves left for the rest
            f = min(max(f, out[-1], fragments - (n - j)), out[-1] + 1)
        out.append(f if out else 0)
        before += size
    return out


class _Mean:
    """The workers' mean pseudo-gradient of one fragment: `reduce`'s mean, or with
    compression SparseLoCo's (error feedback, top-k, quantized, exchanged by `gather`)."""

    def __init__(self, reduce: Callable | None, compression: TopK | None, gather: Callable | None) -> None:
        self.reduce, self.compression, self.gather = reduce, compression, gather

    def __call__(self, delta: list[Tensor], error: list[Tensor], spec: Any) -> tuple[list[Tensor], list[Tensor]]:
        """(Δ̄, the new error feedback) from this worker's Δ and error feedback."""
        c = self.compression
        if c is None:
            tree = _unflat(delta, spec)
            return spec.flatten_up_to(self.reduce(tree) if self.reduce is not None else tree), []
        error = [c.error_decay * e + d.to(e.dtype) for e, d in zip(error, delta)]
        payloads = [c.compress(e) for e in error]
        error = [e - c.decompress(pl, e) for e, pl in zip(error, payloads)]
        if self.gather is None:  # one worker: its own
            return [c.decompress(pl, d).to(d.dtype) for pl, d in zip(payloads, delta)], error
        gathered = self.gather(_unflat(payloads, spec))
        return [c.mean(g, d).to(d.dtype) for g, d in zip(spec.flatten_up_to(gathered), delta)], error


class _Sync:
    """One fragment's sync as the branches of a `cond` over flat tuples of tensors, n leaves
    each part: anchor, params, inner updates, then the outer state's leaves (`step`, `keep`)
    or the pending pseudo-gradient (`average`, `last`), then the error feedback or the
    averaged pseudo-gradient. A step returns the updates, the anchor, the outer state and
    the error feedback; `average` the averaged pseudo-gradient and the error feedback."""

    def __init__(
        self,
        spec: Any,
        outer_spec: Any,
        outer: Transform,
        mean: _Mean,
        alpha: float,
        n: int,
        plain: bool,
        delay: int,
        commit: Callable[[], bool] | None = None,
    ) -> None:
        self.spec, self.outer_spec, self.outer, self.mean, self.alpha, self.n = spec, outer_spec, outer, mean, alpha, n
        self.commit = commit
        # the step's cond carries the error feedback (with a delay, the average's cond does)
        self.carries_error = mean.compression is not None and not delay
        self.copy = as_is if plain else fresh  # cond outputs are new tensors; a plain branch's need not be

    def _out(self, xs: Any) -> tuple[Tensor, ...]:
        return tuple(self.copy(x) for x in xs)

    def _delta(self, ops: tuple, error: Any) -> tuple[list[Tensor], list[Tensor]]:
        """Δ̄ and the new error feedback from Δ = anchor − θ, θ = params + updates."""
        n = self.n
        a, p, u = ops[:n], ops[n : 2 * n], ops[2 * n : 3 * n]
        return self.mean([ai - (pi + ui) for ai, pi, ui in zip(a, p, u)], list(error), self.spec)

    def average(self, *ops: Tensor) -> tuple[Tensor, ...]:  # (a, p, u, pending, error) -> (pending, error)
        averaged, error = self._delta(ops, ops[4 * self.n :])
        return self._out((*averaged, *error))

    def last(self, *ops: Tensor) -> tuple[Tensor, ...]:
        return self._out(ops[3 * self.n :])

    def step(self, *ops: Tensor) -> tuple[Tensor, ...]:  # (a, p, u, o, error) -> (moves, anchor, o, error)
        k = self.outer_spec.num_leaves
        averaged, error = self._delta(ops, ops[3 * self.n + k :])
        return self._outer(ops[: 3 * self.n + k], averaged) + self._out(error)

    def step_averaged(self, *ops: Tensor) -> tuple[Tensor, ...]:  # (a, p, u, o, averaged) -> (moves, anchor, o)
        return self._outer(ops[: -self.n], ops[-self.n :])

    def _outer(self, ops: tuple, averaged: Any) -> tuple[Tensor, ...]:
        """The anchor's outer step along `averaged`, and the updates that put the params on
        it (`lerp(new anchor, θ, alpha)`)."""
        n = self.n
        a, p, u, o = ops[:n], ops[n : 2 * n], ops[2 * n : 3 * n], ops[3 * n :]
        if self.commit is not None and not self.commit():  # the workers dropped this sync: back to the anchor
            return self._out((*[(ai - pi).to(ui.dtype) for ai, pi, ui in zip(a, p, u)], *a, *o))
        state = pytree.tree_unflatten(list(o), self.outer_spec)
        step, new_state = self.outer.update(_unflat(averaged, self.spec), state, _unflat(a, self.spec))
        anchor = [ai + si.to(ai.dtype) for ai, si in zip(a, self.spec.flatten_up_to(step))]
        target = [torch.lerp(ai, pi + ui, self.alpha) for ai, pi, ui in zip(anchor, p, u)] if self.alpha else anchor
        moves = [(ti - pi).to(ui.dtype) for ti, pi, ui in zip(target, p, u)]
        return self._out((*moves, *anchor, *pytree.tree_leaves(new_state)))

    def keep(self, *ops: Tensor) -> tuple[Tensor, ...]:  # the updates, the anchor, the outer state[, the error]
        n, k = self.n, self.outer_spec.num_leaves
        carried = ops[3 * n + k :] if self.carries_error else ()
        return self._out((*ops[2 * n : 3 * n], *ops[:n], *ops[3 * n : 3 * n + k], *carried))


def _unflat(leaves: Any, spec: Any) -> PyTree:
    return pytree.tree_unflatten(list(leaves), spec)
