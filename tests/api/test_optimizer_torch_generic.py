"""What torch's generic optimizer tests (test/test_optim.py) check of an optimizer class, run
on the adapter over torch's own configurations (issue 23).

`tests/api/test_optimizer_optim_db.py` follows a whole trajectory against torch per
configuration; this file adds the protocol checks torch runs on every class: loss goes the
right way (contiguous or not, with a scheduler), near-zero group lr leaves a group alone,
tensor lr equals float lr, zero or absent grads change nothing, grads are never written into,
step hooks (global and per instance) run in torch's order, printing, state dicts that survive
`torch.save` + `torch.load(weights_only=True)`, older state dicts (no implementation flags,
a Python-number step), deepcopy keeps every public attribute, state is never empty after a
step, and complex params equal their real view on a 2-D problem; beside them, what torch's
state-dict hook tests and common code do to `optimizer.state` (flags under non-param keys,
assigned buffers and steps, resets), side by side with torch's classes. The eager path runs
each configuration of optim_db but the `fused` ones; `_COMPILED` runs one configuration per
class with `compile=True` (what `fused=True` does).
"""

from __future__ import annotations

import copy
import inspect
import io

import pytest
import torch
import torch.optim.optimizer as torch_optimizer
from torch.nn import Parameter
from torch.testing._internal.common_optimizers import _get_optim_inputs_including_global_cliquey_kwargs, optim_db

import purestep.core as ps
from purestep.api import Optimizer

FACTORIES = {"SGD": ps.sgd, "Adam": ps.adam, "AdamW": ps.adamw}
INFOS = {info.optim_cls.__name__: info for info in optim_db if info.optim_cls.__name__ in FACTORIES}


def _configs(name: str, *, differentiable: bool = False) -> list[dict]:
    """optim_db's configurations of `name` (its flags included), without the compiling `fused`,
    and every argument of torch's constructor spelled out at its default, as torch writes them
    (`momentum=0, weight_decay=0`: ints, and `foreach=None`)."""
    skip = () if differentiable else ("differentiable",)
    inputs = _get_optim_inputs_including_global_cliquey_kwargs("cpu", torch.float32, INFOS[name], skip=skip)
    spelled = {
        k: p.default
        for k, p in inspect.signature(INFOS[name].optim_cls).parameters.items()
        if k not in ("params", "fused") and p.default is not inspect.Parameter.empty
    }
    return [dict(i.kwargs) for i in inputs if not i.kwargs.get("fused")] + [spelled]


def _make(name: str, compile: bool | None = None):
    def build(params, **kwargs):
        return Optimizer(params, FACTORIES[name], compile=compile, **kwargs)
    return build


def _cases(differentiable: bool = False) -> list:
    return [pytest.param(n, kw, id=f"{n}-{i}") for n in FACTORIES for i, kw in enumerate(_configs(n, differentiable=differentiable))]


_COMPILED = [pytest.param("SGD", {"momentum": 0.9, "nesterov": True}, id="SGD-nesterov"),
             pytest.param("Adam", {"amsgrad": True, "weight_decay": 0.1}, id="Adam-amsgrad"),
             pytest.param("AdamW", {"maximize": True, "weight_decay": 0.1}, id="AdamW-maximize")]


def _quadratic(weight, bias, x):
    return (weight.mv(x) + bias).pow(2).sum()


@pytest.mark.parametrize("contiguous", [True, False])
@pytest.mark.parametrize("name, kwargs", _cases())
def test_loss_goes_the_right_way_with_and_without_a_scheduler(name, kwargs, contiguous):
    for scheduled in (False, True):
        torch.manual_seed(0)
        if contiguous:
            weight, bias = Parameter(torch.randn(10, 5)), Parameter(torch.randn(10))
        else:
            weight, bias = Parameter(torch.randn(10, 5, 2)[..., 0]), Parameter(torch.randn(10, 2)[..., 0])
        x = torch.randn(5)
        opt = _make(name)([weight, bias], **kwargs)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=5, gamma=0.9) if scheduled else None

        def closure():
            opt.zero_grad()
            loss = _quadratic(weight, bias, x)
            loss.backward()
            return loss

        start = closure().item()
        for _ in range(20):
            opt.step(closure)
            if sched is not None:
                sched.step()
        end = closure().item()
        assert (end > start) if kwargs.get("maximize") else (end < start), (start, end)


