"""What a checkpoint directory may hold and how it is trusted: the sealed manifest and its files.

A manifest lists every file it vouches for by a plain name (no directories, no dots in
front, only the names its layout writes) with the file's size and sha256, and seals
itself with a sha256 of its own content. Files are opened without following symlinks
and must be regular files, so nothing outside the checkpoint's directory is ever read
because a manifest names it, and nothing inside it is read unless the manifest lists it.
"""

from __future__ import annotations

import errno
import hashlib
import os
import re
import stat
from pathlib import Path
from typing import Any

import msgspec
import safetensors
import safetensors.torch
import torch
from torch import Tensor

from ..errors import CheckpointError

MANIFEST = "manifest.json"
FORMAT = 1
GROUPS = ("params", "opt_state", "ema")  # the trees a checkpoint holds, in this order
# The files each layout writes: what a manifest of that layout may list.
FILE_NAMES = {
    "files": re.compile(r"(params|opt_state|ema|rng)\.safetensors|worker-\d{5}\.safetensors"),  # + DiLoCo workers
    "dcp": re.compile(r"shard-\d{5}-model-\d{5}-of-\d{5}\.safetensors|rng\.safetensors"),
}
LAYOUTS = tuple(FILE_NAMES)
_CHUNK = 1 << 22
MAX_MANIFEST_BYTES = 1 << 28  # a config, metadata and the key order of every tensor: far below this
DTYPES = {  # safetensors' dtype codes
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "U16": torch.uint16,
    "U32": torch.uint32,
    "U64": torch.uint64,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}


class FileEntry(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One file of a checkpoint as the manifest seals it."""

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
    order: dict[str, list[str]] = {}  # group -> its key paths in the order they were saved
    complex: list[str] = []  # the `group.path` keys of complex tensors, stored as torch.view_as_real
    checksum: str = ""  # sha256 of this manifest encoded with checksum=""


def unwrap(e: BaseException) -> BaseException:
    """The error inside torch.distributed.checkpoint's `CheckpointException` (a BaseException that carries
    each failed rank's error); `e` itself otherwise."""
    failures = getattr(e, "failures", None)
    if isinstance(failures, dict) and failures:
        inner = next(iter(failures.values()))  # (exception, stack summary)
        return unwrap(inner[0] if isinstance(inner, tuple) else inner)
    return e


def reason(e: BaseException) -> str:
    """One line saying why an I/O or torch.distributed.checkpoint operation failed."""
    e = unwrap(e)
    if isinstance(e, OSError) and e.strerror:
        return f"{e.strerror}" + (f" ({e.filename})" if e.filename else "")
    first = next((line for line in str(e).splitlines() if line.strip()), "")
    return f"{type(e).__name__}: {first}" if first else type(e).__name__


# --------------------------------------------------------------------------- #
# The manifest.
# --------------------------------------------------------------------------- #


def encode_manifest(manifest: Manifest) -> bytes:
    """The manifest as sealed JSON: `checksum` is the sha256 of the encoding with checksum=""."""
    body = msgspec.json.encode(msgspec.structs.replace(manifest, checksum=""))
    sealed = msgspec.structs.replace(manifest, checksum=hashlib.sha256(body).hexdigest())
    return msgspec.json.format(msgspec.json.encode(sealed), indent=2)


def read_manifest(path: str | os.PathLike) -> Manifest:
    """The verified manifest of the checkpoint directory `path` (files not checked)."""
    file = Path(path) / MANIFEST
    if not file.exists() and not file.is_symlink():
        raise CheckpointError(f"{file}: missing; {Path(path)} is not a complete checkpoint")
    data = _read_all(file)
    if len(data) > MAX_MANIFEST_BYTES:
        raise CheckpointError(f"{file}: {len(data)} bytes; a manifest is at most {MAX_MANIFEST_BYTES}")
    try:
        manifest = msgspec.json.decode(data, type=Manifest)
        body = msgspec.json.encode(msgspec.structs.replace(manifest, checksum=""))
    except (msgspec.DecodeError, msgspec.EncodeError, UnicodeError, RecursionError, ValueError) as e:
        raise CheckpointError(f"{file}: unreadable manifest ({type(e).__name__}: {e})") from None
    if hashlib.sha256(body).hexdigest() != manifest.checksum:
        raise CheckpointError(f"{file}: checksum mismatch; the manifest was changed after it was written")
    if manifest.format != FORMAT:
        raise CheckpointError(f"{file}: checkpoint format {manifest.format}, this purestep reads {FORMAT}")
    if manifest.layout not in LAYOUTS:
        raise CheckpointError(f"{file}: unknown layout {manifest.layout!r}, this purestep reads {LAYOUTS}")
    for name in manifest.files:
        if not FILE_NAMES[manifest.layout].fullmatch(name):
            raise CheckpointError(
                f"{file}: lists {name!r}, which is not a file a {manifest.layout!r} checkpoint holds; "
                "a manifest names plain files inside its own directory only"
            )
    return manifest


# --------------------------------------------------------------------------- #
# Files: opened without following links, hashed, fsynced.
# --------------------------------------------------------------------------- #


def _open_regular(file: Path) -> int:
    """A read-only descriptor of `file`, which must be a regular file and not a symlink."""
    try:
        if not stat.S_ISREG(os.lstat(file).st_mode):  # before open: opening a named pipe blocks
            kind = "a symlink" if os.path.islink(file) else "not a regular file"
            if kind == "a symlink":
                raise CheckpointError(f"{file}: is a symlink; a checkpoint's files must be inside its directory")
            raise CheckpointError(f"{file}: not a regular file")
        fd = os.open(file, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0))
    except FileNotFoundError:
        raise CheckpointError(f"{file}: missing (the manifest lists it)") from None
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise CheckpointError(f"{file}: is a symlink; a checkpoint's files must be inside its directory") from None
        raise CheckpointError(f"{file}: cannot be read ({reason(e)})") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise CheckpointError(f"{file}: not a regular file")
    return fd


