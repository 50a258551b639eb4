"""LaProp against pytorch_optimizer's LaProp and a per-tensor reference (schedules, decay after the step)."""

from __future__ import annotations

import pytest
import torch

import purestep.core as ps
from tests.core.test_alias import assert_histories_close, assert_moved, grad_stream, make_params, run_purestep, run_torch

pytorch_optimizer = pytest.importorskip("pytorch_optimizer")

STEPS = 30


def reference_laprop(params, grads_list, lrs, b1=0.9, b2=0.999, eps=1e-15, weight_decay=0.0):
    """The rule of `ps.laprop`'s docstring, per tensor in float64, lr `lrs[t]` at step t."""
    p = {k: v.clone() for k, v in params.items()}
    m = {k: torch.zeros_like(v) for k, v in p.items()}
    v = {k: torch.zeros_like(x) for k, x in p.items()}
    lr_sum, history = 0.0, []
    for t, grads in enumerate(grads_list, start=1):
        lr = lrs[t - 1]
        lr_sum = b1 * lr_sum + (1 - b1) * lr
        for k, g in grads.items():
            v[k] = b2 * v[k] + (1 - b2) * g * g
            m[k] = b1 * m[k] + (1 - b1) * lr * g / ((v[k] / (1 - b2**t)).sqrt() + eps)
            p[k] = (p[k] - lr * m[k] / lr_sum) * (1 - lr * weight_decay)
        history.append({k: x.clone() for k, x in p.items()})
    return history


def _lrs(t):
    return 1e-2 * (1 - t / 40)


@pytest.mark.parametrize("kwargs", [dict(), dict(b1=0.8, b2=0.99, weight_decay=0.1, eps=1e-8)])
@pytest.mark.parametrize("scheduled", [False, True])
def test_laprop_matches_the_per_tensor_reference(kwargs, scheduled):
    params = make_params()
    grads = grad_stream(params, steps=STEPS)
    lr = _lrs if scheduled else 1e-2
    ours, _ = run_purestep(ps.laprop(lr, **kwargs), params, grads)
    lrs = [_lrs(t) if scheduled else 1e-2 for t in range(STEPS)]
    assert_histories_close(ours, reference_laprop(params, grads, lrs, **kwargs), rtol=1e-10)
    assert_moved(ours, params)


@pytest.mark.parametrize("kwargs", [dict(), dict(betas=(0.8, 0.99), weight_decay=0.1)])
def test_laprop_matches_pytorch_optimizer_laprop_under_a_schedule(kwargs):
    params = make_params()
    grads = grad_stream(params, steps=STEPS)
    ours_kw = dict(kwargs)
    if "betas" in ours_kw:
        ours_kw["b1"], ours_kw["b2"] = ours_kw.pop("betas")
    ours, _ = run_purestep(ps.laprop(_lrs, **ours_kw), params, grads)
    lrs = [_lrs(t) for t in range(STEPS)]
    theirs, _ = run_torch(lambda t: pytorch_optimizer.LaProp(list(t.values()), lr=lrs[0], foreach=False, **kwargs),
                          params, grads, lrs=lrs)
    assert_histories_close(ours, theirs, rtol=1e-7)
    assert_moved(ours, params)


def test_laprop_at_lr_zero_stays_finite_and_still():
    params = make_params()
    ours, _ = run_purestep(ps.laprop(0.0), params, grad_stream(params, steps=3))
    for k in params:
        assert torch.equal(ours[-1][k], params[k])


@pytest.mark.parametrize(
    "make, arg",
    [(lambda: ps.laprop(-1.0), "lr"), (lambda: ps.laprop(1e-3, b1=1.0), "b1"), (lambda: ps.laprop(1e-3, b2=2.0), "b2"),
     (lambda: ps.laprop(1e-3, eps=0.0), "eps"), (lambda: ps.laprop(1e-3, weight_decay=-1.0), "weight_decay")],
)
def test_laprop_invalid_hyperparameters_raise_naming_the_argument(make, arg):
    with pytest.raises(ValueError, match=arg):
        make()
