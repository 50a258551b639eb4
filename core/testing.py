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

Example:
    >>> import purestep.core as ps
    >>> from purestep.core.testing import check_transform
    >>> check_transform(lambda: ps.adamw(1e-2), max_examples=5)
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Iterable, Sequence

import torch
import torch.utils._pytree as pytree
from torch import Tensor

import purestep.core as ps

try:
    import hypothesis
    from hypothesis import strategies as st
except ImportError as error:  # pragma: no cover - exercised only without hypothesis
    raise ImportError(
        "purestep.core.testing needs hypothesis: pip install hypothesis (or purestep[test])"
    ) from error

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

FLOAT_DTYPES = (torch.float32, torch.float64, torch.bfloat16)
# Grad magnitudes drawn; hypothesis tries the first in its simplest example and shrinks toward it.
GRAD_KINDS = ("zeros", "normal", "huge", "tiny", "mixed")
_MAGNITUDE = {"normal": 1.0, "zeros": 0.0, "huge": 1e10, "tiny": 1e-10}

# One per-dtype tolerance table (rtol, atol) for every numeric comparison in the kit.
TOLERANCES: dict[torch.dtype, tuple[float, float]] = {
    torch.float64: (1e-9, 1e-12),
    torch.float32: (1e-5, 1e-7),
    torch.bfloat16: (2e-2, 1e-3),
}

DEFAULT_CHECKS = (
    "purity", "state_stability", "update_structure", "finite_outputs", "determinism", "replay", "composition"
)


class InvariantError(AssertionError):
    """An invariant that a transform or schedule broke; the message starts with its name."""

    def __init__(self, invariant: str, message: str):
        super().__init__(f"{invariant}: {message}")
        self.invariant = invariant


# --------------------------------------------------------------------------- #
# Building trees from small, readable descriptions (what hypothesis shrinks).
# --------------------------------------------------------------------------- #


def _tensor(shape: Sequence[int], dtype: torch.dtype, magnitude: float, seed: int, device: Any = "cpu") -> Tensor:
    gen = torch.Generator().manual_seed(seed)  # drawn on the CPU: the same values on every device
    return (torch.randn(tuple(shape), generator=gen, dtype=torch.float64) * magnitude).to(device=device, dtype=dtype)


def _grads_like(params: dict[str, Tensor], kind: str, seed: int, *, nonnegative: bool = False) -> dict[str, Tensor]:
    out = {}
    for i, (name, p) in enumerate(params.items()):
        leaf_kind = ("normal", "zeros", "huge", "tiny")[(seed + i) % 4] if kind == "mixed" else kind
        g = _tensor(p.shape, p.dtype, _MAGNITUDE[leaf_kind], seed * 1009 + i, p.device)
        out[name] = g.abs() if nonnegative else g
    return out


def _brief(t: Tensor) -> str:
    name = str(t.dtype).replace("torch.", "")
    text = f"{name}{list(t.shape)}"
    if t.numel() <= 3:
        text += f"={[round(v, 4) for v in t.double().reshape(-1).tolist()]}"
    return text


class Example:
    """One drawn input for the checks: params, then per step a grads kind and seed
    (printed briefly, as hypothesis's counterexample)."""

    def __init__(self, params, param_seed, grads, grad_kinds, extras, hyperparams):
        self.params: dict[str, Tensor] = params
        self.param_seed: int = param_seed
        self.grads: list[dict[str, Tensor]] = grads
        self.grad_kinds: list[tuple[str, int]] = grad_kinds
        self.extras: list[dict[str, Any]] = extras
        self.hyperparams: dict[str, Any] = hyperparams

    def replace(self, **changes: Any) -> "Example":
        fields = dict(vars(self), **changes)
        return Example(**fields)

    def __repr__(self) -> str:
        params = "{" + ", ".join(f"{k!r}: {_brief(v)}" for k, v in self.params.items()) + "}"
        grads = ", ".join(k if k == "zeros" else f"{k}(seed={s})" for k, s in self.grad_kinds)
        extra = "".join(f"; step {i} extra {sorted(e)}" for i, e in enumerate(self.extras) if e)
        hp = f"; hyperparams {self.hyperparams}" if self.hyperparams else ""
        return f"Example(params={params} (seed={self.param_seed}); grads per step: [{grads}]{extra}{hp})"


# --------------------------------------------------------------------------- #
# Strategies.
# --------------------------------------------------------------------------- #

_seeds = st.integers(min_value=0, max_value=2**16)


def _layouts(min_leaves, max_leaves, min_rank, max_rank, max_side, dtypes):
    leaf = st.tuples(
        st.lists(st.integers(1, max_side), min_size=min_rank, max_size=max_rank).map(tuple),
        st.sampled_from(tuple(dtypes)),
    )
    return st.lists(leaf, min_size=min_leaves, max_size=max_leaves)