@pytest.mark.parametrize("name, kwargs", _cases())
def test_a_group_with_near_zero_lr_stays_put_and_the_other_learns(name, kwargs):
    torch.manual_seed(0)
    group = dict(kwargs)
    group["lr"] = group.get("lr", 1e-3) or 1e-3
    weight, bias, other = Parameter(torch.randn(10, 5)), Parameter(torch.randn(10)), Parameter(torch.randn(2))
    before = other.detach().clone()
    x = torch.randn(5)
    opt = _make(name)([dict(params=[weight, bias], **group), dict(params=[other])], lr=1e-28)
    start = _quadratic(weight, bias, x).item()
    for _ in range(20):
        opt.zero_grad()
        _quadratic(weight, bias, x).backward()
        other.grad = torch.rand_like(other)
        opt.step()
    end = _quadratic(weight, bias, x).item()
    assert (end > start) if kwargs.get("maximize") else (end < start)
    torch.testing.assert_close(other.detach(), before)


@pytest.mark.parametrize("name, kwargs", _cases())
def test_tensor_lr_steps_as_the_float_lr(name, kwargs):
    torch.manual_seed(0)
    lr = kwargs.get("lr", 1e-3)
    w, b, x = torch.randn(10, 5), torch.randn(10), torch.randn(5)
    runs = []
    for value in (float(lr), torch.tensor(float(lr))):
        weight, bias = Parameter(w.clone()), Parameter(b.clone())
        opt = _make(name)([weight, bias], **{**kwargs, "lr": value})
        for _ in range(5):
            opt.zero_grad()
            _quadratic(weight, bias, x).backward()
            opt.step()
        runs.append((weight.detach(), bias.detach()))
    torch.testing.assert_close(runs[0], runs[1])


@pytest.mark.parametrize("name, kwargs", _cases(differentiable=True))
def test_zero_or_absent_grads_change_nothing_and_grads_are_never_written_into(name, kwargs):
    # Params without grads: no step at all.
    frozen = [torch.randn(2, 3) for _ in range(2)]
    before = [p.clone() for p in frozen]
    _make(name)(frozen, **kwargs).step(lambda: torch.tensor([1.0]))
    torch.testing.assert_close(frozen, before)

    # Zero grads move nothing unless decay does (torch's test makes AdamW's lr small).
    if kwargs.get("weight_decay", 0) == 0:
        base = torch.randn(5, 1, requires_grad=True)
        param = base.clone() if kwargs.get("differentiable") else base
        zero = dict(kwargs, lr=1e-4) if name == "AdamW" else kwargs
        opt = _make(name)([param], **zero)
        param.grad = torch.zeros_like(param)
        start = param.detach().clone()
        opt.step()
        torch.testing.assert_close(param.detach(), start)

    # The grads a step reads are left as they were.
    params = [torch.randn(2, 3, requires_grad=True) for _ in range(2)]
    if kwargs.get("differentiable"):
        params = [p.clone() for p in params]
    for p in params:
        p.grad = torch.randn_like(p)
    grads = [p.grad.clone() for p in params]
    opt = _make(name)(params, **kwargs)
    for _ in range(3):
        opt.step()
        for p, g in zip(params, grads):
            assert torch.equal(p.grad, g)


