"""The step engine: which execution path runs a donated update or step (core/README.md maps them)."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import torch
import torch.utils._pytree as pytree
from torch import Tensor

from . import sharded as _sharded
from .. import _tree as tr
from .._base import Params, PyTree
from .flat import FlatUpdate


def _tied_leaves(tree: PyTree) -> tuple[str, str] | None:
    """The paths of two leaves that are the same tensor, if any."""
    seen: dict[int, str] = {}
    for path, x in tr.tree_flatten_with_path(tree)[0]:
        if isinstance(x, Tensor):
            if id(x) in seen:
                return seen[id(x)], path
            seen[id(x)] = path
    return None


def _plain_leaves(tree: PyTree) -> bool:
    """Leaves the flat layout can re-point: dense tensors (Parameters too), not subclasses such as DTensor."""
    leaves = pytree.tree_leaves(tree)
    return bool(leaves) and all(type(x) in (Tensor, torch.nn.Parameter) and x.layout == torch.strided for x in leaves)


@dataclasses.dataclass
class _Path:
    name: str  # "flat", "sharded", "per-leaf compiled", "eager in place", "per-leaf DTensor"
    why: str
    run: Callable


def explain_pure(params: Any = None) -> str:
    """Which path runs the update or step, and why."""
    return "pure: donate=False returns new trees (differentiable, vmappable)"


class Engine:
    """The execution paths of a donated update (or step) and the choice among them, made
    on the first call and again when the kind of leaves changes (see core/README.md):

    - "sharded": DTensor (FSDP2) params, flat buffers over this rank's shards (`_sharded`);
    - "flat": `compile=True`, plain dense leaves, flat buffers per group (`_flat_step`);
    - "per-leaf compiled" / "eager in place": the update leaf by leaf, compiled or eager
      (where a transform or the leaves cannot run on flat buffers: `explain()` says why);
    - "per-leaf DTensor": DTensor params the sharded path cannot take, eager, whole DTensors.
    """

    def __init__(
        self,
        *,
        flat: FlatUpdate | None,
        sharded: Callable[[], FlatUpdate] | None,
        per_leaf: Callable,
        per_leaf_dtensor: Callable,
        compile: bool,
        flat_asked: bool,
    ) -> None:
        self.flat, self.sharded, self.per_leaf, self.per_leaf_dtensor = flat, sharded, per_leaf, per_leaf_dtensor
        self.compile, self.flat_asked = compile, flat_asked
        self.path: _Path | None = None
        self.on_dtensors: bool | None = None

    def path_for(self, params: Params, grads: PyTree | None = None) -> Callable:
        on_dtensors = _sharded.has_dtensors(params)
        if self.path is None or on_dtensors != self.on_dtensors:
            self.path, self.on_dtensors = self._choose(params, grads, on_dtensors), on_dtensors
        return self.path.run

    def _choose(self, params: Params, grads: PyTree | None, on_dtensors: bool, agree: bool = True) -> _Path:
        if grads is not None:
            tr.check_match(grads, params, "grads", "params")
        tied = _tied_leaves(params)
        if tied:
            raise ValueError(
                f"donate=True: params '{tied[0]}' and '{tied[1]}' are the same tensor; an in-place update would "
                "apply both leaves' updates to it. Pass a shared (tied) param once, as model.named_parameters() does"
            )
        if on_dtensors:
            engine = self.sharded() if self.sharded is not None else None
            if engine is not None and engine.plans(params, agree=agree):
                how = "flat buffers over this rank's blocks" if self.compile else "this rank's blocks in place, eager"
                return _Path("sharded", f"DTensor params: {how}; {_sharded.describe(params)}", engine)
            why = (
                "flat=False"
                if self.flat_asked is False
                else "no sharded path here"
                if engine is None
                else engine.why_not
            )
            return _Path("per-leaf DTensor", f"{why}; eager, on whole DTensors", self.per_leaf_dtensor)
        if self.flat is not None:
            if not _plain_leaves(params):
                why = "leaves that are not plain dense tensors"
            elif self.flat.plans(params):
                return _Path("flat", f"compile=True, donate=True: {self.flat.plan_for(params).summary}", self.flat)
            else:
                why = self.flat.why_not
            return _Path("per-leaf compiled", f"not on flat buffers: {why}", self.per_leaf)
        if self.compile:
            return _Path("per-leaf compiled", "flat=False", self.per_leaf)
        return _Path("eager in place", "donate=True without compile", self.per_leaf)

    def explain(self, params: Params | None = None) -> str:
        """Which path runs the update or step, and why: "flat", "sharded", "per-leaf compiled",
        "eager in place" or "per-leaf DTensor" ("pure" without `donate`). Before the first
        call, given the params, the path the first call would take (read from the
        transform's declarations: nothing runs, nothing is bound, no collective)."""
        if self.path is not None:
            return f"{self.path.name}: {self.path.why}"
        if params is None:
            return "not chosen yet: the first call chooses (explain(params) says which it would)"
        path = self._choose(params, None, _sharded.has_dtensors(params), agree=False)
        return f"{path.name}: {path.why}"

    def layout(self) -> dict[str, list[str]] | None:
        """The flat buffers in use: `{buffer: [leaf paths]}`, or None on a per-leaf path."""
        run = self.path.run if self.path else None
        return run.layout() if isinstance(run, FlatUpdate) and run.bound is not None else None
