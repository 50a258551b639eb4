"""MARS-AdamW: AdamW over a variance-reduced gradient (block and alias)."""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.utils._pytree as pytree
from torch import Tensor

from .engine import ops as lay
from . import _adam as adam
from . import _foreach as ls
from . import _low_precision as lp
from ._base import (
    Params,
    ScalarOrSchedule,
    Transform,
    check_beta,
    check_hyperparam,
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


class ScaleByMarsState(NamedTuple):
    """State of `scale_by_mars`: Adam's moments of the corrected gradient, and the last gradient."""

    count: Tensor  # type: ignore[assignment]  # (), int64
    mu: Params  # EMA (β₁) of c
    nu: Params  # EMA (β₂) of c²
    last_grad: Params  # g of the previous update (zeros before the first), in the grads' dtype


def scale_by_mars(
    b1: ScalarOrSchedule = 0.95,
    b2: ScalarOrSchedule = 0.99,
    gamma: ScalarOrSchedule = 0.025,
    eps: float = 1e-8,
    *,
    mu_dtype: torch.dtype | None = None,
    nu_dtype: torch.dtype | None = None,
    rounding: str = "stochastic",
) -> Transform:
    """MARS-AdamW's direction, Adam over the clipped variance-reduced gradient; see `mars`
    for the rule, `adam` for `mu_dtype`, `nu_dtype` and `rounding`."""
    for name, beta in (("b1", b1), ("b2", b2)):
        check_hyperparam(name, beta)
        check_beta(name, beta)
    check_hyperparam("gamma", gamma)
    check_nonnegative("gamma", gamma)
    check_hyperparam("eps", eps)
    check_positive("eps", eps)
    lp.check_moments(mu_dtype, nu_dtype, rounding)

    def init(params: Params) -> ScaleByMarsState:
        count = zero_count(leaf_device(pytree.tree_leaves(params)))
        last = pytree.tree_map(torch.zeros_like, params)
        return ScaleByMarsState(count, lp.init_moments(params, mu_dtype), lp.init_moments(params, nu_dtype), last)

    def update(grads, state, params=None, **extra):
        beta1, beta2 = resolve(b1, state.count), resolve(b2, state.count)
        gs, wide, mu = lp.load_moments(grads, state.mu, params)
        nu = lp.load_moments(grads, state.nu, second=True)[2]
        last = [x.to(w.dtype) for x, w in zip(pytree.tree_leaves(state.last_grad), wide)]
        spec = pytree.tree_structure(grads)
        bc1, bc2 = adam.bias_corrections(state.count, beta1, beta2)
        # c = g + γ·β₁/(1-β₁)·(g - g_prev), then c / max(‖c‖, 1) per leaf
        cs = ls.axpy(resolve(gamma, state.count) * beta1 / (1.0 - beta1), ls.sub(wide, last), wide)
        norms = lay.leaf_norms(grads, cs)  # over shards: whole leaves' norms, one collective
        cs = [c / torch.clamp(n, min=1.0).to(c.dtype) for c, n in zip(cs, norms)]
        mu, nu = adam.moments(mu, nu, cs, beta1, beta2)  # Adam's moments and direction, on c
        out = ls.cast_like(adam.direction(mu, nu, bc1, bc2, eps), gs)
        keys = lp.moment_keys(state.count, rounding, state.mu, state.nu)
        new_state = ScaleByMarsState(
            state.count + 1,
            lp.store_moments(mu, state.mu, keys),
            lp.store_moments(nu, state.nu, keys, second=True),
            pytree.tree_unflatten([g.detach().clone() for g in gs], pytree.tree_structure(state.last_grad)),
        )
        return pytree.tree_unflatten(out, spec), new_state

    # A norm per leaf: same-shape leaves stacked, but 16-bit leaves are buffers of their own:
    # inductor (torch 2.13, CPU) fails to compile this norm on stacks of 16-bit leaves
    # ("KeyError: 'buf6'" in its outer-loop fusion).
    wide_only = lambda path, leaf: leaf.dtype not in (torch.bfloat16, torch.float16)  # noqa: E731
    return with_needs(
        Transform(init, update),
        Needs(flat=lp.unpackable(mu_dtype, nu_dtype), whole_leaves=True, stacks=wide_only, reductions=("leaf_norms",)),
    )


def mars(
    lr: ScalarOrSchedule,
    b1: ScalarOrSchedule = 0.95,
    b2: ScalarOrSchedule = 0.99,
    gamma: ScalarOrSchedule = 0.025,
    eps: float = 1e-8,
    weight_decay: ScalarOrSchedule = 0.0,
    *,
    mu_dtype: torch.dtype | None = None,
    nu_dtype: torch.dtype | None = None,
    rounding: str = "stochastic",
) -> Transform:
    """MARS-AdamW (Yuan et al. 2024): AdamW over a variance-reduced, clipped gradient, on every leaf.

    c = g + γ·β₁/(1-β₁)·(g - g_prev);  c ← c / max(‖c‖₂, 1)  (per leaf);
    m ← β₁·m + (1-β₁)·c;  v ← β₂·v + (1-β₂)·c²;  p ← p - η·(m̂ / (√v̂ + ε) + λ·p),
    with η = `lr`, (β₁, β₂) = (`b1`, `b2`), γ = `gamma`, ε = `eps`, λ = `weight_decay`
    (decoupled), m̂, v̂ bias-corrected as Adam's and g_prev the previous update's gradient
    (0 before the first: c = g·(1 + γ·β₁/(1-β₁)) then). g_prev is in the state, so a
    checkpoint carries it.

    Args:
      gamma: γ, the weight of the gradient correction (0: AdamW on the clipped gradient).
      mu_dtype, nu_dtype, rounding: how m and v are stored; see `adam` (g_prev keeps the
        grads' dtype).

    Warning:
        pytorch_optimizer's `MARS(mars_type="adamw", optimize_1d=True)` adds ε to √v before
        the bias correction, m̂ / ((√v + ε)/√(1-β₂ᵗ)); here ε is added after it, as AdamW's.

    Examples:
        >>> import torch, purestep.core as ps
        >>> opt = ps.mars(lr=0.1)
        >>> params = {"w": torch.ones(4)}
        >>> u, _ = opt.update({"w": torch.full((4,), 0.1)}, opt.init(params), params)
        >>> u["w"]
        tensor([-0.1000, -0.1000, -0.1000, -0.1000])

    References:
        Yuan et al., MARS: Unleashing the Power of Variance Reduction for Training Large Models, 2024.
    """
    check_hyperparam("weight_decay", weight_decay)
    check_nonnegative("weight_decay", weight_decay)
    block = scale_by_mars(b1, b2, gamma, eps, mu_dtype=mu_dtype, nu_dtype=nu_dtype, rounding=rounding)
    return chain(block, decayed(weight_decay), scale_by_lr(lr))
