"""The testing kit passes good transforms and catches planted bugs, naming the invariant."""

from __future__ import annotations

from typing import NamedTuple

import pytest
import torch
import torch.utils._pytree as pytree
from hypothesis import given, settings

import purestep.core as ps
from purestep.core import testing as kit

FAST = dict(max_examples=15)


class _MomentumState(NamedTuple):
    count: torch.Tensor  # (), int64
    mu: dict


def sign_momentum(lr: float = 1e-2, beta: float = 0.9, *, bug: str | None = None) -> ps.Transform:
    """A small correct optimizer, with switches that plant one bug each."""

    def init(params):
        device = ps.tree_leaves(params)[0].device  # state scalars live with the params (CPU or CUDA)
        return _MomentumState(torch.zeros((), dtype=torch.int64, device=device), ps.tree_zeros_like(params))

    def update(grads, state, params=None, **extra):
        if bug == "mutates_grads":
            for g in pytree.tree_leaves(grads):
                g.mul_(1 - beta)
        mu = pytree.tree_map(lambda m, g: beta * m + (1 - beta) * g, state.mu, grads)
        if bug == "dtype_drift":
            mu = pytree.tree_map(lambda m: m.to(torch.float64), mu)
        if bug == "nan_on_zero":
            updates = pytree.tree_map(lambda m: -lr * m / m.abs().max(), mu)
        else:
            updates = pytree.tree_map(lambda m: -lr * torch.sign(m).to(m.dtype), mu)
        if bug == "python_count":
            return updates, _MomentumState(int(state.count) + 1, mu)
        return updates, _MomentumState(state.count + 1, mu)

    return ps.Transform(init, update)


def l2_adam(lr: float = 1e-2, weight_decay: float = 0.1) -> ps.Transform:
    """Adam with L2 decay in the grads: what torch.optim.Adam does, not decoupled."""
    return ps.chain(ps.add_decayed_weights(weight_decay), ps.scale_by_adam(), ps.scale_by_lr(lr))


# --------------------------------------------------------------------------- #
# Good transforms pass.
# --------------------------------------------------------------------------- #


def test_kit_passes_a_correct_custom_optimizer():
    kit.check_transform(sign_momentum, **FAST)
    kit.check_bounded_updates(sign_momentum, bound=1e-2, **FAST)


def test_kit_passes_adamw_with_drawn_hyperparams_and_torch_reference():
    kit.check_transform(
        ps.adamw,
        hyperparams=kit.hyperparams("lr", "betas", "weight_decay"),
        reference=torch.optim.AdamW,
        **FAST,
    )


def test_kit_passes_library_properties():
    kit.check_decoupled_decay(lambda: ps.adamw(0.1, weight_decay=0.2), coefficient=-0.02, **FAST)
    kit.check_scale_invariance(lambda: ps.adam(1e-2), **FAST)
    kit.check_bounded_updates(lambda: ps.lion(1e-3, weight_decay=0.5), bound=1e-3, **FAST)


# --------------------------------------------------------------------------- #
# Planted bugs fail, naming the invariant and carrying the counterexample.
# --------------------------------------------------------------------------- #


def _fails(invariant: str, run) -> str:
    with pytest.raises(AssertionError) as info:
        run()
    message = str(info.value)
    assert message.startswith(f"{invariant}:"), message
    assert isinstance(info.value, kit.InvariantError) and info.value.invariant == invariant
    return message


def test_kit_catches_an_optimizer_that_mutates_its_grads():
    message = _fails("purity", lambda: kit.check_transform(lambda: sign_momentum(bug="mutates_grads"), **FAST))
    assert "mutated its grads input" in message
    assert "minimal counterexample" in message and "Example(params=" in message


def test_kit_catches_state_dtype_drift():
    message = _fails("state_stability", lambda: kit.check_transform(lambda: sign_momentum(bug="dtype_drift"), **FAST))
    assert "state leaf 'mu.p0' changed from" in message


def test_kit_catches_a_python_number_in_state():
    _fails("state_stability", lambda: kit.check_transform(lambda: sign_momentum(bug="python_count"), **FAST))


