"""Pytree utilities over `torch.utils._pytree` trees, and leaf-list math.

Leaf-list math runs as one `torch._foreach_*` kernel per op in eager mode; under a
`torch.func` transform (vmap has no foreach rule) the same math runs per leaf.
"""

from __future__ import annotations

from typing import Any, Callable, Iterator, Sequence

import torch
import torch.utils._pytree as pytree
from torch import Tensor

from ._base import PyTree

Scalar = float | Tensor

# --------------------------------------------------------------------------- #
# Paths.
# --------------------------------------------------------------------------- #


def _key_str(key: Any) -> str:
    for attr in ("key", "idx", "name"):
        if hasattr(key, attr):
            return str(getattr(key, attr))
    return str(key)


def path_str(path: Sequence[Any]) -> str:
    """A key path as a dotted string: `layers.1.mlp.bias`."""
    return ".".join(_key_str(k) for k in path)


def tree_map(fn: Callable[..., Any], tree: PyTree, *rest: PyTree) -> PyTree:
    """`fn(leaf, *other_leaves)` over every leaf of `tree` (and the same leaves of `rest`).

    Example:
        >>> import torch, purestep.core as ps
        >>> ps.tree_map(lambda m, g: 0.9 * m + g, {"w": torch.ones(2)}, {"w": torch.ones(2)})
        {'w': tensor([1.9000, 1.9000])}
    """
    return pytree.tree_map(fn, tree, *rest)


def tree_leaves(tree: PyTree) -> list[Any]:
    """The leaves of `tree`, in flatten order.

    Example:
        >>> import torch, purestep.core as ps
        >>> ps.tree_leaves({"b": torch.zeros(1), "a": (torch.ones(1), torch.ones(2))})
        [tensor([0.]), tensor([1.]), tensor([1., 1.])]
    """
    return pytree.tree_leaves(tree)


def tree_flatten(tree: PyTree) -> tuple[list[Any], pytree.TreeSpec]:
    """The leaves of `tree` and the spec that `tree_unflatten` rebuilds it from.

    Example:
        >>> import torch, purestep.core as ps
        >>> leaves, spec = ps.tree_flatten({"w": torch.ones(2)})
        >>> ps.tree_unflatten([2 * x for x in leaves], spec)
        {'w': tensor([2., 2.])}
    """
    return pytree.tree_flatten(tree)


def tree_flatten_with_path(tree: PyTree) -> tuple[list[tuple[str, Any]], pytree.TreeSpec]:
    """Leaves with their dotted paths, and the spec to rebuild the tree.

    Example:
        >>> import torch, purestep.core as ps
        >>> pairs, spec = ps.tree_flatten_with_path({"a": [torch.zeros(1), torch.ones(1)]})
        >>> [p for p, _ in pairs]
        ['a.0', 'a.1']
    """
    pairs, spec = pytree.tree_flatten_with_path(tree)
    return [(path_str(p), leaf) for p, leaf in pairs], spec


def tree_unflatten(leaves: Sequence[Any], spec: pytree.TreeSpec) -> PyTree:
    """Rebuild a tree from its leaves and spec (the inverse of `tree_flatten` and `tree_flatten_with_path`)."""
    return pytree.tree_unflatten(list(leaves), spec)


def tree_paths(tree: PyTree) -> list[str]:
    """The dotted path of every leaf, in flatten order."""
    return [p for p, _ in tree_flatten_with_path(tree)[0]]


def tree_map_with_path(fn: Callable[..., Any], tree: PyTree, *rest: PyTree) -> PyTree:
    """`fn(path, leaf, *other_leaves)` over every leaf; `path` is the dotted string.

    Example:
        >>> import torch, purestep.core as ps
        >>> ps.tree_map_with_path(lambda path, x: x.dim() >= 2 and "bias" not in path,
        ...                       {"fc.weight": torch.ones(2, 2), "fc.bias": torch.ones(2)})
        {'fc.weight': True, 'fc.bias': False}
    """
    return pytree.tree_map_with_path(lambda p, *xs: fn(path_str(p), *xs), tree, *rest)


