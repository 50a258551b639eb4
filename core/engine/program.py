"""What the engine's paths run: a program, as `_step.py` describes `make_update`'s and
`make_step`'s (`UpdateProgram`, `StepProgram`). The runners read it through this protocol."""

from __future__ import annotations

from typing import Any, Callable, Protocol, runtime_checkable

from .._base import Transform


class Program(Protocol):
    """A donated update or step as data.

    `kind`: "update" (grads come from the caller) or "step" (grads computed inside, from a
    loss); `transform`; `averaging`: the EMA's (init, update) pair or None; `metrics`: whether
    `pure` returns metrics last. Its two forms: `pure` (new trees: what the flat and sharded
    paths compile over their buffers) and `in_place` (pure, then copied into the inputs);
    `metrics_of` computes the metrics from a form's values (the uncompiled donated form,
    `per_leaf.eager`, runs the transform's in-place forms and asks it for them)."""

    @property
    def kind(self) -> str: ...

    @property
    def transform(self) -> Transform: ...

    @property
    def averaging(self) -> tuple[Callable, Callable] | None: ...

    @property
    def metrics(self) -> bool: ...

    def pure(self, *args: Any, **kwargs: Any) -> Any: ...

    def in_place(self, *args: Any, **kwargs: Any) -> Any: ...

    def metrics_of(self, *args: Any, **kwargs: Any) -> Any: ...


@runtime_checkable
class StepProgram(Program, Protocol):
    """A step program: grads from the loss, `loss_and_grads(params, batch, buffers,
    with_buffers) -> (grads, loss, aux, new_buffers)`."""

    def loss_and_grads(self, *args: Any, **kwargs: Any) -> Any: ...
