"""Leaf-list math and the eager in-place helpers behind it.

Each op takes lists of tensors and float-or-0-d-tensor scalars. In eager mode it runs
as one `torch._foreach_*` kernel per op; under a `torch.func` transform (vmap has no
foreach rule) the same math runs per leaf. The `_`-suffixed forms write into a list the
caller owns (`scale_add_`: into the params of a donated step); `leafwise` says when eager
CPU math may run leaf by leaf instead, `cache_blocks` in blocks of leaves that stay in cache.
"""

from __future__ import annotations

import functools

from typing import Any, Sequence

import torch
import torch.utils._pytree as pytree
from torch import Tensor

from . import _compat as compat
from ._base import coefficient

Scalar = float | Tensor


def use_foreach(xs: Sequence[Tensor], *scalars: Scalar) -> bool:
    """Whether foreach kernels may run: not under a torch.func transform, and not with a
    0-d tensor `scalar` that autograd differentiates (foreach's backward for a tensor
    scalar fails: "inconsistent range for TensorList output"; meta-gradients need it)."""
    if not xs or torch._C._functorch.peek_interpreter_stack() is not None:
        return False  # under vmap/grad, also when torch.compile traces vmap(step)
    if torch.compiler.is_compiling():
        return True
    if not (all(type(x) in _PLAIN for x in xs) if type(xs[0]) in _PLAIN else _one_mesh(xs)):
        return False  # DTensors beside plain tensors (TP alone), or over several meshes (FSDP beside TP)
    return not (torch.is_grad_enabled() and any(isinstance(s, Tensor) and s.requires_grad for s in scalars))


_PLAIN = (Tensor, torch.nn.Parameter)


def _runs(xs: Sequence[Tensor], op: Any) -> bool:
    """Whether foreach `op` runs on `xs`: plain tensors, or DTensors with a sharding rule for it."""
    return type(xs[0]) in _PLAIN or torch.compiler.is_compiling() or compat.dtensor_runs(op)


def _one_mesh(xs: Sequence[Tensor]) -> bool:
    """Whether `xs` are DTensors of one device mesh (a foreach kernel then runs over them)."""
    mesh = getattr(xs[0], "device_mesh", None)
    return mesh is not None and all(getattr(x, "device_mesh", None) == mesh for x in xs)


def sum_scalars(xs: list[Tensor]) -> Tensor:
    """Σ of 0-d per-leaf results (partial sums), as one 0-d tensor. Plain tensors, or DTensors
    of one mesh and placement, stack and add as they are; DTensors of several (the per-leaf
    DTensor path: FSDP beside TP, TP beside plain params) add within each mesh and placement
    first, then each group's sum is reduced to its full value: one collective per group, not
    per leaf."""
    from .engine.dtensor import at_owner, mesh_device  # (engine imports this module)

    owned = [x for x in xs if at_owner(x)]
    if owned:  # values of state at its owner (engine.owners): the owners' values, summed over every rank
        xs = [x for x in xs if not at_owner(x)]
        held = [x for x in owned if x.device_mesh.get_coordinate() is not None]  # type: ignore[attr-defined]
        # A rank outside a mesh holds no value there (DTensor leaves its result unset): zero
        total = torch.zeros((), dtype=owned[0].dtype, device=mesh_device(owned[0].device_mesh))  # type: ignore[attr-defined]
        for x in held:
            total = total + x._local_tensor.reshape(())  # type: ignore[attr-defined]
        torch.distributed.all_reduce(total)
        if not xs:
            return total
        rest = sum_scalars(list(xs))
        rest = rest.full_tensor() if hasattr(rest, "full_tensor") else rest  # one mesh and placement's sum
        return rest + total.to(rest.dtype)
    groups: dict[tuple, list[Tensor]] = {}
    for x in xs:
        mesh = getattr(x, "device_mesh", None)
        key = (mesh, tuple(getattr(x, "placements", ()))) if mesh is not None else ("plain",)  # equal meshes: one group
        groups.setdefault(key, []).append(x)
    if len(groups) <= 1:
        return torch.stack(list(xs)).sum()
    parts = []
    for key, group in groups.items():
        total = functools.reduce(torch.add, group)
        parts.append(total.full_tensor() if key != ("plain",) else total)  # type: ignore[attr-defined]
    return torch.stack(parts).sum()


def _owned_inplace(xs: list[Tensor]) -> bool:
    # In-place kernels may reuse the storage of a list the caller created itself, but
    # not while autograd records it (the backward of sqrt, say, needs its output).
    # Compiled code plans its own buffers: there the plain ops make a smaller graph.
    if torch.compiler.is_compiling():
        return False
    return use_foreach(xs) and not (torch.is_grad_enabled() and xs[0].requires_grad)


