"""Low-precision state and parameters: stochastic rounding and 8-bit block-quantized
moments (compensated updates for bf16/fp16 params: `_compensated.py`).

Everything here is elementwise, or blockwise over a leaf's flattened elements, so it runs
unchanged on one big flat buffer. The randomness of stochastic rounding is a
counter-based hash of (key, element index) computed with integer tensor ops: the same
bits on CPU and CUDA, eager, compiled or under vmap, and never torch's global RNG, so a
run and its resume from a checkpoint are bitwise identical.

The building blocks with a moment (`scale_by_adam`, `trace`, `scale_by_lion`,
`scale_by_muon`) store it through `init_moments` / `load_moments` / `store_moments`:
the math runs in float32 (or the grads' dtype where wider) and only the stored copy
is narrow.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
import torch.utils._pytree as pytree
from torch import Tensor

from . import _compat as compat
from . import _tree as tr
from ._base import Params

# --------------------------------------------------------------------------- #
# Counter-based random bits.
# --------------------------------------------------------------------------- #

_M32 = 0xFFFFFFFF
# murmur3's 32-bit finalizer constants, taken as negative int64 where >= 2^31: for
# x < 2^32 the product x·c then stays inside int64 (no overflow on any backend) and its
# low 32 bits are those of the unsigned 32-bit product.
_C1 = 0x85EBCA6B - (1 << 32)
_C2 = 0xC2B2AE35 - (1 << 32)
_C1_INT32, _C2_INT32 = _C1, _C2  # the same bits as int32 (both are below 2^31 in magnitude)


def _mix32(x: Any) -> Any:
    """murmur3's finalizer on uint32 values held in int64 tensors (or Python ints)."""
    x = x ^ (x >> 16)
    x = (x * _C1) & _M32
    x = x ^ (x >> 13)
    x = (x * _C2) & _M32
    return x ^ (x >> 16)


def leaf_key(count: Tensor, leaf: int, salt: int = 0) -> Tensor:
    """A 0-d int64 key for leaf number `leaf` at update `count` (`salt` tells uses apart)."""
    return _mix32((count & _M32) ^ _mix32((salt << 24) + leaf))


def _int32(x: Tensor) -> Tensor:
    """uint32 values held in int64, as the int32s with the same bits."""
    return (((x & _M32) ^ 0x80000000) - 0x80000000).to(torch.int32)


def leaf_seed(key: Tensor | int, device: torch.device | None = None) -> Tensor:
    """The 0-d int32 seed that `key` gives the per-element hash.

    Compute it once per leaf and pass it (`seed=`) to every rounding of that leaf: a
    compiled graph then computes the per-element hash once for all of them (two seeds
    computed apart from one key are two buffers to inductor, which then hashes twice).
    """
    return _int32(_mix32(torch.as_tensor(key, dtype=torch.int64, device=device) & _M32))


def _random_bits(x: Tensor, key: Tensor | int | None = None, *, seed: Tensor | None = None) -> Tensor:
    """32 random bits per element of `x` (int32, x's shape), a hash of (key, element index)
    (`seed`: `leaf_seed(key)`, computed once).

    The per-element work is int32, whose products wrap on every backend (CPU vector
    units, CUDA, Triton) and which CPUs without AVX-512 multiply natively, unlike int64;
    `>>` on int32 is arithmetic, so each shift is masked to a logical one. Leaves of more
    than 2^32 elements reuse the bits every 2^32 elements, which leaves each rounding
    unbiased.
    """
    n = x.numel()
    index = torch.arange(n, device=x.device, dtype=torch.int32 if n < 2**31 else torch.int64)
    index = index.to(torch.int32).view(x.shape)
    if seed is None:
        assert key is not None, "a key or a seed"
        seed = leaf_seed(key, x.device)
    h = (index ^ seed) * _C1_INT32
    h = h ^ ((h >> 15) & 0x1FFFF)
    h = h * _C2_INT32
    return h ^ ((h >> 16) & 0xFFFF)


# --------------------------------------------------------------------------- #
# Stochastic rounding.
# --------------------------------------------------------------------------- #

_FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)
_NARROW = (torch.bfloat16, torch.float16) + _FP8


