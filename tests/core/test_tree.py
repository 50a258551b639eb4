"""Tree utilities: paths, get/set by name, apply_updates, norms, and the foreach/per-leaf switch."""

from __future__ import annotations

from typing import NamedTuple

import pytest
import torch

import purestep.core as ps


class Pair(NamedTuple):
    count: torch.Tensor
    mu: dict


def test_flatten_with_path_round_trips_nested_trees():
    tree = {"a": [torch.zeros(1), (torch.ones(2), {"b": torch.ones(3)})], "c": Pair(torch.tensor(0), {"w": torch.ones(1)})}
    pairs, spec = ps.tree_flatten_with_path(tree)
    assert [p for p, _ in pairs] == ["a.0", "a.1.0", "a.1.1.b", "c.count", "c.mu.w"]
    rebuilt = ps.tree_unflatten([x for _, x in pairs], spec)
    assert isinstance(rebuilt["c"], Pair) and torch.equal(rebuilt["a"][1][1]["b"], torch.ones(3))
    assert ps.tree_paths(tree) == [p for p, _ in pairs]


def test_tree_map_with_path_sees_dotted_paths():
    tree = {"layers": [{"w": torch.ones(2)}]}
    out = ps.tree_map_with_path(lambda path, x: x * len(path), tree)
    assert torch.equal(out["layers"][0]["w"], torch.full((2,), float(len("layers.0.w"))))


def test_tree_get_and_tree_set_reach_named_fields_at_any_depth():
    state = ps.adamw(1e-3).init({"w": torch.zeros(2)})
    assert torch.equal(ps.tree_get(state, "count"), torch.tensor(0))
    assert set(ps.tree_get(state, "mu")) == {"w"}
    new = ps.tree_set(state, "count", torch.tensor(7))
    assert ps.tree_get(new, "count").item() == 7
    assert ps.tree_get(state, "count").item() == 0  # the original is untouched
    assert type(new) is type(state) and type(new[0]) is type(state[0])


def test_tree_get_raises_key_error_listing_candidates():
    state = ps.adamw(1e-3).init({"w": torch.zeros(2)})
    with pytest.raises(KeyError, match="count"):
        ps.tree_get(state, "momentum")
    with pytest.raises(KeyError, match="ambiguous"):
        ps.tree_get(state, "w")  # mu.w and nu.w


def test_apply_updates_casts_back_to_each_param_dtype():
    params = {"a": torch.ones(3, dtype=torch.bfloat16), "b": torch.ones(2)}
    updates = {"a": torch.full((3,), 1e-3, dtype=torch.float32), "b": torch.full((2,), 0.5)}
    out = ps.apply_updates(params, updates)
    assert out["a"].dtype == torch.bfloat16 and out["b"].dtype == torch.float32
    assert torch.equal(out["b"], torch.full((2,), 1.5))
    assert torch.equal(params["b"], torch.ones(2))


def test_apply_updates_in_place_mutates_and_returns_the_params():
    model = torch.nn.Linear(2, 2)
    params = dict(model.named_parameters())
    before = model.weight.detach().clone()
    out = ps.apply_updates_(params, {k: torch.ones_like(v) for k, v in params.items()})
    assert out is params
    assert torch.equal(model.weight.detach(), before + 1)


def test_apply_updates_names_a_missing_leaf():
    with pytest.raises(ValueError, match="'b'"):
        ps.apply_updates({"a": torch.ones(1), "b": torch.ones(1)}, {"a": torch.ones(1)})


def test_global_norm_and_zeros_like_and_cast():
    tree = {"a": torch.tensor([3.0]), "b": [torch.tensor([4.0], dtype=torch.float64)]}
    torch.testing.assert_close(ps.tree_global_norm(tree), torch.tensor(5.0, dtype=torch.float64))
    zeros = ps.tree_zeros_like(tree)
    assert zeros["b"][0].dtype == torch.float64 and torch.count_nonzero(zeros["a"]) == 0
    cast = ps.tree_cast(tree, torch.bfloat16)
    assert cast["a"].dtype == torch.bfloat16 and cast["b"][0].dtype == torch.bfloat16


