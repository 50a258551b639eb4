"""PSGD-Kron against pytorch_optimizer's Kron (kron_torch) in float64 with the same probes, its
generator (reproducible, resumable, never the global RNG), the refit probability, the compiled step."""

from __future__ import annotations

import copy

import pytest
import torch

import purestep.core as ps
from purestep.core import _kron
from tests.core.test_alias import assert_histories_close, assert_moved, grad_stream, make_params, run_purestep

pytorch_optimizer = pytest.importorskip("pytorch_optimizer")
psgd = pytest.importorskip("pytorch_optimizer.optimizer.psgd")

STEPS = 30


def _params():
    params = make_params()
    params["scale"] = torch.tensor(0.7, dtype=torch.float64)  # a 0-d leaf: one diagonal factor of one
    return params


def _coins(seed, prob, steps):
    """Whether ps.kron refits at each update: its draw from (key, count) against `prob`."""
    key = torch.tensor(seed, dtype=torch.int64)
    return [bool(_kron._coin(key, torch.tensor(t)) < prob) for t in range(steps)]


def run_reference(params, grads_list, refits, seed=0, **kwargs):
    """pytorch_optimizer's Kron, refitting at the steps `refits` says, with ps.kron's probes.

    Its triangular solve runs in float32 whatever the factors' dtype (`solve_triangular_right`
    casts); patched to solve in the factors' dtype, so float64 runs agree to rounding."""
    tensors = {k: torch.nn.Parameter(v.clone()) for k, v in params.items()}
    group = {k: kwargs.pop(k) for k in ("precondition_lr", "precondition_init_scale") if k in kwargs}
    opt = pytorch_optimizer.Kron(list(tensors.values()), precondition_dtype=torch.float64, balance_prob=0.0, **kwargs)
    opt.param_groups[0].update(group)  # not constructor arguments there: group entries
    key, queue = torch.tensor(seed, dtype=torch.int64), []
    real_randn_like = torch.randn_like

    def probes(x, dtype=None):  # the reference draws one probe per leaf, in the params' order
        return queue.pop(0)

    history = []
    for t, grads in enumerate(grads_list):
        opt.param_groups[0]["pre_conditioner_update_probability"] = 1.0 if refits[t] else 0.0
        queue[:] = [_kron.probe(torch.empty(v.shape or (1,), dtype=torch.float64), key, torch.tensor(t), n).reshape(v.shape)
                    for n, v in enumerate(tensors.values())]
        for k, p in tensors.items():
            p.grad = grads[k].clone()
        psgd.torch.randn_like, psgd.solve_triangular_right = probes, _solve_in_place_dtype
        try:
            opt.step()
        finally:
            psgd.torch.randn_like, psgd.solve_triangular_right = real_randn_like, real_solve
        assert not refits[t] or not queue, "the reference drew fewer probes than there are leaves"
        history.append({k: p.detach().clone() for k, p in tensors.items()})
    return history


real_solve = psgd.solve_triangular_right


def _solve_in_place_dtype(x, a):
    return torch.linalg.solve_triangular(a, x.reshape(-1, x.size(-1)), upper=True, left=False).reshape_as(x)


_MATRICES = lambda p: {k: v.dim() >= 2 for k, v in p.items()}  # noqa: E731  # the references decay these


@pytest.mark.parametrize(
    "ours_kw, theirs_kw",
    [
        (dict(), dict()),
        (dict(b1=0.5, weight_decay=0.1, mask=_MATRICES, precond_lr=0.3, precond_init_scale=2.0),
         dict(momentum=0.5, weight_decay=0.1)),
        (dict(memory_save_mode="one_diag", momentum_into_precond_update=False, max_size_triangular=4),
         dict(memory_save_mode="one_diag", momentum_into_precondition_update=False, max_size_triangular=4)),
        (dict(memory_save_mode="smart_one_diag", min_ndim_triangular=3), dict(memory_save_mode="smart_one_diag", min_ndim_triangular=3)),
        (dict(memory_save_mode="all_diag"), dict(memory_save_mode="all_diag")),
    ],
)
@pytest.mark.parametrize("prob", [1.0, 0.4])
def test_kron_matches_pytorch_optimizer_kron_with_the_same_probes(ours_kw, theirs_kw, prob):
    params = _params()
    grads = grad_stream(params, steps=STEPS)
    ours, state = run_purestep(ps.kron(1e-2, update_prob=prob, **ours_kw), params, grads)
    theirs_kw = dict(theirs_kw)
    if "precond_lr" in ours_kw:
        theirs_kw["precondition_lr"] = ours_kw["precond_lr"]
    if "precond_init_scale" in ours_kw:
        theirs_kw["precondition_init_scale"] = ours_kw["precond_init_scale"]
    refits = _coins(0, prob, STEPS)
    assert 0 < sum(refits) <= STEPS and (prob == 1.0) == all(refits)
    theirs = run_reference(params, grads, refits, lr=1e-2, **theirs_kw)
    assert_histories_close(ours, theirs, rtol=1e-9)
    assert_moved(ours, params)




