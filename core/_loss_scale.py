"""Dynamic loss scaling for float16 training: a pure `torch.amp.GradScaler`."""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import torch
import torch.utils._pytree as pytree
from torch import Tensor

from . import _foreach as ls
from ._base import PyTree, check_int, is_static, leaf_device


class DynamicLossScaleState(NamedTuple):
    """State of `dynamic_loss_scale`: the scale and GradScaler's growth tracker."""

    scale: Tensor  # (), float32: the loss multiplier (GradScaler's _scale)
    growth_tracker: Tensor  # (), int64: finite steps since the scale last changed


class LossScaler(NamedTuple):
    """Three pure functions: `s = init(params=None)`, `scale_loss(loss, s)`,
    `unscale(grads, s) -> (grads, finite, s)`."""

    init: Callable[..., DynamicLossScaleState]
    scale_loss: Callable[[Tensor, DynamicLossScaleState], Tensor]
    unscale: Callable[[PyTree, DynamicLossScaleState], tuple[PyTree, Tensor, DynamicLossScaleState]]


def dynamic_loss_scale(
    init_scale: float = 2.0**16,
    growth_factor: float = 2.0,
    backoff_factor: float = 0.5,
    growth_interval: int = 2000,
) -> LossScaler:
    """Dynamic loss scaling with GradScaler's rule, as pure functions over a small state.

    `scale_loss(loss, s) = loss · S`. `unscale(grads, s)` returns grads · (1/S), a 0-d
    bool `finite` (every grad element finite) and the next state: on a non-finite
    step S ← S·backoff_factor and the tracker resets; after `growth_interval` finite
    steps in a row S ← S·growth_factor (kept only if finite). One `unscale` does
    GradScaler's `unscale_` and `update()`; skip the optimizer step where `finite`
    is False (e.g. `torch.where`, or `apply_if_finite` around the optimizer).

    Args:
      init_scale: the first S.
      growth_factor: > 1.
      backoff_factor: in (0, 1).
      growth_interval: finite steps between growths (int >= 1).

    Returns:
      `LossScaler(init, scale_loss, unscale)`; `init(params=None)` puts the state on
      the device of the first leaf of `params` (CPU without).

    Examples:
        >>> import torch, purestep.core as ps
        >>> ls = ps.dynamic_loss_scale(init_scale=8.0, growth_interval=1)
        >>> s = ls.init()
        >>> ls.scale_loss(torch.tensor(1.5), s)
        tensor(12.)
        >>> grads, finite, s = ls.unscale({"w": torch.tensor([8.0, 16.0])}, s)
        >>> grads["w"], finite, s.scale
        (tensor([1., 2.]), tensor(True), tensor(16.))
        >>> grads, finite, s = ls.unscale({"w": torch.tensor([float("inf"), 1.0])}, s)
        >>> finite, s.scale
        (tensor(False), tensor(8.))
    """
    if not is_static(init_scale) or not init_scale > 0:
        raise ValueError(f"init_scale must be a float > 0, got {init_scale!r}")
    if not is_static(growth_factor) or not growth_factor > 1.0:
        raise ValueError(f"growth_factor must be a float > 1, got {growth_factor!r}")
    if not is_static(backoff_factor) or not 0.0 < backoff_factor < 1.0:
        raise ValueError(f"backoff_factor must be a float in (0, 1), got {backoff_factor!r}")
    check_int("growth_interval", growth_interval, 1)

    def init(params: Any = None) -> DynamicLossScaleState:
        device = leaf_device(pytree.tree_leaves(params)) if params is not None else torch.device("cpu")
        scale = torch.full((), init_scale, dtype=torch.float32, device=device)
        return DynamicLossScaleState(scale, torch.zeros((), dtype=torch.int64, device=device))

    def scale_loss(loss: Tensor, state: DynamicLossScaleState) -> Tensor:
        return loss * state.scale

    def unscale(grads: PyTree, state: DynamicLossScaleState) -> tuple[PyTree, Tensor, DynamicLossScaleState]:
        gs, spec = pytree.tree_flatten(grads)
        # GradScaler: inv_scale = scale.double().reciprocal().float()
        inv = state.scale.to(torch.float64).reciprocal().to(torch.float32)
        finite = ls.all_finite(gs).to(state.scale.device)
        out = ls.cast_like(ls.mul(gs, inv), gs)
        # torch._amp_update_scale_: products in float64, stored as float32
        grown = (state.scale.to(torch.float64) * growth_factor).to(torch.float32)
        backed = (state.scale.to(torch.float64) * backoff_factor).to(torch.float32)
        tracker = state.growth_tracker + 1
        grow = tracker == growth_interval
        zero = torch.zeros_like(tracker)
        scale = torch.where(finite, torch.where(grow & torch.isfinite(grown), grown, state.scale), backed)
        tracker = torch.where(finite & ~grow, tracker, zero)
        return pytree.tree_unflatten(out, spec), finite, DynamicLossScaleState(scale, tracker)

    return LossScaler(init, scale_loss, unscale)