def test_kit_catches_state_on_another_device_than_the_params():
    # "meta" stands in for the CPU beside CUDA params (tests/core/test_cuda.py has the real pair):
    # the check fires at init, before any update would touch the state.
    def elsewhere(**hp):
        t = sign_momentum(**hp)
        return ps.Transform(lambda p: t.init(p)._replace(count=torch.zeros((), dtype=torch.int64, device="meta")), t.update)

    message = _fails("state_stability", lambda: kit.check_transform(elsewhere, **FAST))
    assert "init state leaf 'count' is on meta but the params are on cpu" in message


def test_kit_catches_nan_on_zero_grads_with_a_minimal_example():
    message = _fails("finite_outputs", lambda: kit.check_transform(lambda: sign_momentum(bug="nan_on_zero"), **FAST))
    assert "all-zero grads" in message
    # One step of zero grads on one float32 scalar.
    assert "grads per step: [zeros]" in message and "{'p0': float32[]" in message, message


@pytest.mark.parametrize("hp", [None, "drawn"])
def test_kit_tries_edge_grads_whatever_hypothesis_draws(hp):
    # Hypothesis's derandomized draws change between its versions and even with the tests run
    # before (on a CUDA machine no example of 15 had zero grads at the first step): the edge
    # grads come first and do not depend on the draw. One drawn example is all there is here.
    hyperparams = kit.hyperparams("lr") if hp else None
    for bug, kind in (("nan_on_zero", "all-zero"), ("nan_on_huge", "huge"), ("nan_on_tiny", "tiny")):
        if hp and bug != "nan_on_zero":
            continue  # with drawn hyperparameters only the simplest example (zero grads) is fixed
        message = _fails(
            "finite_outputs",
            lambda: kit.check_transform(lambda **k: _nan_on(bug, **k), hyperparams=hyperparams, max_examples=1),
        )
        assert f"({kind} grads)" in message, message


def _nan_on(bug: str, lr: float = 1e-2) -> ps.Transform:
    """NaN updates for one grad magnitude: zero, huge (> 1e5) or tiny (< 1e-5, not zero)."""
    test = {
        "nan_on_zero": lambda g: g == 0,
        "nan_on_huge": lambda g: g.abs() > 1e5,
        "nan_on_tiny": lambda g: (g != 0) & (g.abs() < 1e-5),
    }[bug]

    def update(grads, state, params=None, **extra):
        return ps.tree_map(lambda g: torch.where(test(g), torch.nan, -lr * g), grads), state

    return ps.Transform(lambda p: ps.EmptyState(), update)


def test_kit_catches_l2_decay_declared_decoupled():
    message = _fails("decoupled_decay", lambda: kit.check_decoupled_decay(l2_adam, **FAST))
    # L2 decay shows as a params dependence that is not c·p, differs per leaf, or has the wrong sign.
    assert any(s in message for s in ("not a multiple of p", "different rates", "grows with p", "no decay")), message


def test_kit_catches_a_decay_coefficient_that_is_not_the_declared_one():
    _fails(
        "decoupled_decay",
        lambda: kit.check_decoupled_decay(lambda: ps.adamw(0.1, weight_decay=0.2), coefficient=-0.03, **FAST),
    )


def test_kit_catches_scale_dependence_and_unbounded_updates():
    _fails("scale_invariance", lambda: kit.check_scale_invariance(lambda: ps.sgd(0.1, momentum=0.9), **FAST))
    _fails("bounded_updates", lambda: kit.check_bounded_updates(lambda: ps.sgd(1e-2), bound=1e-2, **FAST))


def test_kit_catches_a_wrong_reference():
    _fails(
        "reference_parity",
        lambda: kit.check_transform(lambda: ps.adam(1e-2), reference=lambda p: torch.optim.AdamW(p, lr=1e-2), **FAST),
    )


def test_kit_catches_hidden_python_state_as_nondeterminism():
    calls = []

    def factory():
        t = ps.scale(-0.1)

        def update(grads, state, params=None, **extra):
            calls.append(1)
            return pytree.tree_map(lambda g: g * len(calls), grads), state

        return ps.Transform(t.init, update)

    _fails("determinism", lambda: kit.check_transform(factory, checks=("determinism",), **FAST))


