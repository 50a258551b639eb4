"""Hyperparameters in state: `inject_hyperparams`, `get_hyperparams`, `set_hyperparam`."""

from __future__ import annotations

import inspect
from typing import Any, Callable, NamedTuple

import torch
import torch.utils._pytree as pytree
from torch import Tensor

from . import _tree as tr
from ._base import (
    is_clock_state,
    schedule_clock,
    OptState,
    Params,
    Transform,
    as_float64,
    leaf_device,
    resolve,
    with_in_place,
    zero_count,
)
from .engine.per_leaf import apply_in_place
from .engine.needs import Needs, bounded, with_needs


@schedule_clock
class InjectHyperparamsState(NamedTuple):
    """State of `inject_hyperparams`: the hyperparameters in use and the inner state."""

    count: Tensor  # type: ignore[assignment]  # (), int64
    hyperparams: dict[str, Any]  # name -> 0-d float64 tensor (or a tuple of them)
    inner_state: OptState


_ALWAYS_STATIC = (
    "mask",
    "labels",
    "weight_decay_mask",
    "trust_ratio_mask",
    "ns_coefficients",
    "base_shapes",
    "batch_dims",
    "split",
)


def _injectable(value: Any) -> bool:
    if isinstance(value, bool) or isinstance(value, str) or value is None:
        return False
    if isinstance(value, float) or callable(value):
        return True
    if isinstance(value, Tensor):
        return value.dim() == 0
    if isinstance(value, (tuple, list)):
        return len(value) > 0 and all(_injectable(v) for v in value)
    return False


def inject_hyperparams(
    factory: Callable[..., Transform], *, static_args: tuple[str, ...] = ()
) -> Callable[..., Transform]:
    """Wrap `factory` so its hyperparameters live in state as 0-d float64 tensors.

    Floats, 0-d tensors, schedules (callables) and tuples of them are injected;
    ints, bools, strings, None, mask/label callables and names in `static_args` stay
    static. Schedules are evaluated at the update count each step, and the value used
    is kept in `state.hyperparams`; change a constant one with `set_hyperparam`.

    Examples:
        >>> import torch, purestep.core as ps
        >>> opt = ps.inject_hyperparams(ps.sgd)(lr=0.1)
        >>> state = opt.init({"w": torch.ones(1)})
        >>> state = ps.set_hyperparam(state, "lr", 0.0)
        >>> opt.update({"w": torch.ones(1)}, state, {"w": torch.ones(1)})[0]
        {'w': tensor([-0.])}
    """
    signature = inspect.signature(factory)
    static_names = set(_ALWAYS_STATIC) | set(static_args)

    def wrapped(*args: Any, **kwargs: Any) -> Transform:
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        arguments = dict(bound.arguments)
        factory(**arguments)  # validated now, with the values as given
        dynamic = {k: v for k, v in arguments.items() if k not in static_names and _injectable(v)}
        static = {k: v for k, v in arguments.items() if k not in dynamic}

        def values(count: Tensor, stored: dict | None) -> dict[str, Any]:
            out: dict[str, Any] = {}
            for name, v in dynamic.items():
                if isinstance(v, (tuple, list)):
                    out[name] = tuple(
                        _value(x, count, None if stored is None else stored[name][i]) for i, x in enumerate(v)
                    )
                else:
                    out[name] = _value(v, count, None if stored is None else stored[name])
            return out

        def init(params: Params) -> InjectHyperparamsState:
            count = zero_count(leaf_device(pytree.tree_leaves(params)))
            hp = values(count, None)
            return InjectHyperparamsState(count, hp, factory(**hp, **static).init(params))

        def update(grads, state, params=None, **extra):
            hp = values(state.count, state.hyperparams)
            updates, inner_state = factory(**hp, **static).update(grads, state.inner_state, params, **extra)
            return updates, InjectHyperparamsState(state.count + 1, hp, inner_state)

        def apply_(grads, state, params, a=1.0, b=1.0):
            hp = values(state.count, state.hyperparams)
            inner_state = apply_in_place(factory(**hp, **static), grads, state.inner_state, params, a, b)
            return InjectHyperparamsState(state.count + 1, hp, inner_state)

        # Its needs are those of the transform each update builds: from the injected values as
        # 0-d tensors, as at run time (a factory may branch on a value's type: a float 0.0
        # decay leaves out a masked decay that a tensor keeps).
        probe = factory(**values(zero_count(torch.device("cpu")), None), **static)
        t = Transform(init, with_in_place(update, apply_=apply_))
        return with_needs(t, Needs(parts=lambda tree: [(probe, None)], bounded=bounded(probe)))

    return wrapped


