"""params_ema / params_swa against torch.optim.swa_utils.AveragedModel."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

import purestep.core as ps


def _model(dtype):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 7), nn.LayerNorm(7), nn.Linear(7, 3)).to(dtype)


def _walk(model, averaged, ours, steps=15, seed=1):
    """Move the model randomly and average it `steps` times with both implementations."""
    g = torch.Generator().manual_seed(seed)
    avg = ours.init({k: v.detach() for k, v in model.named_parameters()})  # AveragedModel copies at construction too
    for _ in range(steps):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn(p.shape, generator=g, dtype=p.dtype) * 0.3)
        averaged.update_parameters(model)
        avg = ours.update(avg, {k: v.detach().clone() for k, v in model.named_parameters()})
    return avg


@pytest.mark.parametrize("dtype,rtol", [(torch.float64, 1e-10), (torch.float32, 1e-6)])
@pytest.mark.parametrize("decay", [0.9, 0.999, 0.5])
def test_params_ema_matches_averaged_model_with_ema_multi_avg_fn(dtype, rtol, decay):
    model = _model(dtype)
    averaged = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(decay))
    avg = _walk(model, averaged, ps.params_ema(decay))
    assert avg.count.dtype == torch.int64 and avg.count.item() == 15 == averaged.n_averaged.item()
    for k, v in averaged.module.named_parameters():
        torch.testing.assert_close(avg.params[k], v.detach(), rtol=rtol, atol=0)


@pytest.mark.parametrize("dtype,rtol", [(torch.float64, 1e-10), (torch.float32, 1e-5)])
def test_params_swa_matches_averaged_model_default_average(dtype, rtol):
    model = _model(dtype)
    averaged = AveragedModel(model)
    avg = _walk(model, averaged, ps.params_swa())
    for k, v in averaged.module.named_parameters():
        torch.testing.assert_close(avg.params[k], v.detach(), rtol=rtol, atol=0)


@pytest.mark.parametrize("make", [lambda: ps.params_ema(0.99), ps.params_swa], ids=["ema", "swa"])
def test_the_first_update_copies_the_params_and_the_second_averages(make):
    avg_fn = make()
    p0 = {"w": torch.zeros(3, dtype=torch.float64)}
    p1 = {"w": torch.tensor([1e10, -3.0, 7.5], dtype=torch.float64)}
    p2 = {"w": torch.tensor([1.0, 1.0, 1.0], dtype=torch.float64)}
    avg = avg_fn.update(avg_fn.init(p0), p1)
    assert torch.equal(avg.params["w"], p1["w"])  # bit for bit, not up to rounding
    avg = avg_fn.update(avg, p2)
    assert not torch.equal(avg.params["w"], p1["w"]) and not torch.equal(avg.params["w"], p2["w"])


def test_averaging_leaves_its_inputs_alone_and_keeps_dtypes():
    ema = ps.params_ema(0.9, dtype=torch.float32)
    params = {"w": torch.randn(4, dtype=torch.bfloat16), "b": torch.randn(2, dtype=torch.bfloat16)}
    copy = {k: v.clone() for k, v in params.items()}
    avg0 = ema.init(params)
    avg1 = ema.update(avg0, params)
    avg2 = ema.update(avg1, {k: v * 2 for k, v in params.items()})
    assert all(v.dtype == torch.float32 for v in avg2.params.values())
    assert all(torch.equal(params[k], copy[k]) for k in params)
    assert avg1.count.item() == 1 and avg0.count.item() == 0
    torch.testing.assert_close(avg2.params["w"], (params["w"].float() * 1.1), rtol=1e-6, atol=1e-6)


def test_params_ema_follows_a_decay_schedule():
    decay = lambda n: 1.0 - 1.0 / (n + 1.0)  # noqa: E731  (equal weights: the running mean)
    ema = ps.params_ema(decay)
    avg = ema.init({"w": torch.zeros(1, dtype=torch.float64)})
    for v in (2.0, 4.0, 9.0):
        avg = ema.update(avg, {"w": torch.full((1,), v, dtype=torch.float64)})
    torch.testing.assert_close(avg.params["w"], torch.full((1,), 5.0, dtype=torch.float64))


def test_averaging_runs_under_vmap_per_leaf():
    ema = ps.params_ema(0.5)
    ens = {"w": torch.arange(6.0).view(3, 2)}

    def run(p):
        avg = ema.update(ema.init(p), p)
        return ema.update(avg, {"w": p["w"] * 3}).params

    out = torch.func.vmap(run)(ens)
    torch.testing.assert_close(out["w"], ens["w"] * 2)


def test_clip_and_ema_compile_fullgraph_without_recompiling():
    clip, ema = ps.clip_by_global_norm(1.0), ps.params_ema(0.9)
    params = {"w": torch.randn(4, 3), "b": torch.randn(3)}

    def step(grads, clip_state, avg, params):
        updates, clip_state = clip.update(grads, clip_state)
        params = ps.apply_updates(params, {k: -0.1 * u for k, u in updates.items()})
        return params, clip_state, ema.update(avg, params)

    compiled = torch.compile(step, fullgraph=True)
    cs, avg = clip.init(params), ema.init(params)
    cs_ref, avg_ref, params_ref = cs, avg, params
    for i in range(4):
        grads = {k: torch.randn_like(v) * 10 ** (i - 1) for k, v in params.items()}
        stance = "fail_on_recompile" if i >= 2 else "default"  # the count's first values may specialise once
        with torch.compiler.set_stance(stance):
            params, cs, avg = compiled(grads, cs, avg, params)
        params_ref, cs_ref, avg_ref = step(grads, cs_ref, avg_ref, params_ref)
        torch.testing.assert_close(cs.norm, cs_ref.norm)
        for k in params:
            torch.testing.assert_close(avg.params[k], avg_ref.params[k])


@pytest.mark.parametrize("decay", [0.0, 1.0, -0.5, 1.5])
def test_ema_decay_outside_zero_one_raises_naming_decay(decay):
    with pytest.raises(ValueError, match="decay"):
        ps.params_ema(decay)


def test_update_with_mismatched_params_names_the_leaf():
    ema = ps.params_ema()
    avg = ema.init({"w": torch.zeros(2)})
    with pytest.raises(ValueError, match="'w'"):
        ema.update(avg, {"w": torch.zeros(3)})


def test_averages_keep_each_leaf_dtype_including_zero_dim_leaves():
    params = {"t": torch.tensor(1.0), "w": torch.ones(3, dtype=torch.bfloat16), "d": torch.ones(2, dtype=torch.float64)}
    for averager in (ps.params_ema(0.9), ps.params_swa()):
        avg = averager.init(params)
        for _ in range(3):
            avg = averager.update(avg, params)
        assert {k: v.dtype for k, v in avg.params.items()} == {k: v.dtype for k, v in params.items()}
