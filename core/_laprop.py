"""LaProp: momentum over the normalized gradient (block and alias)."""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
import torch.utils._pytree as pytree
from torch import Tensor

from . import _adam as adam
from . import _foreach as ls
from . import _low_precision as lp
from . import _tree as tr
from ._base import (
    EmptyState,
    Params,
    ScalarOrSchedule,
    Transform,
    check_beta,
    check_hyperparam,
    check_nonnegative,
    check_positive,
    is_zero,
    leaf_device,
    resolve,
    zero_count,
)
from ._combine import chain, identity, masked
from ._blocks import scale_by_lr
from .engine.needs import Needs, with_needs


class ScaleByLapropState(NamedTuple):
    """State of `scale_by_laprop`: the momentum of lr-weighted normalized gradients and its weight."""

    count: Tensor  # type: ignore[assignment]  # (), int64
    mu: Params  # m, EMA (β₁) of η·g/(√ν̂ + ε): it carries the lr of each step
    nu: Params  # ν, EMA (β₂) of g²
    lr_sum: Tensor  # (), float64: EMA (β₁) of η, m's bias correction (= η·(1-β₁ᵗ) at a constant lr)


class DecayAfterState(NamedTuple):
    """State of LaProp's decay after the step, when its lr or weight decay is a schedule."""

    count: Tensor  # type: ignore[assignment]  # (), int64


def scale_by_laprop(
    lr: ScalarOrSchedule = 1.0,
    b1: ScalarOrSchedule = 0.9,
    b2: ScalarOrSchedule = 0.999,
    eps: float = 1e-15,
    *,
    mu_dtype: torch.dtype | None = None,
    nu_dtype: torch.dtype | None = None,
    rounding: str = "stochastic",
) -> Transform:
    """LaProp's direction m / Σ, the bias-corrected momentum of normalized gradients; see
    `laprop` for the rule, `adam` for `mu_dtype`, `nu_dtype` and `rounding`.

    `lr` weights each step's normalized gradient in the momentum (the direction itself is
    lr-free: scale it with `scale_by_lr(lr)` after, as `laprop` does); a constant lr cancels.
    """
    check_hyperparam("lr", lr)
    check_nonnegative("lr", lr)
    for name, beta in (("b1", b1), ("b2", b2)):
        check_hyperparam(name, beta)
        check_beta(name, beta)
    check_hyperparam("eps", eps)
    check_positive("eps", eps)
    lp.check_moments(mu_dtype, nu_dtype, rounding)

    def init(params: Params) -> ScaleByLapropState:
        device = leaf_device(pytree.tree_leaves(params))
        zero = torch.zeros((), dtype=torch.float64, device=device)
        return ScaleByLapropState(
            zero_count(device), lp.init_moments(params, mu_dtype), lp.init_moments(params, nu_dtype), zero
        )

    def update(grads, state, params=None, **extra):
        beta1, beta2 = resolve(b1, state.count), resolve(b2, state.count)
        eta = resolve(lr, state.count)
        gs, wide, mu = lp.load_moments(grads, state.mu, params)
        nu = lp.load_moments(grads, state.nu, second=True)[2]
        spec = pytree.tree_structure(grads)
        t = (state.count + 1).to(torch.float64)
        bc2 = 1.0 - beta2**t
        # ν ← β₂·ν + (1-β₂)·g²;  m ← β₁·m + (1-β₁)·η·g/(√(ν/bc2) + ε);  Σ ← β₁·Σ + (1-β₁)·η
        nu = ls.cast_like(ls.ema_sq(nu, wide, beta2), wide)
        normalized = ls.cast_like(
            ls.mul_(ls.div_into_(wide, adam.denominator(nu, bc2, eps)), eta), wide
        )  # a 0-d η may promote a 0-d leaf
        mu = ls.cast_like(ls.ema(mu, normalized, beta1), wide)
        lr_sum = beta1 * state.lr_sum + (1.0 - beta1) * eta
        # u = m / Σ (0 while every lr so far was 0: m is 0 then too)
        inv = torch.where(lr_sum > 0, 1.0 / torch.where(lr_sum > 0, lr_sum, 1.0), 0.0)
        out = ls.cast_like(ls.mul(mu, inv), gs)
        keys = lp.moment_keys(state.count, rounding, state.mu, state.nu)
        new_state = ScaleByLapropState(
            state.count + 1,
            lp.store_moments(mu, state.mu, keys),
            lp.store_moments(nu, state.nu, keys, second=True),
            lr_sum,
        )
        return pytree.tree_unflatten(out, spec), new_state

    return with_needs(Transform(init, update), Needs(flat=lp.unpackable(mu_dtype, nu_dtype)))


