"""Parameter averaging: EMA and SWA, = `torch.optim.swa_utils.AveragedModel`.

Both are elementwise (no reduction across a leaf), so under FSDP each rank
averages its own shard.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import torch
import torch.utils._pytree as pytree
from torch import Tensor

from . import _foreach as ls
from . import _tree as tr
from ._base import Params, ScalarOrSchedule, check_hyperparam, is_static, leaf_device, resolve, zero_count


class ParamsEmaState(NamedTuple):
    """State of `params_ema`: the averaged params and how many updates went in."""

    count: Tensor  # type: ignore[assignment]  # (), int64: updates averaged in (AveragedModel's n_averaged)
    params: Params  # the averaged params


class ParamsSwaState(NamedTuple):
    """State of `params_swa`: the averaged params and how many updates went in."""

    count: Tensor  # type: ignore[assignment]  # (), int64: updates averaged in (AveragedModel's n_averaged)
    params: Params  # the averaged params


class Averager(NamedTuple):
    """A pair of pure functions: `avg = init(params)`, `avg = update(avg, params)`; read `avg.params`."""

    init: Callable[[Params], NamedTuple]
    update: Callable[[NamedTuple, Params], NamedTuple]


def _lerp(ms: list[Tensor], xs: list[Tensor], w: Tensor, keep: Tensor) -> list[Tensor]:
    """m + w·(x - m) for 0-d float64 `w`, `keep` (0 on the first update, else 1): four foreach kernels."""
    floats = [i for i, m in enumerate(ms) if torch.is_floating_point(m) or torch.is_complex(m)]
    out = list(xs)  # non-float leaves (step counters, int buffers) follow the params, as buffers do
    if not floats:
        return out
    fm, fx = [ms[i] for i in floats], [xs[i] for i in floats]
    # m + w·(x - m) with m zeroed on the first update (count 0, w = 1), which then copies x exactly
    refs = fm
    fm = ls.mul(fm, keep)
    res = ls.cast_like(ls.axpy(w, ls.sub(fx, fm), fm), refs)  # a 0-d leaf stays in its dtype
    for i, r in zip(floats, res):
        out[i] = r
    return out


def _averager(weight_fn: Callable[[Tensor], Tensor], state_cls: type, dtype: torch.dtype | None) -> Averager:
    def init(params: Params):
        leaves = pytree.tree_leaves(params)
        avg = pytree.tree_map(lambda p: p.detach().clone(), tr.tree_cast(params, dtype))
        return state_cls(zero_count(leaf_device(leaves)), avg)

    def update(avg, params: Params):
        xs = tr.check_match(params, avg.params, "params", "averaged params", dtype=False)
        ms, spec = pytree.tree_flatten(avg.params)
        xs = [x.detach().to(m.dtype) for x, m in zip(xs, ms)]
        keep = (avg.count != 0).to(torch.float64)
        out = _lerp(ms, xs, weight_fn(avg.count), keep)
        return state_cls(avg.count + 1, pytree.tree_unflatten(out, spec))

    return Averager(init, update)


def params_ema(decay: ScalarOrSchedule = 0.999, *, dtype: torch.dtype | None = None) -> Averager:
    """Exponential moving average of params, = `AveragedModel(multi_avg_fn=get_ema_multi_avg_fn(decay))`.

    θ̄₁ = θ₁ (the first update copies);  θ̄ₜ = decay·θ̄ₜ₋₁ + (1 - decay)·θₜ afterwards.

    Args:
      decay: in (0, 1); a float, a 0-d tensor or a schedule of the number of updates
        averaged so far.
      dtype: keep the average in this dtype (e.g. float32 for bf16 params); None keeps each param's.

    Returns:
      `Averager(init, update)`: `avg = init(params)`, `avg = update(avg, params)`;
      the averaged params are `avg.params`.

    Examples:
        >>> import torch, purestep.core as ps
        >>> ema = ps.params_ema(0.5)
        >>> avg = ema.init({"w": torch.zeros(1)})
        >>> avg = ema.update(avg, {"w": torch.full((1,), 4.0)})  # first update copies
        >>> avg = ema.update(avg, {"w": torch.zeros(1)})
        >>> avg.params
        {'w': tensor([2.])}
    """
    check_hyperparam("decay", decay)
    if is_static(decay) and not 0.0 < decay < 1.0:  # type: ignore[operator]  # is_static: a number
        raise ValueError(f"decay must be in (0, 1), got {decay!r}")

    def weight(count: Tensor) -> Tensor:
        first = (count == 0).to(torch.float64)
        # 1 on the first update (a copy), 1 - decay afterwards; exact in both cases.
        return first + (1.0 - first) * (1.0 - resolve(decay, count))

    return _averager(weight, ParamsEmaState, dtype)


def params_swa(*, dtype: torch.dtype | None = None) -> Averager:
    """Equal-weight average of every params passed to `update` (SWA), = `AveragedModel`'s default average.

    θ̄ₙ = θ̄ₙ₋₁ + (θₙ - θ̄ₙ₋₁)/n, so the first update copies and θ̄ₙ is the mean of θ₁…θₙ.

    Args:
      dtype: keep the average in this dtype; None keeps each param's.

    Warning:
      `AveragedModel` divides by n on CPU but lerps with a float32 weight 1/n on
      CUDA; this lerps with 1/n computed in float64 (one fused kernel), which equals
      the CPU result to rounding and is the more exact of the two for float64 params.

    Examples:
        >>> import torch, purestep.core as ps
        >>> swa = ps.params_swa()
        >>> avg = swa.init({"w": torch.zeros(1)})
        >>> for v in (1.0, 2.0, 6.0):
        ...     avg = swa.update(avg, {"w": torch.full((1,), v)})
        >>> avg.params
        {'w': tensor([3.])}

    References:
        Izmailov et al., Averaging Weights Leads to Wider Optima and Better Generalization, 2018.
    """

    def weight(count: Tensor) -> Tensor:
        return 1.0 / (count + 1).to(torch.float64)  # 1 on the first update: an exact copy

    return _averager(weight, ParamsSwaState, dtype)
