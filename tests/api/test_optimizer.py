"""The torch.optim.Optimizer adapter: parity with torch.optim, state_dict, GradScaler, lr schedulers."""

from __future__ import annotations

import copy
import io

import pytest
import torch

import purestep.core as ps
from purestep.api import Optimizer

STEPS = 12


def make_model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3)).double()


def batches(n: int = STEPS, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(16, 4, generator=g, dtype=torch.float64), torch.randn(16, 3, generator=g, dtype=torch.float64))
        for _ in range(n)
    ]


def loss_of(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return ((model(x) - y) ** 2).mean()


def train(model, opt, data, scheduler=None):
    for x, y in data:
        opt.zero_grad()
        loss_of(model, x, y).backward()
        opt.step()
        if scheduler is not None:
            scheduler.step()


def assert_same_params(a: torch.nn.Module, b: torch.nn.Module, exact: bool = False) -> None:
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        if exact:
            assert torch.equal(p, q), name
        else:
            torch.testing.assert_close(p, q, rtol=1e-12, atol=1e-14, msg=lambda m: f"{name}: {m}")


def test_adamw_adapter_matches_torch_adamw():
    ours, theirs = make_model(), make_model()
    data = batches()
    opt = Optimizer(ours.parameters(), ps.adamw(1e-2, betas=(0.8, 0.99), weight_decay=0.1))
    ref = torch.optim.AdamW(theirs.parameters(), lr=1e-2, betas=(0.8, 0.99), weight_decay=0.1)
    train(ours, opt, data)
    train(theirs, ref, data)
    assert_same_params(ours, theirs)
    state = opt.state_dict()["state"]
    for i, p in enumerate(theirs.parameters()):
        torch.testing.assert_close(state[i]["exp_avg"], ref.state[p]["exp_avg"], rtol=1e-12, atol=1e-15)
        torch.testing.assert_close(state[i]["exp_avg_sq"], ref.state[p]["exp_avg_sq"], rtol=1e-12, atol=1e-15)


def test_sgd_momentum_with_closure_matches_torch_sgd():
    ours, theirs = make_model(), make_model()
    opt = Optimizer(ours.parameters(), ps.sgd(0.05, momentum=0.9))
    ref = torch.optim.SGD(theirs.parameters(), lr=0.05, momentum=0.9)
    for x, y in batches():
        for model, o in ((ours, opt), (theirs, ref)):

            def closure(model=model, o=o):
                o.zero_grad()
                loss = loss_of(model, x, y)
                loss.backward()
                return loss

            loss = o.step(closure)
            assert loss is not None and loss.requires_grad
    assert_same_params(ours, theirs)
    for i, p in enumerate(theirs.parameters()):
        torch.testing.assert_close(
            opt.state_dict()["state"][i]["momentum_buffer"], ref.state[p]["momentum_buffer"], rtol=1e-12, atol=1e-15
        )


def test_named_parameters_reach_a_decay_mask():
    model = make_model()
    mask = lambda params: {name: name.endswith("weight") for name in params}  # noqa: E731
    opt = Optimizer(model.named_parameters(), ps.adamw(1e-2, weight_decay=0.5, mask=mask))
    ref_model = make_model()
    ref = torch.optim.AdamW(
        [
            {"params": [p for n, p in ref_model.named_parameters() if n.endswith("weight")], "weight_decay": 0.5},
            {"params": [p for n, p in ref_model.named_parameters() if n.endswith("bias")], "weight_decay": 0.0},
        ],
        lr=1e-2,
    )
    data = batches(4)
    train(model, opt, data)
    train(ref_model, ref, data)
    for (name, p), q in zip(model.named_parameters(), ref_model.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-12, atol=1e-14, msg=name)
    assert opt.param_groups[0]["param_names"] == [n for n, _ in model.named_parameters()]


def test_dict_labels_by_param_name():
    model = make_model()
    labels = {n: "train" if n.startswith("0.") else "freeze" for n, _ in model.named_parameters()}
    opt = Optimizer(model.named_parameters(), ps.partition({"train": ps.sgd(0.1), "freeze": ps.scale(0.0)}, labels))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    train(model, opt, batches(1))
    for n, p in model.named_parameters():
        assert torch.equal(p, before[n]) != n.startswith("0."), n


def test_param_groups_set_injected_hyperparameters_like_torch():
    ours, theirs = make_model(), make_model()
    opt = Optimizer(
        [
            {"params": ours[0].parameters(), "lr": 1e-3},
            {"params": ours[2].parameters(), "weight_decay": 0.0},
        ],
        ps.inject_hyperparams(ps.adamw)(lr=1e-2, weight_decay=0.1),
    )
    ref = torch.optim.AdamW(
        [{"params": theirs[0].parameters(), "lr": 1e-3}, {"params": theirs[2].parameters(), "weight_decay": 0.0}],
        lr=1e-2,
        weight_decay=0.1,
    )
    assert opt.param_groups[0]["lr"] == 1e-3 and opt.param_groups[1]["lr"] == 1e-2
    assert opt.param_groups[1]["weight_decay"] == 0.0 and opt.param_groups[0]["weight_decay"] == 0.1
    data = batches()
    train(ours, opt, data)
    train(theirs, ref, data)
    assert_same_params(ours, theirs)


def test_group_with_its_own_transform():
    ours, theirs = make_model(), make_model()
    opt = Optimizer(
        [{"params": ours[0].parameters()}, {"params": ours[2].parameters(), "transform": ps.sgd(0.1)}],
        ps.adam(1e-2),
    )
    ref_a = torch.optim.Adam(theirs[0].parameters(), lr=1e-2)
    ref_b = torch.optim.SGD(theirs[2].parameters(), lr=0.1)
    for x, y in batches(5):
        opt.zero_grad()
        ref_a.zero_grad()
        ref_b.zero_grad()
        loss_of(ours, x, y).backward()
        loss_of(theirs, x, y).backward()
        opt.step()
        ref_a.step()
        ref_b.step()
    assert_same_params(ours, theirs)


def test_group_setting_a_value_the_transform_does_not_hold_is_refused():
    model = make_model()
    with pytest.raises(ValueError, match="'weight_decay'.*inject_hyperparams"):
        Optimizer([{"params": model.parameters(), "weight_decay": 0.0}], ps.adamw(1e-2))


def test_state_dict_round_trips_and_resume_is_bit_identical():
    data = batches()
    transform = ps.inject_hyperparams(ps.adamw)(lr=1e-2, weight_decay=0.1)
    straight = make_model()
    opt = Optimizer(straight.named_parameters(), transform)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=STEPS)
    train(straight, opt, data, sched)

    first = make_model()
    opt1 = Optimizer(first.named_parameters(), transform)
    sched1 = torch.optim.lr_scheduler.CosineAnnealingLR(opt1, T_max=STEPS)
    train(first, opt1, data[:5], sched1)
    # Through bytes, with weights_only: tensors and plain values only.
    buf = io.BytesIO()
    torch.save({"model": first.state_dict(), "opt": opt1.state_dict(), "sched": sched1.state_dict()}, buf)
    buf.seek(0)
    saved = torch.load(buf, weights_only=True)

    resumed = make_model(seed=123)  # different init: everything comes from the checkpoint
    resumed.load_state_dict(saved["model"])
    opt2 = Optimizer(resumed.named_parameters(), transform)
    sched2 = torch.optim.lr_scheduler.CosineAnnealingLR(opt2, T_max=STEPS)
    opt2.load_state_dict(saved["opt"])
    sched2.load_state_dict(saved["sched"])
    assert opt2.param_groups[0]["lr"] == opt1.param_groups[0]["lr"]
    train(resumed, opt2, data[5:], sched2)
    assert_same_params(resumed, straight, exact=True)
    for a, b in zip(ps.tree_flatten_with_path(opt2.opt_states)[0], ps.tree_flatten_with_path(opt.opt_states)[0]):
        assert a[0] == b[0] and torch.equal(a[1], b[1]), a[0]


