"""Flat buffers under make_update(compile=True, donate=True): same numbers as the pure
update, groups that follow the transform's per-leaf rules, re-pointed user trees, and
kernels that do not grow with the tensor count."""

from __future__ import annotations

import pytest
import torch
import torch.utils._pytree as pytree

import purestep.core as ps

from .test_step import assert_trees_close

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def _tree(n: int, seed: int, device: str = "cpu", dtype=torch.float64) -> dict:
    g = torch.Generator().manual_seed(seed)
    shapes = [(7, 5), (5,), (3, 4, 2), (7, 5), (1,)] * n
    return {
        (f"layers.{i}.w" if len(s) > 1 else f"layers.{i}.bias"): torch.randn(s, generator=g, dtype=dtype).to(device)
        for i, s in enumerate(shapes)
    }


def _run(opt, n_steps: int = 5, device: str = "cpu", dtype=torch.float64, ema=None, every=None):
    """The compiled flat update against the eager pure one, step by step."""
    p_ref, p = _tree(2, 0, device, dtype), _tree(2, 0, device, dtype)
    s_ref, s = opt.init(p_ref), opt.init(p)
    e_ref, e = (ema.init(p_ref), ema.init(p)) if ema else ((), ())
    e_ref, e = (e_ref,) if ema else (), (e,) if ema else ()
    ref = ps.make_update(opt, ema=ema)
    fast = ps.make_update(opt, ema=ema, compile=True, donate=True)
    for k in range(n_steps):
        grads = _tree(2, 10 + k, device, dtype)
        if every is not None:
            s, s_ref = every(k, s), every(k, s_ref)
        out = ref(p_ref, grads, s_ref, *e_ref)
        p_ref, s_ref, e_ref = out[0], out[1], tuple(out[2:])
        out = fast(p, _tree(2, 10 + k, device, dtype), s, *e)
        assert out[0] is p and out[1] is s
    return (p, s, e), (p_ref, s_ref, e_ref), fast


@pytest.mark.parametrize(
    "name, opt",
    [
        ("adamw+decay_mask", ps.adamw(1e-2, weight_decay=0.1, mask=ps.decay_mask)),
        ("clip+injected schedule", ps.chain(
            ps.clip_by_global_norm(0.5),
            ps.inject_hyperparams(ps.adamw)(lr=ps.warmup_cosine_schedule(1e-2, 2, 10), weight_decay=0.1),
        )),
        ("lamb (per-leaf norms)", ps.lamb(1e-2, weight_decay=0.01)),
        ("llrd", ps.chain(ps.scale_by_adam(), ps.scale_per_leaf(lambda g: ps.layerwise_lr_decay(g, 0.5)), ps.scale_by_lr(1e-2))),
        ("partition", ps.partition({"a": ps.sgd(0.1, momentum=0.9), "b": ps.lion(1e-3)},
                                   lambda p: {k: "a" if k.endswith("bias") else "b" for k in p})),
    ],
)
def test_flat_update_matches_the_pure_update(name, opt):
    got, want, fast = _run(opt)
    assert_trees_close(got, want, rtol=1e-10, atol=1e-12)
    assert fast.layout() is not None, f"{name}: fell back to the per-leaf path"


def test_groups_follow_masks_and_per_leaf_math():
    _, _, fast = _run(ps.adamw(1e-2, weight_decay=0.1, mask=ps.decay_mask), n_steps=1)
    groups = sorted(sorted(v) for v in fast.layout().values())
    # decayed matrices in one buffer, biases and other non-decayed leaves in another
    assert len(groups) == 2
    assert all(all(p.endswith(".w") for p in g) or all(not p.endswith(".w") or "." not in p for p in g) for g in groups)
    _, _, fast = _run(ps.lamb(1e-2), n_steps=1)
    shapes = {k: {tuple(_tree(2, 0)[p].shape) for p in v} for k, v in fast.layout().items()}
    assert all(len(v) == 1 for v in shapes.values()), f"trust ratios need same-shape stacks: {shapes}"