def _decay_after(lr: ScalarOrSchedule, weight_decay: ScalarOrSchedule) -> Transform:
    """u ← u - η·λ·(p + u): p ← (p + u)·(1 - η·λ), the decay applied to the stepped params."""
    scheduled = callable(lr) or callable(weight_decay)

    def init(params: Params) -> EmptyState | DecayAfterState:
        return DecayAfterState(zero_count(leaf_device(pytree.tree_leaves(params)))) if scheduled else EmptyState()

    def update(grads, state, params=None, **extra):
        ps_ = tr.params_for(params, grads, "laprop's weight decay")
        us, spec = pytree.tree_flatten(grads)
        count = state.count if scheduled else None
        shrink = resolve(lr, count) * resolve(weight_decay, count)
        out = ls.cast_like(ls.axpy(-shrink, ls.add(ps_, us), us), us)
        return pytree.tree_unflatten(out, spec), (DecayAfterState(state.count + 1) if scheduled else state)

    return with_needs(Transform(init, update), Needs())


def laprop(
    lr: ScalarOrSchedule,
    b1: ScalarOrSchedule = 0.9,
    b2: ScalarOrSchedule = 0.999,
    eps: float = 1e-15,
    weight_decay: ScalarOrSchedule = 0.0,
    *,
    mask: Any = None,
    mu_dtype: torch.dtype | None = None,
    nu_dtype: torch.dtype | None = None,
    rounding: str = "stochastic",
) -> Transform:
    """LaProp (Ziyin et al. 2020): Adam with the normalization before the momentum, so
    momentum and adaptivity are decoupled (any β₁ < 1 with any β₂ is stable).

    ν ← β₂·ν + (1-β₂)·g²;  m ← β₁·m + (1-β₁)·η·g/(√ν̂ + ε);  Σ ← β₁·Σ + (1-β₁)·η;
    p ← (p - η·m/Σ)·(1 - η·λ),
    with η = `lr` (η_t at step t), (β₁, β₂) = (`b1`, `b2`), ε = `eps`, λ = `weight_decay`,
    ν̂ = ν/(1-β₂ᵗ). Σ is m's bias correction weighted by each step's lr, so a schedule is
    exact (= η·(1-β₁ᵗ) at a constant lr, Adam's correction). The decay, decoupled and times
    η, is applied after the step (as pytorch_optimizer's and timm's LaProp).

    Args:
      eps: ε, 1e-15 as the paper's code and pytorch_optimizer.
      mask: where to decay: a bool pytree like params or `callable(params)`.
      mu_dtype, nu_dtype, rounding: how m and ν are stored; see `adam`.

    Warning:
        pytorch_optimizer's `LaProp(centered=False)` adds ε to √ν before the bias
        correction, g / ((√ν + ε)/√(1-β₂ᵗ)); here ε is added after it, as Adam's.

    Examples:
        >>> import torch, purestep.core as ps
        >>> opt = ps.laprop(lr=0.1)
        >>> params = {"w": torch.ones(2)}
        >>> u, _ = opt.update({"w": torch.full((2,), 3.0)}, opt.init(params), params)
        >>> u["w"]
        tensor([-0.1000, -0.1000])

    References:
        Ziyin, Wang and Ueda, LaProp: Separating Momentum and Adaptivity in Adam, 2020.
    """
    check_hyperparam("weight_decay", weight_decay)
    check_nonnegative("weight_decay", weight_decay)
    block = scale_by_laprop(lr, b1, b2, eps, mu_dtype=mu_dtype, nu_dtype=nu_dtype, rounding=rounding)
    if is_zero(weight_decay):
        decay = identity()  # left out, the state layout kept
    else:
        decay = _decay_after(lr, weight_decay) if mask is None else masked(_decay_after(lr, weight_decay), mask)
    return chain(block, scale_by_lr(lr), decay)
