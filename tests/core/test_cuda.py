"""The research pieces on CUDA: the testing kit, a compiled vmapped ensemble, apply_if_finite, amsgrad."""

from __future__ import annotations

import pytest
import torch

import purestep.core as ps
from purestep.core import testing as kit
from tests.core.test_ensemble import check_compiled_ensemble
from tests.core.test_testing import FAST, _fails, sign_momentum

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def test_kit_checks_a_transform_on_cuda_and_catches_nan_on_zero_grads():
    kit.check_transform(sign_momentum, device="cuda", **FAST)
    kit.check_transform(
        ps.adamw, hyperparams=kit.hyperparams("lr", "betas", "weight_decay"), reference=torch.optim.AdamW,
        device="cuda", **FAST,
    )
    message = _fails(
        "finite_outputs", lambda: kit.check_transform(lambda: sign_momentum(bug="nan_on_zero"), device="cuda", **FAST)
    )
    assert "grads per step: [zeros]" in message


def test_kit_catches_state_left_on_the_cpu():
    def cpu_count(**hp):
        t = sign_momentum(**hp)
        return ps.Transform(lambda p: t.init(p)._replace(count=torch.zeros((), dtype=torch.int64)), t.update)

    kit.check_transform(cpu_count, checks=("purity",), device="cuda", **FAST)  # runs: the devices mix silently
    _fails("state_stability", lambda: kit.check_transform(cpu_count, device="cuda", **FAST))


def test_compiled_vmapped_ensemble_on_cuda_matches_each_member():
    check_compiled_ensemble("cuda", torch.float32, rtol=1e-4, atol=1e-5)


def test_apply_if_finite_keeps_a_cuda_state_finite_and_amsgrad_matches_torch():
    params = {"w": torch.zeros(3, device="cuda")}
    opt = ps.apply_if_finite(ps.adam(1e-3, amsgrad=True))
    _, state = opt.update({"w": torch.full((3,), 1e30, device="cuda")}, opt.init(params), params)
    assert int(state.total_notfinite) == 1 and bool(torch.isfinite(ps.tree_get(state, "nu")["w"]).all())
    p = torch.nn.Parameter(torch.randn(5, 4, device="cuda", dtype=torch.float64))
    ref = torch.optim.AdamW([p], lr=1e-2, amsgrad=True, maximize=True)
    opt = ps.adamw(1e-2, amsgrad=True, maximize=True)
    ours = {"p": p.detach().clone()}
    s = opt.init(ours)
    for _ in range(10):
        g = torch.randn_like(p)
        u, s = opt.update({"p": g}, s, ours)
        ours = ps.apply_updates(ours, u)
        p.grad = g
        ref.step()
    torch.testing.assert_close(ours["p"], p.detach(), rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(ps.tree_get(s, "nu_max")["p"], ref.state[p]["max_exp_avg_sq"], rtol=1e-10, atol=1e-14)
