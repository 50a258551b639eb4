"""Muon: momentum, then Newton-Schulz (or Polar Express) orthogonalization of each matrix
(`_newton_schulz`): the block, the routing of leaves, and the aliases `muon` and `muon_adamw`."""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import torch
import torch.utils._pytree as pytree
from torch import Tensor

from .engine import ops as lay
from . import _low_precision as lp
from . import _foreach as ls
from . import _tree as tr
from ._base import (
    Params,
    PyTree,
    ScalarOrSchedule,
    Transform,
    check_hyperparam,
    check_int,
    check_nonnegative,
    check_positive,
    leaf_device,
    resolve,
    zero_count,
)
from ._combine import chain, partition
from ._weight_decay import decayed, param_kind
from ._alias import adamw
from ._blocks import scale_by_lr
from .engine.needs import Needs, Rule, with_needs
from ._newton_schulz import _ADJUST_LR, NS5_COEFFICIENTS, Coefficients, _coefficient_schedule, orthogonalize_leaves


def leaf_batch_dims(tree: PyTree, batch_dims: Any) -> list[int]:
    """Per leaf of `tree` (flatten order): how many leading dims index separate matrices,
    from `batch_dims` (an int, a tree of ints like the params, or `(path, leaf) -> int`);
    on flat buffers one value per buffer, as the planner read them (`batch_rule`)."""
    return lay.per_leaf(tree, batch_rule(batch_dims))


def batch_rule(batch_dims: Any) -> Rule:
    """`batch_dims` as a per-leaf rule (`Needs.rules`), known by the user's own object: the
    same across rebuilds of the transform, as `inject_hyperparams` makes them."""

    def per_leaf(whole: PyTree) -> list[int]:
        pairs = tr.tree_flatten_with_path(whole)[0]
        if callable(batch_dims):
            values = [batch_dims(path, x) for path, x in pairs]
        elif isinstance(batch_dims, int):
            values = [batch_dims] * len(pairs)
        else:  # a tree of ints like the params, read by leaf path (a hybrid's Muon side sees some leaves)
            given = dict(tr.tree_flatten_with_path(batch_dims)[0])
            missing = [path for path, _ in pairs if path not in given]
            if missing:
                raise ValueError(
                    f"batch_dims must be an int, a callable (path, leaf) -> int or a tree of ints shaped "
                    f"like the params; it has no entry for leaf '{missing[0]}'"
                )
            values = [given[path] for path, _ in pairs]
        for (path, x), b in zip(pairs, values):
            if isinstance(b, bool) or not isinstance(b, int) or b < 0 or x.dim() - b < 2:
                raise ValueError(
                    f"batch_dims of leaf '{path}' (shape {tuple(x.shape)}) is {b!r}: it must be an int >= 0 that "
                    "leaves a matrix (at least 2 dims) after the batch dims"
                )
        return [int(b) for b in values]

    return Rule("batch_dims", batch_dims, per_leaf)


