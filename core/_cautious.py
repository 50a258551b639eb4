"""Cautious updates (C-Optim): keep only the entries of an update that point downhill."""

from __future__ import annotations

from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import Tensor

from .engine import ops as lay
from . import _tree as tr
from ._base import (
    OptState,
    Params,
    ScalarOrSchedule,
    Transform,
    check_betas,
    check_hyperparam,
    check_lr,
    check_nonnegative,
)
from ._combine import chain
from ._weight_decay import decayed
from ._blocks import scale_by_adam, scale_by_lr
from .engine.needs import Needs, with_needs

_RESCALES = ("count", "mean")
_MEAN_FLOOR = 1e-3  # C-Optim's (and timm's) floor on the kept fraction under rescale="mean"


def _rescale(kept: Tensor, numel: int, rescale: str) -> Tensor:
    """The factor on a leaf's kept entries from their count: n/(kept + 1), or 1/max(kept/n, 1e-3)."""
    if rescale == "count":
        return numel / (kept + 1.0)
    return 1.0 / torch.clamp(kept / numel, min=_MEAN_FLOOR)


def cautious(transform: Transform, *, before_lr: bool = False, rescale: str = "count") -> Transform:
    """Cautious updates: `transform`'s update where it points downhill, zero elsewhere.

    u ← t(g);  k = [u·g < 0] elementwise;  u ← u · k · n / (Σk + 1), per leaf of n elements,
    with t = `transform`; purestep adds updates, so u·g < 0 means u descends. Where
    fewer entries survive, the rest grow: the leaf's update keeps its size on average.

    Args:
      transform: the transform to wrap, whose update is the step (lr applied:
        `ps.adam(lr)`), or, with `before_lr`, a direction along the grad that a later
        `scale_by_lr` negates (`ps.scale_by_adam()`).
      before_lr: True for a wrapped transform that comes before `scale_by_lr`: the kept
        entries are then those with u·g > 0 (its direction agrees with the grad).
      rescale: "count", n/(Σk + 1), the paper's and C-Optim's first code (still its
        C-Lion's); "mean", 1/max(Σk/n, 1e-3), C-Optim's C-AdamW since 2025 and timm's
        `caution=True`.

    Returns:
      A transform with the wrapped transform's state (nothing is added to it).

    Warning:
        The whole update of `transform` is masked, a decoupled weight decay inside it
        (`ps.cautious(ps.adamw(lr))`) included: its λ·p term is zeroed and rescaled
        entry by entry with the rest. C-Optim decays every entry, outside the mask:
        that is `ps.cautious_adamw`, =
        `chain(cautious(scale_by_adam(), before_lr=True), add_decayed_weights(λ), scale_by_lr(lr))`.
        The per-leaf count is a reduction over each leaf, so under `make_update` with
        flat buffers the leaves are grouped whole (stacks of same-shape leaves).

    Examples:
        >>> import torch, purestep.core as ps
        >>> t = ps.cautious(ps.sgd(lr=1.0))
        >>> g = {"w": torch.tensor([1.0, -2.0, 3.0])}
        >>> t.update(g, t.init(g), g)[0]  # sgd descends on every entry: 3/(3 + 1) each
        {'w': tensor([-0.7500,  1.5000, -2.2500])}

    References:
        Liang et al., Cautious Optimizers: Improving Training with One Line of Code, 2024
        (github.com/kyleliang919/C-Optim).
    """
    if not isinstance(transform, Transform):
        raise ValueError(f"transform must be a ps.Transform, got {type(transform).__name__}")
    if rescale not in _RESCALES:
        raise ValueError(f"rescale must be one of {_RESCALES}, got {rescale!r}")
    if not isinstance(before_lr, bool):
        raise ValueError(f"before_lr must be a bool, got {before_lr!r}")

    def init(params: Params) -> OptState:
        return transform.init(params)

    def update(grads, state, params=None, **extra):
        updates, state = transform.update(grads, state, params, **extra)
        us, spec = pytree.tree_flatten(updates)
        gs = tr.check_match(grads, updates, "grads", "updates", dtype=False)
        shapes = lay.global_shapes(grads)  # a stack member's shape for a stack
        keeps = [(u * g.to(u.dtype) > 0) if before_lr else (u * g.to(u.dtype) < 0) for u, g in zip(us, gs)]
        kept = lay.leaf_sums(grads, keeps)  # per leaf or stack member ((k, 1, ...)); over shards, whole leaves
        out = []
        for u, keep, n, shape in zip(us, keeps, kept, shapes):
            factor = _rescale(n, shape.numel(), rescale).to(u.dtype)
            out.append(u * (keep.to(u.dtype) * factor))  # a NaN in u stays NaN, as in C-Optim
        return pytree.tree_unflatten(out, spec), state

    # Per-leaf counts: same-shape leaves stacked.
    needs = Needs(whole_leaves=True, reductions=("leaf_sums",), parts=lambda tree: [(transform, None)])
    return with_needs(Transform(init, update), needs)


def cautious_adamw(
    lr: ScalarOrSchedule,
    betas: tuple[ScalarOrSchedule, ScalarOrSchedule] = (0.9, 0.999),
    eps: float = 1e-8,
    weight_decay: ScalarOrSchedule = 0.01,
    mask: Any = None,
    *,
    rescale: str = "count",
    mu_dtype: torch.dtype | None = None,
    nu_dtype: torch.dtype | None = None,
    rounding: str = "stochastic",
) -> Transform:
    """Cautious AdamW, = C-Optim's C-AdamW: Adam's step where it agrees with the grad, decay everywhere.

    u = m̂ / (√v̂ + ε);  k = [m·g > 0];  p ← p - η · (u · k · n/(Σk + 1) + λ·p),
    with m̂, v̂ as in `adam`, η = `lr`, λ = `weight_decay` (where `mask`), n the elements
    of the leaf and Σk those kept. It is
    `chain(cautious(scale_by_adam(...), before_lr=True, rescale=rescale), add_decayed_weights(λ, mask), scale_by_lr(lr))`:
    the decay stays outside the mask, as C-Optim applies it.

    Args:
      rescale: "count" (n/(Σk + 1)) or "mean" (1/max(Σk/n, 1e-3), C-Optim's current C-AdamW);
        see `cautious`.
      mu_dtype, nu_dtype, rounding: how m and v are stored; see `adam`.

    Warning:
        C-Optim's AdamW (from transformers') adds ε to √v before the bias correction
        (η·√(1-β₂ᵗ)/(1-β₁ᵗ) · m/(√v + ε)); here ε is added after it, as torch.optim.AdamW
        does. The two differ where √v̂ is within a few ε of 0.

    Examples:
        >>> import torch, purestep.core as ps
        >>> opt = ps.cautious_adamw(lr=0.1, weight_decay=0.0)
        >>> params = {"w": torch.ones(3)}
        >>> updates, _ = opt.update({"w": torch.ones(3)}, opt.init(params), params)
        >>> updates["w"]  # every entry agrees on the first step: 3/(3 + 1) of Adam's
        tensor([-0.0750, -0.0750, -0.0750])

    References:
        Liang et al., Cautious Optimizers: Improving Training with One Line of Code, 2024.
    """
    check_lr(lr)
    b1, b2 = check_betas(betas)
    check_hyperparam("weight_decay", weight_decay)
    check_nonnegative("weight_decay", weight_decay)
    adam_step = scale_by_adam(b1, b2, eps, mu_dtype=mu_dtype, nu_dtype=nu_dtype, rounding=rounding)
    return chain(cautious(adam_step, before_lr=True, rescale=rescale), decayed(weight_decay, mask), scale_by_lr(lr))