def test_load_state_dict_names_what_does_not_fit():
    model = make_model()
    opt = Optimizer(model.named_parameters(), ps.adam(1e-2))
    sd = copy.deepcopy(opt.state_dict())
    del sd["state"][1]["exp_avg_sq"]
    with pytest.raises(ValueError, match=r"state\[1\]\['exp_avg_sq'\].*param '0.bias'"):
        opt.load_state_dict(sd)
    sd = copy.deepcopy(opt.state_dict())
    sd["state"][0]["exp_avg"] = torch.zeros(2, 2)
    with pytest.raises(ValueError, match=r"state\[0\]\['exp_avg'\].*shape"):
        opt.load_state_dict(sd)
    sd = copy.deepcopy(opt.state_dict())
    sd["param_groups"][0]["param_names"][0] = "other.weight"
    with pytest.raises(ValueError, match="other.weight"):
        opt.load_state_dict(sd)


@pytest.mark.parametrize(
    "make_scheduler",
    [
        lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=3, gamma=0.5),
        lambda o: torch.optim.lr_scheduler.CosineAnnealingLR(o, T_max=STEPS, eta_min=1e-4),
        lambda o: torch.optim.lr_scheduler.OneCycleLR(o, max_lr=0.05, total_steps=STEPS),
    ],
    ids=["step", "cosine", "one_cycle_with_betas"],
)
def test_lr_scheduler_drives_injected_hyperparameters_as_torch(make_scheduler):
    ours, theirs = make_model(), make_model()
    opt = Optimizer(ours.parameters(), ps.inject_hyperparams(ps.adamw)(lr=1e-2, weight_decay=0.1))
    ref = torch.optim.AdamW(theirs.parameters(), lr=1e-2, weight_decay=0.1)
    s_ours, s_ref = make_scheduler(opt), make_scheduler(ref)
    data = batches()
    for x, y in data:
        for model, o, s in ((ours, opt, s_ours), (theirs, ref, s_ref)):
            o.zero_grad()
            loss_of(model, x, y).backward()
            o.step()
            s.step()
        assert opt.param_groups[0]["lr"] == ref.param_groups[0]["lr"]
    assert_same_params(ours, theirs)
    lr_in_state = ps.tree_get(opt.opt_states[0], "lr")
    assert lr_in_state.dtype == torch.float64  # pushed as a tensor, so no recompile under compile