def tree_zeros_like(tree: PyTree) -> PyTree:
    """A tree of zeros shaped and typed like `tree` (a momentum buffer at init).

    Example:
        >>> import torch, purestep.core as ps
        >>> ps.tree_zeros_like({"w": torch.ones(2, dtype=torch.float64)})
        {'w': tensor([0., 0.], dtype=torch.float64)}
    """
    return pytree.tree_map(torch.zeros_like, tree)


def tree_cast(tree: PyTree, dtype: torch.dtype | None) -> PyTree:
    """Floating-point leaves cast to `dtype` (None leaves the tree as it is)."""
    if dtype is None:
        return tree
    return pytree.tree_map(lambda x: x.to(dtype) if torch.is_floating_point(x) else x, tree)


def tree_global_norm(tree: PyTree) -> Tensor:
    """The 2-norm of all leaves together, as one 0-d tensor (float32 at least)."""
    return global_norm(pytree.tree_leaves(tree))


# --------------------------------------------------------------------------- #
# Checking that trees match.
# --------------------------------------------------------------------------- #


def check_match(
    tree: PyTree, like: PyTree, what: str = "grads", like_what: str = "params", *, dtype: bool = True
) -> list[Tensor]:
    """The leaves of `tree`, after checking it matches `like` leaf for leaf.

    Raises a `ValueError` naming the first missing, extra or mismatched leaf path.
    """
    leaves, spec = pytree.tree_flatten(tree)
    ref, ref_spec = pytree.tree_flatten(like)
    if spec != ref_spec:
        got = dict(tree_flatten_with_path(tree)[0])
        want = dict(tree_flatten_with_path(like)[0])
        missing = [p for p in want if p not in got]
        extra = [p for p in got if p not in want]
        if missing:
            raise ValueError(f"{what} has no leaf '{missing[0]}' that {like_what} has ({len(missing)} missing)")
        if extra:
            raise ValueError(f"{what} has a leaf '{extra[0]}' that {like_what} lacks ({len(extra)} extra)")
        raise ValueError(f"{what} is not structured like {like_what}: {spec} vs {ref_spec}")
    for i, (x, y) in enumerate(zip(leaves, ref)):
        if not isinstance(x, Tensor) or x.shape != y.shape or (dtype and x.dtype != y.dtype):
            path = tree_paths(like)[i]
            if not isinstance(x, Tensor):
                raise ValueError(f"{what} leaf '{path}' is {type(x).__name__}, not a tensor")
            if x.shape != y.shape:
                raise ValueError(
                    f"{what} leaf '{path}' has shape {tuple(x.shape)} but {like_what} has {tuple(y.shape)}"
                )
            raise ValueError(f"{what} leaf '{path}' has dtype {x.dtype} but {like_what} has {y.dtype}")
    return leaves


# --------------------------------------------------------------------------- #
# State access by name.
# --------------------------------------------------------------------------- #


def _is_namedtuple(x: Any) -> bool:
    return isinstance(x, tuple) and hasattr(x, "_fields")


is_namedtuple = _is_namedtuple


def _children(node: Any) -> list[tuple[Any, Any]]:
    if _is_namedtuple(node):
        return [(f, getattr(node, f)) for f in node._fields]
    if isinstance(node, dict):
        return list(node.items())
    if isinstance(node, (list, tuple)):
        return list(enumerate(node))
    return []


def _find(tree: Any, name: str, path: tuple = ()) -> Iterator[tuple[tuple, Any]]:
    for key, child in _children(tree):
        if key == name:
            yield path + (key,), child
        yield from _find(child, name, path + (key,))


def _unique(tree: PyTree, name: str) -> tuple[tuple, Any]:
    found = list(_find(tree, name))
    if len(found) == 1:
        return found[0]
    if not found:
        names = sorted({str(k) for k, _ in _walk_keys(tree)})
        raise KeyError(f"no field or entry named {name!r} in the tree; names present: {', '.join(names)}")
    paths = ", ".join(path_str(p) for p, _ in found)
    hint = "; for the number of updates applied use ps.step_count(state)" if name == "count" else ""
    raise KeyError(f"{name!r} is ambiguous: found at {paths}; reach one with tree_get on a sub-state{hint}")


def _walk_keys(tree: Any) -> Iterator[tuple[Any, Any]]:
    for key, child in _children(tree):
        if isinstance(key, str):
            yield key, child
        yield from _walk_keys(child)


