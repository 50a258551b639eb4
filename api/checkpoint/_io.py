"""The one save and the one load behind every public checkpoint function, over either layout.

A save: rank 0 removes crashed saves' leftovers, makes room for `keep_last`, and creates
a temporary directory; the layout writes into it (rank 0 alone, or every rank's shards);
rank 0 adds the RNG states and the sealed manifest and publishes the directory with one
rename. Every rank learns the outcome, so all raise or none does. In the background
(`background=True`), the call returns once the state is copied to host memory (the files
layout gathers its DTensors first), and a thread per rank writes, seals and publishes,
its collectives on a process group of their own (`distributed.side_group`); a process
killed meanwhile leaves the temporary directory unpublished, which the next save removes.

A load: rank 0 verifies every file; every rank checks the trees it loads into against
the checkpoint's tensors, leaf for leaf (name, shape, dtype: never a broadcast), and
torch.distributed.checkpoint reads each rank's regions from the sealed files.
"""

from __future__ import annotations

import os
import platform
import random
import threading
import time
from importlib import metadata as _metadata
from pathlib import Path
from typing import Any, Callable, NamedTuple

import msgspec
import safetensors
import torch
from torch import Tensor

import purestep.core as ps

from . import _dirs as dirs
from . import _dcp, _files

from .. import distributed as D
from ..errors import CheckpointError, check_int
from ._format import DTYPES, GROUPS, MANIFEST, Manifest, encode_manifest, fsync_dir, read_manifest
from ._format import read_tensors, reason, unwrap, verify_file, write_bytes, write_tensors
from ._reader import Whole, assemble, read_into

_LAYOUT = {"files": _files, "dcp": _dcp}
ONE = D.World(0, 1, 0, torch.device("cpu"), "single")  # this process alone, whatever process group exists


class Checkpoint(NamedTuple):
    """A loaded checkpoint.

    `params` and (without a `*_like` tree) `opt_state` and `ema` are flat
    `dict(path -> tensor)`; with a `*_like` tree they are trees of that shape, laid out
    like its leaves (device, DTensor sharding).
    """

    params: Any
    opt_state: Any
    ema: Any
    step: int
    manifest: Manifest
    rng: dict[str, Tensor]

    def restore_rng(self) -> None:
        """Set the torch CPU, CUDA and Python `random` generators to their saved states."""
        if "torch.cpu" in self.rng:
            torch.set_rng_state(self.rng["torch.cpu"])
        if torch.cuda.is_available():
            for key, state in self.rng.items():
                if key.startswith("torch.cuda.") and int(key.rsplit(".", 1)[1]) < torch.cuda.device_count():
                    torch.cuda.set_rng_state(state, int(key.rsplit(".", 1)[1]))
        if self.manifest.python_rng is not None:
            random.setstate(_python_state(self.manifest.python_rng))


def verify_checkpoint(path: str | os.PathLike) -> Manifest:
    """The manifest of `path` after checking every file's size and sha256 (CheckpointError naming a bad file)."""
    root = Path(path)
    manifest = read_manifest(root)
    for filename, entry in manifest.files.items():
        verify_file(root / filename, entry)
    return manifest