def test_grad_scaler_drives_it_as_torch_including_skipped_steps():
    ours, theirs = make_model(), make_model()
    opt = Optimizer(ours.parameters(), ps.adamw(1e-2))
    ref = torch.optim.AdamW(theirs.parameters(), lr=1e-2)
    scalers = [torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=3) for _ in range(2)]
    scales = []
    for i, (x, y) in enumerate(batches()):
        for model, o, scaler in ((ours, opt, scalers[0]), (theirs, ref, scalers[1])):
            o.zero_grad()
            loss = loss_of(model, x, y)
            if i in (2, 7):
                loss = loss * float("inf")  # an overflow: GradScaler must skip this step
            scaler.scale(loss).backward()
            scaler.step(o)
            scaler.update()
        assert scalers[0].get_scale() == scalers[1].get_scale()
        scales.append(scalers[0].get_scale())
    assert min(scales) == 2.0**9 and max(scales) == 2.0**10  # backed off, then grew back
    assert_same_params(ours, theirs)
    # Two steps were skipped: the adapter applied exactly STEPS - 2 updates.
    assert int(ps.tree_get(opt.opt_states[0], "count")) == STEPS - 2


def test_params_without_grad_in_a_group_are_skipped_as_torch_skips_them():
    ours, theirs = make_model(), make_model()
    opt = Optimizer(ours.named_parameters(), ps.adamw(1e-2, weight_decay=0.1))
    ref = torch.optim.AdamW(theirs.parameters(), lr=1e-2, weight_decay=0.1)
    frozen = ("2.bias", 3)  # the output bias gets no grad on steps 2..4 (a head unused, a layer frozen)
    for step, (x, y) in enumerate(batches(6)):
        for model, o in ((ours, opt), (theirs, ref)):
            o.zero_grad()
            loss_of(model, x, y).backward()
            if 2 <= step <= 4:
                dict(model.named_parameters())[frozen[0]].grad = None
        held = dict(ours.named_parameters())[frozen[0]].detach().clone()
        held_m = opt.state_dict()["state"][frozen[1]]["exp_avg"].clone()
        opt.step()
        ref.step()
        if 2 <= step <= 4:  # untouched: value and its own moments
            assert torch.equal(dict(ours.named_parameters())[frozen[0]], held)
            assert torch.equal(opt.state_dict()["state"][frozen[1]]["exp_avg"], held_m)
    for (name, p), q in zip(ours.named_parameters(), theirs.parameters()):
        if name != frozen[0]:  # the others exactly as torch (the skipped one's bias correction counts every step)
            torch.testing.assert_close(p, q, rtol=1e-12, atol=1e-14, msg=lambda m: f"{name}: {m}")


def test_zero_grad_and_step_without_grads_are_no_ops():
    model = make_model()
    opt = Optimizer(model.parameters(), ps.adam(1e-2))
    before = [p.detach().clone() for p in model.parameters()]
    opt.step()
    x, y = batches(1)[0]
    loss_of(model, x, y).backward()
    opt.zero_grad()
    assert all(p.grad is None for p in model.parameters())
    opt.step()
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_a_non_transform_is_refused():
    with pytest.raises(ValueError, match="ps.Transform"):
        Optimizer(make_model().parameters(), torch.optim.SGD)