def _protocol(name: str, kwargs: dict, compile: bool | None) -> None:
    build = _make(name, compile)
    torch.manual_seed(0)
    weight, bias, x = Parameter(torch.randn(2, 3)), Parameter(torch.randn(2)), torch.randn(3)
    opt = build([weight, bias], **kwargs)
    assert repr(opt).startswith(type(opt).__name__)

    # Step hooks: the global ones around the instance's, in torch's order; removable.
    calls: list[str] = []
    handles = [torch_optimizer.register_optimizer_step_pre_hook(lambda o, a, k: calls.append("global pre")),
               opt.register_step_pre_hook(lambda o, a, k: calls.append("pre")),
               opt.register_step_post_hook(lambda o, a, k: calls.append("post")),
               torch_optimizer.register_optimizer_step_post_hook(lambda o, a, k: calls.append("global post"))]

    def closure():
        opt.zero_grad()
        loss = _quadratic(weight, bias, x)
        loss.backward()
        return loss

    try:
        for _ in range(3):
            opt.step(closure)
    finally:
        for h in handles:
            h.remove()
    opt.step(closure)
    assert calls == ["global pre", "pre", "post", "global post"] * 3, calls
    if name != "SGD" or kwargs.get("momentum"):  # torch's SGD without momentum keeps no state either
        assert len(opt.state) == 2 and all(len(s) > 0 for s in opt.state.values())

    # deepcopy keeps every public attribute.
    public = lambda o: {k for k in vars(o) if not k.startswith("_")}  # noqa: E731
    assert public(copy.deepcopy(opt)) == public(opt)

    # torch.save + torch.load(weights_only=True) keep the state dict, which loads back.
    saved = opt.state_dict()
    buffer = io.BytesIO()
    torch.save(saved, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=True)
    torch.testing.assert_close(loaded, saved)

    # A fresh optimizer on equal (not identical) params, loaded, continues identically.
    with torch.no_grad():
        weight_c, bias_c = Parameter(weight.clone()), Parameter(bias.clone())
    twin = build([weight_c, bias_c], **kwargs)
    twin.load_state_dict(loaded)
    for _ in range(4):
        opt.step(closure)
        twin.zero_grad()
        _quadratic(weight_c, bias_c, x).backward()
        twin.step()
        torch.testing.assert_close((weight, bias), (weight_c, bias_c), rtol=0, atol=0)
    torch.testing.assert_close(opt.state_dict(), twin.state_dict())
    twin.param_groups.extend(twin.param_groups)  # a repeated group shows as the original does
    assert twin.state_dict()["param_groups"][-1] == opt.state_dict()["param_groups"][-1]

    # An older state dict: no implementation flags, and the per-param step a Python number.
    older = copy.deepcopy(opt.state_dict())
    for group in older["param_groups"]:
        for flag in ("maximize", "foreach", "fused", "differentiable", "capturable"):
            group.pop(flag, None)
    for state in older["state"].values():
        if torch.is_tensor(state.get("step")):
            state["step"] = state["step"].item()
    opt.load_state_dict(older)
    before = weight.detach().clone()
    opt.step(closure)
    assert not torch.equal(weight.detach(), before)


@pytest.mark.parametrize("name, kwargs", _cases())
def test_hooks_printing_state_dicts_and_copies_behave_as_torchs(name, kwargs):
    _protocol(name, kwargs, compile=None)


@pytest.mark.parametrize("name, kwargs", _COMPILED)
def test_compiled_hooks_printing_state_dicts_and_copies_behave_as_torchs(name, kwargs):
    _protocol(name, kwargs, compile=True)


@pytest.mark.parametrize("name, kwargs", [c for c in _cases() if c.values[0] != "SGD"])
def test_a_complex_param_steps_as_its_real_and_imaginary_parts(name, kwargs):
    # torch's complex 2-D check: a complex pair against its real and imaginary parts as two
    # real params, on |rosenbrock| (SGD at its default lr diverges there, in torch too).
    def rosenbrock(t):
        x, y = t
        return ((1 - x) ** 2 + 100 * (y - x**2) ** 2).abs()

    torch.manual_seed(0)
    z = torch.randn(2, dtype=torch.complex64, requires_grad=True)
    re, im = z.real.detach().clone().requires_grad_(), z.imag.detach().clone().requires_grad_()
    complex_opt, real_opt = _make(name)([z], **kwargs), _make(name)([re, im], **kwargs)
    for _ in range(10):
        complex_opt.zero_grad()
        real_opt.zero_grad()
        rosenbrock(z).backward()
        rosenbrock(torch.complex(re, im)).backward()
        complex_opt.step()
        real_opt.step()
        torch.testing.assert_close((z.real, z.imag), (re, im))


