"""Gradient clipping: by global norm, by value, unit-wise (AGC), by a running norm."""

from __future__ import annotations

from typing import NamedTuple, Sequence

import torch
import torch.utils._pytree as pytree
from torch import Tensor

from .engine import ops as lay
from . import _foreach as ls
from . import _tree as tr
from ._base import (
    EmptyState,
    Params,
    Transform,
    check_hyperparam,
    check_int,
    check_positive,
    is_static,
    leaf_device,
    once,
    zero_count,
)
from .engine.needs import Needs, with_needs

_NORM_EPS = 1e-6  # torch.nn.utils.clip_grad_norm_'s: coef = max_norm / (norm + 1e-6)


def _norm_dtype(leaves: Sequence[Tensor]) -> torch.dtype:
    # tr.global_norm accumulates in float64 when any leaf is float64, else float32.
    return torch.float64 if any(x.dtype == torch.float64 for x in leaves) else torch.float32


def _zero_norm(leaves: Sequence[Tensor]) -> Tensor:
    return torch.zeros((), dtype=_norm_dtype(leaves), device=leaf_device(list(leaves)))


def _check_max_norm(name: str, value: object) -> None:
    check_hyperparam(name, value)
    if callable(value):
        raise ValueError(f"{name} must be a float or a 0-d tensor, not a schedule")
    check_positive(name, value)


class ClipByGlobalNormState(NamedTuple):
    """State of `clip_by_global_norm`: the last pre-clip global norm."""

    norm: Tensor  # (), float32 (float64 for float64 grads): the last pre-clip global norm


def clip_by_global_norm(max_norm: float | Tensor) -> Transform:
    """Scale all grads together so their global 2-norm is at most `max_norm`, = `clip_grad_norm_`.

    g ← g · min(1, max_norm/(‖g‖ + 1e-6)), with ‖g‖ the 2-norm of every leaf together
    (one reduction over the whole tree). The pre-clip norm is kept in `state.norm`.

    Args:
      max_norm: the largest global norm let through (> 0).

    Examples:
        >>> import torch, purestep.core as ps
        >>> t = ps.clip_by_global_norm(1.0)
        >>> g = {"w": torch.tensor([3.0, 4.0])}
        >>> u, s = t.update(g, t.init(g))
        >>> u["w"], s.norm
        (tensor([0.6000, 0.8000]), tensor(5.))
    """
    _check_max_norm("max_norm", max_norm)

    def init(params: Params) -> ClipByGlobalNormState:
        return ClipByGlobalNormState(_zero_norm(pytree.tree_leaves(params)))

    def update(grads, state, params=None, **extra):
        gs, spec = pytree.tree_flatten(grads)
        norm = lay.global_norm(grads)
        # coef = min(1, max_norm / (‖g‖ + eps)), a 0-d tensor: no host sync
        coef = once(torch.clamp(max_norm / (norm + _NORM_EPS), max=1.0))
        out = ls.cast_like(ls.mul(gs, coef), gs)
        return pytree.tree_unflatten(out, spec), ClipByGlobalNormState(norm.to(state.norm.dtype))

    return with_needs(Transform(init, update), Needs(reductions=("global_norm",), bounded=True))


def _clamp(xs: list[Tensor], lo: float | Tensor, hi: float | Tensor) -> list[Tensor]:
    if ls.use_foreach(xs) and not isinstance(lo, Tensor) and not isinstance(hi, Tensor):
        return list(torch._foreach_clamp_max(torch._foreach_clamp_min(xs, lo), hi))
    return [torch.clamp(x, lo, hi) for x in xs]  # type: ignore[arg-type]  # a float bound too


def clip_by_value(max_abs: float | Tensor) -> Transform:
    """Clamp every grad element to [-max_abs, max_abs], = `torch.nn.utils.clip_grad_value_`.

    Examples:
        >>> import torch, purestep.core as ps
        >>> t = ps.clip_by_value(0.5)
        >>> g = {"w": torch.tensor([-2.0, 0.1, 3.0])}
        >>> t.update(g, t.init(g))[0]
        {'w': tensor([-0.5000,  0.1000,  0.5000])}
    """
    _check_max_norm("max_abs", max_abs)

    def init(params: Params) -> EmptyState:
        return EmptyState()

    def update(grads, state, params=None, **extra):
        gs, spec = pytree.tree_flatten(grads)
        lo = -max_abs
        out = ls.cast_like(_clamp(gs, lo, max_abs), gs)
        return pytree.tree_unflatten(out, spec), state

    return with_needs(Transform(init, update), Needs(bounded=True))


