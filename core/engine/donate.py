"""Writing new values into the user's tensors: the one place donation touches storage.

A donated update hands back the trees it was given, holding the new values. Five ways to
get them there, each with its storage rule, and nothing else in the engine writes into a
user's tensor (the one other writer is a transform's own in-place form on the eager paths,
`with_in_place`: `p ← a·p + b·u` into the params it is given):

- `add_into(params, updates)` (eager paths): `p ← a·p + b·u` in place, for an update
  computed whole (a transform without an in-place form, make_step's eager step).

- `copy_into(dst, src)`: copy each new leaf into the old tensor (`copy_`; DTensors leaf by
  leaf, a reduction's Partial result redistributed first). Always correct; costs a copy.
- `adopt_into(dst, src, taken)` (eager paths): the old tensor takes over its new value's
  storage (`Tensor.set_`), no copy, when that storage is the new value's alone, laid out
  as the old tensor was, and not one the caller still holds (`Taken`: the grads, params,
  old state); else it is copied. Small leaves are copied (cheaper than the checks).
- `repoint_(user, view)` / `bind_tree` (flat buffers): the user's tensor becomes a view
  of its slice of a flat buffer, values copied first; the tensor object stays the same.
  `functional_model`'s detached alias of a module Parameter is re-pointed with it.
- `move_storage(user, view)` (FSDP2 params, whose storage FSDP itself holds): the memory
  behind the user's storage object moves into the buffer (`_swap_data_ptr_`), so every
  tensor on that storage, FSDP's own included, reads and writes the buffer.

Inside a compiled step the new values are written with `write_back` (a `_foreach_copy_`
inductor turns into stores of the fused kernel).
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.utils._pytree as pytree
from torch import Tensor

from .. import _compat as compat
from .. import _foreach as ls
from .. import _tree as tr
from .._base import PyTree
from .dtensor import is_dtensor
from .packed import is_packed


def add_into(params: PyTree, updates: PyTree, a: Any = 1.0, b: Any = 1.0) -> None:
    """`p ← a·p + b·u` into the user's params, in place: the eager paths' apply of updates
    (`per_leaf.apply_in_place` where a transform has no in-place form of its own)."""
    ls.scale_add_(tr.check_match(params, updates, "params", "updates", dtype=False), a, b, tr.tree_leaves(updates))


def copy_into(dst_tree: PyTree, src_tree: PyTree, what: str, defer: list | None = None) -> None:
    """Write each leaf of `src_tree` into the same leaf of `dst_tree` (donation). `defer`: a
    list that takes the `(dst, src)` pairs of 0-d leaves instead, for the caller to copy
    after a compiled program (see `copy_scalars`)."""
    dst, dst_spec = pytree.tree_flatten(dst_tree)
    src, src_spec = pytree.tree_flatten(src_tree)
    if dst_spec != src_spec:
        raise ValueError(
            f"donate=True needs the new {what} structured like the old one; the transform changed "
            f"{dst_spec} into {src_spec}"
        )
    pairs = [(d, s) for d, s in zip(dst, src) if isinstance(d, Tensor) and d is not s]
    if defer is not None:
        defer += [(d, s) for d, s in pairs if d.dim() == 0]
        pairs = [(d, s) for d, s in pairs if d.dim() != 0]
    if not pairs:
        return
    with torch.no_grad():
        # DTensor (FSDP2 params) has no sharding rule for `_foreach_copy_`: copy leaf by leaf.
        plain = all(type(d) in (Tensor, torch.nn.Parameter) for d, _ in pairs)
        if plain and ls.use_foreach([d for d, _ in pairs]):
            torch._foreach_copy_([d for d, _ in pairs], [s for _, s in pairs])
        else:
            for d, s in pairs:
                if is_dtensor(s):  # a reduction's result may be Partial, or a DTensor for a plain leaf
                    s = s.redistribute(d.device_mesh, d.placements) if is_dtensor(d) else s.full_tensor()  # type: ignore[attr-defined]
                d.copy_(s)


def copy_scalars(program: Callable) -> Callable:
    """`program` (a compiled `in_place` form run with `defer_scalars=True`), then its 0-d
    leaves copied in, uncompiled: inductor (2.13) drops a `copy_` into a 0-d float64 CPU
    input (a schedule's stored value stayed its first) and may order a count's store before a
    read of the old count; counts and hyperparameters copied after the program are always right."""

    def run(*args: Any, **kwargs: Any) -> Any:
        out, deferred = program(*args, **kwargs)
        if deferred:
            dsts = {id(d) for d, _ in deferred}
            with torch.no_grad():  # a source that is also a destination is read before any write
                srcs = [s.clone() if id(s) in dsts else s for _, s in deferred]
                torch._foreach_copy_([d for d, _ in deferred], srcs)
        return out

    return run


def _storages(*trees: Any) -> set[int]:
    """The addresses of the storages behind every tensor leaf of `trees`."""
    return {x.untyped_storage().data_ptr() for x in ls.tensors_in(*trees) if type(x) in (Tensor, torch.nn.Parameter)}


def _leaf_pairs(dst: Any, src: Any, out: list) -> bool:
    """Collect the matching tensor leaves of two trees of dicts, lists, tuples and
    NamedTuples into `out` (a walk, without pytree's specs); False for any other node or a
    difference in structure, which the caller leaves to pytree."""
    if dst is src:
        return True  # a subtree updated in place: nothing to adopt
    if isinstance(dst, Tensor) or isinstance(src, Tensor):
        if isinstance(dst, Tensor) and isinstance(src, Tensor):
            out.append((dst, src))
            return True
        return False
    kind = type(dst)
    if kind is not type(src):
        return False
    if issubclass(kind, dict):  # a `Packed` tree of buffers too
        return list(dst) == list(src) and all(_leaf_pairs(dst[k], src[k], out) for k in dst)
    if kind is tuple or kind is list or tr.is_namedtuple(dst):
        return len(dst) == len(src) and all(_leaf_pairs(a, b, out) for a, b in zip(dst, src))
    return dst is None or kind in (int, float, bool, str)


class Taken:
    """The storages a donated update may not adopt: those of the trees given (read on
    first use: an update that wrote its state in place never needs them) and those
    adopted already."""

    def __init__(self, *trees: Any) -> None:
        self.trees: tuple | None = trees
        self.ptrs: set[int] = set()

    def __contains__(self, ptr: int) -> bool:
        if self.trees is not None:
            self.ptrs |= _storages(*self.trees)
            self.trees = None
        return ptr in self.ptrs

    def add(self, ptr: int) -> None:
        self.ptrs.add(ptr)


# Smaller new state leaves (step counters) are copied: cheaper than the storage checks.
_ADOPT_MIN_BYTES = 1 << 16


def adopt_into(dst_tree: PyTree, src_tree: PyTree, what: str, taken: Taken) -> None:
    """Donation without copies: each `dst` leaf takes over the storage of its new value
    (`Tensor.set_`), so the tensor objects stay the same and nothing is copied.

    A new value is adopted only when it is a tensor of the same dtype, device, shape and
    strides whose storage nothing else uses: not a storage in `taken` (the grads, params,
    old state: a state that kept the caller's grad would otherwise alias it from then
    on), nor one adopted already. Anything else (and anything small) is copied, as
    `copy_into` does; a leaf that is its own new value (updated in place) is left alone.
    """
    pairs: list[tuple[Tensor, Tensor]] = []
    if not _leaf_pairs(dst_tree, src_tree, pairs):  # another kind of node, or a mismatch to report
        copy_into(dst_tree, src_tree, what)
        return
    copies = []
    for d, s in pairs:
        if d is s:
            continue
        if (
            type(d) is Tensor
            and type(s) is Tensor
            and s.storage_offset() == 0
            and s.dtype == d.dtype
            and s.nbytes >= _ADOPT_MIN_BYTES
        ):
            storage = s.untyped_storage()
            ptr = storage.data_ptr()
            # The whole of a storage no one else holds, laid out as `d` was.
            if (
                ptr not in taken
                and storage.nbytes() == s.nbytes
                and s.shape == d.shape
                and s.stride() == d.stride()
                and s.device == d.device
            ):
                taken.add(ptr)
                d.set_(s)  # type: ignore[call-overload]  # (torch's stubs list set_ by storage only)
                continue
        copies.append((d, s))
    if copies:
        copy_into([d for d, _ in copies], [s for _, s in copies], what)


def repoint_(user: Tensor, view: Tensor, what: str) -> None:
    """Copy `user`'s values into `view`, then make `user` a view of the same memory."""
    if user.shape != view.shape or user.dtype != view.dtype or user.device != view.device:
        raise ValueError(
            f"{what}: expected {tuple(view.shape)} {view.dtype} on {view.device}, got "
            f"{tuple(user.shape)} {user.dtype} on {user.device}"
        )
    if aliases(user, view):
        return
    with torch.no_grad():
        view.copy_(user)
        user.set_(view)  # type: ignore[call-overload]  # (torch's stubs list set_ by storage only)
        source = getattr(user, "_purestep_source", None)  # functional_model's detached alias of a Parameter
        if isinstance(source, Tensor) and source.shape == view.shape:
            source.set_(view)  # type: ignore[call-overload]


def aliases(a: Tensor, b: Tensor) -> bool:
    return a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.stride() == b.stride() and a.dtype == b.dtype


def bind_tree(user_tree: Any, packed_tree: Any, what: str) -> None:
    """Point every tensor of `user_tree` into the matching memory of `packed_tree`."""
    unpacked = pytree.tree_map(lambda x: x.unpack() if is_packed(x) else x, packed_tree, is_leaf=is_packed)
    mine, spec = tr.tree_flatten_with_path(unpacked)
    theirs, user_spec = tr.tree_flatten_with_path(user_tree)
    if spec != user_spec:
        raise ValueError(
            f"{what} is not structured like the optimizer's state for these params "
            f"(was it built by this optimizer's init?)"
        )
    for (path, view), (_, user) in zip(mine, theirs):
        if isinstance(view, Tensor):
            if not isinstance(user, Tensor):
                raise ValueError(f"{what} leaf '{path}' is {type(user).__name__}, expected a tensor")
            repoint_(user, view, f"{what} leaf '{path}'")


def write_back(dst: Any, src: Any) -> None:
    """Inside a compiled step: the new leaves of `src` into the buffers of `dst` (inductor
    turns these copies into stores of the fused kernel)."""
    pairs = [
        (d, n) for d, n in zip(pytree.tree_leaves(dst), pytree.tree_leaves(src)) if isinstance(d, Tensor) and d is not n
    ]
    # 0-d leaves (step counts, norms) by themselves: in one foreach copy with the buffers,
    # inductor (2.13) scheduled a count's store ahead of a later kernel that read the old count.
    for group in ([x for x in pairs if x[0].dim()], [x for x in pairs if not x[0].dim()]):
        if group:
            torch._foreach_copy_([d for d, _ in group], [n for _, n in group])


def move_storage(user: Tensor, view: Tensor, room: int) -> bool:
    """Move the memory behind `user`'s storage into the buffer at `view` (values copied
    first), so every tensor on that storage reads and writes the buffer from now on.
    False (nothing done) when the storage is not `user`'s alone from its start, needs more
    than `room` bytes from `view` on, or this torch cannot move storage (`compat.SWAPS_STORAGE`)."""
    storage = user.untyped_storage()
    if not compat.SWAPS_STORAGE or user.storage_offset() != 0 or storage.nbytes() > room or user.numel() == 0:
        return False
    with torch.no_grad():
        view.copy_(user)
    spare = torch._C._construct_storage_from_data_pointer(view.data_ptr(), view.device, storage.nbytes())
    compat.swap_storage(storage, spare)  # `spare` now owns the old memory and frees it when dropped
    return True