def test_kit_catches_a_step_counter_kept_in_a_closure_naming_replay():
    def factory():
        calls = [0]  # per instance, so a fresh instance repeats the same sequence: determinism holds

        def update(grads, state, params=None, **extra):
            calls[0] += 1
            return ps.tree_map(lambda g: -1e-2 * g / calls[0], grads), state  # a 1/t lr schedule

        return ps.Transform(lambda p: ps.EmptyState(), update)

    kit.check_transform(factory, checks=tuple(c for c in kit.DEFAULT_CHECKS if c != "replay"), **FAST)
    message = _fails("replay", lambda: kit.check_transform(factory, **FAST))
    assert "replayed from init" in message and "closure" in message


def test_kit_catches_a_closure_counter_that_init_resets():
    def factory():
        calls = [0]

        def init(params):
            calls[0] = 0
            return ps.EmptyState()

        def update(grads, state, params=None, **extra):
            calls[0] += 1
            return ps.tree_map(lambda g: -1e-2 * g / calls[0], grads), state

        return ps.Transform(init, update)

    message = _fails("replay", lambda: kit.check_transform(factory, checks=("replay",), **FAST))
    assert "given step 1's inputs again" in message


def test_kit_catches_a_transform_that_changes_inside_a_combinator():
    import sys

    def factory():
        def update(grads, state, params=None, **extra):
            wrapped = sys._getframe(1).f_code.co_name == "update"  # called by chain/masked
            return {k: v * (2.0 if wrapped else 1.0) for k, v in grads.items()}, state

        return ps.Transform(lambda p: ps.EmptyState(), update)

    message = _fails("composition", lambda: kit.check_transform(factory, checks=("composition",), **FAST))
    assert "chain(identity(), t) vs t" in message


def test_kit_catches_an_in_place_form_that_disagrees_with_update():
    # The affine form claims u ↦ x·u while `update` returns -u: with x = 2 an eager
    # donated step would apply something else than the pure update.
    def factory(x):
        def update(grads, state, params=None, **extra):
            return {k: -v for k, v in grads.items()}, state

        return ps.Transform(lambda p: ps.EmptyState(), ps.with_in_place(update, affine=lambda state: (x, 0.0, state)))

    message = _fails("in_place", lambda: kit.check_transform(lambda: factory(2.0), checks=("in_place",), **FAST))
    assert "gave other params than update" in message
    kit.check_transform(lambda: factory(-1.0), checks=("in_place",), **FAST)


def test_in_place_forms_belong_to_the_update_function_not_to_a_wrapper():
    import functools

    base = ps.scale(-1.0)

    @functools.wraps(base.update)  # copies the function's attributes: must not copy its forms
    def doubled(grads, state, params=None, **extra):
        u, s = base.update(grads, state, params, **extra)
        return {k: 2 * v for k, v in u.items()}, s

    for t in (base._replace(update=doubled), ps.Transform(base.init, doubled)):
        params, grads = {"w": torch.ones(3)}, {"w": torch.full((3,), 0.5)}
        want = ps.apply_updates(params, t.update(grads, t.init(params), params)[0])
        step = ps.make_update(ps.chain(t), donate=True)
        got, _ = step(params, grads, ps.chain(t).init(params))
        torch.testing.assert_close(got["w"], want["w"])
    with pytest.raises(ValueError, match="update must be a function"):
        ps.with_in_place(3, affine=lambda s: (1.0, 0.0, s))


def test_kit_reports_an_exception_in_update_as_an_invariant():
    def factory():
        def update(grads, state, params=None, **extra):
            if any(g.dim() == 0 for g in grads.values()):
                raise RuntimeError("0-d leaves not supported")
            return grads, state

        return ps.Transform(lambda p: ps.EmptyState(), update)

    message = _fails("no_exception", lambda: kit.check_transform(factory, **FAST))
    assert "RuntimeError: 0-d leaves not supported" in message


def test_kit_rejects_unknown_checks():
    with pytest.raises(ValueError, match="unknown entries"):
        kit.check_transform(ps.identity(), checks=("purty",))


# --------------------------------------------------------------------------- #
# Schedules.
# --------------------------------------------------------------------------- #


def _warmup_cosine(peak=1.0, warmup=10, total=50, *, jump=1.0):
    def schedule(step):
        t = torch.as_tensor(step, dtype=torch.float64)
        warm = peak * t / warmup
        frac = torch.clamp((t - warmup) / (total - warmup), 0.0, 1.0)
        cos = jump * peak * 0.5 * (1 + torch.cos(torch.pi * frac))
        return torch.where(t < warmup, warm, cos)

    return schedule


