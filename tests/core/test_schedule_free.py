"""Schedule-free AdamW against schedulefree.AdamWScheduleFree: training params y and eval params x."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from schedulefree import AdamWScheduleFree

import purestep.core as ps

STEPS = 25
RTOL = 1e-6


def make_params(seed=0):
    g = torch.Generator().manual_seed(seed)
    shapes = {"bias": (7,), "layers.0.weight": (5, 3), "conv.weight": (4, 3, 2, 2), "scale": ()}
    return {k: torch.randn(s, generator=g, dtype=torch.float64) for k, s in shapes.items()}


def grad_stream(params, steps=STEPS, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [{k: torch.randn(v.shape, generator=g, dtype=v.dtype) for k, v in params.items()} for _ in range(steps)]


CASES = [
    dict(lr=0.05),
    dict(lr=0.05, weight_decay=0.1, warmup_steps=10),
    dict(lr=0.02, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.05, warmup_steps=5, r=0.5, weight_lr_power=1.0),
    dict(lr=0.05, warmup_steps=30, weight_lr_power=0.0),
]


@pytest.mark.parametrize("kwargs", CASES, ids=lambda k: ",".join(f"{a}={b}" for a, b in k.items()))
def test_schedule_free_adamw_matches_schedulefree_train_and_eval_params(kwargs):
    params = make_params()
    tensors = {k: nn.Parameter(v.clone()) for k, v in params.items()}
    ref = AdamWScheduleFree(list(tensors.values()), foreach=False, **kwargs)
    ref.train()
    opt = ps.schedule_free_adamw(**kwargs)
    state, y = opt.init(params), params
    for step, g in enumerate(grad_stream(params)):
        for k, p in tensors.items():
            p.grad = g[k].clone()
        ref.step()
        updates, state = opt.update(g, state, y)
        y = ps.apply_updates(y, updates)
        for k, p in tensors.items():
            torch.testing.assert_close(y[k], p.detach(), rtol=RTOL, atol=1e-12, msg=lambda m: f"y, step {step}, {k}: {m}")
        ref.eval()
        x = ps.schedule_free_eval_params(state, y)
        for k, p in tensors.items():
            torch.testing.assert_close(x[k], p.detach(), rtol=RTOL, atol=1e-12, msg=lambda m: f"x, step {step}, {k}: {m}")
        ref.train()
    for k in params:
        assert not torch.equal(x[k], y[k]) and not torch.equal(y[k], params[k]), k
    torch.testing.assert_close(ps.tree_get(state, "z")["bias"], ref.state[tensors["bias"]]["z"], rtol=RTOL, atol=1e-12)


def test_eval_params_are_an_output_and_leave_state_and_params_alone():
    params = make_params()
    opt = ps.schedule_free_adamw(lr=0.05)
    updates, state = opt.update(grad_stream(params, 1)[0], opt.init(params), params)
    y = ps.apply_updates(params, updates)
    before = {k: v.clone() for k, v in y.items()}
    z_before = {k: v.clone() for k, v in ps.tree_get(state, "z").items()}
    x1 = ps.schedule_free_eval_params(state, y)
    x2 = ps.schedule_free_eval_params(state, y)
    for k in y:
        assert torch.equal(x1[k], x2[k]) and torch.equal(y[k], before[k])
        assert torch.equal(ps.tree_get(state, "z")[k], z_before[k])


def test_eval_params_under_partition_touch_only_the_schedule_free_leaves():
    params = make_params()
    labels = {k: "sf" if k != "bias" else "sgd" for k in params}
    opt = ps.partition({"sf": ps.schedule_free_adamw(lr=0.05), "sgd": ps.sgd(0.1)}, labels)
    state, y = opt.init(params), params
    for g in grad_stream(params, 3):
        updates, state = opt.update(g, state, y)
        y = ps.apply_updates(y, updates)
    x = ps.schedule_free_eval_params(state, y)
    assert torch.equal(x["bias"], y["bias"])
    assert not torch.equal(x["layers.0.weight"], y["layers.0.weight"])


def test_schedule_free_runs_compiled_without_recompiling_when_lr_changes():
    opt = ps.inject_hyperparams(ps.schedule_free_adamw)(lr=0.05, weight_decay=0.1, warmup_steps=3)
    params = {k: v.float() for k, v in make_params().items()}
    state = opt.init(params)
    step = torch.compile(lambda g, s, p: opt.update(g, s, p), fullgraph=True)
    grads = [{k: v.float() for k, v in g.items()} for g in grad_stream(params, 3)]
    _, state = step(grads[0], state, params)
    state = ps.set_hyperparam(state, "lr", 0.01)
    with torch.compiler.set_stance("fail_on_recompile"):
        compiled, _ = step(grads[1], state, params)
    eager, _ = opt.update(grads[1], state, params)
    for k in params:
        torch.testing.assert_close(compiled[k], eager[k], rtol=1e-5, atol=1e-7)


def test_missing_state_or_params_raise_clearly():
    params = make_params()
    opt = ps.schedule_free_adamw()
    with pytest.raises(ValueError, match="needs params"):
        opt.update(grad_stream(params, 1)[0], opt.init(params))
    with pytest.raises(ValueError, match="no schedule-free state"):
        ps.schedule_free_eval_params(ps.adamw(1e-3).init(params), params)
    with pytest.raises(ValueError, match="layers.0.weight"):
        bad = dict(params, **{"layers.0.weight": torch.zeros(3, 5, dtype=torch.float64)})
        opt.update(grad_stream(params, 1)[0], opt.init(params), bad)


@pytest.mark.parametrize(
    "kwargs,name",
    [
        (dict(lr=-1.0), "lr"),
        (dict(betas=(1.0, 0.999)), "betas"),
        (dict(betas=(0.0, 0.999)), "b1"),
        (dict(betas=(0.9,)), "betas"),
        (dict(eps=0.0), "eps"),
        (dict(weight_decay=-0.1), "weight_decay"),
        (dict(warmup_steps=-1), "warmup_steps"),
        (dict(warmup_steps=2.5), "warmup_steps"),
        (dict(r=-1.0), "r"),
        (dict(weight_lr_power=-2.0), "weight_lr_power"),
    ],
)
def test_invalid_schedule_free_arguments_raise_naming_the_argument(kwargs, name):
    with pytest.raises(ValueError, match=name):
        ps.schedule_free_adamw(**kwargs)