def tree_get(tree: PyTree, name: str) -> Any:
    """The unique NamedTuple field or dict entry called `name` anywhere in `tree`.

    Raises `KeyError` listing the candidates when it is missing or ambiguous.

    Example:
        >>> import torch, purestep.core as ps
        >>> opt = ps.adam(1e-3)
        >>> state = opt.init({"w": torch.zeros(3)})
        >>> ps.tree_get(state, "count")
        tensor(0)
    """
    return _unique(tree, name)[1]


def _replace(node: Any, path: tuple, value: Any) -> Any:
    if not path:
        return value
    key, rest = path[0], path[1:]
    if _is_namedtuple(node):
        return node._replace(**{key: _replace(getattr(node, key), rest, value)})
    if isinstance(node, dict):
        out = dict(node)
        out[key] = _replace(node[key], rest, value)
        return type(node)(out) if type(node) is not dict else out
    items = list(node)
    items[key] = _replace(items[key], rest, value)
    return type(node)(items)


def tree_set(tree: PyTree, name: str, value: Any) -> PyTree:
    """A copy of `tree` with the unique field or entry called `name` replaced by `value`.

    Example:
        >>> import torch, purestep.core as ps
        >>> state = ps.adam(1e-3).init({"w": torch.zeros(3)})
        >>> ps.tree_get(ps.tree_set(state, "count", torch.tensor(5)), "count")
        tensor(5)
    """
    path, _ = _unique(tree, name)
    return _replace(tree, path, value)


def _is_counter(key: Any, x: Any) -> bool:
    return key == "count" and isinstance(x, Tensor) and not x.is_floating_point()


def step_count(state: PyTree) -> Tensor:
    """The number of updates applied: the outermost step counter of an optimizer state.

    The counter is the `count` field nearest the root of `state` (breadth first; among
    counters at one depth, the first in flatten order). Every counter in purestep counts
    the updates of its own transform, so within one state they agree, except across the
    wrappers that hold an inner state back: calls that `apply_if_finite` skips and calls
    that `accumulate` only accumulates leave their inner state, and so its counter,
    unchanged. Hence `step_count` counts updates applied to params, not calls, for
    `apply_if_finite(adamw(...))` and `accumulate(adamw(...), every=k)` (k calls, one
    update). `inject_hyperparams`, `schedule_free_adamw`, `muon_adamw` (both sides count)
    and chains of several counters give the same number. It is the step a schedule
    sees: the first update runs at step 0, after it `step_count` is 1.

    Returns the int64 counter itself (no copy, no host sync): 0-d, or one per member,
    shape (N,), for a state stacked by `vmap(opt.init)` (an ensemble).

    Raises:
      KeyError: when no part of the optimizer keeps a counter (`ps.sgd(0.1)` with a
        constant lr and no momentum keeps no state); wrap it in
        `ps.inject_hyperparams(...)` to count.

    Example:
        >>> import torch, purestep.core as ps
        >>> opt = ps.chain(ps.clip_by_running_norm(), ps.adamw(lr=ps.cosine_schedule(1e-3, 100)))
        >>> params = {"w": torch.zeros(2)}
        >>> state = opt.init(params)
        >>> _, state = opt.update({"w": torch.ones(2)}, state, params)
        >>> ps.step_count(state)
        tensor(1)
    """
    level = [state]
    while level:
        deeper = []
        for node in level:
            for key, child in _children(node):
                if _is_counter(key, child):
                    return child
                deeper.append(child)
        level = deeper
    raise KeyError(
        "this state keeps no step counter (e.g. ps.sgd with a constant lr and no momentum keeps no "
        "state at all); build the optimizer with ps.inject_hyperparams(factory)(...) to count its updates"
    )


def replace_at(tree: PyTree, path: tuple, value: Any) -> PyTree:
    """A copy of `tree` with the node at key `path` replaced."""
    return _replace(tree, path, value)


def find_all(tree: PyTree, name: str) -> list[tuple[tuple, Any]]:
    """Every `(key path, value)` whose key is `name`."""
    return list(_find(tree, name))


# --------------------------------------------------------------------------- #
# Applying updates.
# --------------------------------------------------------------------------- #


