"""Per-param step counts in the adapter (issue 32), as torch.optim keeps them.

A param without a grad does not advance its own count, a param whose state is reset
starts its count over, an assigned or loaded `step` is that param's alone: checked against
torch.optim.AdamW/Adam/SGD over gradual unfreezing (ULMFiT-style: layers frozen with
`requires_grad_(False)`, then unfrozen one by one), resets, assignments and state dicts
both ways. The adapter splits a group into cohorts of params sharing one history; a
compiled group compiles each cohort once and never again per step.
"""

from __future__ import annotations

import copy

import pytest
import torch

import purestep.core as ps
from purestep.api import Optimizer

TORCH = {ps.adamw: torch.optim.AdamW, ps.adam: torch.optim.Adam, ps.sgd: torch.optim.SGD}


def _models(seed: int = 0) -> tuple[torch.nn.Module, torch.nn.Module]:
    torch.manual_seed(seed)
    a = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 8), torch.nn.Linear(8, 1))
    a = a.double()
    b = copy.deepcopy(a)
    return a, b


def _step(model: torch.nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor) -> None:
    opt.zero_grad()
    model(x).pow(2).mean().backward()
    opt.step()


def _close(a: torch.nn.Module, b: torch.nn.Module, what: str) -> None:
    for (n, p), q in zip(a.named_parameters(), b.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-10, atol=1e-12, msg=lambda m: f"{what} {n}: {m}")


def _steps(opt: torch.optim.Optimizer) -> dict[int, float]:
    return {i: float(e["step"]) for i, e in opt.state_dict()["state"].items() if "step" in e}


CASES = [
    (ps.adamw, {"lr": 1e-2, "weight_decay": 0.1}),
    (ps.adam, {"lr": 1e-2, "amsgrad": True, "weight_decay": 0.01}),
    (ps.sgd, {"lr": 1e-2, "momentum": 0.9, "dampening": 0.3, "nesterov": False}),
]


@pytest.mark.parametrize("factory, kwargs", CASES, ids=["adamw", "adam-amsgrad", "sgd-dampening"])
@pytest.mark.parametrize("frozen", [1, 20, 200])
def test_gradual_unfreezing_equals_torch(factory, kwargs, frozen):
    """The head trains alone for `frozen` steps, then the middle layer, then the first:
    each layer's first update after unfreezing has torch's step-1 bias correction."""
    ours, theirs = _models()
    opt = Optimizer(ours.parameters(), factory, **kwargs)
    ref = TORCH[factory](theirs.parameters(), **kwargs)
    layers = [0, 2]  # frozen first, unfrozen one by one (the last layer trains throughout)
    for m in (ours, theirs):
        for i in layers:
            m[i].requires_grad_(False)
    x = torch.randn(frozen + 12, 16, 8, dtype=torch.float64)
    for t in range(frozen + 12):
        if t == frozen or t == frozen + 6:
            unfreeze = layers[1] if t == frozen else layers[0]
            for m in (ours, theirs):
                m[unfreeze].requires_grad_(True)
        _step(ours, opt, x[t])
        _step(theirs, ref, x[t])
        _close(ours, theirs, f"step {t}")
    assert _steps(opt) == _steps(ref)
    if factory is not ps.sgd:
        assert sorted(set(_steps(opt).values())) == [6.0, 12.0, frozen + 12.0]
    # The per-param steps travel both ways.
    again = torch.optim.AdamW if factory is ps.adamw else TORCH[factory]
    into_torch = again(copy.deepcopy(theirs).parameters(), **kwargs)
    into_torch.load_state_dict(opt.state_dict())
    assert _steps(into_torch) == _steps(ref)
    twin_model = copy.deepcopy(ours)
    twin = Optimizer(twin_model.parameters(), factory, **kwargs)
    twin.load_state_dict(ref.state_dict())
    assert _steps(twin) == _steps(ref)
    for t in range(3):
        _step(twin_model, twin, x[t])
        _step(theirs, ref, x[t])
    _close(twin_model, theirs, "loaded from torch")


