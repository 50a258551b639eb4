"""μP (maximal update parametrization), the optimizer side: per-leaf lr multipliers from shapes.

Which dims of a leaf scale with width is read off a base model's shapes, as
`mup.set_base_shapes` reads it; the multipliers then feed `scale_per_leaf` (the
`mup_adamw` and `mup_sgd` aliases below are the chains).
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

import torch
from torch import Tensor

from . import _tree as tr
from ._base import (
    Params,
    PyTree,
    ScalarOrSchedule,
    Transform,
    check_betas,
    check_hyperparam,
    check_lr,
    check_nonnegative,
    is_static,
)
from ._combine import chain, identity
from ._weight_decay import decayed, scale_per_leaf
from ._alias import sgd
from ._blocks import scale_by_adam, scale_by_lr, trace

# One dim of a base shape: (base size, always a width dim). A plain int is a width dim
# only where it differs from the leaf's size (mup's `zip_infshape`); an InfDim-like
# entry with a base size (what `mup.make_base_shapes` / `load_base_shapes` give, and
# `mup.get_infshapes`) is one even at equal sizes; None is never one.
_Dim = tuple[int | None, bool]
_RULES = ("adam", "sgd")


def _is_dim(d: Any) -> bool:
    return d is None or (isinstance(d, int) and not isinstance(d, bool)) or hasattr(d, "base_dim")


def _is_shape(v: Any) -> bool:
    return isinstance(v, (tuple, list)) and all(_is_dim(d) for d in v)


def _dim(d: Any, where: str) -> _Dim:
    if hasattr(d, "base_dim"):  # mup.infshape.InfDim
        d = d.base_dim
        if d is not None and not (isinstance(d, int) and d > 0):
            raise ValueError(f"base_shapes {where} has base size {d!r}; expected an int > 0 or None")
        return d, d is not None
    if d is not None and d <= 0:
        raise ValueError(f"base_shapes {where} has size {d}; expected an int > 0 or None")
    return d, False


def _normalize(base_shapes: Any) -> tuple[tuple[str, tuple[_Dim, ...]], ...]:
    """`base_shapes` as `((dotted name, dims), ...)`, hashable, sorted by name."""
    if isinstance(base_shapes, Mapping) and base_shapes and all(_is_shape(v) for v in base_shapes.values()):
        items = [(str(k), v) for k, v in base_shapes.items()]
    else:
        pairs, _ = tr.tree_flatten_with_path(base_shapes)
        if not pairs:
            raise ValueError(
                "base_shapes is empty; give the base model's shapes, e.g. "
                "{name: p.shape for name, p in base_model.named_parameters()}"
            )
        for path, leaf in pairs:
            if not isinstance(leaf, Tensor):
                raise ValueError(
                    f"base_shapes leaf '{path}' is {type(leaf).__name__}; expected a tensor (a base params tree) "
                    "or, in a flat mapping of names to shapes, a shape (a tuple of ints or None)"
                )
        items = [(path, tuple(leaf.shape)) for path, leaf in pairs]
    return tuple(sorted((name, tuple(_dim(d, f"entry '{name}'") for d in shape)) for name, shape in items))


def _width_mults(path: str, leaf: Any, dims: tuple[_Dim, ...]) -> list[float | None]:
    """Per dim of `leaf`: its width multiplier size/base where it is a width dim, else None."""
    shape = tuple(leaf.shape)
    if len(shape) != len(dims):
        raise ValueError(
            f"base_shapes entry '{path}' has {len(dims)} dims, but the leaf has shape {shape}; "
            "the base model must have the same layers, only narrower"
        )
    return [
        size / base if base is not None and (forced or base != size) else None
        for size, (base, forced) in zip(shape, dims)
    ]


def _multiplier(path: str, mults: list[float | None], rule: str) -> float:
    width = [m for m in mults if m is not None]
    if len(width) > 2:
        raise ValueError(
            f"leaf '{path}' has {len(width)} width dims (sizes that differ from base_shapes); μP as mup defines "
            "it covers at most 2 (vectors and matrices): mark the others finite (None) in base_shapes"
        )
    if rule == "adam":
        # A hidden matrix (two width dims): lr / width_mult of its fan-in, the last width dim.
        return 1.0 / width[-1] if len(width) == 2 else 1.0
    if len(width) == 1:  # a vector-like leaf (biases, gains, input and output layers)
        return width[0]
    if len(width) == 2:  # lr · fan_out_mult / fan_in_mult (dims 0 and 1 as torch lays out weights)
        fan_in, fan_out = mults[1] or 1.0, mults[0] or 1.0
        return fan_out / fan_in
    return 1.0


def _multipliers(params: Params, normalized: tuple, rule: str) -> PyTree:
    bases = dict(normalized)

    def leaf_rule(path: str, leaf: Any) -> float:
        if path not in bases:
            near = sorted(bases)[:4]
            raise ValueError(
                f"base_shapes has no entry for leaf '{path}' (it names {len(bases)} leaves: {', '.join(near)}...); "
                "its names must be the params' dotted names (model.named_parameters())"
            )
        return _multiplier(path, _width_mults(path, leaf, bases[path]), rule)

    return tr.tree_map_with_path(leaf_rule, params)


def _check_rule(optimizer: str) -> None:
    if optimizer not in _RULES:
        raise ValueError(f"optimizer must be one of {_RULES}, got {optimizer!r}")


def mup_lr_multipliers(params: Params, base_shapes: Any, *, optimizer: str = "adam") -> PyTree:
    """Per-leaf μP lr multipliers, = the param groups of `mup.MuAdam` / `mup.MuSGD`.

    A dim of a leaf is a *width* dim when its size differs from the base model's; its
    width multiplier is size / base size. With r_i the multiplier of dim i (1 for a
    finite dim) and the fan-in the last width dim:
    Adam-like (`optimizer="adam"`): 1/r_fan-in for a leaf with two width dims (hidden
    matrices), 1 for the rest (vectors, biases, embeddings, the readout layer);
    SGD (`optimizer="sgd"`): r for a leaf with one width dim, r₀/r₁ for two, 1 for none.
    Feed the result to `scale_per_leaf` before `scale_by_lr`; `mup_adamw` and
    `mup_sgd` do, and keep lr·λ of a decoupled decay unscaled, as mup does.

    Args:
      params: the (wide) model's params tree; only names and shapes are read.
      base_shapes: the base (narrow) model's shapes, in one of the forms mup reads:
        a flat mapping of dotted names to shapes (`{n: p.shape for n, p in
        base.named_parameters()}`, or `mup.get_shapes(base)`), where an int equal to the
        leaf's size and None mark a dim that does not scale; mup's base-shape objects
        (`mup.make_base_shapes(base, delta)`, `mup.load_base_shapes(path)`,
        `mup.get_infshapes(model)`), whose width dims stay width dims at any size; a
        params tree of the base model (tensors, meta tensors will do); or
        `callable(params)` returning one of these. It may name more leaves than `params`.
      optimizer: "adam" for Adam-like optimizers (Adam, AdamW, Lion, ...), "sgd" for SGD.

    Returns:
      A tree like `params` of float multipliers.

    Warning:
        This is only the optimizer side of μP. The model side stays yours or mup's: the
        readout multiplier (`mup.MuReadout` divides the head's input by its width
        multiplier), 1/d attention scaling and the init (`mup.set_base_shapes` rescales
        it); see docs/guides/families.md. Leaves with more than 2 width dims raise, as mup's
        optimizers do.

    Examples:
        >>> import torch, purestep.core as ps
        >>> params = {"embed": torch.zeros(256, 512), "h.0.w": torch.zeros(512, 512), "head": torch.zeros(10, 512)}
        >>> base = {"embed": (256, 128), "h.0.w": (128, 128), "head": (10, 128)}
        >>> ps.mup_lr_multipliers(params, base)
        {'embed': 1.0, 'h.0.w': 0.25, 'head': 1.0}
        >>> ps.mup_lr_multipliers(params, base, optimizer="sgd")
        {'embed': 4.0, 'h.0.w': 1.0, 'head': 4.0}

    References:
        Yang et al., Tensor Programs V: Tuning Large Neural Networks via Zero-Shot
        Hyperparameter Transfer, 2021 (github.com/microsoft/mup).
    """
    _check_rule(optimizer)
    if callable(base_shapes):
        base_shapes = base_shapes(params)
    return _multipliers(params, _normalize(base_shapes), optimizer)


class _Rule:
    """`mup_lr_multipliers` with fixed base shapes: the `multipliers` of `scale_per_leaf`.

    One object per (base shapes, rule), so flat buffers resolve it once (their cache is
    keyed by the rule's identity) however often a factory is called with the same shapes.
    """

    def __init__(self, normalized: tuple | None, fn: Callable | None, rule: str) -> None:
        self.normalized, self.fn, self.rule = normalized, fn, rule

    def __call__(self, tree: PyTree) -> PyTree:
        normalized = self.normalized if self.fn is None else _normalize(self.fn(tree))
        return _multipliers(tree, normalized, self.rule)  # type: ignore[arg-type]  # one of the two is set


# One rule object per (base shapes, rule) for the life of the process. Flat buffers key a
# per-leaf rule's values by the rule's identity, resolved once when the layout is planned;
# `inject_hyperparams` builds its factory again at every update (in a compiled step inside
# the trace, where functools caches are traced through, not consulted), so a new object per
# call would be resolved again, and in a compiled step recompile. A plain dict lookup is
# what the trace sees and guards on.
_RULES_MEMO: dict[tuple, _Rule] = {}


def mup_rule(base_shapes: Any, optimizer: str) -> _Rule:
    """The `scale_per_leaf` multipliers of `base_shapes` (checked now where they are not a callable)."""
    _check_rule(optimizer)
    if base_shapes is None:
        raise ValueError("base_shapes is required: the base model's shapes (see ps.mup_lr_multipliers)")
    key = (base_shapes if callable(base_shapes) else _normalize(base_shapes), optimizer)
    if key not in _RULES_MEMO:
        fn = base_shapes if callable(base_shapes) else None
        _RULES_MEMO[key] = _Rule(None if fn is not None else key[0], fn, optimizer)
    return _RULES_MEMO[key]


# --------------------------------------------------------------------------- #
# The aliases: mup.MuAdamW and mup.MuSGD as chains.
# --------------------------------------------------------------------------- #


def mup_adamw(
    lr: ScalarOrSchedule,
    betas: tuple[ScalarOrSchedule, ScalarOrSchedule] = (0.9, 0.999),
    eps: float = 1e-8,
    weight_decay: ScalarOrSchedule = 0.0,
    mask: Any = None,
    *,
    base_shapes: Any = None,
    mu_dtype: torch.dtype | None = None,
    nu_dtype: torch.dtype | None = None,
    rounding: str = "stochastic",
) -> Transform:
    """AdamW under μP, = `mup.MuAdamW` on a model set up with `mup.set_base_shapes`.

    p ← p - η · (r⁻¹ · m̂ / (√v̂ + ε) + λ·p),
    with m̂, v̂ as in `adam`, η = `lr`, λ = `weight_decay` (where `mask`), r the width
    multiplier of a hidden matrix's fan-in (1 for vectors, embeddings and the readout:
    see `mup_lr_multipliers`). As in mup, the decay's η·λ is the same for every leaf
    (mup divides the group lr by r and multiplies its decay by r).

    Args:
      base_shapes: the base model's shapes, required; see `mup_lr_multipliers` for the
        forms it takes (a mapping of names to shapes, mup's base shapes, a base params tree).
      weight_decay: 0.0 by default, as `mup.MuAdamW` (which sets every group's decay to
        its own default, 0, whatever torch's AdamW default is).
      mu_dtype, nu_dtype, rounding: how m and v are stored; see `adam`.

    Warning:
        Only the optimizer side of μP: the readout multiplier, attention scaling and
        init stay the model's (`mup.MuReadout`, `mup.set_base_shapes`); see docs/guides/families.md.

    Examples:
        >>> import torch, purestep.core as ps
        >>> params = {"h.0.w": torch.zeros(8, 8), "h.0.b": torch.zeros(8)}
        >>> opt = ps.mup_adamw(lr=0.1, base_shapes={"h.0.w": (4, 4), "h.0.b": (4,)})
        >>> updates, _ = opt.update({"h.0.w": torch.ones(8, 8), "h.0.b": torch.ones(8)}, opt.init(params), params)
        >>> updates["h.0.w"][0, 0], updates["h.0.b"][0]  # a hidden matrix twice as wide: half the lr
        (tensor(-0.0500), tensor(-0.1000))

    References:
        Yang et al., Tensor Programs V: Tuning Large Neural Networks via Zero-Shot
        Hyperparameter Transfer, 2021 (github.com/microsoft/mup).
    """
    check_lr(lr)
    b1, b2 = check_betas(betas)
    check_hyperparam("weight_decay", weight_decay)
    check_nonnegative("weight_decay", weight_decay)
    adam_step = scale_by_adam(b1, b2, eps, mu_dtype=mu_dtype, nu_dtype=nu_dtype, rounding=rounding)
    widths = scale_per_leaf(mup_rule(base_shapes, "adam"))
    return chain(adam_step, widths, decayed(weight_decay, mask), scale_by_lr(lr))


def mup_sgd(
    lr: ScalarOrSchedule,
    momentum: ScalarOrSchedule = 0.0,
    dampening: float = 0.0,
    nesterov: bool = False,
    weight_decay: ScalarOrSchedule = 0.0,
    *,
    base_shapes: Any = None,
) -> Transform:
    """SGD under μP, = `mup.MuSGD` on a model set up with `mup.set_base_shapes`.

    g ← r·g + λ·p;  b ← μ·b + (1 - τ)·g  (b₁ = g);  p ← p - η·(g + μ·b if nesterov else b),
    with η = `lr`, μ = `momentum`, τ = `dampening`, λ = `weight_decay` (L2), r the leaf's
    μP multiplier (`mup_lr_multipliers(..., optimizer="sgd")`: the width multiplier of a
    vector-like leaf, fan-out over fan-in multiplier for a matrix). mup scales the group
    lr by r and its L2 decay by 1/r; SGD is linear, so scaling the grad instead gives the
    same steps, with b held r times larger than torch's momentum buffer.

    Args:
      base_shapes: the base model's shapes, required; see `mup_lr_multipliers`.

    Examples:
        >>> import torch, purestep.core as ps
        >>> params = {"embed": torch.zeros(10, 8)}
        >>> opt = ps.mup_sgd(lr=0.1, base_shapes={"embed": (10, 4)})
        >>> updates, _ = opt.update({"embed": torch.ones(10, 8)}, opt.init(params), params)
        >>> updates["embed"][0, 0]  # one width dim, twice as wide: twice the lr
        tensor(-0.2000)

    References:
        Yang et al., Tensor Programs V, 2021 (github.com/microsoft/mup).
    """
    check_lr(lr)
    sgd(lr, momentum, dampening, nesterov, weight_decay)  # the same checks as sgd's, naming the argument
    widths = scale_per_leaf(mup_rule(base_shapes, "sgd"))
    momentum_step = (
        identity() if is_static(momentum) and momentum == 0 else trace(momentum, nesterov, dampening=dampening)
    )
    return chain(widths, decayed(weight_decay), momentum_step, scale_by_lr(lr))