def test_kron_factors_are_triangular_or_diagonal_as_the_reference_decides():
    params = {"w": torch.zeros(5, 3), "big": torch.zeros(9, 2), "v": torch.zeros(4), "one": torch.zeros(1, 6)}
    q = ps.scale_by_kron(max_size_triangular=8).init(params).q
    assert [tuple(x.shape) for x in q["w"]] == [(5, 5), (3, 3)]
    assert [tuple(x.shape) for x in q["big"]] == [(9,), (2, 2)]  # 9 > max_size_triangular
    assert [tuple(x.shape) for x in q["v"]] == [(4,)]  # one dim < min_ndim_triangular
    assert [tuple(x.shape) for x in q["one"]] == [(1,), (6, 6)]  # a dim of 1
    for name in params:
        theirs, _ = psgd.initialize_q_expressions(params[name], 1.0, 8, 2, None)
        assert [tuple(x.shape) for x in theirs] == [tuple(x.shape) for x in q[name]], name


def test_kron_refits_where_its_generator_says_and_factors_stay_upper_triangular():
    params = _params()
    grads = grad_stream(params, steps=40)
    opt = ps.scale_by_kron(update_prob=0.25, seed=3)
    state = opt.init(params)
    refits = _coins(3, 0.25, 40)
    assert 4 <= sum(refits) <= 18  # about a quarter of 40
    for t, g in enumerate(grads):
        before = ps.tree_get(state, "q")
        _, state = opt.update(g, state)
        after = ps.tree_get(state, "q")
        changed = any(not torch.equal(a, b) for k in after for a, b in zip(after[k], before[k]))
        assert changed == refits[t], t
    for q in ps.tree_get(state, "q")["layers.0.weight"]:
        assert torch.equal(q, q.triu())


def test_kron_update_probability_is_the_reference_schedule():
    ours = ps.kron_update_probability()
    theirs = psgd.precondition_update_prob_schedule()
    for t in (0, 1, 499, 500, 501, 900, 2000, 4000, 10000):
        assert float(ours(torch.tensor(t))) == pytest.approx(float(theirs(t)), rel=1e-6), t
    coins = _coins(0, 0.3, 4000)
    assert abs(sum(coins) / 4000 - 0.3) < 0.03


def test_kron_probes_are_standard_normal_and_leave_torchs_generator_alone():
    torch.manual_seed(5)
    before = torch.random.get_rng_state()
    x = torch.empty(200_000, dtype=torch.float64)
    v = _kron.probe(x, torch.tensor(0), torch.tensor(7), 2)
    assert torch.equal(torch.random.get_rng_state(), before)
    assert abs(float(v.mean())) < 0.01 and abs(float(v.std()) - 1.0) < 0.01
    assert abs(float((v > 1.0).double().mean()) - 0.1587) < 0.005  # the normal's tail, not just its moments
    other = _kron.probe(x, torch.tensor(1), torch.tensor(7), 2)  # another seed
    later = _kron.probe(x, torch.tensor(0), torch.tensor(8), 2)  # another update
    assert abs(float((v * other).mean())) < 0.01 and abs(float((v * later).mean())) < 0.01


def test_kron_resumed_from_a_copy_of_its_state_equals_the_uninterrupted_run_and_seeds_differ():
    params = _params()
    grads = grad_stream(params, steps=20)
    opt = ps.kron(1e-2, update_prob=0.5, seed=11)
    whole, _ = run_purestep(opt, params, grads)
    first, state = run_purestep(opt, params, grads[:10])
    state = copy.deepcopy(state)  # as a checkpoint round trip gives it
    second, _ = run_purestep(opt, first[-1], grads[10:], state)
    for k in params:
        assert torch.equal(whole[-1][k], second[-1][k]), k
    other, _ = run_purestep(ps.kron(1e-2, update_prob=0.5, seed=12), params, grads)
    assert not torch.equal(other[-1]["layers.0.weight"], whole[-1]["layers.0.weight"])