def _bit_views() -> bool:
    """Whether float32 <-> int32 bit views may run here: not under vmap on a torch without
    their batching rule (`compat.VMAP_BITCASTS`), where the same roundings run arithmetically.
    Compiled code takes the bit views (Dynamo before 2.12 reports a functorch level while it
    traces any function, so `under_vmap` cannot tell there)."""
    return compat.VMAP_BITCASTS or torch.compiler.is_compiling() or not compat.under_vmap()


def _pow2(k: Tensor) -> Tensor:
    """2^k as float32, exactly, for int32 k in [-126, 127] (built from the exponent bits)."""
    if not _bit_views():
        return torch.exp2(k.to(torch.float32))
    return ((k + 127) << 23).view(torch.float32)


def _exponent(x: Tensor) -> Tensor:
    """e with x = m·2^e, |m| in [0.5, 1), as int32 (float32 x; below the normal range, and
    for 0, inf and NaN, a value every caller clamps or never reads)."""
    if not _bit_views():
        return torch.frexp(x)[1].to(torch.int32)
    return ((x.view(torch.int32) >> 23) & 0xFF) - 126


def round_to_bf16(x: Tensor) -> Tensor:
    """float32 `x` rounded to bf16's values (to nearest, ties to even), kept in float32: what
    `x.to(torch.bfloat16).to(torch.float32)` gives, in integer bit operations compiled code
    cannot fuse away (inductor before 2.12 drops such a cast round trip after a matmul)."""
    return _round_bf16(x, None)


def _round_bf16(x: Tensor, bits: Tensor | None) -> Tensor:
    # bf16 is float32's upper half: adding 16 uniform bits below the cut and truncating
    # rounds up with probability exactly (dropped bits) / 2^16; adding 0x7FFF plus the
    # lowest kept bit rounds to nearest, ties to even.
    if not _bit_views():
        return _round_bf16_arithmetic(x, bits)
    b = x.view(torch.int32)
    noise = ((b >> 16) & 1) + 0x7FFF if bits is None else bits
    rounded = ((b + noise) & -65536).view(torch.float32)
    return torch.where(torch.isfinite(x), rounded, x)


def _round_bf16_arithmetic(x: Tensor, bits: Tensor | None) -> Tensor:
    # The same rounding without bit views: |x| = (below + dropped / 2^16)·spacing with
    # spacing bf16's in x's binade (fixed below the normal range), exact in float64; it
    # rounds up when bits + dropped reaches 2^16, as the carry out of the dropped bits does.
    if bits is None:
        return torch.where(torch.isfinite(x), x.to(torch.bfloat16).to(torch.float32), x)
    magnitude = x.abs().to(torch.float64)
    exponent = torch.clamp(torch.frexp(x)[1], min=-125).to(torch.float64)
    spacing = torch.pow(torch.full_like(magnitude, 2.0), exponent - 8)
    scaled = magnitude / spacing
    below = torch.floor(scaled)
    up = bits.to(torch.float64) + (scaled - below) * 65536 >= 65536
    rounded = torch.copysign(((below + up.to(torch.float64)) * spacing).to(torch.float32), x)
    return torch.where(torch.isfinite(x), rounded, x)


def _round_grid(x: Tensor, dtype: torch.dtype, bits: Tensor | None) -> Tensor:
    # Any narrower float format: the representable neighbours of x are multiples of the
    # format's spacing in x's binade; round up with probability (x - below) / spacing,
    # or to nearest (ties to even) without bits.
    info = torch.finfo(dtype)
    mantissa = round(-math.log2(info.eps))  # stored mantissa bits
    emin = round(math.log2(info.tiny))  # exponent of the smallest normal
    if dtype in _FP8:
        x = x.clamp(-info.max, info.max)  # fp8 saturates (e4m3fn has no inf)
    exponent = _exponent(x)  # x = m·2^exponent, |m| in [0.5, 1)
    exponent = torch.clamp(exponent, min=emin + 1)  # below the normal range the spacing stays fixed
    scaled = x * _pow2(mantissa + 1 - exponent)  # x / spacing, exact
    below = torch.floor(scaled)
    frac = scaled - below
    if bits is None:
        up = (frac > 0.5) | ((frac == 0.5) & (torch.remainder(below, 2) == 1))
    else:
        up = (bits.to(torch.float32) + 0.5) * (1.0 / 65536) < frac
    return (below + up.to(torch.float32)) * _pow2(exponent - mantissa - 1)


