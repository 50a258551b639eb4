"""Optimizer aliases: each is a `chain` of public building blocks, no math of its own."""

from __future__ import annotations

from typing import Any

from ._base import ScalarOrSchedule, Transform, check_betas, check_hyperparam, check_nonnegative, check_positive, is_static
from ._combine import chain, identity, masked
from ._decay import add_decayed_weights
from ._scaling import scale_by_adam, scale_by_lion, scale_by_lr, scale_by_trust_ratio, trace


def _is_zero(value: Any) -> bool:
    return is_static(value) and value == 0


def _decay(weight_decay: ScalarOrSchedule, mask: Any = None) -> Transform:
    # A constant zero decay is left out of the chain; identity keeps the state layout.
    return identity() if _is_zero(weight_decay) else add_decayed_weights(weight_decay, mask)


def _check_lr(lr: Any) -> None:
    check_hyperparam("lr", lr)
    check_nonnegative("lr", lr)


def sgd(
    lr: ScalarOrSchedule,
    momentum: ScalarOrSchedule = 0.0,
    dampening: float = 0.0,
    nesterov: bool = False,
    weight_decay: ScalarOrSchedule = 0.0,
) -> Transform:
    """Stochastic gradient descent with momentum, = `torch.optim.SGD`.

    g ← g + λ·p;  b ← μ·b + (1 - τ)·g  (b₁ = g);  p ← p - η·(g + μ·b if nesterov else b),
    with η = `lr`, μ = `momentum`, τ = `dampening`, λ = `weight_decay` (L2, in the grad).

    Example:
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
    _check_lr(lr)
    check_hyperparam("momentum", momentum)
    check_nonnegative("momentum", momentum)
    check_hyperparam("weight_decay", weight_decay)
    check_nonnegative("weight_decay", weight_decay)
    check_nonnegative("dampening", dampening)
    if nesterov and (_is_zero(momentum) or dampening != 0):
        raise ValueError("nesterov=True needs momentum > 0 and dampening=0 (as torch.optim.SGD)")
    momentum_step = identity() if _is_zero(momentum) else trace(momentum, nesterov, dampening=dampening)
    return chain(_decay(weight_decay), momentum_step, scale_by_lr(lr))


def adam(
    lr: ScalarOrSchedule,
    betas: tuple[ScalarOrSchedule, ScalarOrSchedule] = (0.9, 0.999),
    eps: float = 1e-8,
    weight_decay: ScalarOrSchedule = 0.0,
) -> Transform:
    """Adam with L2 weight decay in the gradient, = `torch.optim.Adam`.

    g ← g + λ·p;  m ← β₁·m + (1-β₁)·g;  v ← β₂·v + (1-β₂)·g²;
    p ← p - η · (m / (1-β₁ᵗ)) / (√(v / (1-β₂ᵗ)) + ε),
    with η = `lr`, (β₁, β₂) = `betas`, ε = `eps`, λ = `weight_decay`, t the step from 1.

    Example:
        >>> import torch, purestep.core as ps
        >>> opt = ps.adam(lr=0.1)
        >>> params = {"w": torch.ones(2)}
        >>> updates, _ = opt.update({"w": torch.ones(2)}, opt.init(params), params)
        >>> updates["w"]
        tensor([-0.1000, -0.1000])

    References:
        Kingma and Ba, Adam: A Method for Stochastic Optimization, 2015.
    """
    _check_lr(lr)
    b1, b2 = check_betas(betas)
    check_hyperparam("weight_decay", weight_decay)
    check_nonnegative("weight_decay", weight_decay)
    return chain(_decay(weight_decay), scale_by_adam(b1, b2, eps), scale_by_lr(lr))


def adamw(
    lr: ScalarOrSchedule,
    betas: tuple[ScalarOrSchedule, ScalarOrSchedule] = (0.9, 0.999),
    eps: float = 1e-8,
    weight_decay: ScalarOrSchedule = 0.01,
    mask: Any = None,
) -> Transform:
    """Adam with decoupled weight decay, = `torch.optim.AdamW`.

    m, v as in `adam` (without λ in g);  p ← p - η · (m̂ / (√v̂ + ε) + λ·p),
    with η = `lr`, λ = `weight_decay`, applied where `mask` is True.

    Args:
      mask: where to decay: a bool pytree like params or `callable(params)`,
        e.g. `ps.decay_mask`. None decays every leaf, as torch.optim.AdamW does.

    Example:
        >>> import torch, purestep.core as ps
        >>> opt = ps.adamw(lr=0.1, weight_decay=0.0)
        >>> params = {"w": torch.ones(2)}
        >>> updates, _ = opt.update({"w": torch.ones(2)}, opt.init(params), params)
        >>> updates["w"]
        tensor([-0.1000, -0.1000])

    References:
        Loshchilov and Hutter, Decoupled Weight Decay Regularization, 2019.
    """
    _check_lr(lr)
    b1, b2 = check_betas(betas)
    check_hyperparam("weight_decay", weight_decay)
    check_nonnegative("weight_decay", weight_decay)
    return chain(scale_by_adam(b1, b2, eps), _decay(weight_decay, mask), scale_by_lr(lr))


def lion(
    lr: ScalarOrSchedule,
    betas: tuple[ScalarOrSchedule, ScalarOrSchedule] = (0.9, 0.99),
    weight_decay: ScalarOrSchedule = 0.0,
    mask: Any = None,
) -> Transform:
    """Lion, = `lion_pytorch.Lion`.

    u = sign(β₁·m + (1-β₁)·g);  m ← β₂·m + (1-β₂)·g;  p ← p - η·(u + λ·p),
    with η = `lr`, (β₁, β₂) = `betas`, λ = `weight_decay` (decoupled, where `mask`).

    Example:
        >>> import torch, purestep.core as ps
        >>> opt = ps.lion(lr=0.1)
        >>> params = {"w": torch.ones(2)}
        >>> updates, _ = opt.update({"w": torch.tensor([2.0, -3.0])}, opt.init(params), params)
        >>> updates["w"]
        tensor([-0.1000,  0.1000])

    References:
        Chen et al., Symbolic Discovery of Optimization Algorithms, 2023.
    """
    _check_lr(lr)
    b1, b2 = check_betas(betas)
    check_hyperparam("weight_decay", weight_decay)
    check_nonnegative("weight_decay", weight_decay)
    return chain(scale_by_lion(b1, b2), _decay(weight_decay, mask), scale_by_lr(lr))


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

    Example:
        >>> import torch, purestep.core as ps
        >>> opt = ps.lamb(lr=0.1)
        >>> params = {"w": torch.full((4,), 2.0)}
        >>> updates, _ = opt.update({"w": torch.ones(4)}, opt.init(params), params)
        >>> updates["w"]
        tensor([-0.2000, -0.2000, -0.2000, -0.2000])

    References:
        You et al., Large Batch Optimization for Deep Learning: Training BERT in 76 minutes, 2020.
    """
    _check_lr(lr)
    b1, b2 = check_betas(betas)
    check_positive("eps", eps)
    check_hyperparam("weight_decay", weight_decay)
    check_nonnegative("weight_decay", weight_decay)
    return chain(
        scale_by_adam(b1, b2, eps),
        _decay(weight_decay, mask),
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

    Example:
        >>> import torch, purestep.core as ps
        >>> opt = ps.lars(lr=1.0, trust_coefficient=1.0)
        >>> params = {"w": torch.full((4,), 2.0)}
        >>> updates, _ = opt.update({"w": torch.ones(4)}, opt.init(params), params)
        >>> updates["w"]
        tensor([-2., -2., -2., -2.])

    References:
        You et al., Large Batch Training of Convolutional Networks, 2017.
    """
    _check_lr(lr)
    check_hyperparam("momentum", momentum)
    check_nonnegative("momentum", momentum)
    check_hyperparam("weight_decay", weight_decay)
    check_nonnegative("weight_decay", weight_decay)
    if nesterov and _is_zero(momentum):
        raise ValueError("nesterov=True needs momentum > 0")
    ratio = scale_by_trust_ratio(trust_coefficient=trust_coefficient, eps=eps)
    return chain(
        _decay(weight_decay, mask),
        ratio if trust_ratio_mask is None else masked(ratio, trust_ratio_mask),
        scale_by_lr(lr),
        trace(momentum, nesterov),
    )