def test_a_transform_that_declares_nothing_runs_leaf_by_leaf_and_says_so_before_the_first_call():
    from purestep.core.engine import needs, packed

    def normalize() -> ps.Transform:  # a user's transform: one norm per leaf, nothing declared
        return ps.Transform(lambda p: (), lambda g, s, p=None, **e: (ps.tree_map(lambda x: x / x.norm(), g), s))

    params = _tree(2, 0)
    with pytest.raises(packed.NotPacked, match="declares no needs"):
        needs.plan(ps.chain(normalize(), ps.sgd(0.1)), params)
    opt = ps.chain(normalize(), ps.sgd(0.1))
    update = ps.make_update(opt, compile=True, donate=True)
    assert update.explain(params).startswith("per-leaf compiled: not on flat buffers: 'normalize' declares no needs")
    p, state = {k: v.clone() for k, v in params.items()}, opt.init(params)
    grads = _tree(2, 1)
    want = {k: v - 0.1 * grads[k] / grads[k].norm() for k, v in params.items()}
    update(p, grads, state)
    assert_trees_close(p, want, rtol=1e-6, atol=1e-7)  # each leaf by its own norm
    # Declared elementwise (nothing per leaf), the same transform packs into one buffer.
    scale = ps.with_needs(ps.Transform(lambda p: (), lambda g, s, p=None, **e: (ps.tree_map(lambda x: 2 * x, g), s)), ps.Needs())
    assert len(needs.plan(ps.chain(scale, ps.clip_by_global_norm(1.0), ps.sgd(0.1)), params).groups) == 1
    # Declared per-leaf math: each leaf or same-shape stack a buffer of its own, and the result is right.
    declared = ps.with_needs(normalize(), ps.Needs(whole_leaves=True, stacks=False))
    spec = needs.plan(ps.chain(declared, ps.sgd(0.1)), params)
    assert len(spec.groups) == len(params)
    opt = ps.chain(declared, ps.sgd(0.1))
    update = ps.make_update(opt, compile=True, donate=True)
    p, state = {k: v.clone() for k, v in params.items()}, opt.init(params)
    update(p, grads, state)
    assert update.explain().startswith("flat"), update.explain()
    assert_trees_close(p, want, rtol=1e-6, atol=1e-7)


def test_a_declaration_that_leaves_out_a_rule_or_per_leaf_math_is_an_error_not_a_silent_mix():
    from purestep.core.engine import needs, ops

    def per_leaf_norms() -> ps.Transform:  # uses the protocol's leaf norms but declares elementwise
        def update(g, s, p=None, **e):
            norms = ops.leaf_norms(g, ps.tree_leaves(g))
            return ps.tree_unflatten([x / n for x, n in zip(ps.tree_leaves(g), norms)], ps.tree_flatten(g)[1]), s

        return ps.with_needs(ps.Transform(lambda p: (), update), ps.Needs())

    params = _tree(2, 0)
    opt = ps.chain(per_leaf_norms(), ps.sgd(0.1))
    assert len(needs.plan(opt, params).groups) == 1  # what it declared
    update = ps.make_update(opt, compile=True, donate=True)
    with pytest.raises(Exception, match="needs whole leaves"):
        update({k: v.clone() for k, v in params.items()}, _tree(2, 1), opt.init(params))


def test_state_leaves_alias_the_buffers_and_new_state_trees_are_taken_in():
    opt = ps.inject_hyperparams(ps.adamw)(lr=1e-2)
    (p, s, _), (p_ref, s_ref, _), fast = _run(opt, n_steps=2, every=lambda k, st: ps.set_hyperparam(st, "lr", 0.05) if k == 1 else st)
    assert_trees_close((p, s), (p_ref, s_ref), rtol=1e-10, atol=1e-12)
    # The per-leaf moments the user holds are views of one buffer: writing through the
    # buffer shows in them (they are what checkpoints read).
    mu = ps.tree_get(s, "mu")
    ptrs = sorted(t.data_ptr() for k, t in mu.items() if k.endswith(".w"))
    assert len({t.untyped_storage().data_ptr() for k, t in mu.items() if k.endswith(".w")}) == 1, ptrs


def test_a_replaced_param_is_taken_in_on_the_next_call():
    opt = ps.sgd(0.5)
    params = {"w": torch.ones(3), "b": torch.ones(2)}
    state = opt.init(params)
    update = ps.make_update(opt, compile=True, donate=True)
    update(params, {"w": torch.ones(3), "b": torch.ones(2)}, state)
    params["w"] = torch.full((3,), 10.0)  # a new tensor under the same name
    update(params, {"w": torch.ones(3), "b": torch.ones(2)}, state)
    assert torch.equal(params["w"], torch.full((3,), 9.5)) and torch.equal(params["b"], torch.zeros(2))


