"""How the engine compiles: inductor's options for the per-leaf and the flat paths, and why."""

from __future__ import annotations

import types
from typing import Any, Callable

import torch

from .. import _compat as compat

# Inductor inlines 0-d scalar math (bias corrections, schedules) into every element's
# loop; realizing any reused expression of more than a few ops computes it once instead
# (on CPU an inlined `pow` per vector made the AdamW step ~10x slower).
_INDUCTOR_OPTIONS: dict[str, Any] = {"realize_opcount_threshold": 4}
# Inductor before 2.12 asserts in `ForeachKernelSchedulerNode.reorder_loops_by_dep_pair` when
# foreach ops meet per-tensor reductions over tensors of several shapes, as in Muon's graph on
# CUDA (pytorch/pytorch#176591, fixed by #176849; no cheap probe finds it): on a machine with
# CUDA, loop reordering after fusion stays off on every release (the CUDA results were measured
# so). An optimizer step's loops are flat or per-leaf elementwise: there is little to reorder.
if torch.cuda.is_available():
    _INDUCTOR_OPTIONS["loop_ordering_after_fusion"] = False
# Keep a narrowing cast's rounding where the compiled code rounds and widens again (Muon's
# bf16 emulation, low-precision moments read back): without it inductor fuses the round
# trip away and the compiled step silently differs from the eager one.
if compat.EMULATES_PRECISION_CASTS:
    _INDUCTOR_OPTIONS["emulate_precision_casts"] = True
# Per device type, for the flat and sharded paths. There the per-step scalars are realized
# by `ps.once` where they are computed (bias corrections, schedules, the clip factor), and
# 0-d coefficients of elementwise math are cast to its dtype once (`_foreach`' coefficients): a
# low threshold for every node would also materialize large intermediates read twice, as
# apply_if_finite's new state (checked, then selected), which measurably slowed the CPU
# step (see benchmarks/README.md, "ps.once").
# Inlined into a large kernel, float64 `pow`s per element make a CUDA step compute-bound:
# `once` keeps them out.
_FLAT_INDUCTOR_OPTIONS = {k: v for k, v in _INDUCTOR_OPTIONS.items() if k != "realize_opcount_threshold"}


def compile_per_leaf(fn: Callable) -> Callable:
    """`fn` under `torch.compile(fullgraph=True)`, as the per-leaf paths run it."""
    return torch.compile(fn, fullgraph=True, options=_INDUCTOR_OPTIONS)


def compile_own(fn: Callable, device: torch.device, static: bool = False) -> Callable:
    """`fn` compiled as the flat and sharded paths run it, under its own code object: Dynamo
    keeps compiled graphs per code object (8 at most), so each step is its own program
    rather than evicting the others'. `static` (`dynamic=False`, for the update, whose
    buffers never change size): Dynamo's automatic dynamic shapes remember sizes by a
    function's file and line across code objects, and would turn the plan's sizes into
    symbols once a second update of other sizes compiles (owner-computes then cannot sort
    its matrices by cost). `make_step`'s step stays dynamic: its batches change shape."""
    own = types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)
    options = _FLAT_INDUCTOR_OPTIONS if device.type in ("cpu", "cuda") else {}
    return torch.compile(own, fullgraph=True, dynamic=False if static else None, options=options)
