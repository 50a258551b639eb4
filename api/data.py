"""Data for the Trainer: step-indexed sources, iterables of batches, and the demo's corpus.

Two kinds of source feed `Trainer`:

- a step-indexed source, any object with `batch(step, rank=0, world=1, split="train")`
  returning this rank's rows of the global batch of `step` (`ByteCorpus`). The batch is
  a pure function of `(seed, step)`, so a resume (on any world size) continues with
  exactly the batches the uninterrupted run would have seen: bit-identical on CPU.
- any iterable of batches: a `torch.utils.data.DataLoader`, a list, a generator
  function's result. Iterated pass after pass; on resume the batches the checkpoint
  had consumed are drawn again and dropped, so the run continues exactly only if the
  iterable yields the same sequence again (a DataLoader with a seeded `generator=` and
  no randomness in its workers does; one shuffled from the global RNG does not), and
  the skipped batches cost their loading time. Under DDP/FSDP each rank iterates its
  own (a `DistributedSampler`), and the batch it yields is that rank's share.

The demo's corpus is the Python standard library's own `.py` files, bytes as tokens:
every machine that runs purestep has this text, so the demo downloads nothing.
"""

from __future__ import annotations

import itertools
import os
import sysconfig
from pathlib import Path
from typing import Any, Iterator

import torch
from torch import Tensor

from .errors import ConfigError

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


# --------------------------------------------------------------------------- #
# The two kinds of source, as the Trainer reads them.
# --------------------------------------------------------------------------- #


def is_step_indexed(source: Any) -> bool:
    """Whether `source` gives the batch of any step (`source.batch(step, rank, world)`)."""
    return callable(getattr(source, "batch", None))


def train_batches(source: Any, start: int, rank: int, world: int, micro_batches: int = 1) -> Iterator[list[Any]]:
    """This rank's micro-batches of each step, from step `start` on.

    A step-indexed source splits them itself: micro-batch i of rank r is its
    `batch(step, r * k + i, world * k)`, rows of the same global batch whatever the
    world size and `k`. From an iterable, each step takes its next `k` batches (as
    Lightning's `accumulate_grad_batches`), pass after pass; the first `start * k` are
    drawn and dropped.
    """
    k = micro_batches
    if is_step_indexed(source):
        return ([source.batch(step, rank * k + i, world * k) for i in range(k)] for step in itertools.count(start))
    if not hasattr(source, "__iter__"):
        raise ValueError(
            f"data must have batch(step, rank, world) or be an iterable of batches (a DataLoader), "
            f"got {type(source).__name__}"
        )
    if iter(source) is source:
        raise ValueError(
            "data is a one-shot iterator; pass something that can be iterated again "
            "(a DataLoader, a list, or an object whose __iter__ starts a new pass)"
        )

    def passes() -> Iterator[Any]:
        while True:
            empty = True
            for batch in source:
                empty = False
                yield batch
            if empty:
                raise ValueError(f"data: the iterable ({type(source).__name__}) yielded no batches")

    batches = itertools.islice(passes(), start * k, None)
    return ([next(batches) for _ in range(k)] for _ in itertools.count(start))


def eval_batches(source: Any, n: int, rank: int, world: int) -> list[Any]:
    """The same `n` validation batches every time: `split="val"` of a step-indexed
    source, or the first `n` batches of an iterable."""
    if is_step_indexed(source):
        return [source.batch(i, rank, world, split="val") for i in range(n)]
    return list(itertools.islice(iter(source), n))


def build_data(config: Any) -> ByteCorpus:
    """The corpus the `data` section describes (`config` is a `TrainConfig`)."""
    d = config.data
    max_bytes = d.max_bytes or 1 << 40
    if d.kwargs:
        raise ConfigError("data.kwargs", f"the byte corpus takes no more arguments, got {sorted(d.kwargs)}")
    path = Path(d.source)
    try:
        if d.source == "stdlib":
            tokens = stdlib_corpus(max_bytes)
        elif path.is_dir():
            tokens = stdlib_corpus(max_bytes, root=path)
        elif path.is_file():
            with open(path, "rb") as f:
                raw = f.read(max_bytes)
            tokens = torch.frombuffer(bytearray(raw), dtype=torch.uint8) if raw else torch.zeros(0, dtype=torch.uint8)
        else:
            raise ConfigError("data.source", f"{path} is neither 'stdlib' nor an existing file or folder")
        return ByteCorpus(
            tokens,
            seq_len=config.model.block_size,
            batch_size=config.batch_size,
            seed=config.seed,
            val_fraction=d.val_fraction,
        )
    except OSError as e:
        raise ConfigError("data.source", f"{e.filename or path}: {e.strerror or e}") from None
    except ValueError as e:
        if isinstance(e, ConfigError):
            raise
        raise ConfigError("data.source", f"{d.source}: {e}") from None


def to_device(batch: Any, device: torch.device) -> Any:
    """Every tensor of `batch` on `device` (from pinned memory, without waiting, to a GPU)."""

    def move(t: Any) -> Any:
        if not isinstance(t, Tensor) or t.device == device:
            return t
        return (t.pin_memory() if device.type == "cuda" else t).to(device, non_blocking=True)

    return torch.utils._pytree.tree_map(move, batch)


def batch_rows(batch: Any) -> int:
    """The rows of a batch: the first dimension of its first tensor (a `TypeError` when it holds none)."""
    for t in torch.utils._pytree.tree_leaves(batch):
        if isinstance(t, Tensor) and t.dim():
            return t.shape[0]
    raise TypeError(
        f"a batch ({type(batch).__name__}) holds no tensor to count its rows by: have the data yield tensors "
        "(a collate_fn that returns tensors), or have loss_fn return (loss_sum, tokens)"
    )


def check_rows(micro: list[Any], world: int, batch_size: int) -> bool:
    """A `ConfigError` naming `batch_size` unless the micro-batches of a step, on every rank, hold that many rows."""
    rows = batch_rows(micro[0])
    given = rows * len(micro) * world
    if given != batch_size:
        raise ConfigError(
            "batch_size",
            f"{batch_size}, but the data gives {given} rows a step "
            f"({rows} a batch x {len(micro)} micro-batches x {world} rank(s))",
        )
    return True
