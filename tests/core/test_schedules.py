"""Schedules against torch.optim.lr_scheduler and optax, tensor steps against int steps."""

from __future__ import annotations

import math

import pytest
import torch

import purestep.core as ps
from tests.registry import SCHEDULES

jax = pytest.importorskip("jax")
jax.config.update("jax_enable_x64", True)
optax = pytest.importorskip("optax")

REL = 1e-6


def _close(ours, ref, where=""):
    assert ours == pytest.approx(ref, rel=REL, abs=1e-12), where


def _torch_lrs(make_scheduler, steps, lr=1.0, opt="sgd", **opt_kw):
    """lr (and momentum) the scheduler sets for optimizer steps 0..steps-1."""
    p = torch.nn.Parameter(torch.zeros(1, dtype=torch.float64))
    o = torch.optim.SGD([p], lr=lr, momentum=0.9, **opt_kw) if opt == "sgd" else torch.optim.Adam([p], lr=lr)
    sched = make_scheduler(o)
    lrs, moms = [], []
    for _ in range(steps):
        g = o.param_groups[0]
        lrs.append(g["lr"])
        moms.append(g["momentum"] if opt == "sgd" else g["betas"][0])
        o.step()
        sched.step()
    return lrs, moms


# --------------------------------------------------------------------------- #
# torch.optim.lr_scheduler
# --------------------------------------------------------------------------- #


@pytest.mark.parametrize("final", [0.0, 0.05])
def test_cosine_schedule_matches_cosine_annealing_lr_then_stays_at_final(final):
    steps = 37
    lrs, _ = _torch_lrs(lambda o: torch.optim.lr_scheduler.CosineAnnealingLR(o, T_max=steps, eta_min=final), steps + 1, lr=0.3)
    s = ps.cosine_schedule(0.3, steps, final)
    for t, ref in enumerate(lrs):
        _close(s(t), ref, t)
    # Past T_max torch rises again; ours stays at final.
    for t in (steps, steps + 1, 3 * steps):
        assert s(t) == pytest.approx(final, abs=1e-15)


ONE_CYCLE_CASES = [
    dict(),
    dict(anneal="linear"),
    dict(three_phase=True),
    dict(three_phase=True, anneal="linear"),
    dict(pct_start=0.1, div_factor=10.0, final_div_factor=100.0),
    dict(pct_start=0.45, div_factor=3.0, final_div_factor=1e3, three_phase=True),
]


@pytest.mark.parametrize("kw", ONE_CYCLE_CASES, ids=lambda kw: ",".join(f"{k}={v}" for k, v in kw.items()) or "default")
@pytest.mark.parametrize("opt", ["sgd", "adam"])
def test_one_cycle_matches_one_cycle_lr_and_its_momentum(kw, opt):
    total = 53
    torch_kw = dict(kw)
    if "anneal" in torch_kw:
        torch_kw["anneal_strategy"] = torch_kw.pop("anneal")
    lrs, moms = _torch_lrs(
        lambda o: torch.optim.lr_scheduler.OneCycleLR(
            o, max_lr=0.7, total_steps=total, base_momentum=0.8, max_momentum=0.93, **torch_kw
        ),
        total,
        opt=opt,
    )
    lr = ps.one_cycle_schedule(0.7, total, **kw)
    mom_kw = {k: v for k, v in kw.items() if k in ("pct_start", "anneal", "three_phase")}
    mom = ps.one_cycle_momentum_schedule(total, base=0.8, max=0.93, **mom_kw)
    for t in range(total):
        _close(lr(t), lrs[t], ("lr", t))
        _close(mom(t), moms[t], ("momentum", t))


def test_one_cycle_stays_at_its_final_value_after_the_run():
    s = ps.one_cycle_schedule(1.0, 20)
    assert s(19) == pytest.approx(1.0 / 25 / 1e4)
    assert s(25) == s(19) == s(1000)


def test_one_cycle_drives_sgd_like_one_cycle_lr():
    """The schedules plugged into ps.sgd give torch's trajectory with OneCycleLR."""
    total = 20
    w0 = torch.randn(5, dtype=torch.float64)
    target = torch.randn(5, dtype=torch.float64)
    p = torch.nn.Parameter(w0.clone())
    opt = torch.optim.SGD([p], lr=0.1, momentum=0.9)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.1, total_steps=total)
    ours = ps.sgd(ps.one_cycle_schedule(0.1, total), momentum=ps.one_cycle_momentum_schedule(total))
    params = {"w": w0.clone()}
    state = ours.init(params)
    for _ in range(total):
        opt.zero_grad()
        ((p - target) ** 2).sum().backward()
        opt.step()
        sched.step()
        grads = {"w": 2 * (params["w"] - target)}
        updates, state = ours.update(grads, state, params)
        params = ps.apply_updates(params, updates)
    torch.testing.assert_close(params["w"], p.detach(), rtol=1e-10, atol=1e-12)


# --------------------------------------------------------------------------- #
# optax
# --------------------------------------------------------------------------- #


def _optax(s, t):
    return float(s(jax.numpy.asarray(t, dtype=jax.numpy.float64)))