def _build_params(layout, seed: int, zero: bool, device: Any = "cpu") -> dict[str, Tensor]:
    return {
        f"p{i}": _tensor(shape, dtype, 0.0 if zero else 1.0, seed + i, device) for i, (shape, dtype) in enumerate(layout)
    }


def param_trees(
    *,
    min_leaves: int = 1,
    max_leaves: int = 4,
    min_rank: int = 0,
    max_rank: int = 4,
    max_side: int = 3,
    dtypes: Iterable[torch.dtype] = FLOAT_DTYPES,
    zeros: bool = True,
) -> st.SearchStrategy[dict[str, Tensor]]:
    """Params trees `{"p0": tensor, ...}`: ranks `min_rank..max_rank`, sides `1..max_side`
    (size-1 dims included), dtypes from `dtypes`, values N(0, 1) (or all zero, a bias at init).

    Example:
        >>> from hypothesis import given
        >>> from purestep.core.testing import param_trees
        >>> @given(param_trees(max_rank=2))
        ... def test(params):
        ...     assert all(p.dim() <= 2 for p in params.values())
        >>> test()
    """
    return st.builds(
        _build_params,
        _layouts(min_leaves, max_leaves, min_rank, max_rank, max_side, dtypes),
        _seeds,
        st.booleans() if zeros else st.just(False),
    )


def grad_trees(params: dict[str, Tensor], kinds: Iterable[str] = GRAD_KINDS) -> st.SearchStrategy[dict[str, Tensor]]:
    """Grads trees matching `params` leaf for leaf (shape and dtype), of a magnitude drawn
    from `kinds`: "normal" N(0, 1), "zeros", "huge" (1e10), "tiny" (1e-10), "mixed" (per leaf)."""
    kinds = tuple(kinds)
    unknown = set(kinds) - set(GRAD_KINDS)
    if unknown:
        raise ValueError(f"kinds has unknown entries {sorted(unknown)}; choose from {GRAD_KINDS}")
    return st.builds(lambda kind, seed: _grads_like(params, kind, seed), st.sampled_from(kinds), _seeds)


def _log_uniform(lo: float, hi: float) -> st.SearchStrategy[float]:
    return st.floats(math.log(lo), math.log(hi)).map(math.exp)


_HYPERPARAMS: dict[str, Callable[[], st.SearchStrategy]] = {
    "lr": lambda: _log_uniform(1e-4, 1.0),
    "weight_decay": lambda: st.floats(0.0, 0.2),
    "momentum": lambda: st.floats(0.0, 0.99),
    "eps": lambda: _log_uniform(1e-10, 1e-6),
    "betas": lambda: st.tuples(st.floats(0.0, 0.99), st.floats(0.9, 0.9999)),
}


def hyperparams(*names: str, **strategies: st.SearchStrategy) -> st.SearchStrategy[dict[str, Any]]:
    """Keyword dicts of hyperparameters in their usual ranges, to call a factory with.

    Known names: lr (1e-4..1, log), weight_decay (0..0.2), momentum (0..0.99),
    eps (1e-10..1e-6, log), betas ((0..0.99), (0.9..0.9999)); any other name takes a
    strategy as a keyword.

    Example:
        >>> from hypothesis import strategies as st
        >>> from purestep.core.testing import hyperparams
        >>> hp = hyperparams("lr", "betas", weight_decay=st.just(0.0))
    """
    fields = {}
    for name in names:
        if name not in _HYPERPARAMS:
            raise ValueError(f"no default range for {name!r}; pass it as {name}=<strategy>, or one of {sorted(_HYPERPARAMS)}")
        fields[name] = _HYPERPARAMS[name]()
    fields.update(strategies)
    return st.fixed_dictionaries(fields)


@dataclasses.dataclass(frozen=True)
class _Options:
    steps: int = 3
    needs_params: bool = True
    matrices_only: bool = False
    dtypes: tuple = FLOAT_DTYPES
    kinds: tuple = GRAD_KINDS
    grad_like_extra: tuple = ()
    extra: Any = None
    hyperparams: Any = None
    max_leaves: int = 4
    device: Any = "cpu"


def _example(opts: _Options, layout, param_seed: int, kinds: list, with_extra: Callable[[int], bool], hp: dict) -> Example:
    params = _build_params(layout, param_seed, zero=False, device=opts.device)
    grads = [_grads_like(params, k, s) for k, s in kinds]
    extras = []
    for i in range(len(kinds)):
        extra = dict(opts.extra or {})
        for name in opts.grad_like_extra:
            if with_extra(i):
                extra[name] = _grads_like(params, "normal", 7919 + 31 * i + kinds[i][1], nonnegative=True)
        extras.append(extra)
    return Example(params, param_seed, grads, kinds, extras, hp)


@st.composite
def _examples(draw, opts: _Options) -> Example:
    layout = draw(_layouts(1, opts.max_leaves, 2 if opts.matrices_only else 0, 4, 3, opts.dtypes))
    param_seed = draw(_seeds)
    kinds = draw(st.lists(st.tuples(st.sampled_from(opts.kinds), _seeds), min_size=1, max_size=opts.steps))
    flags = [draw(st.booleans()) for _ in kinds] if opts.grad_like_extra else []
    hp = draw(opts.hyperparams) if opts.hyperparams is not None else {}
    return _example(opts, layout, param_seed, kinds, lambda i: flags[i], hp)