def save(
    final: Path,
    trees: tuple[Any, Any, Any],
    *,
    step: int,
    world: D.World,
    layout: str,
    extras: tuple,
    rng: bool,
    keep_last: int | None,
    is_good: Callable[[Path], bool],
    background: bool = False,
    staging: dict | None = None,
    worker: int | None = None,
) -> Path | "Pending":
    """The one save: rank 0 prepares a temporary directory, the layout writes into it, rank 0
    seals and publishes. `background`: a `Pending` save, returned once the state is copied
    (into `staging`'s host buffers, kept there for the next save of the same trees).
    `worker`: on the rank that leads DiLoCo worker `worker` (1 or more), the files layout
    writes this rank's trees as that worker's own file (`_files.worker_file`)."""
    check_int("step", step)
    if keep_last is not None:
        check_int("keep_last", keep_last, 1)
    state, order, complex_keys = flat_state(trees)
    try:
        config, metadata, data_state = (msgspec.to_builtins(x) for x in (extras[0], extras[1] or {}, extras[2]))
    except TypeError as e:
        raise ValueError(f"config, metadata and data_state must be msgspec-encodable plain data: {e}") from None
    tmp, problem = None, None
    if world.main:
        try:
            final.parent.mkdir(parents=True, exist_ok=True)
            dirs.cleanup(final.parent)
            if keep_last is not None:  # make room first: at most keep_last checkpoints, the new one included
                _prune(final, keep_last - 1, is_good)
            tmp = dirs.temporary(final)
            tmp.mkdir()
        except Exception as e:  # noqa: BLE001 - every rank raises it below
            problem = f"{final}: cannot write the checkpoint: {reason(e)}"
    tmp, problem = D.broadcast_object((tmp, problem), world)
    if problem is not None:
        raise CheckpointError(problem)
    generators = (_rng_tensors(), _python_rng()) if rng else None  # as they are now, whenever the write runs
    manifest = Manifest(
        step=step,
        files={},
        versions=_versions(),
        created_unix=time.time(),
        config=config,
        data_state=data_state,
        metadata=metadata,
        python_rng=generators[1] if generators else None,
        layout=layout,
        world_size=world.size,
        order=order,
        complex=complex_keys,
    )
    if worker and layout != "files":
        raise ValueError("a DiLoCo worker's own state is written in the files layout")
    job = _Write(final, tmp, layout, manifest, generators, keep_last, world, worker or None)
    if not background:
        job.run(state, None, background=False)
        if job.outcome is not None:
            raise CheckpointError(job.outcome)
        return final
    staged = _stage(layout, state, world, staging if staging is not None else {}, keep=bool(worker))
    group = D.side_group(world)  # made here, by every rank together, before any thread uses it
    thread = threading.Thread(target=job.run, args=(staged, group, True), name=f"purestep-save-{step}", daemon=True)
    thread.start()
    return Pending(final, job, thread)


class Pending:
    """A checkpoint being written in the background (`save(..., background=True)`)."""

    def __init__(self, final: Path, job: "_Write", thread: threading.Thread) -> None:
        self.path, self._job, self._thread = final, job, thread

    @property
    def done(self) -> bool:
        # The job's own flag: a join interrupted by Ctrl-C can leave `is_alive()` False early.
        return self._job.finished.is_set()

    def wait(self) -> Path:
        """Its path once sealed and published; `CheckpointError` (on every rank) if it failed."""
        self._job.finished.wait()
        self._thread.join()
        if self._job.outcome is not None:
            raise CheckpointError(self._job.outcome)
        return self.path


class _Write:
    """The layout's write into the temporary directory, then rank 0 seals and publishes;
    `outcome` is None or the error every rank raises."""

    def __init__(self, final, tmp, layout, manifest, generators, keep_last, world, worker=None) -> None:
        self.final, self.tmp, self.layout, self.manifest = final, tmp, layout, manifest
        self.generators, self.keep_last, self.world, self.worker = generators, keep_last, world, worker
        self.outcome: str | None = None
        self.finished = threading.Event()

    def run(self, state: dict[str, Tensor], group: Any, background: bool) -> None:
        try:
            self._run(state, group, background)
        finally:
            self.finished.set()

    def _run(self, state: dict[str, Tensor], group: Any, background: bool) -> None:
        final, tmp, world = self.final, self.tmp, self.world
        try:
            try:
                own = {"worker": self.worker} if self.worker else {}  # a DiLoCo worker's own file
                mine, error = _LAYOUT[self.layout].write(tmp, state, self.manifest.order, world, group, **own), None
            except BaseException as e:  # DCP raises its failures as a BaseException; an interrupt inside it stays one
                if not isinstance(unwrap(e), Exception):
                    raise unwrap(e) from None
                mine, error = (
                    {},
                    reason(e) if world.size == 1 else f"rank {world.rank}: {reason(e)}",
                )  # rank 0 reports it
            written = D.gather_object((mine, error), world, group)
            outcome = None
            if world.main:
                try:
                    errors = [err for _, err in written if err]
                    if errors:
                        raise CheckpointError(f"{final}: cannot write the checkpoint: {errors[0]}")
                    files = {name: entry for rank_files, _ in written for name, entry in rank_files.items()}
                    if self.generators is not None:
                        files["rng.safetensors"] = write_tensors(tmp / "rng.safetensors", self.generators[0])
                    manifest = msgspec.structs.replace(self.manifest, files=dict(sorted(files.items())))
                    write_bytes(tmp / MANIFEST, encode_manifest(manifest))
                    fsync_dir(tmp)
                    dirs.publish(tmp, final)
                    if self.keep_last is not None:
                        _prune(final, self.keep_last - 1, None)
                except BaseException as e:
                    dirs.discard(tmp)
                    if not isinstance(e, Exception):
                        raise
                    outcome = (
                        str(e)
                        if isinstance(e, CheckpointError)
                        else f"{final}: cannot write the checkpoint: {reason(e)}"
                    )
            self.outcome = D.broadcast_object(outcome, world, group)
        except BaseException as e:  # in a thread nobody else would see it: the waiter raises it
            if not background:
                raise
            self.outcome = f"{final}: cannot write the checkpoint: {reason(e)}"


