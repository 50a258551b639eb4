"""Cautious updates against plain per-tensor references written from C-Optim's code
(github.com/kyleliang919/C-Optim: c_adamw.py, c_lion.py), in float64 over many steps."""

from __future__ import annotations

import math

import pytest
import torch

import purestep.core as ps
from tests.core.test_alias import RTOL, assert_histories_close, assert_moved, grad_stream, make_params, run_purestep

STEPS = 30


def _rescaled(mask: torch.Tensor, rescale: str) -> torch.Tensor:
    if rescale == "count":  # C-Optim's first c_adamw.py (and c_lion.py): numel / (sum + 1)
        return mask * (mask.numel() / (mask.sum() + 1))
    return mask / mask.mean().clamp(min=1e-3)  # c_adamw.py since 2025-01 (timm's caution)


def c_adamw_reference(params, grads_list, lr, betas, eps, weight_decay, rescale="count", decay_inside=False):
    """C-Optim's C-AdamW step per tensor: decay first (p ← p - lr·λ·p), moments, the mask
    from m·g > 0, then p ← p - lr/bc1 · (m·mask) / (√v/√bc2 + ε).

    C-Optim's own line is `denom = √v + ε` with `step = lr·√bc2/bc1` (transformers' AdamW);
    ε is added after the bias correction here, as torch.optim.AdamW and purestep do.
    `decay_inside`: `ps.cautious(ps.adamw(...))` instead, whose mask and rescale cover the
    decay term too (u = -lr·(m̂/(√v̂ + ε) + λ·p), kept where u·g < 0).
    """
    b1, b2 = betas
    p = {k: v.clone() for k, v in params.items()}
    m = {k: torch.zeros_like(v) for k, v in params.items()}
    v2 = {k: torch.zeros_like(v) for k, v in params.items()}
    history = []
    for t, grads in enumerate(grads_list, start=1):
        for k, g in grads.items():
            m[k] = m[k] * b1 + (1 - b1) * g
            v2[k] = v2[k] * b2 + (1 - b2) * g * g
            bc1, bc2 = 1 - b1**t, 1 - b2**t
            adam = (m[k] / bc1) / (v2[k].sqrt() / math.sqrt(bc2) + eps)
            if decay_inside:
                direction = adam + weight_decay * p[k]
                mask = _rescaled((direction * g > 0).to(g.dtype), rescale)
                p[k] = p[k] - lr * direction * mask
            else:
                p[k] = p[k] - lr * weight_decay * p[k]
                mask = _rescaled((m[k] * g > 0).to(g.dtype), rescale)
                p[k] = p[k] - lr * adam * mask
        history.append({k: x.clone() for k, x in p.items()})
    return history


def c_lion_reference(params, grads_list, lr, betas):
    """C-Optim's c_lion.py update_fn per tensor (no decay)."""
    b1, b2 = betas
    p = {k: v.clone() for k, v in params.items()}
    m = {k: torch.zeros_like(v) for k, v in params.items()}
    history = []
    for grads in grads_list:
        for k, g in grads.items():
            update = (m[k] * b1 + (1 - b1) * g).sign()
            mask = _rescaled((update * g > 0).to(g.dtype), "count")
            p[k] = p[k] - lr * update * mask
            m[k] = m[k] * b2 + (1 - b2) * g
        history.append({k: x.clone() for k, x in p.items()})
    return history


def _opposed_grads(params, steps=STEPS):
    """Grads whose sign flips often, so the masks keep a varying part of each leaf."""
    grads = grad_stream(params, steps=steps)
    return [{k: g + (0.8 if i % 3 else -1.2) for k, g in gr.items()} for i, gr in enumerate(grads)]


@pytest.mark.parametrize("rescale", ["count", "mean"])
@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
def test_cautious_adamw_matches_c_optim_c_adamw(weight_decay, rescale):
    params = make_params()
    grads = _opposed_grads(params)
    ours, _ = run_purestep(ps.cautious_adamw(1e-2, betas=(0.9, 0.99), weight_decay=weight_decay, rescale=rescale),
                           params, grads)
    theirs = c_adamw_reference(params, grads, 1e-2, (0.9, 0.99), 1e-8, weight_decay, rescale)
    assert_histories_close(ours, theirs)
    assert_moved(ours, params)


