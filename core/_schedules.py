"""Schedules: callables `step -> value` for lr, weight decay, betas.

A step is an int or a 0-d tensor (optimizers pass the number of updates already
applied as a 0-d float64 tensor). A tensor step gives a 0-d float64 tensor on the
step's device, computed with `torch.where` / `clamp` only, so a schedule traces under
`torch.compile(fullgraph=True)`; an int step gives a Python float, computed by the
same tensor code, so both agree exactly.
"""

from __future__ import annotations

import math
import numbers
from typing import Callable, Mapping, Sequence

import torch
from torch import Tensor

from ._base import Schedule, as_float64, check_int

_Fn = Callable[[Tensor], Tensor]  # float64 step -> float64 value, both 0-d


def _step_tensor(step: int | float | Tensor) -> Tensor:
    if isinstance(step, Tensor):
        if step.dim() != 0:
            raise ValueError(f"a schedule's step must be an int or a 0-d tensor, got shape {tuple(step.shape)}")
        return step.to(torch.float64)
    if isinstance(step, bool) or not isinstance(step, numbers.Real):
        raise ValueError(f"a schedule's step must be an int or a 0-d tensor, got {step!r}")
    return torch.tensor(float(step), dtype=torch.float64)


def _schedule(fn: _Fn, name: str) -> Schedule:
    """Wrap a float64-tensor function as a schedule taking int or tensor steps."""

    def schedule(step: int | Tensor) -> float | Tensor:
        value = fn(_step_tensor(step))
        return value if isinstance(step, Tensor) else float(value)

    schedule.__name__ = schedule.__qualname__ = name
    return schedule


