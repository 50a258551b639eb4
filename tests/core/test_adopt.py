"""ADOPT against optax.contrib.adopt (jax on CPU, float64), its first step, decay, low-precision state."""

from __future__ import annotations

import optax
import pytest
import torch

import purestep.core as ps
from tests.core.test_ademamix import run_optax
from tests.core.test_alias import assert_histories_close, assert_moved, grad_stream, make_params, run_purestep

STEPS = 40

CASES = {
    "defaults": (dict(), dict()),
    "no clip": (dict(clip=False), dict(use_clipping=False)),
    "betas, eps": (dict(b1=0.8, b2=0.99, eps=1e-4), dict(b1=0.8, b2=0.99, eps=1e-4)),
}


@pytest.mark.parametrize("name", CASES)
def test_adopt_matches_optax_contrib_adopt(name):
    ours_kw, theirs_kw = CASES[name]
    params = make_params()
    grads = grad_stream(params, steps=STEPS)
    ours, state = run_purestep(ps.adopt(3e-2, **ours_kw), params, grads)
    theirs, their_state = run_optax(optax.contrib.adopt(3e-2, **theirs_kw), params, grads)
    assert_histories_close(ours, theirs)
    assert_moved(ours, params)
    inner = their_state[0]
    for field in ("mu", "nu"):
        for k in params:
            torch.testing.assert_close(getattr(state[0], field)[k], torch.from_numpy(inner._asdict()[field][k].__array__().copy()),
                                       rtol=1e-7, atol=1e-12)


def test_adopt_first_update_is_zero_and_sets_nu_to_g_squared():
    params = make_params()
    g = grad_stream(params, steps=1)[0]
    opt = ps.adopt(0.1, weight_decay=0.0)
    u, state = opt.update(g, opt.init(params), params)
    assert all(torch.equal(u[k], torch.zeros_like(u[k])) for k in u)
    for k in params:
        torch.testing.assert_close(state[0].nu[k], g[k] ** 2)


def test_adopt_weight_decay_is_decoupled_as_adamw():
    params = make_params()
    grads = grad_stream(params, steps=5)
    plain, _ = run_purestep(ps.adopt(1e-2), params, grads)
    decayed, _ = run_purestep(ps.chain(ps.scale_by_adopt(), ps.add_decayed_weights(0.1), ps.scale_by_lr(1e-2)), params, grads)
    ours, _ = run_purestep(ps.adopt(1e-2, weight_decay=0.1), params, grads)
    assert_histories_close(ours, decayed)
    assert not torch.equal(ours[-1]["bias"], plain[-1]["bias"])


def test_adopt_bf16_moments_stay_narrow_and_close_to_float32():
    params = {k: v.float() for k, v in make_params().items()}
    grads = [{k: v.float() for k, v in g.items()} for g in grad_stream(params, steps=20)]
    wide, _ = run_purestep(ps.adopt(1e-2), params, grads)
    narrow, state = run_purestep(ps.adopt(1e-2, mu_dtype=torch.bfloat16, nu_dtype=torch.bfloat16), params, grads)
    assert all(v.dtype == torch.bfloat16 for v in state[0].mu.values())
    assert all(v.dtype == torch.bfloat16 for v in state[0].nu.values())
    for k in params:
        torch.testing.assert_close(narrow[-1][k], wide[-1][k], rtol=0, atol=5e-3)


@pytest.mark.parametrize(
    "make, arg",
    [
        (lambda: ps.adopt(-1.0), "lr"),
        (lambda: ps.adopt(1e-3, b1=1.0), "b1"),
        (lambda: ps.adopt(1e-3, b2=-0.1), "b2"),
        (lambda: ps.adopt(1e-3, eps=0.0), "eps"),
        (lambda: ps.adopt(1e-3, weight_decay=-0.1), "weight_decay"),
        (lambda: ps.adopt(1e-3, clip="yes"), "clip"),
    ],
)
def test_adopt_invalid_hyperparameters_raise_naming_the_argument(make, arg):
    with pytest.raises(ValueError, match=arg):
        make()
