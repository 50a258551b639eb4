"""dynamic_loss_scale against torch.amp.GradScaler (which runs on CPU) for the same overflow pattern."""

from __future__ import annotations

import pytest
import torch

import purestep.core as ps

# 1 = this step's grads overflow. Runs of finite steps longer than growth_interval grow the scale.
PATTERN = [0, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0, 1, 1, 0, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 0]


def _grads(step, overflow, dtype=torch.float32):
    g = torch.Generator().manual_seed(step)
    grads = {"w": torch.randn(3, 4, generator=g, dtype=dtype), "b": torch.randn(4, generator=g, dtype=dtype)}
    if overflow:
        grads["b"][step % 4] = float("inf") if step % 2 else float("nan")
    return grads


@pytest.mark.parametrize(
    "kw",
    [
        dict(init_scale=2.0**10, growth_factor=2.0, backoff_factor=0.5, growth_interval=3),
        dict(init_scale=1000.0, growth_factor=1.7, backoff_factor=0.3, growth_interval=2),
        dict(init_scale=2.0**126, growth_factor=4.0, backoff_factor=0.5, growth_interval=1),  # growth overflows float32
    ],
)
def test_scale_sequence_and_unscaled_grads_match_grad_scaler(kw):
    scaler = torch.amp.GradScaler("cpu", **kw)
    p = {k: torch.nn.Parameter(torch.zeros_like(v)) for k, v in _grads(0, False).items()}
    opt = torch.optim.SGD(list(p.values()), lr=0.0)
    ls = ps.dynamic_loss_scale(**kw)
    state = ls.init(p)
    loss = torch.tensor(0.75)
    for step, overflow in enumerate(PATTERN):
        assert ls.scale_loss(loss, state).item() == scaler.scale(loss).item()
        scaled = {k: v * scaler.get_scale() for k, v in _grads(step, overflow).items()}
        for k, param in p.items():
            param.grad = scaled[k].clone()
        scaler.unscale_(opt)
        found_inf = sum(v.item() for v in scaler._found_inf_per_device(opt).values())
        grads, finite, state = ls.unscale(scaled, state)
        assert finite.dtype == torch.bool and bool(finite) == (found_inf == 0), step
        assert not (overflow and bool(finite)), step
        if bool(finite):
            for k in p:
                torch.testing.assert_close(grads[k], p[k].grad, rtol=0, atol=0)
        scaler.step(opt)
        scaler.update()
        assert state.scale.item() == scaler.get_scale(), (step, state.scale.item(), scaler.get_scale())
        assert state.growth_tracker.item() == scaler._get_growth_tracker(), step
    assert state.scale.dtype == torch.float32 and state.growth_tracker.dtype == torch.int64


def test_loss_scaling_round_trip_trains_like_unscaled_sgd_and_skips_overflows():
    """scale the loss, take grads, unscale, step only where finite: equals plain SGD on the finite steps."""
    w0 = torch.randn(4, dtype=torch.float64)
    x = torch.randn(8, 4, dtype=torch.float64)
    ls = ps.dynamic_loss_scale(init_scale=2.0**8, growth_interval=2)
    opt = ps.sgd(0.1)
    params, ref = {"w": w0.clone()}, {"w": w0.clone()}
    state, s = opt.init(params), ls.init(params)

    def loss_fn(p):
        return ((x @ p["w"]) ** 2).mean()

    for step, overflow in enumerate(PATTERN[:12]):
        grads = torch.func.grad(lambda p: ls.scale_loss(loss_fn(p), s))(params)
        if overflow:
            grads = {"w": grads["w"] * float("inf")}
        grads, finite, s = ls.unscale(grads, s)
        updates, new_state = opt.update(grads, state, params)
        new_params = ps.apply_updates(params, updates)
        params = {k: torch.where(finite, new_params[k], params[k]) for k in params}
        if not overflow:
            ref_updates, _ = opt.update(torch.func.grad(loss_fn)(ref), opt.init(ref), ref)
            ref = ps.apply_updates(ref, ref_updates)
    torch.testing.assert_close(params["w"], ref["w"], rtol=1e-12, atol=0)


def test_state_lives_on_the_params_device_and_defaults_to_cpu():
    ls = ps.dynamic_loss_scale()
    assert ls.init().scale.device.type == "cpu"
    assert ls.init({"w": torch.zeros(1)}).scale.item() == 2.0**16


@pytest.mark.parametrize(
    "kw,name",
    [
        (dict(init_scale=0.0), "init_scale"),
        (dict(growth_factor=1.0), "growth_factor"),
        (dict(backoff_factor=1.0), "backoff_factor"),
        (dict(backoff_factor=0.0), "backoff_factor"),
        (dict(growth_interval=0), "growth_interval"),
    ],
)
def test_bad_arguments_raise_value_error_naming_the_argument(kw, name):
    with pytest.raises(ValueError, match=name):
        ps.dynamic_loss_scale(**kw)
