"""The demo's corpus: the Python standard library's own `.py` files, bytes as tokens.

Every machine that runs purestep has this text, so the demo downloads nothing. The
global batch of a step is a pure function of `(seed, step)`: each rank takes its rows
of that batch, so runs on any world size see the same data and resume anywhere.
"""

from __future__ import annotations

import os
import sysconfig
from pathlib import Path

import torch
from torch import Tensor

_SKIP_DIRS = {"site-packages", "dist-packages", "test", "tests", "idlelib", "__pycache__", "lib2to3"}


def stdlib_files(root: str | Path | None = None) -> list[Path]:
    """The standard library's `.py` files in a fixed (sorted) order, tests and site-packages left out."""
    root = Path(root or sysconfig.get_paths()["stdlib"])
    if not root.is_dir():
        raise FileNotFoundError(f"no standard library sources at {root}; set data.root to a folder of .py files")
    found = []
    for folder, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d not in _SKIP_DIRS and not d.startswith("."))
        found += [Path(folder) / f for f in files if f.endswith(".py")]
    return sorted(found)


def stdlib_corpus(max_bytes: int = 4_000_000, root: str | Path | None = None) -> Tensor:
    """The first `max_bytes` bytes of the concatenated standard-library sources, as a uint8 tensor."""
    chunks, total = [], 0
    for path in stdlib_files(root):
        data = path.read_bytes()
        chunks.append(data)
        total += len(data)
        if total >= max_bytes:
            break
    data = b"".join(chunks)[:max_bytes]
    if len(data) < 10_000:
        raise ValueError(f"the corpus under {root or 'the standard library'} holds only {len(data)} bytes")
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


class ByteCorpus:
    """Random windows of a byte corpus; the global batch of `step` depends only on `(seed, step)`.

    `batch(step, rank=0, world=1, split="train")` returns this rank's rows of the global
    batch, `{"input": (B/world, T) int64, "target": (B/world, T) int64}` (targets are
    the inputs shifted by one byte). The last `val_fraction` of the corpus is the
    validation split.
    """

    def __init__(
        self,
        tokens: Tensor,
        *,
        seq_len: int,
        batch_size: int,
        seed: int = 0,
        val_fraction: float = 0.05,
    ) -> None:
        if batch_size < 1 or seq_len < 1:
            raise ValueError(f"batch_size and seq_len must be >= 1, got {batch_size} and {seq_len}")
        cut = int(len(tokens) * (1 - val_fraction))
        self.splits = {"train": tokens[:cut], "val": tokens[cut:]}
        for name, part in self.splits.items():
            if len(part) <= seq_len + 1:
                raise ValueError(f"the {name} split ({len(part)} bytes) is shorter than seq_len={seq_len}")
        self.seq_len, self.batch_size, self.seed = seq_len, batch_size, seed
        self.vocab_size = 256

    @classmethod
    def stdlib(cls, *, seq_len: int, batch_size: int, seed: int = 0, max_bytes: int = 4_000_000) -> "ByteCorpus":
        """The corpus of the standard library's sources (see `stdlib_corpus`)."""
        return cls(stdlib_corpus(max_bytes), seq_len=seq_len, batch_size=batch_size, seed=seed)

    def batch(self, step: int, rank: int = 0, world: int = 1, split: str = "train") -> dict[str, Tensor]:
        if self.batch_size % world:
            raise ValueError(f"batch_size={self.batch_size} must be a multiple of the world size {world}")
        tokens = self.splits[split]
        # One generator per (seed, split, step): no state to carry, checkpoint or resume.
        gen = torch.Generator().manual_seed((self.seed * 1_000_003 + step) * 2 + (split == "val"))
        starts = torch.randint(0, len(tokens) - self.seq_len - 1, (self.batch_size,), generator=gen)
        per_rank = self.batch_size // world
        starts = starts[rank * per_rank : (rank + 1) * per_rank]
        windows = torch.stack([tokens[s : s + self.seq_len + 1] for s in starts.tolist()]).long()
        return {"input": windows[:, :-1], "target": windows[:, 1:]}


def decode(tokens: Tensor | list[int]) -> str:
    """Bytes back to text (invalid UTF-8 replaced)."""
    data = bytes(int(t) for t in (tokens.tolist() if isinstance(tokens, Tensor) else tokens))
    return data.decode("utf-8", errors="replace")


def encode(text: str) -> Tensor:
    """Text as a (len,) int64 tensor of its UTF-8 bytes."""
    return torch.tensor(list(text.encode("utf-8")), dtype=torch.long)
