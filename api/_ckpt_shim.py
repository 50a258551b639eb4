"""Today's checkpoint functions behind the `CheckpointManager` interface (until it lands in checkpoint.py)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch

from . import checkpoint as ckpt
from . import distributed as D


class CheckpointManager:
    def __init__(self, run_dir: Any, *, keep_last: int = 3, world: Any = None, distributed: bool = False) -> None:
        self.run_dir, self.keep_last, self.world, self.distributed = Path(run_dir), keep_last, world, distributed

    def save(self, step: int, *, params: Any, opt_state: Any = None, ema: Any = None, config: Any = None,
             data_state: Any = None, metadata: Any = None) -> Path | None:
        path = None
        if self.world.main or self.distributed:
            path = ckpt.save_checkpoint(
                ckpt.checkpoint_dir(self.run_dir, step), params=params, opt_state=opt_state, ema=ema, step=step,
                config=config, data_state=data_state, metadata=metadata, keep_last=self.keep_last,
                distributed=self.distributed,
            )
        D.barrier(self.world)
        return path if self.world.main else None

    def latest(self) -> Path | None:
        return ckpt.latest_checkpoint(self.run_dir)

    def load(self, path: Path, *, params_like: Any, opt_state_like: Any = None, ema_like: Any = None) -> Any:
        if self.distributed and ckpt.read_manifest(path).layout == "dcp":
            return ckpt.load_distributed(path, params=params_like, opt_state=opt_state_like, ema=ema_like)
        c = ckpt.load_checkpoint(path, opt_state_like=opt_state_like, ema_like=ema_like)
        for k, v in params_like.items():
            if k not in c.params or c.params[k].shape != v.shape:
                raise ckpt.CheckpointError(f"{path}: params tensor '{k}' missing or of another shape")
        reshard = lambda full, like: torch.utils._pytree.tree_map(D.shard_like, full, like)  # noqa: E731
        return c._replace(params=reshard({k: c.params[k] for k in params_like}, params_like),
                          opt_state=reshard(c.opt_state, opt_state_like) if opt_state_like is not None else None,
                          ema=reshard(c.ema, ema_like) if ema_like is not None else None)

    def restore(self, *, params_like: Any, opt_state_like: Any = None, ema_like: Any = None) -> Any:
        folder = self.run_dir / "checkpoints"
        found = sorted(p for p in folder.iterdir() if (p / ckpt.MANIFEST).is_file()) if folder.is_dir() else []
        for path in reversed(found):
            try:
                return self.load(path, params_like=params_like, opt_state_like=opt_state_like, ema_like=ema_like)
            except ckpt.CheckpointError as e:
                print(f"purestep: warning: skipping checkpoint {path.name}: {e}", file=sys.stderr, flush=True)
        return None