def test_zero_dim_leaves_keep_their_dtype_with_float64_scalars():
    params = {"t": torch.tensor(1.0), "w": torch.ones(2, dtype=torch.bfloat16)}
    opt = ps.inject_hyperparams(ps.adamw)(lr=1e-2)
    state = opt.init(params)
    for _ in range(2):
        updates, state = opt.update({k: torch.ones_like(v) for k, v in params.items()}, state, params)
    assert updates["t"].dtype == torch.float32 and updates["w"].dtype == torch.bfloat16
    assert ps.tree_get(state, "mu")["t"].dtype == torch.float32


def loss(params, x):
    return ((x @ params["w"]) ** 2).mean() + (params["b"] ** 2).sum()


def test_an_update_runs_under_vmap_equal_to_separate_runs():
    """foreach kernels have no vmap rule; the leaf-list math switches to per-leaf."""
    g = torch.Generator().manual_seed(0)
    params = {"w": torch.randn(4, 3, 2, generator=g, dtype=torch.float64), "b": torch.randn(4, 2, generator=g, dtype=torch.float64)}
    grads = {k: torch.randn(v.shape, generator=g, dtype=v.dtype) for k, v in params.items()}
    opt = ps.adamw(1e-2, weight_decay=0.1)

    def one_step(p, gr):
        state = opt.init(p)
        updates, state = opt.update(gr, state, p)
        updates, state = opt.update(gr, state, ps.apply_updates(p, updates))
        return updates

    batched = torch.func.vmap(one_step)(params, grads)
    for i in range(4):
        single = one_step({k: v[i] for k, v in params.items()}, {k: v[i] for k, v in grads.items()})
        for k in params:
            torch.testing.assert_close(batched[k][i], single[k], rtol=1e-12, atol=1e-15)


def test_an_update_is_differentiable_with_torch_func_grad():
    g = torch.Generator().manual_seed(0)
    params = {"w": torch.randn(3, 2, generator=g, dtype=torch.float64), "b": torch.randn(2, generator=g, dtype=torch.float64)}
    x = torch.randn(5, 3, generator=g, dtype=torch.float64)
    opt = ps.inject_hyperparams(ps.sgd)(lr=0.1, momentum=0.9)

    def after_two_steps(lr):
        p = params
        state = opt.init(p)
        state = ps.set_hyperparam(state, "lr", lr)
        for _ in range(2):
            grads = torch.func.grad(loss)(p, x)
            updates, state = opt.update(grads, state, p)
            p = ps.apply_updates(p, updates)
        return loss(p, x)

    lr = torch.tensor(0.1, dtype=torch.float64)
    meta = torch.func.grad(lambda lr: after_two_steps(lr))(lr)
    eps = 1e-6
    fd = (after_two_steps(lr + eps) - after_two_steps(lr - eps)) / (2 * eps)
    torch.testing.assert_close(meta, fd, rtol=1e-6, atol=1e-9)


# --------------------------------------------------------------------------- #
# The helpers a transform author needs, and step_count.
# --------------------------------------------------------------------------- #


def test_tree_map_leaves_and_flatten_work_on_nested_states():
    tree = {"a": [torch.zeros(1), Pair(torch.tensor(3), {"w": torch.ones(2)})]}
    doubled = ps.tree_map(lambda x: 2 * x, tree)
    assert isinstance(doubled["a"][1], Pair) and int(doubled["a"][1].count) == 6
    assert [x.tolist() for x in ps.tree_leaves(doubled)] == [[0.0], 6, [2.0, 2.0]]
    leaves, spec = ps.tree_flatten(tree)
    summed = ps.tree_map(torch.add, tree, ps.tree_unflatten(leaves, spec))
    assert torch.equal(summed["a"][1].mu["w"], torch.full((2,), 2.0))