def round_to(
    x: Tensor, dtype: torch.dtype, key: Tensor | int | None = None, half: int = 0, *, seed: Tensor | None = None
) -> Tensor:
    """`x` rounded to `dtype`: stochastically with `key` or its `seed` (`leaf_seed(key)`)
    (using the low or high 16 bits of its hash, `half` 0 or 1, so two moments of one leaf
    share one hash), else to nearest (ties to even).

    Computed with integer and exact power-of-two ops, so inductor cannot skip the
    rounding when it fuses this with later float32 math (it may skip a plain `.to()`
    round trip: `emulate_precision_casts` is off by default).
    """
    x32 = x.to(torch.float32)
    random = key is not None or seed is not None
    bits = (_random_bits(x32, key, seed=seed) >> (16 * half)) & 0xFFFF if random else None
    y = _round_bf16(x32, bits) if dtype == torch.bfloat16 else _round_grid(x32, dtype, bits)
    return y.to(dtype)


def stochastic_round(x: Tensor, dtype: torch.dtype, key: Tensor | int) -> Tensor:
    """`x` rounded to `dtype` up or down at random, unbiased: E[round(x)] = x.

    x lies between two neighbours a < b of `dtype`; it becomes b with probability
    (x - a) / (b - a). The random bits are a hash of `key` and each element's index,
    so the same (x, key) gives the same result on every run, device and under
    `torch.compile` or `vmap`; draw a fresh key per update (the building blocks use
    their step count).

    Args:
      x: a float tensor (float64 is first rounded to float32 to nearest).
      dtype: torch.bfloat16, torch.float16, torch.float8_e4m3fn or torch.float8_e5m2
        (fp8 saturates at its largest finite value).
      key: a 0-d int64 tensor or an int.

    Examples:
        >>> import torch, purestep.core as ps
        >>> x = torch.full((100_000,), 1.0 + 2**-10)  # a quarter of the way from 1 to the next bf16
        >>> r = ps.stochastic_round(x, torch.bfloat16, key=0)
        >>> sorted(r.unique().tolist()), round(r.float().mean().item(), 4)
        ([1.0, 1.0078125], 1.001)
    """
    if dtype not in _NARROW:
        raise ValueError(f"dtype must be one of {_NARROW} for stochastic rounding, got {dtype!r}")
    return round_to(x, dtype, key)


# --------------------------------------------------------------------------- #
# 8-bit block quantization.
# --------------------------------------------------------------------------- #

BLOCK_SIZE = 256  # elements per scale, as bitsandbytes' and torchao's 8-bit optimizers
MIN_QUANTIZED_SIZE = 4096  # smaller leaves stay float32 (bitsandbytes' min_8bit_size)


class QuantizedTensor(NamedTuple):
    """A tensor stored as 8-bit float codes times one float32 scale per block of 256 elements.

    Element i is `codes.flatten()[i] · scale[i // 256]`; each block's scale maps its
    largest magnitude onto the codes' largest finite value (448 for float8_e4m3fn).
    `quantize_blockwise` builds one, `dequantize_blockwise` reads it back.
    """

    codes: Tensor  # the tensor's shape, float8_e4m3fn or float8_e5m2
    scale: Tensor  # (ceil(numel / 256),), float32


def _blocks(flat: Tensor) -> Tensor:
    """A flat tensor zero-padded to whole blocks, as (blocks, BLOCK_SIZE)."""
    pad = -flat.numel() % BLOCK_SIZE
    return F.pad(flat, (0, pad)).view(-1, BLOCK_SIZE)


