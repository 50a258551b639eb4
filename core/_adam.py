"""Adam's rule, written once, and the eager kernels registered against it.

    m ← β₁·m + (1-β₁)·g,   v ← β₂·v + (1-β₂)·g²                      `moments`
    bc₁ = 1 - β₁ᵗ,   bc₂ = 1 - β₂ᵗ   (t counts this update)            `bias_corrections`
    u = (m / bc₁) / (√(v / bc₂ + ε_root) + ε)                          `direction`

`definition` is the rule over lists of leaves (foreach kernels where they apply, one op per
leaf under torch.func and inside a compiled step); it is what `scale_by_adam` computes.
Decoupled weight decay and the learning rate are other transforms (`add_decayed_weights`,
`scale_by_lr`). The eager CPU paths run faster forms of the same rule, registered in
`IMPLEMENTATIONS` as torch.optim keeps `_single_tensor_adam` / `_multi_tensor_adam` /
`_fused_adam` behind one class, each equal to `definition` to rounding
(tests/core/test_adam.py):

- "leafwise": one leaf at a time, its temporaries reused in place;
- "apply_leafwise": torch.optim.AdamW's step fused with the apply, `p ← a·p + b·u` with m
  and v updated in their own storage, a cache block of leaves at a time;
- "apply_fused": the same through torch's fused AdamW kernel (one pass over memory per
  leaf), where it takes the step: on the CPU, one float dtype, a nonzero lr.

AdEMAMix (a slow momentum beside m, in the numerator) and MARS (Adam on a corrected,
clipped gradient) reuse `moments`, `bias_corrections` and `denominator`/`direction`; SOAP
reuses `moments` in its eigenbasis. Per-step scalars (the bias corrections) are 0-d float64
tensors computed once per step (`ps.once`), never per element.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import Tensor

from . import _foreach as ls
from . import _low_precision as lp
from ._base import once

Scalar = Any  # a float or a 0-d tensor


def bias_corrections(count: Tensor, beta1: Scalar, beta2: Scalar) -> tuple[Tensor, Tensor]:
    """`(1 - β₁ᵗ, 1 - β₂ᵗ)` with t = count + 1, 0-d float64, computed once per step."""
    t = (count + 1).to(torch.float64)
    return once(1.0 - beta1**t), once(1.0 - beta2**t)


def moments(mu: list[Tensor], nu: list[Tensor], xs: list[Tensor], beta1: Scalar, beta2: Scalar) -> tuple[list, list]:
    """The new first and second moments of `xs`, in `xs`' dtypes (the compute dtype)."""
    return ls.cast_like(ls.ema(mu, xs, beta1), xs), ls.cast_like(ls.ema_sq(nu, xs, beta2), xs)


def denominator(nu: list[Tensor], bc2: Scalar, eps: Scalar, eps_root: Scalar = 0.0) -> list[Tensor]:
    """`√(v / bc₂ + ε_root) + ε`, new tensors (updated in place as they are made: in eager
    mode allocation costs more than the math)."""
    denom = ls.mul(nu, 1.0 / bc2)
    if isinstance(eps_root, Tensor) or eps_root:  # injected: a 0-d tensor, added whatever its value
        denom = ls.add_scalar_(denom, eps_root)
    return ls.add_scalar_(ls.sqrt_(denom), eps)


def direction(
    mu: list[Tensor], nu: list[Tensor], bc1: Scalar, bc2: Scalar, eps: Scalar, eps_root: Scalar = 0.0
) -> list[Tensor]:
    """`(m / bc₁) / (√(v / bc₂ + ε_root) + ε)`, new tensors (`mu` is only read)."""
    return ls.mul_(ls.div_into_(mu, denominator(nu, bc2, eps, eps_root)), 1.0 / bc1)


def definition(
    grads: Any,
    gs: list[Tensor],
    wide: list[Tensor],
    mu: list[Tensor],
    nu: list[Tensor],
    beta1: Scalar,
    beta2: Scalar,
    bc1: Scalar,
    bc2: Scalar,
    eps: Scalar,
    eps_root: Scalar = 0.0,
    nu_max: Any = None,
) -> tuple[list, list, Any]:
    """The rule over lists: new m and v and the updates (in `gs`' dtypes), from the grads
    `wide` in the compute dtype and the moments loaded in it. With `nu_max` (AMSGrad, the
    stored tree) v̂ is built from max(ν_max, v) and the updates come as `(u, new ν_max)`."""
    mu, nu = moments(mu, nu, wide, beta1, beta2)
    if nu_max is not None:
        nu_max = [torch.maximum(a, b) for a, b in zip(lp.load_moments(grads, nu_max, second=True)[2], nu)]
    out = ls.cast_like(direction(mu, nu if nu_max is None else nu_max, bc1, bc2, eps, eps_root), gs)
    return mu, nu, (out if nu_max is None else (out, nu_max))


