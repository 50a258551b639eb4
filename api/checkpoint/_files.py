"""The plain layout: one safetensors file per tree, written whole by rank 0.

    params.safetensors      name -> tensor
    opt_state.safetensors   optimizer state, flattened by key path (`0.mu.layers.0.weight`)
    ema.safetensors         the EMA tree, flattened by key path

Under FSDP2 the DTensor leaves are gathered first (a collective), so any world writes
and reads the same files.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from torch import Tensor

from .. import distributed as D
from ..errors import CheckpointError
from ._format import DTYPES, GROUPS, FileEntry, Manifest, read_header, read_tensors, write_tensors
from ._reader import Chunk


def worker_file(worker: int) -> str:
    """The file of a DiLoCo worker's own state (worker 0's is the group files)."""
    return f"worker-{worker:05d}.safetensors"


def write(
    tmp: Path,
    state: dict[str, Tensor],
    order: dict[str, list[str]],
    world: D.World,
    group: Any = None,
    worker: int | None = None,
) -> dict[str, FileEntry]:
    """Rank 0 writes one file per group into `tmp` (every rank calls: DTensors are gathered,
    over the default process group; `group` is unused, staged trees hold no DTensors); its files.
    `worker` (the index of the DiLoCo worker this rank leads, 1 or more): this rank writes
    that worker's whole state, every group in one file (`worker_file`), instead."""
    state = D.full_tree(state)
    if worker:
        return {worker_file(worker): write_tensors(tmp / worker_file(worker), _host(state))}
    if not world.main:
        return {}
    files = {}
    for group in GROUPS:
        if group in order:
            tensors = _host({path: state[f"{group}.{path}"] for path in order[group]})
            files[f"{group}.safetensors"] = write_tensors(tmp / f"{group}.safetensors", tensors)
    return files


def read_worker(root: Path, manifest: Manifest, worker: int, state: dict[str, Tensor]) -> None:
    """DiLoCo worker `worker`'s own state (its file, written by `write(..., worker=)`) into
    `state` (`group.path -> tensor`, plain tensors or DTensors, each taking its own block), in
    place. The checkpoint is one `load` verified (its manifest hashes the worker files)."""
    name = worker_file(worker)
    if name not in manifest.files:
        raise CheckpointError(f"{root}: holds no state of DiLoCo worker {worker} ({name})")
    saved = read_tensors(root / name)
    for fqn, dst in state.items():
        src = saved.get(fqn)
        if src is None or tuple(src.shape) != tuple(dst.shape) or src.dtype != dst.dtype:
            got = "nothing" if src is None else f"{list(src.shape)} {src.dtype}"
            raise CheckpointError(f"{root / name}: '{fqn}' is {got}, but {list(dst.shape)} {dst.dtype} here")
        D.copy_whole_into_(dst, src)
    extra = sorted(set(saved) - set(state))
    if extra:
        raise CheckpointError(f"{root / name}: holds '{extra[0]}', which this run lacks ({len(extra)} extra)")


def _host(tensors: dict[str, Tensor]) -> dict[str, Tensor]:
    """CPU, contiguous, and no two sharing memory (safetensors refuses tied weights): each gets its own."""
    out, seen = {}, set()
    for path, t in tensors.items():
        t = t.detach().to("cpu").contiguous()
        if t.numel() and t.untyped_storage().data_ptr() in seen:
            t = t.clone()
        seen.add(t.untyped_storage().data_ptr())
        out[path] = t
    return out


def chunks(root: Path, manifest: Manifest) -> list[Chunk]:
    """One chunk per tensor, at offset 0, from the listed group files."""
    out = []
    for name in manifest.files:
        group = name.removesuffix(".safetensors")
        if group in GROUPS:
            rows, _ = read_header(root / name)
            out += [
                Chunk(f"{group}.{key}", name, key, (0,) * len(shape), shape, DTYPES[code]) for key, shape, code in rows
            ]
    return out
