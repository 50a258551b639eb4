"""The kit's opt-in properties (`check_decoupled_decay`, `check_scale_invariance`,
`check_bounded_updates`) and `check_schedule`; `purestep.core.testing` re-exports them."""

from __future__ import annotations

import math
from typing import Any, Callable, Sequence

import torch
from torch import Tensor

import purestep.core as ps

from ._invariants import InvariantError, as_factory, call_checked, in_float64, kit_settings, make_transform, name_of
from ._invariants import run_reporting, trajectory
from ._strategies import GRAD_KINDS, Example, Options, given_examples, log_uniform


# --------------------------------------------------------------------------- #
# Opt-in properties (run in float64: they are about the math, not the rounding).
# --------------------------------------------------------------------------- #


def _property(
    name: str,
    factory,
    body: Callable[[Callable[[], ps.Transform], Example, Options], None],
    opts: Options,
    max_examples: int | None,
) -> None:
    factory = as_factory(factory)

    @given_examples(opts)
    @kit_settings(max_examples)
    def run(ex: Example) -> None:
        ex = in_float64(ex)
        body(lambda: make_transform(factory, ex), ex, opts)

    run_reporting(name_of(factory), run)


def _opts(kw: dict, **override) -> Options:
    kw = {**kw, **override}
    return Options(
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
    factory: Callable[..., ps.Transform] | ps.Transform,
    *,
    coefficient: float | None = None,
    max_examples: int | None = None,
    **kw: Any,
) -> None:
    """Check "decoupled_decay": the update's dependence on params is `c·p`, a pure
    multiple of p (c ≤ 0, the same for every decayed leaf), not routed through the
    preconditioner or the state as L2 decay is.

    Runs the same grads twice, with the evolving params and with zero params, and
    requires `u(p) - u(0) = c·p`; with `coefficient` (e.g. `-lr·weight_decay`) c must equal it
    on every decayed leaf. Keywords as `check_transform` (steps, matrices_only, extra, ...).

    Examples:
        >>> import purestep.core as ps
        >>> from purestep.core.testing import check_decoupled_decay
        >>> check_decoupled_decay(lambda: ps.adamw(0.1, weight_decay=0.1), coefficient=-0.01, max_examples=5)
    """

    def body(make, ex: Example, opts: Options) -> None:
        ups, _, params = trajectory(make(), ex, opts)
        zero, _, _ = trajectory(make(), ex, opts, params=lambda k, p: ps.tree_zeros_like(p))
        seen = False
        for k, (u, u0, p) in enumerate(zip(ups, zero, params)):
            coefs = {}
            for name in p:
                d, x = u[name] - u0[name], p[name]
                pp = (x * x).sum()
                scale = u[name].abs().max() + u0[name].abs().max() + 1e-300
                if pp == 0:
                    if d.abs().max() > 1e-9 * scale:
                        raise InvariantError(
                            "decoupled_decay", f"leaf '{name}' is zero but u(p) - u(0) is not, at step {k}"
                        )
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
                    raise InvariantError(
                        "decoupled_decay", f"at step {k}, leaf '{name}' grows with p (c = {c:.3g} > 0)"
                    )
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
                            "decoupled_decay",
                            f"at step {k}, leaf '{name}' decays with c = {c:.6g}, expected {coefficient}",
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

    Examples:
        >>> import purestep.core as ps
        >>> from purestep.core.testing import check_scale_invariance
        >>> check_scale_invariance(lambda: ps.adam(1e-2), max_examples=5)
    """
    opts = _opts(kw, grad_kinds=("normal", "zeros"))

    @given_examples(opts, log_uniform(*scales))
    @kit_settings(max_examples)
    def run(ex: Example, c: float) -> None:
        ex = in_float64(ex)
        # Bounded away from zero, so eps never dominates an element.
        grads = [{k: torch.sign(v) * (0.1 + v.abs()) if v.any() else v for k, v in g.items()} for g in ex.grads]
        ex = ex.replace(grads=grads)
        f = as_factory(factory)
        ups, _, params = trajectory(make_transform(f, ex), ex, opts)
        scaled, _, _ = trajectory(
            make_transform(f, ex),
            ex,
            opts,
            grads=[{k: v * c for k, v in g.items()} for g in grads],
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

    run_reporting(name_of(factory), run)


def check_bounded_updates(
    factory: Callable[..., ps.Transform] | ps.Transform, bound: float, *, max_examples: int | None = None, **kw: Any
) -> None:
    """Check "bounded_updates": |u| ≤ `bound` elementwise for any grads (sign-based
    optimizers: bound = lr; Sophia: lr). Params are zero, so decoupled decay adds nothing.
    Keywords as `check_transform`.

    Examples:
        >>> import purestep.core as ps
        >>> from purestep.core.testing import check_bounded_updates
        >>> check_bounded_updates(lambda: ps.lion(1e-3, weight_decay=0.1), bound=1e-3, max_examples=5)
    """

    def body(make, ex: Example, opts: Options) -> None:
        ups, _, _ = trajectory(make(), ex, opts, params=lambda k, p: ps.tree_zeros_like(p))
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

    Examples:
        >>> import torch
        >>> from purestep.core.testing import check_schedule
        >>> warmup = lambda t: torch.clamp(torch.as_tensor(t, dtype=torch.float64) / 10, max=1.0)
        >>> check_schedule(warmup, steps=30, boundaries=[10], bounds=(0.0, 1.0))
    """
    values = []
    for k in range(steps + 1):
        at_int = call_checked(f"schedule({k})", schedule, k)
        at_tensor = call_checked(f"schedule(tensor({k}.))", schedule, torch.tensor(float(k), dtype=torch.float64))
        if not isinstance(at_tensor, Tensor) or at_tensor.dim() != 0:
            raise InvariantError(
                "tensor_steps", f"schedule(tensor({k}.)) returned {at_tensor!r}, not a 0-d tensor (compile-safe)"
            )
        a, b = float(at_int), float(at_tensor)
        if not (math.isfinite(a) and math.isfinite(b)):
            raise InvariantError(
                "tensor_steps", f"schedule is not finite at step {k}: {a} (int step), {b} (tensor step)"
            )
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
            raise InvariantError(
                "monotone_phases", f"the schedule changes direction {len(turns)} times (> {max_turns})"
            )
