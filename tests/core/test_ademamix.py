"""AdEMAMix against optax.contrib.ademamix (jax on CPU, float64), schedules, low-precision state."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import torch

import purestep.core as ps
from tests.core.test_alias import RTOL, assert_histories_close, assert_moved, grad_stream, make_params, run_purestep

jax.config.update("jax_enable_x64", True)

STEPS = 40


def run_optax(opt, params, grads_list):
    """Params after each step, and optax's final state."""
    jparams = {k: jnp.asarray(v.numpy()) for k, v in params.items()}
    state = opt.init(jparams)
    history = []
    for grads in grads_list:
        updates, state = opt.update({k: jnp.asarray(v.numpy()) for k, v in grads.items()}, state, jparams)
        jparams = optax.apply_updates(jparams, updates)
        history.append({k: torch.from_numpy(np.asarray(v).copy()) for k, v in jparams.items()})
    return history, state


def _alpha(t):  # the paper's linear warmup of α, over 30 steps
    return 5.0 * jnp.minimum(t / 30.0, 1.0) if isinstance(t, jax.Array) else 5.0 * torch.clamp(t / 30.0, max=1.0)


def _b3(t):  # the paper's β₃ warmup from β₁ = 0.9 to 0.999 over 30 steps
    lib = jnp if isinstance(t, jax.Array) else torch
    frac = lib.minimum(t / 30.0, 1.0) if lib is jnp else torch.clamp(t / 30.0, max=1.0)
    lo, hi = np.log(0.9), np.log(0.999)
    return lib.exp(lo * hi / ((1 - frac) * hi + frac * lo))


CASES = {
    "defaults": dict(),
    "decay, eps_root": dict(b1=0.8, b2=0.99, b3=0.995, alpha=2.0, eps=1e-6, weight_decay=0.1, eps_root=1e-10),
    "schedules": dict(b3=_b3, alpha=_alpha, weight_decay=0.01),
}


@pytest.mark.parametrize("name", CASES)
def test_ademamix_matches_optax_contrib_ademamix(name):
    kwargs = CASES[name]
    params = make_params()
    grads = grad_stream(params, steps=STEPS)
    ours, state = run_purestep(ps.ademamix(3e-2, **kwargs), params, grads)
    theirs, their_state = run_optax(optax.contrib.ademamix(3e-2, **kwargs), params, grads)
    assert_histories_close(ours, theirs)
    assert_moved(ours, params)
    their_inner = their_state[0]
    for field in ("m1", "m2", "nu"):
        for k in params:
            torch.testing.assert_close(ps.tree_get(state, field)[k], torch.from_numpy(np.array(getattr(their_inner, field)[k])),
                                       rtol=RTOL, atol=1e-14, msg=lambda m: f"{field}[{k}]: {m}")


def test_scale_by_ademamix_matches_optax_block_and_its_defaults():
    params = make_params()
    grads = grad_stream(params, steps=10)
    ours, _ = run_purestep(ps.chain(ps.scale_by_ademamix(), ps.scale_by_lr(1e-2)), params, grads)
    theirs, _ = run_optax(optax.chain(optax.contrib.scale_by_ademamix(), optax.scale_by_learning_rate(1e-2)), params, grads)
    assert_histories_close(ours, theirs)


def test_ademamix_with_alpha_zero_and_b3_anything_is_adamw():
    params = make_params()
    grads = grad_stream(params, steps=10)
    ours, _ = run_purestep(ps.ademamix(1e-2, b3=0.5, alpha=0.0, weight_decay=0.1), params, grads)
    adamw, _ = run_purestep(ps.adamw(1e-2, weight_decay=0.1), params, grads)
    assert_histories_close(ours, adamw)


def test_ademamix_decay_mask_leaves_masked_leaves_undecayed():
    params = {k: v for k, v in make_params().items()}
    grads = [{k: torch.zeros_like(v) for k, v in params.items()}]
    mask = {k: k != "bias" for k in params}
    ours, _ = run_purestep(ps.ademamix(0.1, weight_decay=0.5, mask=mask), params, grads)
    torch.testing.assert_close(ours[0]["bias"], params["bias"])
    torch.testing.assert_close(ours[0]["conv.weight"], params["conv.weight"] * (1 - 0.1 * 0.5))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn])
def test_ademamix_low_precision_moments_stay_narrow_and_drift_no_more_than_adams(dtype):
    g = torch.Generator().manual_seed(0)
    params = {"w": torch.randn(64, 80, generator=g), "b": torch.randn(80, generator=g)}
    grads = [{k: torch.randn(v.shape, generator=g) for k, v in params.items()} for _ in range(20)]

    def drift(make):  # mean |narrow - float32| over the mean distance moved, for "w"
        wide, _ = run_purestep(make(), params, grads)
        narrow, state = run_purestep(make(mu_dtype=dtype, nu_dtype=dtype), params, grads)
        moved = (wide[-1]["w"] - params["w"]).abs().mean()
        return float((narrow[-1]["w"] - wide[-1]["w"]).abs().mean() / moved), state

    ours, state = drift(lambda **kw: ps.ademamix(1e-2, b3=0.99, **kw))
    adams, _ = drift(lambda **kw: ps.adam(1e-2, **kw))
    for field in ("m1", "m2", "nu"):
        stored = ps.tree_get(state, field)["w"]
        assert (stored.codes if isinstance(stored, ps.QuantizedTensor) else stored).dtype == dtype, field
    assert 0 < ours <= 1.5 * adams, (ours, adams)


def test_ademamix_slow_moment_rounds_with_its_own_bits():
    # m₁ and m₂ of one leaf get the same value on the first step (both EMAs of the same g
    # from 0 with the same decay); stochastic rounding must still draw them apart.
    params = {"w": torch.zeros(4096)}
    g = {"w": torch.randn(4096, generator=torch.Generator().manual_seed(1)) * 1e-3}
    opt = ps.scale_by_ademamix(b1=0.9, b3=0.9, mu_dtype=torch.bfloat16)
    _, state = opt.update(g, opt.init(params))
    assert not torch.equal(state.m1["w"], state.m2["w"])


@pytest.mark.parametrize(
    "make, arg",
    [
        (lambda: ps.ademamix(-1.0), "lr"),
        (lambda: ps.ademamix(1e-3, b1=1.0), "b1"),
        (lambda: ps.ademamix(1e-3, b2=-0.1), "b2"),
        (lambda: ps.ademamix(1e-3, b3=1.5), "b3"),
        (lambda: ps.ademamix(1e-3, alpha=-1.0), "alpha"),
        (lambda: ps.ademamix(1e-3, eps=0.0), "eps"),
        (lambda: ps.ademamix(1e-3, weight_decay=-0.1), "weight_decay"),
        (lambda: ps.ademamix(1e-3, mu_dtype=torch.int8), "mu_dtype"),
    ],
)
def test_ademamix_invalid_hyperparameters_raise_naming_the_argument(make, arg):
    with pytest.raises(ValueError, match=arg):
        make()
