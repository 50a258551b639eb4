"""Reading a checkpoint's tensors, whole or resharded, from the files its manifest seals and nothing else.

Both layouts describe their tensors as chunks: a region of a whole tensor (`fqn`, e.g.
`params.layers.0.weight`) stored under a key of one listed file. A plain checkpoint has
one chunk per tensor at offset 0; a DCP checkpoint one per shard, offsets from the shard
file's header. `torch.distributed.checkpoint.load` plans which rank reads which region,
whatever the world size that wrote them, and `_SealedReader` serves the regions from the
listed files only (DCP's own safetensors reader would read every `*.safetensors` file
it finds in the directory).
"""

from __future__ import annotations

import contextlib
import math
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

import safetensors
import torch
from torch import Tensor

from ..errors import CheckpointError
from ._format import reason, unwrap


class Chunk(NamedTuple):
    """A region of the whole tensor `fqn`, stored as `key` in the checkpoint file `file`."""

    fqn: str
    file: str
    key: str
    offsets: tuple[int, ...]
    shape: tuple[int, ...]
    dtype: torch.dtype


class Whole(NamedTuple):
    """A whole tensor of a checkpoint: its shape, dtype and the chunks that tile it."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    chunks: list[Chunk]


def assemble(root: Path, chunks: list[Chunk]) -> dict[str, Whole]:
    """The whole tensors the chunks make up, checked to tile them exactly (no gap, no overlap)."""
    by_fqn: dict[str, list[Chunk]] = {}
    for c in chunks:
        by_fqn.setdefault(c.fqn, []).append(c)
    out = {}
    for fqn, parts in by_fqn.items():
        first = parts[0]
        for c in parts:
            if c.dtype != first.dtype or len(c.shape) != len(first.shape) or len(c.offsets) != len(c.shape):
                raise CheckpointError(f"{root / c.file}: '{c.key}' does not fit the other pieces of '{fqn}'")
            if any(o < 0 for o in c.offsets):
                raise CheckpointError(f"{root / c.file}: '{c.key}' has a negative offset {list(c.offsets)}")
        shape = tuple(max(c.offsets[d] + c.shape[d] for c in parts) for d in range(len(first.shape)))
        covered = sum(math.prod(c.shape) for c in parts)
        overlap = _first_overlap(parts)
        if overlap is not None or covered != math.prod(shape):
            culprit = overlap[1] if overlap is not None else parts[-1]
            raise CheckpointError(
                f"{root / culprit.file}: the pieces of '{fqn}' do not tile its shape {list(shape)} "
                f"({'overlapping' if overlap is not None else f'{covered} of {math.prod(shape)} elements'})"
            )
        out[fqn] = Whole(shape, first.dtype, parts)
    return out


def _first_overlap(parts: list[Chunk]) -> tuple[Chunk, Chunk] | None:
    """Two pieces that overlap, found by a sweep along the dimension where the pieces' offsets
    differ most: sorted by it, each piece is compared with the earlier ones still open there
    only (one for row shards), so a load of N pieces costs N log N, not N² pairs."""
    live = [c for c in parts if math.prod(c.shape)]
    if len(live) < 2:
        return None
    if not live[0].shape:
        return live[0], live[1]
    d = max(range(len(live[0].shape)), key=lambda k: len({c.offsets[k] for c in live}))
    open_: list[Chunk] = []
    for c in sorted(live, key=lambda c: c.offsets[d]):
        open_ = [a for a in open_ if a.offsets[d] + a.shape[d] > c.offsets[d]]
        hit = next((a for a in open_ if _overlap(a, c)), None)
        if hit is not None:
            return hit, c
        open_.append(c)
    return None


def _overlap(a: Chunk, b: Chunk) -> bool:
    if not math.prod(a.shape) or not math.prod(b.shape):
        return False
    return all(oa < ob + nb and ob < oa + na for oa, na, ob, nb in zip(a.offsets, a.shape, b.offsets, b.shape))


@contextlib.contextmanager
def quiet_dcp() -> Iterator[None]:
    """torch.distributed.checkpoint without its warning that a single process has no process group."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def read_into(root: Path, wholes: dict[str, Whole], state: dict[str, Tensor], *, distributed: bool) -> None:
    """Fill `state` (fqn -> tensor or DTensor of the whole tensor's shape) from the checkpoint (a collective
    when `distributed`: every rank reads the regions of its own shards)."""
    import torch.distributed.checkpoint as dcp

    try:
        with quiet_dcp():
            dcp.load(state, storage_reader=_sealed_reader(root, wholes), no_dist=not distributed)
    except BaseException as e:  # DCP raises its failures as a BaseException; an interrupt inside it stays one
        if not isinstance(unwrap(e), Exception):
            raise unwrap(e) from None
        raise CheckpointError(f"{root}: does not load ({reason(e)})") from None


def _sealed_reader(root: Path, wholes: dict[str, Whole]) -> Any:
    from torch.distributed.checkpoint import StorageReader
    from torch.distributed.checkpoint.metadata import (
        ChunkStorageMetadata,
        Metadata,
        MetadataIndex,
        TensorProperties,
        TensorStorageMetadata,
    )

    class _SealedReader(StorageReader):
        """Serves the regions DCP plans from the chunks given (listed, verified files) and nothing else."""

        def reset(self, checkpoint_id: Any = None) -> None:
            pass

        def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
            tensors: dict[str, Any] = {
                fqn: TensorStorageMetadata(
                    properties=TensorProperties(dtype=w.dtype),
                    size=torch.Size(w.shape),
                    chunks=[ChunkStorageMetadata(torch.Size(c.offsets), torch.Size(c.shape)) for c in w.chunks],
                )
                for fqn, w in wholes.items()
            }
            where = {MetadataIndex(c.fqn, c.offsets): (c.file, c.key) for w in wholes.values() for c in w.chunks}
            return Metadata(state_dict_metadata=tensors, storage_data=where)

        def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
            self.where = metadata.storage_data

        def prepare_local_plan(self, plan: Any) -> Any:
            return plan

        def prepare_global_plan(self, plans: list[Any]) -> list[Any]:
            return plans

        def read_data(self, plan: Any, planner: Any) -> torch.futures.Future:
            by_file: dict[str, list[Any]] = {}
            for item in plan.items:
                by_file.setdefault(self.where[item.storage_index][0], []).append(item)
            for file, items in by_file.items():
                with safetensors.safe_open(str(root / file), framework="pt") as f:
                    for item in items:
                        key = self.where[item.storage_index][1]
                        region = tuple(slice(o, o + n) for o, n in zip(item.storage_offsets, item.lengths))
                        data = f.get_slice(key)[region] if region else f.get_tensor(key)
                        target = planner.resolve_tensor(item).detach()
                        if data.shape != target.shape:  # planned from our own metadata: never, unless a file lies
                            raise CheckpointError(
                                f"{root / file}: '{key}' is {list(data.shape)}, not {list(target.shape)}"
                            )
                        target.copy_(data)
                        planner.commit_tensor(item, target)
            done: torch.futures.Future = torch.futures.Future()
            done.set_result(None)
            return done

        @classmethod
        def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
            return False

    return _SealedReader()
