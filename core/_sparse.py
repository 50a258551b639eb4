"""SparseLoCo's compression of a pseudo-gradient: top-k per tile, a few-bit quantizer, and
the mean of several workers' compressed tensors (`diloco(..., compression=ps.TopK())`).

Per tensor: the tensor is cut into tiles (each dim split by its largest divisor <= `chunk`:
64 x 64 tiles of a matrix, runs of a vector), each tile keeps its `density` share of
entries largest in magnitude, and the kept values are quantized to `bits` bits together:
centred on their mean, levels `spread`·σ/2^bits apart, each code decoding to the mean of the
values it took (a 2^bits-entry table sent with the codes). What travels per tensor: the
places in their tiles (int32), the codes (uint8) and the table. The mean over workers is
taken per entry over the workers that kept it (SparseLoCo's aggregation; entries no worker
kept are 0).
"""

from __future__ import annotations

import dataclasses
import math

import torch
from torch import Tensor


@dataclasses.dataclass(frozen=True)
class TopK:
    """SparseLoCo's compression (`ps.diloco(..., compression=ps.TopK())`).

    Args:
      density: the share of each tile's entries kept (SparseLoCo: 128 of 4096, 3.125%).
      chunk: the largest tile side (each dim split by its largest divisor <= chunk).
      bits: the quantizer's bits per kept value (None: values sent as they are).
      error_decay: β of the error feedback e ← β·e + Δ (what was not sent is sent later).
      spread: the quantizer's range, in standard deviations of the kept values.

    References:
        Sarfi et al., SparseLoCo: Communication-efficient LLM training, arXiv 2508.15706, 2025.
    """

    density: float = 0.03125
    chunk: int = 64
    bits: int | None = 2
    error_decay: float = 0.95
    spread: float = 6.0

    def __post_init__(self) -> None:
        if isinstance(self.density, bool) or not isinstance(self.density, (int, float)) or not 0 < self.density <= 1:
            raise ValueError(f"density must be in (0, 1], got {self.density!r}")
        if isinstance(self.chunk, bool) or not isinstance(self.chunk, int) or self.chunk < 1:
            raise ValueError(f"chunk must be an int >= 1, got {self.chunk!r}")
        if self.bits is not None and (
            isinstance(self.bits, bool) or not isinstance(self.bits, int) or not 1 <= self.bits <= 8
        ):
            raise ValueError(f"bits must be an int in [1, 8] or None, got {self.bits!r}")
        if (
            isinstance(self.error_decay, bool)
            or not isinstance(self.error_decay, (int, float))
            or not 0 <= self.error_decay <= 1
        ):
            raise ValueError(f"error_decay must be in [0, 1], got {self.error_decay!r}")
        if isinstance(self.spread, bool) or not isinstance(self.spread, (int, float)) or self.spread <= 0:
            raise ValueError(f"spread must be a number > 0, got {self.spread!r}")

    # -- tiles -------------------------------------------------------------------------
    def tile_shape(self, shape: torch.Size) -> tuple[int, int]:
        """(rows, cols) of one tile of a leaf of `shape` (seen as 2-D: dim 0 by the rest)."""
        rows, cols = (shape[0], math.prod(shape[1:])) if len(shape) > 1 else (1, math.prod(shape))
        return _divisor(rows, self.chunk), _divisor(cols, self.chunk)

    def tiles(self, x: Tensor) -> Tensor:
        """`x` as (number of tiles, tile size), each row one tile's entries."""
        rows, cols = (x.shape[0], x[0].numel()) if x.dim() > 1 else (1, x.numel())
        tr, tc = self.tile_shape(x.shape)
        return x.reshape(rows // tr, tr, cols // tc, tc).permute(0, 2, 1, 3).reshape(-1, tr * tc)

    def untiles(self, t: Tensor, shape: torch.Size) -> Tensor:
        rows, cols = (shape[0], math.prod(shape[1:])) if len(shape) > 1 else (1, math.prod(shape))
        tr, tc = self.tile_shape(shape)
        return t.reshape(rows // tr, cols // tc, tr, tc).permute(0, 2, 1, 3).reshape(shape)

    def keep(self, shape: torch.Size) -> int:
        """Entries kept per tile."""
        tr, tc = self.tile_shape(shape)
        return max(1, round(tr * tc * self.density))

    # -- one worker ----------------------------------------------------------------------
    def compress(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """`x` as (indices in each tile, codes, table): what travels. Without quantization
        the codes are the values and the table is empty."""
        tiles = self.tiles(x)
        idx = tiles.abs().topk(self.keep(x.shape), dim=1, sorted=False).indices
        values = tiles.gather(1, idx)
        idx = idx.to(torch.int32)  # a place in its tile (NCCL and gloo carry no int16)
        if self.bits is None:
            return idx, values, values.new_zeros(0)
        bins = 2**self.bits
        shift = values.mean()
        centred = values - shift
        sigma = centred.std() if values.numel() > 1 else torch.zeros_like(shift)
        scale = torch.clamp(self.spread * sigma / bins, min=torch.finfo(values.dtype).tiny)
        codes = torch.clamp(torch.round(centred / scale + bins // 2), 0, bins - 1).to(torch.int64)
        hits = torch.zeros(bins, dtype=values.dtype, device=values.device).scatter_add_(
            0, codes.reshape(-1), torch.ones_like(centred).reshape(-1)
        )
        sums = torch.zeros_like(hits).scatter_add_(0, codes.reshape(-1), centred.reshape(-1))
        table = sums / hits.clamp(min=1) + shift  # each code's mean value (an empty bin decodes to the shift)
        return idx, codes.to(torch.uint8), table

    def values(self, codes: Tensor, table: Tensor) -> Tensor:
        """The kept values a payload stands for."""
        return codes if table.numel() == 0 else table[codes.to(torch.int64)]

    def decompress(self, payload: tuple[Tensor, Tensor, Tensor], like: Tensor) -> Tensor:
        idx, codes, table = payload
        tiles = torch.zeros_like(self.tiles(like))
        tiles = tiles.scatter_(1, idx.to(torch.int64), self.values(codes, table).to(like.dtype))
        return self.untiles(tiles, like.shape)

    # -- several workers ---------------------------------------------------------------
    def mean(self, gathered: tuple[Tensor, Tensor, Tensor], like: Tensor) -> Tensor:
        """The workers' mean of their compressed tensors (`gathered`: each part with a
        leading dim of workers), per entry over the workers that kept it."""
        idx, codes, table = gathered
        values = torch.stack([self.values(c, t) for c, t in zip(codes.unbind(0), table.unbind(0))]).to(like.dtype)
        tiles = self.tiles(like)
        total = torch.zeros_like(tiles)
        count = torch.zeros_like(tiles)
        for i, v in zip(idx.to(torch.int64).unbind(0), values.unbind(0)):
            total = total.scatter_add(1, i, v)
            count = count.scatter_add(1, i, torch.ones_like(v))
        return self.untiles(total / count.clamp(min=1), like.shape)


def _divisor(n: int, most: int) -> int:
    """The largest divisor of `n` that is at most `most`."""
    return max(d for d in range(1, min(n, most) + 1) if n % d == 0) if n else 1
