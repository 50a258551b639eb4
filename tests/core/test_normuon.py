"""NorMuon against a plain per-matrix reference of the paper's rule, compiled and in the Trainer."""

from __future__ import annotations

import math

import pytest
import torch

import purestep.core as ps
from purestep.api import TrainConfig, apply_overrides


def _ns5(x: torch.Tensor, steps: int = 5) -> torch.Tensor:
    """Keller Jordan's quintic Newton-Schulz on one matrix, in float64."""
    a, b, c = (3.4445, -4.7750, 2.0315)
    flip = x.shape[0] > x.shape[1]
    x = x.T if flip else x
    x = x / x.norm().clamp(min=1e-7)
    for _ in range(steps):
        g = x @ x.T
        x = a * x + (b * g + c * g @ g) @ x
    return x.T if flip else x


def reference(params, grads_per_step, lr, momentum=0.95, beta2=0.95, wd=0.0, eps=1e-10, nesterov=True,
              adjust_lr="match_rms_adamw"):
    """The rule of Li et al. 2025 (arXiv 2510.05491, Algorithm 1) written out per matrix;
    `adjust_lr="original"`: the step size of the authors' released code instead (the update
    keeps O's Frobenius norm, then Muon's max(1, rows/cols)^0.5)."""
    params = {k: v.clone() for k, v in params.items()}
    m = {k: torch.zeros_like(v) for k, v in params.items()}
    v = {k: torch.zeros(p.shape[0], dtype=p.dtype) for k, p in params.items()}
    for grads in grads_per_step:
        for k, p in params.items():
            g = grads[k]
            m[k] = momentum * m[k] + (1 - momentum) * g
            src = (1 - momentum) * g + momentum * m[k] if nesterov else m[k]
            rows, cols = p.shape[0], math.prod(p.shape[1:])
            o = _ns5(src.reshape(rows, cols))
            v[k] = beta2 * v[k] + (1 - beta2) * (o * o).mean(dim=1)
            o_hat = o / (v[k].sqrt() + eps)[:, None]
            if adjust_lr == "original":
                step = o.norm() / (o_hat.norm() + eps) * max(1.0, rows / cols) ** 0.5 * o_hat
            else:
                step = 0.2 * math.sqrt(rows * cols) / (o_hat.norm() + eps) * o_hat
            params[k] = p - lr * wd * p - lr * step.reshape(p.shape)
    return params


@pytest.mark.parametrize("nesterov, adjust_lr", [(True, "match_rms_adamw"), (False, "match_rms_adamw"), (True, "original")])
def test_normuon_follows_the_papers_rule_over_many_steps(nesterov, adjust_lr):
    gen = torch.Generator().manual_seed(0)
    params = {"a": torch.randn(6, 4, generator=gen, dtype=torch.float64),
              "b": torch.randn(3, 7, generator=gen, dtype=torch.float64),
              "conv": torch.randn(4, 2, 3, generator=gen, dtype=torch.float64)}
    grads = [{k: torch.randn(v.shape, generator=gen, dtype=torch.float64) for k, v in params.items()} for _ in range(30)]
    opt = ps.normuon(0.05, weight_decay=0.1, ns_dtype=torch.float64, nesterov=nesterov, adjust_lr=adjust_lr)
    state, ours = opt.init(params), dict(params)
    for g in grads:
        u, state = opt.update(g, state, ours)
        ours = ps.apply_updates(ours, u)
    want = reference(params, grads, 0.05, wd=0.1, nesterov=nesterov, adjust_lr=adjust_lr)
    for k in params:
        torch.testing.assert_close(ours[k], want[k], rtol=1e-9, atol=1e-10)
        assert (ours[k] - params[k]).abs().max() > 0.1  # it moved: the comparison can fail
    assert state[0].nu["conv"].shape == (4,) and state[0].count == 30


