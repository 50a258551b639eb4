"""AdamC against torch.optim.AdamW (constant lr), pytorch_optimizer's AdamC and a per-tensor reference."""

from __future__ import annotations

import pytest
import torch

import purestep.core as ps
from tests.core.test_alias import assert_histories_close, assert_moved, grad_stream, make_params, run_purestep, run_torch

STEPS = 30


def _warmup_then_decay(t):  # up over 5 steps to 1e-2, then linearly down
    return 1e-2 * min((t + 1) / 5, 1.0) * (1 - max(t - 5, 0) / 40)


def reference_adamc(params, grads_list, lrs, b1=0.9, b2=0.999, eps=1e-8, weight_decay=0.0):
    """The rule of `ps.adamc`'s docstring, per tensor in float64."""
    p = {k: v.clone() for k, v in params.items()}
    m = {k: torch.zeros_like(v) for k, v in p.items()}
    v = {k: torch.zeros_like(x) for k, x in p.items()}
    top, history = 0.0, []
    for t, grads in enumerate(grads_list, start=1):
        lr = lrs[t - 1]
        top = max(top, lr)
        for k, g in grads.items():
            m[k] = b1 * m[k] + (1 - b1) * g
            v[k] = b2 * v[k] + (1 - b2) * g * g
            u = (m[k] / (1 - b1**t)) / ((v[k] / (1 - b2**t)).sqrt() + eps)
            p[k] = p[k] - lr * (u + weight_decay * lr / top * p[k])
        history.append({k: x.clone() for k, x in p.items()})
    return history


def test_adamc_at_a_constant_lr_is_torch_adamw():
    params = make_params()
    grads = grad_stream(params, steps=STEPS)
    ours, _ = run_purestep(ps.adamc(1e-2, weight_decay=0.1), params, grads)
    theirs, _ = run_torch(lambda t: torch.optim.AdamW(t.values(), lr=1e-2, weight_decay=0.1, foreach=False), params, grads)
    assert_histories_close(ours, theirs)


def test_adamc_under_warmup_and_decay_matches_the_reference():
    params = make_params()
    grads = grad_stream(params, steps=STEPS)
    ours, state = run_purestep(ps.adamc(_warmup_then_decay, weight_decay=0.5), params, grads)
    lrs = [_warmup_then_decay(t) for t in range(STEPS)]
    assert_histories_close(ours, reference_adamc(params, grads, lrs, weight_decay=0.5), rtol=1e-10)
    assert_moved(ours, params)
    assert float(state[1].max_lr) == pytest.approx(max(lrs))
    plain, _ = run_purestep(ps.adamw(_warmup_then_decay, weight_decay=0.5), params, grads)
    assert not torch.allclose(plain[-1]["bias"], ours[-1]["bias"])  # the decay did follow the lr


def test_adamc_matches_pytorch_optimizer_adamc_from_the_peak():
    pytorch_optimizer = pytest.importorskip("pytorch_optimizer")
    params = make_params()
    grads = grad_stream(params, steps=STEPS)
    lrs = [1e-2 * (1 - t / 40) for t in range(STEPS)]  # starts at its max: their max_lr = the lr at build
    ours, _ = run_purestep(ps.adamc(lambda t: 1e-2 * (1 - t / 40), eps=1e-14, weight_decay=0.5), params, grads)
    theirs, _ = run_torch(lambda t: pytorch_optimizer.AdamC(list(t.values()), lr=1e-2, weight_decay=0.5, eps=1e-14,
                                                            normalized=True, foreach=False), params, grads, lrs=lrs)
    assert_histories_close(ours, theirs, rtol=1e-7)
    assert_moved(ours, params)


@pytest.mark.parametrize(
    "make, arg",
    [(lambda: ps.adamc(-1.0), "lr"), (lambda: ps.adamc(1e-3, b1=1.0), "b1"), (lambda: ps.adamc(1e-3, b2=-1.0), "b2"),
     (lambda: ps.adamc(1e-3, eps=0.0), "eps"), (lambda: ps.adamc(1e-3, weight_decay=-1.0), "weight_decay")],
)
def test_adamc_invalid_hyperparameters_raise_naming_the_argument(make, arg):
    with pytest.raises(ValueError, match=arg):
        make()
