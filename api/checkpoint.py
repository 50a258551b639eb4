"""Checkpoints: a directory of safetensors files plus a msgspec manifest, written atomically.

Layout of one checkpoint directory:

    params.safetensors      name -> tensor
    opt_state.safetensors   optimizer state, flattened by key path (`0.mu.layers.0.weight`)
    ema.safetensors         averaged params (or any EMA tree), flattened by key path
    rng.safetensors         RNG states as uint8 tensors (torch CPU, each CUDA device)
    manifest.json           step, config, data position, versions, sha256 + size of every file,
                            and a sha256 of the manifest itself

A checkpoint saved with `distributed=True` (FSDP2 runs; `layout: "dcp"` in the manifest)
is written by `torch.distributed.checkpoint` with its safetensors storage
(`HuggingFaceStorageWriter(save_distributed=True)`): every rank writes its own shards,
`shard-<rank+1>-model-<group>-of-<groups>.safetensors`, groups 1/2/3 = params, opt_state,
ema, keys `params.<name>`, `opt_state.<path>`, `ema.<path>`, each shard's offset in the
full tensor in the file's `DCP_SHARDING_INFO` header. `rng.safetensors` and the manifest
are written by rank 0 as above. Such a directory is a DCP checkpoint
(`HuggingFaceStorageReader` reads it, resharding to any world size: `load_distributed`)
and a purestep checkpoint (`load_checkpoint` assembles whole tensors in one process, no
process group needed). DCP's own consolidation (`enable_consolidation=True`) is not used:
in torch 2.13 it calls `torch.finfo` on every dtype and fails on the int64 step counters.

The directory is built under a temporary name in the same parent, every file and the
directory are fsynced, and one `rename` publishes it: a reader sees the whole checkpoint
or none of it. No pickle is used anywhere.
"""

from __future__ import annotations

import hashlib
import os
import platform
import random
import re
import shutil
import time
import uuid
import warnings
from importlib import metadata as _metadata
from pathlib import Path
from typing import Any, NamedTuple

import msgspec
import safetensors
import safetensors.torch
import torch
from torch import Tensor

import purestep.core as ps

MANIFEST = "manifest.json"
FORMAT = 1
LAYOUTS = ("files", "dcp")
_GROUPS = ("params", "opt_state", "ema")  # DCP file index = position + 1
_CHUNK = 1 << 22


class CheckpointError(RuntimeError):
    """A checkpoint that is missing, incomplete, corrupted or does not fit what it is loaded into."""


