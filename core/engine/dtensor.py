"""DTensor helpers, the one set core and api share: tell DTensors apart, take this rank's
block, gather whole tensors. Importing this never imports torch.distributed.tensor where
torch.distributed is missing."""

from __future__ import annotations

from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import Tensor

from . import cache


_DTENSOR: list = []  # DTensor's class, looked up once (None without torch.distributed)


def _dtensor_type() -> Any:
    if not _DTENSOR:
        if torch.distributed.is_available():
            from torch.distributed.tensor import DTensor

            _DTENSOR.append(DTensor)
        else:
            _DTENSOR.append(None)
    return _DTENSOR[0]


def is_dtensor(x: Any) -> bool:
    """Whether `x` is a `torch.distributed.tensor.DTensor` (False without torch.distributed)."""
    cls = _dtensor_type()
    return cls is not None and isinstance(x, cls)


def has_dtensors(tree: Any) -> bool:
    """Whether any leaf of `tree` is a DTensor."""
    cls = _dtensor_type()
    if cls is None:
        return False
    leaves = list(tree.values()) if type(tree) is dict else []  # a flat dict of tensors: no flatten
    if not leaves or not all(isinstance(x, Tensor) for x in leaves):
        leaves = pytree.tree_leaves(tree)
    return any(isinstance(x, cls) for x in leaves)


def local(x: Any) -> Any:
    """This rank's block of a DTensor (the tensor object FSDP2 keeps), else `x`."""
    return x._local_tensor if is_dtensor(x) else x


def local_tree(tree: Any) -> Any:
    """Every DTensor leaf of `tree` as this rank's block."""
    return pytree.tree_map(local, tree)


def full_tree(tree: Any) -> Any:
    """Every DTensor leaf gathered into a whole plain tensor (a collective: call on every rank)."""
    return pytree.tree_map(lambda t: _full(t) if is_dtensor(t) else t, tree)


def _full(t: Any) -> Tensor:
    """A DTensor's whole tensor on every rank; state at its owner (`at_owner`) is broadcast
    from that rank (the others hold none of it)."""
    if not at_owner(t):
        return t.full_tensor()
    owner = owner_rank(t)
    if owner == torch.distributed.get_rank():
        whole = t._local_tensor.clone(memory_format=torch.contiguous_format)
    else:
        whole = torch.empty(t.shape, dtype=t.dtype, device=mesh_device(t.device_mesh))
    torch.distributed.broadcast(whole, src=owner)
    return whole


def at_owner(x: Any) -> bool:
    """Whether `x` is state at its owner: a DTensor on one of the one-rank meshes `engine.owners`
    places a leaf's state on (`cache.owner_mesh`), held whole by that rank alone."""
    mesh = getattr(x, "device_mesh", None)
    return mesh is not None and cache.is_owner_mesh(mesh)


def owner_rank(x: Any) -> int:
    """The global rank holding `x` (`at_owner`)."""
    return int(x.device_mesh.mesh.flatten()[0])


def mesh_device(mesh: Any) -> torch.device:
    """The device this rank's tensors of `mesh`'s device type live on (a rank outside the mesh
    included: DTensor leaves its results there on the CPU)."""
    if mesh.device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(mesh.device_type)


def replicated_like(t: Tensor, x: Any) -> Any:
    """`t` (a plain tensor) as a replicated DTensor on `x`'s mesh when `x` is a DTensor, so that
    elementwise math between them runs; `t` itself otherwise."""
    if not is_dtensor(x):
        return t
    from torch.distributed.tensor import DTensor, Replicate

    # Every rank computed the same `t` (from values all-reduced before): no broadcast needed.
    return DTensor.from_local(t, x.device_mesh, [Replicate()] * x.device_mesh.ndim, run_check=False)
