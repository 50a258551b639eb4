"""μP's optimizer side against microsoft/mup: `mup.MuAdamW` / `mup.MuSGD` on a model set up
with `mup.set_base_shapes`, over many steps in float64, weight decay included."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import purestep.core as ps
from tests.core.test_alias import RTOL, assert_histories_close, assert_moved

mup = pytest.importorskip("mup")

STEPS = 25


class Net(nn.Module):
    """Every kind of leaf μP tells apart: an input layer (one width dim), hidden matrices
    and a conv (two), biases and norm gains (vectors), a readout (one, `MuReadout`)."""

    def __init__(self, width: int, ff: int | None = None) -> None:
        super().__init__()
        ff = ff or 2 * width
        self.inp = nn.Linear(5, width)
        self.up = nn.Linear(width, ff)
        self.down = nn.Linear(ff, width, bias=False)
        self.conv = nn.Conv2d(width, width, 3, bias=False)
        self.norm = nn.LayerNorm(width)
        self.out = mup.MuReadout(width, 3)


def make_net(width: int, base: object, ff: int | None = None, *, delta: object = None, check: bool = True) -> nn.Module:
    torch.manual_seed(0)
    net = Net(width, ff).double()
    return mup.set_base_shapes(net, base, delta=delta, do_assert=check)


def grads_for(net: nn.Module, steps: int = STEPS, seed: int = 1) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    return [{n: torch.randn(p.shape, generator=g, dtype=p.dtype) for n, p in net.named_parameters()} for _ in range(steps)]


def run_torch(net: nn.Module, opt: torch.optim.Optimizer, grads_list: list[dict]) -> list[dict]:
    named = dict(net.named_parameters())
    history = []
    for grads in grads_list:
        for n, p in named.items():
            p.grad = grads[n].clone()
        opt.step()
        history.append({n: p.detach().clone() for n, p in named.items()})
    return history


def run_ours(opt: ps.Transform, params: dict, grads_list: list[dict]) -> list[dict]:
    state, history = opt.init(params), []
    for grads in grads_list:
        updates, state = opt.update(grads, state, params)
        params = ps.apply_updates(params, updates)
        history.append(params)
    return history


def _params(net: nn.Module) -> dict:
    return {n: p.detach().clone() for n, p in net.named_parameters()}


BASE = {n: p.shape for n, p in Net(4).named_parameters()}


@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
@pytest.mark.parametrize("width", [4, 12])
def test_mup_adamw_matches_mup_muadamw(width, weight_decay):
    net = make_net(width, Net(4))
    params, grads = _params(net), grads_for(net)
    theirs = run_torch(net, mup.MuAdamW(net.parameters(), lr=1e-2, betas=(0.9, 0.99), weight_decay=weight_decay), grads)
    ours = run_ours(ps.mup_adamw(1e-2, betas=(0.9, 0.99), weight_decay=weight_decay, base_shapes=BASE), params, grads)
    assert_histories_close(ours, theirs)
    assert_moved(ours, params)


@pytest.mark.parametrize("kwargs", [dict(), dict(momentum=0.9, weight_decay=0.1),
                                    dict(momentum=0.9, nesterov=True, weight_decay=0.01),
                                    dict(momentum=0.8, dampening=0.3)], ids=["plain", "momentum-decay", "nesterov", "dampening"])
def test_mup_sgd_matches_mup_musgd(kwargs):
    net = make_net(12, Net(4), ff=16)  # width 3x, ff 2x the base: fan-in and fan-out multipliers differ
    params, grads = _params(net), grads_for(net)
    theirs = run_torch(net, mup.MuSGD(net.parameters(), lr=0.05, **kwargs), grads)
    ours = run_ours(ps.mup_sgd(0.05, **kwargs, base_shapes=BASE), params, grads)
    assert_histories_close(ours, theirs)
    assert_moved(ours, params)


def test_base_shapes_forms_mup_reads_give_the_same_multipliers():
    """Names -> shapes, mup's own base-shape objects (from a delta model or a .bsh file), a
    base params tree on the meta device, and a callable: all what `set_base_shapes` reads."""
    net = make_net(12, Net(4))
    want = {n: 1.0 / p.infshape.width_mult() if p.infshape.ninf() == 2 else 1.0 for n, p in net.named_parameters()}
    params = _params(net)
    with torch.device("meta"):
        base_tree = dict(Net(4).named_parameters())
    for form in (BASE, mup.get_shapes(Net(4)), mup.make_base_shapes(Net(4), Net(6)), base_tree, lambda p: BASE):
        assert ps.mup_lr_multipliers(params, form) == pytest.approx(want)
    assert any(v != 1.0 for v in want.values()) and any(v == 1.0 for v in want.values())


def test_width_dims_from_a_delta_model_stay_width_dims_at_the_base_size():
    """A target whose hidden size equals the base's but whose ff size differs: with a delta
    model mup counts `down` (ff -> width) as a hidden matrix (two width dims), from shapes
    alone only ff differs (one width dim, which mup's own check refuses: a Linear of width
    fan-in and finite fan-out); both agree with MuAdamW set up the same way."""
    for delta in (None, Net(6)):
        net = make_net(4, Net(4), ff=32, delta=delta, check=delta is not None)  # width = base, ff 4x base
        base = BASE if delta is None else mup.make_base_shapes(Net(4), delta)
        params, grads = _params(net), grads_for(net, steps=8)
        theirs = run_torch(net, mup.MuAdamW(net.parameters(), lr=1e-2), grads)
        ours = run_ours(ps.mup_adamw(1e-2, base_shapes=base), params, grads)
        assert_histories_close(ours, theirs)
        mults = ps.mup_lr_multipliers(params, base)
        assert mults["down.weight"] == (1.0 if delta is None else 0.25)


def test_mup_lr_multipliers_on_a_nested_tree_use_dotted_names():
    params = {"blocks": [{"w": torch.zeros(8, 8)}], "head": torch.zeros(3, 8)}
    base = {"blocks.0.w": (4, 4), "head": (3, 4)}
    assert ps.mup_lr_multipliers(params, base) == {"blocks": [{"w": 0.5}], "head": 1.0}
    assert ps.mup_lr_multipliers(params, base, optimizer="sgd") == {"blocks": [{"w": 1.0}], "head": 2.0}


def test_mup_adamw_under_partition_sees_a_subset_of_the_base_shapes():
    params = {"h.w": torch.randn(8, 8, dtype=torch.float64), "h.b": torch.randn(8, dtype=torch.float64)}
    base = {"h.w": (4, 4), "h.b": (4,)}
    opt = ps.partition({"mup": ps.mup_adamw(0.1, base_shapes=base), "sgd": ps.sgd(0.1)}, {"h.w": "mup", "h.b": "sgd"})
    updates, _ = opt.update({k: torch.ones_like(v) for k, v in params.items()}, opt.init(params), params)
    torch.testing.assert_close(updates["h.w"], torch.full((8, 8), -0.05, dtype=torch.float64), rtol=RTOL, atol=0)


@pytest.mark.parametrize(
    "params, base, match",
    [
        ({"w": torch.zeros(4, 4)}, {"v": (2, 2)}, "no entry for leaf 'w'"),
        ({"w": torch.zeros(4, 4)}, {"w": (2,)}, r"'w' has 1 dims, but the leaf has shape \(4, 4\)"),
        ({"w": torch.zeros(4, 4, 4)}, {"w": (2, 2, 2)}, "leaf 'w' has 3 width dims"),
        ({"w": torch.zeros(4)}, {"w": (0,)}, "entry 'w' has size 0"),
        ({"w": torch.zeros(4)}, {"w": "4"}, "base_shapes leaf 'w' is str"),
        ({"w": torch.zeros(4)}, {}, "base_shapes is empty"),
    ],
)
def test_bad_base_shapes_raise_naming_the_leaf(params, base, match):
    with pytest.raises(ValueError, match=match):
        ps.mup_lr_multipliers(params, base)


def test_mup_aliases_need_base_shapes_and_a_known_rule():
    with pytest.raises(ValueError, match="base_shapes is required"):
        ps.mup_adamw(1e-3)
    with pytest.raises(ValueError, match="optimizer must be one of"):
        ps.mup_lr_multipliers({"w": torch.zeros(2)}, {"w": (2,)}, optimizer="lion")
    with pytest.raises(ValueError, match="momentum"):
        ps.mup_sgd(0.1, momentum=-1.0, base_shapes={"w": (2,)})
    with pytest.raises(ValueError, match="betas"):
        ps.mup_adamw(0.1, betas=(1.0, 0.9), base_shapes={"w": (2,)})


def test_mup_adamw_with_injected_hyperparams_keeps_base_shapes_static():
    params = {"w": torch.randn(8, 8, dtype=torch.float64)}
    opt = ps.inject_hyperparams(ps.mup_adamw)(lr=0.1, base_shapes=lambda p: {"w": (4, 4)})
    state = opt.init(params)
    assert "base_shapes" not in ps.get_hyperparams(state)
    updates, _ = opt.update({"w": torch.ones(8, 8, dtype=torch.float64)}, state, params)
    torch.testing.assert_close(updates["w"], torch.full((8, 8), -0.05, dtype=torch.float64), rtol=RTOL, atol=0)


def test_compiled_donated_update_of_ademamix_cautious_and_mup_equals_eager_without_recompiles():
    """One compile covers the third release's blocks on flat buffers: AdEMAMix (elementwise),
    cautious AdamW (a per-leaf count: same-shape leaves stacked) and μP AdamW (per-leaf
    multipliers: leaves grouped by multiplier), hyperparameters injected and changed."""
    torch._dynamo.reset()
    g = torch.Generator().manual_seed(0)
    shapes = {"w1": (16, 16), "w2": (16, 16), "v": (32, 16), "b": (16,)}
    params = {f"{k}.{n}": torch.randn(s, generator=g) for k in ("a", "c", "m") for n, s in shapes.items()}
    base = {name: tuple(d // 2 for d in p.shape) for name, p in params.items()}
    lr = lambda t: 1e-2 * torch.clamp((t + 1) / 3, max=1.0)  # noqa: E731
    opt = ps.partition(
        {
            "a": ps.inject_hyperparams(ps.ademamix)(lr=lr, b3=0.99, alpha=2.0, weight_decay=0.1),
            "c": ps.inject_hyperparams(ps.cautious_adamw)(lr=lr, weight_decay=0.1),
            "m": ps.inject_hyperparams(ps.mup_adamw)(lr=lr, weight_decay=0.1, base_shapes=base),
        },
        lambda p: {k: k[0] for k in p},
    )
    compiled, eager = ps.make_update(opt, compile=True, donate=True), ps.make_update(opt)
    p, s = {k: v.clone() for k, v in params.items()}, opt.init(params)
    p_ref, s_ref = {k: v.clone() for k, v in params.items()}, opt.init(params)
    for i in range(4):
        grads = {k: torch.randn(v.shape, generator=g) for k, v in params.items()}
        if i == 2:  # a changed hyperparameter is a new tensor value, not a new graph
            s, s_ref = ps.set_hyperparam(s, "alpha", 5.0), ps.set_hyperparam(s_ref, "alpha", 5.0)
        with torch.compiler.set_stance("fail_on_recompile" if i else "default"):
            compiled(p, grads, s)
        p_ref, s_ref = eager(p_ref, grads, s_ref)
    layout = compiled.layout()
    assert layout is not None and len(layout) < len(params), layout  # flat buffers, leaves packed together
    for k in params:
        torch.testing.assert_close(p[k], p_ref[k], rtol=1e-5, atol=1e-6, msg=k)
        assert not torch.equal(p[k], params[k]), k
