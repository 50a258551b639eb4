"""AdamC: AdamW whose decoupled decay follows the lr schedule's decline (Defazio et al. 2025)."""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
import torch.utils._pytree as pytree
from torch import Tensor

from . import _foreach as ls
from . import _tree as tr
from ._base import (
    schedule_clock,
    Params,
    ScalarOrSchedule,
    Transform,
    check_beta,
    check_hyperparam,
    check_nonnegative,
    leaf_device,
    resolve,
    zero_count,
)
from ._combine import chain, masked
from ._blocks import scale_by_adam, scale_by_lr
from .engine.needs import Needs, with_needs


@schedule_clock
class AdamcState(NamedTuple):
    """State of `adamc`'s decay: the largest lr applied so far."""

    count: Tensor  # type: ignore[assignment]  # (), int64: the lr schedule's step
    max_lr: Tensor  # (), float64: max over the updates so far of η_t, this one included


def _corrected_decay(weight_decay: ScalarOrSchedule, lr: ScalarOrSchedule) -> Transform:
    """u ← u + λ·(η_t / max_{s≤t} η_s)·p: AdamC's decay, before the lr scaling."""

    def init(params: Params) -> AdamcState:
        device = leaf_device(pytree.tree_leaves(params))
        return AdamcState(zero_count(device), torch.zeros((), dtype=torch.float64, device=device))

    def update(grads, state, params=None, **extra):
        ps_ = tr.params_for(params, grads, "adamc")
        us, spec = pytree.tree_flatten(grads)
        eta = torch.as_tensor(resolve(lr, state.count), dtype=torch.float64, device=state.max_lr.device)
        top = torch.maximum(state.max_lr, eta)
        ratio = torch.where(top > 0, eta / torch.where(top > 0, top, 1.0), 1.0)  # 1 while every lr is 0
        out = ls.cast_like(ls.axpy(resolve(weight_decay, state.count) * ratio, ps_, us), us)
        return pytree.tree_unflatten(out, spec), AdamcState(state.count + 1, top)

    return with_needs(Transform(init, update), Needs())


def adamc(
    lr: ScalarOrSchedule,
    b1: ScalarOrSchedule = 0.9,
    b2: ScalarOrSchedule = 0.999,
    eps: float = 1e-8,
    weight_decay: ScalarOrSchedule = 0.0,
    *,
    mask: Any = None,
    mu_dtype: torch.dtype | None = None,
    nu_dtype: torch.dtype | None = None,
    rounding: str = "stochastic",
) -> Transform:
    """AdamC (Defazio et al. 2025): AdamW with its decay scaled by lr_t / max lr, so that
    the weights' norm settles instead of growing as the schedule decays the lr.

    m̂, v̂ as in `adam`;  p ← p - η_t · (m̂ / (√v̂ + ε) + λ·(η_t / η_max)·p),
    with η_t = `lr` at step t, η_max the largest lr applied so far (this step's included:
    plain AdamW decay while the lr rises, as in a warmup), (β₁, β₂) = (`b1`, `b2`),
    ε = `eps`, λ = `weight_decay`, applied where `mask` is True. The decay is ∝ η_t², the
    paper's correction for normalized layers; at a constant lr this is `adamw`.

    Args:
      mask: where to decay: a bool pytree like params or `callable(params)` (the paper
        corrects the decay of normalized layers' weights; None decays every leaf).
      mu_dtype, nu_dtype, rounding: how m and v are stored; see `adam`.

    Warning:
        pytorch_optimizer's `AdamC(normalized=True)` divides by the lr it was built with,
        not the running max; the two agree when the schedule starts at its peak. Its ε is
        added before the bias correction of √v; here after it, as torch.optim.AdamW's.

    Examples:
        >>> import torch, purestep.core as ps
        >>> opt = ps.adamc(lr=lambda t: 0.1 / (1 + t), weight_decay=0.5)
        >>> params = {"w": torch.ones(2)}
        >>> state = opt.init(params)
        >>> u, state = opt.update({"w": torch.zeros(2)}, state, params)  # η = η_max = 0.1
        >>> u, state = opt.update({"w": torch.zeros(2)}, state, params)  # η = 0.05: decay × 0.5
        >>> u["w"]
        tensor([-0.0125, -0.0125])

    References:
        Defazio et al., Why Gradients Rapidly Increase Near the End of Training, 2025.
    """
    for name, beta in (("b1", b1), ("b2", b2)):
        check_hyperparam(name, beta)
        check_beta(name, beta)
    check_hyperparam("weight_decay", weight_decay)
    check_nonnegative("weight_decay", weight_decay)
    adam_step = scale_by_adam(b1, b2, eps, mu_dtype=mu_dtype, nu_dtype=nu_dtype, rounding=rounding)
    decay = _corrected_decay(weight_decay, lr)
    return chain(adam_step, decay if mask is None else masked(decay, mask), scale_by_lr(lr))
