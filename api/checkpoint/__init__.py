"""Checkpoints: a directory of safetensors files plus a sealed msgspec manifest, published atomically.

    manifest.json           step, config, data position, versions, layout, sha256 + size of every
                            file, and a sha256 of the manifest itself
    rng.safetensors         RNG states as uint8 tensors (torch CPU, each CUDA device)
    + the layout's files:   "files" (`_files`): params / opt_state / ema .safetensors, whole
                            "dcp" (`_dcp`): torch.distributed.checkpoint shards, one set per rank

Either layout loads whole in one process (`load_checkpoint`) and into trees sharded for
any world size (`load_distributed`, `CheckpointManager.load`). Only the files the
manifest lists and seals are read, never through a symlink or outside the directory;
every file's size and sha256 are checked before any is loaded. A save builds the
directory under a hidden temporary name and publishes it with one rename
(`_dirs`): a crash at any point leaves the earlier checkpoints loadable, and the
next save removes what it left. No pickle is used anywhere.

`CheckpointManager` is the policy a training loop needs on top: a run's checkpoints
by step, `keep_last` without ever needing room for one more, the newest checkpoint
that loads for a resume or a rewind, and cleanup after crashes.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any, Callable

import torch

from . import _dirs as dirs
from . import _files
from . import _io as store

from .. import distributed as D
from ..errors import CheckpointError as CheckpointError
from ..errors import check_int
from ..errors import RunDirError
from ._lock import RunLock
from ._format import MANIFEST as MANIFEST
from ._format import FileEntry as FileEntry
from ._format import Manifest as Manifest
from ._format import read_header as read_header  # with verify_file: how `purestep inspect` reads files
from ._format import read_manifest as read_manifest
from ._format import verify_file as verify_file
from ._io import Checkpoint as Checkpoint
from ._io import verify_checkpoint as verify_checkpoint

__all__ = [
    "Checkpoint",
    "CheckpointError",
    "CheckpointManager",
    "Manifest",
    "checkpoint_dir",
    "latest_checkpoint",
    "load_checkpoint",
    "load_distributed",
    "read_manifest",
    "save_checkpoint",
    "verify_checkpoint",
]


def read_worker(root: Path, manifest: Manifest, worker: int, trees: tuple[Any, Any, Any]) -> None:
    """DiLoCo worker `worker`'s own state, from its file in the checkpoint at `root`
    (`CheckpointManager(worker=)` wrote it), into `trees` (params, opt_state, ema), in place."""
    _files.read_worker(root, manifest, worker, store.flat_state(trees)[0])


def checkpoint_dir(run_dir: str | os.PathLike, step: int) -> Path:
    """The conventional directory of the checkpoint at `step`: `run_dir/checkpoints/step_00001000`."""
    return Path(run_dir) / "checkpoints" / f"step_{step:08d}"


# --------------------------------------------------------------------------- #
# Saving.
# --------------------------------------------------------------------------- #


def save_checkpoint(
    path: str | os.PathLike,
    *,
    params: Any,
    opt_state: Any = None,
    ema: Any = None,
    step: int,
    metadata: dict[str, Any] | None = None,
    config: Any = None,
    data_state: Any = None,
    rng: bool = True,
    keep_last: int | None = None,
    distributed: bool = False,
) -> Path:
    """Write a checkpoint directory at `path` atomically and return its path.

    Args:
      path: the checkpoint directory, e.g. `run/checkpoints/step_00001000`
        (`checkpoint_dir(run_dir, step)` gives that name). An existing one is replaced,
        and stays loadable until the new one is in place.
      params: a tree of tensors, usually `dict(model.state_dict())` or `dict(name -> param)`.
      opt_state: the optimizer state tree (`opt.init(params)` and its successors).
      ema: averaged params, any tree of tensors.
      step: the number of optimizer steps taken.
      metadata: msgspec-encodable extras kept in the manifest.
      config: the run's config (a msgspec Struct or plain data), kept in the manifest.
      data_state: the data position (plain data), kept in the manifest.
      rng: save the torch CPU/CUDA and Python `random` states (`Checkpoint.restore_rng`).
      keep_last: keep at most `keep_last` checkpoints beside it, the new one included,
        deleting the oldest before writing (so a nearly full disk needs no room for one
        more), but never the newest one that verifies while the new one is unfinished.
      distributed: write through `torch.distributed.checkpoint` (the "dcp" layout): a
        collective that every rank of the default process group calls with its own
        (DTensor-sharded) trees. Without a process group it writes this process's tensors.

    Raises:
      CheckpointError: the directory cannot be written (disk full, read-only), in one
        line naming it; earlier checkpoints are untouched.

    Examples:
        >>> import tempfile, torch
        >>> from purestep.api import save_checkpoint, load_checkpoint
        >>> d = tempfile.mkdtemp()
        >>> p = save_checkpoint(f"{d}/step_1", params={"w": torch.ones(2)}, step=1)
        >>> load_checkpoint(p).params["w"]
        tensor([1., 1.])
    """
    world = D.current_world() if distributed else store.ONE
    return store.save(  # type: ignore[return-value]  # not in the background: the path
        Path(path),
        (params, opt_state, ema),
        step=step,
        world=world,
        layout="dcp" if distributed else "files",
        extras=(config, metadata, data_state),
        rng=rng,
        keep_last=keep_last,
        is_good=store.verifies,
    )


# --------------------------------------------------------------------------- #
# Loading.
# --------------------------------------------------------------------------- #


def load_checkpoint(
    path: str | os.PathLike,
    *,
    opt_state_like: Any = None,
    ema_like: Any = None,
    device: str | torch.device | None = None,
) -> Checkpoint:
    """Load the checkpoint directory `path` whole, in this process (either layout; no process group used).

    Every file's size and sha256 are checked against the manifest first, so a missing,
    truncated or corrupted file raises `CheckpointError` naming it.

    Args:
      opt_state_like: a state tree of the structure to rebuild (e.g. `opt.init(params)`);
        its leaves give the device. A state that does not match raises naming the path and
        both shapes. None gives the flat `dict(path -> tensor)`.
      ema_like: the same for the EMA tree.
      device: where to put params (and flat trees); default CPU.
    """
    dev = torch.device("cpu" if device is None else device)
    return store.load(
        Path(path),
        (None, opt_state_like, ema_like),
        ("params", "opt_state_like", "ema_like"),
        store.ONE,
        flat=True,
        device=dev,
    )


def load_distributed(
    path: str | os.PathLike, *, params: Any, opt_state: Any = None, ema: Any = None, verify: bool = True
) -> Checkpoint:
    """Load a checkpoint of either layout into trees laid out like `params` / `opt_state` / `ema` (a collective).

    The trees' leaves may be DTensors sharded for any world size (FSDP2) or plain tensors:
    each rank reads its own regions of the saved tensors, whatever world size wrote them.
    The given trees are not written to; `.params`, `.opt_state`, `.ema` are new trees of
    their shape. With `verify`, rank 0 checks every file's sha256 first. A tensor whose
    shape or dtype differs raises `CheckpointError` naming it and both shapes.
    """
    world = D.current_world()
    return store.load(Path(path), (params, opt_state, ema), ("params", "opt_state", "ema"), world, verify=verify)


# --------------------------------------------------------------------------- #
# Finding checkpoints, and the policy over a run's checkpoints.
# --------------------------------------------------------------------------- #


def _sealed(folder: Path) -> Path | None:
    """The newest checkpoint in `folder` whose manifest reads and is sealed (files not checked)."""
    for path in dirs.candidates(folder):
        try:
            read_manifest(path)
            return path
        except CheckpointError:
            continue
    return None


def latest_checkpoint(run_dir: str | os.PathLike) -> Path | None:
    """The newest complete checkpoint in `run_dir/checkpoints` or in `run_dir` itself, or None.

    Half-written saves are never returned, nor a checkpoint whose manifest is damaged; a
    checkpoint whose files were damaged later is, and fails loudly when loaded
    (`CheckpointManager.restore` falls back past it).
    """
    found = [p for p in (_sealed(Path(run_dir) / "checkpoints"), _sealed(Path(run_dir))) if p is not None]
    return max(found, key=lambda p: (dirs.step_of(p), p.name), default=None)


class CheckpointManager:
    """The checkpoints of one run: `run_dir/checkpoints/step_<step>`, at most `keep_last` of them.

    Args:
      run_dir: the run directory.
      keep_last: how many checkpoints to keep. The oldest are deleted before a save, so
        a disk with room for `keep_last` checkpoints suffices, except that the newest one
        that verifies is never deleted before its successor is complete.
      world: the `distributed.World` of this process (default: the default process group's).
        In a world of more than one rank, `save`, `load` and `restore` are collectives:
        every rank calls them.
      distributed: save in the sharded "dcp" layout (FSDP2: every rank writes its shards);
        otherwise rank 0 writes plain files (DTensor leaves gathered first). Loading reads
        either layout into any world.
      worker: the index of the DiLoCo worker this rank leads (1 or more; files layout):
        `save` writes this rank's trees as that worker's own file in the checkpoint
        (`read_worker` reads them back); worker 0's are the checkpoint's trees.
      background: `save` returns once the state is copied to host memory (and, in the
        files layout, its DTensors gathered); a thread per rank writes the files, seals and
        publishes the checkpoint, its collectives on a process group of its own, as
        torchtitan's `async_mode`. The next `save`, `wait`, `restore`, `cleanup` and
        `release` wait for it first, and raise its `CheckpointError` if it failed; until it
        is published, `latest` is the one before. A process killed during the write leaves
        the last good checkpoint as it was and nothing of the new one taken for good.

    Examples:
        >>> import tempfile, torch
        >>> from purestep.api.checkpoint import CheckpointManager
        >>> run = CheckpointManager(tempfile.mkdtemp(), keep_last=2)
        >>> for step in (10, 20, 30):
        ...     _ = run.save(step, params={"w": torch.full((2,), float(step))})
        >>> run.latest().name
        'step_00000030'
        >>> run.restore(params_like={"w": torch.zeros(2)}).params["w"]
        tensor([30., 30.])
    """

    def __init__(
        self,
        run_dir: str | os.PathLike,
        *,
        keep_last: int = 3,
        world: D.World | None = None,
        distributed: bool = False,
        background: bool = False,
        worker: int | None = None,
    ) -> None:
        check_int("keep_last", keep_last, 1)
        self.worker = worker
        self.run_dir, self.folder = Path(run_dir), Path(run_dir) / "checkpoints"
        self.keep_last, self.distributed, self.background = keep_last, distributed, bool(background)
        self._pending: store.Pending | None = None
        self._staging: dict = {}  # background saves: the host copy of the state, made once
        self.world = world if world is not None else D.current_world()
        self._good: dict[Path, str] = {}  # checkpoints known to verify: path -> manifest checksum
        self._lock, self._holding = RunLock(self.run_dir), False

    def hold(self) -> None:
        """Hold the run directory for this run (collective; rank 0 takes the lock).

        `save` and `cleanup` do it first; a `Trainer` does it before it reads or writes
        anything. Raises `RunDirError` on every rank, naming the holder (pid, host, since
        when), while another process holds it; held until `release` or this process ends.
        """
        if self._holding:  # on every rank alike: the broadcast below is a collective
            return
        error = None
        if self.world.main:
            try:
                self._lock.acquire()
            except RunDirError as e:
                error = str(e)
        error = D.broadcast_object(error, self.world)
        if error is not None:
            raise RunDirError(error)
        self._holding = True

    def release(self) -> None:
        """Let go of the run directory (another run may then write to it), once a save in the
        background is done (its error, if any, is raised after)."""
        try:
            self.wait()
        finally:
            self._lock.release()
            self._holding = False

    def wait(self) -> Path | None:
        """Wait for the save writing in the background, if any (every rank calls): its path on
        rank 0 (None elsewhere, or when none was pending); `CheckpointError` if it failed."""
        pending = self._pending
        if pending is None:
            return None
        try:
            path = pending.wait()
        finally:  # interrupted (Ctrl-C) while the write runs: still pending, waited for next time
            if pending.done:
                self._pending = None
        if self.world.main:
            self._good[path] = read_manifest(path).checksum  # hashed as it was written
            self._good = {p: c for p, c in self._good.items() if p.is_dir()}
            return path
        return None

    def save(
        self,
        step: int,
        *,
        params: Any,
        opt_state: Any = None,
        ema: Any = None,
        config: Any = None,
        data_state: Any = None,
        metadata: dict[str, Any] | None = None,
    ) -> Path | None:
        """Write the checkpoint of `step` (every rank calls); its path on rank 0, None elsewhere.

        Crashed saves' leftovers are removed first. Raises `CheckpointError` (one line
        naming the path) on every rank when the checkpoint cannot be written, and
        `RunDirError` when another process holds the run directory (see `hold`). With
        `background`, it returns once the state is copied, the path where the checkpoint
        will be once written (see the class); a failure is raised by the next call that waits.
        """
        self.hold()
        self.wait()
        path = store.save(
            checkpoint_dir(self.run_dir, step),
            (params, opt_state, ema),
            step=step,
            world=self.world,
            layout="dcp" if self.distributed else "files",
            extras=(config, metadata, data_state),
            rng=True,
            keep_last=self.keep_last,
            is_good=self._is_good,
            background=self.background,
            staging=self._staging,
            worker=self.worker,
        )
        if isinstance(path, store.Pending):
            self._pending = path
            return path.path if self.world.main else None
        if self.world.main:
            self._good[path] = read_manifest(path).checksum  # hashed as it was written
            self._good = {p: c for p, c in self._good.items() if p.is_dir()}  # pruned ones go: bounded by keep_last
            return path
        return None

    def latest(self) -> Path | None:
        """The newest complete, sealed checkpoint of the run (its files are not read)."""
        return _sealed(self.folder)

    def has_candidates(self) -> bool:
        """Whether the run holds any checkpoint directory, loadable or not."""
        return bool(dirs.candidates(self.folder))

    def load(
        self, path: str | os.PathLike, *, params_like: Any, opt_state_like: Any = None, ema_like: Any = None
    ) -> Checkpoint:
        """Load `path` into trees laid out like the `*_like` trees (plain tensors or DTensors of any world size).

        Every file is verified first. A tensor missing, extra, or of another shape or dtype
        raises `CheckpointError` naming it and both shapes: nothing is ever broadcast. A save
        writing in the background is waited for first.
        """
        self.wait()
        root = Path(path)
        c = store.load(
            root, (params_like, opt_state_like, ema_like), ("params_like", "opt_state_like", "ema_like"), self.world
        )
        self._good[root] = c.manifest.checksum
        return c

    def restore(
        self,
        *,
        params_like: Any,
        opt_state_like: Any = None,
        ema_like: Any = None,
        check: Callable[[Path, Manifest], None] | None = None,
    ) -> Checkpoint | None:
        """The newest checkpoint that loads, for a resume or a rewind; None when none does.

        A checkpoint that does not load is reported in one line on stderr, naming it and
        why, and the next older one is tried. `check(path, manifest)` may refuse one more
        (raising `CheckpointError`) before anything is loaded: the caller's own metadata.
        """
        self.wait()
        paths = D.broadcast_object(dirs.candidates(self.folder), self.world)
        for path in paths:
            try:
                if check is not None:
                    check(path, read_manifest(path))
                return self.load(path, params_like=params_like, opt_state_like=opt_state_like, ema_like=ema_like)
            except CheckpointError as e:
                if self.world.main:
                    print(f"purestep: warning: skipping checkpoint {path.name}: {e}", file=sys.stderr, flush=True)
        return None

    def cleanup(self) -> None:
        """Remove the temporaries crashed saves left (every `save` does this first); rank 0 works, all wait.

        Holds the run directory first, so a live writer's temporaries are never touched.
        """
        self.hold()
        self.wait()
        if self.world.main:
            dirs.cleanup(self.folder)
        D.barrier(self.world)

    def _is_good(self, path: Path) -> bool:
        try:
            checksum = read_manifest(path).checksum
        except CheckpointError:
            return False
        if self._good.get(path) != checksum:
            if not store.verifies(path):
                return False
            self._good[path] = checksum
        return True