def _unit_dims(x: Tensor, axis: int | tuple[int, ...] | None) -> tuple[int, ...] | None:
    """The dims a unit-wise norm reduces over; None means the whole tensor."""
    if axis is not None:
        return (axis,) if isinstance(axis, int) else tuple(axis)
    if x.squeeze().dim() <= 1:  # scalars and vectors (also (1, n) / (n, 1)): the whole tensor, as optax
        return None
    return tuple(range(1, x.dim()))  # torch layout: one unit per output channel (dim 0)


def _unit_norm(x: Tensor, dims: tuple[int, ...], stack: bool = False) -> Tensor:
    """Norms of `x` over `dims` (one unit per index of the other dims), or of each member of
    a (k, *shape) stack (flat buffers), keepdim."""
    if stack:  # the member's dims, one further right
        dims = tuple(d + 1 if d >= 0 else d for d in dims)
    return torch.linalg.vector_norm(x, dim=dims, keepdim=True)


def adaptive_clip(clipping: float = 0.01, eps: float = 1e-3, *, axis: int | tuple[int, ...] | None = None) -> Transform:
    """Unit-wise adaptive gradient clipping (AGC), = `optax.adaptive_grad_clip` on torch-layout weights.

    For each unit i: g_i ← g_i · λ·max(‖p_i‖, eps)/‖g_i‖ where ‖g_i‖ > λ·max(‖p_i‖, eps)
    (the ratio's denominator floored at 1e-6), λ = `clipping`.

    Args:
      clipping: λ, the largest allowed ‖g_i‖/‖p_i‖.
      eps: floor on ‖p_i‖, so zero-initialised params still move.
      axis: the dims a unit's norm reduces over. None: the whole tensor for 0-D/1-D
        leaves, else every dim but dim 0 (one unit per output row of a torch
        `Linear`/`Conv` weight).

    Warning:
      optax's default units assume JAX's (in, out) / HWIO layouts and reduce over
      dim 0; here they reduce over dims 1.. (torch's (out, in) / OIHW), so the units
      are the same neurons. Pass `axis=0` for optax's default on a 2-D leaf.

    Examples:
        >>> import torch, purestep.core as ps
        >>> t = ps.adaptive_clip(0.1)
        >>> p, g = {"w": torch.ones(2, 2)}, {"w": torch.tensor([[3.0, 4.0], [0.01, 0.0]])}
        >>> t.update(g, t.init(p), p)[0]["w"]
        tensor([[0.0849, 0.1131],
                [0.0100, 0.0000]])

    References:
        Brock et al., High-Performance Large-Scale Image Recognition Without Normalization, 2021.
    """
    if not is_static(clipping) or not clipping > 0:
        raise ValueError(f"clipping must be a float > 0, got {clipping!r}")
    if not is_static(eps) or not eps >= 0:
        raise ValueError(f"eps must be a float >= 0, got {eps!r}")

    def init(params: Params) -> EmptyState:
        return EmptyState()

    def update(grads, state, params=None, **extra):
        ps_ = tr.params_for(params, grads, "adaptive_clip")
        gs, spec = pytree.tree_flatten(grads)
        flags, shapes = lay.stacked(grads), lay.global_shapes(grads)
        dims = [_unit_dims(torch.empty(shape, device="meta"), axis) for shape in shapes]
        if any(d is not None and 0 in d for d in dims) and lay.is_sharded(grads):
            raise ValueError("adaptive_clip: an axis that reduces over dim 0 needs whole leaves; FSDP2 shards dim 0")
        # Units that are whole leaves (scalars, vectors): leaf norms, across ranks over shards.
        whole = [d is None for d in dims]
        g_whole, p_whole = lay.leaf_norms(grads, gs, ps_) if any(whole) else (None, None)
        out = []
        for i, (g, p, stack) in enumerate(zip(gs, ps_, flags)):
            if whole[i]:
                g_norm, p_norm = g_whole[i].expand(g.shape), p_whole[i].expand(p.shape)
            else:
                g_norm, p_norm = _unit_norm(g, dims[i], stack), _unit_norm(p, dims[i], stack)
            max_norm = clipping * torch.clamp(p_norm.to(g_norm.dtype), min=eps)
            clipped = g * (max_norm / torch.clamp(g_norm, min=1e-6))
            out.append(torch.where(g_norm < max_norm, g, clipped).to(g.dtype))
        return pytree.tree_unflatten(out, spec), state

    return with_needs(Transform(init, update), Needs(whole_leaves=True, reductions=("leaf_norms",)))


