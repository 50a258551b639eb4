"""The aliases of `_blocks`' building blocks (sgd, adam, adamw, lion, lamb, lars): each a `chain`, no
math of its own. Every other family keeps its aliases in its own module."""

from __future__ import annotations

from typing import Any

import torch

from ._base import (
    ScalarOrSchedule,
    Transform,
    check_betas,
    check_hyperparam,
    check_nonnegative,
    check_positive,
    is_static,
    is_zero,
)
from ._combine import chain, identity, masked
from ._weight_decay import decayed
from ._blocks import scale, scale_by_adam, scale_by_lion, scale_by_lr, scale_by_trust_ratio, trace


def _signed(maximize: bool, *transforms: Transform) -> Transform:
    # torch.optim negates the grad first, before L2 decay: g ← -g ascends the objective.
    return chain(scale(-1.0), *transforms) if maximize else chain(*transforms)


def sgd(
    lr: ScalarOrSchedule,
    momentum: ScalarOrSchedule = 0.0,
    dampening: float = 0.0,
    nesterov: bool = False,
    weight_decay: ScalarOrSchedule = 0.0,
    *,
    maximize: bool = False,
    accumulator_dtype: torch.dtype | None = None,
    rounding: str = "stochastic",
) -> Transform:
    """Stochastic gradient descent with momentum, = `torch.optim.SGD`.

    g ← g + λ·p;  b ← μ·b + (1 - τ)·g  (b₁ = g);  p ← p - η·(g + μ·b if nesterov else b),
    with η = `lr`, μ = `momentum`, τ = `dampening`, λ = `weight_decay` (L2, in the grad).

    Args:
      maximize: ascend the objective: g ← -g before anything else, as torch.optim does
        (the chain then starts with `scale(-1.0)`).
      accumulator_dtype, rounding: the dtype b is stored in (optax's name) and how it is
        rounded there; see `adam`'s `mu_dtype`.

    Examples:
        >>> import torch, purestep.core as ps
        >>> opt = ps.sgd(lr=0.1, momentum=0.9)
        >>> params = {"w": torch.ones(2)}
        >>> state = opt.init(params)
        >>> updates, state = opt.update({"w": torch.ones(2)}, state, params)
        >>> ps.apply_updates(params, updates)
        {'w': tensor([0.9000, 0.9000])}

    References:
        Sutskever et al., On the importance of initialization and momentum in deep learning, 2013.
    """
    check_hyperparam("momentum", momentum)
    check_nonnegative("momentum", momentum)
    check_nonnegative("dampening", dampening)
    if nesterov and (is_zero(momentum) or (is_static(dampening) and dampening != 0)):
        raise ValueError("nesterov=True needs momentum > 0 and dampening=0 (as torch.optim.SGD)")
    momentum_step = (
        identity()
        if is_zero(momentum)
        else trace(momentum, nesterov, dampening=dampening, accumulator_dtype=accumulator_dtype, rounding=rounding)
    )
    return _signed(maximize, decayed(weight_decay), momentum_step, scale_by_lr(lr))