def apply_updates(params: PyTree, updates: PyTree) -> PyTree:
    """New params `p + u`, each cast back to its param's dtype.

    Example:
        >>> import torch, purestep.core as ps
        >>> ps.apply_updates({"w": torch.ones(2)}, {"w": torch.full((2,), -0.5)})
        {'w': tensor([0.5000, 0.5000])}
    """
    us = check_match(updates, params, "updates", "params", dtype=False)
    ps_, spec = pytree.tree_flatten(params)
    if use_foreach(ps_) and all(p.dtype == u.dtype for p, u in zip(ps_, us)):
        out = torch._foreach_add(ps_, us)
    else:
        out = [(p + u).to(p.dtype) for p, u in zip(ps_, us)]
    return pytree.tree_unflatten(out, spec)


def apply_updates_(params: PyTree, updates: PyTree) -> PyTree:
    """Adds `updates` to `params` in place (no autograd tracking) and returns `params`."""
    us = check_match(updates, params, "updates", "params", dtype=False)
    ps_ = pytree.tree_leaves(params)
    with torch.no_grad():
        if use_foreach(ps_):
            torch._foreach_add_(ps_, us)
        else:
            for p, u in zip(ps_, us):
                p.add_(u)
    return params


# --------------------------------------------------------------------------- #
# Leaf-list math. Each op takes lists of tensors and float-or-0-d-tensor scalars.
# --------------------------------------------------------------------------- #


def use_foreach(xs: Sequence[Tensor], *scalars: Scalar) -> bool:
    """Whether foreach kernels may run: not under a torch.func transform, and not with a
    0-d tensor `scalar` that autograd differentiates (foreach's backward for a tensor
    scalar fails: "inconsistent range for TensorList output"; meta-gradients need it)."""
    if not xs or torch._C._functorch.peek_interpreter_stack() is not None:
        return False  # under vmap/grad, also when torch.compile traces vmap(step)
    if torch.compiler.is_compiling():
        return True
    return not (torch.is_grad_enabled() and any(isinstance(s, Tensor) and s.requires_grad for s in scalars))


def _owned_inplace(xs: list[Tensor]) -> bool:
    # In-place kernels may reuse the storage of a list the caller created itself, but
    # not while autograd records it (the backward of sqrt, say, needs its output).
    # Compiled code plans its own buffers: there the plain ops make a smaller graph.
    if torch.compiler.is_compiling():
        return False
    return use_foreach(xs) and not (torch.is_grad_enabled() and xs[0].requires_grad)


def leafwise(xs: Sequence[Tensor], *scalars: Scalar) -> bool:
    """Whether eager CPU math may run leaf by leaf, in place on its own intermediates.

    On CPU a foreach kernel is a loop over the leaves, so a chain of them sweeps all the
    leaves once per op; running every op of one leaf before the next keeps that leaf's
    intermediates in cache (10M fp32 params in 50 leaves: AdamW's leaf math 15% faster).
    Only in eager mode (compiled code plans its own loops; vmap needs the per-leaf ops of
    `use_foreach`'s fallback anyway) and with nothing that autograd records.
    """
    if not _owned_inplace(list(xs)) or any(x.device.type != "cpu" for x in xs):
        return False
    if not torch.is_grad_enabled():
        return True
    return not any(x.requires_grad for x in xs) and not any(getattr(s, "requires_grad", False) for s in scalars)


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
        elif kind is tuple or kind is list or _is_namedtuple(node):
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
    and params as `others`) before letting the next transform write into them
    (`update_owned`): an update that is a grad passed through, a state leaf or a view of
    one is not the chain's to overwrite.
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


def sqrt_(xs: list[Tensor]) -> list[Tensor]:
    """√x, reusing the storage of `xs` where it can: call only on a list you created."""
    if _owned_inplace(xs):
        torch._foreach_sqrt_(xs)
        return xs
    return sqrt(xs)


def add_scalar_(xs: list[Tensor], s: Scalar) -> list[Tensor]:
    """x + s, reusing the storage of `xs` where it can: call only on a list you created."""
    if _owned_inplace(xs) and use_foreach(xs, s):
        torch._foreach_add_(xs, s)
        return xs
    return add_scalar(xs, s)


