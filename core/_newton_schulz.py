"""Orthogonalization of matrices by Newton-Schulz iterations (Muon's quintic, or Polar
Express's schedule of quintics), batched over same-shape matrices and batch dims."""

from __future__ import annotations

import math
from typing import Any, Sequence, Union

import torch
from torch import Tensor

from ._low_precision import round_to_bf16


# torch.optim.Muon's quintic Newton-Schulz coefficients (from Keller Jordan's Muon), used every iteration.
NS5_COEFFICIENTS = (3.4445, -4.7750, 2.0315)

# Polar Express (Amsel et al. 2025), one quintic per iteration, with the 2% safety factor
# that modded-nanogpt applies (its spectral-norm bound is ‖X‖_F·1.02). Iterations past the
# table repeat the last polynomial, as the paper's reference code does.
POLAR_EXPRESS_COEFFICIENTS = (
    (8.156554524902461, -22.48329292557795, 15.878769915207462),
    (4.042929935166739, -2.808917465908714, 0.5000178451051316),
    (3.8916678022926607, -2.772484153217685, 0.5060648178503393),
    (3.285753657755655, -2.3681294933425376, 0.46449024233003106),
    (2.3465413258596377, -1.7097828382687081, 0.42323551169305323),
)
_POLAR_EXPRESS_SAFETY = 1.02

Coefficients = Union[str, Sequence[float], Sequence[Sequence[float]]]
_ADJUST_LR = ("original", "match_rms_adamw")


# --------------------------------------------------------------------------- #
# Orthogonalization.
# --------------------------------------------------------------------------- #


def _is_triple(c: Any) -> bool:
    return (
        isinstance(c, (tuple, list))
        and len(c) == 3
        and all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) for v in c)
    )


def _coefficient_schedule(
    ns_coefficients: Coefficients, ns_steps: int
) -> tuple[list[tuple[float, float, float]], float]:
    """The (a, b, c) of every iteration, and the safety factor of the initial normalization."""
    table: Any
    if isinstance(ns_coefficients, str):
        if ns_coefficients != "polar_express":
            raise ValueError(
                f"ns_coefficients must be (a, b, c), a sequence of (a, b, c) per iteration or "
                f"'polar_express', got {ns_coefficients!r}"
            )
        table, safety = POLAR_EXPRESS_COEFFICIENTS, _POLAR_EXPRESS_SAFETY
    elif _is_triple(ns_coefficients):
        table, safety = (tuple(ns_coefficients),), 1.0
    elif isinstance(ns_coefficients, (tuple, list)) and ns_coefficients and all(_is_triple(c) for c in ns_coefficients):
        table, safety = tuple(tuple(c) for c in ns_coefficients), 1.0
    else:
        raise ValueError(
            f"ns_coefficients must be (a, b, c), a sequence of (a, b, c) per iteration or "
            f"'polar_express', got {ns_coefficients!r}"
        )
    steps = [tuple(float(v) for v in table[min(i, len(table) - 1)]) for i in range(ns_steps)]
    return steps, safety  # type: ignore[return-value]  # triples, checked above


def _orthogonalize_batch(
    x: Tensor,  # (N, m, n) with m <= n, in the Newton-Schulz dtype (or float32 holding bf16 values)
    coefficients: list[tuple[float, float, float]],
    safety: float,
    eps: float,
    round_to: torch.dtype | None = None,
) -> Tensor:
    """N matrices orthogonalized together: X ← a·X + (b·A + c·A²)·X with A = X·Xᵀ.

    With `round_to`, x is float32 and every result is rounded to `round_to` (bf16), which
    is what a bf16 matmul with float32 accumulation computes, at float32 matmul speed.
    """
    # bf16 rounding in integer bit operations: compiled code keeps it (inductor before 2.12
    # fuses a cast round trip after a matmul away, `compat.EMULATES_PRECISION_CASTS`).
    r = (
        (lambda t: t)
        if round_to is None
        else round_to_bf16
        if round_to == torch.bfloat16
        else (lambda t: t.to(round_to).to(t.dtype))
    )  # noqa: E731
    norm = r(torch.linalg.vector_norm(x, dim=(-2, -1), keepdim=True))  # (N, 1, 1)
    if safety != 1.0:
        norm = r(norm * safety)
    x = r(x / norm.clamp(min=eps))  # spectral norm <= Frobenius norm <= 1
    for a, b, c in coefficients:
        gram = r(x @ x.mT)  # (N, m, m)
        poly = r(torch.baddbmm(gram, gram, gram, beta=b, alpha=c))  # b·A + c·A²
        x = r(torch.baddbmm(x, poly, x, beta=a))  # a·X + poly·X
    return x