def test_cautious_adam_matches_c_optim_without_decay_and_differs_from_adam():
    params = make_params()
    grads = _opposed_grads(params)
    ours, _ = run_purestep(ps.cautious(ps.adam(1e-2)), params, grads)
    assert_histories_close(ours, c_adamw_reference(params, grads, 1e-2, (0.9, 0.999), 1e-8, 0.0))
    plain, _ = run_purestep(ps.adam(1e-2), params, grads)
    assert not torch.allclose(ours[-1]["bias"], plain[-1]["bias"])


def test_cautious_around_adamw_masks_its_decay_too():
    params = make_params()
    grads = _opposed_grads(params)
    ours, _ = run_purestep(ps.cautious(ps.adamw(1e-2, weight_decay=0.5)), params, grads)
    assert_histories_close(ours, c_adamw_reference(params, grads, 1e-2, (0.9, 0.999), 1e-8, 0.5, decay_inside=True))
    outside = c_adamw_reference(params, grads, 1e-2, (0.9, 0.999), 1e-8, 0.5)
    assert not torch.allclose(ours[-1]["bias"], outside[-1]["bias"])


def test_cautious_lion_matches_c_optim_c_lion():
    params = make_params()
    grads = _opposed_grads(params)
    ours, _ = run_purestep(ps.cautious(ps.lion(1e-2, betas=(0.9, 0.99))), params, grads)
    assert_histories_close(ours, c_lion_reference(params, grads, 1e-2, (0.9, 0.99)), rtol=RTOL)


def test_cautious_keeps_the_wrapped_state_and_counts_per_leaf():
    params = {"a": torch.zeros(4, dtype=torch.float64), "b": torch.zeros(2, 2, dtype=torch.float64), "c": torch.zeros((), dtype=torch.float64)}
    grads = {"a": torch.tensor([1.0, -1.0, 0.0, 2.0], dtype=torch.float64),
             "b": torch.tensor([[1.0, 1.0], [1.0, 1.0]], dtype=torch.float64), "c": torch.tensor(3.0, dtype=torch.float64)}
    inner = ps.sgd(1.0, momentum=0.9)
    opt = ps.cautious(inner)
    state = opt.init(params)
    assert torch.utils._pytree.tree_structure(state) == torch.utils._pytree.tree_structure(inner.init(params))
    updates, _ = opt.update(grads, state, params)
    # a: 3 of 4 entries descend (the zero grad does not): ×4/(3+1); b: 4 of 4: ×4/5; c: 1 of 1: ×1/2
    torch.testing.assert_close(updates["a"], torch.tensor([-1.0, 1.0, 0.0, -2.0], dtype=torch.float64))
    torch.testing.assert_close(updates["b"], torch.full((2, 2), -0.8, dtype=torch.float64))
    torch.testing.assert_close(updates["c"], torch.tensor(-1.5, dtype=torch.float64))
    nan = opt.update({**grads, "a": torch.full((4,), float("nan"), dtype=torch.float64)}, state, params)[0]
    assert nan["a"].isnan().all()  # a NaN update stays NaN (apply_if_finite sees it), as in C-Optim


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda: ps.cautious(ps.adam), "transform must be a ps.Transform"),
        (lambda: ps.cautious(ps.adam(1e-3), rescale="sum"), "rescale must be one of"),
        (lambda: ps.cautious(ps.adam(1e-3), before_lr=1), "before_lr must be a bool"),
        (lambda: ps.cautious_adamw(1e-3, betas=(0.9, 1.0)), r"betas\[1\]"),
        (lambda: ps.cautious_adamw(-1e-3), "lr"),
    ],
)
def test_cautious_bad_arguments_raise_naming_them(make, match):
    with pytest.raises(ValueError, match=match):
        make()