@pytest.mark.parametrize("init,end,steps,begin", [(1.0, 0.1, 30, 0), (0.0, 2.0, 7, 5), (3.0, 3.0, 1, 0), (1.0, 0.5, 0, 0)])
def test_linear_schedule_matches_optax(init, end, steps, begin):
    s = ps.linear_schedule(init, end, steps, begin=begin)
    ref = optax.linear_schedule(init, end, steps, transition_begin=begin)
    for t in range(0, steps + begin + 10):
        _close(s(t), _optax(ref, t), t)


@pytest.mark.parametrize("init,peak,warmup,total,final", [(0.0, 1e-3, 10, 100, 0.0), (1e-5, 3e-4, 0, 50, 1e-5), (0.1, 1.0, 49, 50, 0.2)])
def test_warmup_cosine_schedule_matches_optax(init, peak, warmup, total, final):
    s = ps.warmup_cosine_schedule(peak, warmup, total, init=init, final=final)
    ref = optax.warmup_cosine_decay_schedule(init, peak, warmup, total, final)
    for t in range(total + 10):
        _close(s(t), _optax(ref, t), t)


def test_piecewise_constant_schedule_matches_optax():
    bs = {10: 0.5, 4: 2.0, 25: 0.1, 26: 0.0}
    s = ps.piecewise_constant_schedule(0.3, bs)
    ref = optax.piecewise_constant_schedule(0.3, bs)
    for t in range(40):
        _close(s(t), _optax(ref, t), t)


def test_join_schedules_matches_optax():
    ours = ps.join_schedules(
        [ps.linear_schedule(0.0, 1.0, 10), ps.cosine_schedule(1.0, 20, 0.1), ps.constant_schedule(0.1)], [10, 30]
    )
    ref = optax.join_schedules(
        [optax.linear_schedule(0.0, 1.0, 10), optax.cosine_decay_schedule(1.0, 20, alpha=0.1), optax.constant_schedule(0.1)],
        [10, 30],
    )
    for t in range(45):
        _close(ours(t), _optax(ref, t), t)


# --------------------------------------------------------------------------- #
# Hand-checked shapes (no reference package).
# --------------------------------------------------------------------------- #


@pytest.mark.parametrize("shape", ["linear", "cosine", "sqrt"])
def test_wsd_schedule_warms_up_holds_then_decays_with_its_shape(shape):
    peak, final, W, T, D = 2.0, 0.2, 5, 40, 10
    s = ps.wsd_schedule(peak, W, T, D, init=0.0, final=final, shape=shape)
    decay = {
        "linear": lambda tau: peak - (peak - final) * tau,
        "cosine": lambda tau: final + (peak - final) * (1 + math.cos(math.pi * tau)) / 2,
        "sqrt": lambda tau: peak - (peak - final) * math.sqrt(tau),
    }[shape]
    for t in range(T + 5):
        if t < W:
            want = peak * t / W
        elif t < T - D:
            want = peak
        else:
            want = decay(min(t - (T - D), D) / D)
        _close(s(t), want, t)
    assert s(T) == pytest.approx(final) and s(T - D) == pytest.approx(peak)


def test_inverse_sqrt_schedule_warms_up_then_decays_as_one_over_sqrt_t():
    s = ps.inverse_sqrt_schedule(1e-3, 100)
    for t in range(0, 100, 7):
        _close(s(t), 1e-3 * t / 100, t)
    for t in (100, 400, 10_000):
        _close(s(t), 1e-3 * math.sqrt(100 / t), t)


# --------------------------------------------------------------------------- #
# Every registered schedule: tensor steps == int steps, float64 out, compile.
# --------------------------------------------------------------------------- #

STEPS = [0, 1, 2, 3, 5, 9, 10, 11, 17, 29, 30, 31, 50, 99, 100, 101, 150, 500, 1000]


@pytest.mark.parametrize("name", sorted(SCHEDULES))
@pytest.mark.parametrize("dtype", [torch.float64, torch.int64, torch.float32])
def test_tensor_steps_give_float64_tensors_equal_to_int_steps(name, dtype):
    s = SCHEDULES[name]()
    for t in STEPS:
        value = s(torch.tensor(t, dtype=dtype))
        assert isinstance(value, torch.Tensor) and value.dim() == 0 and value.dtype == torch.float64
        ref = s(t)
        assert isinstance(ref, float)
        assert value.item() == ref, (name, t)


def test_every_public_schedule_is_registered():
    public = {n for n in ps.__all__ if n.endswith("_schedule") or n == "join_schedules"}
    assert public <= set(SCHEDULES), public - set(SCHEDULES)


def test_a_schedule_compiles_with_fullgraph_and_does_not_recompile_as_the_step_advances():
    s = ps.join_schedules(
        [ps.warmup_cosine_schedule(1.0, 5, 50, final=0.1), ps.wsd_schedule(0.1, 0, 20, 5, final=0.0, shape="sqrt")], [50]
    )
    compiled = torch.compile(s, fullgraph=True)
    first = compiled(torch.tensor(0.0, dtype=torch.float64))
    assert first.item() == s(0)
    with torch.compiler.set_stance("fail_on_recompile"):
        for t in (1, 4, 5, 30, 50, 60, 67, 80):
            assert compiled(torch.tensor(float(t), dtype=torch.float64)).item() == pytest.approx(s(t), rel=1e-12, abs=1e-15)


