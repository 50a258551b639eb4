"""Checkpoint directories as transactions: built under a temporary name, published by rename.

Every name a save uses besides the final one is hidden and says what it is:

    .step_00000008.tmp-<hex>   being written; a crash leaves it (incomplete or not yet published)
    .step_00000008.old-<hex>   the checkpoint a re-save of step 8 replaces, moved aside until the new one is in
    .step_00000008.del-<hex>   a checkpoint being deleted (renamed first, so it vanishes at once)

A crash at any point leaves every published checkpoint loadable. The one gap a rename
dance cannot close, a crash between moving the old step 8 aside and renaming the new
one in, is covered by readers: an `.old` directory whose name is vacant counts as that
checkpoint (`candidates`), and `cleanup` renames it back. `cleanup` removes the rest.
"""

from __future__ import annotations

import os
import re
import shutil
import uuid
from pathlib import Path

from ..errors import CheckpointError
from ._format import MANIFEST, fsync_dir, read_manifest

_HIDDEN = re.compile(r"\.(?P<name>.+)\.(?P<kind>tmp|old|del)-[0-9a-f]{12}")


def temporary(final: Path, kind: str = "tmp") -> Path:
    """A fresh hidden name beside `final`."""
    return final.parent / f".{final.name}.{kind}-{uuid.uuid4().hex[:12]}"


def discard(path: Path) -> None:
    """Remove a directory tree that nothing refers to any more."""
    shutil.rmtree(path, ignore_errors=True)


def retire(path: Path) -> None:
    """Delete a published checkpoint: renamed away first, so no reader ever sees it half deleted."""
    gone = temporary(path, "del")
    os.rename(path, gone)
    fsync_dir(path.parent)
    discard(gone)


def publish(tmp: Path, final: Path) -> None:
    """Rename the complete directory `tmp` to `final`, replacing a checkpoint already there."""
    old = None
    if final.exists():
        old = temporary(final, "old")
        os.rename(final, old)  # a crash from here to the next rename: `old` stands in for `final`
    os.rename(tmp, final)
    fsync_dir(final.parent)
    if old is not None:
        discard(old)


def cleanup(folder: Path) -> None:
    """Remove what crashed saves left in `folder`; put back a replaced checkpoint whose successor never arrived."""
    if not folder.is_dir():
        return
    for path in sorted(folder.iterdir()):
        m = _HIDDEN.fullmatch(path.name)
        if m is None or not path.is_dir() or path.is_symlink():
            continue
        final = folder / m["name"]
        if m["kind"] == "old" and not final.exists() and (path / MANIFEST).is_file():
            os.rename(path, final)
        else:
            discard(path)
    fsync_dir(folder)


def step_of(path: Path) -> int:
    """The step a checkpoint directory holds: from its sealed manifest, else the last number in its name."""
    try:
        return read_manifest(path).step
    except CheckpointError:
        name = m["name"] if (m := _HIDDEN.fullmatch(path.name)) else path.name
        digits = re.findall(r"\d+", name)
        return int(digits[-1]) if digits else -1


def candidates(folder: Path) -> list[Path]:
    """The checkpoints in `folder`, newest step first: published ones, and replaced ones whose name is vacant."""
    if not folder.is_dir():
        return []
    found = []
    for path in folder.iterdir():
        m = _HIDDEN.fullmatch(path.name)
        if m is not None and (m["kind"] != "old" or (folder / m["name"]).exists()):
            continue
        if m is None and path.name.startswith("."):
            continue
        if path.is_dir() and (path / MANIFEST).is_file():
            found.append(path)
    return sorted(found, key=lambda p: (step_of(p), p.name), reverse=True)
