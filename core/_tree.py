"""Pytree utilities over `torch.utils._pytree` trees: paths, checks, state access by name, applying updates."""

from __future__ import annotations

from typing import Any, Callable, Iterator, Sequence

import torch
import torch.utils._pytree as pytree
from torch import Tensor

from ._base import PyTree, require_params
from ._foreach import global_norm, use_foreach

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

    Examples:
        >>> import torch, purestep.core as ps
        >>> ps.tree_map(lambda m, g: 0.9 * m + g, {"w": torch.ones(2)}, {"w": torch.ones(2)})
        {'w': tensor([1.9000, 1.9000])}
    """
    return pytree.tree_map(fn, tree, *rest)


def tree_leaves(tree: PyTree) -> list[Any]:
    """The leaves of `tree`, in flatten order.

    Examples:
        >>> import torch, purestep.core as ps
        >>> ps.tree_leaves({"b": torch.zeros(1), "a": (torch.ones(1), torch.ones(2))})
        [tensor([0.]), tensor([1.]), tensor([1., 1.])]
    """
    return pytree.tree_leaves(tree)


def tree_flatten(tree: PyTree) -> tuple[list[Any], pytree.TreeSpec]:
    """The leaves of `tree` and the spec that `tree_unflatten` rebuilds it from.

    Examples:
        >>> import torch, purestep.core as ps
        >>> leaves, spec = ps.tree_flatten({"w": torch.ones(2)})
        >>> ps.tree_unflatten([2 * x for x in leaves], spec)
        {'w': tensor([2., 2.])}
    """
    return pytree.tree_flatten(tree)


def tree_flatten_with_path(tree: PyTree) -> tuple[list[tuple[str, Any]], pytree.TreeSpec]:
    """Leaves with their dotted paths, and the spec to rebuild the tree.

    Examples:
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

    Examples:
        >>> import torch, purestep.core as ps
        >>> ps.tree_map_with_path(lambda path, x: x.dim() >= 2 and "bias" not in path,
        ...                       {"fc.weight": torch.ones(2, 2), "fc.bias": torch.ones(2)})
        {'fc.weight': True, 'fc.bias': False}
    """
    return pytree.tree_map_with_path(lambda p, *xs: fn(path_str(p), *xs), tree, *rest)


def tree_zeros_like(tree: PyTree) -> PyTree:
    """A tree of zeros shaped and typed like `tree` (a momentum buffer at init).

    Examples:
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


def state_bytes(tree: PyTree) -> int:
    """The bytes of tensor memory this rank holds for `tree` (an optimizer state, an EMA):
    each tensor leaf's elements times their size, a DTensor by its local part (this rank's
    block or piece), a tensor that appears twice once. No collective, no host sync.

    Examples:
        >>> import torch, purestep.core as ps
        >>> ps.state_bytes(ps.adamw(1e-3).init({"w": torch.zeros(4, 4)}))  # mu and nu, and the 8-byte count
        136
    """
    seen: set[int] = set()
    total = 0
    for x in pytree.tree_leaves(tree):
        if not isinstance(x, Tensor) or id(x) in seen:
            continue
        seen.add(id(x))
        own = getattr(x, "_local_tensor", x)  # a DTensor's local part
        total += own.numel() * own.element_size()
    return total


