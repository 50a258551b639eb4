"""The branch helpers SOAP and Kron share: a refit (an eigenbasis, a preconditioner) taken on
some steps only, decided by a 0-d tensor: a plain Python branch where reading it costs nothing,
`torch.cond` in compiled code and where reading it would wait for the device."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from . import _compat as compat


def plain_branch(pred: Tensor) -> bool:
    """Whether `cond` on `pred` runs a plain branch: eagerly, with `pred` on the CPU, where
    reading it costs nothing (an eager cond traces its branches through dynamo for every
    leaf and step, ms each)."""
    return not torch.compiler.is_compiling() and pred.device.type == "cpu" and not compat.under_vmap()


def cond(pred: Tensor, true_fn: Any, false_fn: Any, operands: tuple, host: bool = False) -> Any:
    """`torch.cond`, for compiled code and devices where reading `pred` would wait for the
    device; a plain branch where `plain_branch`, or eagerly with `host` (a branch that runs host
    code: `pred` is read, waiting for the device). Eagerly elsewhere the cond traces its branches for
    each leaf's shapes as they are (static: leaves of many shapes must not turn them symbolic)."""
    if plain_branch(pred) or (host and not torch.compiler.is_compiling() and not compat.under_vmap()):
        return true_fn(*operands) if bool(pred) else false_fn(*operands)
    if not torch.compiler.is_compiling():
        for x in operands:
            torch._dynamo.mark_static(x)
    return torch.cond(pred, true_fn, false_fn, operands)


def fresh(x: Tensor) -> Tensor:
    """A cond branch's output: a new contiguous tensor (the branches must agree on strides
    and may not return an input)."""
    return x.clone(memory_format=torch.contiguous_format)


def as_is(x: Tensor) -> Tensor:
    """A plain branch's output: no copy (nothing aliases in place; the state is replaced whole)."""
    return x