def test_a_compiled_group_compiles_each_cohort_once():
    """Unfreezing splits a compiled group: one compile per cohort, then none per step."""
    import torch._dynamo.utils as dynamo_utils

    ours, theirs = _models(1)
    opt = Optimizer(ours.parameters(), ps.adamw, lr=1e-2, compile=True)
    ref = torch.optim.AdamW(theirs.parameters(), lr=1e-2)
    for m in (ours, theirs):
        m[0].requires_grad_(False)
    x = torch.randn(14, 16, 8, dtype=torch.float64)
    dynamo_utils.counters.clear()
    for t in range(14):
        if t == 4:
            for m in (ours, theirs):
                m[0].requires_grad_(True)
        if t == 8:
            graphs = dynamo_utils.counters["stats"]["unique_graphs"]
        _step(ours, opt, x[t])
        _step(theirs, ref, x[t])
    _close(ours, theirs, "compiled")
    assert graphs == 2  # the trained layers, then the unfrozen one
    assert dynamo_utils.counters["stats"]["unique_graphs"] == graphs  # nothing compiled since
    assert sorted(set(_steps(opt).values())) == [10.0, 14.0]


@pytest.mark.parametrize("reset", ["pop", "clear", "step"])
def test_a_param_reset_or_given_a_step_alone_counts_on_its_own(reset):
    """torch's ways to touch one param's state mid-run: `state.pop(p)` and `state[p].clear()`
    start it over (its buffers and its count from 0); `state[p]["step"] = t` sets its count."""
    ours, theirs = _models(2)
    opt = Optimizer(ours.parameters(), ps.adamw, lr=1e-2)
    ref = torch.optim.AdamW(theirs.parameters(), lr=1e-2)
    x = torch.randn(12, 16, 8, dtype=torch.float64)
    for t in range(12):
        if t == 5:
            for o, m in ((opt, ours), (ref, theirs)):
                p = m[2].weight
                if reset == "pop":
                    o.state.pop(p)
                elif reset == "clear":
                    o.state[p].clear()
                else:
                    o.state[p]["step"] = torch.tensor(40.0)
        _step(ours, opt, x[t])
        _step(theirs, ref, x[t])
        _close(ours, theirs, f"{reset}, step {t}")
    assert _steps(opt) == _steps(ref)
    assert len(set(_steps(opt).values())) == 2


def test_schedulers_and_group_values_reach_every_cohort():
    """A scheduler's lr after the split reaches each cohort's state; a group's schedule of
    its own (a purestep schedule inside the transform) keeps the group's clock."""
    ours, theirs = _models(3)
    opt = Optimizer(ours.parameters(), ps.adamw, lr=1e-2, weight_decay=0.05)
    ref = torch.optim.AdamW(theirs.parameters(), lr=1e-2, weight_decay=0.05)
    scheds = [torch.optim.lr_scheduler.StepLR(o, step_size=2, gamma=0.5) for o in (opt, ref)]
    for m in (ours, theirs):
        m[0].requires_grad_(False)
    x = torch.randn(10, 16, 8, dtype=torch.float64)
    for t in range(10):
        if t == 3:
            for m in (ours, theirs):
                m[0].requires_grad_(True)
        for m, o, s in ((ours, opt, scheds[0]), (theirs, ref, scheds[1])):
            _step(m, o, x[t])
            s.step()
        _close(ours, theirs, f"step {t}")

    # A built transform whose lr is a schedule: the frozen layer's cohort keeps the clock.
    sched = ps.linear_schedule(1e-2, 0.0, 10)
    a, b = _models(4)
    opt = Optimizer(a.parameters(), ps.adamw(sched))
    ref = torch.optim.AdamW(b.parameters(), lr=1e-2)
    lam = torch.optim.lr_scheduler.LambdaLR(ref, lambda k: max(0.0, 1 - k / 10))
    for m in (a, b):
        m[0].requires_grad_(False)
    for t in range(8):
        if t == 4:
            for m in (a, b):
                m[0].requires_grad_(True)
        _step(a, opt, x[t])
        _step(b, ref, x[t])
        lam.step()
        _close(a, b, f"scheduled, step {t}")


