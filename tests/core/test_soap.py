"""SOAP against a per-tensor reference of its reference implementation, over several refreshes."""

from __future__ import annotations

import pytest
import torch

import purestep.core as ps
from purestep.api import TrainConfig, apply_overrides
from tests.reference.soap import ReferenceSOAP

SHAPES = {"w": (6, 4), "b": (5,), "conv": (4, 3, 2), "wide": (3, 40)}


def _run(steps, kwargs, ref_kwargs, seed=0):
    gen = torch.Generator().manual_seed(seed)
    start = {k: torch.randn(s, generator=gen, dtype=torch.float64) for k, s in SHAPES.items()}
    grads = [{k: torch.randn(s, generator=gen, dtype=torch.float64) for k, s in SHAPES.items()} for _ in range(steps)]
    ref_params = [start[k].clone().requires_grad_(False) for k in SHAPES]
    ref = ReferenceSOAP(ref_params, **ref_kwargs)
    opt = ps.soap(**kwargs)
    ours, state = dict(start), opt.init(start)
    for g in grads:
        for p, k in zip(ref_params, SHAPES):
            p.grad = g[k]
        ref.step()
        u, state = opt.update(g, state, ours)
        ours = ps.apply_updates(ours, u)
    return start, ours, dict(zip(SHAPES, ref_params)), state


@pytest.mark.parametrize(
    "kwargs",
    [
        {},
        {"max_precond_dim": 10, "precondition_1d": True, "shampoo_beta": 0.9, "weight_decay": 0.1},
        {"merge_dims": True, "max_precond_dim": 8, "normalize_grads": True, "correct_bias": False},
    ],
    ids=["defaults", "max_dim+1d+shampoo_beta", "merge+normalize+no_bias"],
)
def test_soap_matches_the_reference_over_several_refreshes(kwargs):
    names = {"precondition_frequency": "freq", "max_precond_dim": "max_dim"}
    base = {"lr": 0.01, "precondition_frequency": 3}
    ref_kwargs = {names.get(k, k): v for k, v in {**base, **kwargs}.items()}
    start, ours, want, state = _run(20, {**base, **kwargs}, ref_kwargs)
    for k in SHAPES:
        torch.testing.assert_close(ours[k], want[k], rtol=1e-8, atol=1e-10)
        assert (ours[k] - start[k]).abs().max() > 1e-3  # it moved: the comparison can fail
    assert int(state.count) == 20


def test_the_first_update_sets_the_basis_up_and_moves_nothing():
    params = {"w": torch.randn(4, 3)}
    opt = ps.soap(0.1)
    u, state = opt.update({"w": torch.randn(4, 3)}, opt.init(params), params)
    assert float(u["w"].abs().max()) == 0.0
    q = state.q["w"]
    torch.testing.assert_close(q[0].T @ q[0], torch.eye(4), atol=1e-5, rtol=0)
    assert ps.soap().init({"b": torch.zeros(3)}).q["b"][0].numel() == 0  # 1-D: plain Adam


def test_soap_compiles_per_leaf_equal_to_eager_and_a_refresh_is_no_recompile():
    torch.manual_seed(0)
    params = {"w": torch.randn(6, 4), "b": torch.zeros(4)}
    opt = ps.inject_hyperparams(ps.soap)(lr=0.01, precondition_frequency=2)
    eager_p, eager_s = dict(params), opt.init(params)
    fast_p, fast_s = {k: v.clone() for k, v in params.items()}, opt.init(params)
    step = ps.make_update(opt, compile=True, donate=True)
    for i in range(5):
        grads = {k: torch.randn_like(v) for k, v in params.items()}
        u, eager_s = opt.update(grads, eager_s, eager_p)
        eager_p = ps.apply_updates(eager_p, u)
        fast_p, fast_s = step(fast_p, {k: g.clone() for k, g in grads.items()}, fast_s)
        if i == 1:  # past the set-up: refreshes and plain steps run the same compiled code
            torch.compiler.set_stance("fail_on_recompile")
            eager_s, fast_s = ps.set_hyperparam(eager_s, "lr", 0.005), ps.set_hyperparam(fast_s, "lr", 0.005)
    torch.compiler.set_stance("default")
    for k in params:
        torch.testing.assert_close(fast_p[k], eager_p[k], rtol=1e-4, atol=1e-5)


def test_the_config_names_soap():
    cfg = apply_overrides(TrainConfig(), ["optimizer.name=soap", 'optimizer.kwargs={"precondition_frequency": 5}'])
    state = cfg.build_optimizer().init({"w": torch.randn(4, 4)})
    assert "SOAPState" in str(state)


def test_bf16_moments_are_the_float32_run_with_its_moments_rounded_each_step():
    # Rounded to nearest, bf16 storage is exactly: compute in float32, round m and v to bf16
    # after every update, read them back. Emulated on the float32 run by rounding its state.
    gen = torch.Generator().manual_seed(3)
    start = {k: torch.randn(s, generator=gen) for k, s in SHAPES.items()}
    grads = [{k: torch.randn(s, generator=gen) for k, s in SHAPES.items()} for _ in range(12)]
    low = ps.soap(0.01, precondition_frequency=3, mu_dtype=torch.bfloat16, nu_dtype=torch.bfloat16, rounding="nearest")
    plain = ps.soap(0.01, precondition_frequency=3)
    p_low, s_low = dict(start), low.init(start)
    p_ref, s_ref = dict(start), plain.init(start)
    rounded = lambda tree: ps.tree_map(lambda x: x.to(torch.bfloat16).float(), tree)  # noqa: E731
    for g in grads:
        u, s_low = low.update(g, s_low, p_low)
        p_low = ps.apply_updates(p_low, u)
        u, s_ref = plain.update(g, s_ref, p_ref)
        p_ref = ps.apply_updates(p_ref, u)
        s_ref = s_ref._replace(mu=rounded(s_ref.mu), nu=rounded(s_ref.nu))
    assert s_low.mu["w"].dtype == s_low.nu["conv"].dtype == torch.bfloat16
    for k in SHAPES:
        torch.testing.assert_close(p_low[k], p_ref[k], rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(s_low.mu[k].float(), s_ref.mu[k], rtol=0, atol=0)
    assert any(not torch.equal(p_low[k], ps.apply_updates(start, u)[k]) for k in SHAPES)


def test_8bit_moments_train_close_to_float32_ones():
    gen = torch.Generator().manual_seed(4)
    start = {"big": torch.randn(96, 64, generator=gen)}  # above the quantization threshold
    grads = [{"big": torch.randn(96, 64, generator=gen)} for _ in range(10)]
    runs = {}
    for name, kw in {"fp8": {"mu_dtype": torch.float8_e4m3fn, "nu_dtype": torch.float8_e4m3fn}, "fp32": {}}.items():
        opt = ps.soap(0.01, precondition_frequency=3, **kw)
        p, s = dict(start), opt.init(start)
        for g in grads:
            u, s = opt.update(g, s, p)
            p = ps.apply_updates(p, u)
        runs[name] = (p["big"], s)
    assert type(runs["fp8"][1].mu["big"]).__name__ == "QuantizedTensor"
    moved = (runs["fp32"][0] - start["big"]).norm()
    assert float((runs["fp8"][0] - runs["fp32"][0]).norm() / moved) < 0.1
    with pytest.raises(ValueError, match="mu_dtype"):
        ps.soap(mu_dtype=torch.int8)