def test_grads_from_backward_land_in_the_flat_buffer_without_a_copy():
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    params = dict(model.named_parameters())
    opt = ps.sgd(0.1)
    state = opt.init(params)
    update = ps.make_update(opt, compile=True, donate=True)
    x = torch.randn(8, 4)
    model(x).square().sum().backward()
    update(params, {k: p.grad for k, p in params.items()}, state)
    ptrs = [p.grad.data_ptr() for p in params.values()]
    model.zero_grad(set_to_none=False)
    model(x).square().sum().backward()
    assert [p.grad.data_ptr() for p in params.values()] == ptrs  # backward wrote into the buffer views
    before = {k: p.detach().clone() for k, p in params.items()}
    grads = {k: p.grad.clone() for k, p in params.items()}
    update(params, {k: p.grad for k, p in params.items()}, state)
    for k, p in params.items():
        torch.testing.assert_close(p.detach(), before[k] - 0.1 * grads[k])


def test_functional_model_module_follows_the_flat_params():
    net = torch.nn.Linear(3, 2)
    apply_fn, params, _ = ps.functional_model(net)
    opt = ps.sgd(1.0)
    state = opt.init(params)
    update = ps.make_update(opt, compile=True, donate=True)
    update(params, {k: torch.ones_like(v) for k, v in params.items()}, state)
    update(params, {k: torch.ones_like(v) for k, v in params.items()}, state)
    for name, p in net.named_parameters():
        assert torch.equal(p.detach(), params[name]), name


def test_kernels_and_graph_do_not_grow_with_the_tensor_count():
    from torch._inductor.utils import run_and_get_code

    def code_for(n: int) -> str:
        torch._dynamo.reset()
        params = {f"l{i}.weight": torch.randn(64, 32) for i in range(n)} | {f"l{i}.bias": torch.randn(32) for i in range(n)}
        opt = ps.chain(ps.clip_by_global_norm(1.0), ps.adamw(1e-3, weight_decay=0.1, mask=ps.decay_mask))
        state = opt.init(params)
        update = ps.make_update(opt, compile=True, donate=True)
        grads = {k: torch.randn_like(v) for k, v in params.items()}
        _, code = run_and_get_code(lambda: update(params, grads, state))
        assert len(update.layout()) == 2
        return "\n".join(code)

    def kernels(code: str) -> int:
        return code.count("async_compile.cpp") + code.count("async_compile.triton(")

    small, large = code_for(3), code_for(30)
    # 60 tensors compile to the kernels of 6: two buffers either way.
    assert 0 < kernels(large) == kernels(small) <= 4, (kernels(small), kernels(large))


def test_per_step_scalars_leave_the_elementwise_loop():
    # Injected hyperparameters are float64 0-d tensors and the bias corrections need a pow:
    # inlined, every vector of the 12345-element loop would convert them and redo `1 - β`,
    # `1 / bc` (AdamW ~5% slower than torch's fused step on CPU). `ps.once` and the
    # coefficients of `_foreach` compute them before the loop; nothing is called per step
    # but the one kernel.
    from torch._inductor.utils import run_and_get_code

    torch._dynamo.reset()
    params = {"w": torch.randn(12345), "v": torch.randn(12345)}
    opt = ps.chain(ps.clip_by_global_norm(1.0), ps.inject_hyperparams(ps.adamw)(1e-3, weight_decay=0.1))
    state = opt.init(params)
    update = ps.make_update(opt, compile=True, donate=True)
    grads = {k: torch.randn_like(v) for k, v in params.items()}
    _, code = run_and_get_code(lambda: update(params, grads, state))
    code = "\n".join(code)
    loops = code.split("for(int64_t x0=")
    main = [body for body in loops if body.split(";")[1].strip().endswith("<static_cast<int64_t>(24690L)")]
    assert main, "no loop over the 24690 elements"
    for body in main:
        elementwise = body.split("#pragma omp single")[0]
        for scalar_math in ("std::pow", "c10::convert<float>", "double"):
            assert scalar_math not in elementwise, scalar_math
    assert "torch.ops.purestep" not in code


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_graph_replay_matches_and_follows_hyperparameter_changes():
    opt = ps.chain(ps.clip_by_global_norm(0.5), ps.inject_hyperparams(ps.adamw)(lr=1e-2, weight_decay=0.1))
    got, want, fast = _run(
        opt, n_steps=6, device="cuda", dtype=torch.float32, ema=ps.params_ema(0.9),
        every=lambda k, st: ps.set_hyperparam(st, "lr", 0.03) if k == 4 else st,
    )
    assert_trees_close(got, want, rtol=1e-5, atol=1e-6)


