"""NorMuon: Muon's orthogonalized momentum, normalized per neuron by a second moment.

The update rule is written once, on `normuon` below; `scale_by_normuon` is the block.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import torch
import torch.utils._pytree as pytree
from torch import Tensor

from .engine import ops as lay
from . import _foreach as ls
from . import _low_precision as lp
from ._base import (
    Params,
    ScalarOrSchedule,
    Transform,
    check_hyperparam,
    check_nonnegative,
    check_positive,
    leaf_device,
    resolve,
    zero_count,
)
from ._combine import chain
from ._weight_decay import add_decayed_weights
from ._muon import _check_matrices, batch_rule, beside_adamw, check_muon_args, leaf_batch_dims, muon_labels
from ._newton_schulz import NS5_COEFFICIENTS, Coefficients, _coefficient_schedule, orthogonalize_leaves
from .engine.dtensor import is_dtensor
from ._blocks import scale_by_lr
from .engine.needs import Needs, with_needs

_NS_EPS = 1e-7  # the Newton-Schulz normalization's, as scale_by_muon's default


class ScaleByNorMuonState(NamedTuple):
    """State of `scale_by_normuon`: the momentum (like the params) and, per matrix, the
    second moment of each row (neuron) of the orthogonalized update, (rows,) in float32
    (float64 for float64 params)."""

    count: Tensor  # type: ignore[assignment]  # (), int64
    mu: Params
    nu: Params


def _wide(dtype: torch.dtype) -> torch.dtype:
    """float32 for low-precision leaves, float64 for float64 ones: the normalization's dtype."""
    return torch.promote_types(dtype, torch.float32)


def _row_zeros(p: Any, lead: int) -> Tensor:
    """Zeros, one per row of each matrix of `p` (`lead` leading dims index the matrices:
    (k, rows) for a stack of k), in the normalization's dtype; for an FSDP2 param (a
    DTensor sharded on its rows or matrices, FSDP's strided rows over TP's included) sharded
    the same way, so that each rank keeps its rows; a split of the columns (TP's rowwise
    weights) is not one of v's: each rank holds all rows there."""
    shape, dtype = p.shape[: 1 + lead], _wide(p.dtype)
    if not is_dtensor(p):
        return torch.zeros(shape, dtype=dtype, device=p.device)
    from torch.distributed.tensor import Replicate, Shard, zeros
    from torch.distributed.tensor.placement_types import _StridedShard

    rows = [q if isinstance(q, (Shard, _StridedShard)) and q.dim <= lead else Replicate() for q in p.placements]
    return zeros(shape, dtype=dtype, device_mesh=p.device_mesh, placements=rows)