def test_an_lr_scheduler_on_a_transform_without_injected_lr_says_how_to_fix_it():
    opt = Optimizer(make_model().parameters(), ps.adamw(1e-2))
    with pytest.raises(KeyError, match="inject_hyperparams"):
        torch.optim.lr_scheduler.StepLR(opt, step_size=1)


# --------------------------------------------------------------------------- #
# torch.optim's state_dict layout: ours -> torch -> ours.
# --------------------------------------------------------------------------- #


def matrices_model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(4, 8, bias=False), torch.nn.Tanh(), torch.nn.Linear(8, 3, bias=False)
    ).double()


MIRRORED = {
    "sgd_dampening_decay": (ps.sgd, torch.optim.SGD, dict(lr=0.05, momentum=0.9, dampening=0.1, weight_decay=0.01)),
    "sgd_nesterov": (ps.sgd, torch.optim.SGD, dict(lr=0.05, momentum=0.9, nesterov=True)),
    "sgd_plain_maximize": (ps.sgd, torch.optim.SGD, dict(lr=0.05, maximize=True)),
    "adam": (ps.adam, torch.optim.Adam, dict(lr=1e-2, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.1)),
    "adam_amsgrad_maximize": (ps.adam, torch.optim.Adam, dict(lr=1e-2, weight_decay=0.1, amsgrad=True, maximize=True)),
    "adamw": (ps.adamw, torch.optim.AdamW, dict(lr=1e-2, betas=(0.8, 0.99), weight_decay=0.1)),
    "adamw_amsgrad": (ps.adamw, torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.1, amsgrad=True)),
    "muon": (ps.muon, torch.optim.Muon, dict(lr=0.02, momentum=0.9, weight_decay=0.1)),
}


def through_bytes(obj):
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)  # tensors and plain values only


def fresh_copy(model_fn, of: torch.nn.Module) -> torch.nn.Module:
    model = model_fn(seed=99)  # other weights: everything comes from `of`
    model.load_state_dict(of.state_dict())
    return model


@pytest.mark.parametrize("case", list(MIRRORED))
def test_state_dict_goes_to_torch_and_back_and_the_run_continues_as_torchs(case):
    """K steps ours -> K steps torch.optim -> K steps ours equals 3K steps of torch.optim:
    to float64 rounding (1e-12) for SGD/Adam/AdamW; for Muon to the bf16 Newton-Schulz
    tolerance of tests/core/test_muon.py (torch runs it in bf16, ours emulates it here)."""
    factory, cls, kw = MIRRORED[case]
    model_fn = matrices_model if cls.__name__ == "Muon" else make_model
    k = 6
    data = batches(3 * k)
    straight = model_fn()
    ref = cls(straight.parameters(), **kw)
    train(straight, ref, data)

    ours = model_fn()
    opt = Optimizer(ours.parameters(), factory, **kw)
    assert opt.torch_class is cls
    train(ours, opt, data[:k])
    theirs = fresh_copy(model_fn, ours)
    mid = cls(theirs.parameters(), lr=123.0)  # every group value must come from the state_dict
    mid.load_state_dict(through_bytes(opt.state_dict()))
    assert mid.param_groups[0]["lr"] == kw["lr"]
    train(theirs, mid, data[k : 2 * k])
    back = fresh_copy(model_fn, theirs)
    opt2 = Optimizer(back.parameters(), factory, **kw)
    opt2.load_state_dict(through_bytes(mid.state_dict()))
    train(back, opt2, data[2 * k :])

    if cls.__name__ == "Muon":
        for (name, p), q in zip(back.named_parameters(), straight.parameters()):
            torch.testing.assert_close(p, q, rtol=0, atol=1e-2 * kw["lr"] * 2 * len(data), msg=name)
    else:
        assert_same_params(back, straight)
    ours_sd, ref_sd = opt2.state_dict(), ref.state_dict()
    assert ours_sd["param_groups"] == ref_sd["param_groups"]  # torch's keys, values and order
    assert ours_sd["state"].keys() == ref_sd["state"].keys()
    for i, entry in ref_sd["state"].items():
        assert list(ours_sd["state"][i]) == list(entry), i  # torch's names, in torch's order
        for name, value in entry.items():
            assert value.dtype == ours_sd["state"][i][name].dtype, (i, name)
            if cls.__name__ != "Muon":
                torch.testing.assert_close(ours_sd["state"][i][name], value, rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize("case", ["sgd_dampening_decay", "adamw_amsgrad", "muon"])
def test_a_round_trip_through_torch_is_lossless(case):
    """ours -> torch -> ours with no torch step in between continues bit for bit."""
    factory, cls, kw = MIRRORED[case]
    model_fn = matrices_model if cls.__name__ == "Muon" else make_model
    data = batches(8)
    straight = model_fn()
    opt = Optimizer(straight.parameters(), factory, **kw)
    train(straight, opt, data)

    first = model_fn()
    opt1 = Optimizer(first.parameters(), factory, **kw)
    train(first, opt1, data[:4])
    mid = cls(fresh_copy(model_fn, first).parameters())
    mid.load_state_dict(through_bytes(opt1.state_dict()))
    resumed = fresh_copy(model_fn, first)
    opt2 = Optimizer(resumed.parameters(), factory, **kw)
    opt2.load_state_dict(through_bytes(mid.state_dict()))
    train(resumed, opt2, data[4:])
    assert_same_params(resumed, straight, exact=True)


def test_torch_state_before_any_step_loads_as_a_fresh_state():
    ours, theirs = make_model(), make_model()
    ref = torch.optim.AdamW(theirs.parameters(), lr=1e-2)
    opt = Optimizer(ours.parameters(), ps.adamw, lr=1e-2)
    assert opt.state_dict()["state"] == ref.state_dict()["state"] == {}
    opt.load_state_dict(ref.state_dict())
    data = batches()
    train(ours, opt, data)
    train(theirs, ref, data)
    assert_same_params(ours, theirs)


def test_factory_groups_take_any_argument_per_group_as_torch():
    ours, theirs = make_model(), make_model()
    groups = lambda m: [  # noqa: E731
        {"params": m[0].parameters(), "nesterov": True, "lr": 0.02},
        {"params": m[2].parameters(), "weight_decay": 0.1},
    ]
    opt = Optimizer(groups(ours), ps.sgd, lr=0.05, momentum=0.9)
    ref = torch.optim.SGD(groups(theirs), lr=0.05, momentum=0.9)
    assert [g["nesterov"] for g in opt.param_groups] == [True, False]
    train(ours, opt, batches())
    train(theirs, ref, batches())
    assert_same_params(ours, theirs)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.1, total_steps=4)  # reads "momentum"
    assert sched.get_last_lr()[0] == pytest.approx(0.004)


