"""The adapter where torch's own optimizer machinery and common wrappers look (issue 23, part)."""

from __future__ import annotations

import copy
import io
import pickle

import pytest
import torch

import purestep.core as ps
from purestep.api import Optimizer
from tests.api.test_optimizer import assert_same_params, batches, make_model, train


def test_torch_implementation_flags_are_accepted_and_said_what_they_do():
    model = make_model()
    opt = Optimizer(model.parameters(), ps.adamw, lr=1e-2, foreach=False, fused=True, capturable=True)
    assert opt._compile is True  # fused: purestep's fused step, compiled over flat buffers
    assert opt.param_groups[0]["fused"] is True and opt.param_groups[0]["foreach"] is False
    with pytest.raises(ValueError, match="differentiable=True runs the pure update eagerly"):
        Optimizer(model.parameters(), ps.adamw, lr=1e-2, differentiable=True, compile=True)


@pytest.mark.parametrize("factory, cls, kwargs", [
    (ps.sgd, torch.optim.SGD, {"lr": 0.1, "weight_decay": 0.1}),  # torch's SGD detaches a fresh momentum buffer
    (ps.adamw, torch.optim.AdamW, {"lr": 0.1, "weight_decay": 0.1}),
])
def test_differentiable_steps_carry_gradients_as_torchs_do(factory, cls, kwargs):
    def meta_grad(make):
        torch.manual_seed(0)
        p0 = torch.randn(5, requires_grad=True)
        p = p0.clone()  # a non-leaf param, as torch's differentiable tests use
        opt = make([p])
        for _ in range(3):
            p.grad = (p * p).detach() + p - 1.0  # a grad that depends on p, recorded
            opt.step()
        (p.sum() ** 2).backward()
        return p.detach(), p0.grad

    ours = meta_grad(lambda ps_: Optimizer(ps_, factory, differentiable=True, **kwargs))
    theirs = meta_grad(lambda ps_: cls(ps_, differentiable=True, **kwargs))
    torch.testing.assert_close(ours[0], theirs[0], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(ours[1], theirs[1], rtol=1e-4, atol=1e-5)
    assert ours[1].abs().max() > 0  # a gradient flowed through the steps


def test_extra_group_keys_are_kept_and_a_layer_decay_scheduler_reads_them():
    ours, theirs = make_model(), make_model()
    groups = lambda m: [{"params": [p], "lr_scale": 0.5 ** i} for i, p in enumerate(m.parameters())]  # noqa: E731
    opt = Optimizer(groups(ours), ps.adamw, lr=1e-2)
    ref = torch.optim.AdamW(groups(theirs), lr=1e-2)
    for o in (opt, ref):  # timm's layer decay: each step, lr = base · lr_scale
        for g in o.param_groups:
            g["lr"] = 1e-2 * g["lr_scale"]
    train(ours, opt, batches())
    train(theirs, ref, batches())
    assert_same_params(ours, theirs)
    assert [g["lr_scale"] for g in opt.state_dict()["param_groups"]] == [0.5 ** i for i in range(4)]
    with pytest.raises(ValueError, match="'momentum', which neither ps.adamw nor AdamW takes"):
        Optimizer([{"params": make_model().parameters(), "momentum": 0.9}], ps.adamw, lr=1e-3)


def test_state_dict_hooks_run_as_in_torch():
    opt = Optimizer(make_model().parameters(), ps.adamw, lr=1e-2)
    seen = []
    opt.register_state_dict_pre_hook(lambda o: seen.append("pre"))
    opt.register_state_dict_post_hook(lambda o, sd: {**sd, "extra": 1})
    opt.register_load_state_dict_pre_hook(lambda o, sd: {k: v for k, v in sd.items() if k != "extra"})
    opt.register_load_state_dict_post_hook(lambda o: seen.append("loaded"))
    sd = opt.state_dict()
    assert sd["extra"] == 1 and seen == ["pre"]
    opt.load_state_dict(sd)
    assert seen == ["pre", "loaded"]


@pytest.mark.parametrize("copier", ["deepcopy", "pickle", "torch.save"])
def test_a_copied_optimizer_works_and_continues_where_the_original_was(copier):
    model = make_model()
    opt = Optimizer(model.parameters(), ps.adamw, lr=1e-2, weight_decay=0.1)
    train(model, opt, batches(4))
    bundle = {"model": model, "opt": opt}
    if copier == "deepcopy":
        copied = copy.deepcopy(bundle)
    elif copier == "pickle":
        copied = pickle.loads(pickle.dumps(bundle))
    else:
        buf = io.BytesIO()
        torch.save(bundle, buf)
        copied = torch.load(io.BytesIO(buf.getvalue()), weights_only=False)
    later = batches(4, seed=7)
    train(model, opt, later)
    train(copied["model"], copied["opt"], later)  # the copy steps its own model's params
    assert_same_params(copied["model"], model)


@pytest.mark.parametrize(
    "damage",
    [
        lambda sd: sd["param_groups"][0].__setitem__("lr", "fast"),
        lambda sd: sd["param_groups"][0].__setitem__("betas", (0.9, 0.99, 0.5)),
        lambda sd: sd["param_groups"][0].__setitem__("weight_decay", 2**100),
        lambda sd: sd["param_groups"][0].__setitem__("amsgrad", True),
    ],
    ids=["string lr", "three betas", "huge decay", "structure"],
)
def test_a_refused_load_leaves_the_optimizer_as_it_was(damage):
    model = make_model()
    opt = Optimizer(model.parameters(), ps.adamw, lr=1e-2)
    train(model, opt, batches(2))
    good = opt.state_dict()
    bad = copy.deepcopy(good)
    bad["state"] = {k: {n: v.clone() + 1 if torch.is_tensor(v) else v for n, v in s.items()} for k, s in bad["state"].items()}
    damage(bad)
    before = copy.deepcopy(opt.state_dict())
    with pytest.raises(ValueError):
        opt.load_state_dict(bad)
    after = opt.state_dict()
    assert after["param_groups"] == before["param_groups"]
    for k in before["state"]:
        for n, v in before["state"][k].items():
            assert torch.equal(torch.as_tensor(after["state"][k][n]), torch.as_tensor(v)), (k, n)
    train(model, opt, batches(2))  # and it still steps


def test_named_and_unnamed_state_dicts_load_into_each_other():
    named = Optimizer(make_model().named_parameters(), ps.adamw, lr=1e-2)
    plain = Optimizer(make_model().parameters(), ps.adamw, lr=1e-2)
    plain.load_state_dict(named.state_dict())
    named.load_state_dict(plain.state_dict())
    ref = torch.optim.AdamW(make_model().parameters(), lr=1e-2)
    ref.load_state_dict(named.state_dict())  # torch takes it too


def test_built_on_meta_params_then_materialized_it_trains_as_built_on_real_ones():
    swap = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)  # to_empty keeps the Parameter objects
    try:
        with torch.device("meta"):
            deferred = make_model()
        opt = Optimizer(deferred.parameters(), ps.adamw, lr=1e-2, weight_decay=0.1)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5 ** s)  # sets the lr while params are meta
        with pytest.raises(ValueError, match="still on the meta device"):
            opt.state_dict()
        deferred.to_empty(device="cpu")
        deferred.load_state_dict(make_model().state_dict())
        eager = make_model()
        ref = Optimizer(eager.parameters(), ps.adamw, lr=1e-2, weight_decay=0.1)
        ref_sched = torch.optim.lr_scheduler.LambdaLR(ref, lambda s: 0.5 ** s)
        train(deferred, opt, batches(4), sched)
        train(eager, ref, batches(4), ref_sched)
        assert_same_params(deferred, eager, exact=True)
    finally:
        torch.__future__.set_swap_module_params_on_conversion(swap)


