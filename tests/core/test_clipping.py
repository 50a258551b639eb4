"""Clipping against torch.nn.utils (clip_grad_norm_, clip_grad_value_) and optax (adaptive_grad_clip)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import purestep.core as ps


def _tree(dtype, scale, seed=0):
    g = torch.Generator().manual_seed(seed)
    shapes = {"emb": (11, 6), "layers.0.w": (6, 6), "layers.0.b": (6,), "conv": (4, 3, 3, 3), "gain": ()}
    return {k: (torch.randn(s, generator=g, dtype=torch.float64) * scale).to(dtype) for k, s in shapes.items()}


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("scale", [1e-3, 1.0, 50.0])
@pytest.mark.parametrize("max_norm", [1.0, 0.25])
def test_clip_by_global_norm_matches_clip_grad_norm(dtype, scale, max_norm):
    grads = _tree(dtype, scale)
    torch_params = [torch.nn.Parameter(torch.zeros_like(g)) for g in grads.values()]
    for p, g in zip(torch_params, grads.values()):
        p.grad = g.clone()
    ref_norm = torch.nn.utils.clip_grad_norm_(torch_params, max_norm)

    t = ps.clip_by_global_norm(max_norm)
    updates, state = t.update(grads, t.init(grads))
    exact = dict(rtol=0, atol=0) if dtype == torch.float64 else dict(rtol=1e-6, atol=0)
    torch.testing.assert_close(state.norm, ref_norm.to(state.norm.dtype), **exact)
    for (k, u), p in zip(updates.items(), torch_params):
        assert u.dtype == dtype, k
        torch.testing.assert_close(u, p.grad, **exact)
    if scale * math.sqrt(sum(g.numel() for g in grads.values())) > 2 * max_norm:
        assert ps.tree_global_norm(updates) <= max_norm  # actually clipped


def test_clip_by_global_norm_keeps_the_state_dtype_and_leaves_inputs_alone():
    grads = _tree(torch.bfloat16, 10.0)
    copy = {k: v.clone() for k, v in grads.items()}
    t = ps.clip_by_global_norm(1.0)
    s0 = t.init(grads)
    updates, s1 = t.update(grads, s0)
    assert s0.norm.dtype == s1.norm.dtype == torch.float32
    assert all(u.dtype == torch.bfloat16 for u in updates.values())
    assert all(torch.equal(grads[k], copy[k]) for k in grads)


def test_clip_by_global_norm_accepts_a_tensor_max_norm():
    grads = _tree(torch.float64, 5.0)
    t = ps.clip_by_global_norm(torch.tensor(0.5, dtype=torch.float64))
    updates, _ = t.update(grads, t.init(grads))
    assert ps.tree_global_norm(updates) == pytest.approx(0.5, rel=1e-5)


def test_clip_by_global_norm_runs_per_leaf_under_vmap():
    grads = {k: v.expand(3, *v.shape).clone() * torch.tensor([0.01, 1.0, 100.0], dtype=torch.float64).view(3, *[1] * v.dim())
             for k, v in _tree(torch.float64, 1.0).items()}
    t = ps.clip_by_global_norm(1.0)

    def one(g):
        return t.update(g, t.init(g))

    updates, state = torch.func.vmap(one)(grads)
    for i in range(3):
        gi = {k: v[i] for k, v in grads.items()}
        ui, si = one(gi)
        torch.testing.assert_close(state.norm[i], si.norm)
        for k in gi:
            torch.testing.assert_close(updates[k][i], ui[k])


@pytest.mark.parametrize("clip", [0.05, 1.0])
def test_clip_by_value_matches_clip_grad_value(clip):
    grads = _tree(torch.float32, 1.0)
    torch_params = [torch.nn.Parameter(torch.zeros_like(g)) for g in grads.values()]
    for p, g in zip(torch_params, grads.values()):
        p.grad = g.clone()
    torch.nn.utils.clip_grad_value_(torch_params, clip)
    t = ps.clip_by_value(clip)
    updates, _ = t.update(grads, t.init(grads))
    for u, p in zip(updates.values(), torch_params):
        torch.testing.assert_close(u, p.grad, rtol=0, atol=0)


# --------------------------------------------------------------------------- #
# adaptive_clip = optax.adaptive_grad_clip
# --------------------------------------------------------------------------- #

jax = pytest.importorskip("jax")
jax.config.update("jax_enable_x64", True)
optax = pytest.importorskip("optax")


def _optax_agc(grads, params, clipping, eps, axis=None):
    t = optax.adaptive_grad_clip(clipping, eps, axis=axis)
    g = {k: jax.numpy.asarray(v.numpy()) for k, v in grads.items()}
    p = {k: jax.numpy.asarray(v.numpy()) for k, v in params.items()}
    out, _ = t.update(g, t.init(p), p)
    return {k: torch.from_numpy(np.array(v)) for k, v in out.items()}


@pytest.mark.parametrize("clipping,eps", [(0.01, 1e-3), (0.3, 1e-3), (1.0, 0.5)])
def test_adaptive_clip_matches_optax_on_transposed_layouts(clipping, eps):
    params = _tree(torch.float64, 1.0, seed=1)
    params["zero"] = torch.zeros(5, 4, dtype=torch.float64)  # eps floor engages
    grads = _tree(torch.float64, 30 * clipping, seed=2)
    grads["zero"] = torch.randn(5, 4, dtype=torch.float64)
    t = ps.adaptive_clip(clipping, eps)
    ours, _ = t.update(grads, t.init(params), params)

    # optax's units: axis 0 of (in, out) matrices and (0, 1, 2) of HWIO kernels.
    def to_jax(k, v):
        return v.T if v.dim() == 2 else v.permute(2, 3, 1, 0) if v.dim() == 4 else v

    def from_jax(k, v):
        return v.T if v.dim() == 2 else v.permute(3, 2, 0, 1) if v.dim() == 4 else v

    ref = _optax_agc({k: to_jax(k, v).contiguous() for k, v in grads.items()},
                     {k: to_jax(k, v).contiguous() for k, v in params.items()}, clipping, eps)
    clipped = 0
    for k in grads:
        torch.testing.assert_close(ours[k], from_jax(k, ref[k]), rtol=1e-12, atol=0)
        clipped += int(not torch.equal(ours[k], grads[k]))
    assert clipped >= 2


def test_adaptive_clip_with_an_explicit_axis_matches_optax():
    params = {"w": torch.randn(7, 3, dtype=torch.float64)}
    grads = {"w": torch.randn(7, 3, dtype=torch.float64)}
    t = ps.adaptive_clip(0.2, axis=0)
    ours, _ = t.update(grads, t.init(params), params)
    torch.testing.assert_close(ours["w"], _optax_agc(grads, params, 0.2, 1e-3, axis=0)["w"], rtol=1e-12, atol=0)


def test_adaptive_clip_needs_params():
    t = ps.adaptive_clip()
    g = {"w": torch.ones(2, 2)}
    with pytest.raises(ValueError, match="params"):
        t.update(g, t.init(g))


# --------------------------------------------------------------------------- #
# clip_by_running_norm against a plain float64 loop of its documented rule
# --------------------------------------------------------------------------- #


def _running_norm_reference(norms, factor, beta, warmup):
    m, coefs = 0.0, []
    for c, n in enumerate(norms):
        if c < warmup:
            coef = 1.0
        else:
            coef = min(1.0, factor * m / (1 - beta**c) / (n + 1e-6))
        m = beta * m + (1 - beta) * n * coef
        coefs.append(coef)
    return coefs


def test_clip_by_running_norm_follows_its_documented_rule():
    factor, beta, warmup = 1.5, 0.9, 4
    scales = [1.0, 2.0, 1.0, 1.5, 1.2, 30.0, 1.0, 0.5, 4.0, 100.0, 1.0, 1.1]
    base = _tree(torch.float64, 1.0)
    base_norm = ps.tree_global_norm(base).item()
    coefs = _running_norm_reference([s * base_norm for s in scales], factor, beta, warmup)
    t = ps.clip_by_running_norm(factor, beta, warmup)
    state = t.init(base)
    for i, s in enumerate(scales):
        grads = {k: v * s for k, v in base.items()}
        updates, state = t.update(grads, state)
        assert state.norm.item() == pytest.approx(s * base_norm, rel=1e-12)
        for k in grads:
            torch.testing.assert_close(updates[k], grads[k] * coefs[i], rtol=1e-10, atol=0)
    assert coefs[:warmup] == [1.0] * warmup and coefs[5] < 0.2 and coefs[9] < 0.05  # spikes were clipped
    assert state.count.item() == len(scales)


# --------------------------------------------------------------------------- #
# Bad input.
# --------------------------------------------------------------------------- #


@pytest.mark.parametrize(
    "make,name",
    [
        (lambda: ps.clip_by_global_norm(0.0), "max_norm"),
        (lambda: ps.clip_by_global_norm(-1.0), "max_norm"),
        (lambda: ps.clip_by_global_norm(lambda t: 1.0), "max_norm"),
        (lambda: ps.clip_by_value(0.0), "max_abs"),
        (lambda: ps.adaptive_clip(0.0), "clipping"),
        (lambda: ps.adaptive_clip(0.1, eps=-1.0), "eps"),
        (lambda: ps.clip_by_running_norm(factor=0.0), "factor"),
        (lambda: ps.clip_by_running_norm(beta=1.0), "beta"),
        (lambda: ps.clip_by_running_norm(warmup_steps=0), "warmup_steps"),
    ],
)
def test_bad_arguments_raise_value_error_naming_the_argument(make, name):
    with pytest.raises(ValueError, match=name):
        make()


# --------------------------------------------------------------------------- #
# Invariant over drawn trees: the clipped norm is at most max_norm, the direction kept.
# --------------------------------------------------------------------------- #

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402


@settings(max_examples=40, deadline=None)
@given(
    st.lists(st.lists(st.floats(-1e6, 1e6), min_size=1, max_size=6), min_size=1, max_size=4),
    st.floats(1e-3, 1e3),
    st.sampled_from([torch.float32, torch.float64]),
)
def test_clipped_global_norm_is_at_most_max_norm_and_the_direction_is_kept(rows, max_norm, dtype):
    grads = {f"g{i}": torch.tensor(r, dtype=dtype) for i, r in enumerate(rows)}
    t = ps.clip_by_global_norm(max_norm)
    updates, state = t.update(grads, t.init(grads))
    before = torch.cat([g.double() for g in grads.values()])
    after = torch.cat([u.double() for u in updates.values()])
    assert after.norm() <= max_norm * (1 + 1e-5)
    assert state.norm.item() == pytest.approx(before.norm().item(), rel=1e-5)
    coef = (after.norm() / before.norm()).item() if before.norm() > 0 else 1.0
    assert coef <= 1 + 1e-6
    torch.testing.assert_close(after, before * coef, rtol=1e-5, atol=1e-30)