def test_the_generic_layout_keeps_each_params_step():
    """A built transform (generic layout) whose params stepped apart saves each param's
    `step` and loads it back: the copy goes on as the original."""
    a, _ = _models(5)
    opt = Optimizer(a.parameters(), ps.lion(1e-3, weight_decay=0.1))
    a[0].requires_grad_(False)
    x = torch.randn(10, 16, 8, dtype=torch.float64)
    for t in range(3):
        _step(a, opt, x[t])
    a[0].requires_grad_(True)
    _step(a, opt, x[3])
    saved = opt.state_dict()
    assert sorted({float(e["step"]) for e in saved["state"].values()}) == [1.0, 4.0]
    b = copy.deepcopy(a)
    twin = Optimizer(b.parameters(), ps.lion(1e-3, weight_decay=0.1))
    twin.load_state_dict(saved)
    for t in range(4, 10):
        _step(a, opt, x[t])
        _step(b, twin, x[t])
    _close(a, b, "generic reload")
    assert _steps(twin) == _steps(opt)


def test_a_group_with_a_statistic_over_its_params_keeps_one_count():
    """Prodigy's estimate is over the whole group: its params do not split (a skipped param
    is held as it was, the group's count goes on), as the class docstring says."""
    a, _ = _models(6)
    opt = Optimizer(a.parameters(), ps.prodigy())
    a[0].requires_grad_(False)
    x = torch.randn(4, 16, 8, dtype=torch.float64)
    before = a[0].weight.detach().clone()
    for t in range(4):
        _step(a, opt, x[t])
    assert len(opt._groups[0].cohorts) == 1
    torch.testing.assert_close(a[0].weight.detach(), before, rtol=0, atol=0)
    assert int(ps.step_count(opt.opt_states[0])) == 4


def test_params_missing_grads_at_random_compile_a_bounded_number_of_cohorts(monkeypatch):
    """Unrouted experts: each step a random subset has no grad, so every param's count goes
    its own way (as torch's). A compiled group compiles at most `COMPILED_COHORTS` cohorts
    (2 here, to keep the test short); the rest run eagerly: equal to torch throughout."""
    import torch._dynamo.utils as dynamo_utils

    import purestep.api.optimizer._group as group

    monkeypatch.setattr(group, "COMPILED_COHORTS", 2)
    COMPILED_COHORTS = 2

    g = torch.Generator().manual_seed(0)
    ours = [torch.nn.Parameter(torch.randn(4, 3, generator=g, dtype=torch.float64)) for _ in range(6)]
    theirs = [torch.nn.Parameter(p.detach().clone()) for p in ours]
    opt = Optimizer(ours, ps.adamw, lr=1e-2, compile=True)
    ref = torch.optim.AdamW(theirs, lr=1e-2)
    dynamo_utils.counters.clear()
    for t in range(10):
        routed = torch.rand(6, generator=g) < 0.6
        grads = [torch.randn(4, 3, generator=g, dtype=torch.float64) for _ in range(6)]
        for params in (ours, theirs):
            for p, gr, on in zip(params, grads, routed):
                p.grad = gr.clone() if on else None
        opt.step()
        ref.step()
        for a, b in zip(ours, theirs):
            torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12, msg=lambda m: f"step {t}: {m}")
    assert len(opt._groups[0].cohorts) > COMPILED_COHORTS  # the histories parted further
    assert dynamo_utils.counters["stats"]["unique_graphs"] <= COMPILED_COHORTS  # the whole group never ran
    assert _steps(opt) == _steps(ref)