def _check_value(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite float, got {value!r}")
    return float(value)


def _linear(t: Tensor, start: float, end: float, steps: int) -> Tensor:
    # optax.polynomial_schedule with power 1: (start - end)·(1 - c/steps) + end, c = clip(t, 0, steps)
    if steps <= 0:
        return torch.full_like(t, start)
    frac = 1.0 - torch.clamp(t, 0.0, float(steps)) / steps
    return (start - end) * frac + end


def _cos_anneal(start: float, end: float, pct: Tensor) -> Tensor:
    # OneCycleLR._annealing_cos: end + (start - end)/2·(cos(π·pct) + 1)
    return end + (start - end) / 2.0 * (torch.cos(math.pi * pct) + 1.0)


def _lin_anneal(start: float, end: float, pct: Tensor) -> Tensor:
    # OneCycleLR._annealing_linear: (end - start)·pct + start
    return (end - start) * pct + start


# --------------------------------------------------------------------------- #
# Simple shapes.
# --------------------------------------------------------------------------- #


def constant_schedule(value: float) -> Schedule:
    """The schedule that is `value` at every step.

    Examples:
        >>> import purestep.core as ps
        >>> ps.constant_schedule(0.1)(1000)
        0.1
    """
    value = _check_value("value", value)
    return _schedule(lambda t: torch.full_like(t, value), "constant_schedule")


def linear_schedule(init: float, end: float, steps: int, *, begin: int = 0) -> Schedule:
    """Linear from `init` to `end` over `steps` steps, then `end`, = `optax.linear_schedule`.

    v(t) = init + (end - init)·clip(t - begin, 0, steps)/steps; `steps=0` is the
    constant `init` (as optax).

    Args:
      init: the value at step `begin` and before.
      end: the value from step `begin + steps` on.
      steps: the length of the ramp (optax's `transition_steps`).
      begin: the step where the ramp starts (optax's `transition_begin`).

    Examples:
        >>> import purestep.core as ps
        >>> ps.linear_schedule(1.0, 0.0, steps=4)(1)
        0.75
    """
    init, end = _check_value("init", init), _check_value("end", end)
    steps = check_int("steps", steps)
    begin = check_int("begin", begin)
    return _schedule(lambda t: _linear(t - begin, init, end, steps), "linear_schedule")


def cosine_schedule(init: float, steps: int, final: float = 0.0) -> Schedule:
    """Half a cosine from `init` to `final` over `steps`, then `final`, = `CosineAnnealingLR(T_max=steps, eta_min=final)`.

    v(t) = final + (init - final)·(1 + cos(π·min(t, steps)/steps))/2.

    Warning:
      `CosineAnnealingLR` keeps following the cosine past `T_max` (the lr rises
      again); this schedule stays at `final`, as optax's cosine decay does.

    Examples:
        >>> import purestep.core as ps
        >>> ps.cosine_schedule(1.0, steps=10, final=0.0)(5)
        0.5
    """
    init, final = _check_value("init", init), _check_value("final", final)
    steps = check_int("steps", steps, 1)

    def fn(t: Tensor) -> Tensor:
        tau = torch.clamp(t, 0.0, float(steps)) / steps
        return final + (init - final) * (1.0 + torch.cos(math.pi * tau)) / 2.0

    return _schedule(fn, "cosine_schedule")


def warmup_cosine_schedule(
    peak: float, warmup_steps: int, total_steps: int, init: float = 0.0, final: float = 0.0
) -> Schedule:
    """Linear warmup to `peak`, then cosine decay to `final` at `total_steps`, = `optax.warmup_cosine_decay_schedule`.

    v(t) = init + (peak - init)·t/W for t < W;  then final + (peak - final)·(1 + cos(π·τ))/2 with
    τ = min(t - W, T - W)/(T - W), W = `warmup_steps`, T = `total_steps` (the whole run, warmup included).

    Examples:
        >>> import purestep.core as ps
        >>> s = ps.warmup_cosine_schedule(1.0, warmup_steps=2, total_steps=12)
        >>> [round(s(t), 3) for t in (0, 1, 2, 7, 12, 20)]
        [0.0, 0.5, 1.0, 0.5, 0.0, 0.0]
    """
    peak, init, final = _check_value("peak", peak), _check_value("init", init), _check_value("final", final)
    warmup_steps = check_int("warmup_steps", warmup_steps)
    total_steps = check_int("total_steps", total_steps, 1)
    if warmup_steps >= total_steps:
        raise ValueError(
            f"warmup_steps ({warmup_steps}) must be < total_steps ({total_steps}): the warmup would outlast the run"
        )
    decay = total_steps - warmup_steps
    alpha = 0.0 if peak == 0.0 else final / peak  # optax's form: peak·((1 - α)·c + α)

    def fn(t: Tensor) -> Tensor:
        warm = _linear(t, init, peak, warmup_steps)
        tau = torch.clamp(t - warmup_steps, 0.0, float(decay)) / decay
        cos = peak * ((1.0 - alpha) * 0.5 * (1.0 + torch.cos(math.pi * tau)) + alpha)
        return torch.where(t < warmup_steps, warm, cos)

    return _schedule(fn, "warmup_cosine_schedule")


_WSD_SHAPES = ("linear", "cosine", "sqrt")


def wsd_schedule(
    peak: float,
    warmup_steps: int,
    total_steps: int,
    decay_steps: int,
    init: float = 0.0,
    final: float = 0.0,
    shape: str = "linear",
) -> Schedule:
    """Warmup-stable-decay: linear warmup to `peak`, flat, then decay to `final` over the last `decay_steps`.

    With W = `warmup_steps`, T = `total_steps`, D = `decay_steps`, τ = clip((t - (T - D))/D, 0, 1):
    v(t) = init + (peak - init)·t/W for t < W; `peak` until T - D; then
    "linear": peak - (peak - final)·τ, "cosine": final + (peak - final)·(1 + cos(π·τ))/2,
    "sqrt": peak - (peak - final)·√τ. `final` from T on.

    Examples:
        >>> import purestep.core as ps
        >>> s = ps.wsd_schedule(1.0, warmup_steps=2, total_steps=10, decay_steps=4)
        >>> [s(t) for t in (0, 1, 2, 5, 6, 8, 10)]
        [0.0, 0.5, 1.0, 1.0, 1.0, 0.5, 0.0]

    References:
        Hägele et al., Scaling Laws and Compute-Optimal Training Beyond Fixed Training Durations, 2024.
    """
    peak, init, final = _check_value("peak", peak), _check_value("init", init), _check_value("final", final)
    warmup_steps = check_int("warmup_steps", warmup_steps)
    total_steps = check_int("total_steps", total_steps, 1)
    decay_steps = check_int("decay_steps", decay_steps, 1)
    if shape not in _WSD_SHAPES:
        raise ValueError(f"shape must be one of {', '.join(map(repr, _WSD_SHAPES))}, got {shape!r}")
    if warmup_steps > total_steps:
        raise ValueError(f"warmup_steps ({warmup_steps}) must be <= total_steps ({total_steps})")
    if decay_steps > total_steps:
        raise ValueError(f"decay_steps ({decay_steps}) must be <= total_steps ({total_steps})")
    if warmup_steps + decay_steps > total_steps:
        raise ValueError(
            f"decay_steps ({decay_steps}) + warmup_steps ({warmup_steps}) must be <= total_steps ({total_steps}): "
            "shorten the decay or the warmup"
        )
    start = total_steps - decay_steps

    def fn(t: Tensor) -> Tensor:
        warm = _linear(t, init, peak, warmup_steps)
        tau = torch.clamp(t - start, 0.0, float(decay_steps)) / decay_steps
        if shape == "linear":
            dec = peak - (peak - final) * tau
        elif shape == "cosine":
            dec = final + (peak - final) * (1.0 + torch.cos(math.pi * tau)) / 2.0
        else:
            dec = peak - (peak - final) * torch.sqrt(tau)
        return torch.where(t < warmup_steps, warm, dec)

    return _schedule(fn, "wsd_schedule")


def inverse_sqrt_schedule(peak: float, warmup_steps: int, *, init: float = 0.0) -> Schedule:
    """Linear warmup to `peak`, then `peak·√(W/t)` (the Transformer's "Noam" decay).

    v(t) = init + (peak - init)·t/W for t < W, peak·√(W/t) from t = W = `warmup_steps` on.

    Examples:
        >>> import purestep.core as ps
        >>> s = ps.inverse_sqrt_schedule(1.0, warmup_steps=4)
        >>> [s(t) for t in (0, 2, 4, 16)]
        [0.0, 0.5, 1.0, 0.5]

    References:
        Vaswani et al., Attention Is All You Need, 2017 (section 5.3).
    """
    peak, init = _check_value("peak", peak), _check_value("init", init)
    warmup_steps = check_int("warmup_steps", warmup_steps, 1)

    def fn(t: Tensor) -> Tensor:
        warm = _linear(t, init, peak, warmup_steps)
        decay = peak * torch.sqrt(warmup_steps / torch.clamp(t, min=float(warmup_steps)))
        return torch.where(t < warmup_steps, warm, decay)

    return _schedule(fn, "inverse_sqrt_schedule")


def piecewise_constant_schedule(init: float, boundaries_and_scales: Mapping[int, float] | None = None) -> Schedule:
    """`init` times every scale whose boundary has been reached, = `optax.piecewise_constant_schedule`.

    v(t) = init · Π_{b ≤ t} scale_b.

    Examples:
        >>> import purestep.core as ps
        >>> s = ps.piecewise_constant_schedule(1.0, {3: 0.5, 6: 0.1})
        >>> [s(t) for t in (0, 2, 3, 5, 6)]
        [1.0, 1.0, 0.5, 0.5, 0.05]
    """
    init = _check_value("init", init)
    items = sorted((boundaries_and_scales or {}).items())
    for b, s in items:
        if isinstance(b, bool) or not isinstance(b, int):
            raise ValueError(f"boundaries_and_scales keys must be int steps, got {b!r}")
        if not isinstance(s, (int, float)) or not s >= 0.0:
            raise ValueError(f"boundaries_and_scales values must be scales >= 0 (as optax), got {s!r} at step {b}")

    def fn(t: Tensor) -> Tensor:
        v = torch.full_like(t, init)
        for b, s in items:
            v = torch.where(t < b, v, v * float(s))
        return v

    return _schedule(fn, "piecewise_constant_schedule")


def join_schedules(schedules: Sequence[Callable], boundaries: Sequence[int]) -> Schedule:
    """Run `schedules[i]` from `boundaries[i-1]` on, each restarted at step 0, = `optax.join_schedules`.

    Examples:
        >>> import purestep.core as ps
        >>> s = ps.join_schedules([ps.linear_schedule(0.0, 1.0, 2), ps.constant_schedule(0.5)], [2])
        >>> [s(t) for t in (0, 1, 2, 9)]
        [0.0, 0.5, 0.5, 0.5]
    """
    schedules, boundaries = list(schedules), list(boundaries)
    if not schedules:
        raise ValueError("schedules must hold at least one schedule")
    if len(boundaries) != len(schedules) - 1:
        raise ValueError(
            f"boundaries must have len(schedules) - 1 = {len(schedules) - 1} entries, got {len(boundaries)}"
        )
    for i, s in enumerate(schedules):
        if not callable(s):
            raise ValueError(f"schedules[{i}] is {type(s).__name__}, not a schedule (step -> value)")
    for b in boundaries:
        check_int("boundaries entries", b)

    def fn(t: Tensor) -> Tensor:
        out = as_float64(schedules[0](t), t.device)
        for b, s in zip(boundaries, schedules[1:]):
            out = torch.where(t < b, out, as_float64(s(t - b), t.device))
        return out

    return _schedule(fn, "join_schedules")


# --------------------------------------------------------------------------- #
# One-cycle (torch.optim.lr_scheduler.OneCycleLR).
# --------------------------------------------------------------------------- #

_ANNEALS = ("cos", "linear")


def _one_cycle_phases(total_steps: int, pct_start: float, three_phase: bool) -> list[tuple[float, float]]:
    """(start_step, end_step) of each phase, as OneCycleLR builds them."""
    e1 = float(pct_start * total_steps) - 1
    if three_phase:
        e2 = float(2 * pct_start * total_steps) - 2
        return [(0.0, e1), (e1, e2), (e2, float(total_steps - 1))]
    return [(0.0, e1), (e1, float(total_steps - 1))]


def _one_cycle(phases: list[tuple[float, float]], values: list[tuple[float, float]], anneal: str) -> _Fn:
    anneal_fn = _cos_anneal if anneal == "cos" else _lin_anneal

    def fn(t: Tensor) -> Tensor:
        out = None
        # OneCycleLR takes the first phase with t <= end_step (the last phase otherwise).
        for (s, e), (v0, v1) in reversed(list(zip(phases, values))):
            length = e - s
            # A zero-length phase (OneCycleLR divides by zero there) is already complete.
            pct = torch.clamp((t - s) / length, 0.0, 1.0) if length > 0 else torch.ones_like(t)
            v = anneal_fn(v0, v1, pct)
            out = v if out is None else torch.where(t <= e, v, out)
        assert out is not None  # every cycle has phases
        return out

    return fn


def _check_one_cycle(total_steps: int, pct_start: float, anneal: str) -> None:
    check_int("total_steps", total_steps, 1)
    if not isinstance(pct_start, (int, float)) or not 0.0 <= pct_start <= 1.0:
        raise ValueError(f"pct_start must be a float in [0, 1], got {pct_start!r}")
    if anneal not in _ANNEALS:
        raise ValueError(f"anneal must be 'cos' or 'linear' (OneCycleLR's anneal_strategy), got {anneal!r}")


def one_cycle_schedule(
    peak: float,
    total_steps: int,
    pct_start: float = 0.3,
    div_factor: float = 25.0,
    final_div_factor: float = 1e4,
    anneal: str = "cos",
    three_phase: bool = False,
) -> Schedule:
    """The lr of `torch.optim.lr_scheduler.OneCycleLR(max_lr=peak, ...)`.

    From peak/div_factor up to `peak` by step pct_start·T - 1, then down to
    peak/(div_factor·final_div_factor) at step T - 1 (`three_phase`: back to
    peak/div_factor at 2·pct_start·T - 2 first), each phase annealed by `anneal`
    ("cos" or "linear"). Constant after T - 1.

    Warning:
      OneCycleLR extrapolates its last phase past T - 1 and refuses steps past T;
      this schedule stays at its final value.

    Examples:
        >>> import purestep.core as ps
        >>> s = ps.one_cycle_schedule(1.0, total_steps=10, anneal="linear")
        >>> [round(s(t), 4) for t in (0, 2, 9)]
        [0.04, 1.0, 0.0]

    References:
        Smith and Topin, Super-Convergence, 2017.
    """
    peak = _check_value("peak", peak)
    _check_one_cycle(total_steps, pct_start, anneal)
    if not div_factor > 0:
        raise ValueError(f"div_factor must be > 0, got {div_factor!r}")
    if not final_div_factor > 0:
        raise ValueError(f"final_div_factor must be > 0, got {final_div_factor!r}")
    initial = peak / div_factor
    lowest = initial / final_div_factor
    if three_phase:
        values = [(initial, peak), (peak, initial), (initial, lowest)]
    else:
        values = [(initial, peak), (peak, lowest)]
    fn = _one_cycle(_one_cycle_phases(total_steps, pct_start, three_phase), values, anneal)
    return _schedule(fn, "one_cycle_schedule")


def one_cycle_momentum_schedule(
    total_steps: int,
    base: float = 0.85,
    max: float = 0.95,  # noqa: A002 (OneCycleLR's max_momentum)
    pct_start: float = 0.3,
    anneal: str = "cos",
    three_phase: bool = False,
) -> Schedule:
    """The momentum (or β₁) cycle of `OneCycleLR(base_momentum=base, max_momentum=max, ...)`.

    Mirrors `one_cycle_schedule`: `max` down to `base` while the lr rises, back up
    to `max` while it falls (`three_phase`: flat at `max` in the third phase).
    Pass it as `momentum=` (sgd) or `betas=(schedule, β₂)` (adam).

    Examples:
        >>> import purestep.core as ps
        >>> s = ps.one_cycle_momentum_schedule(10, anneal="linear")
        >>> [round(s(t), 4) for t in (0, 2, 9)]
        [0.95, 0.85, 0.95]
    """
    base, top = _check_value("base", base), _check_value("max", max)
    _check_one_cycle(total_steps, pct_start, anneal)
    if three_phase:
        values = [(top, base), (base, top), (top, top)]
    else:
        values = [(top, base), (base, top)]
    fn = _one_cycle(_one_cycle_phases(total_steps, pct_start, three_phase), values, anneal)
    return _schedule(fn, "one_cycle_momentum_schedule")