def mul_(xs: list[Tensor], s: Scalar) -> list[Tensor]:
    """s·x, reusing the storage of `xs` where it can: call only on a list you created."""
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
    if use_foreach(xs, s):
        return list(torch._foreach_mul(xs, s))
    return [x * s for x in xs]


def add_scalar(xs: list[Tensor], s: Scalar) -> list[Tensor]:
    """x + s."""
    # Under torch.compile, _foreach_add with a 0-d tensor bakes the tensor's value into a
    # guard (torch 2.13), so a changed eps would recompile: add it per leaf there instead.
    tensor_in_graph = isinstance(s, Tensor) and torch.compiler.is_compiling()
    if use_foreach(xs, s) and not tensor_in_graph:
        return list(torch._foreach_add(xs, s))
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
    if use_foreach(xs, a):
        if isinstance(a, Tensor):
            return list(torch._foreach_add(ys, torch._foreach_mul(xs, a)))
        return list(torch._foreach_add(ys, xs, alpha=a))
    return [a * x + y for x, y in zip(xs, ys)]


def lincomb(a: Scalar, xs: list[Tensor], b: Scalar, ys: list[Tensor]) -> list[Tensor]:
    """a·x + b·y."""
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
    if use_foreach(ms) and not isinstance(decay, Tensor):
        return list(torch._foreach_lerp(ms, xs, 1.0 - decay))
    return lincomb(decay, ms, 1.0 - decay, xs)


def ema_sq(vs: list[Tensor], xs: list[Tensor], decay: Scalar) -> list[Tensor]:
    """decay·v + (1 - decay)·x²."""
    if use_foreach(vs, decay):
        out = torch._foreach_mul(vs, decay)
        if isinstance(decay, Tensor):
            torch._foreach_add_(out, torch._foreach_mul(torch._foreach_mul(xs, xs), 1.0 - decay))
        else:
            torch._foreach_addcmul_(out, xs, xs, value=1.0 - decay)
        return list(out)
    return [decay * v + (1.0 - decay) * x * x for v, x in zip(vs, xs)]


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


def norms(xs: list[Tensor]) -> list[Tensor]:
    """‖x‖₂ of each leaf, as 0-d tensors in the leaf's dtype."""
    if use_foreach(xs):
        return list(torch._foreach_norm(xs))
    return [torch.linalg.vector_norm(x) for x in xs]


def member_norms(xs: list[Tensor], stacked: list[bool]) -> list[Tensor]:
    """`norms`, where a leaf marked in `stacked` (a (k, *shape) stack of k leaves under flat
    buffers) gives its members' norms shaped (k, 1, ...), to broadcast against it."""
    out = dict(zip((i for i, s in enumerate(stacked) if not s), norms([x for x, s in zip(xs, stacked) if not s])))
    for i, (x, s) in enumerate(zip(xs, stacked)):
        if s:
            out[i] = torch.linalg.vector_norm(x, dim=tuple(range(1, x.dim())), keepdim=True) if x.dim() > 1 else x.abs()
    return [out[i] for i in range(len(xs))]


def global_norm(xs: list[Tensor]) -> Tensor:
    """‖(x₁, …, xₙ)‖₂ as one 0-d tensor, accumulated in float32 at least."""
    if not xs:
        return torch.zeros((), dtype=torch.float32)
    acc = torch.float64 if any(x.dtype == torch.float64 for x in xs) else torch.float32
    per_leaf = [n.to(acc) for n in norms(xs)]
    return torch.linalg.vector_norm(torch.stack(per_leaf))


def where(cond: Tensor, xs: list[Tensor], ys: list[Tensor]) -> list[Tensor]:
    """x where `cond` (a 0-d bool) else y, leaf by leaf."""
    return [torch.where(cond, x, y) for x, y in zip(xs, ys)]


def all_finite(xs: list[Tensor]) -> Tensor:
    """A 0-d bool: every element of every leaf is finite."""
    if not xs:
        return torch.ones((), dtype=torch.bool)
    # A count of non-finite elements rather than a product of flags: under FSDP2 the
    # per-leaf counts of sharded and replicated leaves are Partial(sum) and Replicate
    # DTensors, which add; Partial(product) flags and Replicate ones do not combine.
    counts = [(~torch.isfinite(x)).sum() for x in xs]
    bad = counts[0]
    for c in counts[1:]:
        bad = bad + c
    return bad == 0