def scale_by_normuon(
    momentum: ScalarOrSchedule = 0.95,
    beta2: ScalarOrSchedule = 0.95,
    nesterov: bool = True,
    ns_steps: int = 5,
    *,
    ns_coefficients: Coefficients = NS5_COEFFICIENTS,
    ns_dtype: torch.dtype = torch.bfloat16,
    eps: float = 1e-10,
    adjust_lr: str = "match_rms_adamw",
    emulate_bf16: bool | None = None,
    batch_dims: Any = 0,
    mu_dtype: torch.dtype | None = None,
    rounding: str = "stochastic",
) -> Transform:
    """NorMuon's normalized, orthogonalized momentum; see `normuon` for the rule and
    `adjust_lr`, `adam` for `mu_dtype` and `rounding` (the momentum's storage; the per-row
    second moment is small and stays float32).

    Every leaf must have >= 2 dims; a leaf of shape (A, ...) is an A × prod(rest) matrix
    whose A rows are the neurons. The second moment is per row: on flat buffers it is
    (k, A) for a stack of k same-shape matrices, which run batched as Muon's do. Under
    FSDP2 each matrix is orthogonalized once, on its owner rank, as Muon's; each rank keeps
    the rows of v it holds (a DTensor sharded like the param's rows) and the norm of Ô is
    summed across ranks. `batch_dims` as `scale_by_muon`'s: each of a leaf's matrices has its
    own rows' v and its own norm (under FSDP2 such leaves run on whole DTensors).

    Examples:
        >>> import torch, purestep.core as ps
        >>> t = ps.scale_by_normuon(ns_dtype=torch.float32)
        >>> g = {"w": torch.eye(3)}
        >>> u, s = t.update(g, t.init(g))
        >>> tuple(s.nu["w"].shape), round(float(u["w"].square().mean().sqrt()), 3)
        ((3,), 0.2)
    """
    for name, value in (("momentum", momentum), ("beta2", beta2)):
        check_hyperparam(name, value)
        check_nonnegative(name, value)
    check_muon_args(ns_steps, ns_coefficients, ns_dtype, "original", _NS_EPS)
    check_positive("eps", eps)
    if adjust_lr not in ("match_rms_adamw", "original"):
        raise ValueError(
            f"adjust_lr must be 'match_rms_adamw' (the paper's RMS 0.2) or 'original' (the authors' "
            f"code: O's norm kept, then max(1, A/B)^0.5), got {adjust_lr!r}"
        )
    lp.check_stored("mu_dtype", mu_dtype, rounding)
    coefficients, safety = _coefficient_schedule(ns_coefficients, ns_steps)
    if emulate_bf16 is not None and not isinstance(emulate_bf16, bool):
        raise ValueError(f"emulate_bf16 must be True, False or None, got {emulate_bf16!r}")

    def leads(tree: Any, what: str) -> list[int]:
        _check_matrices(tree, what)
        batch = leaf_batch_dims(tree, batch_dims)  # over shards a batched leaf's row blocks are whole matrices
        return [int(k) + b for k, b in zip(lay.stacked(tree), batch)]

    def init(params: Params) -> ScaleByNorMuonState:
        lead = leads(params, "params")
        leaves, spec = pytree.tree_flatten(params)
        mu = lp.init_moments(params, mu_dtype)
        nu = [_row_zeros(p, b) for p, b in zip(leaves, lead)]
        return ScaleByNorMuonState(zero_count(leaf_device(leaves)), mu, pytree.tree_unflatten(nu, spec))

    def update(grads, state, params=None, **extra):
        lead = leads(grads, "grads")
        gs, wide, mu = lp.load_moments(grads, state.mu, params)
        spec = pytree.tree_structure(grads)
        nu = pytree.tree_leaves(state.nu)
        beta, b2 = resolve(momentum, state.count), resolve(beta2, state.count)
        mu = ls.cast_like(ls.ema(mu, wide, beta), wide)  # m ← β·m + (1-β)·g
        src = ls.cast_like(ls.ema(wide, mu, 1.0 - beta), wide) if nesterov else mu  # m̃ = (1-β)·g + β·m
        batch = [b - int(k) for b, k in zip(lead, lay.stacked(grads))]

        def orthogonal(mats: list[Tensor], lead: list[int]) -> list[Tensor]:
            # On whole matrices (over FSDP2 shards: once, on each matrix's owner rank).
            return orthogonalize_leaves(mats, coefficients, safety, _NS_EPS, ns_dtype, emulate_bf16, lead)

        # Everything after the orthogonalization is per row, but the norm: on FSDP2 shards
        # each rank normalizes its rows and `leaf_norms` sums the squares across ranks.
        shapes = lay.global_shapes(grads)  # the whole matrix (a stack's member)
        orth, normed, new_nu = [], [], []
        os_ = lay.map_matrices(grads, orthogonal, src, batch_dims=batch)
        # Σ_cols O² per row of each whole matrix (a row split over TP ranks: summed across them)
        row_sq = lay.row_sums(grads, [o.to(_wide(o.dtype)).square() for o in os_], lead)
        for o, v, b, sq, full in zip(os_, nu, lead, row_sq, shapes):
            n, rows, cols = math.prod(o.shape[:b]), o.shape[b], math.prod(o.shape[b + 1 :])
            o2 = o.reshape(n, rows, cols).to(_wide(o.dtype))  # a stack's (or batch's) matrices, or one
            whole_cols = math.prod(full[b - (len(o.shape) - len(full)) + 1 :])  # the whole matrix's columns
            v = v.reshape(n, rows) * b2 + sq.reshape(n, rows) / whole_cols * (
                1.0 - b2
            )  # v ← β₂·v + (1-β₂)·mean_cols(O²)
            normed.append((o2 / (v.sqrt() + eps).unsqueeze(2)).reshape(o.shape))  # Ô = O / (√v + ε), per row
            if adjust_lr == "original":
                orth.append(o2.reshape(o.shape))  # O's norm, kept by the authors' code
            new_nu.append(v.reshape(o.shape[: 1 + b]))
        # Per whole matrix: its norms (a stack's (k, 1, ...); over shards summed across ranks)
        # and its size A × B; a leaf with batch dims holds several matrices, normed one by one.
        o_norms, normed_norms = lay.leaf_norms(grads, orth if orth else normed, normed)
        dims = []
        for i, (x, b, extra, full) in enumerate(zip(normed, lead, batch, shapes)):
            if extra:  # a norm per matrix: over its dims, keeping the batch dims (no flatten: a DTensor's too)
                matrix_norm = lambda y: torch.linalg.vector_norm(y, dim=tuple(range(b, y.dim())), keepdim=True)  # noqa: E731
                normed_norms[i] = matrix_norm(x)
                if orth:
                    o_norms[i] = matrix_norm(orth[i])
            a = full[extra]
            dims.append((a, math.prod(full[extra + 1 :])))
        if adjust_lr == "match_rms_adamw":  # η̂ = 0.2·√(AB)/‖Ô‖: RMS 0.2, as AdamW's
            scales = [0.2 * math.sqrt(a * c) / (norm + eps) for norm, (a, c) in zip(normed_norms, dims)]
        else:  # the authors' code: ‖O‖/‖Ô‖ keeps O's norm, then Muon's max(1, A/B)^0.5
            scales = [
                o_norm / (norm + eps) * max(1.0, a / c) ** 0.5
                for o_norm, norm, (a, c) in zip(o_norms, normed_norms, dims)
            ]
        out = [(x * scale).to(g.dtype) for x, scale, g in zip(normed, scales, gs)]
        mu_tree = lp.store_moments(mu, state.mu, lp.moment_keys(state.count, rounding, state.mu))
        nu_tree = pytree.tree_unflatten(new_nu, pytree.tree_structure(state.nu))
        return pytree.tree_unflatten(out, spec), ScaleByNorMuonState(state.count + 1, mu_tree, nu_tree)

    # Per-matrix math: same-shape matrices stacked; batch dims a per-leaf rule; ν per row.
    rules = (batch_rule(batch_dims),)
    needs = Needs(
        whole_leaves=True,
        rules=rules,
        per_row_state=True,
        reductions=("map_matrices", "leaf_norms", "row_sums"),
        flat=lp.unpackable(mu_dtype),
    )
    return with_needs(Transform(init, update), needs)