def _stage(layout: str, state: dict[str, Tensor], world: D.World, cache: dict, keep: bool = False) -> dict[str, Tensor]:
    """What a background write reads: a copy in host memory of this rank's part (the files
    layout: the gathered tensors, on rank 0, and on a rank that writes its DiLoCo worker's
    file (`keep`); DTensors keep their placements, their local blocks copied), taken now, so
    that training may go on changing the originals. The host buffers are made once per
    layout of the trees and kept in `cache` (pinned when the state is on CUDA): a later save
    only copies, at memory speed."""
    from torch.distributed._state_dict_utils import _copy_state_dict, _create_cpu_state_dict

    if layout == "files":
        state = D.full_tree(state)  # a collective over the default group, here on the loop's thread
        if not world.main and not keep:
            return {}
    key = (
        layout,
        tuple((k, type(t), t.shape, t.dtype, t.device, tuple(getattr(t, "placements", ()))) for k, t in state.items()),
    )
    if cache.get("key") != key:
        pin = torch.cuda.is_available() and any(t.device.type == "cuda" for t in state.values())
        host = _create_cpu_state_dict(state, pin_memory=pin)
        for k, t in host.items():  # torch's helper hands some tensors back as they are (0-d DTensors)
            if t is state[k]:
                host[k] = t.detach().clone().to("cpu")  # in host memory: the writer thread never reads the device
        cache.clear()
        cache.update(key=key, host=host)
    _copy_state_dict(state, cache["host"])
    return cache["host"]


_SAVABLE = frozenset(DTYPES.values())


_COMPLEX = (torch.complex64, torch.complex128)


def flat_state(trees: tuple[Any, Any, Any]) -> tuple[dict[str, Tensor], dict[str, list[str]], list[str]]:
    """`group.path -> tensor` for every leaf (DTensors stay DTensors), each group's paths in
    order, and the keys of complex leaves (stored as their real view, (..., 2), which every
    safetensors writer and DCP take)."""
    state: dict[str, Tensor] = {}
    order: dict[str, list[str]] = {}
    complex_keys: list[str] = []
    for group, tree in zip(GROUPS, trees):
        if tree is None:
            continue
        order[group] = []
        for path, leaf in ps.tree_flatten_with_path(tree)[0]:
            if not isinstance(leaf, Tensor):
                raise ValueError(
                    f"{group} leaf '{path}' is {type(leaf).__name__}, not a tensor; checkpoints hold tensors only "
                    "(keep plain values in metadata=...)"
                )
            if f"{group}.{path}" in state:
                raise ValueError(f"{group} has two leaves at path '{path}'")
            if leaf.dtype in _COMPLEX:
                complex_keys.append(f"{group}.{path}")
                leaf = torch.view_as_real(leaf.detach().resolve_conj())  # a lazily conjugated view has no real view
            if leaf.dtype not in _SAVABLE:
                raise ValueError(
                    f"{group} leaf '{path}' has dtype {leaf.dtype}, which a checkpoint cannot hold (it would save but "
                    f"never load); keep it in one of {sorted(str(d).removeprefix('torch.') for d in _SAVABLE)}"
                )
            state[f"{group}.{path}"] = leaf.detach()
            order[group].append(path)
    return state, order, complex_keys