def test_factory_arguments_torch_cannot_hold_are_refused_with_the_fix():
    model = make_model()
    with pytest.raises(ValueError, match="lr is a schedule.*lr_scheduler"):
        Optimizer(model.parameters(), ps.adamw, lr=ps.cosine_schedule(1e-3, 10))
    with pytest.raises(ValueError, match="mask=.*no AdamW equivalent.*built transform"):
        Optimizer(model.parameters(), ps.adamw, lr=1e-3, mask=ps.decay_mask)
    with pytest.raises(
        ValueError, match="decoupled_weight_decay=True, but ps.adam runs Adam's decoupled_weight_decay=False"
    ):
        Optimizer([{"params": model.parameters(), "decoupled_weight_decay": True}], ps.adam, lr=1e-3)
    with pytest.raises(ValueError, match="param group 0 sets 'momentum', which neither ps.adamw nor AdamW takes"):
        Optimizer([{"params": model.parameters(), "momentum": 0.9}], ps.adamw, lr=1e-3)
    with pytest.raises(ValueError, match="Optimizer arguments for ps.adamw: .*'momentum'"):
        Optimizer(model.parameters(), ps.adamw, lr=1e-3, momentum=0.9)
    with pytest.raises(ValueError, match="go with a factory"):
        Optimizer(model.parameters(), ps.adamw(1e-3), lr=1e-3)


def test_a_structural_group_value_changed_later_is_refused():
    model = make_model()
    opt = Optimizer(model.parameters(), ps.sgd, lr=0.1, momentum=0.9)
    opt.param_groups[0]["nesterov"] = True
    loss_of(model, *batches(1)[0]).backward()
    with pytest.raises(ValueError, match="nesterov=True, but its transform was built with nesterov=False"):
        opt.step()


def test_loading_a_torch_state_dict_that_does_not_fit_names_what():
    model = make_model()
    x, y = batches(1)[0]
    ref = torch.optim.SGD(make_model().parameters(), lr=0.1, momentum=0.9, nesterov=True)
    opt = Optimizer(model.parameters(), ps.sgd, lr=0.1, momentum=0.9)
    with pytest.raises(ValueError, match="nesterov=True, this optimizer was built with nesterov=False"):
        opt.load_state_dict(ref.state_dict())

    ref = torch.optim.Adam(make_model().parameters(), lr=0.1)
    opt = Optimizer(model.parameters(), ps.adam, lr=0.1)
    generic = Optimizer(make_model().parameters(), ps.adam(0.1))
    with pytest.raises(ValueError, match="torch.optim's layout.*factory"):
        generic.load_state_dict(ref.state_dict())
    with pytest.raises(ValueError, match="generic layout.*keeps Adam's"):
        opt.load_state_dict(generic.state_dict())