# --------------------------------------------------------------------------- #
# Bad input.
# --------------------------------------------------------------------------- #


@pytest.mark.parametrize(
    "make,name",
    [
        (lambda: ps.warmup_cosine_schedule(1.0, 100, 50), "warmup_steps"),
        (lambda: ps.warmup_cosine_schedule(1.0, 50, 50), "warmup_steps"),
        (lambda: ps.wsd_schedule(1.0, 10, 100, 200), "decay_steps"),
        (lambda: ps.wsd_schedule(1.0, 200, 100, 10), "warmup_steps"),
        (lambda: ps.wsd_schedule(1.0, 60, 100, 50), "decay_steps"),
        (lambda: ps.wsd_schedule(1.0, 10, 100, 20, shape="exp"), "shape"),
        (lambda: ps.wsd_schedule(1.0, 10, 100, 0), "decay_steps"),
        (lambda: ps.one_cycle_schedule(1.0, 100, anneal="cosine"), "anneal"),
        (lambda: ps.one_cycle_momentum_schedule(100, anneal="exp"), "anneal"),
        (lambda: ps.one_cycle_schedule(1.0, 100, pct_start=1.5), "pct_start"),
        (lambda: ps.one_cycle_schedule(1.0, 0), "total_steps"),
        (lambda: ps.one_cycle_schedule(1.0, 100, div_factor=0.0), "div_factor"),
        (lambda: ps.cosine_schedule(1.0, 0), "steps"),
        (lambda: ps.linear_schedule(1.0, 0.0, -1), "steps"),
        (lambda: ps.inverse_sqrt_schedule(1.0, 0), "warmup_steps"),
        (lambda: ps.piecewise_constant_schedule(1.0, {10: -0.5}), "boundaries_and_scales"),
        (lambda: ps.join_schedules([ps.constant_schedule(1.0)], [10]), "boundaries"),
        (lambda: ps.constant_schedule(float("nan")), "value"),
    ],
)
def test_bad_arguments_raise_value_error_naming_the_argument(make, name):
    with pytest.raises(ValueError, match=name):
        make()


def test_a_non_scalar_step_is_refused():
    with pytest.raises(ValueError, match="0-d"):
        ps.constant_schedule(1.0)(torch.zeros(2))


# --------------------------------------------------------------------------- #
# Invariants over drawn arguments: monotone phases, continuity, bounds.
# --------------------------------------------------------------------------- #

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from purestep.core.testing import check_schedule  # noqa: E402

_FAST = settings(max_examples=25, deadline=None)


@_FAST
@given(st.sampled_from([0, 4, 9, 30]), st.integers(4, 60), st.floats(1e-4, 1.0), st.floats(0.0, 0.9), st.floats(0.0, 0.5))
def test_warmup_cosine_is_monotone_in_each_phase_continuous_and_bounded(warmup, decay, peak, init_frac, final_frac):
    total = warmup + decay
    s = ps.warmup_cosine_schedule(peak, warmup, total, init=init_frac * peak, final=final_frac * peak)
    check_schedule(s, steps=total + 5, boundaries=[warmup, total], bounds=(0.0, peak), jump_factor=8.0)


@_FAST
@given(st.sampled_from([0, 4, 13]), st.integers(0, 20), st.integers(4, 30), st.sampled_from(["linear", "cosine", "sqrt"]), st.floats(0.0, 0.5))
def test_wsd_is_monotone_in_each_phase_and_bounded(warmup, stable, decay, shape, final_frac):
    total = warmup + stable + decay
    s = ps.wsd_schedule(1.0, warmup, total, decay, final=final_frac, shape=shape)
    # sqrt's slope is unbounded at the start of the decay, so no jump check there
    check_schedule(
        s, steps=total + 5, boundaries=[warmup, total - decay, total], bounds=(0.0, 1.0),
        continuous=shape != "sqrt", jump_factor=8.0,
    )


@_FAST
@given(st.integers(2, 10), st.integers(1, 4), st.booleans(), st.sampled_from(["cos", "linear"]))
def test_one_cycle_rises_then_falls_within_its_bounds(up, k, three_phase, anneal):
    total = up * k * 4  # pct_start·total = up·k, a whole step, so the peak falls on a step
    pct = 0.25
    s = ps.one_cycle_schedule(1.0, total, pct_start=pct, anneal=anneal, three_phase=three_phase)
    e1 = int(pct * total) - 1
    bounds = [e1, 2 * e1 + 1] if three_phase else [e1]
    check_schedule(s, steps=total + 3, boundaries=[*bounds, total - 1], bounds=(1.0 / 25 / 1e4, 1.0), continuous=False)
    m = ps.one_cycle_momentum_schedule(total, pct_start=pct, anneal=anneal, three_phase=three_phase)
    check_schedule(m, steps=total + 3, boundaries=[*bounds, total - 1], bounds=(0.85, 0.95), continuous=False)
