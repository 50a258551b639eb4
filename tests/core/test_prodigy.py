"""Prodigy against optax.contrib.prodigy (jax on CPU, float64), its d-estimate and its edge cases."""

from __future__ import annotations

import numpy as np
import optax
import pytest
import torch

import purestep.core as ps
from tests.core.test_ademamix import run_optax
from tests.core.test_alias import assert_histories_close, assert_moved, grad_stream, make_params, run_purestep

STEPS = 40

CASES = {
    "defaults": (dict(), dict()),
    "decay, d0, coef": (dict(weight_decay=0.1, d0=1e-3, d_coef=0.5, eps=1e-6),
                        dict(weight_decay=0.1, estim_lr0=1e-3, estim_lr_coef=0.5, eps=1e-6)),
    "betas, safeguard": (dict(b1=0.8, b2=0.99, beta3=0.9, safeguard_warmup=True, d0=1e-4),
                         dict(betas=(0.8, 0.99), beta3=0.9, safeguard_warmup=True, estim_lr0=1e-4)),
    "schedule": (dict(lr=lambda t: 0.5 + 0.5 * t / 40, d0=1e-4), dict(learning_rate=lambda t: 0.5 + 0.5 * t / 40, estim_lr0=1e-4)),
}


def _quadratic_runs(ours_opt, theirs_opt, steps=STEPS):
    """Both optimizers on f(p) = Σ w·(p - target)² (grads from each one's own params, so d
    has a distance to estimate): params after each step, and both final states."""
    import jax.numpy as jnp

    params = make_params()
    target = {k: v + 1.0 for k, v in make_params(seed=3).items()}
    weight = {k: torch.rand(v.shape, generator=torch.Generator().manual_seed(4), dtype=torch.float64) + 0.5
              for k, v in params.items()}
    ours, theirs = [], []
    p, state = dict(params), ours_opt.init(params)
    jp = {k: jnp.asarray(v.numpy()) for k, v in params.items()}
    jstate = theirs_opt.init(jp)
    for _ in range(steps):
        u, state = ours_opt.update({k: 2 * weight[k] * (p[k] - target[k]) for k in p}, state, p)
        p = ps.apply_updates(p, u)
        ours.append(p)
        jg = {k: 2 * jnp.asarray(weight[k].numpy()) * (jp[k] - jnp.asarray(target[k].numpy())) for k in jp}
        ju, jstate = theirs_opt.update(jg, jstate, jp)
        jp = optax.apply_updates(jp, ju)
        theirs.append({k: torch.from_numpy(np.asarray(v).copy()) for k, v in jp.items()})
    return params, ours, theirs, state, jstate


@pytest.mark.parametrize("name", CASES)
def test_prodigy_matches_optax_contrib_prodigy(name):
    ours_kw, theirs_kw = CASES[name]
    params, ours, theirs, state, their_state = _quadratic_runs(ps.prodigy(**ours_kw), optax.contrib.prodigy(**theirs_kw))
    assert_histories_close(ours, theirs, rtol=1e-6)
    assert_moved(ours, params)
    assert float(state.estim_lr) > 10 * ours_kw.get("d0", 1e-6)  # d grew
    np.testing.assert_allclose(float(state.estim_lr), float(their_state.estim_lr), rtol=1e-6)
    np.testing.assert_allclose(float(state.numerator_weighted), float(their_state.numerator_weighted), rtol=1e-6)


def test_prodigy_matches_optax_on_random_grads():
    params = make_params()
    grads = grad_stream(params, steps=STEPS)
    ours, _ = run_purestep(ps.prodigy(d0=1e-3, weight_decay=0.1), params, grads)
    theirs, _ = run_optax(optax.contrib.prodigy(estim_lr0=1e-3, weight_decay=0.1), params, grads)
    assert_histories_close(ours, theirs, rtol=1e-6)
    assert_moved(ours, params)


def test_prodigy_zero_grads_keep_d_and_stay_finite():
    params = make_params()
    opt = ps.prodigy()
    state = opt.init(params)
    for _ in range(3):
        u, state = opt.update({k: torch.zeros_like(v) for k, v in params.items()}, state, params)
        assert all(torch.isfinite(x).all() for x in u.values())
    assert float(state.estim_lr) == 1e-6


def test_prodigy_init_copies_the_params():
    params = make_params()
    state = ps.prodigy().init(params)
    with torch.no_grad():
        params["bias"].add_(1.0)
    assert not torch.equal(state.params0["bias"], params["bias"])


@pytest.mark.parametrize(
    "make, arg",
    [
        (lambda: ps.prodigy(lr=-1.0), "lr"),
        (lambda: ps.prodigy(b1=1.0), "b1"),
        (lambda: ps.prodigy(beta3=1.5), "beta3"),
        (lambda: ps.prodigy(d0=0.0), "d0"),
        (lambda: ps.prodigy(d_coef=-1.0), "d_coef"),
        (lambda: ps.prodigy(weight_decay=-0.1), "weight_decay"),
        (lambda: ps.prodigy(safeguard_warmup=1), "safeguard_warmup"),
    ],
)
def test_prodigy_invalid_hyperparameters_raise_naming_the_argument(make, arg):
    with pytest.raises(ValueError, match=arg):
        make()
