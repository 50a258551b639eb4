"""Types shared by every transform: `Transform`, states, schedules, hyperparameter checks."""

from __future__ import annotations

import math
import weakref
from typing import Any, Callable, NamedTuple, Protocol, Union

import torch
from torch import Tensor

PyTree = Any
Params = PyTree  # usually dict(name -> Tensor), as model.named_parameters() gives
Updates = PyTree
OptState = PyTree


class Schedule(Protocol):
    """A callable `step -> value`; `step` is an int or a 0-d tensor."""

    def __call__(self, step: int | Tensor) -> float | Tensor: ...


ScalarOrSchedule = Union[float, Tensor, Schedule]


class Transform(NamedTuple):
    """A pure gradient transformation: `state = init(params)`,
    `updates, state = update(grads, state, params=None, **extra)`.

    Updates are added to params (`apply_updates`). `update` ignores `extra`
    keywords it does not know, so transforms compose under `chain`.

    An `update` may carry in-place forms (`with_in_place`), which let an eager donated
    step (`make_update(..., donate=True)` without compile) apply it without materializing
    the updates. `update` stays the definition: the forms belong to that one function, so
    a transform rebuilt around a new `update` (a wrapper, `t._replace(update=...)`) has
    none and only runs slower there:

    - `affine(state) -> (x, y, state)`: the update is `x·u + y·p`, with `u` the
      transform's input, `p` the params and x, y floats or 0-d tensors (`identity`,
      `scale`, `scale_by_lr`, `add_decayed_weights`). `chain` folds a tail of these into
      the in-place apply, and writes them into updates it owns.
    - `apply_(grads, state, params, a, b) -> state`: `p ← a·p + b·u` in place, with
      `u, state = update(grads, state, params)`; equal to that to rounding. It may
      update the leaves of `state` in place (the caller gives the old state up) and
      only reads `grads`. `chain`, `inject_hyperparams` and `scale_by_adam` have one.

    Examples:
        >>> import torch, purestep.core as ps
        >>> t = ps.scale(-0.1)
        >>> params = {"w": torch.ones(2)}
        >>> updates, state = t.update({"w": torch.ones(2)}, t.init(params))
        >>> updates["w"]
        tensor([-0.1000, -0.1000])
    """

    init: Callable[[Params], OptState]
    update: Callable[..., tuple[Updates, OptState]]


# The in-place forms of update functions, keyed by the function itself (not stored on it:
# `functools.wraps` copies a function's attributes onto its wrapper, which would hand a
# wrapper's different update the wrapped one's forms).
_IN_PLACE: "weakref.WeakKeyDictionary[Callable, tuple]" = weakref.WeakKeyDictionary()


_CLOCK_STATES: set[type] = set()


def schedule_clock(cls: type) -> type:
    """Declare a state class whose `count` is the step a schedule reads (`scale_by_lr`'s,
    `inject_hyperparams`'...): `ps.schedule_clocks` finds those counters by it."""
    _CLOCK_STATES.add(cls)
    return cls


def is_clock_state(node: Any) -> bool:
    """Whether `node` is a state declared by `schedule_clock`."""
    return type(node) in _CLOCK_STATES


def with_in_place(update: Callable, *, affine: Callable | None = None, apply_: Callable | None = None) -> Callable:
    """`update`, registered with its in-place forms (see `Transform`): returns `update`
    itself, for `Transform(init, with_in_place(update, affine=...))`."""
    if affine is not None and apply_ is not None:
        raise ValueError("an update has either an affine form or an apply_ form, not both")
    if torch.compiler.is_compiling():  # built inside a compiled step: the forms are for eager steps
        return update
    try:
        _IN_PLACE[update] = (affine, apply_)
    except TypeError:
        raise ValueError(f"with_in_place: update must be a function, got {type(update).__name__}") from None
    return update


def _forms(t: Transform) -> tuple:
    if torch.compiler.is_compiling():  # traced code takes the plain `update`
        return (None, None)
    try:
        return _IN_PLACE.get(t.update, (None, None))
    except TypeError:  # not weak-referenceable: registered by nobody
        return (None, None)