def _edge_examples(opts: _Options) -> list[Example]:
    """One small leaf, one step of each grad kind: tried first, whatever hypothesis draws.

    Hypothesis's derandomized draws differ between its versions and even between runs
    in one process, so edge grads (all-zero, huge, tiny) are never left to chance.
    Without fixed hyperparameters (a `hyperparams` strategy) there are none.
    """
    if opts.hyperparams is not None:
        return []
    layout = [((2, 3) if opts.matrices_only else (), opts.dtypes[0])]
    kinds = [k for k in ("normal", "zeros", "huge", "tiny") if k in opts.kinds]
    return [_example(opts, layout, 0, [(k, 0)], lambda i: True, {}) for k in kinds]


def _given(opts: _Options, *more: st.SearchStrategy) -> Callable:
    """`hypothesis.given(examples, *more)` with the edge examples tried first."""

    def decorate(test: Callable) -> Callable:
        if not more:
            for ex in reversed(_edge_examples(opts)):  # run top to bottom: in the listed order
                test = hypothesis.example(ex)(test)
        return hypothesis.given(_examples(opts), *more)(test)

    return decorate


# --------------------------------------------------------------------------- #
# Tree comparisons.
# --------------------------------------------------------------------------- #


def _clone(tree: Any) -> Any:
    return pytree.tree_map(lambda x: x.detach().clone() if isinstance(x, Tensor) else x, tree)


def _bits(x: Tensor) -> Tensor:
    return x.detach().reshape(-1).contiguous().view(torch.uint8)


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, Tensor) and isinstance(b, Tensor):
        return a.dtype == b.dtype and a.shape == b.shape and torch.equal(_bits(a), _bits(b))
    return type(a) is type(b) and a == b


def _first_difference(a: Any, b: Any) -> str | None:
    """The dotted path of the first leaf where `a` and `b` differ bitwise ('<structure>' if trees differ)."""
    pa, sa = ps.tree_flatten_with_path(a)
    pb, sb = ps.tree_flatten_with_path(b)
    if sa != sb:
        return "<structure>"
    for (path, x), (_, y) in zip(pa, pb):
        if not _same(x, y):
            return path or "<root>"
    return None


def _where(step: int, kind: str) -> str:
    return f"at step {step} ({'all-zero' if kind == 'zeros' else kind} grads)"


def _call(what: str, fn: Callable, *args, **kwargs):
    try:
        return fn(*args, **kwargs)
    except AssertionError:
        raise
    except Exception as error:
        raise InvariantError("no_exception", f"{what} raised {type(error).__name__}: {error}") from error


def _wrap(name: str, run: Callable[[], None]) -> None:
    """Run a hypothesis test; re-raise its failure with the counterexample in the message."""
    try:
        run()
    except hypothesis.errors.Flaky as error:  # failed once, passed on replay: hidden state somewhere
        inner = [e for e in getattr(error, "exceptions", ()) if isinstance(e, AssertionError)]
        cause = f"; first failure: {inner[0]}" if inner else ""
        raise InvariantError(
            "determinism", f"the check failed once and passed when hypothesis replayed it{cause}\n  checking {name}"
        ) from error
    except AssertionError as error:
        notes = "\n".join(getattr(error, "__notes__", []))
        invariant = getattr(error, "invariant", "assertion")
        message = str(error).split(": ", 1)[-1] if isinstance(error, InvariantError) else str(error)
        raise InvariantError(
            invariant, f"{message}\n  checking {name}\n  minimal counterexample:\n{notes}"
        ) from error


def _settings(max_examples: int | None) -> hypothesis.settings:
    current = hypothesis.settings()
    n = max_examples if max_examples is not None else min(current.max_examples, 25)
    return hypothesis.settings(
        current,
        max_examples=n,
        deadline=None,
        database=None,
        report_multiple_bugs=False,
        # No explain/target phases: they rerun failing examples many times, for notes we do not need.
        phases=[hypothesis.Phase.explicit, hypothesis.Phase.reuse, hypothesis.Phase.generate, hypothesis.Phase.shrink],
        suppress_health_check=list(hypothesis.HealthCheck),
    )


def _name(factory: Any) -> str:
    name = getattr(factory, "__qualname__", None) or repr(factory)
    code = getattr(factory, "__code__", None)
    return f"{name} ({code.co_filename}:{code.co_firstlineno})" if code is not None else name


def _factory(factory: Callable[..., ps.Transform] | ps.Transform) -> Callable[..., ps.Transform]:
    if isinstance(factory, ps.Transform):
        return lambda **hp: factory
    return factory