def test_schedule_check_passes_warmup_cosine():
    kit.check_schedule(_warmup_cosine(), steps=60, boundaries=[10, 50], bounds=(0.0, 1.0))


def test_schedule_check_catches_a_jump_at_a_phase_boundary():
    message = _fails("continuity", lambda: kit.check_schedule(_warmup_cosine(jump=0.3), steps=60, boundaries=[10, 50]))
    assert "at step 9" in message


def test_schedule_check_catches_a_non_monotone_phase_and_bounds():
    wiggle = lambda t: 1.0 + 0.1 * torch.sin(torch.as_tensor(t, dtype=torch.float64))  # noqa: E731
    _fails("monotone_phases", lambda: kit.check_schedule(wiggle, steps=20, boundaries=[], continuous=False))
    _fails("bounds", lambda: kit.check_schedule(_warmup_cosine(peak=2.0), steps=60, bounds=(0.0, 1.0)))


def test_schedule_check_catches_python_branching_on_the_step():
    branchy = lambda t: 0.1 if t < 5 else 0.01  # noqa: E731 - not a tensor for a tensor step
    _fails("tensor_steps", lambda: kit.check_schedule(branchy, steps=10, continuous=False))


# --------------------------------------------------------------------------- #
# Strategies.
# --------------------------------------------------------------------------- #


@settings(max_examples=30, deadline=None, database=None)
@given(kit.param_trees(max_rank=4, dtypes=(torch.bfloat16,)))
def test_param_trees_draw_small_tensors_of_the_requested_dtypes(params):
    assert 1 <= len(params) <= 4
    for p in params.values():
        assert p.dtype == torch.bfloat16 and p.dim() <= 4 and all(1 <= s <= 3 for s in p.shape)


def test_grad_trees_match_their_params():
    params = {"a": torch.zeros(2, 1, dtype=torch.float64), "b": torch.zeros((), dtype=torch.bfloat16)}

    @settings(max_examples=20, deadline=None, database=None)
    @given(kit.grad_trees(params))
    def check(grads):
        assert list(grads) == ["a", "b"]
        for k in params:
            assert grads[k].shape == params[k].shape and grads[k].dtype == params[k].dtype
            assert torch.isfinite(grads[k]).all()

    check()
    with pytest.raises(ValueError, match="unknown entries"):
        kit.grad_trees(params, kinds=("normal", "enormous"))


def test_hyperparams_refuses_names_without_a_default_range():
    with pytest.raises(ValueError, match="rho"):
        kit.hyperparams("lr", "rho")


def test_the_custom_optimizer_example_passes_and_its_planted_bug_fails():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "examples" / "custom_optimizer.py"
    spec = importlib.util.spec_from_file_location("custom_optimizer_example", path)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    kit.check_transform(example.sign_momentum, hyperparams=kit.hyperparams("lr", "momentum"), **FAST)
    message = _fails("purity", lambda: kit.check_transform(lambda: example.sign_momentum(in_place=True), **FAST))
    assert "mutated its state input at leaf 'mu.p0'" in message


def test_kit_reports_a_failure_that_does_not_replay_as_nondeterminism():
    calls = [0]

    def factory():
        def update(grads, state, params=None, **extra):
            calls[0] += 1  # global hidden state: the 12th update ever (past the 4 edge examples) returns NaN
            return {k: v * (float("nan") if calls[0] == 12 else 1.0) for k, v in grads.items()}, state

        return ps.Transform(lambda p: ps.EmptyState(), update)

    message = _fails("determinism", lambda: kit.check_transform(factory, checks=("finite_outputs",), **FAST))
    assert "replayed" in message and "finite_outputs" in message


def test_kit_catches_a_python_number_in_state_as_a_recompile():
    # One small compile (10-30 s on CPU): a Python int step count is specialised by dynamo.
    message = _fails(
        "no_recompile",
        lambda: kit.check_transform(lambda: sign_momentum(bug="python_count"), checks=(), compile=True, max_examples=1),
    )
    assert "step 1 recompiled" in message
