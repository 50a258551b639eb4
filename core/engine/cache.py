"""The engine's one cache: what it derives from a layout (owners, the process groups and
meshes it makes), keyed by the meshes' ranks, placements and shapes, per default process
group: a re-initialized world starts empty, and the ranks of torch's threaded process group
(one default group per thread) each keep their own.

Nothing else in the engine keeps state between calls of different step functions. A value
is made once per key by `get(kind, key, make)`; `owner_mesh(device_type, rank)` is the
one-rank mesh a leaf's owner-resident state lives on (`engine.owners`), made without a
process group (no collective, so each rank makes only the meshes it meets), and
`is_owner_mesh(mesh)` tells such a mesh apart.
"""

from __future__ import annotations

from typing import Any, Callable

# id(default group) -> (that group, its entries); a group gone and its id reused is told
# apart by identity
_WORLDS: dict[int, tuple[Any, dict[tuple, Any]]] = {}
_OWNER_MESHES: dict[int, Any] = {}  # id -> the one-rank meshes made here (identity: `is_owner_mesh`)


def _entries() -> dict[tuple, Any]:
    """The entries made under the current default process group."""
    import torch.distributed as dist

    group = dist.group.WORLD if dist.is_available() and dist.is_initialized() else None
    found = _WORLDS.get(id(group))
    if found is None or found[0] is not group:
        found = _WORLDS[id(group)] = (group, {})
    return found[1]


def get(kind: str, key: Any, make: Callable[[], Any]) -> Any:
    """The value of `kind` for `key`, made by `make()` the first time (per default group)."""
    entries = _entries()
    if (kind, key) not in entries:
        entries[(kind, key)] = make()
    return entries[(kind, key)]


def owner_mesh(device_type: str, rank: int) -> Any:
    """The `DeviceMesh` of `rank` alone: owner-resident state is a DTensor on it. No process
    group is made (`_init_backend=False`): nothing communicates over it (the owner holds the
    whole tensor; `dtensor.full_tree` broadcasts over the world)."""

    def make() -> Any:
        from torch.distributed.device_mesh import DeviceMesh

        mesh = DeviceMesh(device_type, [rank], _init_backend=False)
        _OWNER_MESHES[id(mesh)] = mesh
        return mesh

    return get("owner mesh", (device_type, rank), make)


def is_owner_mesh(mesh: Any) -> bool:
    """Whether `mesh` is one of `owner_mesh`'s."""
    return _OWNER_MESHES.get(id(mesh)) is mesh


def mesh_key(mesh: Any) -> tuple:
    """A mesh by its ranks: device type, shape, ranks (`fully_shard` per block makes equal
    mesh objects; a named slice and its root's flattening may be the same ranks)."""
    return (mesh.device_type, tuple(mesh.mesh.shape), tuple(mesh.mesh.flatten().tolist()))
