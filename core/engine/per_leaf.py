"""The per-leaf paths: the update (or step) on the user's own trees, leaf by leaf.

- "per-leaf compiled": `compile=True` where the flat path cannot run (`flat=False`, leaves
  that are not plain dense tensors, a transform that declares it cannot run packed or
  declares nothing): the program's `in_place` form compiled, one kernel per leaf;
- "eager in place": `donate=True` without compile: the program's `eager` form (in-place
  forms of the transforms, storage adopted, see `donate`);
- "per-leaf DTensor": DTensor params the sharded path cannot take: `in_place` eager, on
  whole DTensors (DTensor dispatch per op, implicit gathers).
"""

from __future__ import annotations

from typing import Any, Callable


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