def adam(
    lr: ScalarOrSchedule,
    betas: tuple[ScalarOrSchedule, ScalarOrSchedule] = (0.9, 0.999),
    eps: float = 1e-8,
    weight_decay: ScalarOrSchedule = 0.0,
    *,
    amsgrad: bool = False,
    maximize: bool = False,
    mu_dtype: torch.dtype | None = None,
    nu_dtype: torch.dtype | None = None,
    rounding: str = "stochastic",
) -> Transform:
    """Adam with L2 weight decay in the gradient, = `torch.optim.Adam`.

    g ← g + λ·p;  m ← β₁·m + (1-β₁)·g;  v ← β₂·v + (1-β₂)·g²;
    p ← p - η · (m / (1-β₁ᵗ)) / (√(v / (1-β₂ᵗ)) + ε),
    with η = `lr`, (β₁, β₂) = `betas`, ε = `eps`, λ = `weight_decay`, t the step from 1.

    Args:
      amsgrad: use v̂ ← max over steps of v in the denominator (Reddi et al. 2018), as
        torch.optim does: the max of the raw v, bias-corrected after (state field `nu_max`).
      maximize: ascend the objective: g ← -g before the L2 term, as torch.optim does.
      mu_dtype, nu_dtype: the dtypes m and v are stored in (optax's names). None keeps
        the param's dtype (float32 for float16 params, whose range cannot hold v).
        torch.bfloat16 halves the state; torch.float8_e4m3fn (or float8_e5m2) stores it
        8-bit, block-quantized: fp8 codes times a float32 absmax scale per 256 elements,
        v as √v (so its range squares), leaves under 4096 elements in float32. The math
        runs in float32 (or the params' dtype where wider) and the update uses the
        unrounded m and v, as in optax; only the stored copy is narrow.
      rounding: how m and v are rounded into a narrower dtype. "stochastic" rounds up or
        down at random, unbiased, so EMA increments below half an ulp are not lost; its
        bits are a hash of the step count, leaf and element, so a resume is bitwise
        identical. "nearest" is optax's cast.

    Warning:
        With 16-bit params torch.optim runs the math in the params' dtype; here it runs
        in float32 (with float16, eps = 1e-8 would round to 0 and a zero grad give NaN).

    Examples:
        >>> import torch, purestep.core as ps
        >>> opt = ps.adam(lr=0.1)
        >>> params = {"w": torch.ones(2)}
        >>> updates, _ = opt.update({"w": torch.ones(2)}, opt.init(params), params)
        >>> updates["w"]
        tensor([-0.1000, -0.1000])

    References:
        Kingma and Ba, Adam: A Method for Stochastic Optimization, 2015.
    """
    b1, b2 = check_betas(betas)
    adam_step = scale_by_adam(b1, b2, eps, amsgrad=amsgrad, mu_dtype=mu_dtype, nu_dtype=nu_dtype, rounding=rounding)
    return _signed(maximize, decayed(weight_decay), adam_step, scale_by_lr(lr))


def adamw(
    lr: ScalarOrSchedule,
    betas: tuple[ScalarOrSchedule, ScalarOrSchedule] = (0.9, 0.999),
    eps: float = 1e-8,
    weight_decay: ScalarOrSchedule = 0.01,
    mask: Any = None,
    *,
    amsgrad: bool = False,
    maximize: bool = False,
    cautious_weight_decay: bool = False,
    mu_dtype: torch.dtype | None = None,
    nu_dtype: torch.dtype | None = None,
    rounding: str = "stochastic",
) -> Transform:
    """Adam with decoupled weight decay, = `torch.optim.AdamW`.

    m, v as in `adam` (without λ in g);  p ← p - η · (m̂ / (√v̂ + ε) + λ·p),
    with η = `lr`, λ = `weight_decay`, applied where `mask` is True.

    Args:
      mask: where to decay: a bool pytree like params or `callable(params)`,
        e.g. `ps.decay_mask`. None decays every leaf, as torch.optim.AdamW does.
      amsgrad: the running max of v in the denominator, as in `adam`.
      maximize: ascend the objective (g ← -g); the decay still shrinks p, as torch.optim does.
      cautious_weight_decay: decay only where the step already moves p toward 0,
        p ← p - η·(u + λ·𝟙[sign u = sign p]·p) with u = m̂/(√v̂ + ε) (Chen et al. 2025,
        Cautious Weight Decay); see `add_decayed_weights`.
      mu_dtype, nu_dtype, rounding: how m and v are stored; see `adam`.

    Examples:
        >>> import torch, purestep.core as ps
        >>> opt = ps.adamw(lr=0.1, weight_decay=0.0)
        >>> params = {"w": torch.ones(2)}
        >>> updates, _ = opt.update({"w": torch.ones(2)}, opt.init(params), params)
        >>> updates["w"]
        tensor([-0.1000, -0.1000])

    References:
        Loshchilov and Hutter, Decoupled Weight Decay Regularization, 2019.
    """
    b1, b2 = check_betas(betas)
    adam_step = scale_by_adam(b1, b2, eps, amsgrad=amsgrad, mu_dtype=mu_dtype, nu_dtype=nu_dtype, rounding=rounding)
    return _signed(maximize, adam_step, decayed(weight_decay, mask, cautious=cautious_weight_decay), scale_by_lr(lr))


