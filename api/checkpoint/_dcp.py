"""The sharded layout for FSDP2: `torch.distributed.checkpoint` with its safetensors storage.

Every rank writes its own shards (`HuggingFaceStorageWriter(save_distributed=True)`):
`shard-<rank+1>-model-<group>-of-00003.safetensors`, groups 1/2/3 = params, opt_state,
ema, keys `params.<name>`, `opt_state.<path>`, `ema.<path>`, each shard's offset in the
whole tensor in the file's `DCP_SHARDING_INFO` header. Replicated (non-DTensor) leaves
are written once, by one rank. DCP's own consolidation (`enable_consolidation=True`) is
not used: in torch 2.13 it calls `torch.finfo` on every dtype and fails on int64 counters.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from torch import Tensor

from .. import distributed as D
from ..errors import CheckpointError
from ._format import DTYPES, GROUPS, FileEntry, Manifest, hash_and_fsync, read_header
from ._reader import Chunk, quiet_dcp

_SHARDING = "DCP_SHARDING_INFO"  # the header entry where DCP's safetensors writer keeps each shard's offsets


def write(
    tmp: Path, state: dict[str, Tensor], order: dict[str, list[str]], world: D.World, group: Any = None
) -> dict[str, FileEntry]:
    """Every rank writes its shards into `tmp` (a collective over `group`, the default process
    group if None); the files this rank wrote, hashed and fsynced."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageWriter

    mapping = {fqn: GROUPS.index(fqn.split(".", 1)[0]) + 1 for fqn in state}
    writer = HuggingFaceStorageWriter(str(tmp), fqn_to_index_mapping=mapping, save_distributed=True)
    with quiet_dcp():
        dcp.save(state, storage_writer=writer, process_group=group, no_dist=world.size == 1)
    # DCP numbers a rank's files rank + 1.
    return {f.name: hash_and_fsync(f) for f in sorted(tmp.glob(f"shard-{world.rank + 1:05d}-*.safetensors"))}


def chunks(root: Path, manifest: Manifest) -> list[Chunk]:
    """One chunk per shard of every listed shard file, placed by the file's sharding header."""
    out = []
    for name in manifest.files:
        if not name.startswith("shard-"):
            continue
        rows, meta = read_header(root / name)
        try:
            info = json.loads(meta.get(_SHARDING, "{}"))
            offsets = {
                key: tuple(int(o) for o in info[key]["saved_offsets"]) if key in info else (0,) * len(shape)
                for key, shape, _ in rows
            }
        except (ValueError, TypeError, KeyError) as e:
            raise CheckpointError(f"{root / name}: unreadable {_SHARDING} header ({type(e).__name__}: {e})") from None
        out += [Chunk(key, name, key, offsets[key], shape, DTYPES[code]) for key, shape, code in rows]
    return out
