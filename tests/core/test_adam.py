"""Adam's rule is written once (core/_adam.py): each registered implementation equals the
definition, and the optimizers that reuse it compute Adam where they should."""

from __future__ import annotations

import pytest
import torch

import purestep.core as ps
from purestep.core import _adam as adam


def _leaves(dtype, seed, shapes=((64, 33), (7,), (), (300, 5), (1, 1))):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g, dtype=torch.float64).to(dtype) for s in shapes]


def _tol(dtype):
    return dict(rtol=1e-6, atol=1e-7) if dtype == torch.float32 else dict(rtol=1e-12, atol=1e-14)


def test_the_registry_names_the_definition_and_the_eager_kernels():
    assert set(adam.IMPLEMENTATIONS) == {"definition", "leafwise", "apply_leafwise", "apply_fused"}
    assert adam.IMPLEMENTATIONS["definition"] is adam.definition


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("tensor_betas", [False, True], ids=["float betas", "0-d tensor betas"])
def test_leafwise_equals_the_definition_over_many_steps(dtype, tensor_betas):
    gs_steps = [_leaves(dtype, seed) for seed in range(1, 9)]
    b1, b2, eps = 0.9, 0.99, 1e-8
    if tensor_betas:
        b1, b2 = torch.tensor(b1, dtype=torch.float64), torch.tensor(b2, dtype=torch.float64)
    mu_d = [torch.zeros_like(x) for x in gs_steps[0]]
    nu_d = [torch.zeros_like(x) for x in gs_steps[0]]
    mu_l, nu_l = [m.clone() for m in mu_d], [v.clone() for v in nu_d]
    for step, gs in enumerate(gs_steps):
        bc1, bc2 = adam.bias_corrections(torch.tensor(step), b1, b2)
        mu_d, nu_d, u_d = adam.definition(None, gs, gs, mu_d, nu_d, b1, b2, bc1, bc2, eps)
        mu_l, nu_l, u_l = adam.leafwise(gs, mu_l, nu_l, b1, b2, bc1, bc2, eps)
        for a, b in zip(mu_l + nu_l + u_l, mu_d + nu_d + u_d):
            assert a.dtype == b.dtype and a.shape == b.shape
            torch.testing.assert_close(a, b, **_tol(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("decay", [1.0, 1.0 - 1e-3 * 0.1], ids=["no decay", "decoupled decay"])
@pytest.mark.parametrize("kernel", ["apply_leafwise", "apply_fused"])
def test_apply_leafwise_equals_the_definition_applied(dtype, decay, kernel):
    b1, b2, eps, lr = 0.9, 0.999, 1e-8, 1e-3
    p_d = _leaves(dtype, 0)
    p_l = [p.clone() for p in p_d]
    mu_d, nu_d = [torch.zeros_like(x) for x in p_d], [torch.zeros_like(x) for x in p_d]
    mu_l, nu_l = [m.clone() for m in mu_d], [v.clone() for v in nu_d]
    for step in range(8):
        gs = _leaves(dtype, 10 + step)
        t = torch.tensor(step + 1, dtype=torch.float64)
        bc1, bc2 = 1.0 - b1**t, 1.0 - b2**t
        mu_d, nu_d, u = adam.definition(None, gs, gs, mu_d, nu_d, b1, b2, bc1, bc2, eps)
        p_d = [decay * p - lr * x for p, x in zip(p_d, u)]
        if kernel == "apply_leafwise":
            adam.apply_leafwise(gs, mu_l, nu_l, p_l, b1, b2, bc1, bc2, eps, decay, -lr)  # in place
        else:
            assert adam.apply_fused(gs, mu_l, nu_l, p_l, b1, b2, t, eps, decay, -lr)
        for a, b in zip(mu_l + nu_l + p_l, mu_d + nu_d + p_d):
            torch.testing.assert_close(a, b, **_tol(dtype))


def test_scale_by_adam_takes_each_implementation_where_it_applies_and_they_agree():
    # Eager CPU with plain moments runs "leafwise" (and, donated, "apply_leafwise"); under
    # torch.func.vmap the definition runs: all three give Adam's updates.
    params = {f"w{i}": x for i, x in enumerate(_leaves(torch.float32, 0))}
    opt = ps.adamw(1e-2, weight_decay=0.1)
    pure, donated = ps.make_update(opt), ps.make_update(opt, donate=True)
    p1, s1 = {k: v.clone() for k, v in params.items()}, opt.init(params)
    p2, s2 = {k: v.clone() for k, v in params.items()}, opt.init(params)
    batched = {k: v[None].clone() for k, v in params.items()}
    s3 = torch.func.vmap(opt.init)(batched)
    vmapped = torch.func.vmap(pure)
    for step in range(6):
        grads = {k: v for k, v in zip(params, _leaves(torch.float32, 20 + step))}
        p1, s1 = pure(p1, grads, s1)
        donated(p2, grads, s2)
        batched, s3 = vmapped(batched, {k: v[None] for k, v in grads.items()}, s3)
    for k in params:
        torch.testing.assert_close(p2[k], p1[k], rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(batched[k][0], p1[k], rtol=1e-6, atol=1e-7)


def test_ademamix_without_its_slow_momentum_is_adam():
    params = {f"w{i}": x for i, x in enumerate(_leaves(torch.float64, 0))}
    mix = ps.scale_by_ademamix(b1=0.9, b2=0.99, b3=0.999, alpha=0.0, eps=1e-8)
    ref = ps.scale_by_adam(b1=0.9, b2=0.99, eps=1e-8)
    s_mix, s_ref = mix.init(params), ref.init(params)
    for step in range(6):
        grads = {k: v for k, v in zip(params, _leaves(torch.float64, 30 + step))}
        u_mix, s_mix = mix.update(grads, s_mix, params)
        u_ref, s_ref = ref.update(grads, s_ref, params)
        for k in params:
            torch.testing.assert_close(u_mix[k], u_ref[k], rtol=1e-12, atol=1e-14)


def test_apply_fused_declines_what_its_kernel_does_not_take():
    """torch's fused kernel walks each tensor's storage and reads Python scalars: a strided
    leaf, a zero lr or a scalar autograd records go to `apply_leafwise` (nothing changed)."""
    gs = _leaves(torch.float32, 1)
    ps_ = _leaves(torch.float32, 2)
    mu, nu = [torch.zeros_like(x) for x in ps_], [torch.zeros_like(x) for x in ps_]
    before = [p.clone() for p in ps_]
    t = torch.tensor(1.0, dtype=torch.float64)
    strided = [p.t() if p.dim() == 2 and p.shape[0] != p.shape[1] else p for p in ps_]
    strided_g = [g.t() if g.dim() == 2 and g.shape[0] != g.shape[1] else g for g in gs]
    strided_m = [m.t() if m.dim() == 2 and m.shape[0] != m.shape[1] else m for m in mu]
    strided_v = [v.t() if v.dim() == 2 and v.shape[0] != v.shape[1] else v for v in nu]
    assert not adam.apply_fused(strided_g, strided_m, strided_v, strided, 0.9, 0.999, t, 1e-8, 1.0, -1e-3)
    assert not adam.apply_fused(gs, mu, nu, ps_, 0.9, 0.999, t, 1e-8, 1.0, 0.0)
    lr = torch.tensor(-1e-3, dtype=torch.float64, requires_grad=True)
    assert not adam.apply_fused(gs, mu, nu, ps_, 0.9, 0.999, t, 1e-8, 1.0, lr)
    assert all(torch.equal(a, b) for a, b in zip(ps_, before))
    assert all(torch.count_nonzero(m) == 0 for m in mu + nu)


def test_one_dispatch_names_the_kernel_scale_by_adam_runs(monkeypatch):
    leaves = lambda *shape: [torch.randn(*shape) for _ in range(4)]  # noqa: E731  (gs, mu, nu, params)
    t = torch.tensor(3.0, dtype=torch.float64)
    assert adam.kernel(None, 0.9, 0.999, 1e-8) == "definition"  # moments not plain (low precision, amsgrad)
    assert adam.kernel(leaves(3, 2), 0.9, 0.999, 1e-8) == "leafwise"
    assert adam.kernel(leaves(3, 2), 0.9, 0.999, 1e-8, 0.99, -1e-3, t=t) == "apply_fused"
    strided = [x.t() for x in leaves(3, 2)]  # the fused kernel walks storage: not contiguous
    assert adam.kernel(strided, 0.9, 0.999, 1e-8, 0.99, -1e-3, t=t) == "apply_leafwise"
    assert adam.kernel(leaves(3, 2), 0.9, 0.999, 1e-8, 0.99, 0.0, t=t) == "apply_leafwise"  # lr 0: no fused step
    # scale_by_adam runs what the dispatch names: each registered kernel, counted.
    ran = []
    for name, fn in list(adam.IMPLEMENTATIONS.items()):
        monkeypatch.setitem(adam.IMPLEMENTATIONS, name, lambda *a, _n=name, _f=fn: ran.append(_n) or _f(*a))
    params = {"w": torch.randn(3, 2)}
    opt = ps.adamw(1e-3, weight_decay=0.1)
    update = ps.make_update(opt, donate=True)
    params, state = update(params, {"w": torch.randn(3, 2)}, opt.init(params))
    opt.update({"w": torch.randn(3, 2)}, state, params)
    ps.adam(1e-3, mu_dtype=torch.bfloat16).update({"w": torch.randn(3, 2)}, ps.adam(1e-3, mu_dtype=torch.bfloat16).init(params), params)
    assert ran == ["apply_fused", "leafwise", "definition"]
