"""The step engine: which execution path runs a donated update or step (core/README.md
maps the paths to this package's files), and the pieces they share: what a transform
declares it needs (`needs`), the packed trees (`packed`), what a transform may call on any
layout (`ops`), the one way new values reach the user's tensors (`donate`), how the paths
compile (`compiling`) and the DTensor helpers (`dtensor`)."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Protocol

import torch
import torch.utils._pytree as pytree
from torch import Tensor

from .. import _tree as tr
from .._base import Params, PyTree
from .program import Program
from .compiling import compile_per_leaf
from .donate import copy_scalars
from .dtensor import has_dtensors
from .flat import FlatStep, FlatUpdate
from .per_leaf import PerLeaf, eager
from .replicas import OverReplicas, hsdp_replicas
from .sharded import ShardedEager, sharded_update


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
    run: Runner


def explain_pure(params: Any = None) -> str:
    """Which path runs the update or step, and why."""
    return "pure: donate=False returns new trees (differentiable, vmappable)"


class Runner(Protocol):
    """One execution path (a file of this package): says whether it takes these params
    (`why_not` when not), runs, and shows its buffers."""

    why_not: str | None

    def plans(self, params: Any, agree: bool = True) -> bool: ...

    def describe(self, params: Any) -> str:
        """What runs on these params, for `explain()` (once `plans` said yes)."""
        ...

    def layout(self) -> dict[str, list[str]] | None: ...

    def __call__(self, *args: Any, **kwargs: Any) -> Any: ...


class Engine:
    """The execution paths of a donated update (or step) and the choice among them, made
    on the first call and again when the kind of leaves changes (see core/README.md):

    - "sharded": DTensor (FSDP2/HSDP) params, this rank's blocks: flat buffers compiled
      (`sharded.sharded_update`: `FlatUpdate` given `ShardBlocks`) or in place eager (`sharded.ShardedEager`);
    - "flat": `compile=True`, plain dense leaves, flat buffers per group (`flat`);
    - "per-leaf compiled" / "eager in place": the update leaf by leaf, compiled or eager
      (where a transform or the leaves cannot run on flat buffers: `explain()` says why);
    - "per-leaf DTensor": DTensor params the sharded path cannot take, eager, whole DTensors.

    `program` is the data the paths run: make_update's `UpdateProgram` (kind "update") or
    make_step's `StepProgram` ("step"), each with `pure` and `in_place` forms (`per_leaf.eager`: uncompiled donation).
    Each path's runner is made once, when first needed.
    """

    def __init__(self, program: Program, *, compile: bool, flat: bool, over_replicas: Any = False) -> None:
        self.program, self.compile, self.flat_asked = program, compile, flat
        # the state sharded across HSDP's replicas (`replicas`): True, or the (replicate, shard) mesh
        self.over_replicas = over_replicas
        self.path: _Path | None = None
        self.on_dtensors: bool | None = None
        self._runners: dict[str, Runner] = {}

    def _runner(self, name: str) -> Runner:
        if name not in self._runners:
            p = self.program
            make: dict[str, Callable[[], Runner]] = {
                "flat": lambda: FlatUpdate(p) if p.kind == "update" else FlatStep(p),
                "sharded": lambda: sharded_update(p) if self.compile else ShardedEager(p),
                "sharded over replicas": lambda: OverReplicas(
                    sharded_update(p) if self.compile else ShardedEager(p),
                    None if self.over_replicas is True else self.over_replicas,
                ),
                "per-leaf compiled": lambda: PerLeaf(
                    copy_scalars(compile_per_leaf(functools.partial(p.in_place, defer_scalars=True)))
                ),
                "eager in place": lambda: PerLeaf(eager(p)),
                # eager: dynamo does not trace copies into DTensors (a step program's own form)
                "per-leaf DTensor": lambda: PerLeaf(
                    p.in_place
                    if p.kind == "update"
                    else self._runner("per-leaf compiled" if self.compile else "eager in place")
                ),
            }
            self._runners[name] = make[name]()
        return self._runners[name]

    def path_for(self, params: Params, grads: PyTree | None = None) -> Callable:
        on_dtensors = has_dtensors(params)
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
            # FSDP2 computes grads in its own forward/backward: a step program has no sharded path.
            if not self.flat_asked:
                why = "flat=False"
            elif self.program.kind != "update":
                why = "no sharded path here"
            else:
                split = self.over_replicas is not False and (
                    self.over_replicas is not True or hsdp_replicas(params) is not None
                )
                runner = self._runner("sharded over replicas" if split else "sharded")
                if runner.plans(params, agree=agree):
                    note = (
                        "; shard_state_over_replicas: these params have no replicas to shard over"
                        if self.over_replicas and not split
                        else ""
                    )
                    return _Path("sharded", f"DTensor params: {runner.describe(params)}{note}", runner)
                why = runner.why_not or "the sharded path cannot take these params"
            how = "compiled" if self.compile and self.program.kind != "update" else "eager"  # see _runner
            return _Path("per-leaf DTensor", f"{why}; {how}, on whole DTensors", self._runner("per-leaf DTensor"))
        if self.compile and self.flat_asked:
            if not _plain_leaves(params):
                why = "leaves that are not plain dense tensors"
            else:
                flat = self._runner("flat")
                if flat.plans(params):
                    return _Path("flat", f"compile=True, donate=True: {flat.describe(params)}", flat)
                why = flat.why_not or "no flat layout"
            return _Path("per-leaf compiled", f"not on flat buffers: {why}", self._runner("per-leaf compiled"))
        if self.compile:
            return _Path("per-leaf compiled", "flat=False", self._runner("per-leaf compiled"))
        why = "donate=True without compile"
        if self.program.kind == "update":  # `per_leaf.eager`: the in-place forms take neither
            why += (
                "; a call with torch's AMP inputs (grad_scale, found_inf) or the transform's own inputs "
                "(max_logits=, hessian=) runs the pure update and copies it in"
            )
        return _Path("eager in place", why, self._runner("eager in place"))

    def explain(self, params: Params | None = None) -> str:
        """Which path runs the update or step, and why: "flat", "sharded", "per-leaf compiled",
        "eager in place" or "per-leaf DTensor" ("pure" without `donate`). Before the first
        call, given the params, the path the first call would take (read from the
        transform's declarations: nothing runs, nothing is bound, no collective)."""
        if self.path is not None:
            return f"{self.path.name}: {self.path.why}"
        if params is None:
            return "not chosen yet: the first call chooses (explain(params) says which it would)"
        path = self._choose(params, None, has_dtensors(params), agree=False)
        return f"{path.name}: {path.why}"

    def layout(self) -> dict[str, list[str]] | None:
        """The flat buffers in use: `{buffer: [leaf paths]}`, or None on a per-leaf path."""
        return self.path.run.layout() if self.path else None