def leafwise(xs: Sequence[Tensor], *scalars: Scalar) -> bool:
    """Whether eager CPU math may run leaf by leaf (or block of leaves by block, see
    `cache_blocks`), in place on its own intermediates.

    On CPU a foreach kernel is a loop over the leaves, so a chain of them sweeps all the
    leaves once per op; running every op of one leaf before the next keeps that leaf's
    intermediates in cache (10M fp32 params in 50 leaves: AdamW's leaf math 15% faster).
    Only in eager mode (compiled code plans its own loops; vmap needs the per-leaf ops of
    `use_foreach`'s fallback anyway) and with nothing that autograd records. The device is
    the first leaf's: leaves elsewhere would run the same per-leaf ops correctly, only slower.
    """
    if not _owned_inplace(list(xs)) or xs[0].device.type != "cpu":
        return False
    if not torch.is_grad_enabled():
        return True
    return not any(x.requires_grad for x in xs) and not any(getattr(s, "requires_grad", False) for s in scalars)


# Elements per block of `cache_blocks`: AdamW's five arrays of a block (g, m, v, p and a
# temporary, 1.25 MiB in fp32) stay in cache. On a 2-core EPYC (1 MiB L2, 8 MiB L3), 1M
# params in 50 leaves: 32K-128K elements per block 0.66-0.76x torch's foreach step, one
# leaf per block 0.79x, one block for all 0.89x.
CACHE_BLOCK = 1 << 16


def cache_blocks(xs: Sequence[Tensor]) -> list[tuple[int, int]]:
    """`(start, stop)` ranges of consecutive leaves of about `CACHE_BLOCK` elements (a
    larger leaf alone): eager CPU math runs every op of a block before the next block, so
    its intermediates stay in cache, with one foreach call per op and block rather than one
    per op and leaf (Python overhead, for many small leaves)."""
    out, lo, size = [], 0, 0
    for i, x in enumerate(xs):
        size += x.numel()
        if size >= CACHE_BLOCK:
            out.append((lo, i + 1))
            lo, size = i + 1, 0
    if lo < len(xs):
        out.append((lo, len(xs)))
    return out


def tensors_in(*trees: Any) -> list[Tensor]:
    """Every tensor leaf of `trees`, in no promised order: a plain walk of dicts, lists,
    tuples and NamedTuples (pytree's flatten also builds a spec, several times slower);
    any other node goes through `pytree.tree_leaves`."""
    out: list[Tensor] = []
    stack = list(trees)
    while stack:
        node = stack.pop()
        kind = type(node)
        if kind is Tensor or kind is torch.nn.Parameter:
            out.append(node)
        elif kind is dict:
            stack.extend(node.values())
        elif kind is tuple or kind is list or hasattr(node, "_fields"):
            stack.extend(node)
        elif node is None or kind in (int, float, bool, str):
            continue
        else:
            out.extend(x for x in pytree.tree_leaves(node) if isinstance(x, Tensor))
    return out


def owned(new: Sequence[Any], *others: Any) -> bool:
    """Whether the tensors `new` are exclusively their holder's: distinct, each covering its
    whole storage, and sharing no storage with any tensor leaf of `others`.

    A chain asks this of a transform's output updates (with the transform's inputs, states
    and params as `others`) before applying the next transform, when it has an affine form
    (`with_in_place`), in place: an update that is a grad passed through, a state leaf or
    a view of one is not the chain's to overwrite.
    """
    if torch.compiler.is_compiling() or torch._C._functorch.peek_interpreter_stack() is not None:
        return False  # traced or batched: no storages to compare, and nothing gains from in place ops
    grad = torch.is_grad_enabled()
    seen = set()
    for x in new:
        if type(x) is not Tensor or x.storage_offset() != 0 or (grad and x.requires_grad):
            return False
        storage = x.untyped_storage()
        if storage.nbytes() != x.numel() * x.element_size():
            return False
        seen.add(storage.data_ptr())
    if len(seen) != len(new):
        return False
    for x in tensors_in(*others):
        if type(x) not in (Tensor, torch.nn.Parameter) or (grad and x.requires_grad):
            return False  # a subclass (DTensor) hides its storage; autograd records the step
        if x.untyped_storage().data_ptr() in seen:
            return False
    return True