def test_each_matrix_update_has_rms_0_2_and_rows_with_large_momentum_are_damped():
    g = {"w": torch.ones(4, 8, dtype=torch.float64) * torch.tensor([[10.0], [1.0], [1.0], [1.0]], dtype=torch.float64)
         + torch.randn(4, 8, dtype=torch.float64) * 0.1}
    t = ps.scale_by_normuon(ns_dtype=torch.float64)
    u, _ = t.update(g, t.init(g))
    torch.testing.assert_close(u["w"].square().mean().sqrt(), torch.tensor(0.2, dtype=torch.float64))
    plain, _ = ps.scale_by_muon(ns_dtype=torch.float64).update(g, ps.scale_by_muon().init(g))
    row_rms = lambda x: x.square().mean(dim=1).sqrt()  # noqa: E731
    ratio = row_rms(u["w"]) / row_rms(plain["w"])
    assert float(ratio.max() / ratio.min()) < float(row_rms(plain["w"]).max() / row_rms(plain["w"]).min()) * 10


def test_normuon_adamw_routes_like_muon_adamw_and_compiles_once_equal_to_eager():
    torch.manual_seed(0)
    params = {"h.0.weight": torch.randn(8, 16), "h.1.weight": torch.randn(16, 8), "h.0.bias": torch.zeros(8),
              "wte.weight": torch.randn(10, 8)}
    opt = ps.inject_hyperparams(ps.normuon_adamw)(lr=0.02, ns_dtype=torch.float32)
    state = opt.init(params)
    assert sorted(state.inner_state.inner_states["muon"][0].nu) == ["h.0.weight", "h.1.weight"]
    eager_p, eager_s = {k: v.clone() for k, v in params.items()}, opt.init(params)
    fast_p, fast_s = {k: v.clone() for k, v in params.items()}, opt.init(params)
    step = ps.make_update(opt, compile=True, donate=True)
    for i in range(4):
        grads = {k: torch.randn_like(v) for k, v in params.items()}
        u, eager_s = opt.update(grads, eager_s, eager_p)
        eager_p = ps.apply_updates(eager_p, u)
        fast_p, fast_s = step(fast_p, {k: g.clone() for k, g in grads.items()}, fast_s)
        if i == 1:
            fast_s = ps.set_hyperparam(fast_s, "lr", 0.01)
            eager_s = ps.set_hyperparam(eager_s, "lr", 0.01)
            torch.compiler.set_stance("fail_on_recompile")
    torch.compiler.set_stance("default")
    for k in params:
        torch.testing.assert_close(fast_p[k], eager_p[k], rtol=1e-4, atol=1e-5)


def test_the_config_names_normuon_adamw():
    cfg = apply_overrides(TrainConfig(), ["optimizer.name=normuon_adamw", 'optimizer.kwargs={"beta2": 0.9}'])
    t = cfg.build_optimizer()
    params = {"h.0.weight": torch.randn(4, 4), "b": torch.zeros(4)}
    state = t.init(params)
    assert float(ps.get_hyperparams(state)["beta2"]) == 0.9 and "h.0.weight" in str(state)


