"""What the engine's paths run: a program, as `_step.py` describes `make_update`'s and
`make_step`'s (`UpdateProgram`, `StepProgram`). The runners read it through this protocol."""

from __future__ import annotations

from typing import Any, Callable, Protocol

from .._base import Transform


class Program(Protocol):
    """A donated update or step as data.

    `kind`: "update" (grads come from the caller) or "step" (grads computed inside, from a
    loss); `transform`; `averaging`: the EMA's (init, update) pair or None; `metrics`: whether
    `pure` returns metrics last. Its three forms: `pure` (new trees: what the flat and
    sharded paths compile over their buffers), `in_place` (pure, then copied into the inputs)
    and `eager` (uncompiled donation through the transform's in-place forms)."""

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

    def eager(self, *args: Any, **kwargs: Any) -> Any: ...
