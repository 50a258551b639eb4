"""AdEMAMix: Adam with a second, slow EMA of the gradient mixed in (block and alias)."""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
import torch.utils._pytree as pytree
from torch import Tensor

from . import _adam as adam
from . import _foreach as ls
from . import _low_precision as lp
from ._base import (
    Params,
    ScalarOrSchedule,
    Transform,
    check_beta,
    check_hyperparam,
    check_lr,
    check_nonnegative,
    check_positive,
    leaf_device,
    resolve,
    zero_count,
)
from ._combine import chain
from ._weight_decay import decayed
from ._blocks import scale_by_lr
from .engine.needs import Needs, with_needs

_SLOW_SALT = 1  # stochastic rounding of m₂ draws bits apart from m₁'s and ν's


class ScaleByAdemamixState(NamedTuple):
    """State of `scale_by_ademamix`: the fast and slow EMAs of the gradient and the second moment."""

    count: Tensor  # type: ignore[assignment]  # (), int64: updates applied; schedules of b3 and alpha see it
    m1: Params  # fast EMA (β₁), bias-corrected when used
    m2: Params  # slow EMA (β₃), never bias-corrected
    nu: Params  # EMA of g² (β₂), bias-corrected when used


def scale_by_ademamix(
    b1: ScalarOrSchedule = 0.9,
    b2: ScalarOrSchedule = 0.999,
    b3: ScalarOrSchedule = 0.9999,
    alpha: ScalarOrSchedule = 6.0,
    eps: float = 1e-8,
    *,
    eps_root: float = 0.0,
    mu_dtype: torch.dtype | None = None,
    nu_dtype: torch.dtype | None = None,
    rounding: str = "stochastic",
) -> Transform:
    """AdEMAMix's preconditioner, `(m̂₁ + α·m₂) / (√(ν̂ + eps_root) + eps)`; see `ademamix`
    for the rule, = `optax.contrib.scale_by_ademamix`.

    Args:
      b1, b2, b3: decays of the fast EMA, the second moment and the slow EMA; floats or
        schedules (optax takes schedules for b3 only).
      alpha: the slow EMA's weight α, a float or a schedule (the paper warms it up).
      eps, eps_root: added outside and inside the square root.
      mu_dtype: the dtype m₁ and m₂ are stored in; nu_dtype: ν's; rounding: how they are
        rounded there. See `adam`.

    Warning:
        The default alpha is 6.0, as in `optax.contrib.scale_by_ademamix`; the `ademamix`
        alias defaults to 5.0, as optax's does. optax stores ν in `mu_dtype` too; here ν
        follows `nu_dtype`, as in `adam`. optax keeps a second counter `count_m2`, always
        equal to `count`; here `count` alone drives the schedules.
    """
    for name, beta in (("b1", b1), ("b2", b2), ("b3", b3)):
        check_hyperparam(name, beta)
        check_beta(name, beta)
    check_hyperparam("alpha", alpha)
    check_nonnegative("alpha", alpha)
    check_hyperparam("eps", eps)
    check_positive("eps", eps)
    check_nonnegative("eps_root", eps_root)
    lp.check_moments(mu_dtype, nu_dtype, rounding)

    def init(params: Params) -> ScaleByAdemamixState:
        count = zero_count(leaf_device(pytree.tree_leaves(params)))
        moments = lp.init_moments(params, mu_dtype), lp.init_moments(params, mu_dtype)
        return ScaleByAdemamixState(count, *moments, lp.init_moments(params, nu_dtype))

    def update(grads, state, params=None, **extra):
        beta1, beta2 = resolve(b1, state.count), resolve(b2, state.count)
        beta3, a = resolve(b3, state.count), resolve(alpha, state.count)
        gs, wide, m1 = lp.load_moments(grads, state.m1, params)
        m2 = lp.load_moments(grads, state.m2)[2]
        nu = lp.load_moments(grads, state.nu, second=True)[2]
        spec = pytree.tree_structure(grads)
        bc1, bc2 = adam.bias_corrections(state.count, beta1, beta2)
        m1, nu = adam.moments(m1, nu, wide, beta1, beta2)  # Adam's moments, and a slow momentum beside m₁
        m2 = ls.cast_like(ls.ema(m2, wide, beta3), wide)
        # u = (m₁ / bc1 + α·m₂) / (√(ν / bc2 + eps_root) + eps)
        numer = ls.lincomb(1.0 / bc1, m1, a, m2)
        out = ls.cast_like(ls.div_into_(numer, adam.denominator(nu, bc2, eps, eps_root)), gs)
        keys = lp.moment_keys(state.count, rounding, state.m1, state.m2, state.nu)
        slow = (
            None if keys is None else [lp.leaf_seed(lp.leaf_key(state.count, i, _SLOW_SALT)) for i in range(len(keys))]
        )
        new_state = ScaleByAdemamixState(
            state.count + 1,
            lp.store_moments(m1, state.m1, keys),
            lp.store_moments(m2, state.m2, slow),
            lp.store_moments(nu, state.nu, keys, second=True),
        )
        return pytree.tree_unflatten(out, spec), new_state

    return with_needs(Transform(init, update), Needs(flat=lp.unpackable(mu_dtype, nu_dtype)))