def _read_all(file: Path) -> bytes:
    fd = _open_regular(file)
    with os.fdopen(fd, "rb") as f:
        return f.read()


def verify_file(file: Path, entry: FileEntry) -> None:
    """Check `file` against its manifest entry: size, then sha256 (CheckpointError naming it)."""
    fd = _open_regular(file)
    with os.fdopen(fd, "rb") as f:
        size = os.fstat(fd).st_size
        if size != entry.size:
            kind = "truncated" if size < entry.size else "longer than written"
            raise CheckpointError(f"{file}: {kind}: {size} bytes, the manifest says {entry.size}")
        h = hashlib.sha256()
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    if h.hexdigest() != entry.sha256:
        raise CheckpointError(f"{file}: corrupted: sha256 {h.hexdigest()[:12]}... is not {entry.sha256[:12]}...")


def hash_and_fsync(file: Path) -> FileEntry:
    """The manifest entry of a file just written, after forcing it to disk."""
    h = hashlib.sha256()
    size = 0
    with open(file, "rb+") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
            size += len(chunk)
        os.fsync(f.fileno())
    return FileEntry(sha256=h.hexdigest(), size=size)


def write_bytes(file: Path, data: bytes) -> None:
    """Write and fsync `data`."""
    with open(file, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def fsync_dir(path: Path) -> None:
    """Make a directory's entries (new files, renames) durable; a no-op where directories cannot be opened."""
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


# --------------------------------------------------------------------------- #
# safetensors.
# --------------------------------------------------------------------------- #


def write_tensors(file: Path, tensors: dict[str, Tensor]) -> FileEntry:
    """Write host tensors as one safetensors file; return its manifest entry."""
    safetensors.torch.save_file(tensors, str(file), metadata={"format": "pt"})
    return hash_and_fsync(file)


def read_header(file: Path) -> tuple[list[tuple[str, tuple[int, ...], str]], dict[str, str]]:
    """`([(key, shape, dtype code)], metadata)` from a safetensors header (codes such as "F32", keys of `DTYPES`);
    CheckpointError naming a malformed file."""
    os.close(_open_regular(file))
    try:
        with safetensors.safe_open(str(file), framework="pt") as f:
            rows = []
            for key in f.keys():
                sl = f.get_slice(key)
                code = sl.get_dtype()
                if code not in DTYPES:
                    raise CheckpointError(f"{file}: tensor '{key}' has dtype {code}, which purestep does not read")
                rows.append((key, tuple(sl.get_shape()), code))
            return rows, dict(f.metadata() or {})
    except CheckpointError:
        raise
    except Exception as e:  # safetensors' own error for a malformed header
        raise CheckpointError(f"{file}: not a readable safetensors file ({reason(e)})") from None


def read_tensors(file: Path) -> dict[str, Tensor]:
    """Every tensor of a (verified) safetensors file, on the CPU."""
    os.close(_open_regular(file))
    try:
        return safetensors.torch.load_file(str(file))
    except Exception as e:
        raise CheckpointError(f"{file}: not a readable safetensors file ({reason(e)})") from None
