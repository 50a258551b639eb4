"""The machinery behind `purestep.core.testing`: running a transform along a drawn example
and comparing runs bit for bit, with failures raised as `InvariantError`s."""

from __future__ import annotations

from typing import Any, Callable, Iterable, Sequence

import hypothesis
import torch
import torch.utils._pytree as pytree
from torch import Tensor

import purestep.core as ps

from ._strategies import Example, Options, brief


class InvariantError(AssertionError):
    """An invariant that a transform or schedule broke; the message starts with its name."""

    def __init__(self, invariant: str, message: str):
        super().__init__(f"{invariant}: {message}")
        self.invariant = invariant


# --------------------------------------------------------------------------- #
# Tree comparisons.
# --------------------------------------------------------------------------- #


def clone_tree(tree: Any) -> Any:
    return pytree.tree_map(lambda x: x.detach().clone() if isinstance(x, Tensor) else x, tree)


def _bits(x: Tensor) -> Tensor:
    return x.detach().reshape(-1).contiguous().view(torch.uint8)


def same_bits(a: Any, b: Any) -> bool:
    if isinstance(a, Tensor) and isinstance(b, Tensor):
        return a.dtype == b.dtype and a.shape == b.shape and torch.equal(_bits(a), _bits(b))
    return type(a) is type(b) and a == b


def first_difference(a: Any, b: Any, same: Callable[[Any, Any], bool] = same_bits) -> str | None:
    """The dotted path of the first leaf where `a` and `b` differ (bitwise, or as `same`
    says; '<structure>' if the trees differ)."""
    pa, sa = ps.tree_flatten_with_path(a)
    pb, sb = ps.tree_flatten_with_path(b)
    if sa != sb:
        return "<structure>"
    for (path, x), (_, y) in zip(pa, pb):
        if not same(x, y):
            return path or "<root>"
    return None


def where_in_run(step: int, kind: str) -> str:
    return f"at step {step} ({'all-zero' if kind == 'zeros' else kind} grads)"


def call_checked(what: str, fn: Callable, *args, **kwargs):
    try:
        return fn(*args, **kwargs)
    except AssertionError:
        raise
    except Exception as error:
        raise InvariantError("no_exception", f"{what} raised {type(error).__name__}: {error}") from error


def run_reporting(name: str, run: Callable[[], None]) -> None:
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
        raise InvariantError(invariant, f"{message}\n  checking {name}\n  minimal counterexample:\n{notes}") from error


def kit_settings(max_examples: int | None) -> hypothesis.settings:
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


def name_of(factory: Any) -> str:
    name = getattr(factory, "__qualname__", None) or repr(factory)
    code = getattr(factory, "__code__", None)
    return f"{name} ({code.co_filename}:{code.co_firstlineno})" if code is not None else name


def as_factory(factory: Callable[..., ps.Transform] | ps.Transform) -> Callable[..., ps.Transform]:
    if isinstance(factory, ps.Transform):
        return lambda **hp: factory
    return factory


def make_transform(factory: Callable[..., ps.Transform], ex: Example) -> ps.Transform:
    t = call_checked("the factory", factory, **ex.hyperparams)
    if not isinstance(t, ps.Transform):
        raise InvariantError("no_exception", f"the factory returned {type(t).__name__}, not a ps.Transform")
    return t


# --------------------------------------------------------------------------- #
# Running a transform along an example, checking per-step invariants.
# --------------------------------------------------------------------------- #


def _widened(x: Tensor) -> Tensor:
    return x.float() if x.element_size() == 1 else x  # fp8 state: torch has no isfinite for it


def _is_float(x: Any) -> bool:
    return isinstance(x, Tensor) and (torch.is_floating_point(x) or torch.is_complex(x))


