"""Weight decay and parameter-group rules."""

from __future__ import annotations

import re
from typing import Any, NamedTuple

import torch
import torch.utils._pytree as pytree
from torch import Tensor

from .engine import ops as lay
from . import _foreach as ls
from . import _tree as tr
from ._base import (
    schedule_clock,
    check_bool,
    EmptyState,
    Params,
    PyTree,
    ScalarOrSchedule,
    Transform,
    check_hyperparam,
    check_nonnegative,
    is_static,
    is_zero,
    leaf_device,
    resolve,
    with_in_place,
    zero_count,
)
from ._combine import identity, masked
from .engine.needs import Needs, Rule, with_needs


@schedule_clock
class AddDecayedWeightsState(NamedTuple):
    """State of `add_decayed_weights` with a scheduled weight decay."""

    count: Tensor  # type: ignore[assignment]  # (), int64: the schedule's step


def decayed(weight_decay: ScalarOrSchedule, mask: Any = None, *, cautious: bool = False) -> Transform:
    """The decay term of an optimizer's chain: `add_decayed_weights`, or `identity()` (the
    same state layout, no work) for a constant zero."""
    return identity() if is_zero(weight_decay) else add_decayed_weights(weight_decay, mask, cautious=cautious)


def add_decayed_weights(weight_decay: ScalarOrSchedule = 0.0, mask: Any = None, *, cautious: bool = False) -> Transform:
    """`u ← u + λ·p`, before lr scaling (as optax): decoupled decay when it follows the
    preconditioner, L2 regularisation when it comes first.

    Args:
      weight_decay: λ, a float, a 0-d tensor or a schedule.
      mask: decay only where True: a bool pytree like params, or `callable(params)`.
      cautious: cautious weight decay (Chen et al. 2025): `u ← u + λ·𝟙[sign u = sign p]·p`,
        the decay only where the incoming direction u already moves p toward 0 (the step
        is -η·u), so decay never fights the optimizer.

    Examples:
        >>> import torch, purestep.core as ps
        >>> t = ps.add_decayed_weights(0.5)
        >>> p = {"w": torch.full((1,), 2.0)}
        >>> t.update({"w": torch.zeros(1)}, t.init(p), p)[0]
        {'w': tensor([1.])}
    """
    check_hyperparam("weight_decay", weight_decay)
    check_nonnegative("weight_decay", weight_decay)
    check_bool("cautious", cautious)

    def init(params: Params) -> EmptyState | AddDecayedWeightsState:
        if callable(weight_decay):
            return AddDecayedWeightsState(zero_count(leaf_device(pytree.tree_leaves(params))))
        return EmptyState()

    def affine(state):
        # u + λ·p as x·u + y·p (see `Transform`): `chain` folds it into an in-place apply.
        if callable(weight_decay):
            return 1.0, resolve(weight_decay, state.count), AddDecayedWeightsState(state.count + 1)
        return 1.0, weight_decay, state

    def update(grads, state, params=None, **extra):
        ps_ = tr.params_for(params, grads, "add_decayed_weights")
        us, spec = pytree.tree_flatten(grads)
        _, wd, state = affine(state)
        if cautious:  # λ·p only where sign(u) = sign(p)
            ps_ = [torch.where(torch.sign(u) == torch.sign(p), p, torch.zeros_like(p)) for u, p in zip(us, ps_)]
        return pytree.tree_unflatten(ls.cast_like(ls.axpy(wd, ps_, us), us), spec), state

    # The cautious decay is not affine in (u, p): no in-place form then.
    t = with_needs(Transform(init, update if cautious else with_in_place(update, affine=affine)), Needs(bounded=True))
    return t if mask is None else masked(t, mask)


# --------------------------------------------------------------------------- #
# Parameter-group rules: which leaves decay, per-leaf lr multipliers.
# --------------------------------------------------------------------------- #

