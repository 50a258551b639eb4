"""Building blocks that rescale updates: scale, scale_by_lr, trace, scale_by_adam, ...

The update rules are written once, on the optimizer aliases in `_alias.py`.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.utils._pytree as pytree
from torch import Tensor

from .engine import ops as lay
from . import _low_precision as lp
from . import _adam as adam
from . import _foreach as ls
from . import _tree as tr
from ._base import (
    schedule_clock,
    EmptyState,
    Params,
    ScalarOrSchedule,
    Transform,
    check_betas,
    check_hyperparam,
    check_nonnegative,
    check_positive,
    leaf_device,
    resolve,
    with_in_place,
    zero_count,
)
from .engine.needs import Needs, with_needs


def scale(factor: float | Tensor) -> Transform:
    """Multiply updates by a constant `factor`.

    Examples:
        >>> import torch, purestep.core as ps
        >>> t = ps.scale(-2.0)
        >>> t.update({"w": torch.ones(1)}, t.init({"w": torch.ones(1)}))[0]
        {'w': tensor([-2.])}
    """
    check_hyperparam("factor", factor)
    if callable(factor):
        raise ValueError("factor must be a constant; use scale_by_lr for a schedule")

    def init(params: Params) -> EmptyState:
        return EmptyState()

    def affine(state):
        return factor, 0.0, state  # x·u + y·p (see `Transform`): `chain` folds it into an in-place apply

    def update(grads, state, params=None, **extra):
        leaves, spec = pytree.tree_flatten(grads)
        return pytree.tree_unflatten(ls.cast_like(ls.mul(leaves, factor), leaves), spec), state

    return with_needs(Transform(init, with_in_place(update, affine=affine)), Needs(bounded=True))


@schedule_clock
class ScaleByLrState(NamedTuple):
    """State of `scale_by_lr` with a scheduled lr."""

    count: Tensor  # type: ignore[assignment]  # (), int64: updates applied, the schedule's step


def scale_by_lr(lr: ScalarOrSchedule) -> Transform:
    """Multiply updates by `-lr`; `lr` is a float, a 0-d tensor or a schedule.

    A schedule is evaluated at the number of updates already applied.

    Examples:
        >>> import torch, purestep.core as ps
        >>> t = ps.scale_by_lr(lambda step: 0.1 * (step + 1))
        >>> p = {"w": torch.ones(1)}
        >>> u, s = t.update(p, t.init(p))
        >>> u, s = t.update(p, s)
        >>> u
        {'w': tensor([-0.2000])}
    """
    check_hyperparam("lr", lr)
    check_nonnegative("lr", lr)

    def init(params: Params) -> EmptyState | ScaleByLrState:
        if callable(lr):
            return ScaleByLrState(zero_count(leaf_device(pytree.tree_leaves(params))))
        return EmptyState()

    def affine(state):
        # -η·u as x·u + y·p (see `Transform`): `chain` folds it into an in-place apply.
        if callable(lr):
            return -resolve(lr, state.count), 0.0, ScaleByLrState(state.count + 1)
        return -lr, 0.0, state

    def update(grads, state, params=None, **extra):
        leaves, spec = pytree.tree_flatten(grads)
        x, _, state = affine(state)
        return pytree.tree_unflatten(ls.cast_like(ls.mul(leaves, x), leaves), spec), state

    return with_needs(Transform(init, with_in_place(update, affine=affine)), Needs(bounded=True))


class TraceState(NamedTuple):
    """State of `trace`: the momentum buffer."""

    count: Tensor  # type: ignore[assignment]  # (), int64
    trace: Params


def trace(
    decay: ScalarOrSchedule,
    nesterov: bool = False,
    *,
    dampening: float | Tensor = 0.0,
    accumulator_dtype: torch.dtype | None = None,
    rounding: str = "stochastic",
) -> Transform:
    """Momentum: `t ← decay·t + (1 - dampening)·g`, update `t` (or `g + decay·t` with nesterov).

    As in `torch.optim.SGD`, the first step sets `t ← g` without dampening.
    With `dampening=0` this is `optax.trace`.

    Args:
      accumulator_dtype: the dtype `t` is stored in (optax's name); None keeps the
        param's (float32 for float16 params); an fp8 dtype stores it 8-bit
        block-quantized. The math runs in float32 (or the grads' dtype where wider).
      rounding: how `t` is rounded into a narrower dtype: "stochastic" (unbiased, keyed
        by the step count) or "nearest".
    """
    check_hyperparam("decay", decay)
    check_nonnegative("decay", decay)
    check_nonnegative("dampening", dampening)
    lp.check_stored("accumulator_dtype", accumulator_dtype, rounding)

    def init(params: Params) -> TraceState:
        leaves = pytree.tree_leaves(params)
        return TraceState(zero_count(leaf_device(leaves)), lp.init_moments(params, accumulator_dtype))

    def update(grads, state, params=None, **extra):
        gs, wide, ts = lp.load_moments(grads, state.trace, params)
        spec = pytree.tree_structure(grads)
        m = resolve(decay, state.count)
        if isinstance(dampening, Tensor) or dampening != 0:
            # torch.optim.SGD: the first buffer is the grad itself, undamped; with momentum
            # 0 (an injected or scheduled one) there is no buffer: the update is g.
            first = (state.count == 0) | (torch.as_tensor(m) == 0)
            first = first.to(torch.float64)
            g_coef = first + (1.0 - first) * (1.0 - dampening)
            new = ls.lincomb(m, ts, g_coef, wide)
        else:
            new = ls.axpy(m, ts, wide)
        new = ls.cast_like(new, wide)
        out = ls.cast_like(ls.axpy(m, new, wide) if nesterov else new, gs)
        stored = lp.store_moments(new, state.trace, lp.moment_keys(state.count, rounding, state.trace))
        return pytree.tree_unflatten(out, spec), TraceState(state.count + 1, stored)

    return with_needs(
        Transform(init, update),
        Needs(flat=lp.unpackable(accumulator_dtype), bounded=accumulator_dtype != torch.float16),
    )


class ScaleByAdamState(NamedTuple):
    """State of `scale_by_adam`: first and second moments."""

    count: Tensor  # type: ignore[assignment]  # (), int64
    mu: Params
    nu: Params


class ScaleByAmsgradState(NamedTuple):
    """State of `scale_by_adam(amsgrad=True)`: the moments and the running max of ν."""

    count: Tensor  # type: ignore[assignment]  # (), int64
    mu: Params
    nu: Params
    nu_max: Params  # max over steps of ν (torch.optim.Adam's max_exp_avg_sq)


def scale_by_adam(
    b1: ScalarOrSchedule = 0.9,
    b2: ScalarOrSchedule = 0.999,
    eps: float = 1e-8,
    *,
    eps_root: float = 0.0,
    amsgrad: bool = False,
    mu_dtype: torch.dtype | None = None,
    nu_dtype: torch.dtype | None = None,
    rounding: str = "stochastic",
) -> Transform:
    """Adam's preconditioner, `m̂ / (√(v̂ + eps_root) + eps)`; see `adam` for the rule and
    for `mu_dtype`, `nu_dtype` and `rounding` (ν_max is stored like ν).

    With `amsgrad`, v̂ is built from ν_max ← max(ν_max, ν), the running max of the raw
    second moment, bias-corrected afterwards, as `torch.optim.Adam(amsgrad=True)` does
    (the state is then a `ScaleByAmsgradState`).

    Warning:
        `optax.scale_by_amsgrad` takes the max of the bias-corrected moment instead; the
        two differ while the bias correction still changes.
    """
    check_betas((b1, b2), "betas")
    check_hyperparam("eps", eps)
    check_positive("eps", eps)
    check_nonnegative("eps_root", eps_root)
    lp.check_moments(mu_dtype, nu_dtype, rounding)

    def init(params: Params) -> ScaleByAdamState | ScaleByAmsgradState:
        leaves = pytree.tree_leaves(params)
        mu, nu = lp.init_moments(params, mu_dtype), lp.init_moments(params, nu_dtype)
        if amsgrad:
            return ScaleByAmsgradState(zero_count(leaf_device(leaves)), mu, nu, lp.init_moments(params, nu_dtype))
        return ScaleByAdamState(zero_count(leaf_device(leaves)), mu, nu)

    def update(grads, state, params=None, **extra):
        beta1, beta2 = resolve(b1, state.count), resolve(b2, state.count)
        bc1, bc2 = adam.bias_corrections(state.count, beta1, beta2)
        plain = None if amsgrad or eps_root else _plain_moments(grads, state.mu, state.nu, params)
        if adam.kernel(plain, beta1, beta2, eps) == "leafwise":
            gs, mu, nu, _ = plain
            spec = pytree.tree_structure(grads)
            mu, nu, out = adam.IMPLEMENTATIONS["leafwise"](gs, mu, nu, beta1, beta2, bc1, bc2, eps)
            mu, nu = pytree.tree_unflatten(mu, spec), pytree.tree_unflatten(nu, spec)
            return pytree.tree_unflatten(out, spec), ScaleByAdamState(state.count + 1, mu, nu)
        gs, wide, mu = lp.load_moments(grads, state.mu, params)
        nu = lp.load_moments(grads, state.nu, second=True)[2]
        spec = pytree.tree_structure(grads)
        nu_max = state.nu_max if amsgrad else None
        mu, nu, out = adam.IMPLEMENTATIONS["definition"](
            grads, gs, wide, mu, nu, beta1, beta2, bc1, bc2, eps, eps_root, nu_max
        )
        keys = lp.moment_keys(state.count, rounding, state.mu, state.nu)  # ν_max is stored like ν
        new_state = ScaleByAdamState(
            state.count + 1, lp.store_moments(mu, state.mu, keys), lp.store_moments(nu, state.nu, keys, second=True)
        )
        if amsgrad:
            new_state = ScaleByAmsgradState(*new_state, lp.store_moments(out[1], state.nu_max, keys, second=True))
            out = out[0]
        return pytree.tree_unflatten(out, spec), new_state

    def apply_(grads, state, params, a=1.0, b=1.0):
        # The in-place form (`with_in_place`): eager CPU with plain moments runs AdamW's
        # whole step, μ and ν updated in their own storage: torch's fused kernel, else its
        # foreach step a cache block of leaves at a time; anything else is `update`
        # followed by the apply.
        plain = None if amsgrad or eps_root else _plain_moments(grads, state.mu, state.nu, params)
        beta1, beta2 = resolve(b1, state.count), resolve(b2, state.count)
        t = (state.count + 1).to(torch.float64)  # eager: no `once` to realize
        name = adam.kernel(plain, beta1, beta2, eps, a, b, t=t)
        if name == "definition":
            updates, new_state = update(grads, state, params)
            ls.scale_add_(
                tr.check_match(params, updates, "params", "updates", dtype=False), a, b, tr.tree_leaves(updates)
            )
            return new_state
        if name == "apply_fused":
            adam.IMPLEMENTATIONS[name](*plain, beta1, beta2, t, eps, a, b)
        else:
            adam.IMPLEMENTATIONS[name](*plain, beta1, beta2, 1.0 - beta1**t, 1.0 - beta2**t, eps, a, b)
        return ScaleByAdamState(state.count + 1, state.mu, state.nu)

    return with_needs(
        Transform(init, with_in_place(update, apply_=apply_)),
        Needs(flat=lp.unpackable(mu_dtype, nu_dtype), bounded=torch.float16 not in (mu_dtype, nu_dtype)),
    )


def _plain_moments(grads, mu, nu, params):
    """`(grads, μ, ν, params)` as leaf lists when they match leaf for leaf with nothing to
    convert: plain float32 or float64 tensors, one dtype and shape per leaf. Else None, and
    the caller takes the general path (`lp.load_moments`, which names a mismatch). A few
    flattens instead of the general path's dozen: per-leaf overhead, not math.
    """
    trees = (grads, mu, nu, grads if params is None else params)
    lists = tr.dict_leaves(*trees)
    if lists is None:
        flat = [pytree.tree_flatten(t) for t in trees]
        if any(spec != flat[0][1] for _, spec in flat):
            return None
        lists = [leaves for leaves, _ in flat]
    gs, ms, vs, ps_ = lists
    if not gs:
        return None
    for g, m, v, p in zip(gs, ms, vs, ps_):
        if not (type(g) is Tensor and type(m) is Tensor and type(v) is Tensor and isinstance(p, Tensor)):
            return None
        if g.dtype not in (torch.float32, torch.float64) or not g.dtype == m.dtype == v.dtype == p.dtype:
            return None
        if not g.shape == m.shape == v.shape == p.shape:
            return None
    return gs, ms, vs, ps_


class ScaleByLionState(NamedTuple):
    """State of `scale_by_lion`: the momentum."""

    count: Tensor  # type: ignore[assignment]  # (), int64
    mu: Params


def scale_by_lion(
    b1: ScalarOrSchedule = 0.9,
    b2: ScalarOrSchedule = 0.99,
    *,
    mu_dtype: torch.dtype | None = None,
    rounding: str = "stochastic",
) -> Transform:
    """Lion's sign update, `sign(β₁·m + (1-β₁)·g)`; see `lion` for the rule, `adam` for
    `mu_dtype` and `rounding`."""
    check_betas((b1, b2), "betas")
    lp.check_stored("mu_dtype", mu_dtype, rounding)

    def init(params: Params) -> ScaleByLionState:
        leaves = pytree.tree_leaves(params)
        return ScaleByLionState(zero_count(leaf_device(leaves)), lp.init_moments(params, mu_dtype))

    def update(grads, state, params=None, **extra):
        gs, wide, mu = lp.load_moments(grads, state.mu, params)
        spec = pytree.tree_structure(grads)
        beta1, beta2 = resolve(b1, state.count), resolve(b2, state.count)
        out = ls.cast_like(ls.sign(ls.ema(mu, wide, beta1)), gs)
        mu = ls.cast_like(ls.ema(mu, wide, beta2), wide)
        stored = lp.store_moments(mu, state.mu, lp.moment_keys(state.count, rounding, state.mu))
        return pytree.tree_unflatten(out, spec), ScaleByLionState(state.count + 1, stored)

    return with_needs(Transform(init, update), Needs(flat=lp.unpackable(mu_dtype), bounded=mu_dtype != torch.float16))


def scale_by_trust_ratio(*, min_norm: float = 0.0, trust_coefficient: float = 1.0, eps: float = 0.0) -> Transform:
    """Layer-wise trust ratio, `u · c·‖p‖ / (‖u‖ + eps)` (1 where either norm is 0), = `optax.scale_by_trust_ratio`."""
    check_nonnegative("min_norm", min_norm)
    check_nonnegative("trust_coefficient", trust_coefficient)
    check_nonnegative("eps", eps)

    def init(params: Params) -> EmptyState:
        return EmptyState()

    def update(grads, state, params=None, **extra):
        ps_ = tr.params_for(params, grads, "scale_by_trust_ratio")
        us, spec = pytree.tree_flatten(grads)
        p_norms, u_norms = lay.leaf_norms(grads, ps_, us)  # over shards: whole leaves' norms, one collective
        p_norm = [torch.clamp(n, min=min_norm) for n in p_norms]
        u_norm = [torch.clamp(n, min=min_norm) for n in u_norms]
        ratios = [
            torch.where((pn == 0) | (un == 0), torch.ones_like(pn), trust_coefficient * pn / (un + eps))
            for pn, un in zip(p_norm, u_norm)
        ]
        out = [u * r.to(u.dtype) for u, r in zip(us, ratios)]
        return pytree.tree_unflatten(out, spec), state

    # Per-leaf norms: same-shape leaves stacked.
    return with_needs(Transform(init, update), Needs(whole_leaves=True, reductions=("leaf_norms",)))
