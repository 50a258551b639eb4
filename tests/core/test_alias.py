"""Optimizer aliases against their references over many steps, in float64."""

from __future__ import annotations

import jax
import numpy as np
import optax
import pytest
import torch
from lion_pytorch import Lion

import purestep.core as ps

jax.config.update("jax_enable_x64", True)

STEPS = 25
RTOL = 1e-7


def make_params(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shapes = {"bias": (7,), "layers.0.weight": (5, 3), "conv.weight": (4, 3, 2, 2)}
    return {k: torch.randn(*s, generator=g, dtype=torch.float64) for k, s in shapes.items()}


def grad_stream(params, steps: int = STEPS, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return [{k: torch.randn(v.shape, generator=g, dtype=v.dtype) for k, v in params.items()} for _ in range(steps)]


def run_purestep(opt: ps.Transform, params, grads_list, state=None):
    """Params after each step, and the final state (from `state`, else a fresh one)."""
    state = opt.init(params) if state is None else state
    history = []
    for grads in grads_list:
        updates, state = opt.update(grads, state, params)
        params = ps.apply_updates(params, updates)
        history.append(params)
    return history, state


def run_torch(make_opt, params, grads_list, lrs=None):
    tensors = {k: torch.nn.Parameter(v.clone()) for k, v in params.items()}
    opt = make_opt(tensors)
    history = []
    for i, grads in enumerate(grads_list):
        if lrs is not None:
            for group in opt.param_groups:
                group["lr"] = lrs[i]
        for k, p in tensors.items():
            p.grad = grads[k].clone()
        opt.step()
        history.append({k: p.detach().clone() for k, p in tensors.items()})
    return history, opt


def assert_histories_close(ours, theirs, rtol=RTOL):
    assert len(ours) == len(theirs)
    for step, (a, b) in enumerate(zip(ours, theirs)):
        for k in b:
            torch.testing.assert_close(a[k], b[k], rtol=rtol, atol=1e-12, msg=lambda m: f"step {step}, {k}: {m}")


def assert_moved(history, params):
    """Guard against vacuous parity: the params must actually change."""
    for k in params:
        assert not torch.equal(history[-1][k], params[k]), k


SGD_CASES = [
    dict(lr=0.05),
    dict(lr=0.05, momentum=0.9),
    dict(lr=0.05, momentum=0.9, dampening=0.3),
    dict(lr=0.05, momentum=0.9, nesterov=True),
    dict(lr=0.05, momentum=0.5, weight_decay=0.1),
    dict(lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.01),
]


@pytest.mark.parametrize("kwargs", SGD_CASES, ids=lambda k: ",".join(f"{a}={b}" for a, b in k.items()))
def test_sgd_matches_torch_sgd(kwargs):
    params = make_params()
    grads = grad_stream(params)
    ours, state = run_purestep(ps.sgd(**kwargs), params, grads)
    theirs, opt = run_torch(lambda t: torch.optim.SGD(t.values(), **kwargs), params, grads)
    assert_histories_close(ours, theirs)
    assert_moved(ours, params)
    if kwargs.get("momentum"):
        for i, k in enumerate(params):
            buf = opt.state[list(opt.param_groups[0]["params"])[i]]["momentum_buffer"]
            torch.testing.assert_close(ps.tree_get(state, "trace")[k], buf, rtol=RTOL, atol=1e-12)


@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_injected_sgd_matches_torch_sgd_with_dampening(momentum):
    # An injected momentum is a tensor, so the buffer always exists; at momentum 0 the
    # update must still be the plain grad, as torch's (dampening applies to a buffer only).
    kwargs = dict(lr=0.05, momentum=momentum, dampening=0.5)
    params = make_params()
    grads = grad_stream(params)
    ours, _ = run_purestep(ps.inject_hyperparams(ps.sgd)(**kwargs), params, grads)
    theirs, _ = run_torch(lambda t: torch.optim.SGD(t.values(), **kwargs), params, grads)
    assert_histories_close(ours, theirs)
    assert_moved(ours, params)


ADAM_CASES = [
    dict(lr=1e-2),
    dict(lr=1e-2, weight_decay=0.1),
    dict(lr=3e-3, betas=(0.8, 0.95), eps=1e-6),
    dict(lr=1e-2, betas=(0.0, 0.5), eps=1e-3, weight_decay=0.5),
]


@pytest.mark.parametrize("kwargs", ADAM_CASES, ids=str)
@pytest.mark.parametrize("name", ["adam", "adamw"])
def test_adam_family_matches_torch(name, kwargs):
    params = make_params()
    grads = grad_stream(params)
    ours, state = run_purestep(getattr(ps, name)(**kwargs), params, grads)
    cls = {"adam": torch.optim.Adam, "adamw": torch.optim.AdamW}[name]
    theirs, opt = run_torch(lambda t: cls(t.values(), foreach=False, **kwargs), params, grads)
    assert_histories_close(ours, theirs)
    assert_moved(ours, params)
    torch_params = opt.param_groups[0]["params"]
    for i, k in enumerate(params):
        torch.testing.assert_close(ps.tree_get(state, "mu")[k], opt.state[torch_params[i]]["exp_avg"], rtol=RTOL, atol=1e-14)
        torch.testing.assert_close(ps.tree_get(state, "nu")[k], opt.state[torch_params[i]]["exp_avg_sq"], rtol=RTOL, atol=1e-14)
    assert int(ps.tree_get(state, "count")) == STEPS


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_adam_eager_cpu_path_equals_the_traced_path_to_rounding(dtype):
    # Eager on CPU, scale_by_adam runs leaf by leaf with the bias corrections folded into
    # the denominator (`tr.leafwise`); while autograd records (or under vmap, compiled) it
    # runs the leaf-list ops. Same math, regrouped: equal to a few ulps.
    params = {k: v.to(dtype) for k, v in make_params().items()}
    opt = ps.inject_hyperparams(ps.adamw)(1e-2, weight_decay=0.1)
    fast_state = slow_state = opt.init(params)
    for grads in grad_stream(params):
        fast, fast_state = opt.update(grads, fast_state, params)
        traced = {k: g.clone().requires_grad_() for k, g in grads.items()}
        slow, slow_state = opt.update(traced, slow_state, params)
        tol = dict(rtol=1e-12, atol=1e-15) if dtype == torch.float64 else dict(rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(fast, {k: v.detach() for k, v in slow.items()}, **tol)
        slow_state = ps.tree_map(lambda t: t.detach(), slow_state)
        torch.testing.assert_close(ps.tree_leaves(fast_state), ps.tree_leaves(slow_state), **tol)


def test_adam_differentiates_through_a_state_that_autograd_records():
    # The eager CPU path updates its own intermediates in place; a moment that requires
    # grad (meta-learning through earlier steps) must take the differentiable path instead.
    params = {"w": torch.randn(5, dtype=torch.float64)}
    opt = ps.adamw(0.1)
    mu0 = torch.randn(5, dtype=torch.float64, requires_grad=True)
    state = ps.tree_set(opt.init(params), "mu", {"w": 2.0 * mu0})
    updates, _ = opt.update({"w": torch.randn(5, dtype=torch.float64)}, state, params)
    (grad,) = torch.autograd.grad(updates["w"].sum(), mu0)
    assert torch.isfinite(grad).all() and (grad != 0).all()


def test_adamw_defaults_match_torch_adamw_defaults():
    params = make_params()
    grads = grad_stream(params)
    ours, _ = run_purestep(ps.adamw(1e-3), params, grads)
    theirs, _ = run_torch(lambda t: torch.optim.AdamW(t.values(), lr=1e-3), params, grads)
    assert_histories_close(ours, theirs)


@pytest.mark.parametrize("name", ["adam", "adamw", "sgd"])
def test_lr_schedule_matches_torch_lr_set_every_step(name):
    params = make_params()
    grads = grad_stream(params)
    schedule = lambda t: 0.02 * (1.0 + torch.cos(t * 0.3)) / (1.0 + t)  # noqa: E731
    lrs = [float(schedule(torch.tensor(float(i), dtype=torch.float64))) for i in range(STEPS)]
    kwargs = dict(weight_decay=0.1) if name != "sgd" else dict(momentum=0.9, weight_decay=0.1)
    ours, _ = run_purestep(getattr(ps, name)(lr=schedule, **kwargs), params, grads)
    cls = {"adam": torch.optim.Adam, "adamw": torch.optim.AdamW, "sgd": torch.optim.SGD}[name]
    theirs, _ = run_torch(lambda t: cls(t.values(), lr=lrs[0], **kwargs), params, grads, lrs=lrs)
    assert_histories_close(ours, theirs)


def test_adamw_decay_mask_matches_torch_param_groups():
    params = make_params()
    grads = grad_stream(params)
    mask = {k: v.dim() >= 2 for k, v in params.items()}
    ours, _ = run_purestep(ps.adamw(1e-2, weight_decay=0.3, mask=mask), params, grads)

    def make(t):
        decay = [p for k, p in t.items() if mask[k]]
        no_decay = [p for k, p in t.items() if not mask[k]]
        return torch.optim.AdamW(
            [{"params": decay, "weight_decay": 0.3}, {"params": no_decay, "weight_decay": 0.0}], lr=1e-2
        )

    theirs, _ = run_torch(make, params, grads)
    assert_histories_close(ours, theirs)
    # A callable mask gives the same result.
    ours_callable, _ = run_purestep(
        ps.adamw(1e-2, weight_decay=0.3, mask=lambda p: {k: v.dim() >= 2 for k, v in p.items()}), params, grads
    )
    assert_histories_close(ours_callable, theirs, rtol=0)


@pytest.mark.parametrize("kwargs", [dict(lr=1e-2), dict(lr=3e-3, betas=(0.95, 0.98), weight_decay=0.2)], ids=str)
def test_lion_matches_lion_pytorch(kwargs):
    params = make_params()
    grads = grad_stream(params)
    ours, state = run_purestep(ps.lion(**kwargs), params, grads)
    theirs, opt = run_torch(lambda t: Lion(t.values(), **kwargs), params, grads)
    assert_histories_close(ours, theirs)
    assert_moved(ours, params)
    torch_params = opt.param_groups[0]["params"]
    for i, k in enumerate(params):
        torch.testing.assert_close(ps.tree_get(state, "mu")[k], opt.state[torch_params[i]]["exp_avg"], rtol=RTOL, atol=1e-14)


def run_optax(opt, params, grads_list):
    jparams = {k: jax.numpy.asarray(v.numpy()) for k, v in params.items()}
    state = opt.init(jparams)
    history = []
    for grads in grads_list:
        jgrads = {k: jax.numpy.asarray(v.numpy()) for k, v in grads.items()}
        updates, state = opt.update(jgrads, state, jparams)
        jparams = optax.apply_updates(jparams, updates)
        history.append({k: torch.from_numpy(np.asarray(v).copy()) for k, v in jparams.items()})
    return history


@pytest.mark.parametrize(
    "kwargs", [dict(), dict(betas=(0.8, 0.99), eps=1e-4, weight_decay=0.1)], ids=["defaults", "decay"]
)
def test_lamb_matches_optax_lamb(kwargs):
    params = make_params()
    grads = grad_stream(params)
    ours, _ = run_purestep(ps.lamb(1e-2, **kwargs), params, grads)
    b1, b2 = kwargs.get("betas", (0.9, 0.999))
    theirs = run_optax(
        optax.lamb(1e-2, b1=b1, b2=b2, eps=kwargs.get("eps", 1e-6), weight_decay=kwargs.get("weight_decay", 0.0)),
        params,
        grads,
    )
    assert_histories_close(ours, theirs)
    assert_moved(ours, params)


@pytest.mark.parametrize(
    "kwargs",
    [dict(), dict(momentum=0.8, weight_decay=0.01, trust_coefficient=0.01, eps=1e-5, nesterov=True)],
    ids=["defaults", "nesterov-decay"],
)
def test_lars_matches_optax_lars(kwargs):
    params = make_params()
    grads = grad_stream(params)
    ours, _ = run_purestep(ps.lars(0.5, **kwargs), params, grads)
    theirs = run_optax(optax.lars(0.5, **kwargs), params, grads)
    assert_histories_close(ours, theirs)
    assert_moved(ours, params)


def test_lamb_and_lars_leave_zero_params_to_plain_updates():
    """A zero-norm param gets trust ratio 1, as optax does."""
    params = {"w": torch.zeros(3, dtype=torch.float64)}
    grads = {"w": torch.tensor([1.0, -2.0, 3.0], dtype=torch.float64)}
    opt = ps.lars(0.1, momentum=0.0)
    updates, _ = opt.update(grads, opt.init(params), params)
    torch.testing.assert_close(updates["w"], -0.1 * grads["w"])


@pytest.mark.parametrize("name", ["sgd", "adam", "adamw", "lion", "lamb", "lars"])
def test_optimizers_are_pure_and_keep_shapes_and_dtypes(name):
    params = {"a": torch.randn(3), "b": torch.randn(2, 2, dtype=torch.float64), "c": torch.randn(()), "d": torch.randn(2, 1, 2, 2).to(torch.bfloat16)}
    grads = {k: torch.randn_like(v.float()).to(v.dtype) for k, v in params.items()}
    opt = getattr(ps, name)(0.1)
    state = opt.init(params)
    snapshots = [{k: v.clone() for k, v in t.items()} for t in (params, grads)]
    state_before = [x.clone() for x in torch.utils._pytree.tree_leaves(state)]
    for _ in range(3):
        updates, new_state = opt.update(grads, state, params)
        for tree, snap in zip((params, grads), snapshots):
            for k in tree:
                assert torch.equal(tree[k], snap[k]), f"{name} mutated input leaf {k}"
        for a, b in zip(torch.utils._pytree.tree_leaves(state), state_before):
            assert torch.equal(a, b), f"{name} mutated its state"
        for k in params:
            assert updates[k].shape == params[k].shape and updates[k].dtype == params[k].dtype, k
        new_leaves = torch.utils._pytree.tree_leaves(new_state)
        assert [(x.shape, x.dtype) for x in new_leaves] == [(x.shape, x.dtype) for x in state_before]
        state = new_state
        state_before = [x.clone() for x in new_leaves]


@pytest.mark.parametrize(
    "make, arg",
    [
        (lambda: ps.sgd(-0.1), "lr"),
        (lambda: ps.sgd(0.1, momentum=-0.5), "momentum"),
        (lambda: ps.sgd(0.1, nesterov=True), "nesterov"),
        (lambda: ps.sgd(0.1, momentum=0.9, dampening=0.1, nesterov=True), "nesterov"),
        (lambda: ps.sgd(0.1, weight_decay=-1.0), "weight_decay"),
        (lambda: ps.adam(1e-3, betas=(1.0, 0.999)), "betas[0]"),
        (lambda: ps.adam(1e-3, betas=(0.9, -0.1)), "betas[1]"),
        (lambda: ps.adam(1e-3, betas=(0.9,)), "betas"),
        (lambda: ps.adamw(1e-3, eps=0.0), "eps"),
        (lambda: ps.adamw(1e-3, eps=-1e-8), "eps"),
        (lambda: ps.adamw(-1e-3), "lr"),
        (lambda: ps.adamw(float("nan")), "lr"),
        (lambda: ps.lion(1e-3, betas=(0.9, 1.5)), "betas[1]"),
        (lambda: ps.lamb(1e-3, eps=0.0), "eps"),
        (lambda: ps.lars(0.1, trust_coefficient=-1.0), "trust_coefficient"),
        (lambda: ps.lars(0.1, momentum=0.0, nesterov=True), "nesterov"),
        (lambda: ps.adamw("fast"), "lr"),
    ],
)
def test_invalid_hyperparameters_raise_naming_the_argument(make, arg):
    with pytest.raises(ValueError, match=arg.replace("[", r"\[").replace("]", r"\]")):
        make()


@pytest.mark.parametrize("name", ["sgd", "adamw", "lion", "lamb", "lars"])
def test_mismatched_grads_raise_naming_the_leaf_path(name):
    params = {"layers.0.mlp.weight": torch.randn(3, 2), "layers.1.mlp.bias": torch.randn(2)}
    opt = getattr(ps, name)(0.1, momentum=0.9) if name == "sgd" else getattr(ps, name)(0.1)
    state = opt.init(params)
    missing = {"layers.0.mlp.weight": torch.randn(3, 2)}
    with pytest.raises(ValueError, match="layers.1.mlp.bias"):
        opt.update(missing, state, params)
    extra = {**params, "layers.2.mlp.bias": torch.randn(2)}
    with pytest.raises(ValueError, match="layers.2.mlp.bias"):
        opt.update(extra, state, params)
    bad_shape = {**params, "layers.1.mlp.bias": torch.randn(3)}
    with pytest.raises(ValueError, match=r"layers.1.mlp.bias.*shape"):
        opt.update(bad_shape, state, params)
    bad_dtype = {**params, "layers.1.mlp.bias": torch.randn(2, dtype=torch.float64)}
    with pytest.raises(ValueError, match=r"layers.1.mlp.bias.*dtype"):
        opt.update(bad_dtype, state, params)


def test_nested_tree_paths_are_dotted():
    params = {"layers": [{"mlp": {"bias": torch.zeros(2)}}, {"mlp": {"bias": torch.zeros(2)}}]}
    opt = ps.adam(1e-3)
    state = opt.init(params)
    grads = {"layers": [{"mlp": {"bias": torch.zeros(2)}}, {"mlp": {"bias": torch.zeros(3)}}]}
    with pytest.raises(ValueError, match=r"'layers\.1\.mlp\.bias'"):
        opt.update(grads, state, params)


def test_betas_and_weight_decay_accept_schedules():
    params = make_params()
    grads = grad_stream(params, steps=6)
    beta1 = lambda t: 0.9 - 0.1 * torch.exp(-t)  # noqa: E731
    ours, _ = run_purestep(ps.adamw(1e-2, betas=(beta1, 0.99), weight_decay=lambda t: 0.1 / (1 + t)), params, grads)
    # Reference: the same rule written per tensor in float64; as torch.optim.Adam does when
    # betas change, the bias correction uses the current beta: 1 - β₁(t)ᵗ.
    ref = {k: v.clone() for k, v in params.items()}
    m = {k: torch.zeros_like(v) for k, v in params.items()}
    v2 = {k: torch.zeros_like(v) for k, v in params.items()}
    for i, g in enumerate(grads):
        b1 = 0.9 - 0.1 * float(torch.exp(-torch.tensor(float(i), dtype=torch.float64)))
        wd = 0.1 / (1 + i)
        for k in ref:
            m[k] = b1 * m[k] + (1 - b1) * g[k]
            v2[k] = 0.99 * v2[k] + 0.01 * g[k] ** 2
            bc1 = 1 - b1 ** (i + 1)
            bc2 = 1 - 0.99 ** (i + 1)
            ref[k] = ref[k] - 1e-2 * ((m[k] / bc1) / ((v2[k] / bc2).sqrt() + 1e-8) + wd * ref[k])
    for k in ref:
        torch.testing.assert_close(ours[-1][k], ref[k], rtol=RTOL, atol=1e-12)