def quantize_blockwise(
    x: Tensor, dtype: torch.dtype = torch.float8_e4m3fn, *, key: Tensor | int | None = None, half: int = 0
) -> QuantizedTensor:
    """`x` as 8-bit float codes with a float32 absmax scale per block of 256 elements.

    The error of each element is at most half a code spacing of its block: relative to
    the block's absmax, 2⁻⁴ (e4m3) or 2⁻³ (e5m2) for the largest values, finer below.
    With `key`, codes are rounded stochastically (unbiased) instead of to nearest.

    Examples:
        >>> import torch, purestep.core as ps
        >>> x = torch.linspace(-1, 1, 1000)
        >>> q = ps.quantize_blockwise(x)
        >>> q.codes.dtype, tuple(q.scale.shape), bool((ps.dequantize_blockwise(q) - x).abs().max() < 2**-4)
        (torch.float8_e4m3fn, (4,), True)
    """
    if dtype not in _FP8:
        raise ValueError(f"dtype must be torch.float8_e4m3fn or torch.float8_e5m2, got {dtype!r}")
    return _quantize(x, dtype, None if key is None else leaf_seed(key, x.device), half)


def _quantize(x: Tensor, dtype: torch.dtype, seed: Tensor | None, half: int) -> QuantizedTensor:
    fmax = torch.finfo(dtype).max
    blocks = _blocks(x.reshape(-1).to(torch.promote_types(x.dtype, torch.float32)))  # (blocks, 256)
    scale = blocks.abs().amax(dim=1) / fmax  # (blocks,)
    y = blocks / torch.where(scale > 0, scale, torch.ones_like(scale))[:, None]
    codes = round_to(y, dtype, half=half, seed=seed) if seed is not None else y.clamp(-fmax, fmax).to(dtype)
    return QuantizedTensor(codes.view(-1)[: x.numel()].view(x.shape), scale.to(torch.float32))


def dequantize_blockwise(q: QuantizedTensor, dtype: torch.dtype = torch.float32) -> Tensor:
    """The tensor a `QuantizedTensor` stands for, in `dtype` (shaped like its codes)."""
    blocks = _blocks(q.codes.reshape(-1).to(dtype)) * q.scale.to(dtype)[:, None]
    return blocks.view(-1)[: q.codes.numel()].view(q.codes.shape)


# --------------------------------------------------------------------------- #
# Moments stored in a chosen dtype (used by the scale_by_* building blocks).
# --------------------------------------------------------------------------- #

STATE_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16) + _FP8
ROUNDINGS = ("stochastic", "nearest")


def check_state_dtype(name: str, dtype: Any) -> None:
    """Refuse a state dtype that is neither None nor one the moments can be stored in."""
    if dtype is not None and dtype not in STATE_DTYPES:
        names = ", ".join(str(d) for d in STATE_DTYPES)
        raise ValueError(
            f"{name} must be None (the param's dtype; float32 for float16 params) or one of {names} "
            f"(fp8 means 8-bit block-quantized), got {dtype!r}"
        )


def check_rounding(rounding: Any) -> None:
    if rounding not in ROUNDINGS:
        raise ValueError(f"rounding must be 'stochastic' or 'nearest', got {rounding!r}")


def check_stored(name: str, dtype: Any, rounding: Any) -> None:
    """The arguments of a state kept in a chosen dtype (`name`), and how it is rounded there."""
    check_state_dtype(name, dtype)
    check_rounding(rounding)


def check_moments(mu_dtype: Any, nu_dtype: Any, rounding: Any) -> None:
    """The arguments of an optimizer keeping two moments: their dtypes and the rounding."""
    check_state_dtype("mu_dtype", mu_dtype)
    check_stored("nu_dtype", nu_dtype, rounding)


def _is_quantized(x: Any) -> bool:
    return isinstance(x, QuantizedTensor)


def _compute_dtype(*dtypes: torch.dtype) -> torch.dtype:
    out = torch.float32
    for d in dtypes:
        if d.is_floating_point and d.itemsize >= 4:
            out = torch.promote_types(out, d)
    return out


def unpackable(*dtypes: torch.dtype | None) -> str | None:
    """Why state stored in `dtypes` cannot live in flat buffers (`Needs.flat`), or None: 8-bit
    blocks would straddle the leaves of a buffer, and a per-block scale cannot be viewed per leaf."""
    return "8-bit block-quantized state is laid out per leaf" if any(d in _FP8 for d in dtypes) else None


