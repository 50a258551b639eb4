"""make_step, make_update, functional_model: parity with torch loops, compile, donation, vmap, meta-gradients."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
import torch.utils._pytree as pytree

import purestep.core as ps
from tests.registry import TRANSFORMS


def mlp(dtype=torch.float64, bn=False, seed=0):
    torch.manual_seed(seed)
    # BatchNorm after the nonlinearity: right after a Linear it would cancel that
    # Linear's bias gradient to rounding noise, which Adam then amplifies.
    layers = [torch.nn.Linear(5, 8), torch.nn.Tanh()]
    if bn:
        layers.append(torch.nn.BatchNorm1d(8))
    layers.append(torch.nn.Linear(8, 3))
    return torch.nn.Sequential(*layers).to(dtype)


def batches(n, size=12, dtype=torch.float64, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(size, 5, generator=g, dtype=dtype), torch.randn(size, 3, generator=g, dtype=dtype))
        for _ in range(n)
    ]


def mse_loss_fn(apply_fn, buffers):
    def loss_fn(params, batch):
        x, y = batch
        out, _ = apply_fn(params, buffers, x)
        return F.mse_loss(out, y)

    return loss_fn


def clone(tree):
    return pytree.tree_map(lambda t: t.clone(), tree)


def assert_trees_close(a, b, **kw):
    for (path, x), y in zip(ps.tree_flatten_with_path(a)[0], pytree.tree_leaves(b)):
        torch.testing.assert_close(x, y, msg=lambda m: f"{path}: {m}", **kw)


# --------------------------------------------------------------------------- #
# Parity with torch.
# --------------------------------------------------------------------------- #


def test_make_step_matches_torch_clip_grad_norm_and_adamw_over_15_steps():
    model = mlp()
    ref = copy.deepcopy(model)
    apply_fn, params, buffers = ps.functional_model(model)
    params = clone(params)
    opt = ps.chain(ps.clip_by_global_norm(0.5), ps.adamw(1e-2, betas=(0.8, 0.95), weight_decay=0.1))
    state = opt.init(params)
    step = ps.make_step(mse_loss_fn(apply_fn, buffers), opt)
    torch_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, betas=(0.8, 0.95), weight_decay=0.1)
    clipped = 0
    for x, y in batches(15):
        torch_opt.zero_grad()
        loss = F.mse_loss(ref(x), y)
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
        torch_opt.step()
        params, state, metrics = step(params, state, (x, y))
        clipped += int(norm > 0.5)
        torch.testing.assert_close(metrics["loss"], loss.detach(), rtol=1e-12, atol=1e-14)
        torch.testing.assert_close(metrics["grad_norm"], norm, rtol=1e-12, atol=1e-14)
        assert_trees_close(params, dict(ref.named_parameters()), rtol=1e-11, atol=1e-13)
    assert clipped > 3  # the clipping was exercised
    assert set(metrics) == {"loss", "grad_norm", "update_norm"}


def test_update_norm_is_the_norm_of_the_applied_update():
    apply_fn, params, buffers = ps.functional_model(mlp())
    params = clone(params)
    opt = ps.sgd(0.1, momentum=0.9)
    state = opt.init(params)
    new, state, metrics = ps.make_step(mse_loss_fn(apply_fn, buffers), opt)(params, state, batches(1)[0])
    diff = pytree.tree_map(torch.sub, new, params)
    torch.testing.assert_close(metrics["update_norm"], ps.tree_global_norm(diff))


def test_lr_metric_is_the_injected_lr_this_step_used():
    apply_fn, params, buffers = ps.functional_model(mlp())
    params = clone(params)
    opt = ps.inject_hyperparams(ps.adamw)(lr=lambda t: 0.1 / (1.0 + t))
    state = opt.init(params)
    step = ps.make_step(mse_loss_fn(apply_fn, buffers), opt)
    for i, batch in enumerate(batches(3)):
        params, state, metrics = step(params, state, batch)
        torch.testing.assert_close(metrics["lr"], torch.tensor(0.1 / (1.0 + i), dtype=torch.float64))


def test_has_aux_returns_aux_in_metrics_stacked_over_micro_batches():
    params = {"w": torch.ones(5, 3, dtype=torch.float64)}

    def loss_fn(params, batch):
        out = batch[0] @ params["w"]
        return F.mse_loss(out, batch[1]), {"mean_out": out.mean()}

    opt = ps.sgd(0.1)
    batch = batches(1)[0]
    _, _, metrics = ps.make_step(loss_fn, opt, has_aux=True)(params, opt.init(params), batch)
    torch.testing.assert_close(metrics["aux"]["mean_out"], (batch[0] @ params["w"]).mean())
    _, _, metrics = ps.make_step(loss_fn, opt, has_aux=True, micro_batches=3)(params, opt.init(params), batch)
    assert metrics["aux"]["mean_out"].shape == (3,)


# --------------------------------------------------------------------------- #
# Micro-batches.
# --------------------------------------------------------------------------- #


def test_micro_batches_equal_the_full_batch_step():
    apply_fn, params, buffers = ps.functional_model(mlp())
    opt = ps.adamw(1e-2)
    full = ps.make_step(mse_loss_fn(apply_fn, buffers), opt)
    micro = ps.make_step(mse_loss_fn(apply_fn, buffers), opt, micro_batches=4)
    p1, s1, p2, s2 = clone(params), opt.init(params), clone(params), opt.init(params)
    for batch in batches(3):
        p1, s1, m1 = full(p1, s1, batch)
        p2, s2, m2 = micro(p2, s2, batch)
        torch.testing.assert_close(m2["loss"], m1["loss"], rtol=1e-13, atol=1e-15)
        torch.testing.assert_close(m2["grad_norm"], m1["grad_norm"], rtol=1e-12, atol=1e-15)
    assert_trees_close(p2, p1, rtol=1e-12, atol=1e-14)
    assert_trees_close(s2, s1, rtol=1e-12, atol=1e-14)


def test_micro_batches_that_do_not_divide_the_batch_raise():
    apply_fn, params, buffers = ps.functional_model(mlp())
    opt = ps.sgd(0.1)
    step = ps.make_step(mse_loss_fn(apply_fn, buffers), opt, micro_batches=5)
    with pytest.raises(ValueError, match="micro_batches=5 must divide the batch size: batch leaf '0' has shape"):
        step(params, opt.init(params), batches(1, size=12)[0])
    with pytest.raises(ValueError, match="micro_batches must be an int >= 1"):
        ps.make_step(mse_loss_fn(apply_fn, buffers), opt, micro_batches=0)


def test_make_step_refuses_what_is_not_a_transform():
    with pytest.raises(ValueError, match="optimizer must be a ps.Transform"):
        ps.make_step(lambda p, b: 0.0, torch.optim.SGD)
    with pytest.raises(ValueError, match="ema must be an"):
        ps.make_update(ps.sgd(0.1), ema=0.999)


# --------------------------------------------------------------------------- #
# Buffers.
# --------------------------------------------------------------------------- #


def test_functional_model_never_mutates_its_buffers():
    model = mlp(bn=True)
    apply_fn, params, buffers = ps.functional_model(model)
    before = clone(buffers)
    _, new = apply_fn(params, buffers, torch.randn(4, 5, dtype=torch.float64))
    assert_trees_close(buffers, before, rtol=0, atol=0)
    assert int(new["2.num_batches_tracked"]) == 1
    assert not torch.equal(new["2.running_mean"], before["2.running_mean"])


@pytest.mark.parametrize("micro_batches", [1, 2])
def test_buffers_are_threaded_through_the_step_as_a_torch_loop_updates_them(micro_batches):
    model = mlp(bn=True)
    ref = copy.deepcopy(model)
    apply_fn, params, buffers = ps.functional_model(model)
    params, buffers = clone(params), clone(buffers)

    def loss_fn(params, batch, buffers):
        out, buffers = apply_fn(params, buffers, batch[0])
        return F.mse_loss(out, batch[1]), buffers

    opt = ps.sgd(0.1, momentum=0.9)
    state = opt.init(params)
    step = ps.make_step(loss_fn, opt, micro_batches=micro_batches)
    torch_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    for x, y in batches(4):
        torch_opt.zero_grad()
        for xs, ys in zip(x.chunk(micro_batches), y.chunk(micro_batches)):
            (F.mse_loss(ref(xs), ys) / micro_batches).backward()
        torch_opt.step()
        params, state, metrics, buffers = step(params, state, (x, y), buffers)
    assert_trees_close(params, dict(ref.named_parameters()), rtol=1e-11, atol=1e-13)
    assert_trees_close(buffers, dict(ref.named_buffers()), rtol=1e-11, atol=1e-13)
    assert int(buffers["2.num_batches_tracked"]) == 4 * micro_batches


# --------------------------------------------------------------------------- #
# Donation.
# --------------------------------------------------------------------------- #


def test_donated_step_updates_inputs_in_place_and_returns_them():
    model = mlp(bn=True)
    apply_fn, params, buffers = ps.functional_model(model)

    def loss_fn(params, batch, buffers):
        out, buffers = apply_fn(params, buffers, batch[0])
        return F.mse_loss(out, batch[1]), buffers

    opt = ps.adamw(1e-2)
    pure = ps.make_step(loss_fn, opt)
    donated = ps.make_step(loss_fn, opt, donate=True)
    p_ref, s_ref, b_ref = clone(params), opt.init(params), clone(buffers)
    state = opt.init(params)
    ptrs = [t.data_ptr() for t in pytree.tree_leaves((params, state, buffers))]
    for batch in batches(3):
        p_ref, s_ref, m_ref, b_ref = pure(p_ref, s_ref, batch, b_ref)
        out = donated(params, state, batch, buffers)
        assert out[0] is params and out[1] is state and out[3] is buffers
        torch.testing.assert_close(out[2]["loss"], m_ref["loss"])
    assert [t.data_ptr() for t in pytree.tree_leaves((params, state, buffers))] == ptrs
    assert_trees_close((params, state, buffers), (p_ref, s_ref, b_ref), rtol=1e-13, atol=1e-15)
    # functional_model's params share storage with the module: the module trained too
    torch.testing.assert_close(model[0].weight.detach(), params["0.weight"])


def test_eager_donated_step_adopts_new_state_storage_and_equals_the_pure_step_bitwise():
    # Without compile, a donated step adds the updates into the params in place (the module
    # trains: functional_model's params share its storage) and lets large state leaves adopt
    # their new values' storage: the same tensor objects, bitwise the pure step's values.
    torch.manual_seed(0)
    model = torch.nn.Linear(200, 100)  # a 20000-element weight: its moments are adopted, not copied
    apply_fn, params, buffers = ps.functional_model(model)
    loss_fn = mse_loss_fn(apply_fn, buffers)
    opt = ps.inject_hyperparams(ps.adamw)(1e-2, weight_decay=0.1)
    pure, donated = ps.make_step(loss_fn, opt), ps.make_step(loss_fn, opt, donate=True)
    state, p_ref, s_ref = opt.init(params), clone(params), opt.init(params)
    mu = ps.tree_get(state, "mu")["weight"]
    mu_storage = mu.data_ptr()
    before = pytree.tree_leaves((params, state))
    g = torch.Generator().manual_seed(1)
    for i in range(3):
        batch = (torch.randn(8, 200, generator=g), torch.randn(8, 100, generator=g))
        out = donated(params, state, batch)
        p_ref, s_ref, m_ref = pure(p_ref, s_ref, batch)
        assert out[0] is params and out[1] is state
        for k in ("loss", "grad_norm", "update_norm", "lr"):
            assert torch.equal(out[2][k], m_ref[k]), k
        if i == 0:  # adopted, not copied (checked after one step: later ones may reuse freed memory)
            assert ps.tree_get(state, "mu")["weight"] is mu and mu.data_ptr() != mu_storage
    assert all(x is y for x, y in zip(pytree.tree_leaves((params, state)), before))
    for (path, x), y in zip(ps.tree_flatten_with_path((params, state))[0], pytree.tree_leaves((p_ref, s_ref))):
        assert torch.equal(x, y), path
    assert torch.equal(model.weight.detach(), params["weight"])


def test_make_update_with_ema_equals_the_separate_pieces():
    torch.manual_seed(0)
    params = {"w": torch.randn(4, 3, dtype=torch.float64), "b": torch.randn(3, dtype=torch.float64)}
    opt = ps.chain(ps.clip_by_global_norm(1.0), ps.adamw(1e-2, weight_decay=0.1))
    ema = ps.params_ema(0.9)
    update = ps.make_update(opt, ema=ema, donate=True)
    p, s, e = clone(params), opt.init(params), ema.init(params)
    p_ref, s_ref, e_ref = clone(params), opt.init(params), ema.init(params)
    for i in range(4):
        grads = pytree.tree_map(lambda t: torch.randn_like(t) * 3, params)
        out = update(p, grads, s, e)
        assert out[0] is p and out[1] is s and out[2] is e
        updates, s_ref = opt.update(grads, s_ref, p_ref)
        p_ref = ps.apply_updates(p_ref, updates)
        e_ref = ema.update(e_ref, p_ref)
    assert_trees_close((p, s, e), (p_ref, s_ref, e_ref), rtol=1e-13, atol=1e-15)
    with pytest.raises(TypeError, match=r"update takes \(params, grads, opt_state, ema_state\)"):
        update(p, grads, s)


@pytest.mark.parametrize("inject", [False, True], ids=["floats", "injected"])
def test_eager_donated_update_keeps_its_tensors_and_equals_the_pure_update_to_rounding(inject):
    # Uncompiled donation runs AdamW in place (torch's fused kernel where it applies): μ and
    # ν in their own storage, the decay and lr folded into p ← (1-ηλ)·p - η·m̂/(√v̂+ε), equal
    # to the pure p + (-η)·(u + λ·p) to rounding; the EMA leaves adopt their new storage. The
    # same tensor objects throughout, and the grads are only read; step counts are exact.
    torch.manual_seed(0)
    params = {"w": torch.randn(64, 32), "b": torch.randn(32), "scalar": torch.randn(())}
    opt = (ps.inject_hyperparams(ps.adamw) if inject else ps.adamw)(1e-2, weight_decay=0.1)
    ema = ps.params_ema(0.9)
    pure, donated = ps.make_update(opt, ema=ema), ps.make_update(opt, ema=ema, donate=True)
    p, s, e = clone(params), opt.init(params), ema.init(params)
    p_ref, s_ref, e_ref = clone(params), opt.init(params), ema.init(params)
    before = pytree.tree_leaves((p, s, e))
    moments = [t.data_ptr() for t in pytree.tree_leaves((ps.tree_get(s, "mu"), ps.tree_get(s, "nu")))]
    for _ in range(4):
        grads = pytree.tree_map(lambda t: torch.randn_like(t), params)
        snapshot = clone(grads)
        out = donated(p, grads, s, e)
        assert out[0] is p and out[1] is s and out[2] is e
        p_ref, s_ref, e_ref = pure(p_ref, grads, s_ref, e_ref)
        for g, g0 in zip(pytree.tree_leaves(grads), pytree.tree_leaves(snapshot)):
            assert torch.equal(g, g0)  # the grads are only read
    after = pytree.tree_leaves((p, s, e))
    assert all(x is y for x, y in zip(after, before))
    assert [t.data_ptr() for t in pytree.tree_leaves((ps.tree_get(s, "mu"), ps.tree_get(s, "nu")))] == moments
    for (path, x), y in zip(ps.tree_flatten_with_path(s)[0], pytree.tree_leaves(s_ref)):
        if x.is_floating_point():
            torch.testing.assert_close(x, y, rtol=1e-6, atol=1e-7, msg=lambda m: f"{path}: {m}")
        else:
            assert torch.equal(x, y), path
    assert_trees_close((p, e), (p_ref, e_ref), rtol=1e-6, atol=1e-6)


def _torch_adamw_run(params, grads, lr, wd, steps_lr=None):
    ref = [torch.nn.Parameter(v.clone()) for v in params.values()]
    opt = torch.optim.AdamW(ref, lr=lr, betas=(0.8, 0.99), weight_decay=wd, foreach=False)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, steps_lr) if steps_lr else None
    for g in grads:
        for q, x in zip(ref, g.values()):
            q.grad = x.clone()
        opt.step()
        if sched:
            sched.step()
    return ref, opt


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("form", ["floats", "injected", "schedule"])
def test_eager_donated_adamw_matches_torch_adamw_over_100_steps(dtype, form):
    # The folded in-place step is torch.optim.AdamW's (its fused kernel, `_adam.apply_fused`):
    # params, μ and ν to a few ulps over 100 steps. "big" is a cache block of its own, "w"
    # and "b" share one (where the fused kernel declines, `apply_leafwise`).
    torch.manual_seed(0)
    params = {
        "big": torch.randn(260, 260, dtype=dtype),
        "w": torch.randn(40, 30, dtype=dtype),
        "b": torch.randn(30, dtype=dtype),
    }
    grads = [pytree.tree_map(torch.randn_like, params) for _ in range(100)]
    decay = lambda t: 0.5 ** (t // 25)  # noqa: E731 (a step schedule, torch's LambdaLR factor)
    if form == "schedule":
        opt = ps.adamw(lambda t: 1e-2 * 0.5 ** torch.floor(t / 25), betas=(0.8, 0.99), weight_decay=0.1)
    else:
        opt = (ps.inject_hyperparams(ps.adamw) if form == "injected" else ps.adamw)(
            1e-2, betas=(0.8, 0.99), weight_decay=0.1
        )
    update = ps.make_update(opt, donate=True)
    p, s = clone(params), opt.init(params)
    for g in grads:
        update(p, g, s)
    ref, torch_opt = _torch_adamw_run(params, grads, 1e-2, 0.1, decay if form == "schedule" else None)
    tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=1e-13, atol=1e-14)
    for (name, x), q in zip(p.items(), ref):
        torch.testing.assert_close(x, q.detach(), **tol, msg=lambda m: f"{name}: {m}")
        mu, nu = ps.tree_get(s, "mu")[name], ps.tree_get(s, "nu")[name]
        torch.testing.assert_close(mu, torch_opt.state[q]["exp_avg"], **tol)
        torch.testing.assert_close(nu, torch_opt.state[q]["exp_avg_sq"], **tol)


_REGISTRY_SKIP = {"sophia", "scale_by_sophia"}  # their curvature comes as an `update` keyword make_update has not


@pytest.mark.parametrize("name", sorted(n for n in TRANSFORMS if n not in _REGISTRY_SKIP))
def test_eager_donated_update_equals_the_pure_update_for_every_registered_transform(name):
    # The in-place apply (`with_in_place`, affine tails folded by chain) of every
    # transform, composed as make_update composes it, equals the pure update to rounding.
    case = TRANSFORMS[name]
    torch.manual_seed(0)
    shapes = {"w": (6, 5), "v": (5, 4)} if case.matrices_only else {"w": (6, 5), "b": (5,)}
    params = {k: torch.randn(shape, dtype=torch.float64) for k, shape in shapes.items()}
    opt = case.make()
    pure, donated = ps.make_update(opt), ps.make_update(opt, donate=True)
    p, s = clone(params), opt.init(params)
    p_ref, s_ref = clone(params), opt.init(params)
    for _ in range(5):
        grads = pytree.tree_map(torch.randn_like, params)
        donated(p, grads, s)
        p_ref, s_ref = pure(p_ref, grads, s_ref)
    assert_trees_close((p, s), (p_ref, s_ref), rtol=1e-12, atol=1e-14)


def test_eager_donated_update_copies_a_new_state_leaf_that_aliases_the_grads():
    # A transform may keep the grads it was given in its state. Adopting that storage would
    # let the caller's next backward, which accumulates into its grads, rewrite the state.
    def init(params):
        return {"last": pytree.tree_map(torch.zeros_like, params)}

    def update(grads, state, params=None, **extra):
        return pytree.tree_map(torch.neg, grads), {"last": grads}

    keep = ps.Transform(init, update)
    n = 1 << 15  # 128 KiB: large enough to be adopted rather than copied, were it not the grad's
    params = {"w": torch.zeros(n)}
    state = keep.init(params)
    grads = {"w": torch.ones(n)}
    ps.make_update(keep, donate=True)(params, grads, state)
    grads["w"].mul_(5.0)  # as loss.backward() into p.grad does
    torch.testing.assert_close(state["last"]["w"], torch.ones(n), rtol=0, atol=0)
    torch.testing.assert_close(params["w"], -torch.ones(n), rtol=0, atol=0)


# --------------------------------------------------------------------------- #
# Pure: vmap and meta-gradients.
# --------------------------------------------------------------------------- #


def test_vmapped_step_trains_four_models_each_equal_to_its_own_run():
    apply_fn, _, buffers = ps.functional_model(mlp())
    opt = ps.chain(ps.clip_by_global_norm(1.0), ps.adamw(1e-2, weight_decay=0.1))
    step = ps.make_step(mse_loss_fn(apply_fn, buffers), opt)
    models = [clone(ps.functional_model(mlp(seed=s))[1]) for s in range(4)]
    data = [batches(3, seed=10 + s) for s in range(4)]
    stack = lambda trees: pytree.tree_map(lambda *xs: torch.stack(xs), *trees)
    params = stack(models)
    state = torch.func.vmap(opt.init)(params)
    vstep = torch.func.vmap(step)
    for i in range(3):
        params, state, metrics = vstep(params, state, stack([d[i] for d in data]))
    assert metrics["loss"].shape == (4,)
    for k in range(4):
        p, s = models[k], opt.init(models[k])
        for batch in data[k]:
            p, s, m = step(p, s, batch)
        assert_trees_close(pytree.tree_map(lambda t: t[k], params), p, rtol=1e-12, atol=1e-14)
        torch.testing.assert_close(metrics["grad_norm"][k], m["grad_norm"], rtol=1e-12, atol=1e-14)


def test_meta_gradient_through_three_steps_matches_central_differences():
    apply_fn, params0, buffers = ps.functional_model(mlp())
    params0 = clone(params0)
    data = batches(4)
    loss_fn = mse_loss_fn(apply_fn, buffers)

    def final_loss(lr):
        opt = ps.chain(ps.clip_by_global_norm(1.0), ps.adamw(lr, weight_decay=0.1))
        step = ps.make_step(loss_fn, opt)
        params, state = params0, opt.init(params0)
        for batch in data[:3]:
            params, state, _ = step(params, state, batch)
        return loss_fn(params, data[3])

    lr = torch.tensor(0.05, dtype=torch.float64, requires_grad=True)
    (grad,) = torch.autograd.grad(final_loss(lr), lr)
    h = 1e-6
    with torch.no_grad():
        fd = (final_loss(lr + h) - final_loss(lr - h)) / (2 * h)
    assert abs(grad.item()) > 1e-3
    torch.testing.assert_close(grad, fd, rtol=1e-6, atol=1e-9)


# --------------------------------------------------------------------------- #
# Compiled (two compiles: keep this section small, each costs 10-30 s on CPU).
# --------------------------------------------------------------------------- #


def test_compiled_donated_step_equals_eager_and_never_recompiles():
    torch._dynamo.reset()
    apply_fn, params, buffers = ps.functional_model(mlp(dtype=torch.float32, bn=True))
    params, buffers = clone(params), clone(buffers)

    def loss_fn(params, batch, buffers):
        out, buffers = apply_fn(params, buffers, batch[0])
        return F.mse_loss(out, batch[1]), buffers

    schedule = lambda t: 1e-2 * torch.clamp((t + 1) / 3, max=1.0)
    opt = ps.chain(ps.clip_by_global_norm(1.0), ps.inject_hyperparams(ps.adamw)(lr=schedule, weight_decay=0.1))
    eager = ps.make_step(loss_fn, opt, micro_batches=2)
    compiled = ps.make_step(loss_fn, opt, micro_batches=2, compile=True, donate=True)
    state, p_ref, s_ref, b_ref = opt.init(params), clone(params), opt.init(params), clone(buffers)
    data = batches(5, dtype=torch.float32)
    for i, batch in enumerate(data):
        if i == 3:  # a changed hyperparameter is a new tensor value, not a new graph
            state = ps.set_hyperparam(state, "weight_decay", 0.5)
            s_ref = ps.set_hyperparam(s_ref, "weight_decay", 0.5)
        with torch.compiler.set_stance("fail_on_recompile" if i else "default"):
            out = compiled(params, state, batch, buffers)
        assert out[0] is params and out[3] is buffers
        p_ref, s_ref, m_ref, b_ref = eager(p_ref, s_ref, batch, b_ref)
        for k in ("loss", "grad_norm", "update_norm", "lr"):
            torch.testing.assert_close(out[2][k], m_ref[k], rtol=1e-5, atol=1e-6)
    assert_trees_close((params, state, buffers), (p_ref, s_ref, b_ref), rtol=1e-5, atol=1e-6)


def test_compiled_donated_update_with_clip_and_ema_equals_eager_and_never_recompiles():
    torch._dynamo.reset()
    torch.manual_seed(0)
    params = {"w": torch.randn(64, 32), "b": torch.randn(32)}
    opt = ps.chain(ps.clip_by_global_norm(1.0), ps.inject_hyperparams(ps.adamw)(lr=1e-2, weight_decay=0.1))
    ema = ps.params_ema(0.9)
    compiled = ps.make_update(opt, ema=ema, compile=True, donate=True)
    eager = ps.make_update(opt, ema=ema)
    p, s, e = clone(params), opt.init(params), ema.init(params)
    p_ref, s_ref, e_ref = clone(params), opt.init(params), ema.init(params)
    for i in range(4):
        grads = pytree.tree_map(lambda t: torch.randn_like(t) * 3, params)
        if i == 2:
            s, s_ref = ps.set_hyperparam(s, "lr", 3e-2), ps.set_hyperparam(s_ref, "lr", 3e-2)
        with torch.compiler.set_stance("fail_on_recompile" if i else "default"):
            out = compiled(p, grads, s, e)
        assert out[0] is p and out[1] is s and out[2] is e
        if i in (0, 2):  # the first call (and a new state tree) moves the tensors into flat buffers, once
            ptrs = [t.data_ptr() for t in pytree.tree_leaves((p, s, e))]
        p_ref, s_ref, e_ref = eager(p_ref, grads, s_ref, e_ref)
    assert [t.data_ptr() for t in pytree.tree_leaves((p, s, e))] == ptrs
    assert_trees_close((p, s, e), (p_ref, s_ref, e_ref), rtol=1e-5, atol=1e-6)


def test_donated_update_refuses_a_tree_holding_one_tensor_twice_naming_both_paths():
    # In place, both leaves' updates would land on the one tensor (the pure and compiled
    # updates write one of them): refused before anything is written.
    w = torch.ones(3)
    params = {"embed": w, "head": w}
    opt = ps.adamw(0.1)
    state = opt.init(params)
    for compile in (False, True):
        update = ps.make_update(opt, compile=compile, donate=True)
        with pytest.raises(ValueError, match="params 'embed' and 'head' are the same tensor"):
            update(params, {"embed": torch.ones(3), "head": torch.ones(3)}, state)
    assert torch.equal(w, torch.ones(3))


def test_explain_names_the_path_each_update_took():
    params = {"w": torch.ones(4, 3), "b": torch.zeros(3)}
    grads = {"w": torch.ones(4, 3), "b": torch.ones(3)}
    opt = ps.adamw(0.1)
    assert ps.make_update(opt).explain().startswith("pure")
    eager = ps.make_update(opt, donate=True)
    assert eager.explain().startswith("not chosen yet")
    eager(clone(params), grads, opt.init(params))
    assert eager.explain().startswith("eager in place")
    per_leaf = ps.make_update(opt, compile=True, donate=True, flat=False)
    per_leaf(clone(params), grads, opt.init(params))
    assert per_leaf.explain() == "per-leaf compiled: flat=False" and per_leaf.layout() is None


@pytest.mark.parametrize("path", ["pure", "eager in place", "flat", "per-leaf compiled"])
def test_make_update_returns_grad_norm_lr_and_skipped_metrics_on_every_path(path):
    torch._dynamo.reset()
    g = torch.Generator().manual_seed(0)
    params = {
        "w": torch.randn(4, 3, generator=g),
        "v": torch.randn(4, 3, generator=g),
        "b": torch.randn(3, generator=g),
    }
    sched = lambda t: 0.1 / (1.0 + t)  # noqa: E731
    opt = ps.apply_if_finite(ps.chain(ps.clip_by_global_norm(1.0), ps.inject_hyperparams(ps.adamw)(lr=sched)))
    kw = {
        "pure": {},
        "eager in place": dict(donate=True),
        "flat": dict(compile=True, donate=True),
        "per-leaf compiled": dict(compile=True, donate=True, flat=False),
    }[path]
    update = ps.make_update(opt, metrics=True, **kw)
    plain = ps.make_update(opt)
    p, s = {k: v.clone() for k, v in params.items()}, opt.init(params)
    p_ref, s_ref = {k: v.clone() for k, v in params.items()}, opt.init(params)
    for step in range(4):
        grads = {k: 3 * torch.randn(v.shape, generator=g) for k, v in params.items()}
        if step == 2:
            grads["b"][0] = float("nan")
        out = update(p, {k: v.clone() for k, v in grads.items()}, s)
        assert len(out) == 3
        p, s, m = out
        p_ref, s_ref = plain(p_ref, grads, s_ref)
        assert sorted(m) == ["grad_norm", "lr", "skipped"]
        assert bool(m["skipped"]) == (step == 2)
        if step != 2:
            torch.testing.assert_close(m["grad_norm"], ps.tree_global_norm(grads), rtol=1e-5, atol=0)
        used = step if step < 2 else step - 1  # a skipped update leaves the state, its lr included, as it was
        torch.testing.assert_close(m["lr"], torch.tensor(sched(used), dtype=torch.float64))
    if path != "pure":
        assert update.explain().startswith(path), update.explain()
    for k in params:
        torch.testing.assert_close(p[k], p_ref[k], rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="metrics"):
        ps.make_update(opt, metrics=1)


def test_per_leaf_compiled_donated_update_stores_each_injected_schedule_value():
    torch._dynamo.reset()
    opt = ps.inject_hyperparams(ps.adamw)(lr=lambda t: 0.1 / (1.0 + t))
    params = {"w": torch.randn(4, 3)}
    update = ps.make_update(opt, compile=True, donate=True, flat=False)
    state = opt.init(params)
    for _ in range(2):
        params, state = update(params, {"w": torch.randn(4, 3)}, state)
    # inductor (2.13) dropped the copy into this 0-d float64 input: 0-d leaves are copied after the program
    assert float(state.hyperparams["lr"]) == pytest.approx(0.05)
    assert int(state.count) == 2


@pytest.mark.parametrize(
    "kw", [dict(), dict(donate=True), dict(compile=True, donate=True)], ids=["pure", "eager", "flat"]
)
def test_make_update_takes_torchs_amp_protocol_grad_scale_and_found_inf(kw):
    torch._dynamo.reset()
    g = torch.Generator().manual_seed(0)
    params = {"w": torch.randn(4, 3, generator=g), "b": torch.randn(3, generator=g)}
    opt = ps.chain(ps.clip_by_global_norm(1.0), ps.adamw(1e-2, weight_decay=0.1))
    update, plain = ps.make_update(opt, metrics=True, **kw), ps.make_update(opt)
    p, s = {k: v.clone() for k, v in params.items()}, opt.init(params)
    p_ref, s_ref = {k: v.clone() for k, v in params.items()}, opt.init(params)
    for step in range(4):
        grads = {k: torch.randn(v.shape, generator=g) for k, v in params.items()}
        scale, inf = torch.tensor(2.0 ** (step + 3)), torch.tensor(float(step == 2))
        p, s, m = update(p, {k: v * scale for k, v in grads.items()}, s, grad_scale=scale, found_inf=inf)
        assert bool(m["skipped"]) == (step == 2)
        if step != 2:
            p_ref, s_ref = plain(p_ref, grads, s_ref)
        for k in params:
            torch.testing.assert_close(p[k], p_ref[k], rtol=1e-6, atol=1e-7)
    assert int(ps.step_count(s)) == 3
    with pytest.raises(ValueError, match="grad_scale"):
        update(p, grads, s, grad_scale=2.0)


@pytest.mark.parametrize("path", ["pure", "eager in place", "flat", "per-leaf compiled"])
def test_make_update_hands_the_transforms_own_inputs_to_it_on_every_path(path):
    # Sophia's `hessian=` through make_update, shaped like the params (packed with the grads on flat buffers).
    torch._dynamo.reset()
    g = torch.Generator().manual_seed(0)
    params = {
        "w": torch.randn(4, 3, generator=g),
        "v": torch.randn(4, 3, generator=g),
        "b": torch.randn(3, generator=g),
    }
    opt = ps.sophia(lr=0.05, weight_decay=0.1, update_every=2)
    kw = {
        "pure": {},
        "eager in place": dict(donate=True),
        "flat": dict(compile=True, donate=True),
        "per-leaf compiled": dict(compile=True, donate=True, flat=False),
    }[path]
    update = ps.make_update(opt, **kw)
    p, s = {k: v.clone() for k, v in params.items()}, opt.init(params)
    p_ref, s_ref = {k: v.clone() for k, v in params.items()}, opt.init(params)
    for step in range(4):
        grads = {k: torch.randn(v.shape, generator=g) for k, v in params.items()}
        hessian = {k: torch.rand(v.shape, generator=g) for k, v in params.items()}
        p, s = update(p, {k: v.clone() for k, v in grads.items()}, s, hessian=hessian)
        u, s_ref = opt.update(grads, s_ref, p_ref, hessian=hessian)
        p_ref = ps.apply_updates(p_ref, u)
    if path != "pure":
        assert update.explain().startswith(path), update.explain()
    for k in params:
        torch.testing.assert_close(p[k], p_ref[k], rtol=1e-5, atol=1e-6)
    for a, b in zip(ps.tree_leaves(s), ps.tree_leaves(s_ref)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