def _make(factory: Callable[..., ps.Transform], ex: Example) -> ps.Transform:
    t = _call("the factory", factory, **ex.hyperparams)
    if not isinstance(t, ps.Transform):
        raise InvariantError("no_exception", f"the factory returned {type(t).__name__}, not a ps.Transform")
    return t


# --------------------------------------------------------------------------- #
# Running a transform along an example, checking per-step invariants.
# --------------------------------------------------------------------------- #


def _is_float(x: Any) -> bool:
    return isinstance(x, Tensor) and (torch.is_floating_point(x) or torch.is_complex(x))


def _trajectory(
    t: ps.Transform,
    ex: Example,
    opts: _Options,
    checks: Iterable[str] = (),
    *,
    grads: list | None = None,
    params: Callable[[int, Any], Any] | None = None,
) -> tuple[list, list, list]:
    """Updates, states and the params passed at each step; params evolve by the updates
    unless `params(step, evolved)` picks them."""
    checks = set(checks)
    grads = ex.grads if grads is None else grads
    current = ex.params
    p0 = params(0, current) if params is not None else current
    snapshot = _clone(p0)
    state = _call("init", t.init, p0)
    if "purity" in checks and (where := _first_difference(p0, snapshot)):
        raise InvariantError("purity", f"init mutated its params input at leaf '{where}'")
    init_spec = ps.tree_flatten_with_path(state)
    if "state_stability" in checks:
        for path, leaf in init_spec[0]:
            if not isinstance(leaf, Tensor):
                raise InvariantError(
                    "state_stability",
                    f"init state leaf '{path}' is {type(leaf).__name__} {leaf!r}, not a tensor "
                    "(a Python number in state is baked into a compiled step and is not checkpointed)",
                )
    updates_seq, states, params_seq = [], [], []
    for k, (g, extra) in enumerate(zip(grads, ex.extras)):
        kind = ex.grad_kinds[k][0]
        p = (params(k, current) if params is not None else current) if opts.needs_params else None
        before = _clone((g, state, p, extra)) if "purity" in checks else None
        u, new_state = _call(f"update {_where(k, kind)}", t.update, g, state, p, **extra)
        if before is not None:
            for label, now, then in zip(("grads", "state", "params", "extra keywords"), (g, state, p, extra), before):
                if where := _first_difference(now, then):
                    raise InvariantError("purity", f"update mutated its {label} input at leaf '{where}' {_where(k, kind)}")
        if "state_stability" in checks:
            _check_state(new_state, init_spec, k, kind)
        if "update_structure" in checks:
            _check_updates(u, g, k, kind)
        if "finite_outputs" in checks:
            for label, tree in (("updates", u), ("state", new_state)):
                for path, leaf in ps.tree_flatten_with_path(tree)[0]:
                    if _is_float(leaf) and not bool(torch.isfinite(leaf).all()):
                        raise InvariantError(
                            "finite_outputs", f"{label} leaf '{path}' is not finite {_where(k, kind)}: {_brief(leaf)}"
                        )
        updates_seq.append(u)
        states.append(new_state)
        params_seq.append(p)
        state = new_state
        if opts.needs_params:
            current = _call("ps.apply_updates", ps.apply_updates, current, u)
    return updates_seq, states, params_seq


def _check_updates(u: Any, g: Any, k: int, kind: str) -> None:
    got, spec = ps.tree_flatten_with_path(u)
    want, want_spec = ps.tree_flatten_with_path(g)
    if spec != want_spec:
        raise InvariantError(
            "update_structure",
            f"updates have leaves {[p for p, _ in got]} but grads/params have {[p for p, _ in want]} {_where(k, kind)}",
        )
    for (path, x), (_, y) in zip(got, want):
        if not isinstance(x, Tensor) or x.shape != y.shape or x.dtype != y.dtype or x.device != y.device:
            what = _brief(x) if isinstance(x, Tensor) else type(x).__name__
            raise InvariantError(
                "update_structure", f"update leaf '{path}' is {what} but its param is {_brief(y)} {_where(k, kind)}"
            )


def _check_state(state: Any, init_spec: tuple, k: int, kind: str) -> None:
    got, spec = ps.tree_flatten_with_path(state)
    want, want_spec = init_spec
    if spec != want_spec:
        raise InvariantError(
            "state_stability",
            f"state structure changed {_where(k, kind)}: leaves {[p for p, _ in got]} after init's {[p for p, _ in want]}",
        )
    for (path, x), (_, y) in zip(got, want):
        if not isinstance(x, Tensor):
            raise InvariantError("state_stability", f"state leaf '{path}' became {type(x).__name__} {_where(k, kind)}")
        if x.shape != y.shape or x.dtype != y.dtype or x.device != y.device:
            raise InvariantError(
                "state_stability",
                f"state leaf '{path}' changed from {_brief(y)} at init to {_brief(x)} {_where(k, kind)}",
            )


