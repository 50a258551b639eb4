"""Property tests for transforms and schedules: hypothesis strategies and invariant checks.

`check_transform(factory)` runs the invariants purestep checks on itself on any
transform: purity, state stability, update structure, finite outputs (all-zero,
huge and tiny grads included), determinism, replay (no state hidden outside the
returned state), composition with `chain`/`masked`,
and optionally parity with a `torch.optim` reference and no recompilation under
`torch.compile`. Opt-in properties: `check_decoupled_decay`,
`check_scale_invariance`, `check_bounded_updates`, and `check_schedule` for any
`step -> value` callable. A broken invariant raises an `AssertionError` that starts
with the invariant's name and carries hypothesis's minimal counterexample.

This module needs hypothesis (`pip install hypothesis`); `purestep.core` does not
import it.

Examples:
    >>> import purestep.core as ps
    >>> from purestep.core.testing import check_transform
    >>> check_transform(lambda: ps.adamw(1e-2), max_examples=5)
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Sequence

import torch
import torch.utils._pytree as pytree
from torch import Tensor

import purestep.core as ps

try:
    import hypothesis  # noqa: F401  (availability: core must import without it)
    from hypothesis import strategies as st
except ImportError as error:  # pragma: no cover - exercised only without hypothesis
    raise ImportError("purestep.core.testing needs hypothesis: pip install hypothesis (or purestep[test])") from error

from ._strategies import (
    FLOAT_DTYPES,
    GRAD_KINDS,
    Example,
    Options,
    given_examples,
    grads_like,
    seeded_tensor,
)
from ._strategies import grad_trees as grad_trees
from ._strategies import hyperparams as hyperparams
from ._strategies import param_trees as param_trees
from .._base import affine_of, apply_of
from ..engine.per_leaf import apply_in_place
from ._invariants import InvariantError as InvariantError
from ._invariants import as_factory, call_checked, clone_tree, compare_runs, first_difference, in_float64, kit_settings
from ._invariants import make_transform, name_of, run_reporting, same_bits, trajectory, where_in_run

__all__ = [
    "FLOAT_DTYPES",
    "GRAD_KINDS",
    "TOLERANCES",
    "DEFAULT_CHECKS",
    "InvariantError",
    "param_trees",
    "grad_trees",
    "hyperparams",
    "check_transform",
    "check_decoupled_decay",
    "check_scale_invariance",
    "check_bounded_updates",
    "check_schedule",
]


# One per-dtype tolerance table (rtol, atol) for every numeric comparison in the kit.
TOLERANCES: dict[torch.dtype, tuple[float, float]] = {
    torch.float64: (1e-9, 1e-12),
    torch.float32: (1e-5, 1e-7),
    torch.bfloat16: (2e-2, 1e-3),
}

DEFAULT_CHECKS = (
    "purity",
    "state_stability",
    "update_structure",
    "finite_outputs",
    "determinism",
    "replay",
    "composition",
    "in_place",
)


# --------------------------------------------------------------------------- #
# check_transform.
# --------------------------------------------------------------------------- #


def check_transform(
    factory: Callable[..., ps.Transform] | ps.Transform,
    *,
    checks: Sequence[str] = DEFAULT_CHECKS,
    hyperparams: st.SearchStrategy[dict] | None = None,
    steps: int = 3,
    needs_params: bool = True,
    matrices_only: bool = False,
    dtypes: Iterable[torch.dtype] = FLOAT_DTYPES,
    grad_kinds: Iterable[str] = GRAD_KINDS,
    extra: dict[str, Any] | None = None,
    grad_like_extra: Sequence[str] = (),
    reference: Callable[..., torch.optim.Optimizer] | None = None,
    compile: bool = False,
    max_examples: int | None = None,
    device: str | torch.device = "cpu",
) -> None:
    """Check the library's invariants on the transform `factory(**hyperparams)` builds.

    Over hypothesis-drawn params trees (ranks 0-4, float32/float64/bfloat16) and
    1..`steps` grads trees (normal, all-zero, huge, tiny, mixed magnitudes) it checks:
    "purity" (init/update mutate no input), "state_stability" (state structure, shapes,
    dtypes and devices as at init; every leaf a tensor, on the params' device), "update_structure" (updates
    shaped and typed like the params), "finite_outputs" (finite updates and state for
    finite inputs), "determinism" (a fresh instance gives bitwise-equal updates and
    states), "replay" (the same instance, run again from init and each step again from
    its recorded input state, gives bitwise-equal updates and states: no state is kept
    outside the returned state, such as a step counter in a closure) and "composition"
    (`chain(identity(), t)`, `chain(t, identity())` and `masked(t, all True)` give
    bitwise-equal updates) and "in_place" (where the transform has `affine` or `apply_`,
    the in-place apply of an eager donated step, run on `chain(t)`, gives the params and
    state of `update` then `apply_updates`, to the dtype's `TOLERANCES`). Before any drawn example, one small leaf is tried with one
    step of normal, all-zero, huge and tiny grads (unless `hyperparams` is a strategy,
    then hypothesis's simplest example has all-zero grads). With `reference`, also
    "reference_parity" against a `torch.optim` optimizer in float64; with `compile`,
    "no_recompile" under `torch.compile(fullgraph=True)`.

    Args:
      factory: `factory(**hp) -> Transform` (or a Transform).
      checks: the invariants to run (default `DEFAULT_CHECKS`).
      hyperparams: a strategy of keyword dicts for the factory (see `hyperparams`).
      needs_params: pass params to update; False checks `update(grads, state)`.
      matrices_only: draw only 2-D+ leaves (Muon).
      extra: keywords passed to every update; `grad_like_extra` names keyword trees
        shaped like the grads (non-negative, e.g. Sophia's `hessian`) passed on
        randomly drawn steps.
      reference: `reference(list_of_params, **hp) -> torch.optim.Optimizer`, e.g.
        `torch.optim.AdamW` when the hyperparameter names match.
      compile: also check that steps run under `torch.compile` without recompiling
        (resets dynamo's caches; 10-30 s on a CPU).
      max_examples: hypothesis examples (default: the profile's, at most 25).
      device: where params, grads and extra trees are put (drawn on the CPU, so the
        values are the same on every device), e.g. "cuda".

    Raises:
      InvariantError: an AssertionError naming the invariant, with hypothesis's minimal
        counterexample in the message.

    Examples:
        >>> import purestep.core as ps
        >>> from purestep.core.testing import check_transform
        >>> check_transform(lambda: ps.sgd(0.1, momentum=0.9), max_examples=5)
    """
    factory = as_factory(factory)
    checks = tuple(checks)
    unknown = set(checks) - set(DEFAULT_CHECKS)
    if unknown:
        raise ValueError(f"checks has unknown entries {sorted(unknown)}; choose from {DEFAULT_CHECKS}")
    opts = Options(
        steps,
        needs_params,
        matrices_only,
        tuple(dtypes),
        tuple(grad_kinds),
        tuple(grad_like_extra),
        extra,
        hyperparams,
        device=torch.device(device),
    )

    @given_examples(opts)
    @kit_settings(max_examples)
    def run(ex: Example) -> None:
        t = make_transform(factory, ex)
        ups, states, params = trajectory(t, ex, opts, checks)
        if "determinism" in checks:
            ups2, states2, _ = trajectory(make_transform(factory, ex), ex, opts)
            compare_runs("determinism", "a fresh instance on the same inputs", ups, ups2, "updates")
            compare_runs("determinism", "a fresh instance on the same inputs", states, states2, "states")
        if "replay" in checks:
            _check_replay(t, ex, opts, ups, states, params)
        if "composition" in checks:
            _check_composition(factory, ex, opts, ups, states)
        if "in_place" in checks:
            _check_in_place(t, ex, opts, ups, states, params)

    run_reporting(name_of(factory), run)
    if reference is not None:
        _check_reference(factory, reference, opts, max_examples)
    if compile:
        _check_no_recompile(factory, opts)


def _check_replay(t: ps.Transform, ex: Example, opts: Options, ups: list, states: list, params: list) -> None:
    """The same instance again: from init over the whole example, then each step from its
    recorded input state. A transform whose output depends on anything but its inputs
    (a counter in a closure, a cache) gives different bits the second time."""
    hint = "state kept outside the returned state (a counter or cache in a closure?)"
    what = f"the same instance, replayed from init on the same inputs ({hint})"
    ups2, states2, _ = trajectory(t, ex, opts)
    compare_runs("replay", what, ups, ups2, "updates")
    compare_runs("replay", what, states, states2, "states")
    for k in range(1, len(ups)):
        where = where_in_run(k, ex.grad_kinds[k][0])
        u, s = call_checked(f"update {where}", t.update, ex.grads[k], states[k - 1], params[k], **ex.extras[k])
        for label, a, b in (("updates", ups[k], u), ("state", states[k], s)):
            if leaf := first_difference(a, b):
                raise InvariantError(
                    "replay",
                    f"the same instance, given step {k}'s inputs again, returned different {label} at leaf '{leaf}' ({hint})",
                )


def _check_in_place(t: ps.Transform, ex: Example, opts: Options, ups: list, states: list, params: list) -> None:
    """The in-place forms of `t.update` (`ps.with_in_place`: affine, apply_) against
    `update`: `chain(t)` folds an affine `t` into its apply and hands the rest to `t`'s
    apply_, as `make_update(..., donate=True)` does."""
    if (affine_of(t) is None and apply_of(t) is None) or any(ex.extras):
        return  # nothing beyond `update` to check; `apply_` takes no extra keywords
    wrapped = ps.chain(t)
    for k, u in enumerate(ups):
        where = where_in_run(k, ex.grad_kinds[k][0])
        target = params[k] if opts.needs_params else ex.params
        state_in = states[k - 1] if k else t.init(params[0] if opts.needs_params else ex.params)
        p, s = clone_tree(target), clone_tree((state_in,))
        with torch.no_grad():
            s = call_checked(f"the in-place apply {where}", apply_in_place, wrapped, ex.grads[k], s, p)[0]
        want = ps.apply_updates(target, u)
        on_scale = ps.tree_map(_close_on_scale, want, p, target, u)
        leaf = first_difference(on_scale, ps.tree_map(lambda _: True, on_scale))
        for label, found in (("params", leaf), ("state", first_difference(states[k], s, _close))):
            if found:
                raise InvariantError(
                    "in_place",
                    f"the in-place apply (affine/apply_) {where} gave other {label} than update at leaf '{found}'",
                )


def _close_on_scale(want: Any, got: Any, before: Any, update: Any) -> bool:
    """`_close` for params, with the tolerance on the operands' scale: `p + u` rounds once
    where the in-place `a·p + b·u` rounds twice, so a result that nearly cancels is off by
    the rounding of `p` and `u`, not of itself (bf16: one ulp of |p| can be 0.008)."""
    if not (isinstance(want, Tensor) and want.is_floating_point() and want.dtype in TOLERANCES):
        return same_bits(want, got)
    if want.dtype != got.dtype:
        return False
    rtol, atol = TOLERANCES[want.dtype]
    w, g = want.double(), got.double()
    scale = w.abs() + torch.maximum(before.double().abs(), update.double().abs())
    return bool(((w - g).abs() <= atol + rtol * scale).logical_or(w == g).logical_or(w.isnan() & g.isnan()).all())


def _close(x: Any, y: Any) -> bool:
    """Floating leaves within the dtype's `TOLERANCES` (NaN equals NaN); anything else bitwise."""
    if isinstance(x, Tensor) and x.is_floating_point() and x.dtype in TOLERANCES:
        rtol, atol = TOLERANCES[x.dtype]
        return x.dtype == y.dtype and torch.allclose(x.double(), y.double(), rtol=rtol, atol=atol, equal_nan=True)
    return same_bits(x, y)


def _check_composition(factory, ex: Example, opts: Options, ups: list, states: list) -> None:
    variants = {
        "chain(identity(), t)": (lambda t: ps.chain(ps.identity(), t), lambda s: s[1]),
        "chain(t, identity())": (lambda t: ps.chain(t, ps.identity()), lambda s: s[0]),
        "masked(t, all True)": (
            lambda t: ps.masked(t, lambda p: pytree.tree_map(lambda _: True, p)),
            lambda s: s.inner_state,
        ),
    }
    for label, (wrap, inner) in variants.items():
        got, got_states, _ = trajectory(wrap(make_transform(factory, ex)), ex, opts)
        compare_runs("composition", f"{label} vs t", ups, got, "updates")
        if "masked" not in label:
            compare_runs("composition", f"{label} vs t", states, [inner(s) for s in got_states], "states")
        else:  # the masked inner state is keyed by flat paths: compare leaf by leaf
            for k, (a, b) in enumerate(zip(states, got_states)):
                la, lb = pytree.tree_leaves(a), pytree.tree_leaves(inner(b))
                if len(la) != len(lb) or not all(same_bits(x, y) for x, y in zip(la, lb)):
                    raise InvariantError("composition", f"{label} vs t: states differ at step {k}")


def _check_reference(factory, reference, opts: Options, max_examples: int | None) -> None:
    rtol, atol = TOLERANCES[torch.float64]

    @given_examples(opts)
    @kit_settings(max_examples)
    def run(ex: Example) -> None:
        ex = in_float64(ex)
        ups, _, _ = trajectory(make_transform(factory, ex), ex, opts)
        ref = {k: v.clone().requires_grad_(True) for k, v in ex.params.items()}
        opt = call_checked("the reference", reference, list(ref.values()), **ex.hyperparams)
        params = ex.params
        for k, (u, g) in enumerate(zip(ups, ex.grads)):
            params = ps.apply_updates(params, u)
            for name, p in ref.items():
                p.grad = g[name].clone()
            call_checked("the reference's step", opt.step)
            for name, p in ref.items():
                want = p.detach()
                if not torch.allclose(params[name], want, rtol=rtol, atol=atol):
                    err = (params[name] - want).abs().max().item()
                    raise InvariantError(
                        "reference_parity",
                        f"param '{name}' differs from {type(opt).__name__} after step {k} "
                        f"by {err:.3g} (float64, rtol={rtol}, atol={atol})",
                    )

    run_reporting(name_of(factory), run)


def _check_no_recompile(factory, opts: Options) -> None:
    """A few steps of a compiled `update + apply_updates` with changing grads, counts and
    injected hyperparameters must compile once. A recompile is retried once from a fresh
    compile, so only a reproducible one fails."""
    shapes = [(3, 2), (2, 4)] if opts.matrices_only else [(3, 2), (2,)]
    t = factory()

    def extra_for(params: dict, k: int) -> dict:
        extra = dict(opts.extra or {})
        for name in opts.grad_like_extra:
            extra[name] = grads_like(params, "normal", 100 + k, nonnegative=True)
        return extra

    def step(params, state, grads, extra):
        updates, state = t.update(grads, state, params if opts.needs_params else None, **extra)
        return ps.apply_updates(params, updates), state

    def attempt() -> None:
        params = {f"p{i}": seeded_tensor(s, torch.float32, 1.0, i, opts.device) for i, s in enumerate(shapes)}
        torch._dynamo.reset()  # one code object serves every call of this check
        compiled = torch.compile(step, fullgraph=True)
        state = t.init(params)
        try:
            params, state = compiled(params, state, grads_like(params, "normal", 0), extra_for(params, 0))
        except Exception as error:
            raise InvariantError("no_recompile", f"the step does not compile with fullgraph=True: {error}") from error
        for k in range(1, 4):
            for key, value in ps.get_hyperparams(state).items():
                state = ps.set_hyperparam(state, key, pytree.tree_map(lambda v: v * 0.5, value))
            args = (params, state, grads_like(params, "normal", k), extra_for(params, k))
            try:
                if hasattr(torch.compiler, "set_stance"):
                    with torch.compiler.set_stance("fail_on_recompile"):
                        params, state = compiled(*args)
                else:  # pragma: no cover - torch < 2.6
                    with torch._dynamo.config.patch(error_on_recompile=True):
                        params, state = compiled(*args)
            except Exception as error:
                reason = "\n    ".join(str(error).splitlines()[:8])
                raise InvariantError("no_recompile", f"step {k} recompiled:\n    {reason}") from error

    try:
        attempt()
    except InvariantError as error:
        if "recompiled" not in str(error):
            raise
        attempt()


from ._properties import check_bounded_updates as check_bounded_updates  # noqa: E402
from ._properties import check_decoupled_decay as check_decoupled_decay  # noqa: E402
from ._properties import check_scale_invariance as check_scale_invariance  # noqa: E402
from ._properties import check_schedule as check_schedule  # noqa: E402
