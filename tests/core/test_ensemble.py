"""Ensembles: one compiled program trains N models, each equal to its own run (no autograd graph kept)."""

from __future__ import annotations

import pytest
import torch

import purestep.core as ps


def _member(seed: int, device: str = "cpu", dtype: torch.dtype = torch.float64) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2)).to(device, dtype)


def check_compiled_ensemble(
    device: str, dtype: torch.dtype, rtol: float, atol: float, *, max_norm: float = 0.5, warmup: int = 2, reset: bool = True
) -> None:
    """torch.compile(vmap(step), dynamic=False) over 3 members, 4 steps, each member against
    its own eager run.

    One compile (10-30 s on a CPU), with clipping (a global norm, whose foreach kernel has no
    batching rule) and a scheduled AdamW.
    """
    if reset:
        torch._dynamo.reset()
    models = [_member(s, device, dtype) for s in range(3)]
    apply_fn, params, buffers = ps.functional_ensemble(models)

    def loss_fn(params, batch):
        x, y = batch
        return ((apply_fn(params, buffers, x)[0] - y) ** 2).mean()

    opt = ps.chain(ps.clip_by_global_norm(max_norm), ps.adamw(ps.warmup_cosine_schedule(1e-2, warmup, 10), weight_decay=0.1))
    step = ps.make_step(loss_fn, opt)
    state = torch.func.vmap(opt.init)(params)
    ensemble_step = torch.compile(torch.func.vmap(step), fullgraph=True, dynamic=False)
    g = torch.Generator().manual_seed(7)
    batches = [tuple(torch.randn(3, 16, n, generator=g, dtype=dtype).to(device) for n in (4, 2)) for _ in range(4)]
    for batch in batches:
        params, state, metrics = ensemble_step(params, state, batch)
    # No autograd graph is carried from step to step.
    assert not any(x.requires_grad for x in ps.tree_leaves((params, state, metrics)))
    assert metrics["loss"].shape == (3,) and int(ps.step_count(state)[0]) == 4
    assert params["0.weight"].device.type == device
    for i, model in enumerate(models):
        _, p, _ = ps.functional_model(model)
        s = opt.init(p)
        for x, y in batches:
            p, s, m = step(p, s, (x[i], y[i]))
        for name in p:
            torch.testing.assert_close(params[name][i], p[name], rtol=rtol, atol=atol)
        torch.testing.assert_close(metrics["grad_norm"][i], m["grad_norm"], rtol=rtol, atol=atol)
        assert not torch.equal(p["0.weight"], dict(model.named_parameters())["0.weight"].detach())


def test_compiled_vmapped_step_trains_each_member_as_its_own_run():
    check_compiled_ensemble("cpu", torch.float64, rtol=1e-9, atol=1e-12)
    # A second ensemble with other hyperparameters in the same process: without
    # dynamic=False dynamo would trace the changed Python scalars as symbolic, which vmap's
    # batching rules refuse ("x must be Tensor or scalar, got SymInt").
    check_compiled_ensemble("cpu", torch.float64, rtol=1e-9, atol=1e-12, max_norm=0.7, warmup=3, reset=False)


def test_stack_module_state_params_would_keep_a_graph_and_functional_ensemble_params_do_not():
    models = [_member(s) for s in range(2)]
    stacked, _ = torch.func.stack_module_state(models)
    apply_fn, params, buffers = ps.functional_ensemble(models)
    assert all(p.requires_grad for p in stacked.values()) and not any(p.requires_grad for p in params.values())
    for name in stacked:
        assert torch.equal(stacked[name].detach(), params[name])

    def loss_fn(params, batch):
        return (apply_fn(params, buffers, batch)[0] ** 2).mean()

    step = torch.func.vmap(ps.make_step(loss_fn, ps.sgd(0.1)))
    x = torch.randn(2, 5, 4, dtype=torch.float64)
    assert ps.tree_leaves(step(stacked, (ps.sgd(0.1).init(stacked)), x)[0])[0].grad_fn is not None
    assert ps.tree_leaves(step(params, (ps.sgd(0.1).init(params)), x)[0])[0].grad_fn is None


def test_functional_ensemble_names_a_member_that_does_not_match():
    models = [_member(0), torch.nn.Sequential(torch.nn.Linear(4, 9), torch.nn.Tanh(), torch.nn.Linear(9, 2)).double()]
    with pytest.raises(ValueError, match=r"module 1 has '0.weight' \(9, 4\)"):
        ps.functional_ensemble(models)
    with pytest.raises(ValueError, match="list of torch.nn.Modules"):
        ps.functional_ensemble(_member(0))