def split_rule(split: Any, batch_dims: Any) -> Rule:
    """`split` as a per-leaf rule: per leaf, None or the row sizes of the blocks its matrices'
    first dim (after the batch dims) splits into before orthogonalizing. `split` per leaf is
    None or 1 (whole), an int k (k equal blocks), or a sequence of row sizes; given once for
    every leaf, as a tree like the params (read by leaf path), or as `(path, leaf) -> value`."""

    def per_leaf(whole: PyTree) -> list[tuple[int, ...] | None]:
        pairs = tr.tree_flatten_with_path(whole)[0]
        if callable(split):
            values = [split(path, x) for path, x in pairs]
        elif split is None or isinstance(split, int) or _is_sizes(split):
            values = [split] * len(pairs)
        else:  # a tree like the params, read by leaf path (a hybrid's Muon side sees some leaves)
            flat = pytree.tree_flatten_with_path(split, is_leaf=lambda v: v is None or _is_sizes(v))[0]
            given = {tr.path_str(p): v for p, v in flat}
            missing = [path for path, _ in pairs if path not in given]
            if missing:
                raise ValueError(
                    "split must be an int, a sequence of row sizes, a tree of those shaped like the params or a "
                    f"callable (path, leaf) -> one; it has no entry for leaf '{missing[0]}'"
                )
            values = [given[path] for path, _ in pairs]
        out: list[tuple[int, ...] | None] = []
        for (path, x), b, v in zip(pairs, batch_rule(batch_dims).values(whole), values):
            rows = x.shape[b] if x.dim() > b else 0
            if v is None or (isinstance(v, int) and not isinstance(v, bool) and v == 1):
                out.append(None)
            elif isinstance(v, int) and not isinstance(v, bool) and v > 1 and rows % v == 0:
                out.append((rows // v,) * v)
            elif _is_sizes(v) and sum(v) == rows and all(n > 0 for n in v):
                out.append(tuple(int(n) for n in v))
            else:
                raise ValueError(
                    f"split of leaf '{path}' (shape {tuple(x.shape)}, {rows} rows after {b} batch dim(s)) is {v!r}: "
                    "give None, a number of equal blocks that divides the rows, or row sizes that sum to them"
                )
        return out

    # Known by the batch-dims rule it reads too; an int names itself (Dynamo before 2.12 cannot trace id() of one).
    by = batch_dims if isinstance(batch_dims, int) else id(batch_dims)
    return Rule(f"split:{by}", split, per_leaf)


def _is_sizes(v: Any) -> bool:
    return isinstance(v, (tuple, list)) and bool(v) and all(isinstance(n, int) and not isinstance(n, bool) for n in v)


def _lr_ratio(shape: torch.Size, adjust_lr: str) -> float:
    rows, cols = shape[0], math.prod(shape[1:])
    if adjust_lr == "original":
        return math.sqrt(max(1.0, rows / cols))
    return 0.2 * math.sqrt(max(rows, cols))


def _check_matrices(tree: PyTree, what: str) -> None:
    for path, x in tr.tree_flatten_with_path(tree)[0]:
        if isinstance(x, Tensor) and x.dim() < 2:
            raise ValueError(
                f"{what} leaf '{path}' has shape {tuple(x.shape)}: Muon orthogonalizes matrices "
                "(>= 2 dims) only; give vectors, scalars, embeddings and the output head to AdamW "
                "with ps.muon_adamw(...) (it routes leaves by ps.muon_labels)"
            )


def check_muon_args(ns_steps: int, ns_coefficients: Coefficients, ns_dtype: Any, adjust_lr: Any, eps: float) -> None:
    check_int("ns_steps", ns_steps, 1, below=100)
    _coefficient_schedule(ns_coefficients, ns_steps)
    if not isinstance(ns_dtype, torch.dtype) or not ns_dtype.is_floating_point:
        raise ValueError(
            f"ns_dtype must be a floating torch.dtype (torch.bfloat16, torch.float32...), got {ns_dtype!r}"
        )
    if adjust_lr not in _ADJUST_LR:
        raise ValueError(f"adjust_lr must be one of {_ADJUST_LR}, got {adjust_lr!r}")
    check_positive("eps", eps)


# --------------------------------------------------------------------------- #
# The building block.
# --------------------------------------------------------------------------- #


class ScaleByMuonState(NamedTuple):
    """State of `scale_by_muon`: the momentum buffer."""

    count: Tensor  # type: ignore[assignment]  # (), int64
    mu: Params  # momentum buffer


def scale_by_muon(
    momentum: ScalarOrSchedule = 0.95,
    nesterov: bool = True,
    ns_steps: int = 5,
    *,
    ns_coefficients: Coefficients = NS5_COEFFICIENTS,
    ns_dtype: torch.dtype = torch.bfloat16,
    adjust_lr: str = "original",
    eps: float = 1e-7,
    emulate_bf16: bool | None = None,
    batch_dims: Any = 0,
    split: Any = None,
    mu_dtype: torch.dtype | None = None,
    rounding: str = "stochastic",
) -> Transform:
    """Muon's orthogonalized momentum, `s(A, B) · NS(m̃)`; see `muon` for the rule, `adam`
    for `mu_dtype` and `rounding`.

    Every leaf must have >= 2 dims; a leaf of shape (A, ...) is orthogonalized as an
    A × prod(rest) matrix (with `batch_dims` b, a leaf (*B, A, ...) of len(B) = b is prod(B)
    such matrices), and matrices of one shape (or its transpose) are stacked into one
    batched matmul per iteration.

    Args:
      batch_dims: how many leading dims of a leaf index separate matrices: an int, a tree of
        ints like the params, or `(path, leaf) -> int`. Expert weights (E, m, n) with 1 are E
        m × n matrices, each orthogonalized and scaled (s(m, n)) on its own, as optax's
        `MuonDimensionNumbers`; 0 (the default) makes a leaf of more than 2 dims one matrix
        (shape[0], prod(rest)), as conv filters want.
      split: blocks of a fused leaf, each orthogonalized and scaled as a matrix of its own:
        per leaf None (whole), an int k (k equal blocks of the matrix's first dim, after the
        batch dims: a fused QKV weight (3·d, d) with 3 is q, k and v; with 3·heads, each head
        of each), or a sequence of row sizes (GQA's unequal q, k, v); given once, as a tree
        like the params, or as `(path, leaf) -> value`. Blocks of one shape batch together.
      emulate_bf16: with `ns_dtype=torch.bfloat16`, run the iterations as float32 matmuls
        with every result rounded to bf16 (True), as real bf16 matmuls (False), or emulate
        only on a CPU without bf16 matmul units, no AVX512-BF16 or AMX (None, the default).

    Warning:
        The emulation is not bit-identical to a bf16 matmul: both accumulate in float32, in
        a different order, so a sum near a bf16 rounding boundary can round the other way.
        On random matrices the orthogonalized entries differ by at most 2⁻⁶ (≈ 2 bf16 ulps at
        the entries' largest magnitude, 1), in 15-95% of the matrices, and the emulation is
        as close to a float64 Newton-Schulz as real bf16 is, and much faster on such CPUs
        (benchmarks/results/2026-11-23-muon-cpu.md). Pass `emulate_bf16=False` for real bf16 matmuls (the slow path on such CPUs).

    Examples:
        >>> import torch, purestep.core as ps
        >>> t = ps.scale_by_muon(ns_dtype=torch.float32)
        >>> g = {"w": torch.eye(3)}
        >>> u, _ = t.update(g, t.init(g))
        >>> bool((torch.linalg.svdvals(u["w"]) > 0.5).all())
        True
    """
    check_hyperparam("momentum", momentum)
    check_nonnegative("momentum", momentum)
    check_muon_args(ns_steps, ns_coefficients, ns_dtype, adjust_lr, eps)
    lp.check_stored("mu_dtype", mu_dtype, rounding)
    coefficients, safety = _coefficient_schedule(ns_coefficients, ns_steps)
    if emulate_bf16 is not None and not isinstance(emulate_bf16, bool):
        raise ValueError(
            f"emulate_bf16 must be True, False or None (only where bf16 matmuls are slow), got {emulate_bf16!r}"
        )

    def init(params: Params) -> ScaleByMuonState:
        _check_matrices(params, "params")
        leaf_batch_dims(params, batch_dims)  # refused now, not at the first update
        if split is not None:
            lay.per_leaf(params, splits)  # checked now (on flat buffers: when the layout was planned)
        leaves = pytree.tree_leaves(params)
        return ScaleByMuonState(zero_count(leaf_device(leaves)), lp.init_moments(params, mu_dtype))

    def update(grads, state, params=None, **extra):
        _check_matrices(grads, "grads")
        batch = leaf_batch_dims(grads, batch_dims)
        blocks = lay.per_leaf(grads, splits) if split is not None else None
        gs, wide, mu = lp.load_moments(grads, state.mu, params)
        spec = pytree.tree_structure(grads)
        beta = resolve(momentum, state.count)
        # m ← β·m + (1-β)·g  (torch.optim.Muon's lerp form)
        mu = ls.cast_like(ls.ema(mu, wide, beta), wide)
        # m̃ = (1-β)·g + β·m with nesterov, else m
        src = ls.cast_like(ls.ema(wide, mu, 1.0 - beta), wide) if nesterov else mu

        def scaled_orthogonal(mats: list[Tensor], lead: list[int], sizes: list | None = None) -> list[Tensor]:
            # On whole matrices (over FSDP2 shards: once, on each matrix's owner rank); a
            # fused leaf as its blocks (`split`), each a matrix of its own.
            parts = [
                list(m.split(list(s), dim=b)) if s else [m] for m, b, s in zip(mats, lead, sizes or [None] * len(mats))
            ]
            flat = [p for ps_ in parts for p in ps_]
            leads = [b for ps_, b in zip(parts, lead) for _ in ps_]
            ortho = orthogonalize_leaves(flat, coefficients, safety, eps, ns_dtype, emulate_bf16, leads)
            scaled = iter([o * _lr_ratio(o.shape[b:], adjust_lr) for o, b in zip(ortho, leads)])
            return [
                torch.cat([next(scaled) for _ in ps_], dim=b) if len(ps_) > 1 else next(scaled)
                for ps_, b in zip(parts, lead)
            ]

        out = ls.cast_like(lay.map_matrices(grads, scaled_orthogonal, src, batch_dims=batch, extra=blocks), gs)
        stored = lp.store_moments(mu, state.mu, lp.moment_keys(state.count, rounding, state.mu))
        return pytree.tree_unflatten(out, spec), ScaleByMuonState(state.count + 1, stored)

    # Per-matrix math: same-shape matrices stacked; batch dims and blocks per-leaf rules.
    splits = split_rule(split, batch_dims)
    rules = (batch_rule(batch_dims),) + ((splits,) if split is not None else ())
    return with_needs(
        Transform(init, update),
        Needs(whole_leaves=True, rules=rules, reductions=("map_matrices",), flat=lp.unpackable(mu_dtype)),
    )


# --------------------------------------------------------------------------- #
# Routing: which leaves Muon takes.
# --------------------------------------------------------------------------- #


def muon_labels(params: Params) -> PyTree:
    """ "muon" for hidden >= 2-D matrices, "adamw" for embeddings, the output head, norms, biases and scalars.

    The leaves `ps.decay_mask` calls weight matrices, less the output head: the same
    classifier decides both. By rank then by the last two parts of the dotted name:
    fewer than 2 dims, biases, norm scales (`*norm*`, `ln_f`, `bn1`), embeddings and
    learned tokens (`embed*`, `wte`, `wpe`, `pos_emb*`, `cls_token`) → "adamw"; a
    module named `lm_head`, `head`, `output`, `classifier`, `fc`, `out`, `logits`,
    `score`, `unembed` or `readout` outside any numbered block (`layers.3.`) → "adamw"
    (the output head); every other matrix, conv filters included (`patch_embed.proj`) → "muon".

    Examples:
        >>> import torch, purestep.core as ps
        >>> params = {"wte.weight": torch.zeros(10, 4), "h.0.attn.weight": torch.zeros(4, 4),
        ...           "h.0.ln_1.weight": torch.zeros(4), "lm_head.weight": torch.zeros(10, 4)}
        >>> ps.muon_labels(params)
        {'wte.weight': 'adamw', 'h.0.attn.weight': 'muon', 'h.0.ln_1.weight': 'adamw', 'lm_head.weight': 'adamw'}

    References:
        Jordan et al., Muon: An optimizer for hidden layers in neural networks, 2024.
    """
    return tr.tree_map_with_path(lambda path, x: "muon" if param_kind(path, x) == "matrix" else "adamw", params)


# --------------------------------------------------------------------------- #
# The aliases.
# --------------------------------------------------------------------------- #


def muon(
    lr: ScalarOrSchedule = 0.02,
    momentum: ScalarOrSchedule = 0.95,
    nesterov: bool = True,
    ns_steps: int = 5,
    weight_decay: ScalarOrSchedule = 0.0,
    adjust_lr: str = "original",
    ns_dtype: torch.dtype = torch.bfloat16,
    ns_coefficients: Coefficients = NS5_COEFFICIENTS,
    *,
    eps: float = 1e-7,
    emulate_bf16: bool | None = None,
    batch_dims: Any = 0,
    split: Any = None,
    cautious_weight_decay: bool = False,
    mu_dtype: torch.dtype | None = None,
    rounding: str = "stochastic",
) -> Transform:
    """Muon, = `torch.optim.Muon`: momentum orthogonalized by Newton-Schulz, for matrices.

    m ← μ·m + (1-μ)·g;  m̃ = (1-μ)·g + μ·m with nesterov, else m;
    O = NSₖ(m̃ / max(‖m̃‖_F, ε));  p ← p - η·(s(A, B)·O + λ·p),
    with η = `lr`, μ = `momentum`, λ = `weight_decay`, k = `ns_steps`; each NS iteration is
    X ← a·X + (b·XXᵀ + c·(XXᵀ)²)·X in `ns_dtype` with (a, b, c) from `ns_coefficients`;
    s(A, B) = max(1, A/B)^½ (`adjust_lr="original"`, Keller Jordan) or 0.2·max(A, B)^½
    (`"match_rms_adamw"`, Moonlight) for a leaf seen as an A × B matrix.

    Args:
      ns_dtype: the dtype of the Newton-Schulz iterations.
      ns_coefficients: (a, b, c) for every iteration (default torch.optim.Muon's NS5),
        a sequence of (a, b, c) per iteration, or "polar_express" (Amsel et al. 2025).
      emulate_bf16: bf16 iterations as float32 matmuls rounded to bf16 (True), real bf16
        matmuls (False), or emulated only on CPUs without bf16 matmul units (None); the
        emulation is not bit-identical, see `scale_by_muon`.
      batch_dims: leading dims that index separate matrices (an int, a tree of ints or
        `(path, leaf) -> int`): expert weights (E, m, n) with 1 are E m × n matrices, each
        orthogonalized and scaled as m × n. See `scale_by_muon`.
      split: blocks of a fused leaf (QKV into q, k, v; per head), each orthogonalized and
        scaled as a matrix of its own: an int of equal blocks or row sizes per leaf. See
        `scale_by_muon`.
      cautious_weight_decay: decay only where sign(O) = sign(p) (Chen et al. 2025); see `adamw`.
      mu_dtype, rounding: how m is stored; see `adam`.

    Warning:
        Defaults differ from `torch.optim.Muon` (lr=1e-3, weight_decay=0.1): lr=0.02 is Keller
        Jordan's. Leaves with more than 2 dims (conv filters) are orthogonalized as
        shape[0] × prod(rest) matrices (torch refuses them); 0-D/1-D leaves raise — use `muon_adamw`.

    Examples:
        >>> import torch, purestep.core as ps
        >>> opt = ps.muon(lr=0.1, ns_dtype=torch.float32)
        >>> params = {"w": torch.zeros(2, 2)}
        >>> updates, _ = opt.update({"w": torch.eye(2)}, opt.init(params), params)
        >>> bool(updates["w"].diag().lt(-0.05).all())
        True

    References:
        Jordan et al., Muon: An optimizer for hidden layers in neural networks, 2024;
        Liu et al., Muon is Scalable for LLM Training, 2025;
        Amsel et al., The Polar Express: Optimal Matrix Sign Methods and Their Application to the Muon Algorithm, 2025.
    """
    block = scale_by_muon(
        momentum,
        nesterov,
        ns_steps,
        ns_coefficients=ns_coefficients,
        ns_dtype=ns_dtype,
        adjust_lr=adjust_lr,
        eps=eps,
        emulate_bf16=emulate_bf16,
        batch_dims=batch_dims,
        split=split,
        mu_dtype=mu_dtype,
        rounding=rounding,
    )
    return chain(block, decayed(weight_decay, cautious=cautious_weight_decay), scale_by_lr(lr))


def muon_adamw(
    lr: ScalarOrSchedule = 0.02,
    momentum: ScalarOrSchedule = 0.95,
    nesterov: bool = True,
    ns_steps: int = 5,
    weight_decay: ScalarOrSchedule = 0.01,
    adjust_lr: str = "original",
    ns_dtype: torch.dtype = torch.bfloat16,
    ns_coefficients: Coefficients = NS5_COEFFICIENTS,
    *,
    adamw_lr: ScalarOrSchedule = 3e-4,
    adamw_betas: tuple[ScalarOrSchedule, ScalarOrSchedule] = (0.9, 0.95),
    adamw_eps: float = 1e-10,
    adamw_weight_decay: ScalarOrSchedule = 0.01,
    labels: Any = muon_labels,
    emulate_bf16: bool | None = None,
    batch_dims: Any = 0,
    split: Any = None,
    cautious_weight_decay: bool = False,
    mu_dtype: torch.dtype | None = None,
    nu_dtype: torch.dtype | None = None,
    rounding: str = "stochastic",
) -> Transform:
    """Keller Jordan's hybrid: `muon` for hidden matrices, `adamw` for everything else.

    `partition({"muon": muon(lr, ..., weight_decay), "adamw": adamw(adamw_lr, adamw_betas,
    adamw_eps, adamw_weight_decay)}, labels)`; see `muon` and `adamw` for the rules and
    `muon_labels` for the default routing (embeddings, output head, norms, biases → AdamW).

    Args:
      lr, weight_decay: Muon's side. Defaults lr=0.02, weight_decay=0.01: the
        `MuonWithAuxAdam` recipe of the KellerJordan/Muon README.
      adamw_lr, adamw_betas, adamw_weight_decay: AdamW's side. Defaults 3e-4, (0.9, 0.95),
        0.01: the same README recipe.
      adamw_eps: 1e-10, the eps of KellerJordan/Muon's `adam_update`.
      labels: "muon"/"adamw" per leaf, a str pytree or `callable(params)`.
      emulate_bf16: Muon's bf16 emulation switch, see `muon`.
      batch_dims: Muon's, see `muon` (an int, a tree of ints or `(path, leaf) -> int`; a
        tree or callable is read on the leaves Muon takes).
      split: Muon's blocks of fused leaves, see `muon` (read on the leaves Muon takes).
      cautious_weight_decay: cautious decay on both sides (Chen et al. 2025); see `adamw`.
      mu_dtype, nu_dtype, rounding: how the momenta are stored (see `adam`): `mu_dtype` for
        Muon's momentum and AdamW's m, `nu_dtype` for AdamW's v.

    Examples:
        >>> import torch, purestep.core as ps
        >>> opt = ps.muon_adamw()
        >>> params = {"h.0.weight": torch.zeros(4, 4), "h.0.bias": torch.zeros(4)}
        >>> state = opt.init(params)
        >>> sorted(state.inner_states["muon"][0].mu)
        ['h.0.weight']

    References:
        Jordan et al., Muon: An optimizer for hidden layers in neural networks, 2024
        (github.com/KellerJordan/Muon, README "MuonWithAuxAdam").
    """
    return beside_adamw(
        muon(
            lr,
            momentum,
            nesterov,
            ns_steps,
            weight_decay,
            adjust_lr,
            ns_dtype,
            ns_coefficients,
            emulate_bf16=emulate_bf16,
            batch_dims=batch_dims,
            split=split,
            cautious_weight_decay=cautious_weight_decay,
            mu_dtype=mu_dtype,
            rounding=rounding,
        ),
        labels,
        adamw_lr,
        adamw_betas,
        adamw_eps,
        adamw_weight_decay,
        cautious_weight_decay=cautious_weight_decay,
        mu_dtype=mu_dtype,
        nu_dtype=nu_dtype,
        rounding=rounding,
    )


def beside_adamw(
    matrices: Transform,
    labels: Any,
    adamw_lr: ScalarOrSchedule,
    adamw_betas: tuple[ScalarOrSchedule, ScalarOrSchedule],
    adamw_eps: float,
    adamw_weight_decay: ScalarOrSchedule,
    **adamw_options: Any,
) -> Transform:
    """The `*_adamw` recipes' split: `matrices` on the leaves `labels` marks "muon", AdamW on
    the rest ("adamw")."""
    return partition(
        {"muon": matrices, "adamw": adamw(adamw_lr, adamw_betas, adamw_eps, adamw_weight_decay, **adamw_options)},
        labels,
    )