class _AdamW(Optimizer):
    """A subclass with torch's constructor, as a user names the adapter in place of torch's."""

    def __init__(self, params, lr: float = 1e-3, weight_decay: float = 1e-2) -> None:
        super().__init__(params, ps.adamw, lr=lr, weight_decay=weight_decay)


def test_a_subclass_taking_other_arguments_deepcopies_and_pickles():
    import pickle

    torch.manual_seed(0)
    weight, bias, x = Parameter(torch.randn(2, 3)), Parameter(torch.randn(2)), torch.randn(3)
    opt = _AdamW([weight, bias], lr=1e-2)
    opt.zero_grad()
    _quadratic(weight, bias, x).backward()
    opt.step()
    for copied in (copy.deepcopy(opt), pickle.loads(pickle.dumps(opt))):
        assert type(copied) is _AdamW
        torch.testing.assert_close(copied.state_dict(), opt.state_dict())
        params = copied.param_groups[0]["params"]
        copied.zero_grad()
        _quadratic(params[0], params[1], x).backward()
        copied.step()  # a working copy
        assert copied.state_dict()["state"][0]["step"] == 2


@pytest.mark.parametrize("name", list(FACTORIES))
def test_state_dict_hooks_see_and_keep_entries_keyed_by_other_than_a_param(name):
    # torch's state-dict hook tests: a pre hook writes `state["test"]`, which state_dict()
    # carries under its own key for the post hook; load pre hooks edit or replace the dict;
    # a load post hook writes flags into `state`, kept by the next state_dict() and by a load.
    def scenario(build):
        params = [Parameter(torch.randn(2, 3, generator=torch.Generator().manual_seed(i))) for i in range(2)]
        for p in params:
            p.grad = torch.ones_like(p)
        opt = build(params, lr=1e-2, **({"momentum": 0.9} if name == "SGD" else {}))
        opt.step()
        opt.register_state_dict_pre_hook(lambda o: o.state.__setitem__("test", 1))

        def post(o, sd):
            sd["ran_pre_hook"] = sd["state"].pop("test", None) == 1
            return sd

        opt.register_state_dict_post_hook(post)
        saved = opt.state_dict()
        twin = build(params, lr=1e-2, **({"momentum": 0.9} if name == "SGD" else {}))
        twin.state["left_over"] = 0  # replaced by the load, as torch's state is
        twin.register_load_state_dict_pre_hook(lambda o, sd: sd["param_groups"][0].__setitem__("lr", 0.002))

        def replace(o, sd):
            new = copy.deepcopy(sd)
            new["param_groups"][0]["lr"] = 0.003
            new["state"]["saved_flag"] = True
            return new

        twin.register_load_state_dict_pre_hook(replace)
        twin.register_load_state_dict_post_hook(lambda o: o.state.__setitem__("ran_post", o.param_groups[0]["lr"]))
        twin.load_state_dict({k: v for k, v in saved.items() if k != "ran_pre_hook"})
        twin.step()
        again = twin.state_dict()
        flags = {k: v for k, v in again["state"].items() if isinstance(k, str)}
        return saved["ran_pre_hook"], twin.param_groups[0]["lr"], flags

    ours = scenario(_make(name))
    theirs = scenario(INFOS[name].optim_cls)
    assert ours == theirs == (True, 0.003, {"saved_flag": True, "ran_post": 0.003}), (ours, theirs)


