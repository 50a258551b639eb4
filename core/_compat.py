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
    `placements` on a mesh of `mesh_shape`: DTensor's own arithmetic (its `_StridedShard` included).
    The placements FSDP2, HSDP and TP make are computed here in closed form (`_chunked_box`,
    tested equal to DTensor's): DTensor's own splits tensors, milliseconds a call, hours
    over every rank of thousands."""
    box = _chunked_box(tuple(shape), tuple(mesh_shape), coordinate, placements)
    if box is not None:
        return box
    from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset

    return _compute_local_shape_and_global_offset(shape, mesh_shape, coordinate, placements)


def chunk_range(size: int, parts: int, k: int) -> tuple[int, int]:
    """(start, count) of part `k` of `torch.chunk` of `size` into `parts` (ceil-sized, the last ones fewer or none)."""
    step = -(-size // parts)
    start = min(k * step, size)
    return start, min(step, size - start)


def _chunked_box(
    shape: tuple[int, ...], mesh_shape: tuple[int, ...], coordinate: list[int], placements: Any
) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """`local_box` where each tensor dim is split by `Shard`s alone (chunked in mesh-dim
    order), or by one `_StridedShard(d, split_factor=n)` before one `Shard(d)` over a mesh dim of
    n ranks (FSDP2's rows over TP's, optimizer state over HSDP's replicas: the `Shard` chunks
    first, the strided one each chunk); None for anything else."""
    from torch.distributed.tensor import Replicate, Shard

    by_dim: dict[int, list[tuple[int, Any]]] = {}
    for m, p in enumerate(placements):
        if isinstance(p, Replicate):
            continue
        # a strided shard has a split factor (a Shard subclass on some releases, not on others)
        if not (isinstance(p, Shard) or hasattr(p, "split_factor")):  # Partial, or a placement unknown here
            return None
        by_dim.setdefault(p.dim if p.dim >= 0 else p.dim + len(shape), []).append((m, p))
    size, offset = list(shape), [0] * len(shape)
    for d, splits in by_dim.items():
        kinds = [not hasattr(p, "split_factor") for _, p in splits]
        if all(kinds):
            order = splits
        elif kinds == [False, True] and splits[0][1].split_factor == mesh_shape[splits[1][0]]:
            order = [splits[1], splits[0]]
        else:
            return None
        for m, _ in order:
            start, count = chunk_range(size[d], mesh_shape[m], coordinate[m])
            offset[d] += start
            size[d] = count
        if not size[d]:
            offset[d] = shape[d]  # DTensor's offset of an empty block: the dim's end
    return tuple(size), tuple(offset)


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


def all_gather_single(output: Any, input: Any, group: Any) -> None:
    """`torch.distributed.all_gather_single` (2.13: `all_gather_into_tensor` is deprecated under that name)."""
    import torch.distributed as dist

    (getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor)(output, input, group=group)


def reduce_scatter_single(output: Any, input: Any, group: Any) -> None:
    """`torch.distributed.reduce_scatter_single` (2.13: `reduce_scatter_tensor` is deprecated under that name)."""
    import torch.distributed as dist

    (getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor)(output, input, group=group)
