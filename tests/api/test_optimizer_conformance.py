"""The adapter conformance sweep (issue 39): every optimizer of the registry, built through
`Optimizer` the ways torch's users write constructors, survives every state-dict round trip
torch's users make, at every point of a run.

Constructors: every argument spelled out at its default as torch spells defaults (`momentum=0`,
`weight_decay=0`: ints) with named params in one group; floats with a 0-d tensor lr and unnamed
params in two groups (the second with its own lr). Round trips: `state_dict()` twice (the same),
`torch.save` + `torch.load(weights_only=True)` into a fresh adapter, `copy.deepcopy`, a named
state dict into an unnamed adapter — before any step, and after steps in which one param
missed its grad (its cohort split off). After each, the copies continue as the original, bit
for bit. Where torch has the optimizer, the state dict goes into torch's class and torch's
comes back, and both continue as one.
"""

from __future__ import annotations

import copy
import inspect
import io

import pytest
import torch

import purestep.core as ps
from purestep.api import Optimizer
from tests.registry import TRANSFORMS


def _optimizers() -> list[str]:
    """The registry's optimizers: public factories taking `lr` and nothing else required."""
    out = []
    for name in TRANSFORMS:
        factory = getattr(ps, name, None)
        if factory is None or name.startswith("scale_by_"):
            continue
        params = inspect.signature(factory).parameters
        required = [n for n, p in params.items() if p.default is inspect.Parameter.empty]
        if "lr" in params and set(required) <= {"lr"}:
            out.append(name)
    return out


OPTIMIZERS = _optimizers()
TORCH = {"sgd": torch.optim.SGD, "adam": torch.optim.Adam, "adamw": torch.optim.AdamW}
if hasattr(torch.optim, "Muon"):
    TORCH["muon"] = torch.optim.Muon


def test_the_sweep_covers_every_optimizer_of_the_registry():
    expected = {"sgd", "adam", "adamw", "lion", "lamb", "lars", "muon", "muon_adamw", "normuon", "soap", "kron",
                "schedule_free_adamw", "sophia", "ademamix", "mup_adamw", "mup_sgd", "adopt", "prodigy", "mars",
                "laprop", "adamc", "normuon_adamw"}
    assert expected <= set(OPTIMIZERS), expected - set(OPTIMIZERS)


def _as_torch_spells(value):
    """A default as torch's signatures spell it: integral floats as ints."""
    if isinstance(value, tuple):
        return tuple(_as_torch_spells(v) for v in value)
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


