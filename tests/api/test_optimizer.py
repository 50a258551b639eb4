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
    return [(torch.randn(16, 4, generator=g, dtype=torch.float64), torch.randn(16, 3, generator=g, dtype=torch.float64)) for _ in range(n)]


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


def test_params_without_grad_in_a_group_are_named():
    model = make_model()
    opt = Optimizer(model.named_parameters(), ps.sgd(0.1))
    x, y = batches(1)[0]
    loss_of(model, x, y).backward()
    model[2].bias.grad = None
    with pytest.raises(ValueError, match="2.bias"):
        opt.step()


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