# --------------------------------------------------------------------------- #
# Grads, zero_grad, replaced params, the compiled path.
# --------------------------------------------------------------------------- #


@pytest.mark.parametrize("set_to_none", [True, False])
def test_zero_grad_and_steps_without_backward_follow_torch(set_to_none):
    """zero_grad(set_to_none=False) keeps zero grads, so a step without backward still
    updates (Adam's momentum moves the params); with None grads the step is skipped."""
    ours, theirs = make_model(), make_model()
    opt = Optimizer(ours.parameters(), ps.adam, lr=1e-2)
    ref = torch.optim.Adam(theirs.parameters(), lr=1e-2)
    for i, (x, y) in enumerate(batches(6)):
        for model, o in ((ours, opt), (theirs, ref)):
            o.zero_grad(set_to_none=set_to_none)
            if i % 2 == 0:
                loss_of(model, x, y).backward()
            o.step()
        assert [p.grad is None for p in ours.parameters()] == [p.grad is None for p in theirs.parameters()]
    assert_same_params(ours, theirs)
    steps = {float(s["step"]) for s in ref.state_dict()["state"].values()}
    assert steps == {float(s["step"]) for s in opt.state_dict()["state"].values()} == {6.0 if not set_to_none else 3.0}


def test_a_param_whose_dtype_changed_after_construction_is_named():
    model = make_model()
    opt = Optimizer(model.named_parameters(), ps.adamw, lr=1e-2)
    model.float()  # replaces each param's data with a float32 copy
    loss_of(model, *(t.float() for t in batches(1)[0])).backward()
    with pytest.raises(ValueError, match=r"param '0.weight' is now torch.float32 .* built for torch.float64.*model.to"):
        opt.step()


def test_a_param_with_new_storage_is_followed_as_torch():
    ours, theirs = make_model(), make_model()
    opt = Optimizer(ours.parameters(), ps.adamw, lr=1e-2, compile=False)
    ref = torch.optim.AdamW(theirs.parameters(), lr=1e-2)
    for i, (x, y) in enumerate(batches()):
        if i == 3:
            for model in (ours, theirs):
                model[0].weight.data = model[0].weight.data.clone()
        for model, o in ((ours, opt), (theirs, ref)):
            o.zero_grad()
            loss_of(model, x, y).backward()
            o.step()
    assert_same_params(ours, theirs)


def test_the_size_rule_picks_eager_for_small_groups_and_compile_for_large_ones():
    from purestep.api.optimizer import AUTO_COMPILE_NUMEL

    small = torch.nn.Parameter(torch.zeros(3))
    large = torch.nn.Parameter(torch.zeros(AUTO_COMPILE_NUMEL))  # one group of each; nothing runs
    opt = Optimizer([{"params": [small]}, {"params": [large]}], ps.sgd, lr=0.1)
    assert [g.compiled for g in opt._groups] == [False, True]
    assert Optimizer([large], ps.sgd, lr=0.1, compile=False)._groups[0].compiled is False


def test_compiled_adapter_matches_torch_adamw_and_its_state_loads_into_torch():
    ours, theirs = make_model(), make_model()
    kw = dict(lr=1e-2, betas=(0.8, 0.99), weight_decay=0.1)
    opt = Optimizer(ours.parameters(), ps.adamw, compile=True, **kw)
    ref = torch.optim.AdamW(theirs.parameters(), **kw)
    sched, ref_sched = (torch.optim.lr_scheduler.CosineAnnealingLR(o, T_max=STEPS) for o in (opt, ref))
    data = batches()
    with torch.compiler.set_stance("fail_on_recompile"):
        for x, y in data[:1]:
            for model, o, s in ((ours, opt, sched), (theirs, ref, ref_sched)):
                o.zero_grad()
                loss_of(model, x, y).backward()
                with torch.compiler.set_stance("default"):  # the first step compiles
                    o.step()
                s.step()
        for x, y in data[1:]:  # lr changes every step: no recompile
            for model, o, s in ((ours, opt, sched), (theirs, ref, ref_sched)):
                o.zero_grad()
                loss_of(model, x, y).backward()
                o.step()
                s.step()
    assert_same_params(ours, theirs)
    assert opt._groups[0].update.layout() is not None  # it ran over flat buffers, the model followed
    sd = opt.state_dict()
    assert sd["param_groups"] == ref.state_dict()["param_groups"]
    for i, entry in ref.state_dict()["state"].items():
        for name, value in entry.items():
            torch.testing.assert_close(sd["state"][i][name], value, rtol=1e-12, atol=1e-15)