def _value(v: Any, count: Tensor, stored: Tensor | None) -> Any:
    if callable(v):
        return resolve(v, count)
    if stored is not None:
        return stored
    return as_float64(v, count.device)


def _injected(state: OptState) -> list[tuple[str, tuple, dict, str]]:
    """Every injected hyperparameter as `(key, state path, its hyperparams dict, name)`;
    `key` is the bare name, or `<path>.<name>` when several injected states hold it."""
    found = [(path, hp, name) for path, hp in tr.find_all(state, "hyperparams") if isinstance(hp, dict) for name in hp]
    counts: dict[str, int] = {}
    for _, _, name in found:
        counts[name] = counts.get(name, 0) + 1
    return [
        (name if counts[name] == 1 else f"{tr.path_str(path[:-1])}.{name}", path, hp, name) for path, hp, name in found
    ]


def get_hyperparams(state: OptState) -> dict[str, Any]:
    """Every hyperparameter held by `inject_hyperparams` anywhere in `state`, by name.

    Values are the 0-d tensors (or tuples of them) the last update used; nothing is
    copied or synced. A name held by several injected states (a `partition` of two
    injected optimizers) is qualified by its state path, `<path>.<name>`; `set_hyperparam`
    takes the same keys.

    Examples:
        >>> import torch, purestep.core as ps
        >>> state = ps.inject_hyperparams(ps.adamw)(lr=1e-3).init({"w": torch.zeros(2)})
        >>> sorted(ps.get_hyperparams(state)), ps.get_hyperparams(state)["lr"]
        (['betas', 'eps', 'lr', 'weight_decay'], tensor(0.0010, dtype=torch.float64))
    """
    return {key: hp[name] for key, _, hp, name in _injected(state)}


def schedule_clocks(state: OptState) -> list[Tensor]:
    """The step counters schedules read, anywhere in `state` (`inject_hyperparams`',
    `scale_by_lr`'s, `add_decayed_weights`'... every state class declared a
    `schedule_clock`): the 0-d int64 tensors themselves (no copy), outermost first, to set
    in place (`clock.fill_(step)`: a run on a time budget moves its schedules by progress,
    with no recompile).

    Examples:
        >>> import torch, purestep.core as ps
        >>> state = ps.inject_hyperparams(ps.adamw)(lr=ps.cosine_schedule(1e-3, 100)).init({"w": torch.zeros(2)})
        >>> ps.schedule_clocks(state)
        [tensor(0)]
    """
    found, level = [], [state]
    while level:
        found += [node.count for node in level if is_clock_state(node)]
        level = [child for node in level for _, child in tr.children(node)]
    return found


def set_hyperparam(state: OptState, name: str, value: Any) -> OptState:
    """A new state with the injected hyperparameter `name` set to `value`.

    `name` is a key of `get_hyperparams(state)`: the bare name, or `<path>.<name>` when
    several injected states hold it. A hyperparameter that follows a schedule is
    overwritten by the schedule next step. Raises `KeyError` naming the keys there are.
    """
    entries = _injected(state)
    match = [(path, hp, leaf) for key, path, hp, leaf in entries if key == name]
    if not match:
        keys = sorted(key for key, *_ in entries)
        ambiguous = [key for key in keys if key.endswith(f".{name}")]
        if ambiguous:
            raise KeyError(f"hyperparameter {name!r} is ambiguous: use one of {ambiguous}")
        raise KeyError(
            f"no injected hyperparameter {name!r}; injected: {keys or 'none'} "
            "(build the optimizer with ps.inject_hyperparams(factory)(...))"
        )
    path, hp, leaf = match[0]
    old = hp[leaf]
    new: Any
    if isinstance(old, tuple):
        if not isinstance(value, (tuple, list)) or len(value) != len(old):
            raise ValueError(f"{name} must be a tuple of {len(old)} values, got {value!r}")
        new = tuple(torch.as_tensor(v, dtype=o.dtype, device=o.device).clone() for v, o in zip(value, old))
    else:
        new = torch.as_tensor(value, dtype=old.dtype, device=old.device).clone()
    return tr.replace_at(state, path, {**hp, leaf: new})