def leafwise(gs, mu, nu, beta1, beta2, bc1, bc2, eps):
    """The rule one leaf at a time (eager CPU, see `ls.leafwise`): new m, v and updates,
    each a fresh tensor; the temporaries of a leaf are reused in place.

    u = m / (√v · bc₁/√bc₂ + ε·bc₁), = (m / bc₁) / (√(v / bc₂) + ε) to rounding, one pass
    over memory fewer than scaling m and v apart.
    """
    # Scalars once per step, not per leaf (a 0-d tensor op costs as much as a small leaf's).
    scale, shift, w1, w2 = bc1 / torch.sqrt(bc2), eps * bc1, 1.0 - beta1, 1.0 - beta2
    new_mu, new_nu, out = [], [], []
    for g, m, v in zip(gs, mu, nu):
        m = torch.lerp(m, g, w1)  # β₁·m + (1-β₁)·g
        if m.dtype != g.dtype:  # a 0-d leaf, promoted by a 0-d float64 β₁ (in place ops keep their dtype)
            m = m.to(g.dtype)
        # β₂·v + (1-β₂)·g², as torch (and `apply_leafwise`) round it; `out=` keeps a 0-d
        # leaf's dtype where a 0-d float64 β₂ would promote it, as the in-place ops do.
        v = torch.mul(v, beta2, out=torch.empty_like(v)).addcmul_(g, g, value=w2)
        d = torch.sqrt(v).mul_(scale).add_(shift)
        out.append(torch.div(m, d, out=d))
        new_mu.append(m)
        new_nu.append(v)
    return new_mu, new_nu, out


def apply_leafwise(gs, mu, nu, ps_, beta1, beta2, bc1, bc2, eps, a, b):
    """`p ← a·p + b·u` with m and v updated in place, a block of leaves at a time (eager
    CPU, see `ls.leafwise`): torch.optim.AdamW's step, 7 passes per leaf.

    m and v are bitwise torch's (the same ops); p equals it to rounding: with r = √bc₂,
    u = m·(r/bc₁) / (√v + ε·r), = (m/bc₁) / (√v/r + ε), one division pass fewer.
    """
    r = torch.sqrt(bc2)
    shift, step, w1, w2 = eps * r, b * r / bc1, 1.0 - beta1, 1.0 - beta2
    decay = not ls.is_one(a)
    for lo, hi in ls.cache_blocks(gs):
        g, m, v, p = gs[lo:hi], mu[lo:hi], nu[lo:hi], ps_[lo:hi]
        torch._foreach_lerp_(m, g, w1)  # β₁·m + (1-β₁)·g
        torch._foreach_mul_(v, beta2)  # β₂·v + (1-β₂)·g²
        torch._foreach_addcmul_(v, g, g, value=w2)  # a 0-d CPU tensor as `value`: no device sync
        d = torch._foreach_sqrt(v)
        torch._foreach_add_(d, shift)
        if decay:
            torch._foreach_mul_(p, a)  # decoupled decay: a = 1 - η·λ
        torch._foreach_addcdiv_(p, m, d, value=step)


def apply_fused(gs, mu, nu, ps_, beta1, beta2, t, eps, a, b) -> bool:
    """`apply_leafwise`'s step through torch's fused AdamW kernel (`torch._fused_adamw_`, as
    torch.optim.AdamW(fused=True) runs it), t the step's count (this update included): one
    read and write of p, m, v and one read of g per element, not seven passes. With
    `p ← a·p + b·u` read as AdamW's lr = -b and decay λ = (1 - a) / lr. False (nothing done)
    where the kernel does not take the step: another device, dtypes that differ, a tensor
    not contiguous (the kernel walks its storage), a zero lr, scalars autograd records."""
    if not _fused_takes(gs, mu, nu, ps_, beta1, beta2, t, eps, a, b):
        return False
    fused = torch._fused_adamw_  # type: ignore[attr-defined]
    beta1, beta2, t, eps, a, b = (float(s) for s in (beta1, beta2, t, eps, a, b))  # CPU values: nothing to wait for
    lr = -b
    step = torch.tensor(t, dtype=torch.float32, device=ps_[0].device)  # read by the kernel, never advanced by it
    fused(
        ps_, gs, mu, nu, [], [step] * len(ps_), lr=lr, beta1=beta1, beta2=beta2, weight_decay=(1.0 - a) / lr,
        eps=eps, amsgrad=False, maximize=False, grad_scale=None, found_inf=None,
    )  # fmt: skip
    return True


def _fused_takes(gs, mu, nu, ps_, *scalars) -> bool:
    if getattr(torch, "_fused_adamw_", None) is None:
        return False
    dtype = ps_[0].dtype
    if any(x.device.type != "cpu" or x.dtype != dtype or not x.is_contiguous() for xs in (gs, mu, nu, ps_) for x in xs):
        return False
    if any(isinstance(s, Tensor) and (s.requires_grad or s.numel() != 1) for s in scalars):
        return False
    b = float(scalars[-1])
    return b != 0.0 and b == b


def kernel(
    plain: tuple | None,
    beta1: Scalar,
    beta2: Scalar,
    eps: Scalar,
    a: Scalar = 1.0,
    b: Scalar = 1.0,
    *,
    t: Scalar = None,
) -> str:
    """The one dispatch: the name of the kernel in `IMPLEMENTATIONS` that runs this step.
    "definition" unless the moments are plain leaves (`plain`: (gs, mu, nu, params) lists)
    that the eager kernels take (`ls.leafwise`: eager, on the CPU, scalars it can read);
    then "leafwise" for the update, or for the in-place form (`t`, this update's count,
    given) "apply_fused" where torch's fused AdamW takes the step, else "apply_leafwise"."""
    if plain is None or not ls.leafwise([x for xs in plain for x in xs], beta1, beta2, eps, a, b):
        return "definition"
    if t is None:
        return "leafwise"
    return "apply_fused" if _fused_takes(*plain, beta1, beta2, t, eps, a, b) else "apply_leafwise"


IMPLEMENTATIONS: dict[str, Callable[..., Any]] = {
    "definition": definition,
    "leafwise": leafwise,
    "apply_leafwise": apply_leafwise,
    "apply_fused": apply_fused,
}