class Lookahead:
    """timm's Lookahead in brief: slow weights kept in the inner optimizer's `state[p]`."""

    def __init__(self, inner, k=2, alpha=0.5):
        self.inner, self.k, self.alpha, self.n = inner, k, alpha, 0

    def step(self):
        self.inner.step()
        self.n += 1
        for group in self.inner.param_groups:
            for p in group["params"]:
                slow = self.inner.state[p].setdefault("lookahead_slow", p.detach().clone())
                if self.n % self.k == 0:
                    slow.add_(p.detach() - slow, alpha=self.alpha)
                    p.data.copy_(slow)

    def zero_grad(self):
        self.inner.zero_grad()


def test_state_shows_each_params_buffers_and_a_wrappers_entries_round_trip():
    model = make_model()
    opt = Optimizer(model.parameters(), ps.adamw, lr=1e-2)
    first = next(model.parameters())
    assert set(opt.state[first]) == {"step", "exp_avg", "exp_avg_sq"} and opt.state[first]["exp_avg"].shape == first.shape
    la = Lookahead(opt)
    train(model, la, batches(3))
    assert torch.equal(opt.state[first]["exp_avg"], opt.state_dict()["state"][0]["exp_avg"])  # the live tensors
    assert float(opt.state[first]["step"]) == 3.0 and opt.state[first]["step"].dtype == torch.float32  # torch's
    saved = copy.deepcopy(opt.state_dict())
    assert "lookahead_slow" in saved["state"][0]
    twin = make_model()
    twin.load_state_dict(model.state_dict())
    opt2 = Optimizer(twin.parameters(), ps.adamw, lr=1e-2)
    opt2.load_state_dict(saved)
    la2 = Lookahead(opt2)
    la2.n = la.n
    train(model, la, batches(3, seed=5))
    train(twin, la2, batches(3, seed=5))
    assert_same_params(twin, model)  # the slow weights came back with the state


