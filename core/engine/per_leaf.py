"""The per-leaf paths: the update (or step) on the user's own trees, leaf by leaf.

- "per-leaf compiled": `compile=True` where the flat path cannot run (`flat=False`, leaves
  that are not plain dense tensors, a transform that declares it cannot run packed or
  declares nothing): the program's `in_place` form compiled, one kernel per leaf;
- "eager in place": `donate=True` without compile: `eager(program)` below (the transforms'
  in-place forms through `apply_in_place`, storage adopted, see `donate`);
- "per-leaf DTensor": DTensor params the sharded path cannot take: `in_place` eager, on
  whole DTensors (DTensor dispatch per op, implicit gathers).
"""

from __future__ import annotations

import functools
from typing import Any, Callable

from .. import _tree as tr
from .._base import OptState, Params, PyTree, Transform, apply_of
from .donate import Taken, add_into, adopt_into, copy_into
from .program import Program, StepProgram


class PerLeaf:
    """A path that runs `run(...)` on the trees as given: it takes any params."""

    why_not: str | None = None

    def __init__(self, run: Callable) -> None:
        self.run = run

    def plans(self, params: Any, agree: bool = True) -> bool:
        return True

    def layout(self) -> None:
        return None

    def describe(self, params: Any) -> str:
        return ""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.run(*args, **kwargs)


def apply_in_place(
    t: Transform, grads: PyTree, state: OptState, params: Params, a: Any = 1.0, b: Any = 1.0
) -> OptState:
    """`p ← a·p + b·u` in place for `u, state = t.update(grads, state, params)`; returns
    the new state. Runs `t`'s in-place apply (`with_in_place`) where it has one (which
    may update `state` in place: the caller gives it up), else `update`, then the apply."""
    apply_ = apply_of(t)
    if apply_ is not None:
        return apply_(grads, state, params, a, b)
    updates, state = t.update(grads, state, params)
    add_into(params, updates, a, b)
    return state


def eager(program: Program) -> Callable:
    """The program's uncompiled donated form: `update(params, grads, opt_state, ema_state,
    amp, extra)` or `step(params, opt_state, batch, buffers, with_buffers)` -> metrics."""
    if program.kind == "update":
        return functools.partial(_eager_update, program)
    assert isinstance(program, StepProgram)
    return functools.partial(_eager_step, program)


def _eager_update(program: Program, params, grads, opt_state, ema_state=None, amp=None, extra=None):
    # The update goes into the params in place (`apply_in_place`: a chain folds its decay and
    # lr into the last transform's own in-place apply), and state leaves not updated in place
    # adopt the storage of their new values.
    if amp is not None or extra:  # a skip decided on the device, or inputs the in-place forms do not take
        return program.in_place(params, grads, opt_state, ema_state, amp, extra)
    tr.check_match(grads, params, "grads", "params")
    new_state = apply_in_place(program.transform, grads, opt_state, params)
    taken = Taken(params, grads, opt_state, ema_state)
    adopt_into(opt_state, new_state, "opt_state", taken)
    if program.averaging is not None:
        adopt_into(ema_state, program.averaging[1](ema_state, params), "ema_state", taken)
    return program.metrics_of(grads, opt_state) if program.metrics else None  # grads are only read


def _eager_step(program: StepProgram, params, opt_state, batch, buffers=None, with_buffers=False):
    # As the update's, but p += u (the updates are kept for `update_norm`, so no folding into
    # the apply: bitwise the pure step's results).
    grads, loss, aux, new_buffers = program.loss_and_grads(params, batch, buffers, with_buffers)
    updates, new_state = program.transform.update(grads, opt_state, params)
    metrics = program.metrics_of(loss, grads, aux, updates, new_state)
    add_into(params, updates)
    adopt_into(opt_state, new_state, "opt_state", Taken(params, grads, opt_state, buffers, new_buffers))
    if with_buffers:  # copied: functional_model's buffers share storage with the module
        copy_into(buffers, new_buffers, "buffers")
    return metrics
