"""Combinators: chain, masked, partition, inject_hyperparams, apply_if_finite, accumulate."""

from __future__ import annotations

import pytest
import torch
import torch.utils._pytree as pytree

import purestep.core as ps


def make_params(dtype=torch.float64):
    g = torch.Generator().manual_seed(0)
    return {
        "embed.weight": torch.randn(6, 4, generator=g, dtype=dtype),
        "layers.0.weight": torch.randn(4, 4, generator=g, dtype=dtype),
        "layers.0.bias": torch.randn(4, generator=g, dtype=dtype),
        "conv.weight": torch.randn(2, 3, 2, 2, generator=g, dtype=dtype),
    }


def grads_like(params, seed, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return {k: scale * torch.randn(v.shape, generator=g, dtype=v.dtype) for k, v in params.items()}


def run(opt, params, grads_list):
    state = opt.init(params)
    outs = []
    for grads in grads_list:
        updates, state = opt.update(grads, state, params)
        params = ps.apply_updates(params, updates)
        outs.append(updates)
    return params, state, outs


def assert_trees_equal(a, b):
    la, sa = pytree.tree_flatten(a)
    lb, sb = pytree.tree_flatten(b)
    assert sa == sb
    for x, y in zip(la, lb):
        assert torch.equal(x, y)


def test_chain_with_identity_equals_the_transform_bitwise():
    params = make_params()
    grads = [grads_like(params, i) for i in range(5)]
    p1, s1, u1 = run(ps.adamw(1e-2), params, grads)
    p2, s2, u2 = run(ps.chain(ps.identity(), ps.adamw(1e-2)), params, grads)
    assert_trees_equal(p1, p2)
    assert_trees_equal(s1, s2[1])
    assert_trees_equal(u1, u2)


@pytest.mark.parametrize("hyper", [float, torch.tensor], ids=["floats", "tensors"])
@pytest.mark.parametrize("first", ["identity", "trace", "scale_by_adam"])
def test_chain_writes_in_place_only_into_updates_it_owns(first, hyper):
    # add_decayed_weights and scale_by_lr write into updates the chain owns: fresh tensors
    # from the transform before. Grads passed through (identity) and a momentum buffer that
    # is both the update and the new state (trace) are not its own. Either way the chain
    # mutates none of its inputs and equals its pieces applied one by one (pure): bitwise
    # with float hyperparameters, to rounding with 0-d tensors (u + λ·p is one addcmul_ in
    # place, a multiply and an add out of place).
    wd, lr = hyper(0.1), hyper(0.5)
    pieces = [getattr(ps, first)(*([0.9] if first == "trace" else [])), ps.add_decayed_weights(wd), ps.scale_by_lr(lr)]
    opt = ps.chain(*pieces)
    params = make_params()
    state = opt.init(params)
    for i in range(3):
        grads = grads_like(params, i)
        inputs = pytree.tree_map(torch.clone, (grads, state, params))
        updates, new_state = opt.update(grads, state, params)
        assert_trees_equal((grads, state, params), inputs)
        expected, expected_state = grads, []
        for t, s in zip(pieces, state):
            expected, s = t.update(expected, s, params)
            expected_state.append(s)
        if hyper is float:
            assert_trees_equal((updates, new_state), (expected, tuple(expected_state)))
        else:
            for x, y in zip(pytree.tree_leaves((updates, new_state)), pytree.tree_leaves((expected, expected_state))):
                torch.testing.assert_close(x, y, rtol=1e-15, atol=1e-17)
        state = new_state


def test_chain_state_is_a_tuple_of_states():
    params = make_params()
    state = ps.chain(ps.scale_by_adam(), ps.scale_by_lr(0.1)).init(params)
    assert isinstance(state, tuple) and isinstance(state[0], ps.ScaleByAdamState)
    assert isinstance(state[1], ps.EmptyState)


def test_masked_passes_masked_out_leaves_through_unchanged():
    params = make_params()
    mask = {k: k.endswith("weight") for k in params}
    opt = ps.masked(ps.chain(ps.scale_by_adam(), ps.scale_by_lr(0.1)), mask)
    state = opt.init(params)
    grads = grads_like(params, 3)
    updates, state = opt.update(grads, state, params)
    assert updates["layers.0.bias"] is grads["layers.0.bias"]
    assert not torch.equal(updates["layers.0.weight"], grads["layers.0.weight"])
    # The masked-in leaves equal the inner transform run on those leaves alone.
    sub = {k: v for k, v in params.items() if mask[k]}
    inner = ps.chain(ps.scale_by_adam(), ps.scale_by_lr(0.1))
    ref, _ = inner.update({k: grads[k] for k in sub}, inner.init(sub), sub)
    for k in sub:
        assert torch.equal(updates[k], ref[k])
    # Masked-out leaves hold no inner state.
    assert set(ps.tree_get(state, "mu")) == set(sub)


def test_masked_accepts_a_callable_mask_and_rejects_a_mismatched_one():
    params = make_params()
    opt = ps.masked(ps.scale(0.0), lambda p: {k: v.dim() > 1 for k, v in p.items()})
    updates, _ = opt.update(params, opt.init(params), params)
    assert torch.equal(updates["layers.0.bias"], params["layers.0.bias"])
    assert torch.equal(updates["layers.0.weight"], torch.zeros_like(params["layers.0.weight"]))
    with pytest.raises(ValueError, match="mask"):
        ps.masked(ps.scale(0.0), {"embed.weight": True}).init(params)
    with pytest.raises(ValueError, match="layers.0.bias"):
        ps.masked(ps.scale(0.0), {k: "yes" if "bias" in k else True for k in params}).init(params)


def test_partition_equals_each_transform_on_its_own_part():
    params = make_params()
    labels = {k: "adamw" if v.dim() >= 2 else "sgd" for k, v in params.items()}
    transforms = {"adamw": ps.adamw(1e-2, weight_decay=0.1), "sgd": ps.sgd(0.1, momentum=0.9)}
    grads = [grads_like(params, i) for i in range(6)]
    p_all, state, _ = run(ps.partition(transforms, labels), params, grads)
    for name, t in transforms.items():
        part = {k: v for k, v in params.items() if labels[k] == name}
        p_part, s_part, _ = run(t, part, [{k: g[k] for k in part} for g in grads])
        for k in part:
            assert torch.equal(p_all[k], p_part[k]), k
        assert_trees_equal(state.inner_states[name], s_part)


def test_partition_rejects_unknown_labels_naming_the_leaf():
    params = make_params()
    labels = {k: "muon" if k == "conv.weight" else "adamw" for k in params}
    with pytest.raises(ValueError, match="conv.weight.*muon"):
        ps.partition({"adamw": ps.adamw(1e-3)}, labels).init(params)


def test_inject_hyperparams_equals_the_plain_transform():
    params = make_params()
    grads = [grads_like(params, i) for i in range(8)]
    schedule = lambda t: 1e-2 / (1.0 + t)  # noqa: E731
    p1, _, _ = run(ps.adamw(schedule, betas=(0.8, 0.95), weight_decay=0.1), params, grads)
    p2, state, _ = run(ps.inject_hyperparams(ps.adamw)(schedule, betas=(0.8, 0.95), weight_decay=0.1), params, grads)
    for k in params:
        torch.testing.assert_close(p1[k], p2[k], rtol=1e-12, atol=0)
    hp = state.hyperparams
    assert hp["lr"].dtype == torch.float64 and hp["lr"].dim() == 0
    torch.testing.assert_close(hp["lr"], torch.tensor(1e-2 / 8, dtype=torch.float64))
    assert isinstance(hp["betas"], tuple) and hp["betas"][0].item() == pytest.approx(0.8)
    assert "mask" not in hp


def test_set_hyperparam_lr_zero_gives_zero_updates():
    params = make_params()
    opt = ps.inject_hyperparams(ps.adamw)(lr=1e-2)
    state = opt.init(params)
    _, state = opt.update(grads_like(params, 0), state, params)
    state = ps.set_hyperparam(state, "lr", 0.0)
    updates, state = opt.update(grads_like(params, 1), state, params)
    for u in updates.values():
        assert torch.count_nonzero(u) == 0
    assert ps.tree_get(state, "hyperparams")["lr"].item() == 0.0
    state = ps.set_hyperparam(state, "betas", (0.5, 0.9))
    assert ps.tree_get(state, "hyperparams")["betas"][0].item() == 0.5


def test_set_hyperparam_unknown_name_lists_the_injected_ones():
    params = make_params()
    state = ps.inject_hyperparams(ps.sgd)(lr=0.1, momentum=0.9).init(params)
    with pytest.raises(KeyError, match="momentum"):
        ps.set_hyperparam(state, "eps", 1e-3)
    with pytest.raises(KeyError, match="inject_hyperparams"):
        ps.set_hyperparam(ps.sgd(0.1).init(params), "lr", 0.2)


def test_apply_if_finite_skips_a_nan_step_as_if_it_never_came():
    params = make_params()
    good = [grads_like(params, i) for i in range(6)]
    bad = dict(good[0])
    bad["layers.0.bias"] = bad["layers.0.bias"].clone()
    bad["layers.0.bias"][1] = float("nan")
    opt = ps.apply_if_finite(ps.adamw(1e-2))
    p_ref, s_ref, _ = run(opt, params, good)
    p_skip, s_skip, outs = run(opt, params, good[:3] + [bad] + good[3:])
    assert_trees_equal(p_ref, p_skip)
    assert_trees_equal(s_ref.inner_state, s_skip.inner_state)
    assert all(torch.count_nonzero(u) == 0 for u in outs[3].values())
    assert int(s_skip.total_notfinite) == 1 and int(s_skip.notfinite_count) == 0
    assert bool(s_skip.last_finite)


def test_apply_if_finite_skips_a_finite_grad_that_overflows_the_state():
    # g = 1e30 is finite, but Adam's float32 second moment (1-β₂)·g² = 1e57 is not: without the
    # state check every later update would be 0 (m / √inf) and the inf would be checkpointed.
    params = make_params(torch.float32)
    good = [grads_like(params, i) for i in range(5)]
    huge = {k: torch.full_like(v, 1e30) for k, v in params.items()}
    opt = ps.apply_if_finite(ps.adam(1e-2))
    p_ref, s_ref, _ = run(opt, params, good)
    p_skip, s_skip, outs = run(opt, params, good[:2] + [huge] + good[2:])
    assert all(torch.count_nonzero(u) == 0 for u in outs[2].values())
    assert all(bool(torch.isfinite(x).all()) for x in pytree.tree_leaves(s_skip))
    assert_trees_equal(p_ref, p_skip)
    assert_trees_equal(s_ref.inner_state, s_skip.inner_state)
    assert int(s_skip.total_notfinite) == 1 and int(ps.step_count(s_skip)) == 5
    assert all(torch.count_nonzero(u) > 0 for u in outs[-1].values())


def test_bounded_declarations_say_which_states_the_grads_bound():
    """`Needs(bounded=True)`: the new state is finite when the grads and their squares are.
    Declared by Adam/Lion/SGD moments, clipping, decay and schedules, and by the combinators
    over those; not by a state in float16, a statistic over the tree, or an undeclared one."""
    assert ps.needs_of(ps.chain(ps.clip_by_global_norm(1.0), ps.adamw(1e-3, weight_decay=0.1))).bounded
    assert ps.needs_of(ps.inject_hyperparams(ps.adamw)(lr=1e-3)).bounded
    assert ps.needs_of(ps.masked(ps.lion(1e-3), lambda path, leaf: leaf.ndim > 1)).bounded
    assert ps.needs_of(ps.apply_if_finite(ps.sgd(0.1, momentum=0.9))).bounded
    assert not ps.needs_of(ps.prodigy()).bounded
    assert not ps.needs_of(ps.chain(ps.clip_by_global_norm(1.0), ps.prodigy())).bounded
    assert not ps.needs_of(ps.scale_by_adam(mu_dtype=torch.float16)).bounded
    mine = ps.Transform(lambda p: (), lambda g, s, p=None, **e: (g, s))
    assert not ps.needs_of(ps.chain(ps.adam(1e-3), ps.with_needs(mine, ps.Needs()))).bounded


@pytest.mark.parametrize("compiled", [False, True])
def test_apply_if_finite_over_a_bounded_transform_checks_the_grads_alone(compiled):
    """Over a bounded inner transform the grads decide, from their global norm (the clip's):
    NaN, inf, 1e30 and grads whose squares sum past float32's range are skipped, large
    finite ones applied; the same steps and values as checking every float of the new
    state (an undeclared twin of the inner transform gets that check), eager and compiled."""
    params = make_params(torch.float32)
    n = sum(x.numel() for x in params.values())
    good = [grads_like(params, i) for i in range(4)]
    nan = {k: v.clone() for k, v in good[1].items()}
    nan["layers.0.bias"][0] = float("nan")
    inf = {k: v.clone() for k, v in good[2].items()}
    inf["embed.weight"][0, 0] = -float("inf")
    huge = {k: torch.full_like(v, 1e30) for k, v in params.items()}
    over = {k: torch.full_like(v, 1.5 * (torch.finfo(torch.float32).max / n) ** 0.5) for k, v in params.items()}
    large = {k: v * 1e6 for k, v in good[0].items()}
    seq = [good[0], nan, good[1], inf, huge, large, good[2], over, good[3]]
    skipped = [False, True, False, True, True, False, False, True, False]
    inner = ps.chain(ps.clip_by_global_norm(1.0), ps.adamw(1e-2, weight_decay=0.1))
    lean = ps.apply_if_finite(inner)
    undeclared = ps.Transform(inner.init, lambda g, s, p=None, **e: inner.update(g, s, p, **e))
    full = ps.apply_if_finite(undeclared)
    assert ps.needs_of(lean).bounded and not ps.needs_of(full).bounded
    outs = {}
    for name, opt in (("lean", lean), ("full", full)):
        p = {k: v.clone() for k, v in params.items()}
        state = opt.init(p)
        update = ps.make_update(opt, compile=compiled and name == "lean", donate=True)
        flags = []
        for g in seq:
            g = {k: v.clone() for k, v in g.items()}  # a compiled update re-points the grads it is given
            before = int(state.total_notfinite)
            p, state = update(p, g, state)[:2]
            flags.append(int(state.total_notfinite) > before)
        outs[name] = (p, state, flags)
    assert outs["lean"][2] == skipped, outs["lean"][2]
    assert outs["full"][2] == skipped, outs["full"][2]
    p_lean, s_lean = outs["lean"][0], outs["lean"][1]
    assert all(bool(torch.isfinite(x).all()) for x in pytree.tree_leaves(s_lean) if x.is_floating_point())
    assert int(ps.step_count(s_lean)) == skipped.count(False)
    for k in p_lean:
        torch.testing.assert_close(p_lean[k], outs["full"][0][k], rtol=1e-5, atol=1e-7)


def test_apply_if_finite_over_an_unbounded_transform_checks_the_new_state():
    """An inner transform that does not declare its state bounded gets the full check: finite
    grads that make its state overflow are skipped."""

    def init(params):
        return {k: torch.zeros_like(v) for k, v in params.items()}

    def update(grads, state, params=None, **extra):
        new = {k: s + g * 1e36 for (k, s), g in zip(state.items(), grads.values())}
        return grads, new

    blowup = ps.with_needs(ps.Transform(init, update), ps.Needs())
    opt = ps.apply_if_finite(blowup)
    params = {"w": torch.zeros(3)}
    state = opt.init(params)
    _, state = opt.update({"w": torch.full((3,), 1e3)}, state, params)
    assert int(state.total_notfinite) == 1
    assert bool(torch.isfinite(state.inner_state["w"]).all())


def test_skipped_updates_reads_the_outermost_apply_if_finite():
    params = {"w": torch.zeros(2), "b": torch.zeros(3)}
    nan = {"w": torch.full((2,), float("nan")), "b": torch.ones(3)}
    inner = ps.apply_if_finite(ps.adam(1e-3))
    opt = ps.diloco(ps.apply_if_finite(ps.chain(ps.clip_by_global_norm(1.0), inner)), ps.sgd(0.7), sync_every=2)
    state = opt.init(params)
    assert [bool(x) for x in ps.skipped_updates(state)] == [False, False]
    for grads, skipped, total in ((nan, True, 1), (nan, True, 2), ({k: torch.ones_like(v) for k, v in params.items()}, False, 2)):
        _, state = opt.update(grads, state, params)
        now, count = ps.skipped_updates(state)
        assert (bool(now), int(count)) == (skipped, total)
        assert now.dtype == torch.bool and count.dtype == torch.int64
    count.add_(5)  # a copy: the state's counter is not written through it
    assert int(ps.skipped_updates(state)[1]) == 2
    assert ps.skipped_updates(ps.adam(1e-3).init(params)) is None
    two = ps.partition({"a": ps.apply_if_finite(ps.sgd(0.1)), "b": ps.apply_if_finite(ps.sgd(0.1))}, {"w": "a", "b": "b"})
    assert ps.skipped_updates(two.init(params)) is None  # two at the same depth: no one answer
    _, _, m = ps.make_update(ps.apply_if_finite(two), metrics=True)(params, nan, ps.apply_if_finite(two).init(params))
    assert bool(m["skipped"])  # the outermost one's, beside inner ones


def test_apply_if_finite_applies_after_max_consecutive_failures():
    params = make_params()
    inf_grads = {k: torch.full_like(v, float("inf")) for k, v in params.items()}
    opt = ps.apply_if_finite(ps.sgd(0.1), max_consecutive=2)
    state = opt.init(params)
    for i in range(3):
        updates, state = opt.update(inf_grads, state, params)
        applied = not torch.equal(updates["embed.weight"], torch.zeros_like(updates["embed.weight"]))
        assert applied == (i == 2)
    assert int(state.notfinite_count) == 3


@pytest.mark.parametrize("every", [1, 3])
def test_accumulate_equals_the_transform_on_the_mean_of_every_k_grads(every):
    params = make_params()
    grads = [grads_like(params, i) for i in range(4 * every)]
    inner = ps.adamw(1e-2, weight_decay=0.1)
    state = ps.accumulate(inner, every=every).init(params)
    opt = ps.accumulate(inner, every=every)
    p_acc = params
    for i, g in enumerate(grads):
        updates, state = opt.update(g, state, p_acc)
        if (i + 1) % every:
            assert all(torch.count_nonzero(u) == 0 for u in updates.values())
        p_acc = ps.apply_updates(p_acc, updates)
    means = [{k: sum(g[k] for g in grads[j : j + every]) / every for k in params} for j in range(0, len(grads), every)]
    p_ref, s_ref, _ = run(inner, params, means)
    for k in params:
        torch.testing.assert_close(p_acc[k], p_ref[k], rtol=1e-12, atol=1e-14)
    assert int(ps.tree_get(state.inner_state, "count")) == 4


def test_accumulate_rejects_a_bad_every():
    with pytest.raises(ValueError, match="every"):
        ps.accumulate(ps.sgd(0.1), every=0)


def test_combinators_route_extra_keyword_trees_like_the_grads():
    seen = {}

    def init(params):
        return ps.EmptyState()

    def update(grads, state, params=None, *, curvature=None, **extra):
        seen["keys"] = sorted(curvature)
        return grads, state

    probe = ps.Transform(init, update)
    params = make_params()
    opt = ps.masked(probe, {k: "bias" in k for k in params})
    opt.update(params, opt.init(params), params, curvature=params, unknown_flag=True)
    assert seen["keys"] == ["layers.0.bias"]


def test_get_hyperparams_qualifies_only_ambiguous_names_and_set_hyperparam_takes_those_keys():
    opt = ps.partition(
        {"a": ps.inject_hyperparams(ps.adamw)(lr=1e-3), "b": ps.inject_hyperparams(ps.sgd)(lr=0.1)},
        {"w": "a", "b": "b"},
    )
    state = opt.init({"w": torch.zeros(2), "b": torch.zeros(1)})
    hp = ps.get_hyperparams(state)
    assert "betas" in hp and "momentum" in hp and "lr" not in hp
    assert float(hp["inner_states.a.lr"]) == 1e-3 and float(hp["inner_states.b.lr"]) == 0.1
    with pytest.raises(KeyError, match="ambiguous.*inner_states.a.lr"):
        ps.set_hyperparam(state, "lr", 1.0)
    state = ps.set_hyperparam(state, "inner_states.b.lr", 0.5)
    assert float(ps.get_hyperparams(state)["inner_states.b.lr"]) == 0.5
    assert float(ps.get_hyperparams(state)["inner_states.a.lr"]) == 1e-3


def test_apply_if_finite_skips_the_same_way_in_place_and_keeps_the_folded_decay():
    """Eagerly in place (donate=True, CPU) a skipped step is a zero update, as the pure one:
    a chain's decay after `apply_if_finite` still applies; float16 state (an accumulation
    buffer of fp16 params) takes the full check, so a finite norm past √65504 is applied;
    and the check runs under inference mode."""
    opt = ps.chain(ps.apply_if_finite(ps.sgd(1.0)), ps.add_decayed_weights(0.1), ps.scale_by_lr(0.5))
    nan = {"w": torch.tensor([float("nan"), 1.0, 1.0])}
    results = []
    for donate in (False, True):
        p = {"w": torch.ones(3)}
        s = opt.init(p)
        p, s = ps.make_update(opt, donate=donate)(p, {k: v.clone() for k, v in nan.items()}, s)[:2]
        results.append(p["w"])
    torch.testing.assert_close(results[0], torch.full((3,), 0.95))
    torch.testing.assert_close(results[1], results[0])
    fp16 = {"w": torch.zeros(1000, dtype=torch.float16)}
    acc = ps.apply_if_finite(ps.accumulate(ps.adam(1e-3), every=2))
    grads = {"w": torch.full((1000,), 10.0, dtype=torch.float16)}  # norm 316 > √65504, every g² finite
    for donate in (False, True):
        s = acc.init(fp16)
        s = ps.make_update(acc, donate=donate)({"w": fp16["w"].clone()}, grads, s)[1]
        assert int(s.total_notfinite) == 0
    with torch.inference_mode():
        clip = ps.chain(ps.clip_by_global_norm(1.0), ps.sgd(0.1))
        u, _ = clip.update({"w": torch.ones(3)}, clip.init({"w": torch.ones(3)}))
    torch.testing.assert_close(u["w"], torch.full((3,), -0.1 / 3**0.5))


def test_takes_parts_reads_the_declared_rules_of_every_part():
    params = {"w": torch.zeros(4, 3), "b": torch.zeros(3)}
    by_dim = lambda p: {k: v.dim() > 1 for k, v in p.items()}  # noqa: E731
    assert ps.takes_parts(ps.adamw(1e-3), params)
    assert ps.takes_parts(ps.chain(ps.clip_by_global_norm(1.0), ps.masked(ps.adamw(1e-3), by_dim)), params)
    assert not ps.takes_parts(ps.masked(ps.adamw(1e-3), {"w": True, "b": False}), params)  # a tree of these params
    assert not ps.takes_parts(ps.chain(ps.clip_by_global_norm(1.0), ps.partition(
        {"a": ps.sgd(0.1), "b": ps.adamw(1e-3)}, {"w": "a", "b": "b"})), params)
    assert not ps.takes_parts(ps.muon(batch_dims={"w": 0, "b": 0}), params)
    undeclared = ps.Transform(lambda p: (), lambda g, s, p=None, **e: (g, s))
    assert not ps.takes_parts(undeclared, params)  # it may look at anything
    # what takes parts does: its init runs on one param alone
    ps.chain(ps.clip_by_global_norm(1.0), ps.masked(ps.adamw(1e-3), by_dim)).init({"w": params["w"]})


def test_schedule_clocks_finds_every_declared_clock_outermost_first():
    params = {"w": torch.zeros(2)}
    sched = ps.cosine_schedule(1e-3, 10)
    assert len(ps.schedule_clocks(ps.adamw(sched).init(params))) == 1  # scale_by_lr's, with a scheduled lr
    assert ps.schedule_clocks(ps.adamw(1e-3).init(params)) == []  # a constant lr keeps no clock
    state = ps.inject_hyperparams(ps.adamw)(lr=sched).init(params)
    clocks = ps.schedule_clocks(state)
    assert clocks[0] is state.count  # the outermost first, the tensor itself (set in place)
    opt = ps.chain(ps.inject_hyperparams(ps.adamw)(lr=sched), ps.add_decayed_weights(sched))
    s = opt.init(params)
    assert [c is x for c, x in zip(ps.schedule_clocks(s), (s[0].count, s[1].count))] == [True, True]
    for c in ps.schedule_clocks(s):
        c.fill_(5)
    _, s = opt.update({"w": torch.ones(2)}, s, params)
    assert [int(c) for c in ps.schedule_clocks(s)] == [6, 6]