def trajectory(
    t: ps.Transform,
    ex: Example,
    opts: Options,
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
    snapshot = clone_tree(p0)
    state = call_checked("init", t.init, p0)
    if "purity" in checks and (where := first_difference(p0, snapshot)):
        raise InvariantError("purity", f"init mutated its params input at leaf '{where}'")
    init_spec = ps.tree_flatten_with_path(state)
    if "state_stability" in checks:
        devices = {x.device for x in ps.tree_leaves(p0) if isinstance(x, Tensor)}
        for path, leaf in init_spec[0]:
            if not isinstance(leaf, Tensor):
                raise InvariantError(
                    "state_stability",
                    f"init state leaf '{path}' is {type(leaf).__name__} {leaf!r}, not a tensor "
                    "(a Python number in state is baked into a compiled step and is not checkpointed)",
                )
            if len(devices) == 1 and leaf.device not in devices:
                raise InvariantError(
                    "state_stability",
                    f"init state leaf '{path}' is on {leaf.device} but the params are on {next(iter(devices))} "
                    "(the devices mix silently: every step copies it, and on CUDA reads it with a host sync)",
                )
    updates_seq, states, params_seq = [], [], []
    for k, (g, extra) in enumerate(zip(grads, ex.extras)):
        kind = ex.grad_kinds[k][0]
        p = (params(k, current) if params is not None else current) if opts.needs_params else None
        before = clone_tree((g, state, p, extra)) if "purity" in checks else None
        u, new_state = call_checked(f"update {where_in_run(k, kind)}", t.update, g, state, p, **extra)
        if before is not None:
            for label, now, then in zip(("grads", "state", "params", "extra keywords"), (g, state, p, extra), before):
                if where := first_difference(now, then):
                    raise InvariantError(
                        "purity", f"update mutated its {label} input at leaf '{where}' {where_in_run(k, kind)}"
                    )
        if "state_stability" in checks:
            _check_state(new_state, init_spec, k, kind)
        if "update_structure" in checks:
            _check_updates(u, g, k, kind)
        if "finite_outputs" in checks:
            for label, tree in (("updates", u), ("state", new_state)):
                for path, leaf in ps.tree_flatten_with_path(tree)[0]:
                    if _is_float(leaf) and not bool(torch.isfinite(_widened(leaf)).all()):
                        raise InvariantError(
                            "finite_outputs",
                            f"{label} leaf '{path}' is not finite {where_in_run(k, kind)}: {brief(leaf)}",
                        )
        updates_seq.append(u)
        states.append(new_state)
        params_seq.append(p)
        state = new_state
        if opts.needs_params:
            current = call_checked("ps.apply_updates", ps.apply_updates, current, u)
    return updates_seq, states, params_seq


def _check_updates(u: Any, g: Any, k: int, kind: str) -> None:
    got, spec = ps.tree_flatten_with_path(u)
    want, want_spec = ps.tree_flatten_with_path(g)
    if spec != want_spec:
        raise InvariantError(
            "update_structure",
            f"updates have leaves {[p for p, _ in got]} but grads/params have {[p for p, _ in want]} {where_in_run(k, kind)}",
        )
    for (path, x), (_, y) in zip(got, want):
        if not isinstance(x, Tensor) or x.shape != y.shape or x.dtype != y.dtype or x.device != y.device:
            what = brief(x) if isinstance(x, Tensor) else type(x).__name__
            raise InvariantError(
                "update_structure",
                f"update leaf '{path}' is {what} but its param is {brief(y)} {where_in_run(k, kind)}",
            )


def _check_state(state: Any, init_spec: tuple, k: int, kind: str) -> None:
    got, spec = ps.tree_flatten_with_path(state)
    want, want_spec = init_spec
    if spec != want_spec:
        raise InvariantError(
            "state_stability",
            f"state structure changed {where_in_run(k, kind)}: leaves {[p for p, _ in got]} after init's {[p for p, _ in want]}",
        )
    for (path, x), (_, y) in zip(got, want):
        if not isinstance(x, Tensor):
            raise InvariantError(
                "state_stability", f"state leaf '{path}' became {type(x).__name__} {where_in_run(k, kind)}"
            )
        if x.shape != y.shape or x.dtype != y.dtype or x.device != y.device:
            raise InvariantError(
                "state_stability",
                f"state leaf '{path}' changed from {brief(y)} at init to {brief(x)} {where_in_run(k, kind)}",
            )


def compare_runs(invariant: str, what: str, ref: Sequence, got: Sequence, label: str) -> None:
    for k, (a, b) in enumerate(zip(ref, got)):
        if where := first_difference(a, b):
            raise InvariantError(invariant, f"{what}: {label} differ at step {k}, leaf '{where}'")


def in_float64(ex: Example) -> Example:
    cast = lambda tree: ps.tree_cast(tree, torch.float64)  # noqa: E731
    return ex.replace(params=cast(ex.params), grads=[cast(g) for g in ex.grads], extras=[cast(e) for e in ex.extras])
