"""What the installed torch can do, probed from torch itself, never read from a version string.

Every difference between the torch releases purestep supports (pyproject's floor to the
newest) lives here, each as a probe of the capability and a short note of where it changes.
The private torch APIs the engine leans on are reached through here too, so a release that
moves one breaks one function. `tools/torch_matrix.sh` runs the whole suite per release.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch._inductor.config as _inductor_config


def _vmap_bitcasts() -> bool:
    # `Tensor.view(dtype)` has a vmap batching rule from torch 2.12 on; before, none.
    try:
        torch.func.vmap(lambda t: t.view(torch.int32))(torch.zeros(1, 1))
    except RuntimeError:
        return False
    return True


VMAP_BITCASTS = _vmap_bitcasts()
"""Whether a float32 <-> int32 bit view (`x.view(torch.int32)`) runs under `torch.func.vmap`."""

SWAPS_STORAGE = hasattr(torch.UntypedStorage, "_swap_data_ptr_")
"""Whether a storage can take over another's memory (`UntypedStorage._swap_data_ptr_`, torch
2.12 on): the sharded path then moves FSDP2's shard storage into its flat buffers; without,
it copies the shards in and the results back every step."""

EMULATES_PRECISION_CASTS = hasattr(_inductor_config, "emulate_precision_casts")
"""Whether inductor has the option to keep a narrowing cast's rounding (purestep turns it on).
It does not tell whether the option works: before 2.12 inductor still fuses a
`.to(bf16).to(float32)` round trip after a matmul away, and no cheap probe shows it, so code
that must round in compiled code rounds with integer bit operations on every release
(`_low_precision.round_to_bf16`)."""


def under_vmap() -> bool:
    """Whether this runs under a torch.func transform (vmap, grad), eagerly or traced."""
    return torch._C._functorch.peek_interpreter_stack() is not None


def swap_storage(storage: Any, spare: Any) -> None:
    """`storage` takes over `spare`'s memory and `spare` takes its old one (needs `SWAPS_STORAGE`)."""
    storage._swap_data_ptr_(spare)


def root_mesh(mesh: Any) -> Any:
    """The device mesh `mesh` was sliced from (itself when it is a root)."""
    get = getattr(mesh, "_get_root_mesh", None)
    if get is not None:
        return get()
    from torch.distributed.device_mesh import _mesh_resources  # before `DeviceMesh._get_root_mesh`

    return _mesh_resources.get_root_mesh(mesh)


def flatten_mesh(mesh: Any, name: str) -> Any:
    """`mesh`'s dims flattened into one mesh named `name` (`DeviceMesh._flatten`, private on
    2.11 to 2.15; keep the mesh it returns: slicing it from the root is deprecated)."""
    return mesh._flatten(name)


def local_box(shape: Any, mesh_shape: Any, coordinate: list[int], placements: Any) -> tuple[Any, Any]:
    """(local shape, global offset) of the block at `coordinate` of a DTensor of `shape` placed by
    `placements` on a mesh of `mesh_shape`: DTensor's own arithmetic (its `_StridedShard` included)."""
    from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset

    return _compute_local_shape_and_global_offset(shape, mesh_shape, coordinate, placements)


@functools.cache
def dtensor_runs(op: Any) -> bool:
    """Whether DTensor has a sharding rule for aten `op` (2.11 has `_foreach_lerp_.Scalar` but not
    `_foreach_lerp.Scalar`): DTensor math picks another form where it has none."""
    try:
        from torch.distributed.tensor import DTensor

        propagator = DTensor._op_dispatcher.sharding_propagator
    except (ImportError, AttributeError):
        return False
    return op in propagator.op_strategy_funcs or op in getattr(propagator, "op_to_rules", {})