@pytest.mark.parametrize("adjust_lr", ["match_rms_adamw", "original"])
def test_flat_compiled_normuon_runs_batched_over_same_shape_stacks(adjust_lr):
    # Two 6x4 matrices form one (2, 6, 4) stack with a (2, 6) second moment; the 3x7 and the
    # conv filter are groups alone. The compiled flat step follows the per-matrix rule.
    gen = torch.Generator().manual_seed(1)
    shapes = {"a": (6, 4), "b": (3, 7), "a2": (6, 4), "conv": (4, 2, 3)}
    params = {k: torch.randn(s, generator=gen, dtype=torch.float64) for k, s in shapes.items()}
    grads = [{k: torch.randn(v.shape, generator=gen, dtype=torch.float64) for k, v in params.items()} for _ in range(6)]
    opt = ps.inject_hyperparams(ps.normuon)(lr=0.05, weight_decay=0.1, ns_dtype=torch.float64, adjust_lr=adjust_lr)
    ours, state = {k: v.clone() for k, v in params.items()}, opt.init(params)
    nu = state.inner_state[0].nu
    step = ps.make_update(opt, compile=True, donate=True)
    for i, g in enumerate(grads):
        step(ours, {k: x.clone() for k, x in g.items()}, state)
        if i == 1:
            torch.compiler.set_stance("fail_on_recompile")
    torch.compiler.set_stance("default")
    assert step.explain().startswith("flat"), step.explain()
    assert sorted(map(sorted, step.layout().values())) == [["a", "a2"], ["b"], ["conv"]]
    want = reference(params, grads, 0.05, wd=0.1, adjust_lr=adjust_lr)
    for k in params:
        torch.testing.assert_close(ours[k], want[k], rtol=1e-8, atol=1e-10)
    assert nu["a"].shape == (6,) and nu["a"].data_ptr() != nu["a2"].data_ptr()  # the user's rows, viewed per matrix
    assert float(nu["a"].abs().sum()) > 0 and state.inner_state[0].nu is nu