def _steps(opt, n, params=None, grads=None):
    params = params or {"embed.weight": torch.ones(3, 2), "h.0.weight": torch.ones(2, 2), "h.0.bias": torch.ones(2)}
    state = opt.init(params)
    for i in range(n):
        g = grads(i) if grads else ps.tree_map(lambda p: torch.full_like(p, 0.1 * (i + 1)), params)
        _, state = opt.update(g, state, params)
    return state


@pytest.mark.parametrize(
    "opt",
    [
        ps.adamw(lr=ps.cosine_schedule(1e-3, 10), weight_decay=ps.linear_schedule(0.1, 0.0, 10)),  # 4 counters
        ps.chain(ps.clip_by_running_norm(), ps.sgd(0.1, momentum=0.9)),
        ps.inject_hyperparams(ps.adamw)(lr=1e-3),
        ps.schedule_free_adamw(1e-3, warmup_steps=2),
        ps.muon_adamw(ns_dtype=torch.float32),
        ps.masked(ps.lion(1e-3), {"embed.weight": True, "h.0.weight": False, "h.0.bias": True}),
    ],
    ids=["scheduled_adamw", "running_clip_sgd", "inject_hyperparams", "schedule_free", "muon_adamw", "masked"],
)
def test_step_count_is_the_number_of_updates_applied(opt):
    state = _steps(opt, 4)
    assert ps.step_count(state).dtype == torch.int64 and int(ps.step_count(state)) == 4


def test_step_count_leaves_out_skipped_and_accumulating_calls():
    nan_at_1 = lambda i: {"w": torch.tensor([float("nan") if i == 1 else 1.0])}  # noqa: E731
    state = _steps(ps.apply_if_finite(ps.adam(1e-3)), 4, {"w": torch.zeros(1)}, nan_at_1)
    assert int(ps.step_count(state)) == 3 and int(state.total_notfinite) == 1
    state = _steps(ps.accumulate(ps.adam(1e-3), every=3), 7, {"w": torch.zeros(1)})
    assert int(ps.step_count(state)) == 2  # 7 calls: two updates, one grad waiting
    # The outermost counter wins: inject_hyperparams outside apply_if_finite counts every call.
    outer = ps.inject_hyperparams(lambda lr: ps.apply_if_finite(ps.adam(lr)))(lr=1e-3)
    assert int(ps.step_count(_steps(outer, 4, {"w": torch.zeros(1)}, nan_at_1))) == 4


def test_step_count_without_a_counter_says_how_to_get_one_and_tree_get_points_to_it():
    with pytest.raises(KeyError, match="inject_hyperparams"):
        ps.step_count(ps.sgd(0.1).init({"w": torch.zeros(1)}))
    state = ps.adamw(lr=ps.cosine_schedule(1e-3, 10)).init({"w": torch.zeros(1)})
    with pytest.raises(KeyError, match="ps.step_count"):
        ps.tree_get(state, "count")


def test_state_bytes_counts_each_tensor_once_and_a_dtensor_by_its_local_part(one_rank_group):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    params = {"w": torch.zeros(4, 3), "b": torch.zeros(3, dtype=torch.float64)}
    state = ps.adamw(1e-3).init(params)
    # mu and nu of w (2 x 12 x 4 bytes) and of b (2 x 3 x 8), and the int64 count
    assert ps.state_bytes(state) == 2 * 12 * 4 + 2 * 3 * 8 + 8
    shared = torch.zeros(5)
    assert ps.state_bytes({"a": shared, "b": shared, "n": 3, "none": None}) == 20
    mesh = init_device_mesh("cpu", (1,))
    # a DTensor that stands for a (8, 3) tensor of which this rank holds 2 rows: its 2 rows count
    piece = DTensor.from_local(torch.zeros(2, 3), mesh, [Shard(0)], run_check=False, shape=(8, 3), stride=(3, 1))
    assert piece.shape == (8, 3) and ps.state_bytes([piece]) == 2 * 3 * 4