def affine_of(t: Transform) -> Callable | None:
    """`t`'s affine form, or None."""
    return _forms(t)[0]


def apply_of(t: Transform) -> Callable | None:
    """`t`'s in-place apply, or None."""
    return _forms(t)[1]


class EmptyState(NamedTuple):
    """State of a transform that keeps none."""


# --------------------------------------------------------------------------- #
# Scalars: counts, hyperparameters and schedules.
# --------------------------------------------------------------------------- #


def check_int(name: str, value: object, minimum: int = 0, *, below: int | None = None, why: str = "") -> int:
    """`value`, an int (not a bool) >= `minimum` (and < `below`), else a ValueError naming `name`."""
    if (
        isinstance(value, bool)
        or not isinstance(value, int)
        or value < minimum
        or (below is not None and value >= below)
    ):
        wanted = f"in [{minimum}, {below})" if below is not None else f">= {minimum}"
        raise ValueError(f"{name} must be an int {wanted}{f' ({why})' if why else ''}, got {value!r}")
    return value


def require_params(params: Any, who: str, what: str = "") -> None:
    """The error of a transform whose update needs the params and was called without them."""
    if params is None:
        raise ValueError(f"{who} needs params{f' ({what})' if what else ''}: call update(grads, state, params)")


def leaf_device(leaves: list[Tensor]) -> torch.device:
    """The device that a state's scalars live on: the first leaf's, else CPU."""
    return leaves[0].device if leaves else torch.device("cpu")


def zero_count(device: torch.device) -> Tensor:
    """A fresh step counter."""
    return torch.zeros((), dtype=torch.int64, device=device)


def as_float64(value: float | Tensor, device: torch.device) -> Tensor:
    """`value` as a 0-d float64 tensor on `device`."""
    if isinstance(value, Tensor):
        return value.to(device=device, dtype=torch.float64)
    return torch.tensor(value, dtype=torch.float64, device=device)


def _define_once() -> Any:
    """The `purestep::once` operator, defined on first import only: a second copy of this
    module (pytest's doctest collection imports `core/` under another name) must not
    redefine it, which would unregister the kernels the first copy's compiled code calls.

    A plain library operator with one kernel for every backend, not `torch.library.custom_op`:
    compiled steps call it at run time, and custom_op's Python autograd wrapper cost ~8 us
    per call there against ~2 us. It has no autograd formula: `once` leaves a value that
    autograd records as it is (see `once`)."""
    try:
        return torch.ops.purestep.once.default
    except (AttributeError, RuntimeError):
        pass
    lib = torch.library.Library("purestep", "DEF")
    lib.define("once(Tensor x) -> Tensor")
    lib.impl("once", lambda x: x.clone(), "CompositeExplicitAutograd")
    torch.library.register_fake("purestep::once", lambda x: torch.empty_like(x), lib=lib)
    _LIBRARIES.append(lib)  # the registrations live as long as the Library object
    return torch.ops.purestep.once.default


_LIBRARIES: list = []
_once = _define_once()


def once(x: Tensor) -> Tensor:
    """`x`, a 0-d value of per-step scalar math, computed once per step in compiled code.

    Inductor inlines small expressions into the elementwise kernels that read them, so a
    bias correction `1 - β**t` or a schedule's cosine would run once per vector of every
    such kernel (a libm call there is not hoisted out of the loop). Wrap such values when
    writing a transform; `resolve` does it for schedules. The identity outside compiled
    code, for tensors that are not 0-d, and for values autograd records (a meta-gradient
    through a compiled step flows through the plain expression).

    Examples:
        >>> import torch, purestep.core as ps
        >>> t = torch.tensor(3, dtype=torch.int64)
        >>> ps.once(1.0 - 0.9 ** t.double())
        tensor(0.2710, dtype=torch.float64)
    """
    if not torch.compiler.is_compiling() or x.dim() != 0 or (x.requires_grad and torch.is_grad_enabled()):
        return x
    if x.device.type == "cpu" and x.dtype.is_floating_point:
        # A max over two copies: inductor computes a reduction into its own buffer (on CPU
        # it never unrolls one with a 0-d result), and all of a step's land in one
        # prologue of the kernel that reads them, with no operator called at run time.
        return x.expand(2).amax()
    return _once(x)  # on CUDA the step replays as a graph: the operator costs nothing