class FileEntry(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    sha256: str
    size: int


class Manifest(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """What `manifest.json` holds."""

    format: int = FORMAT
    step: int
    files: dict[str, FileEntry]
    versions: dict[str, str]
    created_unix: float
    config: Any = None
    data_state: Any = None
    metadata: dict[str, Any] = {}
    python_rng: Any = None
    layout: str = "files"  # "files": one safetensors file per group; "dcp": torch.distributed.checkpoint shards
    world_size: int = 1  # the number of ranks that wrote the checkpoint
    order: dict[str, list[str]] = {}  # "dcp": group -> its key paths in the order they were saved
    checksum: str = ""  # sha256 of this manifest encoded with checksum=""


class Checkpoint(NamedTuple):
    """A loaded checkpoint.

    `params` and (without a `*_like` tree) `opt_state` and `ema` are flat
    `dict(path -> tensor)`; with `opt_state_like` / `ema_like` they are trees of that shape.
    """

    params: dict[str, Tensor]
    opt_state: Any
    ema: Any
    step: int
    manifest: Manifest
    rng: dict[str, Tensor]

    def restore_rng(self) -> None:
        """Set the torch CPU, CUDA and Python `random` generators to their saved states."""
        if "torch.cpu" in self.rng:
            torch.set_rng_state(self.rng["torch.cpu"])
        cuda = sorted((k for k in self.rng if k.startswith("torch.cuda.")), key=lambda k: int(k.rsplit(".", 1)[1]))
        if cuda and torch.cuda.is_available():
            for key in cuda:
                index = int(key.rsplit(".", 1)[1])
                if index < torch.cuda.device_count():
                    torch.cuda.set_rng_state(self.rng[key], index)
        if self.manifest.python_rng is not None:
            version, internal, gauss = self.manifest.python_rng
            random.setstate((version, tuple(internal), gauss))


# --------------------------------------------------------------------------- #
# Saving.
# --------------------------------------------------------------------------- #


def _plain_data(config: Any, metadata: Any, data_state: Any) -> tuple[Any, Any, Any]:
    """config, metadata and data_state as msgspec builtins (what the manifest stores)."""
    try:
        return msgspec.to_builtins(config), msgspec.to_builtins(metadata or {}), msgspec.to_builtins(data_state)
    except TypeError as e:
        raise ValueError(f"config, metadata and data_state must be msgspec-encodable plain data: {e}") from None


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
        (`checkpoint_dir(run_dir, step)` gives that name). An existing one is replaced.
      params: a tree of tensors, usually `dict(model.state_dict())` or `dict(name -> param)`.
      opt_state: the optimizer state tree (`opt.init(params)` and its successors).
      ema: averaged params, any tree of tensors.
      step: the number of optimizer steps taken.
      metadata: msgspec-encodable extras kept in the manifest.
      config: the run's config (a msgspec Struct or plain data), kept in the manifest.
      data_state: the data position (plain data), kept in the manifest.
      rng: save the torch CPU/CUDA and Python `random` states (`Checkpoint.restore_rng`).
      keep_last: after the new checkpoint is complete, delete all but the newest
        `keep_last` complete checkpoints beside it (the new one is always kept).
      distributed: write through `torch.distributed.checkpoint` with its safetensors
        storage (the "dcp" layout): a collective that every rank calls with its own
        (DTensor-sharded) trees; rank 0 publishes after all ranks wrote. Without a process
        group it writes one process's shards (whole tensors).

    Example:
        >>> import tempfile, torch
        >>> from purestep.api import save_checkpoint, load_checkpoint
        >>> d = tempfile.mkdtemp()
        >>> p = save_checkpoint(f"{d}/step_1", params={"w": torch.ones(2)}, step=1)
        >>> load_checkpoint(p).params["w"]
        tensor([1., 1.])
    """
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"step must be an int >= 0, got {step!r}")
    if keep_last is not None and (isinstance(keep_last, bool) or not isinstance(keep_last, int) or keep_last < 1):
        raise ValueError(f"keep_last must be an int >= 1 or None, got {keep_last!r}")
    final = Path(path)
    if distributed:
        return _save_dcp(final, params=params, opt_state=opt_state, ema=ema, step=step, metadata=metadata,
                         config=config, data_state=data_state, rng=rng, keep_last=keep_last)
    parent = final.parent
    parent.mkdir(parents=True, exist_ok=True)
    groups = {"params": _flat(params, "params")}
    if opt_state is not None:
        groups["opt_state"] = _flat(opt_state, "opt_state")
    if ema is not None:
        groups["ema"] = _flat(ema, "ema")
    if rng:
        groups["rng"] = _rng_tensors()
    config_data, extras, data_data = _plain_data(config, metadata, data_state)

    tmp = parent / f".{final.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        files = {}
        for name, tensors in groups.items():
            filename = f"{name}.safetensors"
            files[filename] = _write_tensors(tmp / filename, tensors)
        manifest = Manifest(
            step=step,
            files=files,
            versions=_versions(),
            created_unix=time.time(),
            config=config_data,
            data_state=data_data,
            metadata=extras,
            python_rng=_python_rng() if rng else None,
        )
        _write_bytes(tmp / MANIFEST, _encode_manifest(manifest))
        _fsync_dir(tmp)
        _publish(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if keep_last is not None:
        _prune(parent, final, keep_last)
    return final


def _dist() -> tuple[int, int]:
    """(rank, world size) of the default process group, (0, 1) without one."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _bcast(obj: Any) -> Any:
    import torch.distributed as dist

    if _dist()[1] == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _dcp_state(params: Any, opt_state: Any, ema: Any, check: bool = True) -> dict[str, Tensor]:
    """The flat state dict DCP sees: `group.path -> tensor` (DTensors stay DTensors)."""
    out: dict[str, Tensor] = {}
    for group, tree in zip(_GROUPS, (params, opt_state, ema)):
        if tree is None:
            continue
        for path, leaf in ps.tree_flatten_with_path(tree)[0]:
            if not isinstance(leaf, Tensor):
                raise ValueError(
                    f"{group} leaf '{path}' is {type(leaf).__name__}, not a tensor; checkpoints hold tensors only "
                    "(keep plain values in metadata=...)"
                )
            key = f"{group}.{path}"
            if check and key in out:
                raise ValueError(f"{group} has two leaves at path '{path}'")
            out[key] = leaf.detach()
    return out


def _save_dcp(final: Path, *, params: Any, opt_state: Any, ema: Any, step: int, metadata: Any, config: Any,
              data_state: Any, rng: bool, keep_last: int | None) -> Path:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageWriter

    rank, size = _dist()
    parent = final.parent
    state = _dcp_state(params, opt_state, ema)
    config_data, extras, data_data = _plain_data(config, metadata, data_state)
    # Every rank writes into the same temporary directory; rank 0 names it.
    tmp = _bcast(parent / f".{final.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}" if rank == 0 else None)
    if rank == 0:
        parent.mkdir(parents=True, exist_ok=True)
        tmp.mkdir()
    _bcast(None)  # the directory exists before anyone writes into it
    mapping = {key: _GROUPS.index(key.split(".", 1)[0]) + 1 for key in state}
    order: dict[str, list[str]] = {}
    for key in state:
        group, path_in_group = key.split(".", 1)
        order.setdefault(group, []).append(path_in_group)
    error = None
    try:
        writer = HuggingFaceStorageWriter(str(tmp), fqn_to_index_mapping=mapping, save_distributed=True)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.save(state, storage_writer=writer, no_dist=size == 1)
        # Each rank hashes (and fsyncs) the files it wrote; DCP numbers a rank's shards rank + 1.
        mine = {f.name: _fsync_and_hash(f) for f in sorted(tmp.glob(f"shard-{rank + 1:05d}-*.safetensors"))}
    except Exception as e:  # noqa: BLE001 - reported on every rank below
        mine, error = {}, f"rank {rank}: {type(e).__name__}: {e}"
    gathered = _gather(mine, error)
    if rank == 0:
        try:
            errors = [err for _, err in gathered if err]
            if errors:
                raise CheckpointError(f"{final}: torch.distributed.checkpoint save failed: {errors[0]}")
            files = {name: entry for files_of_rank, _ in gathered for name, entry in files_of_rank.items()}
            if rng:
                files["rng.safetensors"] = _write_tensors(tmp / "rng.safetensors", _rng_tensors())
            manifest = Manifest(
                step=step, files=dict(sorted(files.items())), versions=_versions(), created_unix=time.time(),
                config=config_data, data_state=data_data, metadata=extras,
                python_rng=_python_rng() if rng else None, layout="dcp", world_size=size, order=order,
            )
            _write_bytes(tmp / MANIFEST, _encode_manifest(manifest))
            _fsync_dir(tmp)
            _publish(tmp, final)
            if keep_last is not None:
                _prune(parent, final, keep_last)
            outcome = None
        except BaseException as e:
            shutil.rmtree(tmp, ignore_errors=True)
            outcome = e
        message = _bcast(None if outcome is None else str(outcome))
        if outcome is not None:
            raise outcome
    else:
        message = _bcast(None)
        if message is not None:
            raise CheckpointError(message)
    return final


def _gather(files: dict[str, FileEntry], error: str | None) -> list[tuple[dict[str, FileEntry], str | None]]:
    """Every rank's (files, error) on rank 0."""
    import torch.distributed as dist

    rank, size = _dist()
    item = ({k: [v.sha256, v.size] for k, v in files.items()}, error)
    if size == 1:
        out = [item]
    else:
        out = [None] * size if rank == 0 else None
        dist.gather_object(item, out, dst=0)
        if rank != 0:
            return []
    return [({k: FileEntry(sha256=h, size=n) for k, (h, n) in f.items()}, err) for f, err in out]


def checkpoint_dir(run_dir: str | os.PathLike, step: int) -> Path:
    """The conventional directory of the checkpoint at `step`: `run_dir/checkpoints/step_00001000`."""
    return Path(run_dir) / "checkpoints" / f"step_{step:08d}"


def _flat(tree: Any, what: str) -> dict[str, Tensor]:
    pairs, _ = ps.tree_flatten_with_path(tree)
    out: dict[str, Tensor] = {}
    seen: set[int] = set()
    for path, leaf in pairs:
        if not isinstance(leaf, Tensor):
            raise ValueError(
                f"{what} leaf '{path}' is {type(leaf).__name__}, not a tensor; checkpoints hold tensors only "
                "(keep plain values in metadata=...)"
            )
        if path in out:
            raise ValueError(f"{what} has two leaves at path '{path}'")
        t = leaf.detach().to("cpu")
        if not t.is_contiguous():
            t = t.contiguous()
        # safetensors refuses tensors that share memory (tied weights): give each its own.
        if t.numel() and t.untyped_storage().data_ptr() in seen:
            t = t.clone()
        seen.add(t.untyped_storage().data_ptr())
        out[path] = t
    return out


def _rng_tensors() -> dict[str, Tensor]:
    out = {"torch.cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        for i, state in enumerate(torch.cuda.get_rng_state_all()):
            out[f"torch.cuda.{i}"] = state
    return out


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


def _write_tensors(path: Path, tensors: dict[str, Tensor]) -> FileEntry:
    order = msgspec.json.encode(list(tensors)).decode()  # safetensors itself sorts the keys
    safetensors.torch.save_file(tensors, str(path), metadata={"format": "pt", "purestep.keys": order})
    return _fsync_and_hash(path)


def _write_bytes(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _fsync_and_hash(path: Path) -> FileEntry:
    h = hashlib.sha256()
    size = 0
    with open(path, "rb+") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
            size += len(chunk)
        os.fsync(f.fileno())
    return FileEntry(sha256=h.hexdigest(), size=size)


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # platforms without directory fds (Windows)
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _publish(tmp: Path, final: Path) -> None:
    old = None
    if final.exists():
        old = final.parent / f".{final.name}.old-{uuid.uuid4().hex[:8]}"
        os.rename(final, old)
    os.rename(tmp, final)
    _fsync_dir(final.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def _prune(parent: Path, keep: Path, keep_last: int) -> None:
    others = [(step, p) for step, p in _complete(parent) if p.resolve() != keep.resolve()]
    others.sort(key=lambda sp: (sp[0], sp[1].name))
    for _, p in others[: max(0, len(others) - (keep_last - 1))]:
        shutil.rmtree(p, ignore_errors=True)
    _fsync_dir(parent)


# --------------------------------------------------------------------------- #
# The manifest.
# --------------------------------------------------------------------------- #


def _encode_manifest(manifest: Manifest) -> bytes:
    body = msgspec.json.encode(msgspec.structs.replace(manifest, checksum=""))
    sealed = msgspec.structs.replace(manifest, checksum=hashlib.sha256(body).hexdigest())
    return msgspec.json.format(msgspec.json.encode(sealed), indent=2)


def read_manifest(path: str | os.PathLike) -> Manifest:
    """The verified manifest of the checkpoint directory `path` (files not checked)."""
    file = Path(path) / MANIFEST
    if not file.is_file():
        raise CheckpointError(f"{file}: missing; {Path(path)} is not a complete checkpoint")
    try:
        manifest = msgspec.json.decode(file.read_bytes(), type=Manifest)
    except msgspec.DecodeError as e:
        raise CheckpointError(f"{file}: unreadable manifest ({e})") from None
    body = msgspec.json.encode(msgspec.structs.replace(manifest, checksum=""))
    if hashlib.sha256(body).hexdigest() != manifest.checksum:
        raise CheckpointError(f"{file}: checksum mismatch; the manifest was changed after it was written")
    if manifest.format != FORMAT:
        raise CheckpointError(f"{file}: checkpoint format {manifest.format}, this purestep reads {FORMAT}")
    if manifest.layout not in LAYOUTS:
        raise CheckpointError(f"{file}: unknown layout {manifest.layout!r}, this purestep reads {LAYOUTS}")
    return manifest


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
    """Load and verify the checkpoint directory `path`.

    Every file's size and sha256 are checked against the manifest first, so a missing,
    truncated or corrupted file raises `CheckpointError` naming it.

    Args:
      opt_state_like: a state tree of the structure to rebuild (e.g. `opt.init(params)`);
        its leaves give the device. A state that does not match raises naming the path.
        None gives the flat `dict(path -> tensor)`.
      ema_like: the same for the EMA tree.
      device: where to put params (and flat trees); default CPU.
    """
    root = Path(path)
    manifest = read_manifest(root)
    for filename, entry in manifest.files.items():
        _verify(root / filename, entry)
    dev = "cpu" if device is None else str(torch.device(device))
    if manifest.layout == "dcp":
        whole = _read_dcp_whole(root, manifest)
        groups = {g: {k: t.to(dev) for k, t in ts.items()} if ts else None for g, ts in whole.items()}
        params = groups["params"]
        if params is None:
            raise CheckpointError(f"{root}: a DCP checkpoint that holds no params")
        opt_state = _rebuild(groups["opt_state"], opt_state_like, root / "shard-*-model-00002-*.safetensors", "opt_state_like")
        ema = _rebuild(groups["ema"], ema_like, root / "shard-*-model-00003-*.safetensors", "ema_like")
        return Checkpoint(params, opt_state, ema, manifest.step, manifest, _load_rng(root, manifest))

    def load(name: str) -> dict[str, Tensor] | None:
        filename = f"{name}.safetensors"
        if filename not in manifest.files:
            return None
        try:
            with safetensors.safe_open(str(root / filename), framework="pt", device=dev) as f:
                keys = list(f.keys())
                order = (f.metadata() or {}).get("purestep.keys")
                if order is not None and sorted(msgspec.json.decode(order)) == sorted(keys):
                    keys = msgspec.json.decode(order)
                return {k: f.get_tensor(k) for k in keys}
        except Exception as e:  # a file that hashes right but does not parse
            raise CheckpointError(f"{root / filename}: not a readable safetensors file ({e})") from None

    params = load("params")
    if params is None:
        raise CheckpointError(f"{root / MANIFEST}: lists no params.safetensors")
    opt_flat, ema_flat = load("opt_state"), load("ema")
    opt_state = _rebuild(opt_flat, opt_state_like, root / "opt_state.safetensors", "opt_state_like")
    ema = _rebuild(ema_flat, ema_like, root / "ema.safetensors", "ema_like")
    return Checkpoint(params, opt_state, ema, manifest.step, manifest, load("rng") or {})


def _load_rng(root: Path, manifest: Manifest) -> dict[str, Tensor]:
    if "rng.safetensors" not in manifest.files:
        return {}
    try:
        return safetensors.torch.load_file(str(root / "rng.safetensors"))
    except Exception as e:
        raise CheckpointError(f"{root / 'rng.safetensors'}: not a readable safetensors file ({e})") from None


def _dcp_reader(root: Path) -> Any:
    from torch.distributed.checkpoint import HuggingFaceStorageReader

    return HuggingFaceStorageReader(str(root))


def _read_dcp_whole(root: Path, manifest: Manifest) -> dict[str, dict[str, Tensor]]:
    """Every tensor of a "dcp" checkpoint assembled whole in this process (no process group used)."""
    import torch.distributed.checkpoint as dcp

    try:
        meta = _dcp_reader(root).read_metadata().state_dict_metadata
        keys = [k for k in meta if k.split(".", 1)[0] in _GROUPS]
        state = {k: torch.empty(meta[k].size, dtype=meta[k].properties.dtype) for k in keys}
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(state, storage_reader=_dcp_reader(root), no_dist=True)
    except CheckpointError:
        raise
    except Exception as e:
        raise CheckpointError(f"{root}: not a readable torch.distributed.checkpoint directory ({e})") from None
    out: dict[str, dict[str, Tensor]] = {g: {} for g in _GROUPS}
    for group in _GROUPS:  # the saved order first, then anything the manifest does not list
        for path in manifest.order.get(group, []):
            if f"{group}.{path}" in state:
                out[group][path] = state[f"{group}.{path}"]
    for key in sorted(state):
        group, path = key.split(".", 1)
        out[group].setdefault(path, state[key])
    return out


def verify_checkpoint(path: str | os.PathLike) -> Manifest:
    """The manifest of `path` after checking every file's size and sha256 (CheckpointError naming a bad file)."""
    root = Path(path)
    manifest = read_manifest(root)
    for filename, entry in manifest.files.items():
        _verify(root / filename, entry)
    return manifest


def load_distributed(
    path: str | os.PathLike, *, params: Any, opt_state: Any = None, ema: Any = None, verify: bool = True
) -> Checkpoint:
    """Load a "dcp" checkpoint into trees laid out like `params` / `opt_state` / `ema` (a collective).

    The trees' leaves may be DTensors sharded for any world size (FSDP2) or plain tensors:
    `torch.distributed.checkpoint` reads each rank's slices from the saved shards, whatever
    world size wrote them. The given trees are not written to; the Checkpoint holds new
    tensors laid out like them (`.params`, `.opt_state`, `.ema` as trees of the inputs'
    shape). With `verify`, rank 0 checks every file's sha256 first.
    """
    import torch.distributed.checkpoint as dcp

    root = Path(path)
    rank, size = _dist()
    problem = None
    if rank == 0:
        try:
            manifest = verify_checkpoint(root) if verify else read_manifest(root)
            if manifest.layout != "dcp":
                raise CheckpointError(f"{root / MANIFEST}: layout {manifest.layout!r}, not a DCP checkpoint")
        except CheckpointError as e:
            problem = str(e)
    problem = _bcast(problem)
    if problem is not None:
        raise CheckpointError(problem)
    manifest = read_manifest(root)
    trees = (params, opt_state, ema)
    like = _dcp_state(*trees)
    state = {k: torch.empty_like(v) for k, v in like.items()}
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(state, storage_reader=_dcp_reader(root), no_dist=size == 1)
    except Exception as e:
        raise CheckpointError(f"{root}: does not load into this run's state ({type(e).__name__}: {e})") from None
    out = []
    for group, tree in zip(_GROUPS, trees):
        if tree is None:
            out.append(None)
            continue
        pairs, spec = ps.tree_flatten_with_path(tree)
        out.append(ps.tree_unflatten([state[f"{group}.{p}"] for p, _ in pairs], spec))
    return Checkpoint(out[0], out[1], out[2], manifest.step, manifest, _load_rng(root, manifest))


def _verify(file: Path, entry: FileEntry) -> None:
    if not file.is_file():
        raise CheckpointError(f"{file}: missing (the manifest lists it)")
    size = file.stat().st_size
    if size != entry.size:
        kind = "truncated" if size < entry.size else "longer than written"
        raise CheckpointError(f"{file}: {kind}: {size} bytes, the manifest says {entry.size}")
    h = hashlib.sha256()
    with open(file, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    if h.hexdigest() != entry.sha256:
        raise CheckpointError(f"{file}: corrupted: sha256 {h.hexdigest()[:12]}... is not {entry.sha256[:12]}...")


def _rebuild(flat: dict[str, Tensor] | None, like: Any, file: Path, what: str) -> Any:
    if like is None:
        return flat
    if flat is None:
        raise CheckpointError(f"{file}: missing from the checkpoint, but {what} was given")
    pairs, spec = ps.tree_flatten_with_path(like)
    wanted = {p for p, _ in pairs}
    extra = sorted(set(flat) - wanted)
    leaves = []
    for path, ref in pairs:
        if not isinstance(ref, Tensor):
            raise ValueError(f"{what} leaf '{path}' is {type(ref).__name__}, not a tensor")
        if path not in flat:
            raise CheckpointError(
                f"{file}: has no state at '{path}', which {what} has; "
                f"the checkpoint was saved from a different optimizer ({len(extra)} other entries, e.g. {extra[:3]})"
            )
        t = flat[path]
        if t.shape != ref.shape or t.dtype != ref.dtype:
            raise CheckpointError(
                f"{file}: state '{path}' is {tuple(t.shape)} {t.dtype}, {what} has {tuple(ref.shape)} {ref.dtype}"
            )
        leaves.append(t.to(ref.device))
    if extra:
        raise CheckpointError(f"{file}: has state at '{extra[0]}' that {what} lacks ({len(extra)} extra entries)")
    return ps.tree_unflatten(leaves, spec)


# --------------------------------------------------------------------------- #
# Finding checkpoints.
# --------------------------------------------------------------------------- #


def _step_of(path: Path) -> int:
    try:
        return msgspec.json.decode((path / MANIFEST).read_bytes(), type=Manifest).step
    except (OSError, msgspec.DecodeError):
        digits = re.findall(r"\d+", path.name)
        return int(digits[-1]) if digits else -1


def _complete(folder: Path) -> list[tuple[int, Path]]:
    """Published checkpoints in `folder`: not temporary, with a manifest."""
    if not folder.is_dir():
        return []
    return [
        (_step_of(p), p)
        for p in folder.iterdir()
        if p.is_dir() and not p.name.startswith(".") and (p / MANIFEST).is_file()
    ]


def latest_checkpoint(run_dir: str | os.PathLike) -> Path | None:
    """The newest complete checkpoint in `run_dir/checkpoints` or in `run_dir` itself, or None.

    Half-written saves (temporary directories) are never returned. A published
    checkpoint that was damaged later is returned, and fails loudly in `load_checkpoint`.
    """
    root = Path(run_dir)
    found = _complete(root / "checkpoints") + _complete(root)
    if not found:
        return None
    return max(found, key=lambda sp: (sp[0], sp[1].name))[1]