def test_transforms_with_per_group_state_keep_the_per_leaf_path():
    # A state entry that is not shaped like the params cannot be viewed per leaf.
    def init(params):
        return {"norms": pytree.tree_map(lambda p: torch.zeros(()), params)}

    def update(grads, state, params=None, **extra):
        return grads, {"norms": pytree.tree_map(lambda g: g.norm(), grads)}

    opt = ps.chain(ps.Transform(init, update), ps.sgd(0.1))
    params = {"w": torch.ones(3), "v": torch.ones(2)}
    update_fn = ps.make_update(opt, compile=True, donate=True)
    update_fn(params, {"w": torch.ones(3), "v": torch.ones(2)}, opt.init(params))
    assert update_fn.layout() is None
    assert torch.allclose(params["w"], torch.full((3,), 0.9))


@pytest.mark.parametrize("device", DEVICES)
def test_flat_make_step_matches_the_pure_step(device):
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3)).to(device)
    apply_fn, params, buffers = ps.functional_model(net)

    def loss_fn(p, batch):
        x, y = batch
        return ((apply_fn(p, buffers, x)[0] - y) ** 2).mean()

    opt = ps.chain(ps.clip_by_global_norm(1.0), ps.inject_hyperparams(ps.adamw)(lr=1e-2, weight_decay=0.1, mask=ps.decay_mask))
    ref_params = {k: v.clone() for k, v in params.items()}
    ref_state, state = opt.init(ref_params), opt.init(params)
    ref = ps.make_step(loss_fn, opt)
    fast = ps.make_step(loss_fn, opt, compile=True, donate=True)
    for k in range(5):
        batch = (torch.randn(16, 6, device=device), torch.randn(16, 3, device=device))
        ref_params, ref_state, ref_m = ref(ref_params, ref_state, batch)
        out_params, state, m = fast(params, state, batch)
        assert out_params is params
        torch.testing.assert_close(m["loss"], ref_m["loss"], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(m["grad_norm"], ref_m["grad_norm"], rtol=1e-5, atol=1e-6)
    assert fast.layout() is not None and len(fast.layout()) == 2
    assert_trees_close((params, state), (ref_params, ref_state), rtol=1e-4, atol=1e-5)
    for name, p in net.named_parameters():  # the module follows its flat params
        assert torch.equal(p.detach(), params[name])


def _transformer(layers: int, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    shapes = {"wte.weight": (11, 8), "ln_f.weight": (8,)}
    for i in range(layers):
        shapes |= {f"h.{i}.attn.w": (8, 24), f"h.{i}.proj.w": (8, 8), f"h.{i}.mlp.w": (32, 8), f"h.{i}.ln.weight": (8,)}
    return {k: torch.randn(s, generator=g, dtype=torch.float64) for k, s in shapes.items()}


def test_muon_takes_same_shape_matrices_as_one_stack():
    from purestep.core.engine import needs

    muon = ps.muon_adamw(lr=0.02, ns_dtype=torch.float64)
    for layers in (2, 6):  # the groups follow the shapes, not the matrix count
        spec = needs.plan(muon, _transformer(layers, 0))
        stacks = sorted(tuple(g.shape) for g in spec.groups if g.is_stack)
        assert stacks == [(layers, 8, 8), (layers, 8, 24), (layers, 32, 8)], stacks
        assert len(spec.groups) == 4  # the three stacks and one AdamW buffer

    # Per-leaf math that does not batch splits the stacks into lone matrices.
    def per_leaf() -> ps.Transform:
        return ps.with_needs(ps.Transform(lambda p: (), lambda g, s, p=None, **e: (g, s)), ps.Needs(whole_leaves=True, stacks=False))

    matrices = {k: v for k, v in _transformer(2, 0).items() if v.dim() == 2}
    spec = needs.plan(ps.chain(ps.scale_by_muon(ns_dtype=torch.float64), per_leaf()), matrices)
    assert len(spec.groups) == len(matrices) and not any(g.is_stack for g in spec.groups)


@pytest.mark.parametrize("device", DEVICES)
def test_flat_muon_on_stacks_matches_the_per_leaf_update(device):
    # float64 on the CPU (tight), float32 on CUDA, where the graph is also replayed.
    dtype, tol = (torch.float64, 1e-10) if device == "cpu" else (torch.float32, 1e-4)
    tree = lambda seed: {k: v.to(device, dtype) for k, v in _transformer(3, seed).items()}  # noqa: E731
    opt = ps.muon_adamw(lr=0.02, weight_decay=0.1, ns_dtype=dtype)
    p_ref, p = tree(0), tree(0)
    s_ref, s = opt.init(p_ref), opt.init(p)
    ref, fast = ps.make_update(opt), ps.make_update(opt, compile=True, donate=True)
    for k in range(4):
        p_ref, s_ref = ref(p_ref, tree(10 + k), s_ref)[:2]
        fast(p, tree(10 + k), s)
    assert_trees_close((p, s), (p_ref, s_ref), rtol=tol, atol=tol)
    assert sorted(len(v) for v in fast.layout().values()) == [3, 3, 3, 5]


def test_fourth_release_families_run_compiled_on_flat_buffers_equal_to_eager_without_recompiles():
    """ADOPT, Prodigy (tree-wide sums), MARS (a norm per leaf: same-shape leaves stacked),
    LaProp and AdamC in one compiled, donated update, hyperparameters injected and changed."""
    torch._dynamo.reset()
    g = torch.Generator().manual_seed(0)
    shapes = {"w1": (8, 8), "w2": (8, 8), "b": (8,)}
    names = ("adopt", "prodigy", "mars", "laprop", "adamc")
    params = {f"{n}.{k}": torch.randn(s, generator=g) for n in names for k, s in shapes.items()}
    lr = lambda t: 1e-2 * torch.clamp((t + 1) / 3, max=1.0)  # noqa: E731
    inner = {
        "adopt": ps.inject_hyperparams(ps.adopt)(lr=lr, weight_decay=0.1),
        "prodigy": ps.inject_hyperparams(ps.prodigy)(lr=1.0, d0=1e-3, weight_decay=0.1),
        "mars": ps.inject_hyperparams(ps.mars)(lr=lr, gamma=0.05, weight_decay=0.1),
        "laprop": ps.inject_hyperparams(ps.laprop)(lr=lr, weight_decay=0.1),
        "adamc": ps.inject_hyperparams(ps.adamc)(lr=lr, weight_decay=0.1),
    }
    opt = ps.partition(inner, lambda p: {k: k.split(".")[0] for k in p})
    compiled, eager = ps.make_update(opt, compile=True, donate=True), ps.make_update(opt)
    p, s = {k: v.clone() for k, v in params.items()}, opt.init(params)
    p_ref, s_ref = {k: v.clone() for k, v in params.items()}, opt.init(params)
    for i in range(4):
        grads = {k: torch.randn(v.shape, generator=g) for k, v in params.items()}
        if i == 2:
            s, s_ref = ps.set_hyperparam(s, "gamma", 0.1), ps.set_hyperparam(s_ref, "gamma", 0.1)
        with torch.compiler.set_stance("fail_on_recompile" if i else "default"):
            compiled(p, grads, s)
        p_ref, s_ref = eager(p_ref, grads, s_ref)
    assert compiled.explain().startswith("flat"), compiled.explain()
    assert len(compiled.layout()) < len(params)  # leaves packed together
    for k in params:
        torch.testing.assert_close(p[k], p_ref[k], rtol=1e-5, atol=1e-6, msg=k)
    torch.testing.assert_close(ps.tree_get(s, "estim_lr"), ps.tree_get(s_ref, "estim_lr"), rtol=1e-5, atol=0)


def test_declarations_follow_what_runs_injected_zero_decay_masks_schedule_free_bases_and_placeholder_state():
    """Found in review: the planner reads the declarations of the transform that runs."""
    torch._dynamo.reset()
    from purestep.core.engine import needs

    params = _tree(1, 0, dtype=torch.float32)
    # inject_hyperparams: a float 0.0 decay builds no masked decay, the injected tensor one does.
    injected = ps.inject_hyperparams(ps.adamw)(lr=1e-2, weight_decay=0.0, mask=ps.decay_mask)
    # schedule_free over a base with a masked decay: the base's rule is read too.
    sf = ps.schedule_free(ps.chain(ps.scale_by_adam(0.0), ps.add_decayed_weights(0.1, mask=ps.decay_mask),
                                   ps.scale_by_lr(0.1)), lr=0.1)
    for opt in (injected, sf):
        assert len(needs.plan(opt, params).groups) == 2  # decayed and not
        got, want, fast = _run(opt, n_steps=2, dtype=torch.float32)
        assert_trees_close(got, want, rtol=1e-5, atol=1e-6)
        assert fast.layout() is not None
    # compensated_updates without Kahan keeps (0,) placeholders: declared per leaf.
    bf16 = {k: v.to(torch.bfloat16) for k, v in params.items()}
    stochastic = ps.chain(ps.sgd(0.1), ps.compensated_updates(method="stochastic"))
    with pytest.raises(Exception, match="placeholder"):
        needs.plan(stochastic, bf16)
    update = ps.make_update(stochastic, compile=True, donate=True)
    update({k: v.clone() for k, v in bf16.items()}, {k: torch.ones_like(v) for k, v in bf16.items()}, stochastic.init(bf16))
    assert update.explain().startswith("per-leaf compiled"), update.explain()