def normuon(
    lr: ScalarOrSchedule = 0.02,
    momentum: ScalarOrSchedule = 0.95,
    beta2: ScalarOrSchedule = 0.95,
    nesterov: bool = True,
    ns_steps: int = 5,
    weight_decay: ScalarOrSchedule = 0.0,
    ns_dtype: torch.dtype = torch.bfloat16,
    ns_coefficients: Coefficients = NS5_COEFFICIENTS,
    eps: float = 1e-10,
    *,
    adjust_lr: str = "match_rms_adamw",
    emulate_bf16: bool | None = None,
    batch_dims: Any = 0,
    mu_dtype: torch.dtype | None = None,
    rounding: str = "stochastic",
) -> Transform:
    """NorMuon (Li et al. 2025): Muon with a per-neuron second moment.

    For each matrix W (m × n, a leaf of shape (m, ...) seen as m × prod(rest)):

        m ← β·m + (1-β)·g;   m̃ = (1-β)·g + β·m (nesterov) or m
        O = NS(m̃)                                  Muon's orthogonalization
        v ← β₂·v + (1-β₂)·mean_cols(O²)              one value per row (neuron)
        Ô = O / (√v + ε)                             per row
        W ← W − η·λ·W − η · 0.2·√(mn) / ‖Ô‖_F · Ô

    so every matrix's update has an RMS of 0.2·η, AdamW's (Moonlight's matching), and rows
    whose orthogonalized momentum is large are damped. No bias correction (as the paper).

    Args:
      lr: η. momentum: β. beta2: β₂. nesterov, ns_steps, ns_dtype, ns_coefficients,
        emulate_bf16: as `muon`. weight_decay: λ, decoupled. mu_dtype, rounding: the
        momentum's storage, as `adam`'s (v, one value per row, stays float32).
      eps: ε of the per-row normalization (1e-10, the authors' code).
      batch_dims: leading dims that index separate matrices, as `muon`'s: expert weights
        (E, m, n) with 1 are E matrices, each with its rows' v and its η̂.
      adjust_lr: "match_rms_adamw" (default), the paper's η̂ above. "original" is the
        authors' released code (github.com/zichongli5/NorMuon), which differs from the paper
        here: η̂ = η·‖O‖_F/‖Ô‖_F · max(1, m/n)^0.5 (O's norm kept, then `muon`'s "original"
        scaling), so Muon's lr (0.02) carries over where the default expects AdamW-sized lrs.

    Warning:
        Leaves with fewer than 2 dims raise: use `normuon_adamw`.

    Examples:
        >>> import torch, purestep.core as ps
        >>> opt = ps.normuon(lr=0.1, ns_dtype=torch.float32)
        >>> params = {"w": torch.zeros(2, 2)}
        >>> updates, _ = opt.update({"w": torch.eye(2)}, opt.init(params), params)
        >>> bool(updates["w"].diag().lt(-0.01).all())
        True

    References:
        Li et al., NorMuon: Making Muon more efficient and scalable, 2025 (arXiv 2510.05491).
    """
    check_hyperparam("lr", lr)
    check_nonnegative("lr", lr)
    block = scale_by_normuon(
        momentum,
        beta2,
        nesterov,
        ns_steps,
        ns_coefficients=ns_coefficients,
        ns_dtype=ns_dtype,
        eps=eps,
        adjust_lr=adjust_lr,
        emulate_bf16=emulate_bf16,
        batch_dims=batch_dims,
        mu_dtype=mu_dtype,
        rounding=rounding,
    )
    return chain(block, add_decayed_weights(weight_decay), scale_by_lr(lr))


