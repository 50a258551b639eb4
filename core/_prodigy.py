"""Prodigy: Adam whose step size is learned, an estimate of the distance to the solution."""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.utils._pytree as pytree
from torch import Tensor

from .engine import ops as lay
from . import _adam as adam
from . import _foreach as ls
from . import _low_precision as lp
from . import _tree as tr
from ._base import (
    check_bool,
    Params,
    ScalarOrSchedule,
    Transform,
    as_float64,
    check_beta,
    check_hyperparam,
    check_lr,
    check_nonnegative,
    check_positive,
    is_zero,
    leaf_device,
    require_params,
    resolve,
    zero_count,
)
from .engine.needs import Needs, with_needs


class ProdigyState(NamedTuple):
    """State of `prodigy` (optax.contrib's field names)."""

    exp_avg: Params  # m, EMA (β₁) of d·g
    exp_avg_sq: Params  # v, EMA (β₂) of (d·g)²
    grad_sum: Params  # s, the β₃-discounted sum of (d·η̂/d₀)·d·g
    params0: Params  # x₀, the params at init
    estim_lr: Tensor  # (), float64: d, the step-size estimate (starts at d0, never decreases)
    numerator_weighted: Tensor  # (), float64: r, the β₃-discounted Σ (d/d₀)·η̂·⟨g, x₀ - x⟩
    count: Tensor  # type: ignore[assignment]  # (), int64