def lion(
    lr: ScalarOrSchedule,
    betas: tuple[ScalarOrSchedule, ScalarOrSchedule] = (0.9, 0.99),
    weight_decay: ScalarOrSchedule = 0.0,
    mask: Any = None,
    *,
    cautious_weight_decay: bool = False,
    mu_dtype: torch.dtype | None = None,
    rounding: str = "stochastic",
) -> Transform:
    """Lion, = `lion_pytorch.Lion`.

    u = sign(β₁·m + (1-β₁)·g);  m ← β₂·m + (1-β₂)·g;  p ← p - η·(u + λ·p),
    with η = `lr`, (β₁, β₂) = `betas`, λ = `weight_decay` (decoupled, where `mask`).

    Args:
      cautious_weight_decay: decay only where sign(u) = sign(p) (Chen et al. 2025); see `adamw`.
      mu_dtype, rounding: how m is stored; see `adam`.

    Examples:
        >>> import torch, purestep.core as ps
        >>> opt = ps.lion(lr=0.1)
        >>> params = {"w": torch.ones(2)}
        >>> updates, _ = opt.update({"w": torch.tensor([2.0, -3.0])}, opt.init(params), params)
        >>> updates["w"]
        tensor([-0.1000,  0.1000])

    References:
        Chen et al., Symbolic Discovery of Optimization Algorithms, 2023.
    """
    b1, b2 = check_betas(betas)
    decay = decayed(weight_decay, mask, cautious=cautious_weight_decay)
    return chain(scale_by_lion(b1, b2, mu_dtype=mu_dtype, rounding=rounding), decay, scale_by_lr(lr))


def lamb(
    lr: ScalarOrSchedule,
    betas: tuple[ScalarOrSchedule, ScalarOrSchedule] = (0.9, 0.999),
    eps: float = 1e-6,
    weight_decay: ScalarOrSchedule = 0.0,
    mask: Any = None,
) -> Transform:
    """LAMB, = `optax.lamb`.

    r = m̂ / (√v̂ + ε) + λ·p;  p ← p - η · (‖p‖ / ‖r‖) · r  (ratio 1 where a norm is 0),
    with m̂, v̂ as in `adam`, η = `lr`, λ = `weight_decay` (where `mask`).

    Examples:
        >>> import torch, purestep.core as ps
        >>> opt = ps.lamb(lr=0.1)
        >>> params = {"w": torch.full((4,), 2.0)}
        >>> updates, _ = opt.update({"w": torch.ones(4)}, opt.init(params), params)
        >>> updates["w"]
        tensor([-0.2000, -0.2000, -0.2000, -0.2000])

    References:
        You et al., Large Batch Optimization for Deep Learning: Training BERT in 76 minutes, 2020.
    """
    b1, b2 = check_betas(betas)
    check_positive("eps", eps)
    return chain(
        scale_by_adam(b1, b2, eps),
        decayed(weight_decay, mask),
        scale_by_trust_ratio(),
        scale_by_lr(lr),
    )


def lars(
    lr: ScalarOrSchedule,
    momentum: ScalarOrSchedule = 0.9,
    weight_decay: ScalarOrSchedule = 0.0,
    trust_coefficient: float = 0.001,
    eps: float = 0.0,
    nesterov: bool = False,
    *,
    mask: Any = None,
    trust_ratio_mask: Any = None,
) -> Transform:
    """LARS, = `optax.lars`.

    r = g + λ·p;  r ← r · c·‖p‖ / (‖r‖ + ε) (1 where a norm is 0);  b ← μ·b - η·r;
    p ← p + (b, or -η·r + μ·b with nesterov), with η = `lr`, μ = `momentum`,
    λ = `weight_decay` (where `mask`), c = `trust_coefficient` (where `trust_ratio_mask`).

    Warning:
        As in optax, momentum accumulates lr-scaled updates, so an lr schedule acts on
        the buffer's inputs, not on its output.

    Examples:
        >>> import torch, purestep.core as ps
        >>> opt = ps.lars(lr=1.0, trust_coefficient=1.0)
        >>> params = {"w": torch.full((4,), 2.0)}
        >>> updates, _ = opt.update({"w": torch.ones(4)}, opt.init(params), params)
        >>> updates["w"]
        tensor([-2., -2., -2., -2.])

    References:
        You et al., Large Batch Training of Convolutional Networks, 2017.
    """
    check_hyperparam("momentum", momentum)
    check_nonnegative("momentum", momentum)
    if nesterov and is_zero(momentum):
        raise ValueError("nesterov=True needs momentum > 0")
    ratio = scale_by_trust_ratio(trust_coefficient=trust_coefficient, eps=eps)
    return chain(
        decayed(weight_decay, mask),
        ratio if trust_ratio_mask is None else masked(ratio, trust_ratio_mask),
        scale_by_lr(lr),
        trace(momentum, nesterov),
    )