def test_torch_distributed_checkpoint_state_dict_round_trip_takes_no_step():
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

    model = make_model()
    opt = Optimizer(model.parameters(), ps.adamw(1e-2, weight_decay=0.1))
    train(model, opt, batches(2))
    opt.zero_grad()  # grads None: torch's checkpoint API would step an optimizer whose state looks empty
    before = [p.detach().clone() for p in model.parameters()]
    moments = copy.deepcopy(opt.state_dict())
    for _ in range(3):
        sd = get_optimizer_state_dict(model, opt)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))  # no step was taken
    set_optimizer_state_dict(model, opt, sd)
    after = opt.state_dict()
    assert after["param_groups"] == moments["param_groups"]
    for i, entry in moments["state"].items():
        for k, v in entry.items():
            assert torch.equal(torch.as_tensor(after["state"][i][k]), torch.as_tensor(v)), (i, k)


@pytest.mark.parametrize("amsgrad", [False, True])
def test_complex_params_step_as_torch_steps_their_real_views(amsgrad):
    torch.manual_seed(0)
    ours = torch.randn(4, 3, dtype=torch.complex64, requires_grad=True)
    theirs = ours.detach().clone().requires_grad_(True)
    real = torch.randn(3, requires_grad=True)  # a real param in the same group
    real_t = real.detach().clone().requires_grad_(True)
    opt = Optimizer([ours, real], ps.adamw, lr=1e-2, weight_decay=0.1, amsgrad=amsgrad)
    ref = torch.optim.AdamW([theirs, real_t], lr=1e-2, weight_decay=0.1, amsgrad=amsgrad)
    target = torch.randn(4, 3, dtype=torch.complex64)
    for _ in range(6):
        for p, r, o in ((ours, real, opt), (theirs, real_t, ref)):
            o.zero_grad()
            ((p - target).abs().pow(2).sum() + (r * p.real.sum(0)).pow(2).sum()).backward()
            o.step()
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(real, real_t, rtol=1e-5, atol=1e-6)
    assert opt.state[ours]["exp_avg"].is_complex() and opt.state_dict()["state"][0]["exp_avg"].dtype == torch.complex64
    twin = torch.optim.AdamW([theirs.detach().clone(), real_t.detach().clone()], lr=1e-2, amsgrad=amsgrad)
    twin.load_state_dict(opt.state_dict())  # torch takes ours
    opt.load_state_dict(ref.state_dict())  # and we take torch's
    torch.testing.assert_close(opt.state[ours]["exp_avg"], ref.state[theirs]["exp_avg"])


@pytest.mark.parametrize("form", ["factory", "built", "sgd-momentum"])
def test_get_and_set_state_dict_on_a_fresh_optimizer_change_no_training(form):
    # torch's get_state_dict steps an optimizer whose state looks empty (_init_optim_state);
    # a fresh adapter must come out of three calls and a set_state_dict as it went in.
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    def run(checkpoint: bool) -> list[torch.Tensor]:
        model = make_model()
        opt = {
            "factory": lambda: Optimizer(model.parameters(), ps.adamw, lr=1e-2, weight_decay=0.1),
            "built": lambda: Optimizer(model.parameters(), ps.adamw(1e-2, weight_decay=0.1)),
            "sgd-momentum": lambda: Optimizer(model.parameters(), ps.sgd, lr=1e-2, momentum=0.9, weight_decay=0.1),
        }[form]()
        if checkpoint:
            for _ in range(3):
                model_sd, optim_sd = get_state_dict(model, opt)
            set_state_dict(model, opt, model_state_dict=model_sd, optim_state_dict=optim_sd)
        train(model, opt, batches(3))
        return [p.detach().clone() for p in model.parameters()]

    assert all(torch.equal(a, b) for a, b in zip(run(True), run(False)))


def test_step_called_inside_a_compiled_training_step_runs_as_torchs():
    # torch's compiled-step recipe: the whole training step under torch.compile. The adapter's
    # step is a graph break (compiler.disable); dynamo crashed tracing its bookkeeping before.
    model, twin = make_model(), make_model()
    opt = Optimizer(model.parameters(), ps.adamw, lr=1e-2, weight_decay=0.1)
    ref = torch.optim.AdamW(twin.parameters(), lr=1e-2, weight_decay=0.1)

    @torch.compile
    def train_step(m, o, x, y):
        o.zero_grad()
        ((m(x) - y) ** 2).mean().backward()
        o.step()

    for x, y in batches(3):
        train_step(model, opt, x, y)
        train(twin, ref, [(x, y)])
    assert_same_params(model, twin)