def _compare_runs(invariant: str, what: str, ref: Sequence, got: Sequence, label: str) -> None:
    for k, (a, b) in enumerate(zip(ref, got)):
        if where := _first_difference(a, b):
            raise InvariantError(invariant, f"{what}: {label} differ at step {k}, leaf '{where}'")


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
    dtypes and devices as at init; every leaf a tensor), "update_structure" (updates
    shaped and typed like the params), "finite_outputs" (finite updates and state for
    finite inputs), "determinism" (a fresh instance gives bitwise-equal updates and
    states), "replay" (the same instance, run again from init and each step again from
    its recorded input state, gives bitwise-equal updates and states: no state is kept
    outside the returned state, such as a step counter in a closure) and "composition"
    (`chain(identity(), t)`, `chain(t, identity())` and `masked(t, all True)` give
    bitwise-equal updates). Before any drawn example, one small leaf is tried with one
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
      InvariantError (an AssertionError) naming the invariant, with hypothesis's
      minimal counterexample in the message.

    Example:
        >>> import purestep.core as ps
        >>> from purestep.core.testing import check_transform
        >>> check_transform(lambda: ps.sgd(0.1, momentum=0.9), max_examples=5)
    """
    factory = _factory(factory)
    checks = tuple(checks)
    unknown = set(checks) - set(DEFAULT_CHECKS)
    if unknown:
        raise ValueError(f"checks has unknown entries {sorted(unknown)}; choose from {DEFAULT_CHECKS}")
    opts = _Options(
        steps, needs_params, matrices_only, tuple(dtypes), tuple(grad_kinds), tuple(grad_like_extra), extra, hyperparams,
        device=torch.device(device),
    )

    @_given(opts)
    @_settings(max_examples)
    def run(ex: Example) -> None:
        t = _make(factory, ex)
        ups, states, params = _trajectory(t, ex, opts, checks)
        if "determinism" in checks:
            ups2, states2, _ = _trajectory(_make(factory, ex), ex, opts)
            _compare_runs("determinism", "a fresh instance on the same inputs", ups, ups2, "updates")
            _compare_runs("determinism", "a fresh instance on the same inputs", states, states2, "states")
        if "replay" in checks:
            _check_replay(t, ex, opts, ups, states, params)
        if "composition" in checks:
            _check_composition(factory, ex, opts, ups, states)

    _wrap(_name(factory), run)
    if reference is not None:
        _check_reference(factory, reference, opts, max_examples)
    if compile:
        _check_no_recompile(factory, opts)


def _check_replay(t: ps.Transform, ex: Example, opts: _Options, ups: list, states: list, params: list) -> None:
    """The same instance again: from init over the whole example, then each step from its
    recorded input state. A transform whose output depends on anything but its inputs
    (a counter in a closure, a cache) gives different bits the second time."""
    hint = "state kept outside the returned state (a counter or cache in a closure?)"
    ups2, states2, _ = _trajectory(t, ex, opts)
    _compare_runs("replay", f"the same instance, replayed from init on the same inputs ({hint})", ups, ups2, "updates")
    _compare_runs("replay", f"the same instance, replayed from init on the same inputs ({hint})", states, states2, "states")
    for k in range(1, len(ups)):
        u, s = _call(f"update {_where(k, ex.grad_kinds[k][0])}", t.update, ex.grads[k], states[k - 1], params[k], **ex.extras[k])
        for label, a, b in (("updates", ups[k], u), ("state", states[k], s)):
            if where := _first_difference(a, b):
                raise InvariantError(
                    "replay", f"the same instance, given step {k}'s inputs again, returned different {label} at leaf '{where}' ({hint})"
                )


def _check_composition(factory, ex: Example, opts: _Options, ups: list, states: list) -> None:
    variants = {
        "chain(identity(), t)": (lambda t: ps.chain(ps.identity(), t), lambda s: s[1]),
        "chain(t, identity())": (lambda t: ps.chain(t, ps.identity()), lambda s: s[0]),
        "masked(t, all True)": (
            lambda t: ps.masked(t, lambda p: pytree.tree_map(lambda _: True, p)),
            lambda s: s.inner_state,
        ),
    }
    for label, (wrap, inner) in variants.items():
        got, got_states, _ = _trajectory(wrap(_make(factory, ex)), ex, opts)
        _compare_runs("composition", f"{label} vs t", ups, got, "updates")
        if "masked" not in label:
            _compare_runs("composition", f"{label} vs t", states, [inner(s) for s in got_states], "states")
        else:  # the masked inner state is keyed by flat paths: compare leaf by leaf
            for k, (a, b) in enumerate(zip(states, got_states)):
                la, lb = pytree.tree_leaves(a), pytree.tree_leaves(inner(b))
                if len(la) != len(lb) or not all(_same(x, y) for x, y in zip(la, lb)):
                    raise InvariantError("composition", f"{label} vs t: states differ at step {k}")


def _float64(ex: Example) -> Example:
    cast = lambda tree: ps.tree_cast(tree, torch.float64)  # noqa: E731
    return ex.replace(
        params=cast(ex.params), grads=[cast(g) for g in ex.grads], extras=[cast(e) for e in ex.extras]
    )


def _check_reference(factory, reference, opts: _Options, max_examples: int | None) -> None:
    rtol, atol = TOLERANCES[torch.float64]

    @_given(opts)
    @_settings(max_examples)
    def run(ex: Example) -> None:
        ex = _float64(ex)
        ups, _, _ = _trajectory(_make(factory, ex), ex, opts)
        ref = {k: v.clone().requires_grad_(True) for k, v in ex.params.items()}
        opt = _call("the reference", reference, list(ref.values()), **ex.hyperparams)
        params = ex.params
        for k, (u, g) in enumerate(zip(ups, ex.grads)):
            params = ps.apply_updates(params, u)
            for name, p in ref.items():
                p.grad = g[name].clone()
            _call("the reference's step", opt.step)
            for name, p in ref.items():
                want = p.detach()
                if not torch.allclose(params[name], want, rtol=rtol, atol=atol):
                    err = (params[name] - want).abs().max().item()
                    raise InvariantError(
                        "reference_parity",
                        f"param '{name}' differs from {type(opt).__name__} after step {k} "
                        f"by {err:.3g} (float64, rtol={rtol}, atol={atol})",
                    )

    _wrap(_name(factory), run)


def _check_no_recompile(factory, opts: _Options) -> None:
    """A few steps of a compiled `update + apply_updates` with changing grads, counts and
    injected hyperparameters must compile once. A recompile is retried once from a fresh
    compile, so only a reproducible one fails."""
    shapes = [(3, 2), (2, 4)] if opts.matrices_only else [(3, 2), (2,)]
    t = factory()

    def extra_for(params: dict, k: int) -> dict:
        extra = dict(opts.extra or {})
        for name in opts.grad_like_extra:
            extra[name] = _grads_like(params, "normal", 100 + k, nonnegative=True)
        return extra

    def step(params, state, grads, extra):
        updates, state = t.update(grads, state, params if opts.needs_params else None, **extra)
        return ps.apply_updates(params, updates), state

    def attempt() -> None:
        params = {f"p{i}": _tensor(s, torch.float32, 1.0, i, opts.device) for i, s in enumerate(shapes)}
        torch._dynamo.reset()  # one code object serves every call of this check
        compiled = torch.compile(step, fullgraph=True)
        state = t.init(params)
        try:
            params, state = compiled(params, state, _grads_like(params, "normal", 0), extra_for(params, 0))
        except Exception as error:
            raise InvariantError("no_recompile", f"the step does not compile with fullgraph=True: {error}") from error
        for k in range(1, 4):
            for name, hp in _injected(state):
                state = ps.tree_set(state, name, pytree.tree_map(lambda v: v * 0.5, hp))
            args = (params, state, _grads_like(params, "normal", k), extra_for(params, k))
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


def _injected(state: Any) -> list[tuple[str, Any]]:
    try:
        return [("hyperparams", ps.tree_get(state, "hyperparams"))]
    except KeyError:  # none, or several (then leave them as they are)
        return []


# --------------------------------------------------------------------------- #
# Opt-in properties (run in float64: they are about the math, not the rounding).
# --------------------------------------------------------------------------- #


def _property(
    name: str,
    factory,
    body: Callable[[Callable[[], ps.Transform], Example, _Options], None],
    opts: _Options,
    max_examples: int | None,
) -> None:
    factory = _factory(factory)

    @_given(opts)
    @_settings(max_examples)
    def run(ex: Example) -> None:
        ex = _float64(ex)
        body(lambda: _make(factory, ex), ex, opts)

    _wrap(_name(factory), run)


def _opts(kw: dict, **override) -> _Options:
    kw = {**kw, **override}
    return _Options(
        steps=kw.get("steps", 3),
        needs_params=kw.get("needs_params", True),
        matrices_only=kw.get("matrices_only", False),
        dtypes=(torch.float64,),
        kinds=tuple(kw.get("grad_kinds", GRAD_KINDS)),
        grad_like_extra=tuple(kw.get("grad_like_extra", ())),
        extra=kw.get("extra"),
        hyperparams=kw.get("hyperparams"),
        device=torch.device(kw.get("device", "cpu")),
    )


def check_decoupled_decay(
    factory: Callable[..., ps.Transform] | ps.Transform, *, coefficient: float | None = None, max_examples: int | None = None, **kw: Any
) -> None:
    """Check "decoupled_decay": the update's dependence on params is `c·p`, a pure
    multiple of p (c ≤ 0, the same for every decayed leaf), not routed through the
    preconditioner or the state as L2 decay is.

    Runs the same grads twice, with the evolving params and with zero params, and
    requires `u(p) - u(0) = c·p`; with `coefficient` (e.g. `-lr·weight_decay`) c must equal it
    on every decayed leaf. Keywords as `check_transform` (steps, matrices_only, extra, ...).

    Example:
        >>> import purestep.core as ps
        >>> from purestep.core.testing import check_decoupled_decay
        >>> check_decoupled_decay(lambda: ps.adamw(0.1, weight_decay=0.1), coefficient=-0.01, max_examples=5)
    """

    def body(make, ex: Example, opts: _Options) -> None:
        ups, _, params = _trajectory(make(), ex, opts)
        zero, _, _ = _trajectory(make(), ex, opts, params=lambda k, p: ps.tree_zeros_like(p))
        seen = False
        for k, (u, u0, p) in enumerate(zip(ups, zero, params)):
            coefs = {}
            for name in p:
                d, x = u[name] - u0[name], p[name]
                pp = (x * x).sum()
                scale = u[name].abs().max() + u0[name].abs().max() + 1e-300
                if pp == 0:
                    if d.abs().max() > 1e-9 * scale:
                        raise InvariantError("decoupled_decay", f"leaf '{name}' is zero but u(p) - u(0) is not, at step {k}")
                    continue
                c = (d * x).sum() / pp
                residual = (d - c * x).abs().max()
                if residual > 1e-9 * scale:
                    raise InvariantError(
                        "decoupled_decay",
                        f"at step {k}, leaf '{name}': u(p) - u(0) is not a multiple of p (residual {residual:.3g} "
                        f"of update scale {scale:.3g}); the decay goes through the preconditioner or state (L2 decay?)",
                    )
                if c > 1e-12:
                    raise InvariantError("decoupled_decay", f"at step {k}, leaf '{name}' grows with p (c = {c:.3g} > 0)")
                if abs(c) > 1e-12:
                    coefs[name] = c.item()
            if coefs:
                seen = True
                first = next(iter(coefs.values()))
                for name, c in coefs.items():
                    if not math.isclose(c, first, rel_tol=1e-6):
                        raise InvariantError(
                            "decoupled_decay", f"at step {k}, leaves decay at different rates: {coefs} (L2 decay?)"
                        )
                    if coefficient is not None and not math.isclose(c, coefficient, rel_tol=1e-6):
                        raise InvariantError(
                            "decoupled_decay", f"at step {k}, leaf '{name}' decays with c = {c:.6g}, expected {coefficient}"
                        )
        if not seen and any(float((x * x).sum()) > 0 for x in params[0].values()):
            raise InvariantError("decoupled_decay", "no decay observed: the updates do not depend on params")

    _property("decoupled_decay", factory, body, _opts(kw), max_examples)


def check_scale_invariance(
    factory: Callable[..., ps.Transform] | ps.Transform,
    *,
    scales: tuple[float, float] = (1e-2, 1e2),
    rtol: float = 1e-4,
    max_examples: int | None = None,
    **kw: Any,
) -> None:
    """Check "scale_invariance": multiplying every grad by c > 0 (c drawn in `scales`)
    leaves the updates unchanged up to `eps` (Adam family).

    Grads are normal or all-zero (tiny grads are where eps dominates, by design).
    Keywords as `check_transform`.

    Example:
        >>> import purestep.core as ps
        >>> from purestep.core.testing import check_scale_invariance
        >>> check_scale_invariance(lambda: ps.adam(1e-2), max_examples=5)
    """
    opts = _opts(kw, grad_kinds=("normal", "zeros"))

    @_given(opts, _log_uniform(*scales))
    @_settings(max_examples)
    def run(ex: Example, c: float) -> None:
        ex = _float64(ex)
        # Bounded away from zero, so eps never dominates an element.
        grads = [{k: torch.sign(v) * (0.1 + v.abs()) if v.any() else v for k, v in g.items()} for g in ex.grads]
        ex = ex.replace(grads=grads)
        f = _factory(factory)
        ups, _, params = _trajectory(_make(f, ex), ex, opts)
        scaled, _, _ = _trajectory(
            _make(f, ex), ex, opts, grads=[{k: v * c for k, v in g.items()} for g in grads],
            params=(lambda k, p: params[k]) if opts.needs_params else None,
        )
        top = max((v.abs().max().item() for u in ups for v in u.values()), default=0.0)
        for k, (u, us) in enumerate(zip(ups, scaled)):
            for name in u:
                err = (us[name] - u[name]).abs()
                if bool((err > rtol * (u[name].abs() + top)).any()):
                    raise InvariantError(
                        "scale_invariance",
                        f"grads × {c:.4g} change leaf '{name}' at step {k} by {err.max().item():.3g} "
                        f"(largest update {top:.3g})",
                    )

    _wrap(_name(factory), run)


def check_bounded_updates(
    factory: Callable[..., ps.Transform] | ps.Transform, bound: float, *, max_examples: int | None = None, **kw: Any
) -> None:
    """Check "bounded_updates": |u| ≤ `bound` elementwise for any grads (sign-based
    optimizers: bound = lr; Sophia: lr). Params are zero, so decoupled decay adds nothing.
    Keywords as `check_transform`.

    Example:
        >>> import purestep.core as ps
        >>> from purestep.core.testing import check_bounded_updates
        >>> check_bounded_updates(lambda: ps.lion(1e-3, weight_decay=0.1), bound=1e-3, max_examples=5)
    """

    def body(make, ex: Example, opts: _Options) -> None:
        ups, _, _ = _trajectory(make(), ex, opts, params=lambda k, p: ps.tree_zeros_like(p))
        for k, u in enumerate(ups):
            for path, v in ps.tree_flatten_with_path(u)[0]:
                if bool((v.abs() > bound * (1 + 1e-9)).any()):
                    raise InvariantError(
                        "bounded_updates",
                        f"|update| reaches {v.abs().max().item():.6g} > {bound} at leaf '{path}', step {k} "
                        f"({ex.grad_kinds[k][0]} grads)",
                    )

    _property("bounded_updates", factory, body, _opts(kw), max_examples)


# --------------------------------------------------------------------------- #
# Schedules.
# --------------------------------------------------------------------------- #


def check_schedule(
    schedule: Callable[[Any], Any],
    *,
    steps: int,
    boundaries: Sequence[int] | None = None,
    bounds: tuple[float, float] | None = None,
    continuous: bool = True,
    max_turns: int | None = None,
    jump_factor: float = 3.0,
) -> None:
    """Check a `step -> value` callable over steps 0..`steps` (exhaustively, no hypothesis).

    Invariants: "tensor_steps" (a 0-d float64 tensor step, as optimizers pass, gives a
    finite 0-d tensor equal to the value at the int step); "bounds" (values in `bounds`);
    "monotone_phases" (between consecutive `boundaries` the schedule never changes
    direction; without boundaries it turns at most `max_turns` times, if given);
    "continuity" (with `continuous`, no step changes the value by more than
    `jump_factor` times both neighbouring steps' changes: phases join without a jump).

    Example:
        >>> import torch
        >>> from purestep.core.testing import check_schedule
        >>> warmup = lambda t: torch.clamp(torch.as_tensor(t, dtype=torch.float64) / 10, max=1.0)
        >>> check_schedule(warmup, steps=30, boundaries=[10], bounds=(0.0, 1.0))
    """
    values = []
    for k in range(steps + 1):
        at_int = _call(f"schedule({k})", schedule, k)
        at_tensor = _call(f"schedule(tensor({k}.))", schedule, torch.tensor(float(k), dtype=torch.float64))
        if not isinstance(at_tensor, Tensor) or at_tensor.dim() != 0:
            raise InvariantError(
                "tensor_steps", f"schedule(tensor({k}.)) returned {at_tensor!r}, not a 0-d tensor (compile-safe)"
            )
        a, b = float(at_int), float(at_tensor)
        if not (math.isfinite(a) and math.isfinite(b)):
            raise InvariantError("tensor_steps", f"schedule is not finite at step {k}: {a} (int step), {b} (tensor step)")
        if not math.isclose(a, b, rel_tol=1e-6, abs_tol=1e-12):
            raise InvariantError("tensor_steps", f"schedule({k}) = {a} but schedule(tensor({k}.)) = {b}")
        values.append(a)
    span = max(values) - min(values)
    tol = 1e-9 * max(span, max(abs(v) for v in values), 1e-300)
    if bounds is not None:
        lo, hi = bounds
        for k, v in enumerate(values):
            if not lo - tol <= v <= hi + tol:
                raise InvariantError("bounds", f"schedule({k}) = {v} is outside [{lo}, {hi}]")
    deltas = [b - a for a, b in zip(values, values[1:])]
    if continuous:
        for k, d in enumerate(deltas):
            near = [abs(deltas[j]) for j in (k - 1, k + 1) if 0 <= j < len(deltas)]
            if near and abs(d) > jump_factor * max(near) + tol:
                raise InvariantError(
                    "continuity",
                    f"the schedule jumps from {values[k]:.6g} at step {k} to {values[k + 1]:.6g} at step {k + 1} "
                    f"(neighbouring steps change it by at most {max(near):.3g})",
                )
    if boundaries is not None:
        edges = [0, *sorted(int(b) for b in boundaries if 0 < b < steps), steps]
        for lo, hi in zip(edges, edges[1:]):
            phase = deltas[lo:hi]
            if any(d > tol for d in phase) and any(d < -tol for d in phase):
                up = next(lo + i for i, d in enumerate(phase) if d > tol)
                down = next(lo + i for i, d in enumerate(phase) if d < -tol)
                raise InvariantError(
                    "monotone_phases",
                    f"phase [{lo}, {hi}] rises at step {up}->{up + 1} and falls at step {down}->{down + 1}",
                )
    elif max_turns is not None:
        signs = [1 if d > tol else -1 for d in deltas if abs(d) > tol]
        turns = [i for i, (a, b) in enumerate(zip(signs, signs[1:])) if a != b]
        if len(turns) > max_turns:
            raise InvariantError("monotone_phases", f"the schedule changes direction {len(turns)} times (> {max_turns})")
