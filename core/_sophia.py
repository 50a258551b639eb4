"""Sophia (SophiaG): clipped, curvature-preconditioned momentum, and the Gauss-Newton-Bartlett estimate.

The update rule is written once, on `sophia` in `_alias.py`.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import torch
import torch.nn.functional as F
import torch.utils._pytree as pytree
from torch import Tensor

from . import _low_precision as lp
from . import _foreach as ls
from . import _tree as tr
from ._base import (
    check_int,
    Params,
    PyTree,
    ScalarOrSchedule,
    Transform,
    check_betas,
    check_hyperparam,
    check_nonnegative,
    check_positive,
    leaf_device,
    resolve,
    zero_count,
)
from .engine.needs import Needs, with_needs
from ._weight_decay import decayed
from ._blocks import scale_by_lr
from ._combine import chain


class ScaleBySophiaState(NamedTuple):
    """State of `scale_by_sophia`: the grad EMA and the curvature estimate."""

    count: Tensor  # type: ignore[assignment]  # (), int64
    mu: Params  # EMA of grads
    hessian: Params  # EMA of the curvature estimates, refreshed every `update_every` updates


def scale_by_sophia(
    b1: ScalarOrSchedule = 0.965,
    b2: ScalarOrSchedule = 0.99,
    rho: ScalarOrSchedule = 0.04,
    eps: float = 1e-15,
    *,
    update_every: int = 10,
) -> Transform:
    """SophiaG's clipped step, `sign(m) · min(|m| / (ρ·h + ε), 1)`; see `sophia` for the rule.

    `update(grads, state, params, hessian=ĥ)` folds ĥ (a tree like params) into the
    curvature EMA when the update count is a multiple of `update_every`; an update
    without `hessian` keeps the old estimate, and one passed on another update is ignored.

    Examples:
        >>> import torch, purestep.core as ps
        >>> t = ps.scale_by_sophia()
        >>> p = {"w": torch.ones(2)}
        >>> u, state = t.update({"w": torch.tensor([1.0, -1.0])}, t.init(p), hessian={"w": torch.ones(2)})
        >>> u["w"]
        tensor([ 1., -1.])
    """
    check_betas((b1, b2), "betas")
    check_hyperparam("rho", rho)
    check_nonnegative("rho", rho)
    check_hyperparam("eps", eps)
    check_positive("eps", eps)
    check_int("update_every", update_every, 1)

    def init(params: Params) -> ScaleBySophiaState:
        leaves = pytree.tree_leaves(params)
        # float16 params get float32 state, and the math below runs in float32 at least.
        return ScaleBySophiaState(
            zero_count(leaf_device(leaves)), lp.init_moments(params, None), lp.init_moments(params, None)
        )

    def update(grads, state, params=None, *, hessian: PyTree = None, **extra):
        gs, wide, mu = lp.load_moments(grads, state.mu, params)
        hs = lp.load_moments(grads, state.hessian)[2]
        spec = pytree.tree_structure(grads)
        beta1, beta2 = resolve(b1, state.count), resolve(b2, state.count)
        if hessian is not None:
            est = tr.check_match(hessian, state.hessian, "hessian", "params", dtype=False)
            est = [e.to(h.dtype) for e, h in zip(est, hs)]
            # h ← β₂·h + (1-β₂)·ĥ on refresh updates (count ≡ 0 mod update_every)
            refreshed = ls.cast_like(ls.lincomb(beta2, hs, 1.0 - beta2, est), hs)
            if update_every > 1:
                due = torch.remainder(state.count, update_every) == 0
                refreshed = ls.where(due, refreshed, hs)
            hs = refreshed
        mu = ls.cast_like(ls.ema(mu, wide, beta1), wide)
        denom = ls.add_scalar(ls.mul(hs, resolve(rho, state.count)), eps)
        # u = sign(m) · min(|m| / (ρ·h + ε), 1)
        out = [torch.sign(m) * torch.clamp(m.abs() / d, max=1.0) for m, d in zip(mu, denom)]
        out = ls.cast_like(out, gs)
        new = ScaleBySophiaState(
            state.count + 1, lp.store_moments(mu, state.mu, None), lp.store_moments(hs, state.hessian, None)
        )
        return pytree.tree_unflatten(out, spec), new

    return with_needs(Transform(init, update), Needs())


def gnb_hessian(
    logits_fn: Callable[[Params, Any], Tensor],
    params: Params,
    batch: Any,
    *,
    generator: torch.Generator | None = None,
    labels: Tensor | None = None,
) -> Params:
    """The Gauss-Newton-Bartlett curvature estimate `B · ĝ ⊙ ĝ`, with ĝ the gradient of the
    mean cross-entropy against labels sampled from the model's own logits.

    One forward and one backward through `torch.func.vjp`; labels are drawn by the
    Gumbel-max trick (no host sync). Pass the result as `update(..., hessian=...)` of `sophia`.

    Args:
      logits_fn: `logits_fn(params, batch) -> logits` of shape (..., vocab).
      params: the params tree to differentiate.
      batch: passed to `logits_fn` as it is.
      generator: the random generator for the sampled labels.
      labels: the labels to use instead of sampling (shape logits.shape[:-1]).

    Returns:
      A tree like params: B · ĝ², B the number of predictions (logits rows).

    Examples:
        >>> import torch, purestep.core as ps
        >>> params = {"w": torch.zeros(3, 4)}
        >>> h = ps.gnb_hessian(lambda p, x: x @ p["w"], params, torch.eye(3), labels=torch.zeros(3, dtype=torch.long))
        >>> h["w"][0]
        tensor([0.1875, 0.0208, 0.0208, 0.0208])

    References:
        Liu et al., Sophia: A Scalable Stochastic Second-order Optimizer for Language Model Pre-training, 2023.
    """
    logits, vjp_fn = torch.func.vjp(lambda p: logits_fn(p, batch), params)  # type: ignore[misc]  # no aux: two values
    work = torch.promote_types(logits.dtype, torch.float32)  # softmax in float32 at least
    flat = logits.detach().reshape(-1, logits.shape[-1]).to(work)  # (B, vocab)
    rows = flat.shape[0]
    if labels is None:
        u = torch.rand(flat.shape, generator=generator, device=flat.device, dtype=flat.dtype)
        gumbel = -torch.log(-torch.log(u.clamp(min=torch.finfo(u.dtype).tiny)))
        labels = torch.argmax(flat + gumbel, dim=-1)
    labels = labels.reshape(-1).to(flat.device)
    if labels.shape[0] != rows:
        raise ValueError(f"labels has {labels.shape[0]} entries for {rows} rows of logits")
    # d mean-CE / d logits = (softmax - onehot) / B
    dlogits = (torch.softmax(flat, dim=-1) - F.one_hot(labels, flat.shape[-1]).to(flat.dtype)) / rows
    (ghat,) = vjp_fn(dlogits.reshape(logits.shape).to(logits.dtype))
    return pytree.tree_map(lambda g: rows * g * g, ghat)


def sophia(
    lr: ScalarOrSchedule = 1e-4,
    betas: tuple[ScalarOrSchedule, ScalarOrSchedule] = (0.965, 0.99),
    rho: ScalarOrSchedule = 0.04,
    weight_decay: ScalarOrSchedule = 0.1,
    eps: float = 1e-15,
    update_every: int = 10,
) -> Transform:
    """SophiaG, = the official `SophiaG` (`sophia-opt`) with its `bs` folded into the estimate.

    m ← β₁·m + (1-β₁)·g;  h ← β₂·h + (1-β₂)·ĥ on updates t ≡ 0 (mod k), else h unchanged;
    p ← p - η·(sign(m)·min(|m| / (ρ·h + ε), 1) + λ·p),
    with η = `lr`, (β₁, β₂) = `betas`, ρ = `rho`, ε = `eps`, λ = `weight_decay`,
    k = `update_every`, ĥ the curvature estimate passed as `update(..., hessian=ĥ)`
    (e.g. `ps.gnb_hessian`, = B·ĝ²). Each element moves by at most η (plus decay).

    Warning:
        The official optimizer keeps the EMA of ĝ² and multiplies by the batch size `bs`
        when stepping; here ĥ already carries it (B·ĝ²), so pass `bs * grad**2` to match.
        The refresh happens inside the update that receives `hessian` (the official loop
        calls `update_hessian()` after the step), and updates without one keep h.

    Examples:
        >>> import torch, purestep.core as ps
        >>> opt = ps.sophia(lr=0.1, weight_decay=0.0)
        >>> params = {"w": torch.ones(2)}
        >>> g = {"w": torch.tensor([1.0, -1.0])}
        >>> h = {"w": torch.tensor([1e-3, 1e3])}  # flat: clipped to lr; curved: a small step
        >>> updates, state = opt.update(g, opt.init(params), params, hessian=h)
        >>> updates["w"]
        tensor([-0.1000,  0.0088])

    References:
        Liu et al., Sophia: A Scalable Stochastic Second-order Optimizer for Language Model Pre-training, 2023.
    """
    b1, b2 = check_betas(betas)
    return chain(scale_by_sophia(b1, b2, rho, eps, update_every=update_every), decayed(weight_decay), scale_by_lr(lr))