def _cpu_has_bf16_matmul() -> bool:
    """Whether this CPU multiplies bf16 natively (AVX512-BF16 or AMX). Without, bf16 matmuls run
    7-400x slower than float32 ones, so Muon emulates its bf16 iterations by default (see
    `scale_by_muon`'s `emulate_bf16`)."""
    cpu = getattr(torch, "cpu", None)
    ask = lambda name, default: getattr(cpu, name, lambda: default)()  # noqa: E731
    return bool(ask("_is_avx512_bf16_supported", True) or ask("_is_amx_tile_supported", False))


# A hardware fact, asked once at import: torch.compile cannot trace the query itself.
CPU_BF16_MATMUL = _cpu_has_bf16_matmul()


def orthogonalize_leaves(
    xs: list[Tensor],
    coefficients: list[tuple[float, float, float]],
    safety: float,
    eps: float,
    dtype: torch.dtype,
    emulate_bf16: bool | None = None,
    lead: Sequence[int] | None = None,
) -> list[Tensor]:
    """Each leaf orthogonalized as matrices: a leaf of shape (*B, A, *rest) with `lead[i]` =
    len(B) leading dims is prod(B) matrices of A × prod(rest) (0: one matrix; a (k, *shape)
    stack of `_layout.stacked` has one more, `batch_dims` more still). Matrices of one shape
    (or its transpose) share one batched matmul per iteration; results come back in each
    leaf's shape and dtype. `emulate_bf16` as `scale_by_muon`'s (None: on CPUs without bf16
    matmul units)."""
    lead = lead or [0] * len(xs)
    mats: list[Tensor] = []  # each (k, rows, cols) with rows <= cols
    flipped: list[bool] = []
    groups: dict[tuple, list[int]] = {}
    for i, (x, b) in enumerate(zip(xs, lead)):
        b = int(b)
        # Explicit sizes, not -1: an empty block of rows (a rank's share of a short matrix) reshapes too.
        m = x.reshape(math.prod(x.shape[:b]), x.shape[b], math.prod(x.shape[b + 1 :]))
        flipped.append(m.shape[1] > m.shape[2])
        mats.append(m.mT if flipped[-1] else m)
        # DTensors batch with the same mesh and placements only (whole DTensors, the per-leaf path).
        layout = (x.device_mesh, tuple(x.placements)) if hasattr(x, "device_mesh") else None  # type: ignore[attr-defined]
        groups.setdefault((tuple(mats[-1].shape[1:]), m.device, layout), []).append(i)
    out: list[Tensor | None] = [None] * len(xs)
    for (_, device, _), idx in groups.items():
        round_to = None
        emulate = emulate_bf16 if emulate_bf16 is not None else device.type == "cpu" and not CPU_BF16_MATMUL
        if dtype == torch.bfloat16 and emulate:
            round_to = dtype  # float32 holding bf16 values (rounded by bit operations: compiled code keeps them)
        as_bf16 = round_to is not None and all(mats[i].dtype == torch.float32 for i in idx)
        parts = [mats[i] if as_bf16 else mats[i].to(dtype) for i in idx]
        batch = parts[0] if len(parts) == 1 else torch.cat(parts)  # (N, rows, cols)
        if round_to is not None:
            batch = round_to_bf16(batch) if as_bf16 else batch.float()
        result = _orthogonalize_batch(batch, coefficients, safety, eps, round_to)
        for i, o in zip(idx, result.split([mats[i].shape[0] for i in idx])):
            o = o.mT if flipped[i] else o
            out[i] = o.reshape(xs[i].shape).to(xs[i].dtype)
    return out  # type: ignore[return-value]
