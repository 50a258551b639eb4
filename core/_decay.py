"""Weight decay and parameter-group rules."""

from __future__ import annotations

from typing import Any, NamedTuple

import torch.utils._pytree as pytree
from torch import Tensor

from . import _tree as tr
from ._base import EmptyState, Params, ScalarOrSchedule, Transform, check_hyperparam, check_nonnegative, leaf_device, resolve, zero_count
from ._combine import masked


class AddDecayedWeightsState(NamedTuple):
    count: Tensor  # (), int64: the schedule's step


def add_decayed_weights(weight_decay: ScalarOrSchedule = 0.0, mask: Any = None) -> Transform:
    """`u ← u + λ·p`, before lr scaling (as optax): decoupled decay when it follows the
    preconditioner, L2 regularisation when it comes first.

    Args:
      weight_decay: λ, a float, a 0-d tensor or a schedule.
      mask: decay only where True: a bool pytree like params, or `callable(params)`.

    Example:
        >>> import torch, purestep.core as ps
        >>> t = ps.add_decayed_weights(0.5)
        >>> p = {"w": torch.full((1,), 2.0)}
        >>> t.update({"w": torch.zeros(1)}, t.init(p), p)[0]
        {'w': tensor([1.])}
    """
    check_hyperparam("weight_decay", weight_decay)
    check_nonnegative("weight_decay", weight_decay)

    def init(params: Params) -> EmptyState | AddDecayedWeightsState:
        if callable(weight_decay):
            return AddDecayedWeightsState(zero_count(leaf_device(pytree.tree_leaves(params))))
        return EmptyState()

    def update(grads, state, params=None, **extra):
        if params is None:
            raise ValueError("add_decayed_weights needs params: call update(grads, state, params)")
        ps_ = tr.check_match(params, grads, "params", "grads", dtype=False)
        us, spec = pytree.tree_flatten(grads)
        if callable(weight_decay):
            wd = resolve(weight_decay, state.count)
            state = AddDecayedWeightsState(state.count + 1)
        else:
            wd = weight_decay
        out = tr.cast_like(tr.axpy(wd, ps_, us), us)
        return pytree.tree_unflatten(out, spec), state

    t = Transform(init, update)
    return t if mask is None else masked(t, mask)