# Matched against the last two components of a leaf's dotted name (the module and
# the parameter), lower-cased, so `layers.0.attention_norm.weight`, `ln_f.weight`,
# `bn1.weight` and `LayerNorm.weight` are norm scales while `patch_embed.proj.weight`
# (a conv) is not an embedding.
_NORM_NAME = re.compile(r"norm|^ln(_|\d|$)|_ln(_|\d|$)|^bn(_|\d|$)|_bn(_|\d|$)|^gn(_|\d|$)")
_EMBED_NAME = re.compile(r"embed|^wte$|^wpe$|^emb(_|$)|_emb$|(^|_)token(s)?$|^pos_?emb")
_BIAS_NAME = re.compile(r"bias")
# The output head: a top-level module of one of these names (a numbered block's `output`
# is BERT's hidden projection, not a head).
_HEAD_NAMES = {"lm_head", "head", "output", "classifier", "fc", "out", "logits", "score", "unembed", "readout"}


def _name_parts(path: str) -> list[str]:
    return [part.lower() for part in path.split(".")[-2:]]


def _is_embedding(path: str) -> bool:
    return any(_EMBED_NAME.search(part) for part in _name_parts(path))


def param_kind(path: str, leaf: Any) -> str:
    """The one classifier behind `decay_mask` and `muon_labels`: "vector" (< 2 dims),
    "bias", "norm", "embedding" (tables and learned tokens), "head" (the output layer)
    or "matrix" (every other weight, conv filters included), by rank then by name."""
    if not isinstance(leaf, Tensor) or leaf.dim() <= 1:
        return "vector"
    parts = _name_parts(path)
    if _BIAS_NAME.search(parts[-1]):
        return "bias"
    if any(_NORM_NAME.search(p) for p in parts):
        return "norm"
    if _is_embedding(path):
        return "embedding"
    names = path.split(".")
    module = names[:-1] if names[-1] in ("weight", "bias") else names
    if module and module[-1].lower() in _HEAD_NAMES and not any(p.isdigit() for p in module):
        return "head"
    return "matrix"


def decay_mask(params: Params, exclude_embeddings: bool = True) -> PyTree:
    """A bool tree like `params`: True for weight matrices, False for what should not decay.

    False for 0-D and 1-D leaves (biases, norm gains, scalars), and by name for
    biases (`bias`), every kind of norm scale (`norm`, `LayerNorm`, `ln_1`, `ln_f`,
    `bn1`, `attention_norm`, `q_norm`...) and, with `exclude_embeddings`, embeddings
    and learned tokens (`embed`, `wte`, `wpe`, `tok_embeddings`, `embed_tokens`,
    `pos_embed`, `cls_token`). Pass it as `mask=ps.decay_mask` to `adamw`,
    `add_decayed_weights` or `masked`.

    Args:
      params: a params tree; names are the dotted leaf paths (`named_parameters()` names).
      exclude_embeddings: also exempt embedding tables (the usual GPT/LLaMA recipe).

    Examples:
        >>> import torch, purestep.core as ps
        >>> params = {"wte.weight": torch.zeros(10, 4), "h.0.attn.weight": torch.zeros(4, 4),
        ...           "h.0.attn.bias": torch.zeros(4), "h.0.ln_1.weight": torch.zeros(4)}
        >>> ps.decay_mask(params)
        {'wte.weight': False, 'h.0.attn.weight': True, 'h.0.attn.bias': False, 'h.0.ln_1.weight': False}
    """

    def rule(path: str, leaf: Tensor) -> bool:
        kind = param_kind(path, leaf)
        return kind in ("matrix", "head") or (kind == "embedding" and not exclude_embeddings)

    return tr.tree_map_with_path(rule, params)


_LAYER_INDEX = re.compile(r"(?:^|\.)(?:layers|layer|h|blocks|block)\.(\d+)(?:\.|$)")