def test_kron_compiled_step_equals_eager_and_does_not_recompile_when_lr_or_refit_changes():
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    params = {k: v.float() for k, v in _params().items()}
    grads = [{k: v.float() for k, v in g.items()} for g in grad_stream(params, steps=8)]
    opt = ps.inject_hyperparams(ps.kron)(lr=1e-2, update_prob=0.5, weight_decay=0.1)
    eager, compiled = ps.make_update(opt), ps.make_update(opt, compile=True, donate=True)
    pe, se = dict(params), opt.init(params)
    pc, sc = {k: v.clone() for k, v in params.items()}, opt.init(params)
    counters.clear()
    for t, g in enumerate(grads):
        lr = torch.tensor(1e-2 / (1 + t), dtype=torch.float64)
        se, sc = ps.tree_set(se, "lr", lr), ps.tree_set(sc, "lr", lr.clone())
        pe, se = eager(pe, g, se)[:2]
        pc, sc = compiled(pc, g, sc)[:2]
        if t == 1:
            graphs = counters["stats"]["unique_graphs"]
    assert len(set(_coins(0, 0.5, 8))) == 2  # both branches ran
    assert counters["stats"]["unique_graphs"] == graphs > 0, "recompiled after the second step"
    assert compiled.explain(params).startswith("per-leaf compiled"), compiled.explain(params)
    for k in params:
        torch.testing.assert_close(pc[k], pe[k], rtol=1e-5, atol=1e-6, msg=k)


def test_kron_bf16_momentum_is_stored_narrow():
    params = {k: v.float() for k, v in _params().items()}
    grads = [{k: v.float() for k, v in g.items()} for g in grad_stream(params, steps=5)]
    wide, _ = run_purestep(ps.kron(1e-2), params, grads)
    narrow, state = run_purestep(ps.kron(1e-2, mu_dtype=torch.bfloat16), params, grads)
    assert all(m.dtype == torch.bfloat16 for m in ps.tree_leaves(ps.tree_get(state, "mu")))
    for k in params:
        torch.testing.assert_close(narrow[-1][k], wide[-1][k], rtol=0.05, atol=5e-3)


@pytest.mark.parametrize(
    "make, arg",
    [
        (lambda: ps.kron(-1.0), "lr"),
        (lambda: ps.kron(1e-3, b1=1.0), "b1"),
        (lambda: ps.kron(1e-3, weight_decay=-0.1), "weight_decay"),
        (lambda: ps.kron(1e-3, update_prob=1.5), "update_prob"),
        (lambda: ps.kron(1e-3, memory_save_mode="some"), "memory_save_mode"),
        (lambda: ps.kron(1e-3, max_size_triangular=0), "max_size_triangular"),
        (lambda: ps.kron(1e-3, precond_lr=0.0), "precond_lr"),
        (lambda: ps.kron(1e-3, precond_dtype=torch.bfloat16), "precond_dtype"),
        (lambda: ps.kron(1e-3, seed=-1), "seed"),
        (lambda: ps.kron(1e-3, momentum_into_precond_update=1), "momentum_into_precond_update"),
        (lambda: ps.kron_update_probability(min_prob=2.0), "min_prob"),
    ],
)
def test_kron_invalid_arguments_raise_naming_the_argument(make, arg):
    with pytest.raises(ValueError, match=arg):
        make()


def test_kron_and_soap_take_params_in_tuples_and_empty_leaves():
    params = (torch.randn(3, 2, dtype=torch.float64), {"blk": (torch.randn(4, dtype=torch.float64), torch.zeros(0, 3, dtype=torch.float64))})
    grads = [ps.tree_map(torch.randn_like, params) for _ in range(3)]
    as_dict = lambda t: {"a": t[0], "b": t[1]["blk"][0], "e": t[1]["blk"][1]}  # noqa: E731
    for make in (lambda: ps.kron(1e-2), lambda: ps.soap(1e-2, precondition_frequency=2)):
        ours, _ = run_purestep(make(), params, grads)  # the params' own tuples are containers, not factor tuples
        flat, _ = run_purestep(make(), as_dict(params), [as_dict(g) for g in grads])
        for k, v in as_dict(ours[-1]).items():
            torch.testing.assert_close(v, flat[-1][k], rtol=0, atol=0, msg=k)
        assert as_dict(ours[-1])["e"].shape == (0, 3)


def test_kron_update_probability_refuses_a_floor_above_its_ceiling():
    with pytest.raises(ValueError, match="min_prob=0.5 must be at most max_prob=0.1"):
        ps.kron_update_probability(max_prob=0.1, min_prob=0.5)