def axpy_(a: Scalar, xs: list[Tensor], ys: list[Tensor]) -> list[Tensor]:
    """y += a·x in place: call only on a `ys` you own (see `owned`); `ys` keep their dtypes."""
    a = _coef(a, ys)
    if not _owned_inplace(ys) or not use_foreach(ys, a):
        return cast_like(axpy(a, xs, ys), ys)
    if not isinstance(a, Tensor):
        torch._foreach_add_(ys, xs, alpha=a)
    elif ys[0].device.type == "cpu":  # per leaf: no temporary list of a·x (foreach is a loop there anyway)
        for y, x in zip(ys, xs):
            y.addcmul_(x, a)
    else:
        torch._foreach_add_(ys, torch._foreach_mul(xs, a))
    return ys


def _coef(s: Scalar, xs: Sequence[Tensor]) -> Scalar:
    """`s` as the coefficient of elementwise math on `xs` (see `_base.coefficient`)."""
    return coefficient(s, xs[0]) if xs and isinstance(s, Tensor) else s


def is_one(s: Scalar) -> bool:
    """`s` is the number 1 (a multiply by it can be skipped); a 0-d tensor never is (no sync)."""
    return not isinstance(s, Tensor) and s == 1


def is_zero(s: Scalar) -> bool:
    """`s` is the number 0; a 0-d tensor never is (no sync)."""
    return not isinstance(s, Tensor) and s == 0


def affine_(x: Scalar, us: list[Tensor], y: Scalar, ps: list[Tensor]) -> list[Tensor]:
    """u ← x·u + y·p, in `us` where it can: call only on a `us` you own (see `owned`);
    `us` keep their dtypes. The same ops, in the same order, as `scale` (u·x) then
    `add_decayed_weights` (u + y·p) out of place, so the results are bitwise theirs."""
    if not is_one(x):
        us = mul_(us, x)
    if not is_zero(y):
        us = axpy_(y, ps, us)
    return us


def scale_add_(ps: list[Tensor], a: Scalar, b: Scalar, us: list[Tensor]) -> None:
    """p ← a·p + b·u in place (the params of a donated step; nothing autograd records)."""
    a, b = _coef(a, ps), _coef(b, ps)
    with torch.no_grad():
        foreach = use_foreach(ps)
        if not is_one(a):
            if foreach:
                torch._foreach_mul_(ps, a)
            else:
                for p in ps:
                    p.mul_(a)
        if is_one(b):
            if foreach:
                torch._foreach_add_(ps, us)
            else:
                for p, u in zip(ps, us):
                    p.add_(u)
        elif not isinstance(b, Tensor):
            if foreach:
                torch._foreach_add_(ps, us, alpha=b)
            else:
                for p, u in zip(ps, us):
                    p.add_(u, alpha=b)
        elif foreach and ps[0].device.type != "cpu":
            torch._foreach_add_(ps, torch._foreach_mul(us, b))
        else:  # per leaf with b as a 0-d tensor operand: no temporary b·u list, no read of b
            for p, u in zip(ps, us):
                p.addcmul_(u, b)


def sqrt_(xs: list[Tensor]) -> list[Tensor]:
    """√x, reusing the storage of `xs` where it can: call only on a list you created."""
    if _owned_inplace(xs):
        torch._foreach_sqrt_(xs)
        return xs
    return sqrt(xs)


def add_scalar_(xs: list[Tensor], s: Scalar) -> list[Tensor]:
    """x + s, reusing the storage of `xs` where it can: call only on a list you created."""
    s = _coef(s, xs)
    if _owned_inplace(xs) and use_foreach(xs, s):
        if isinstance(s, Tensor):  # `alpha` picks the overload that takes a tensor; without it,
            torch._foreach_add_(xs, s, alpha=1)  # Python binds the one taking a number: s.item(), a sync
        else:
            torch._foreach_add_(xs, s)
        return xs
    return add_scalar(xs, s)


def mul_(xs: list[Tensor], s: Scalar) -> list[Tensor]:
    """s·x, reusing the storage of `xs` where it can: call only on a list you created."""
    s = _coef(s, xs)
    if _owned_inplace(xs) and use_foreach(xs, s):
        torch._foreach_mul_(xs, s)
        return xs
    return mul(xs, s)


def div_into_(xs: list[Tensor], ys: list[Tensor]) -> list[Tensor]:
    """x / y, written into the storage of `ys` where it can: call only on a `ys` you created."""
    if _owned_inplace(ys):
        torch._foreach_reciprocal_(ys)
        torch._foreach_mul_(ys, xs)
        return ys
    return div(xs, ys)