class ClipByRunningNormState(NamedTuple):
    """State of `clip_by_running_norm`: the EMA of past global norms."""

    count: Tensor  # type: ignore[assignment]  # (), int64: updates seen
    mu: Tensor  # (), float32/64: EMA of past post-clip global norms (not bias-corrected)
    norm: Tensor  # (), float32/64: this step's pre-clip global norm


def clip_by_running_norm(factor: float = 2.0, beta: float = 0.99, warmup_steps: int = 100) -> Transform:
    """Clip the global norm to `factor` × a running average of past global norms (a dynamic threshold).

    With c = updates already seen, n = ‖g‖ (global 2-norm) and m the EMA state:
    during the first `warmup_steps` updates nothing is clipped; afterwards
    τ = factor · m/(1 - βᶜ) (the bias-corrected mean of past norms) and
    g ← g · min(1, τ/(n + 1e-6)), as `clip_grad_norm_(max_norm=τ)`. Then
    m ← β·m + (1 - β)·n·coef: the average follows the *clipped* norm, so a spike
    does not raise the threshold it is judged by.

    Args:
      factor: how far above the running norm a step may go (> 0).
      beta: β, the EMA decay of the running norm, in (0, 1).
      warmup_steps: updates that only feed the average (>= 1).

    Warning:
      A non-finite grad poisons the average; wrap the optimizer in
      `apply_if_finite` so such steps leave the state unchanged.

    Examples:
        >>> import torch, purestep.core as ps
        >>> t = ps.clip_by_running_norm(factor=2.0, beta=0.5, warmup_steps=1)
        >>> s = t.init({"w": torch.zeros(1)})
        >>> _, s = t.update({"w": torch.ones(1)}, s)  # warmup: the mean norm becomes 1
        >>> u, s = t.update({"w": torch.full((1,), 10.0)}, s)
        >>> u["w"], s.norm
        (tensor([2.0000]), tensor(10.))
    """
    check_positive("factor", factor)
    if not is_static(factor):
        raise ValueError(f"factor must be a float > 0, got {factor!r}")
    if not is_static(beta) or not 0.0 < beta < 1.0:
        raise ValueError(f"beta must be a float in (0, 1), got {beta!r}")
    check_int("warmup_steps", warmup_steps, 1, why="the average needs one norm")

    def init(params: Params) -> ClipByRunningNormState:
        leaves = pytree.tree_leaves(params)
        z = _zero_norm(leaves)
        return ClipByRunningNormState(zero_count(leaf_device(leaves)), z, z.clone())

    def update(grads, state, params=None, **extra):
        gs, spec = pytree.tree_flatten(grads)
        norm = lay.global_norm(grads).to(state.mu.dtype)
        c = state.count.to(torch.float64)
        # τ = factor · m / (1 - βᶜ); c >= warmup_steps >= 1 wherever it is used
        debias = torch.clamp(1.0 - beta**c, min=1.0 - beta)
        threshold = (factor * state.mu.to(torch.float64) / debias).to(norm.dtype)
        coef = torch.clamp(threshold / (norm + _NORM_EPS), max=1.0)
        coef = torch.where(state.count >= warmup_steps, coef, torch.ones_like(coef))
        out = ls.cast_like(ls.mul(gs, coef), gs)
        mu = beta * state.mu + (1.0 - beta) * (norm * coef)
        return pytree.tree_unflatten(out, spec), ClipByRunningNormState(state.count + 1, mu, norm)

    return with_needs(Transform(init, update), Needs(reductions=("global_norm",)))