def init_moments(params: Params, dtype: torch.dtype | None) -> Params:
    """Zero moments like `params`, stored in `dtype`.

    None keeps each param's dtype, except float16 (its range cannot hold a second
    moment: g² underflows below 6e-8), which gets float32. An fp8 dtype stores
    `QuantizedTensor`s, and leaves under `MIN_QUANTIZED_SIZE` elements in float32.
    """

    def zeros(p: Tensor) -> Any:
        if not p.is_floating_point():
            return torch.zeros_like(p)
        d = dtype if dtype is not None else (torch.float32 if p.dtype == torch.float16 else p.dtype)
        if d not in _FP8:
            return torch.zeros_like(p, dtype=d)
        if p.numel() < MIN_QUANTIZED_SIZE:
            return torch.zeros_like(p, dtype=_compute_dtype(p.dtype))
        blocks = -(-p.numel() // BLOCK_SIZE)
        return QuantizedTensor(torch.zeros_like(p, dtype=d), torch.zeros(blocks, dtype=torch.float32, device=p.device))

    return pytree.tree_map(zeros, params)


def load_moments(
    grads: Any, moments: Any, params: Any = None, *, second: bool = False
) -> tuple[list[Tensor], list[Tensor], list[Tensor]]:
    """`(grads, grads in the compute dtype, moments in the compute dtype)`, as leaf lists.

    Checks that `grads` matches the moments leaf for leaf (structure and shapes), and
    `params` when given (dtypes too). The compute dtype of a leaf is float32, or the
    grad's (or stored moment's) dtype where wider. `second` marks a second moment
    (stored as its square root when 8-bit).
    """
    stored, spec = pytree.tree_flatten(moments, is_leaf=_is_quantized)
    like = pytree.tree_unflatten([m.codes if _is_quantized(m) else m for m in stored], spec)
    gs = tr.check_match(grads, like, "grads", "params", dtype=False)
    if params is not None:
        tr.check_match(grads, params, "grads", "params")
    wide, xs = [], []
    for g, m in zip(gs, stored):
        if not g.is_floating_point():
            wide.append(g)
            xs.append(m)
            continue
        cd = _compute_dtype(g.dtype, m.codes.dtype if _is_quantized(m) else m.dtype)
        wide.append(g.to(cd))
        if _is_quantized(m):
            x = dequantize_blockwise(m, cd)
            xs.append(x * x if second else x)
        else:
            xs.append(m.to(cd))
    return gs, wide, xs


def moment_keys(count: Tensor, rounding: str, *moments: Any) -> list[Tensor] | None:
    """The stochastic-rounding seeds (`leaf_seed(leaf_key(count, i))`) of the leaves of
    `moments` (trees like the params) at update `count`; None when nothing is rounded
    stochastically (nearest, or no narrow leaf).

    A block computes them once and passes them to every `store_moments` call, so a first
    and a second moment of one leaf share one per-element hash (compiled, it is computed once).
    """
    stored = [pytree.tree_leaves(m, is_leaf=_is_quantized) for m in moments]
    narrow = any(_is_quantized(m) or m.dtype in _NARROW for leaves in stored for m in leaves)
    if rounding != "stochastic" or not narrow:
        return None
    return [leaf_seed(leaf_key(count, i)) for i in range(len(stored[0]))]


def store_moments(xs: list[Tensor], moments: Any, keys: list[Tensor] | None, *, second: bool = False) -> Any:
    """New moments `xs` (compute dtype) stored like `moments`: narrowing rounds
    stochastically with the seeds `keys` (from `moment_keys`), else to nearest; a `second`
    moment takes the other 16 bits of each hash."""
    stored, spec = pytree.tree_flatten(moments, is_leaf=_is_quantized)
    half = int(second)
    out: list[Any] = []
    for i, (x, m) in enumerate(zip(xs, stored)):
        seed = None if keys is None else keys[i]
        if _is_quantized(m):
            out.append(_quantize(torch.sqrt(x) if second else x, m.codes.dtype, seed, half))
        elif x.dtype == m.dtype:
            out.append(x)
        elif seed is not None and m.dtype in _NARROW:
            out.append(round_to(x, m.dtype, half=half, seed=seed))
        else:
            out.append(x.to(m.dtype))
    return pytree.tree_unflatten(out, spec)


# --------------------------------------------------------------------------- #
# bf16/fp16 params without drift.