def test_groups_that_keep_one_count_still_skip_params_without_grads():
    """A mask given as a tree of the whole group (it cannot run on a part) and a
    `differentiable` group keep one count per group (the skipped param held as it was)."""
    ours, theirs = _models(7)
    names = [n for n, _ in ours.named_parameters()]
    mask = {n: n.endswith("weight") for n in names}
    opt = Optimizer(ours.named_parameters(), ps.adamw(1e-2, weight_decay=0.1, mask=mask))
    assert not opt._groups[0].cohortable
    ours[0].requires_grad_(False)
    before = ours[0].weight.detach().clone()
    x = torch.randn(3, 16, 8, dtype=torch.float64)
    for t in range(3):
        _step(ours, opt, x[t])
    assert torch.equal(ours[0].weight.detach(), before)
    # differentiable=True (non-leaf params, as torch's own test of the flag): steps equal torch's
    # while the params have grads; the group keeps one count.
    leaves = [torch.randn(4, 3, dtype=torch.float64, requires_grad=True) for _ in range(2)]
    ps_, qs = [p.clone() for p in leaves], [p.clone() for p in leaves]
    opt = Optimizer(ps_, ps.adamw, lr=0.1, differentiable=True)
    ref = torch.optim.AdamW(qs, lr=0.1, differentiable=True)
    assert not opt._groups[0].cohortable
    for _ in range(3):
        for params, o in ((ps_, opt), (qs, ref)):
            for p in params:
                p.grad = torch.ones_like(p)
            o.step()
    for a, b in zip(ps_, qs):  # torch's differentiable path keeps `step` in float32: 1e-6 apart here
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_the_state_copies_as_plain_dicts_and_takes_in_dicts_code_puts_there():
    """torch's semantics for `optimizer.state`: copy/deepcopy/pickle give plain dicts; a dict
    code assigns is the entry itself (later writes to it count), as is a whole new state."""
    import collections
    import pickle

    for edit in ("setitem", "new state"):
        held_dicts: dict[int, dict] = {}
        ours, theirs = _models(8)
        opt = Optimizer(ours.parameters(), ps.adamw, lr=1e-2)
        ref = torch.optim.AdamW(theirs.parameters(), lr=1e-2)
        x = torch.randn(6, 16, 8, dtype=torch.float64)
        for t in range(6):
            if t == 3:
                for o, p in ((opt, ours[0].weight), (ref, theirs[0].weight)):
                    if edit == "setitem":
                        d: dict = {}
                        o.state[p] = d
                    else:
                        new = collections.defaultdict(dict, {q: dict(e) for q, e in o.state.items()})
                        o.state = new
                        d = new[p]
                    d["step"] = torch.tensor(3.0)
                    d["exp_avg"] = torch.full_like(p, 0.3)
                    d["exp_avg_sq"] = torch.full_like(p, 0.2)
                    held_dicts[id(o)] = d  # written to again a step later
            if t == 4:  # the dict code holds is still the entry: a later write to it counts too
                for o, p in ((opt, ours[0].weight), (ref, theirs[0].weight)):
                    held_dicts[id(o)]["exp_avg"] = torch.full_like(p, 0.1)
            _step(ours, opt, x[t])
            _step(theirs, ref, x[t])
            _close(ours, theirs, f"{edit}, step {t}")
        for copied in (copy.copy(opt.state), copy.deepcopy(opt.state), pickle.loads(pickle.dumps(opt.state))):
            assert type(copied) is collections.defaultdict and len(copied) == 6  # 3 layers x (weight, bias)
            assert all(isinstance(e, dict) and "exp_avg" in e for e in copied.values())


def test_opt_states_show_the_largest_step_once_params_part():
    ours, _ = _models(9)
    opt = Optimizer(ours.parameters(), ps.adamw, lr=1e-2)
    ours[0].requires_grad_(False)
    x = torch.randn(4, 16, 8, dtype=torch.float64)
    for t in range(4):
        _step(ours, opt, x[t])
    assert sorted(set(_steps(opt).values())) == [4.0]  # the frozen layer never stepped: no entry
    assert int(ps.step_count(opt.opt_states[0])) == 4