def coefficient(s: Any, like: Tensor) -> Any:
    """A 0-d tensor coefficient `s` of elementwise math on `like`, in compiled CPU code: cast
    once per step to the dtype that math runs in (float32 for float32 and narrower
    leaves, as the kernels compute; float64 for float64) and computed by `once`. Inlined,
    a float64 hyperparameter is converted, and `1 - β` or `1 / bc` recomputed, in every
    vector of the loop (AdamW's flat CPU step ~5% slower). The same values either way:
    the kernel would convert the same float64 result. Anything else is returned as it is.
    """
    if not (isinstance(s, Tensor) and s.dim() == 0 and torch.compiler.is_compiling()):
        return s
    # CPU only: a GPU kernel reads a scalar once per thread, and there each `once` would be
    # one more kernel launch outside a CUDA graph.
    if not (s.dtype.is_floating_point and like.dtype.is_floating_point and like.device.type == "cpu"):
        return s
    compute = torch.float64 if like.dtype == torch.float64 else torch.float32
    return once(s.to(compute))


def resolve(value: ScalarOrSchedule, count: Tensor) -> float | Tensor:
    """The value of a float-or-schedule hyperparameter after `count` updates.

    Floats and tensors are returned as they are; a schedule is called with the
    count as a 0-d float64 tensor and its value returned as 0-d float64.
    """
    if callable(value):
        step = count.to(torch.float64)
        return once(as_float64(value(step), count.device))
    return value


def is_static(value: Any) -> bool:
    """True when `value` is a plain number whose range can be checked now."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def is_zero(value: Any) -> bool:
    """True when `value` is a plain number equal to 0 (a term the chain can leave out)."""
    return is_static(value) and value == 0


def check_bool(name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be True or False, got {value!r}")


def check_lr(lr: Any) -> None:
    """For an lr that reaches no `scale_by_lr` as it is (schedule-free's warmed-up one);
    elsewhere the blocks check their own arguments (lr, weight_decay, betas) once."""
    check_hyperparam("lr", lr)
    check_nonnegative("lr", lr)


def check_nonnegative(name: str, value: Any) -> None:
    if is_static(value) and not value >= 0:
        raise ValueError(f"{name} must be >= 0, got {value!r}")


def check_positive(name: str, value: Any) -> None:
    if is_static(value) and not value > 0:
        raise ValueError(f"{name} must be > 0, got {value!r}")


def check_beta(name: str, value: Any) -> None:
    if is_static(value) and not 0.0 <= value < 1.0:
        raise ValueError(f"{name} must be in [0, 1), got {value!r}")


def check_hyperparam(name: str, value: Any) -> None:
    """Refuse what is neither a number, a 0-d tensor nor a schedule."""
    if callable(value) or is_static(value):
        if is_static(value) and not math.isfinite(value):
            raise ValueError(f"{name} must be finite, got {value!r}")
        return
    if isinstance(value, Tensor) and value.dim() == 0:
        return
    raise ValueError(f"{name} must be a float, a 0-d tensor or a schedule (step -> value), got {value!r}")


def check_betas(value: Any, name: str = "betas") -> tuple[Any, Any]:
    """Unpack and check a `(beta1, beta2)` pair."""
    if not isinstance(value, (tuple, list)) or len(value) != 2:
        raise ValueError(f"{name} must be a pair (beta1, beta2), got {value!r}")
    for i, beta in enumerate(value):
        check_hyperparam(f"{name}[{i}]", beta)
        check_beta(f"{name}[{i}]", beta)
    return value[0], value[1]