def layerwise_lr_decay(params: Params, decay: float) -> PyTree:
    """Per-leaf lr multipliers that shrink geometrically from the top layer down (LLRD).

    With n layers found by index in the names (`layers.3.`, `h.3.`, `blocks.3.`,
    `layer.3.`), a leaf of layer i gets decay^(n - i); embeddings (by name) get
    decay^(n + 1); everything outside the layers (head, final norm) gets 1.
    Feed the result to `scale_per_leaf`.

    Args:
      params: a params tree with `named_parameters()`-style dotted names.
      decay: the per-layer factor, in (0, 1] (1 turns LLRD off).

    Examples:
        >>> import torch, purestep.core as ps
        >>> params = {"embed.weight": torch.zeros(1), "layers.0.w": torch.zeros(1),
        ...           "layers.1.w": torch.zeros(1), "head.w": torch.zeros(1)}
        >>> ps.layerwise_lr_decay(params, 0.5)
        {'embed.weight': 0.125, 'layers.0.w': 0.25, 'layers.1.w': 0.5, 'head.w': 1.0}

    References:
        Clark et al., ELECTRA, 2020; Bao et al., BEiT, 2021 (layer-wise lr decay).
    """
    if not is_static(decay) or not 0.0 < decay <= 1.0:
        raise ValueError(f"decay must be a float in (0, 1], got {decay!r}")
    paths = tr.tree_paths(params)
    found = [_LAYER_INDEX.search(p) for p in paths]
    n = max((int(m.group(1)) + 1 for m in found if m), default=0)

    def rule(path: str, leaf: Any) -> float:
        m = _LAYER_INDEX.search(path)
        if m:
            return float(decay ** (n - int(m.group(1))))
        if _is_embedding(path):
            return float(decay ** (n + 1))
        return 1.0

    return tr.tree_map_with_path(rule, params)


def _multipliers_per_leaf(multipliers: Any, tree: PyTree) -> list:
    ms = multipliers(tree) if callable(multipliers) else multipliers
    leaves, spec = pytree.tree_flatten(tree)
    if is_static(ms):
        return [float(ms)] * len(leaves)
    factors, m_spec = pytree.tree_flatten(ms)
    if m_spec != spec:
        raise ValueError(
            f"multipliers must have the structure of the grads ({len(leaves)} leaves: "
            f"{', '.join(tr.tree_paths(tree)[:4])}...), got {len(factors)} leaves"
        )
    return factors


def scale_per_leaf(multipliers: Any) -> Transform:
    """Multiply each leaf's update by its own constant multiplier (LLRD, μP-style width scaling).

    Args:
      multipliers: a tree like params of floats (or 0-d tensors), a single float for
        every leaf, or `callable(tree) -> multipliers`, called with the grads (whose
        names and shapes are the params'), e.g. `lambda g: ps.layerwise_lr_decay(g, 0.8)`.
        Put it before `scale_by_lr` in a chain so it scales the lr of each leaf.

    Examples:
        >>> import torch, purestep.core as ps
        >>> t = ps.scale_per_leaf({"a": 0.5, "b": 2.0})
        >>> g = {"a": torch.ones(1), "b": torch.ones(1)}
        >>> t.update(g, t.init(g))[0]
        {'a': tensor([0.5000]), 'b': tensor([2.])}
    """
    if is_static(multipliers):
        check_hyperparam("multipliers", multipliers)
    elif not callable(multipliers):
        for path, m in tr.tree_flatten_with_path(multipliers)[0]:
            check_hyperparam(f"multipliers leaf '{path}'", m)
            if callable(m):
                raise ValueError(f"multipliers leaf '{path}' must be a float or a 0-d tensor, not a schedule")

    rule = Rule("multipliers", multipliers, lambda tree: _multipliers_per_leaf(multipliers, tree))

    def init(params: Params) -> EmptyState:
        return EmptyState()

    def update(grads, state, params=None, **extra):
        gs, spec = pytree.tree_flatten(grads)
        factors = lay.per_leaf(grads, rule)
        if ls.use_foreach(gs) and all(is_static(f) for f in factors):
            out = list(torch._foreach_mul(gs, [float(f) for f in factors]))
        else:
            out = [g * f for g, f in zip(gs, factors)]
        return pytree.tree_unflatten(ls.cast_like(out, gs), spec), state

    return with_needs(Transform(init, update), Needs(rules=(rule,)))
