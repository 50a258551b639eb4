"""Sophia against the official SophiaG (`sophia-opt`), its clipping, and the GNB estimate."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from sophia_opt import SophiaG

import purestep.core as ps

STEPS = 20
BS = 16  # the official optimizer's `bs`: its hessian EMA is of ĝ², used as bs·ĝ²


def make_params(seed=0):
    g = torch.Generator().manual_seed(seed)
    shapes = {"bias": (7,), "layers.0.weight": (5, 3), "conv.weight": (4, 3, 2, 2)}
    return {k: torch.randn(*s, generator=g, dtype=torch.float64) for k, s in shapes.items()}


def grad_stream(params, steps=STEPS, seed=1, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return [{k: scale * torch.randn(v.shape, generator=g, dtype=v.dtype) for k, v in params.items()} for _ in range(steps)]


CASES = [
    dict(lr=0.01, weight_decay=0.1, update_every=4),
    dict(lr=0.02, betas=(0.9, 0.95), rho=0.1, weight_decay=0.0, update_every=3),
    dict(lr=0.01, rho=0.01, update_every=1),
]


@pytest.mark.parametrize("kwargs", CASES, ids=lambda k: ",".join(f"{a}={b}" for a, b in k.items()))
def test_sophia_matches_official_sophiag_with_hessian_refreshes(kwargs):
    k = kwargs["update_every"]
    params = make_params()
    grads = grad_stream(params)
    # ĝ: the gradient of a loss on sampled labels; small enough that the clip is active on some entries only.
    ghats = grad_stream(params, seed=2, scale=0.3)
    tensors = {n: nn.Parameter(v.clone()) for n, v in params.items()}
    ref_kwargs = {a: b for a, b in kwargs.items() if a != "update_every"}
    ref = SophiaG(list(tensors.values()), **ref_kwargs)
    opt = ps.sophia(**kwargs)
    state, ours = opt.init(params), params
    clipped = unclipped = 0
    for step, g in enumerate(grads):
        extra = {}
        if step % k == 0:  # refresh: the official loop calls update_hessian() with ĝ in .grad
            for n, p in tensors.items():
                p.grad = ghats[step][n].clone()
            ref.update_hessian()
            extra = {"hessian": {n: BS * v * v for n, v in ghats[step].items()}}
        for n, p in tensors.items():
            p.grad = g[n].clone()
        ref.step(bs=BS)
        updates, state = opt.update(g, state, ours, **extra)
        ours = ps.apply_updates(ours, updates)
        for n, p in tensors.items():
            torch.testing.assert_close(ours[n], p.detach(), rtol=1e-10, atol=1e-13, msg=lambda m: f"step {step}, {n}: {m}")
        step_size = torch.cat([(u / kwargs["lr"]).abs().flatten() for u in updates.values()])
        clipped += int((step_size > 0.999).sum())
        unclipped += int((step_size < 0.9).sum())
    assert clipped > 0 and unclipped > 0  # both branches of the clip were exercised
    mu = ps.tree_get(state, "mu")
    for n, p in tensors.items():
        torch.testing.assert_close(mu[n], ref.state[p]["exp_avg"], rtol=1e-10, atol=1e-14)
        torch.testing.assert_close(ps.tree_get(state, "hessian")[n], BS * ref.state[p]["hessian"], rtol=1e-10, atol=1e-14)


def test_sophia_updates_never_exceed_lr_elementwise():
    params = make_params()
    lr = 0.01
    opt = ps.sophia(lr=lr, weight_decay=0.0, update_every=2)
    state = opt.init(params)
    for step, g in enumerate(grad_stream(params, seed=5, scale=100.0)):
        h = {n: torch.full_like(v, 1e-12) for n, v in params.items()} if step % 2 == 0 else None
        updates, state = opt.update(g, state, params, **({} if h is None else {"hessian": h}))
        for n, u in updates.items():
            assert u.abs().max() <= lr * (1 + 1e-12), n
            assert u.abs().max() >= lr * 0.999, n  # with a tiny curvature every entry is clipped


def test_an_update_without_hessian_keeps_the_estimate_and_off_schedule_ones_are_ignored():
    params = make_params()
    opt = ps.scale_by_sophia(update_every=3)
    g = grad_stream(params, 4)
    h = {n: torch.ones_like(v) for n, v in params.items()}
    _, s1 = opt.update(g[0], opt.init(params), hessian=h)  # update 0: refreshed
    _, s2 = opt.update(g[1], s1)  # no hessian: kept
    _, s3 = opt.update(g[2], s2, hessian={n: 5 * v for n, v in h.items()})  # update 2: not due, ignored
    _, s4 = opt.update(g[3], s3, hessian=h)  # update 3: refreshed again
    for n in params:
        torch.testing.assert_close(s1.hessian[n], torch.full_like(h[n], 0.01))
        assert torch.equal(s2.hessian[n], s1.hessian[n]) and torch.equal(s3.hessian[n], s1.hessian[n])
        torch.testing.assert_close(s4.hessian[n], torch.full_like(h[n], 0.99 * 0.01 + 0.01))


def test_a_hessian_tree_that_does_not_match_the_params_raises_naming_the_leaf():
    params = make_params()
    opt = ps.sophia()
    state = opt.init(params)
    g = grad_stream(params, 1)[0]
    bad_shape = dict(g, **{"layers.0.weight": torch.ones(3, 5, dtype=torch.float64)})
    with pytest.raises(ValueError, match=r"hessian leaf 'layers\.0\.weight' has shape"):
        opt.update(g, state, params, hessian=bad_shape)
    missing = {n: v for n, v in g.items() if n != "conv.weight"}
    with pytest.raises(ValueError, match=r"hessian has no leaf 'conv\.weight'"):
        opt.update(g, state, params, hessian=missing)


@pytest.mark.parametrize(
    "kwargs,name",
    [
        (dict(lr=-1.0), "lr"),
        (dict(betas=(0.965, 1.0)), "betas"),
        (dict(rho=-0.1), "rho"),
        (dict(weight_decay=-0.1), "weight_decay"),
        (dict(eps=0.0), "eps"),
        (dict(update_every=0), "update_every"),
        (dict(update_every=2.0), "update_every"),
    ],
)
def test_invalid_sophia_arguments_raise_naming_the_argument(kwargs, name):
    with pytest.raises(ValueError, match=name):
        ps.sophia(**kwargs)


# --------------------------------------------------------------------------- #
# The Gauss-Newton-Bartlett estimate.
# --------------------------------------------------------------------------- #


def linear_softmax(params, x):
    return x @ params["w"] + params["b"]


def test_gnb_hessian_on_linear_softmax_equals_the_direct_computation():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(12, 5, generator=g, dtype=torch.float64)
    params = {"w": torch.randn(5, 4, generator=g, dtype=torch.float64), "b": torch.randn(4, generator=g, dtype=torch.float64)}
    labels = torch.randint(0, 4, (12,), generator=g)
    h = ps.gnb_hessian(linear_softmax, params, x, labels=labels)
    # ∂ mean CE / ∂W = Xᵀ(softmax(XW + b) - Y) / B,  ∂/∂b = Σ_rows (softmax - Y) / B;  estimate B·ĝ²
    residual = torch.softmax(x @ params["w"] + params["b"], dim=-1) - nn.functional.one_hot(labels, 4).double()
    gw, gb = x.T @ residual / 12, residual.sum(0) / 12
    torch.testing.assert_close(h["w"], 12 * gw * gw, rtol=1e-12, atol=0)
    torch.testing.assert_close(h["b"], 12 * gb * gb, rtol=1e-12, atol=0)
    # and equal to autograd's gradient of the sampled-label loss
    ghat = torch.func.grad(lambda p: nn.functional.cross_entropy(linear_softmax(p, x), labels))(params)
    torch.testing.assert_close(h["w"], 12 * ghat["w"] ** 2, rtol=1e-12, atol=1e-15)


def test_gnb_hessian_samples_labels_from_the_models_own_distribution():
    rows = 20000
    logits = torch.tensor([2.0, 0.5, -1.0, 0.0], dtype=torch.float64)
    fn = lambda p, batch: batch + p["shift"]  # noqa: E731  ∂ mean CE/∂shift = softmax - label frequencies
    params = {"shift": torch.zeros(4, dtype=torch.float64)}
    batch = logits.expand(rows, 4)
    h = ps.gnb_hessian(fn, params, batch, generator=torch.Generator().manual_seed(0))
    ghat = (h["shift"] / rows).sqrt()
    assert ghat.max() < 0.015, ghat  # frequencies within ~4σ of softmax(logits)
    again = ps.gnb_hessian(fn, params, batch, generator=torch.Generator().manual_seed(0))
    assert torch.equal(h["shift"], again["shift"])  # same generator, same labels
    skewed = ps.gnb_hessian(fn, params, batch, labels=torch.zeros(rows, dtype=torch.long))
    assert (skewed["shift"] / rows).sqrt().max() > 0.2  # a wrong label distribution shows


def test_sophia_with_gnb_hessian_trains_softmax_regression():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(256, 8, generator=g)
    true_w = 3 * torch.randn(8, 5, generator=g)
    y = torch.argmax(x @ true_w, dim=-1)
    params = {"w": torch.zeros(8, 5), "b": torch.zeros(5)}
    opt = ps.sophia(lr=0.05, weight_decay=0.0, update_every=5)
    state = opt.init(params)
    loss_fn = lambda p: nn.functional.cross_entropy(linear_softmax(p, x), y)  # noqa: E731
    losses = []
    for step in range(60):
        grads, loss = torch.func.grad_and_value(loss_fn)(params)
        extra = {"hessian": ps.gnb_hessian(linear_softmax, params, x, generator=g)} if step % 5 == 0 else {}
        updates, state = opt.update(grads, state, params, **extra)
        params = ps.apply_updates(params, updates)
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0], losses[::10]


def test_sophia_compiles_once_per_variant_and_not_again_when_lr_changes():
    opt = ps.inject_hyperparams(ps.sophia)(lr=0.01, weight_decay=0.1, update_every=2)
    params = {k: v.float() for k, v in make_params().items()}
    grads = [{k: v.float() for k, v in g.items()} for g in grad_stream(params, 4)]
    h = {k: torch.ones_like(v) for k, v in params.items()}
    step = torch.compile(lambda g, s, p, **kw: opt.update(g, s, p, **kw), fullgraph=True)
    state = opt.init(params)
    _, state = step(grads[0], state, params, hessian=h)  # refresh variant
    _, state = step(grads[1], state, params)  # plain variant
    state = ps.set_hyperparam(state, "lr", 0.005)
    with torch.compiler.set_stance("fail_on_recompile"):
        _, state = step(grads[2], state, params, hessian=h)
        compiled, _ = step(grads[3], state, params)
    eager, _ = opt.update(grads[3], state, params)
    for k in params:
        torch.testing.assert_close(compiled[k], eager[k], rtol=1e-5, atol=1e-8)