def _kwargs(name: str, spelling: str) -> dict:
    factory = getattr(ps, name)
    out = {}
    for key, p in inspect.signature(factory).parameters.items():
        if p.kind is p.KEYWORD_ONLY or p.default is inspect.Parameter.empty or callable(p.default):
            continue
        out[key] = _as_torch_spells(p.default) if spelling == "ints" else p.default
    lr = out.get("lr") if isinstance(out.get("lr"), (int, float)) else 0.01
    out["lr"] = torch.tensor(float(lr)) if spelling == "floats" else lr
    if name.startswith("mup_"):
        out["base_shapes"] = lambda params: {k: tuple(max(1, d // 2) for d in v.shape) for k, v in params.items()}
    return out


def _model(name: str) -> torch.nn.Module:
    torch.manual_seed(0)
    bias = not TRANSFORMS[name].matrices_only
    return torch.nn.Sequential(torch.nn.Linear(4, 5, bias=bias), torch.nn.Tanh(), torch.nn.Linear(5, 3, bias=bias))


def _builder(name: str, spelling: str, named: bool | None = None):
    kwargs = _kwargs(name, spelling)
    named = spelling == "ints" if named is None else named

    def build(model: torch.nn.Module) -> Optimizer:
        if spelling == "ints":
            params = model.named_parameters() if named else model.parameters()
            return Optimizer(params, getattr(ps, name), **kwargs)
        first, rest = list(model.parameters())[:1], list(model.parameters())[1:]
        groups = [{"params": first}, {"params": rest, "lr": torch.tensor(0.005)}]
        if named:
            names = [n for n, _ in model.named_parameters()]
            groups[0]["param_names"], groups[1]["param_names"] = names[:1], names[1:]
        return Optimizer(groups, getattr(ps, name), **kwargs)

    return build


def _steps(model: torch.nn.Module, opt, start: int, n: int, skip: int | None = None) -> None:
    for i in range(start, start + n):
        opt.zero_grad()
        x = torch.randn(8, 4, generator=torch.Generator().manual_seed(i))
        model(x).pow(2).mean().backward()
        if skip is not None and i == start + 1:
            list(model.parameters())[skip].grad = None  # it misses this step: its cohort splits off
        opt.step()


def _assert_same(a, b, where: str) -> None:
    if isinstance(a, dict):
        assert isinstance(b, dict) and set(a) == set(b), f"{where}: keys {sorted(map(str, a))} vs {sorted(map(str, b))}"
        for k in a:
            _assert_same(a[k], b[k], f"{where}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        assert isinstance(b, (list, tuple)) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _assert_same(x, y, f"{where}[{i}]")
    elif isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), where
    elif callable(a):
        assert callable(b), where
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


def _saved(state_dict: dict) -> dict:
    buffer = io.BytesIO()
    torch.save(state_dict, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def _copies(name: str, spelling: str, model: torch.nn.Module, opt: Optimizer) -> list[tuple]:
    """(model, optimizer) pairs that should continue exactly as `opt`: a fresh adapter loaded from
    the saved state dict, a deepcopy, and an adapter built the other way on names."""
    state_dict = opt.state_dict()
    _assert_same(state_dict, opt.state_dict(), "state_dict() twice")  # deterministic, nothing moved
    out = []
    for named in (None, spelling != "ints"):
        twin = copy.deepcopy(model)
        fresh = _builder(name, spelling, named=named)(twin)
        fresh.load_state_dict(_saved(state_dict))
        if named is None:
            _assert_same(fresh.state_dict(), state_dict, "loaded state_dict")
        out.append((twin, fresh))
    twin_model, twin_opt = copy.deepcopy((model, opt))
    _assert_same(twin_opt.state_dict(), state_dict, "deepcopy's state_dict")
    out.append((twin_model, twin_opt))
    return out


def _continue_as_one(name: str, model, opt, copies, start: int) -> None:
    _steps(model, opt, start, 2)
    for i, (twin, twin_opt) in enumerate(copies):
        _steps(twin, twin_opt, start, 2)
        for (n, a), b in zip(model.named_parameters(), twin.parameters()):
            assert torch.equal(a, b), f"{name}: copy {i} param {n} differs by {(a - b).abs().max():.3g}"


@pytest.mark.parametrize("spelling", ["ints", "floats"])
@pytest.mark.parametrize("name", OPTIMIZERS)
def test_state_dict_round_trips_before_and_after_steps_continue_bit_for_bit(name, spelling):
    build = _builder(name, spelling)
    model = _model(name)
    opt = build(model)
    before = _copies(name, spelling, model, opt)  # before any step
    _continue_as_one(name, model, opt, before, 0)
    _steps(model, opt, 2, 3, skip=0)  # param 0 misses a step
    after = _copies(name, spelling, model, opt)
    _continue_as_one(name, model, opt, after, 5)


def test_int_spelled_defaults_build_the_transform_the_floats_build():
    # torch's `SGD(momentum=0)`: a momentum buffer and a count, as with 0.0, so a scheduler can set it later.
    w = torch.nn.Parameter(torch.ones(3))
    ints = Optimizer([w], ps.sgd, lr=1, momentum=0, dampening=0, weight_decay=0)
    floats = Optimizer([w], ps.sgd, lr=1.0, momentum=0.0, dampening=0.0, weight_decay=0.0)
    assert ps.tree_leaves(ints.opt_states) and len(ps.tree_leaves(ints.opt_states)) == len(
        ps.tree_leaves(floats.opt_states)
    )
    ints.param_groups[0]["momentum"] = 0.9  # as OneCycleLR's cycle_momentum does: taken at the next step
    w.grad = torch.ones(3)
    ints.step()
    ints.step()
    assert torch.allclose(ints.state[w]["momentum_buffer"], torch.full((3,), 1.9))


def test_torchs_own_constructor_arguments_are_taken_at_the_value_the_factory_runs():
    w = torch.nn.Parameter(torch.ones(2))
    opt = Optimizer([w], ps.adam, lr=0.1, decoupled_weight_decay=False)
    assert opt.param_groups[0]["decoupled_weight_decay"] is False
    with pytest.raises(ValueError, match="decoupled_weight_decay=True.*ps.adamw"):
        Optimizer([w], ps.adam, lr=0.1, decoupled_weight_decay=True)


@pytest.mark.parametrize("name", sorted(TORCH))
def test_state_dicts_go_into_torchs_class_and_back_after_a_split_cohort(name):
    cls = TORCH[name]
    kwargs = {k: v for k, v in _kwargs(name, "ints").items() if k in inspect.signature(cls).parameters}
    kwargs["lr"] = 0.01
    if name == "sgd":
        kwargs["momentum"] = 0.9  # buffers to carry (momentum=0 is covered by the sweep above)
    ours_model = _model(name)
    ours = Optimizer(ours_model.parameters(), getattr(ps, name), **kwargs)
    theirs_model = copy.deepcopy(ours_model)
    theirs = cls(theirs_model.parameters(), **kwargs)
    _steps(ours_model, ours, 0, 3, skip=0)
    _steps(theirs_model, theirs, 0, 3, skip=0)
    # Ours into torch's, torch's into ours; each then continues as the other would have.
    to_torch_model, to_ours_model = copy.deepcopy(ours_model), copy.deepcopy(theirs_model)
    to_torch = cls(to_torch_model.parameters(), **kwargs)
    to_torch.load_state_dict(_saved(ours.state_dict()))
    to_ours = Optimizer(to_ours_model.parameters(), getattr(ps, name), **kwargs)
    to_ours.load_state_dict(_saved(theirs.state_dict()))
    assert set(to_ours.state_dict()["state"]) == set(theirs.state_dict()["state"])
    for model, opt in [(ours_model, ours), (theirs_model, theirs), (to_torch_model, to_torch), (to_ours_model, to_ours)]:
        _steps(model, opt, 3, 3)
    for a, b, c, d in zip(*(m.parameters() for m in (ours_model, theirs_model, to_torch_model, to_ours_model))):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(c, a, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(d, b, rtol=1e-5, atol=1e-6)


def test_a_soap_state_dict_saved_by_0_4_with_shared_factors_still_loads():
    # 0.4 kept SOAP's per-dimension factors under "shared_state" by their whole path; now they are
    # each param's own buffers ("gg.0"): an old state dict loads, and continues as the new one.
    build = _builder("soap", "floats", named=True)
    model = _model("soap")
    opt = build(model)
    _steps(model, opt, 0, 3)
    new = opt.state_dict()
    old = copy.deepcopy(new)
    for group in old["param_groups"]:
        for i, name in zip(group["params"], group["param_names"]):
            for key in [k for k in old["state"][i] if "." in k]:  # "gg.0" -> shared "inner_state.gg.<name>.0"
                field, position = key.split(".")
                group["shared_state"][f"inner_state.{field}.{name}.{position}"] = old["state"][i].pop(key)
    twin = copy.deepcopy(model)
    loaded = build(twin)
    loaded.load_state_dict(_saved(old))
    _assert_same(loaded.state_dict(), new, "0.4 state dict loaded")