def _prune(final: Path, room: int, is_good: Callable[[Path], bool] | None) -> None:
    """Delete the oldest checkpoints beside `final` until `room` others are left, sparing the newest good one."""
    others = [p for p in dirs.candidates(final.parent) if p.name != final.name]
    excess = len(others) - room
    if excess <= 0:
        return
    spare = next((p for p in others if is_good(p)), None) if is_good is not None else None
    for path in reversed(others):
        if excess <= 0:
            break
        if path != spare:
            dirs.retire(path)
            excess -= 1


def verifies(path: Path) -> bool:
    """Whether every file of the checkpoint `path` checks out."""
    try:
        verify_checkpoint(path)
        return True
    except CheckpointError:
        return False


def _rng_tensors() -> dict[str, Tensor]:
    out = {"torch.cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        for i, state in enumerate(torch.cuda.get_rng_state_all()):
            out[f"torch.cuda.{i}"] = state
    return out


def _python_state(saved: Any) -> tuple:
    version, internal, gauss = saved
    return version, tuple(internal), gauss


def check_rng(root: Path, manifest: Manifest, rng: dict[str, Tensor]) -> None:
    """Refuse (CheckpointError naming the file) generator states that would not load, before anything is applied."""
    try:
        if manifest.python_rng is not None:
            random.Random().setstate(_python_state(manifest.python_rng))
    except (TypeError, ValueError, OverflowError) as e:
        raise CheckpointError(f"{root / MANIFEST}: python_rng is not a random-module state ({e})") from None
    for key, state in rng.items():
        try:
            if key != "torch.cpu" and not key.startswith("torch.cuda."):
                raise ValueError("not a generator this purestep saves")
            int(key.rsplit(".", 1)[1]) if key.startswith("torch.cuda.") else None
            if key == "torch.cpu":
                torch.Generator().set_state(state)
            elif state.dtype != torch.uint8 or state.dim() != 1:
                raise ValueError(f"a {state.dtype} tensor of shape {tuple(state.shape)}, not a byte vector")
        except (TypeError, ValueError, RuntimeError) as e:
            raise CheckpointError(f"{root / 'rng.safetensors'}: '{key}' is not a generator state ({e})") from None


def _python_rng() -> list[Any]:
    version, internal, gauss = random.getstate()
    return [version, list(internal), gauss]


def _versions() -> dict[str, str]:
    def version(dist: str) -> str:
        try:
            return _metadata.version(dist)
        except _metadata.PackageNotFoundError:
            return "unknown"

    return {
        "purestep": version("purestep"),
        "torch": str(torch.__version__),
        "safetensors": safetensors.__version__,
        "msgspec": msgspec.__version__,
        "python": platform.python_version(),
    }


def load(
    root: Path,
    likes: tuple[Any, Any, Any],
    names: tuple[str, str, str],
    world: D.World,
    *,
    flat: bool = False,
    device: torch.device | None = None,
    verify: bool = True,
) -> Checkpoint:
    """The one load: rank 0 verifies, every rank checks the trees against the checkpoint, DCP reads the regions.

    A tree given as None is not loaded, or with `flat` loaded whole as `dict(path -> tensor)` on `device`.
    """
    problem = None
    if world.main:
        try:
            (verify_checkpoint if verify else read_manifest)(root)
        except CheckpointError as e:
            problem = str(e)
    problem = D.broadcast_object(problem, world)
    if problem is not None:
        raise CheckpointError(problem)
    try:
        manifest = read_manifest(root)
        wholes = assemble(root, _LAYOUT[manifest.layout].chunks(root, manifest))
        state, plan = _targets(root, manifest, wholes, likes, names, flat, device)
        rng = read_tensors(root / "rng.safetensors") if "rng.safetensors" in manifest.files else {}
        check_rng(root, manifest, rng)  # before anything is read into place
    except CheckpointError as e:
        problem = str(e)
    problem = D.agree(problem, world)
    if problem is not None:
        raise CheckpointError(problem)
    read_into(root, {fqn: wholes[fqn] for fqn in state}, state, distributed=world.size > 1)
    for fqn in set(manifest.complex) & set(state):  # read into the real view: the tensor is the complex one
        state[fqn] = torch.view_as_complex(state[fqn])
    trees = []
    for group, present, paths, spec in plan:
        leaves = [state[f"{group}.{p}"] for p in paths]
        trees.append(
            None if not present else dict(zip(paths, leaves)) if spec is None else ps.tree_unflatten(leaves, spec)
        )
    return Checkpoint(trees[0], trees[1], trees[2], manifest.step, manifest, rng)


def _complex_of(real: torch.dtype) -> torch.dtype | None:
    return {torch.float32: torch.complex64, torch.float64: torch.complex128}.get(real)


def _targets(
    root: Path,
    manifest: Manifest,
    wholes: dict[str, Whole],
    likes: tuple[Any, Any, Any],
    names: tuple[str, str, str],
    flat: bool,
    device: torch.device | None,
) -> tuple[dict[str, Tensor], list]:
    """Empty tensors to load into (`fqn -> tensor`: laid out like the `likes` leaves, or whole on `device`),
    after checking each tree against the checkpoint leaf for leaf; and per group how to rebuild it:
    `(group, present, paths, treespec or None for a flat dict)`."""
    held: dict[str, list[str]] = {}
    for fqn in wholes:
        group, path = fqn.split(".", 1) if "." in fqn else (fqn, "")
        if group not in GROUPS:
            raise CheckpointError(f"{root / wholes[fqn].chunks[0].file}: holds '{fqn}', which is in no checkpoint tree")
        held.setdefault(group, []).append(path)
    state: dict[str, Tensor] = {}
    plan = []
    for group, like, what in zip(GROUPS, likes, names):
        saved = manifest.order.get(group, held.get(group, []))
        if set(saved) != set(held.get(group, [])):
            odd = sorted(set(saved) ^ set(held.get(group, [])))[0]
            raise CheckpointError(f"{root / MANIFEST}: the manifest and the files disagree on {group} tensor '{odd}'")
        present = group in manifest.order or group in held
        if like is None:
            if group == "params" and not present:
                raise CheckpointError(f"{root / MANIFEST}: the checkpoint holds no params")
            for path in saved if flat else ():
                w = wholes[f"{group}.{path}"]
                state[f"{group}.{path}"] = torch.empty(w.shape, dtype=w.dtype, device=device)
            plan.append((group, present and flat, saved, None))
            continue
        if not present:
            raise CheckpointError(f"{root}: the checkpoint holds no {group}, but {what} was given")
        pairs, spec = ps.tree_flatten_with_path(like)
        for path, ref in pairs:
            if not isinstance(ref, Tensor):
                raise ValueError(f"{what} leaf '{path}' is {type(ref).__name__}, not a tensor")
            found = wholes.get(f"{group}.{path}")
            if found is None:
                raise CheckpointError(
                    f"{root}: has no {group} tensor '{path}', which {what} has "
                    f"(the checkpoint has {len(saved)} {group} tensors, e.g. {saved[:3]})"
                )
            w = found
            stored = f"{group}.{path}" in manifest.complex
            shape, dtype = (list(w.shape[:-1]), _complex_of(w.dtype)) if stored else (list(w.shape), w.dtype)
            if shape != list(ref.shape) or dtype != ref.dtype:
                raise CheckpointError(
                    f"{root}: {group} '{path}' is {shape} {dtype} in the checkpoint, "
                    f"but {list(ref.shape)} {ref.dtype} in {what}"
                )
            target = torch.empty_like(ref.detach())
            state[f"{group}.{path}"] = torch.view_as_real(target) if stored else target
        extra = sorted(set(saved) - {p for p, _ in pairs})
        if extra:
            raise CheckpointError(f"{root}: has {group} tensor '{extra[0]}', which {what} lacks ({len(extra)} extra)")
        plan.append((group, True, [p for p, _ in pairs], spec))
    return state, plan