def cast_like(xs: list[Tensor], refs: Sequence[Tensor]) -> list[Tensor]:
    """Each `x` in its reference's dtype (a 0-d float64 scalar may have promoted a 0-d leaf)."""
    return [x if x.dtype == r.dtype else x.to(r.dtype) for x, r in zip(xs, refs)]


def mul(xs: list[Tensor], s: Scalar) -> list[Tensor]:
    """s·x."""
    s = _coef(s, xs)
    if use_foreach(xs, s):
        return list(torch._foreach_mul(xs, s))
    return [x * s for x in xs]


def add_scalar(xs: list[Tensor], s: Scalar) -> list[Tensor]:
    """x + s."""
    s = _coef(s, xs)
    # Under torch.compile, _foreach_add with a 0-d tensor bakes the tensor's value into a
    # guard (torch 2.13), so a changed eps would recompile: add it per leaf there instead.
    tensor_in_graph = isinstance(s, Tensor) and torch.compiler.is_compiling()
    if use_foreach(xs, s) and not tensor_in_graph:
        return list(torch._foreach_add(xs, s, alpha=1) if isinstance(s, Tensor) else torch._foreach_add(xs, s))
    return [x + s for x in xs]


def add(xs: list[Tensor], ys: list[Tensor]) -> list[Tensor]:
    """x + y."""
    if use_foreach(xs):
        return list(torch._foreach_add(xs, ys))
    return [x + y for x, y in zip(xs, ys)]


def sub(xs: list[Tensor], ys: list[Tensor]) -> list[Tensor]:
    """x - y."""
    if use_foreach(xs):
        return list(torch._foreach_sub(xs, ys))
    return [x - y for x, y in zip(xs, ys)]


def axpy(a: Scalar, xs: list[Tensor], ys: list[Tensor]) -> list[Tensor]:
    """a·x + y."""
    a = _coef(a, xs)
    if use_foreach(xs, a):
        if isinstance(a, Tensor):
            return list(torch._foreach_add(ys, torch._foreach_mul(xs, a)))
        return list(torch._foreach_add(ys, xs, alpha=a))
    return [a * x + y for x, y in zip(xs, ys)]


def lincomb(a: Scalar, xs: list[Tensor], b: Scalar, ys: list[Tensor]) -> list[Tensor]:
    """a·x + b·y."""
    a, b = _coef(a, xs), _coef(b, ys)
    if use_foreach(xs, a, b):
        out = torch._foreach_mul(xs, a)
        if isinstance(b, Tensor):
            torch._foreach_add_(out, torch._foreach_mul(ys, b))
        else:
            torch._foreach_add_(out, ys, alpha=b)
        return list(out)
    return [a * x + b * y for x, y in zip(xs, ys)]


def ema(ms: list[Tensor], xs: list[Tensor], decay: Scalar) -> list[Tensor]:
    """decay·m + (1 - decay)·x."""
    if use_foreach(ms) and not isinstance(decay, Tensor) and _runs(ms, torch.ops.aten._foreach_lerp.Scalar):
        return list(torch._foreach_lerp(ms, xs, 1.0 - decay))
    return lincomb(decay, ms, _coef(1.0 - decay, xs), xs)


def ema_sq(vs: list[Tensor], xs: list[Tensor], decay: Scalar) -> list[Tensor]:
    """decay·v + (1 - decay)·x²."""
    decay, rest = _coef(decay, vs), _coef(1.0 - decay, xs)
    if use_foreach(vs, decay):
        out = torch._foreach_mul(vs, decay)
        if isinstance(decay, Tensor):
            torch._foreach_add_(out, torch._foreach_mul(torch._foreach_mul(xs, xs), rest))
        else:
            torch._foreach_addcmul_(out, xs, xs, value=rest)  # type: ignore[arg-type]  # a 0-d tensor value: no sync
        return list(out)
    return [decay * v + rest * x * x for v, x in zip(vs, xs)]


def mul_each(xs: list[Tensor], ys: list[Tensor]) -> list[Tensor]:
    """x·y."""
    if use_foreach(xs):
        return list(torch._foreach_mul(xs, ys))
    return [x * y for x, y in zip(xs, ys)]


def div(xs: list[Tensor], ys: list[Tensor]) -> list[Tensor]:
    """x / y."""
    if use_foreach(xs):
        return list(torch._foreach_div(xs, ys))
    return [x / y for x, y in zip(xs, ys)]


def sqrt(xs: list[Tensor]) -> list[Tensor]:
    """√x."""
    if use_foreach(xs):
        return list(torch._foreach_sqrt(xs))
    return [torch.sqrt(x) for x in xs]


