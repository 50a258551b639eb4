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
