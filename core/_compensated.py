"""Compensated updates for bf16/fp16 params: the part of an update below their precision
carried in the state (Kahan) or rounded stochastically, so small updates accumulate."""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
import torch.utils._pytree as pytree
from torch import Tensor

from . import _tree as tr
from ._base import Params, Transform, leaf_device, require_params, zero_count
from ._low_precision import leaf_key, round_to
from .engine.needs import Needs, with_needs


class CompensatedUpdatesState(NamedTuple):
    """State of `compensated_updates`: the step count and the rounding error carried per param."""

    count: Tensor  # type: ignore[assignment]  # (), int64: keys stochastic rounding
    compensation: Params  # what rounding p + u dropped, in the param's dtype (0 elements for wide params)


_METHODS = ("kahan", "stochastic")


def compensated_updates(*, method: str = "kahan") -> Transform:
    """Apply updates to bf16/fp16 params without losing the part below their precision.

    Put it last in the chain, right before `apply_updates`: for each 16-bit param it
    returns the update that moves `p` to the rounding of the exact sum s = p + u + c.
    With `method="kahan"` (compensated summation, as torch-optimi's `kahan_sum`) the
    rounding is to nearest and c, the error it dropped, is kept in the state in the
    param's dtype and added back next step, so small updates accumulate instead of
    vanishing. With `method="stochastic"` s is rounded stochastically (unbiased in
    expectation) and nothing is carried. float32/float64 params pass through.

    Args:
      method: "kahan" (a compensation buffer per 16-bit param, in the state and in
        checkpoints) or "stochastic" (no buffer; randomness keyed by the step count).

    Warning:
        The returned update is exact only when added to the same params in their dtype
        (`ps.apply_updates`, `make_step`, `make_update` do); anything between this
        transform and the addition breaks the bookkeeping.

    Examples:
        >>> import torch, purestep.core as ps
        >>> opt = ps.chain(ps.sgd(lr=1.0), ps.compensated_updates())
        >>> p = {"w": torch.ones(1, dtype=torch.bfloat16)}
        >>> state = opt.init(p)
        >>> for _ in range(100):  # 1e-3 is below half a bf16 ulp of 1.0: plain bf16 stays at 1
        ...     u, state = opt.update({"w": torch.full((1,), -1e-3, dtype=torch.bfloat16)}, state, p)
        ...     p = ps.apply_updates(p, u)
        >>> round(p["w"].item(), 2)
        1.1
    """
    if method not in _METHODS:
        raise ValueError(f"method must be 'kahan' or 'stochastic', got {method!r}")

    def buffer(p: Tensor) -> Tensor:
        if method == "kahan" and p.dtype in (torch.bfloat16, torch.float16):
            return torch.zeros_like(p)
        return torch.zeros(0, dtype=p.dtype, device=p.device)

    def init(params: Params) -> CompensatedUpdatesState:
        count = zero_count(leaf_device(pytree.tree_leaves(params)))
        return CompensatedUpdatesState(count, pytree.tree_map(buffer, params))

    def update(updates, state, params=None, **extra):
        require_params(params, "compensated_updates")
        ps_ = tr.check_match(params, updates, "params", "updates", dtype=False)
        us, spec = pytree.tree_flatten(updates)
        cs, cspec = pytree.tree_flatten(state.compensation)
        if cspec != spec:
            raise ValueError(
                "compensated_updates: the updates are not structured like the params this state was built for"
            )
        out, new_cs = [], []
        for i, (p, u, c) in enumerate(zip(ps_, us, cs)):
            if p.dtype not in (torch.bfloat16, torch.float16):
                out.append(u)
                new_cs.append(c)
                continue
            s = p.float() + u.float() + (c.float() if c.numel() else 0.0)  # the exact target, float32
            # Rounded with integer ops: a fused compiled kernel keeps the rounding (see round_to).
            target = round_to(s, p.dtype, None if method == "kahan" else leaf_key(state.count, i, salt=1))
            step = (target.float() - p.float()).to(p.dtype)
            out.append(step)
            if c.numel():
                applied = (p.float() + step.float()).to(p.dtype)  # what apply_updates will store
                left = s - applied.float()
                new_cs.append(torch.where(torch.isfinite(left), left, torch.zeros_like(left)).to(p.dtype))
            else:
                new_cs.append(c)
        new_state = CompensatedUpdatesState(state.count + 1, pytree.tree_unflatten(new_cs, spec))
        return pytree.tree_unflatten(out, spec), new_state

    def flat(tree: Any) -> str | None:  # placeholders (0-d, or (0,) without Kahan) are not shaped like the params
        if method != "kahan":
            return f"compensated_updates(method={method!r}) keeps an empty placeholder per leaf, not a buffer"
        narrow = all(x.dtype in (torch.bfloat16, torch.float16) for x in pytree.tree_leaves(tree))
        return None if narrow else "compensated_updates keeps a 0-d placeholder for each leaf that is not 16-bit"

    return with_needs(Transform(init, update), Needs(flat=flat))