def normuon_adamw(
    lr: ScalarOrSchedule = 0.02,
    momentum: ScalarOrSchedule = 0.95,
    beta2: ScalarOrSchedule = 0.95,
    nesterov: bool = True,
    ns_steps: int = 5,
    weight_decay: ScalarOrSchedule = 0.01,
    ns_dtype: torch.dtype = torch.bfloat16,
    ns_coefficients: Coefficients = NS5_COEFFICIENTS,
    *,
    adamw_lr: ScalarOrSchedule = 3e-4,
    adamw_betas: tuple[ScalarOrSchedule, ScalarOrSchedule] = (0.9, 0.95),
    adamw_eps: float = 1e-10,
    adamw_weight_decay: ScalarOrSchedule = 0.01,
    labels: Any = muon_labels,
    eps: float = 1e-10,
    adjust_lr: str = "match_rms_adamw",
    emulate_bf16: bool | None = None,
    batch_dims: Any = 0,
    mu_dtype: torch.dtype | None = None,
    nu_dtype: torch.dtype | None = None,
    rounding: str = "stochastic",
) -> Transform:
    """The hybrid of `muon_adamw` with NorMuon on the hidden matrices: `partition({"muon":
    normuon(...), "adamw": adamw(adamw_lr, adamw_betas, adamw_eps, adamw_weight_decay)},
    labels)`, routed by `muon_labels` (embeddings, output head, norms, biases → AdamW).

    `eps`, `adjust_lr` and `batch_dims` (see `muon`) are NorMuon's; `mu_dtype` stores NorMuon's momentum and AdamW's m,
    `nu_dtype` AdamW's v (NorMuon's per-row v stays float32), rounded as `rounding` says (see
    `adam`).

    Examples:
        >>> import torch, purestep.core as ps
        >>> opt = ps.normuon_adamw()
        >>> params = {"h.0.weight": torch.zeros(4, 4), "h.0.bias": torch.zeros(4)}
        >>> sorted(opt.init(params).inner_states["muon"][0].nu)
        ['h.0.weight']
    """
    return beside_adamw(
        normuon(
            lr,
            momentum,
            beta2,
            nesterov,
            ns_steps,
            weight_decay,
            ns_dtype,
            ns_coefficients,
            eps,
            adjust_lr=adjust_lr,
            emulate_bf16=emulate_bf16,
            batch_dims=batch_dims,
            mu_dtype=mu_dtype,
            rounding=rounding,
        ),
        labels,
        adamw_lr,
        adamw_betas,
        adamw_eps,
        adamw_weight_decay,
        mu_dtype=mu_dtype,
        nu_dtype=nu_dtype,
        rounding=rounding,
    )