def ademamix(
    lr: ScalarOrSchedule,
    b1: ScalarOrSchedule = 0.9,
    b2: ScalarOrSchedule = 0.999,
    b3: ScalarOrSchedule = 0.9999,
    alpha: ScalarOrSchedule = 5.0,
    eps: float = 1e-8,
    weight_decay: ScalarOrSchedule = 0.0,
    mask: Any = None,
    *,
    eps_root: float = 0.0,
    mu_dtype: torch.dtype | None = None,
    nu_dtype: torch.dtype | None = None,
    rounding: str = "stochastic",
) -> Transform:
    """AdEMAMix, = `optax.contrib.ademamix`: Adam with a slow EMA of the gradient mixed in.

    m₁ ← β₁·m₁ + (1-β₁)·g;  m₂ ← β₃·m₂ + (1-β₃)·g;  ν ← β₂·ν + (1-β₂)·g²;
    p ← p - η · ((m₁/(1-β₁ᵗ) + α·m₂) / (√(ν/(1-β₂ᵗ)) + ε) + λ·p),
    with η = `lr`, (β₁, β₂, β₃) = (`b1`, `b2`, `b3`), α = `alpha`, ε = `eps`,
    λ = `weight_decay` (decoupled, where `mask`), t the step from 1. m₂ is not
    bias-corrected: it fills slowly, which is why the paper warms α and β₃ up.

    Args:
      b3, alpha: floats or schedules; the paper ramps α linearly from 0 and β₃ from β₁ up
        over the first part of training (pass those as `step -> value` callables).
      mask: where to decay: a bool pytree like params or `callable(params)`.
      eps_root: added inside the square root, as optax's.
      mu_dtype, nu_dtype, rounding: how m₁, m₂ (`mu_dtype`) and ν (`nu_dtype`) are stored;
        see `adam`.

    Examples:
        >>> import torch, purestep.core as ps
        >>> opt = ps.ademamix(lr=0.1, alpha=0.0)  # α = 0: Adam's first step
        >>> params = {"w": torch.ones(2)}
        >>> updates, _ = opt.update({"w": torch.ones(2)}, opt.init(params), params)
        >>> updates["w"]
        tensor([-0.1000, -0.1000])

    References:
        Pagliardini et al., The AdEMAMix Optimizer: Better, Faster, Older, 2024.
    """
    check_lr(lr)
    check_hyperparam("weight_decay", weight_decay)
    check_nonnegative("weight_decay", weight_decay)
    block = scale_by_ademamix(
        b1, b2, b3, alpha, eps, eps_root=eps_root, mu_dtype=mu_dtype, nu_dtype=nu_dtype, rounding=rounding
    )
    return chain(block, decayed(weight_decay, mask), scale_by_lr(lr))