def test_bf16_momentum_is_the_float32_run_with_its_momentum_rounded_each_step():
    gen = torch.Generator().manual_seed(2)
    start = {"a": torch.randn(6, 4, generator=gen), "conv": torch.randn(4, 2, 3, generator=gen)}
    grads = [{k: torch.randn(v.shape, generator=gen) for k, v in start.items()} for _ in range(8)]
    low = ps.normuon(0.05, ns_dtype=torch.float32, mu_dtype=torch.bfloat16, rounding="nearest")
    plain = ps.normuon(0.05, ns_dtype=torch.float32)
    p_low, s_low, p_ref, s_ref = dict(start), low.init(start), dict(start), plain.init(start)
    for g in grads:
        u, s_low = low.update(g, s_low, p_low)
        p_low = ps.apply_updates(p_low, u)
        u, s_ref = plain.update(g, s_ref, p_ref)
        p_ref = ps.apply_updates(p_ref, u)
        mu = ps.tree_map(lambda x: x.to(torch.bfloat16).float(), s_ref[0].mu)
        s_ref = (s_ref[0]._replace(mu=mu), *s_ref[1:])
    assert s_low[0].mu["a"].dtype == torch.bfloat16 and s_low[0].nu["a"].dtype == torch.float32
    for k in start:
        torch.testing.assert_close(p_low[k], p_ref[k], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("factory", [ps.normuon_adamw, ps.muon_adamw])
def test_the_hybrids_store_both_sides_momenta_in_mu_dtype_and_adamws_v_in_nu_dtype(factory):
    params = {"h.0.weight": torch.randn(6, 4), "h.0.bias": torch.zeros(6)}
    opt = factory(ns_dtype=torch.float32, mu_dtype=torch.bfloat16, nu_dtype=torch.bfloat16, rounding="nearest")
    state = opt.init(params)
    muon_side, adamw_side = state.inner_states["muon"], state.inner_states["adamw"]
    assert muon_side[0].mu["h.0.weight"].dtype == torch.bfloat16
    assert adamw_side[0].mu["h.0.bias"].dtype == torch.bfloat16 and adamw_side[0].nu["h.0.bias"].dtype == torch.bfloat16
    if factory is ps.normuon_adamw:
        assert muon_side[0].nu["h.0.weight"].dtype == torch.float32  # NorMuon's per-row v stays float32
    grads = {k: torch.randn_like(v) for k, v in params.items()}
    updates, state = opt.update(grads, state, params)
    assert all(torch.isfinite(u).all() and u.dtype == torch.float32 for u in updates.values())


def test_normuon_adamw_passes_its_eps_to_normuon():
    # With a huge eps, Ô = O/(√v + ε) is O/ε, and the RMS scaling hides ε from the update:
    # compare against normuon with the same eps on the matrix alone.
    gen = torch.Generator().manual_seed(3)
    w = torch.randn(6, 4, generator=gen)
    g = torch.randn(6, 4, generator=gen)
    for eps in (1e-10, 10.0):
        hybrid = ps.normuon_adamw(lr=0.05, ns_dtype=torch.float32, eps=eps, weight_decay=0.0)
        alone = ps.normuon(0.05, ns_dtype=torch.float32, eps=eps)
        u_h, _ = hybrid.update({"h.0.weight": g}, hybrid.init({"h.0.weight": w}), {"h.0.weight": w})
        u_a, _ = alone.update({"h.0.weight": g}, alone.init({"h.0.weight": w}), {"h.0.weight": w})
        torch.testing.assert_close(u_h["h.0.weight"], u_a["h.0.weight"])
    assert not torch.allclose(
        ps.normuon(0.05, ns_dtype=torch.float32, eps=10.0).update({"w": g}, ps.normuon(0.05).init({"w": w}), {"w": w})[0]["w"],
        ps.normuon(0.05, ns_dtype=torch.float32).update({"w": g}, ps.normuon(0.05).init({"w": w}), {"w": w})[0]["w"],
    )


def test_adjust_lr_is_checked_and_the_two_scalings_differ():
    with pytest.raises(ValueError, match="adjust_lr must be"):
        ps.normuon(adjust_lr="rms")
    w = {"w": torch.randn(6, 4, dtype=torch.float64)}
    g = {"w": torch.randn(6, 4, dtype=torch.float64)}
    paper = ps.scale_by_normuon(ns_dtype=torch.float64)
    code = ps.scale_by_normuon(ns_dtype=torch.float64, adjust_lr="original")
    u_paper, _ = paper.update(g, paper.init(w))
    u_code, _ = code.update(g, code.init(w))
    # The code keeps O's norm (about √min(m, n) for an orthogonalized O); the paper sets RMS 0.2.
    torch.testing.assert_close(u_paper["w"].square().mean().sqrt(), torch.tensor(0.2, dtype=torch.float64))
    assert 1.5 < float(u_code["w"].norm()) < 2.5  # √4 = 2, NS5's singular values are ~0.7-1.2
    torch.testing.assert_close(u_code["w"] / u_code["w"].norm(), u_paper["w"] / u_paper["w"].norm())


@pytest.mark.parametrize("adjust_lr", ["match_rms_adamw", "original"])
def test_normuon_with_batch_dims_equals_one_normuon_per_expert_eager_and_flat(adjust_lr):
    g = torch.Generator().manual_seed(0)
    w = torch.randn(3, 8, 4, generator=g)
    grads = [torch.randn(3, 8, 4, generator=g) for _ in range(4)]
    kw = dict(ns_dtype=torch.float32, weight_decay=0.1, adjust_lr=adjust_lr)
    split = ps.normuon(0.05, **kw)
    sp, ss = {f"e{i}": w[i].clone() for i in range(3)}, None
    ss = split.init(sp)
    for gr in grads:
        u, ss = split.update({f"e{i}": gr[i] for i in range(3)}, ss, sp)
        sp = ps.apply_updates(sp, u)
    batched = ps.normuon(0.05, batch_dims=1, **kw)
    torch._dynamo.reset()
    for update in (ps.make_update(batched), ps.make_update(batched, compile=True, donate=True)):
        p = {"e": w.clone(), "twin": w.clone()}  # two same-shape leaves: a stack on flat buffers
        s = batched.init(p)
        for gr in grads:
            p, s = update(p, {"e": gr, "twin": gr}, s)
        assert tuple(ps.tree_get(s, "nu")["e"].shape) == (3, 8)
        for i in range(3):
            torch.testing.assert_close(p["e"][i], sp[f"e{i}"], rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(p["twin"][i], sp[f"e{i}"], rtol=1e-5, atol=1e-6)