def sign(xs: list[Tensor]) -> list[Tensor]:
    """sign(x)."""
    if use_foreach(xs):
        return list(torch._foreach_sign(xs))
    return [torch.sign(x) for x in xs]


def norms(xs: list[Tensor], dtype: torch.dtype | None = None) -> list[Tensor]:
    """‖x‖₂ of each leaf, as 0-d tensors in the leaf's dtype (or accumulated in `dtype`)."""
    if use_foreach(xs):
        return list(torch._foreach_norm(xs, 2, dtype=dtype))
    return [torch.linalg.vector_norm(x, dtype=dtype) for x in xs]


def member_norms(xs: list[Tensor], stacked: list[bool]) -> list[Tensor]:
    """`norms`, where a leaf marked in `stacked` (a (k, *shape) stack of k leaves under flat
    buffers) gives its members' norms shaped (k, 1, ...), to broadcast against it."""
    out = dict(zip((i for i, s in enumerate(stacked) if not s), norms([x for x, s in zip(xs, stacked) if not s])))
    for i, (x, s) in enumerate(zip(xs, stacked)):
        if s:
            out[i] = torch.linalg.vector_norm(x, dim=tuple(range(1, x.dim())), keepdim=True) if x.dim() > 1 else x.abs()
    return [out[i] for i in range(len(xs))]


def member_sums(xs: list[Tensor], stacked: list[bool]) -> list[Tensor]:
    """Σx of each leaf in float64 (0-d), where a leaf marked in `stacked` (a (k, *shape) stack
    of k leaves under flat buffers) gives its members' sums shaped (k, 1, ...)."""
    out = []
    for x, s in zip(xs, stacked):
        dims = tuple(range(1, x.dim())) if s else tuple(range(x.dim()))
        out.append(torch.sum(x, dim=dims, keepdim=s, dtype=torch.float64) if dims else x.to(torch.float64))
    return out


def global_norm(xs: list[Tensor]) -> Tensor:
    """‖(x₁, …, xₙ)‖₂ as one 0-d tensor, accumulated in float32 at least."""
    if not xs:
        return torch.zeros((), dtype=torch.float32)
    acc = torch.float64 if any(x.dtype == torch.float64 for x in xs) else torch.float32
    if all(type(x) in _PLAIN for x in xs) or _one_mesh(xs):
        return torch.linalg.vector_norm(torch.stack([n.to(acc) for n in norms(xs)]))
    # DTensors of several meshes (or beside plain tensors): Σx² per leaf is a partial sum that
    # adds within a mesh (a norm's partial placement does not), one collective per mesh.
    return torch.sqrt(sum_scalars([torch.sum(torch.square(x.to(acc))) for x in xs]))


def where(cond: Tensor, xs: list[Tensor], ys: list[Tensor]) -> list[Tensor]:
    """x where `cond` (a 0-d bool) else y, leaf by leaf."""
    return [torch.where(cond, x, y) for x, y in zip(xs, ys)]


def nonfinite_count(xs: list[Tensor]) -> Tensor:
    """A 0-d int64: how many leaves of `xs` hold a non-finite element (plain tensors), or how
    many non-finite elements they hold (tensor subclasses)."""
    if not xs:
        return torch.zeros((), dtype=torch.int64)
    if all(type(x) in (Tensor, torch.nn.Parameter) for x in xs):
        # min and max of each leaf in one pass each (NaN propagates, ±inf shows), no
        # elementwise mask to count.
        ends = [torch.stack(torch.aminmax(x)).to(torch.float64) for x in xs if x.is_floating_point() and x.numel()]
        if not ends:
            return torch.zeros((), dtype=torch.int64, device=xs[0].device)
        return (~torch.isfinite(torch.stack(ends))).any(dim=1).sum()
    # Under FSDP2 on whole DTensors, the per-leaf counts of sharded and replicated leaves are
    # Partial(sum) and Replicate DTensors, which add; flags would not combine.
    counts = [(~torch.isfinite(x)).sum() for x in xs]
    if _one_mesh(xs):
        bad = counts[0]
        for c in counts[1:]:
            bad = bad + c
        return bad
    return sum_scalars(counts)  # several meshes: one collective per mesh and placement


def all_finite(xs: list[Tensor]) -> Tensor:
    """A 0-d bool: every element of every leaf is finite."""
    if not xs:
        return torch.ones((), dtype=torch.bool)
    return nonfinite_count(xs) == 0