def prodigy(
    lr: ScalarOrSchedule = 1.0,
    b1: ScalarOrSchedule = 0.9,
    b2: ScalarOrSchedule = 0.999,
    beta3: ScalarOrSchedule | None = None,
    eps: float = 1e-8,
    d0: float = 1e-6,
    d_coef: float = 1.0,
    weight_decay: ScalarOrSchedule = 0.0,
    safeguard_warmup: bool = False,
) -> Transform:
    """Prodigy, = `optax.contrib.prodigy(estim_lr0=d0, estim_lr_coef=d_coef)`: Adam with a
    learned step size d, the D-Adaptation estimate of ‖x₀ - x*‖ made faster.

    With t the step from 1, η̂ = d·η·√(1-β₂ᵗ)/(1-β₁ᵗ) and x₀ the params at init:

        m ← β₁·m + (1-β₁)·d·g;   v ← β₂·v + (1-β₂)·(d·g)²
        s ← β₃·s + (η̂/d₀)·d·g  (d/d₀·d·g with `safeguard_warmup`)
        r ← β₃·r + (d/d₀)·η̂·⟨g, x₀ - x⟩            ⟨·,·⟩ over the whole tree
        d ← max(d, d_coef · r / ‖s‖₁)              ‖s‖₁ over the whole tree
        x ← x - η̂·λ·x - η̂ · m / (√v + d·ε)

    with η = `lr` (a multiplier of d: 1 unless scheduled), (β₁, β₂) = (`b1`, `b2`),
    β₃ = `beta3` (√β₂ when None), ε = `eps`, d₀ = `d0`, λ = `weight_decay` (decoupled,
    scaled by η̂). d starts at d₀ and never decreases; the m/v step uses the old d, ε the new.

    Args:
      lr: η, a float or a schedule (warmup and cosine are still useful: d sets the scale).
      b1, b2, beta3: the EMAs' decays; floats or schedules.
      d0: the initial estimate d₀ (optax's `estim_lr0`): small, it only has to undershoot.
      d_coef: multiplies the estimate (optax's `estim_lr_coef`): < 1 for a smaller step.
      safeguard_warmup: leave η out of s (for schedules with a warmup).

    Warning:
        ⟨g, x₀ - x⟩ and ‖s‖₁ are sums over every leaf: under FSDP2 they are summed across
        ranks (one collective), so d is the same on every rank and equals one process's.
        Where ‖s‖₁ = 0 (every grad zero so far) d is kept, where optax's would be NaN.

    Examples:
        >>> import torch, purestep.core as ps
        >>> opt = ps.prodigy()
        >>> params = {"w": torch.ones(2)}
        >>> u, state = opt.update({"w": torch.ones(2)}, opt.init(params), params)
        >>> float(state.estim_lr)  # x = x₀ at the first step: d stays d₀
        1e-06

    References:
        Mishchenko and Defazio, Prodigy: An Expeditiously Adaptive Parameter-Free Learner, ICML 2024.
    """
    check_lr(lr)
    for name, beta in (("b1", b1), ("b2", b2), ("beta3", beta3)):
        if beta is not None:
            check_hyperparam(name, beta)
            check_beta(name, beta)
    for name, value in (("eps", eps), ("d0", d0), ("d_coef", d_coef)):
        check_hyperparam(name, value)
        check_positive(name, value)
    check_hyperparam("weight_decay", weight_decay)
    check_nonnegative("weight_decay", weight_decay)
    check_bool("safeguard_warmup", safeguard_warmup)

    def init(params: Params) -> ProdigyState:
        leaves = pytree.tree_leaves(params)
        device = leaf_device(leaves)
        zeros = lambda: lp.init_moments(params, None)  # noqa: E731  (float32 for float16 params)
        x0 = pytree.tree_map(lambda p: p.detach().clone(), params)
        d = as_float64(d0, device).clone()  # an injected d0 is a state tensor of its own
        r = torch.zeros((), dtype=torch.float64, device=device)
        return ProdigyState(zeros(), zeros(), zeros(), x0, d, r, zero_count(device))

    def update(grads, state, params=None, **extra):
        require_params(params, "prodigy")
        spec = pytree.tree_structure(grads)
        gs, wide, ms = lp.load_moments(grads, state.exp_avg, params)  # math in float32 at least
        vs = lp.load_moments(grads, state.exp_avg_sq)[2]
        ss = lp.load_moments(grads, state.grad_sum)[2]
        xs = [x.to(w.dtype) for x, w in zip(tr.check_match(params, grads, "params", "grads"), wide)]
        x0s = [x.to(w.dtype) for x, w in zip(pytree.tree_leaves(state.params0), wide)]
        beta1, beta2 = resolve(b1, state.count), resolve(b2, state.count)
        beta_3 = beta2**0.5 if beta3 is None else resolve(beta3, state.count)
        # Scalars: 0-d float64, once per step.
        t = (state.count + 1).to(torch.float64)
        d = state.estim_lr
        dlr = d * resolve(lr, state.count) * torch.sqrt(1.0 - beta2**t) / (1.0 - beta1**t)  # η̂
        dgs = ls.cast_like(ls.mul(wide, d), wide)  # d·g (a 0-d d may promote a 0-d leaf)
        ms = ls.cast_like(ls.ema(ms, dgs, beta1), wide)
        vs = ls.cast_like(ls.ema_sq(vs, dgs, beta2), wide)
        ss = ls.cast_like(ls.lincomb(beta_3, ss, (d if safeguard_warmup else dlr) / d0, dgs), wide)
        (inner,) = lay.global_sums(grads, [g * (x0 - x) for g, x0, x in zip(wide, x0s, xs)])  # ⟨g, x₀ - x⟩
        r = beta_3 * state.numerator_weighted + (d / d0) * dlr * inner.to(torch.float64)
        (s_norm,) = lay.global_sums(grads, [torch.abs(s) for s in ss])
        s_norm = s_norm.to(torch.float64)
        estimate = d_coef * r / torch.where(s_norm > 0, s_norm, 1.0)
        d_new = torch.where(s_norm > 0, torch.maximum(d, estimate), d)
        # u = -η̂·λ·x - η̂·m / (√v + d'·ε)
        out = ls.mul_(
            ls.div_into_(list(ms), adam.denominator(list(vs), 1.0, d_new * eps)), -dlr
        )  # Adam's, no bias correction
        wd = resolve(weight_decay, state.count)
        if not is_zero(wd):
            out = ls.axpy(-dlr * wd, xs, out)
        unflat = lambda leaves, like: pytree.tree_unflatten(ls.cast_like(leaves, pytree.tree_leaves(like)), spec)  # noqa: E731
        new_state = ProdigyState(
            unflat(ms, state.exp_avg),
            unflat(vs, state.exp_avg_sq),
            unflat(ss, state.grad_sum),
            state.params0,
            d_new,
            r,
            state.count + 1,
        )
        return pytree.tree_unflatten(ls.cast_like(out, gs), spec), new_state

    return with_needs(Transform(init, update), Needs(reductions=("global_sums",)))