def test_ademamix_cautious_and_mup_factories_run_in_the_adapter_as_their_transforms():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2)).double()
    base = {k: tuple(d // 2 if d == 8 else d for d in p.shape) for k, p in model.named_parameters()}
    x = torch.randn(16, 4, dtype=torch.float64)
    for factory, kwargs in [
        (ps.ademamix, dict(lr=1e-2, b3=0.99)),
        (ps.cautious_adamw, dict(lr=1e-2)),
        (ps.mup_adamw, dict(lr=1e-2, base_shapes=base)),
    ]:
        net = copy.deepcopy(model)
        opt = Optimizer(net.named_parameters(), factory, **kwargs)
        pure, params = factory(**kwargs), {k: p.detach().clone() for k, p in model.named_parameters()}
        state = pure.init(params)
        for _ in range(5):
            opt.zero_grad()
            net(x).pow(2).mean().backward()
            grads = {k: p.grad.clone() for k, p in net.named_parameters()}
            opt.step()
            updates, state = pure.update(grads, state, params)
            params = ps.apply_updates(params, updates)
        for k, p in net.named_parameters():
            torch.testing.assert_close(p.detach(), params[k], rtol=1e-10, atol=1e-12, msg=f"{factory.__name__}: {k}")
    ademamix = Optimizer(model.named_parameters(), ps.ademamix, lr=1e-2)
    model(x).pow(2).mean().backward()
    ademamix.step()
    assert {"exp_avg_fast", "exp_avg_slow", "exp_avg_sq"} <= set(ademamix.state_dict()["state"][0])


def test_fourth_release_factories_run_in_the_adapter_as_their_transforms():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2)).double()
    x = torch.randn(16, 4, dtype=torch.float64)
    for factory, kwargs in [
        (ps.adopt, dict(lr=1e-2)),
        (ps.prodigy, dict(lr=1.0, d0=1e-3)),
        (ps.mars, dict(lr=1e-2)),
        (ps.laprop, dict(lr=1e-2, weight_decay=0.1)),
        (ps.adamc, dict(lr=1e-2, weight_decay=0.1)),
        (ps.kron, dict(lr=1e-2, weight_decay=0.1, update_prob=0.5)),
        (ps.lion, dict(lr=1e-3, weight_decay=0.5, cautious_weight_decay=True)),
    ]:
        net = copy.deepcopy(model)
        opt = Optimizer(net.named_parameters(), factory, **kwargs)
        pure, params = factory(**kwargs), {k: p.detach().clone() for k, p in model.named_parameters()}
        state = pure.init(params)
        for _ in range(5):
            opt.zero_grad()
            net(x).pow(2).mean().backward()
            grads = {k: p.grad.clone() for k, p in net.named_parameters()}
            opt.step()
            updates, state = pure.update(grads, state, params)
            params = ps.apply_updates(params, updates)
        for k, p in net.named_parameters():
            torch.testing.assert_close(p.detach(), params[k], rtol=1e-10, atol=1e-12, msg=f"{factory.__name__}: {k}")
        restored = Optimizer(copy.deepcopy(net).named_parameters(), factory, **kwargs)
        restored.load_state_dict(opt.state_dict())  # the state round-trips (MARS's last grad, Prodigy's x₀ and d)
        assert restored.state_dict()["state"].keys() == opt.state_dict()["state"].keys()


def test_a_named_state_dict_loads_into_an_unnamed_optimizer_and_back_as_torch_does():
    """torch's test_can_load_from_to_named_state_dict: the unnamed optimizer takes the saved
    groups' param_names; the named one keeps its own; both train on as torch's."""
    for named_first in (True, False):
        ours_model, torch_model = torch.nn.Linear(3, 2), torch.nn.Linear(3, 2)
        torch_model.load_state_dict(ours_model.state_dict())
        made = []
        for model, make in (
            (ours_model, lambda p: Optimizer(p, ps.adamw, lr=1e-2)),
            (torch_model, lambda p: torch.optim.AdamW(p, lr=1e-2)),
        ):
            first = make(model.named_parameters() if named_first else model.parameters())
            model(torch.ones(4, 3)).sum().backward()
            first.step()
            second = make(model.parameters() if named_first else model.named_parameters())
            second.load_state_dict(first.state_dict())
            made.append(second)
        ours, theirs = made
        assert [g.get("param_names") for g in ours.param_groups] == [g.get("param_names") for g in theirs.param_groups]
        assert ours.state_dict()["param_groups"][0].get("param_names") == theirs.state_dict()["param_groups"][0].get(
            "param_names"
        )
        for model, opt in ((ours_model, ours), (torch_model, theirs)):
            opt.zero_grad()
            model(torch.ones(4, 3)).sum().backward()
            opt.step()
        torch.testing.assert_close(ours_model.weight, torch_model.weight)