_EDITS = {
    "assign a buffer": lambda opt, ps_: [opt.state[p].__setitem__("exp_avg", torch.zeros_like(p)) for p in ps_],
    "assign a computed buffer": lambda opt, ps_: [opt.state[p].__setitem__("exp_avg_sq", opt.state[p]["exp_avg_sq"] * 3)
                                                  for p in ps_],
    "edit a buffer in place": lambda opt, ps_: [opt.state[p]["exp_avg"].mul_(0.5) for p in ps_],
    "assign step": lambda opt, ps_: [opt.state[p].__setitem__("step", torch.tensor(10.0)) for p in ps_],
    "a new entry with every buffer": lambda opt, ps_: [opt.state.__setitem__(p, {
        "step": torch.tensor(1.0), "exp_avg": torch.full_like(p, 0.1), "exp_avg_sq": torch.full_like(p, 0.2)}) for p in ps_],
    "pop every param": lambda opt, ps_: [opt.state.pop(p) for p in ps_],
    "empty every entry": lambda opt, ps_: [opt.state.__setitem__(p, {}) for p in ps_],
    "clear": lambda opt, ps_: opt.state.clear(),
    "a new state dict": lambda opt, ps_: setattr(opt, "state", __import__("collections").defaultdict(dict)),
    "clear, then load": lambda opt, ps_: (lambda sd: (opt.state.clear(), opt.load_state_dict(sd)))(
        copy.deepcopy(opt.state_dict())),
}


@pytest.mark.parametrize("compile", [None, pytest.param(True, id="compiled")])
def test_edits_to_state_take_effect_at_the_next_step_as_in_torch(compile):
    # What code does to torch's `optimizer.state` (reset moments, restart from scratch, set the
    # step) changes the next steps of the adapter as it changes torch.optim.AdamW's.
    def run(build, edit):
        torch.manual_seed(0)
        params = [Parameter(torch.randn(3, 2)), Parameter(torch.randn(4))]
        opt = build(params)
        for k in range(5):
            if k == 3:
                edit(opt, params)
            for p in params:
                p.grad = torch.full_like(p, k - 1.5) + p.detach()
            opt.step()
        return [p.detach() for p in params], [{k: torch.as_tensor(v) for k, v in opt.state[p].items()} for p in params]

    for what, edit in _EDITS.items():
        ours = run(lambda ps_: Optimizer(ps_, ps.adamw, lr=0.1, weight_decay=0.1, compile=compile), edit)
        theirs = run(lambda ps_: torch.optim.AdamW(ps_, lr=0.1, weight_decay=0.1), edit)
        torch.testing.assert_close(ours, theirs, msg=lambda m: f"{what}: {m}")


def test_a_buffer_set_to_the_wrong_shape_is_refused_naming_the_param():
    params = [Parameter(torch.randn(3))]
    opt = Optimizer(params, ps.adamw, lr=0.1)
    params[0].grad = torch.ones(3)
    opt.step()
    opt.state[params[0]]["exp_avg"] = torch.zeros(4)
    with pytest.raises(ValueError, match=r"state\[param '0'\]\['exp_avg'\] was set to shape \(4,\)"):
        opt.step()


@pytest.mark.parametrize("make, dtype", [
    pytest.param(lambda ps_: Optimizer(ps_, ps.chain(ps.clip_by_global_norm(1.0), ps.lion(1e-2, weight_decay=0.1))),
                 torch.float32, id="built-lion"),
    pytest.param(lambda ps_: Optimizer(ps_, ps.soap, lr=1e-2, precondition_frequency=2), torch.float32, id="soap"),
    pytest.param(lambda ps_: Optimizer(ps_, ps.adamw, lr=1e-2), torch.complex64, id="adamw-complex"),
])
def test_a_cleared_state_starts_over_as_a_new_optimizer_on_the_same_params(make, dtype):
    # The generic layout and non-torch transforms too: after state.clear(), the next steps
    # equal those of an optimizer built afresh on the params as they are.
    torch.manual_seed(0)
    params = [Parameter(torch.randn(4, 3, dtype=dtype)), Parameter(torch.randn(3, dtype=dtype))]
    opt = make(params)

    def steps(o, ps_, ks):
        for k in ks:
            for p in ps_:
                p.grad = torch.full_like(p, 1.0 if k < 5 else -0.3) + p.detach() * 0.1  # momentum, then against it
            o.step()

    steps(opt, params, range(5))
    twin_params = [Parameter(p.detach().clone()) for p in params]
    twin = make(twin_params)
    opt.state.clear()
    steps(opt, params, range(5, 9))
    steps(twin, twin_params, range(5, 9))
    torch.testing.assert_close([p.detach() for p in params], [p.detach() for p in twin_params], rtol=0, atol=0)