def bytes_per_rank(tree: PyTree, world: int | None = None) -> list[int]:
    """The bytes of tensor memory each rank holds for `tree`, by global rank, read from the
    placements alone (no collective: it plans a run on torch's fake process group as well as
    it counts a real one). A DTensor counts its block at every coordinate of its mesh
    (DTensor's own chunking, `_StridedShard` included) and nothing on ranks outside the mesh
    (state held at an owner counts there alone); a plain tensor counts on every rank; a
    tensor that appears twice once.

    Args:
      tree: any tree of tensors (params, grads, an optimizer state).
      world: the number of ranks (None: the default process group's size, 1 without one).

    Returns:
      A list of `world` ints; `ps.state_bytes(tree)` is this rank's entry.

    Examples:
        >>> import torch, purestep.core as ps
        >>> ps.bytes_per_rank(ps.adamw(1e-3).init({"w": torch.zeros(4, 4)}), world=2)  # plain tensors: on every rank
        [136, 136]
    """
    import itertools
    import math

    from . import _compat as compat

    if world is None:
        dist = torch.distributed
        world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    out = [0] * world
    seen: set[int] = set()
    blocks: dict[tuple, list[tuple[int, int]]] = {}  # a layout -> (global rank, local numel) per coordinate
    for x in pytree.tree_leaves(tree):
        if not isinstance(x, Tensor) or id(x) in seen:
            continue
        seen.add(id(x))
        mesh = getattr(x, "device_mesh", None)
        if mesh is None:
            for r in range(world):
                out[r] += x.numel() * x.element_size()
            continue
        ranks, placements = mesh.mesh, tuple(getattr(x, "placements"))
        key = (tuple(x.shape), placements, tuple(ranks.shape), tuple(ranks.flatten().tolist()))
        if key not in blocks:
            blocks[key] = [
                (int(ranks[c]), math.prod(compat.local_box(x.shape, ranks.shape, list(c), placements)[0]))
                for c in itertools.product(*(range(n) for n in ranks.shape))
            ]
        for r, n in blocks[key]:
            out[r] += n * x.element_size()
    return out


def tree_global_norm(tree: PyTree) -> Tensor:
    """The 2-norm of all leaves together, as one 0-d tensor (float32 at least)."""
    return global_norm(pytree.tree_leaves(tree))


# --------------------------------------------------------------------------- #
# Checking that trees match.
# --------------------------------------------------------------------------- #


def dict_leaves(*trees: PyTree) -> list[list[Tensor]] | None:
    """The leaves of each tree when all are flat dicts of tensors with the same keys in the
    same order (the canonical params tree), which is how pytree would flatten them; None
    for anything else. A walk without pytree's specs: per-step overhead, not math."""
    keys = None
    out = []
    for tree in trees:
        if type(tree) is not dict:
            return None
        if keys is None:
            keys = list(tree)
        elif list(tree) != keys:
            return None
        values = list(tree.values())
        if not all(isinstance(x, Tensor) for x in values):
            return None
        out.append(values)
    return out


def params_for(params: PyTree, grads: PyTree, who: str) -> list[Any]:
    """The leaves of `params` for `who`, whose update reads them: an error naming `who` when
    they are not given, or when they are not structured and shaped like `grads`."""
    require_params(params, who)
    return check_match(params, grads, "params", "grads", dtype=False)


def check_match(
    tree: PyTree, like: PyTree, what: str = "grads", like_what: str = "params", *, dtype: bool = True
) -> list[Tensor]:
    """The leaves of `tree`, after checking it matches `like` leaf for leaf.

    Raises a `ValueError` naming the first missing, extra or mismatched leaf path.
    """
    fast = dict_leaves(tree, like)
    if fast is not None:
        leaves, ref = fast
        spec = ref_spec = None
    else:
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


def children(node: Any) -> list[tuple[Any, Any]]:
    if _is_namedtuple(node):
        return [(f, getattr(node, f)) for f in node._fields]
    if isinstance(node, dict):
        return list(node.items())
    if isinstance(node, (list, tuple)):
        return list(enumerate(node))
    return []


def _find(tree: Any, name: str, path: tuple = ()) -> Iterator[tuple[tuple, Any]]:
    for key, child in children(tree):
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
    for key, child in children(tree):
        if isinstance(key, str):
            yield key, child
        yield from _walk_keys(child)


def tree_get(tree: PyTree, name: str) -> Any:
    """The unique NamedTuple field or dict entry called `name` anywhere in `tree`.

    Raises `KeyError` listing the candidates when it is missing or ambiguous.

    Examples:
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

    Examples:
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

    Examples:
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
            for key, child in children(node):
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

    Examples:
        >>> import torch, purestep.core as ps
        >>> ps.apply_updates({"w": torch.ones(2)}, {"w": torch.full((2,), -0.5)})
        {'w': tensor([0.5000, 0.5000])}
    """
    us = check_match(updates, params, "updates", "params", dtype=False)
    ps_, spec = pytree.tree_flatten(params)
    if use_foreach(ps_) and all(p.dtype == u.dtype for p, u in zip(ps_, us)):
        out = torch._foreach_add(ps_, us)
    else:
        out = [(p + u).to(p.dtype) for p, u in zip(ps_, us)]  # type: ignore[assignment]
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