def _amp_run(make, inject_at=(2, 5), steps=8):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    opt = make(model)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=3)
    x, y = torch.randn(32, 8), torch.randn(32, 4)
    for i in range(steps):
        opt.zero_grad()
        scaler.scale(((model(x) - y) ** 2).mean()).backward()
        if i in inject_at:
            model[0].weight.grad[0, 0] = float("inf")
        scaler.step(opt)
        scaler.update()
    return model, opt, scaler


def test_fused_adapter_takes_torchs_amp_protocol_and_equals_fused_adamw_under_gradscaler_with_infs():
    ours, opt, our_scaler = _amp_run(lambda m: Optimizer(m.parameters(), ps.adamw, lr=1e-2, fused=True))
    theirs, topt, their_scaler = _amp_run(lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2, fused=True))
    assert opt._step_supports_amp_scaling and not hasattr(opt, "found_inf")  # GradScaler set and removed them
    assert our_scaler.get_scale() == their_scaler.get_scale()
    for a, b in zip(ours.parameters(), theirs.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    ours_state, their_state = opt.state_dict()["state"], topt.state_dict()["state"]
    assert float(ours_state[0]["step"]) == float(their_state[0]["step"]) == 6  # the 2 skipped steps did not count
    assert not Optimizer(ours.parameters(), ps.adamw, lr=1e-2)._step_supports_amp_scaling  # only fused, as torch


def test_fused_adapter_does_not_step_when_found_inf_is_set_by_hand():
    """torch's test_fused_does_not_step_if_foundinf: grads finite, found_inf = 1: nothing moves."""
    model = torch.nn.Linear(4, 3)
    before = [p.detach().clone() for p in model.parameters()]
    opt = Optimizer(model.parameters(), ps.adamw, lr=1e-2, fused=True)
    model(torch.randn(2, 4)).sum().backward()
    opt.grad_scale, opt.found_inf = torch.ones(()), torch.ones(())
    opt.step()
    for p, b in zip(model.parameters(), before):
        assert torch.equal(p.detach(), b)
    assert float(opt.state_dict()["state"].get(0, {}).get("step", 0)) == 0  # no step counted
    opt.found_inf = torch.zeros(())
    opt.step()
    assert not torch.equal(model.weight.detach(), before[0])
    assert float(opt.state_dict()["state"][0]["step"]) == 1


@pytest.mark.parametrize("read", ["one entry", "whole state"])
def test_reading_state_each_step_costs_the_next_step_nothing(read):
    """#32: code that reads a param's `step` or moments (or the whole state) every step marks
    nothing for the next step to check: one entry read shows that entry alone; the entries
    are live (torch's values), and a write to one is still taken in, that param alone."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    twin = copy.deepcopy(model)
    ours = Optimizer(model.parameters(), ps.adamw, lr=1e-2, compile=False)
    theirs = torch.optim.AdamW(twin.parameters(), lr=1e-2, foreach=False)
    first, other = next(model.parameters()), list(model.parameters())[-1]
    for step in range(1, 4):
        for m, opt in ((model, ours), (twin, theirs)):
            opt.zero_grad()
            m(torch.ones(2, 4)).sum().backward()
            opt.step()
        if read == "one entry":
            entry = ours.state[first]
            assert id(other) not in ours.state.shown_now  # that entry alone shown
        else:
            entry = dict(ours.state.items())[first]
            assert len(ours.state) == 4 and all("exp_avg" in e for e in ours.state.values())
        assert float(entry["step"]) == step == float(theirs.state[next(twin.parameters())]["step"])
        assert not ours.state.touched and not ours.state.edited  # reads: nothing to take in
    entry["exp_avg"] = torch.zeros_like(entry["exp_avg"])  # an edit to the entry read: taken in
    assert set(ours.state.touched) == {id(first)} and not ours.state.edited
    theirs.state[next(twin.parameters())]["exp_avg"] = torch.zeros_like(entry["exp_avg"])
    for m, opt in ((model, ours), (twin, theirs)):
        opt.zero_grad()
        m(torch.ones(2, 4)).sum().backward()
        opt.step()
    for a, b in zip(model.parameters(), twin.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
