"""MARS-AdamW against pytorch_optimizer's MARS(mars_type="adamw", optimize_1d=True) and a per-tensor reference."""

from __future__ import annotations

import math

import pytest
import torch

import purestep.core as ps
from tests.core.test_alias import assert_histories_close, assert_moved, grad_stream, make_params, run_purestep, run_torch

pytorch_optimizer = pytest.importorskip("pytorch_optimizer")

STEPS = 30


def reference_mars(params, grads_list, lr, b1=0.95, b2=0.99, gamma=0.025, eps=1e-8, weight_decay=0.0):
    """The rule as written in `ps.mars`'s docstring, one tensor at a time in float64."""
    p = {k: v.clone() for k, v in params.items()}
    m = {k: torch.zeros_like(v) for k, v in p.items()}
    v = {k: torch.zeros_like(x) for k, x in p.items()}
    prev = {k: torch.zeros_like(x) for k, x in p.items()}
    history = []
    for t, grads in enumerate(grads_list, start=1):
        for k, g in grads.items():
            c = g + gamma * b1 / (1 - b1) * (g - prev[k])
            c = c / max(float(c.norm()), 1.0)
            m[k] = b1 * m[k] + (1 - b1) * c
            v[k] = b2 * v[k] + (1 - b2) * c * c
            u = (m[k] / (1 - b1**t)) / ((v[k] / (1 - b2**t)).sqrt() + eps)
            p[k] = p[k] - lr * (u + weight_decay * p[k])
            prev[k] = g
        history.append({k: x.clone() for k, x in p.items()})
    return history


CASES = [dict(), dict(b1=0.9, b2=0.999, gamma=0.1, weight_decay=0.1), dict(gamma=0.0, eps=1e-6)]


@pytest.mark.parametrize("kwargs", CASES)
def test_mars_matches_the_per_tensor_reference(kwargs):
    params = make_params()
    grads = grad_stream(params, steps=STEPS)
    ours, state = run_purestep(ps.mars(1e-2, **kwargs), params, grads)
    assert_histories_close(ours, reference_mars(params, grads, 1e-2, **kwargs), rtol=1e-10)
    assert_moved(ours, params)
    for k in params:  # the previous gradient is in the state (and so in checkpoints)
        assert torch.equal(state[0].last_grad[k], grads[-1][k])


@pytest.mark.parametrize("kwargs", [dict(), dict(betas=(0.9, 0.999), gamma=0.1, weight_decay=0.1)])
def test_mars_matches_pytorch_optimizer_mars_adamw(kwargs):
    # eps tiny: pytorch_optimizer adds ε before the bias correction of √v, purestep after.
    params = make_params()
    grads = [{k: 3 * g for k, g in gs.items()} for gs in grad_stream(params, steps=STEPS)]  # norms > 1: clipped
    ours_kw = {("b1" if k == "betas" else k): v for k, v in kwargs.items()}
    if "b1" in ours_kw:
        ours_kw["b1"], ours_kw["b2"] = kwargs["betas"]
    ours, _ = run_purestep(ps.mars(1e-2, eps=1e-14, **ours_kw), params, grads)
    theirs, _ = run_torch(lambda t: pytorch_optimizer.MARS(list(t.values()), lr=1e-2, mars_type="adamw", optimize_1d=True,
                                                           eps=1e-14, foreach=False, **kwargs), params, grads)
    assert_histories_close(ours, theirs, rtol=1e-7)
    assert_moved(ours, params)


def test_mars_first_step_scales_the_grad_and_clips_per_leaf():
    params = {"small": torch.ones(4, dtype=torch.float64), "big": torch.ones(4, dtype=torch.float64)}
    g = {"small": torch.full((4,), 0.01, dtype=torch.float64), "big": torch.full((4,), 10.0, dtype=torch.float64)}
    opt = ps.scale_by_mars(gamma=0.5)
    _, state = opt.update(g, opt.init(params), params)
    c_small = 0.01 * (1 + 0.5 * 0.95 / 0.05)  # ‖c‖ < 1: kept
    torch.testing.assert_close(state.mu["small"], torch.full((4,), 0.05 * c_small, dtype=torch.float64))
    torch.testing.assert_close(float(state.mu["big"].norm()), 0.05)  # ‖c‖ > 1: clipped to 1
    assert math.isclose(float(state.nu["big"].sum()), 0.01, rel_tol=1e-12)


@pytest.mark.parametrize(
    "make, arg",
    [(lambda: ps.mars(-1.0), "lr"), (lambda: ps.mars(1e-3, b1=1.0), "b1"), (lambda: ps.mars(1e-3, gamma=-0.1), "gamma"),
     (lambda: ps.mars(1e-3, eps=0.0), "eps"), (lambda: ps.mars(1e-3, weight_decay=-1.0), "weight_decay")],
)
def test_mars_invalid_hyperparameters_raise_naming_the_argument(make, arg):
    with pytest.raises(ValueError, match=arg):
        make()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_mars_on_16_bit_same_shape_leaves_runs_compiled_and_donated_equal_to_eager(dtype):
    # 16-bit leaves are flat buffers of their own, never stacks (inductor 2.13 cannot compile the
    # per-leaf norm on stacks of them): it must run and equal the eager update.
    torch._dynamo.reset()
    g = torch.Generator().manual_seed(0)
    params = {k: torch.randn(8, 8, generator=g).to(dtype) for k in ("w0", "w1")}
    opt = ps.mars(1e-2, weight_decay=0.1)
    compiled, eager = ps.make_update(opt, compile=True, donate=True), ps.make_update(opt)
    p, s = {k: v.clone() for k, v in params.items()}, opt.init(params)
    p_ref, s_ref = {k: v.clone() for k, v in params.items()}, opt.init(params)
    for _ in range(3):
        grads = {k: torch.randn(8, 8, generator=g).to(dtype) for k in params}
        compiled(p, grads, s)
        p_ref, s_ref = eager(p_ref, grads, s_ref)
    assert compiled.explain().startswith("flat"), compiled.explain()
    assert sorted(map(sorted, compiled.layout().values())) == [["w0"], ["w1"]], compiled.layout()
    for k in params:
        torch.testing.assert_close(p[k], p_ref[k], rtol=1e-2, atol=1e-2)
