"""How an `Optimizer`'s transform states appear in a `state_dict`.

Two layouts. torch's, for the factories that mirror a torch.optim class (`ps.sgd`,
`ps.adam`, `ps.adamw`, `ps.muon` given to `Optimizer` as a factory): per-param buffers
under torch's names, torch's `step`, torch's param-group keys, so the dict loads into
that class and back. The generic one, for any other transform: per-param buffers under
torch-style names where one exists, everything a group shares under `"shared_state"`.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable, NamedTuple

import torch
import torch.utils._pytree as pytree
from torch import Tensor

import purestep.core as ps

# (state class, field) -> the name torch.optim gives the same per-param buffer.
BUFFER_NAMES = {  # (state class, field) -> torch.optim's name for that buffer
    (ps.ScaleByAdamState, "mu"): "exp_avg",
    (ps.ScaleByAdamState, "nu"): "exp_avg_sq",
    (ps.ScaleByAmsgradState, "mu"): "exp_avg",
    (ps.ScaleByAmsgradState, "nu"): "exp_avg_sq",
    (ps.ScaleByAmsgradState, "nu_max"): "max_exp_avg_sq",
    (ps.ScaleByLionState, "mu"): "exp_avg",
    (ps.TraceState, "trace"): "momentum_buffer",
    (ps.ScaleByMuonState, "mu"): "momentum_buffer",
    # AdEMAMix: the names of the paper's PyTorch code (apple/ml-ademamix)
    (ps.ScaleByAdemamixState, "m1"): "exp_avg_fast",
    (ps.ScaleByAdemamixState, "m2"): "exp_avg_slow",
    (ps.ScaleByAdemamixState, "nu"): "exp_avg_sq",
}
# torch.optim group keys that choose an implementation, not the math: kept, never checked.
IMPLEMENTATION_KEYS = ("foreach", "fused", "capturable", "differentiable")
STRUCTURE_KEYS = ("params", "param_names")


class Mirror(NamedTuple):
    """A factory whose state and groups take a torch.optim class's layout."""

    cls: type  # the torch.optim class
    has_step: bool  # torch keeps a per-param `step` (Adam, AdamW); SGD and Muon do not
    renames: dict[str, str]  # factory argument -> torch group key


def mirrors() -> dict[Callable[..., ps.Transform], Mirror]:
    """The factories with a torch.optim twin in this torch version."""
    out = {
        ps.sgd: Mirror(torch.optim.SGD, False, {}),
        ps.adam: Mirror(torch.optim.Adam, True, {}),
        ps.adamw: Mirror(torch.optim.AdamW, True, {}),
    }
    if hasattr(torch.optim, "Muon"):
        out[ps.muon] = Mirror(torch.optim.Muon, False, {"adjust_lr": "adjust_lr_fn"})
    return out


def same(a: Any, b: Any) -> bool:
    """Equal as group values: tuples and lists alike, numbers by value, bools and None by identity."""
    if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, bool) or isinstance(b, bool) or a is None or b is None:
        return a is b
    return a == b


def canonical(key: str, value: Any) -> Any:
    """One spelling per meaning: torch.optim.Muon's `adjust_lr_fn=None` is "original"."""
    return "original" if key == "adjust_lr_fn" and value is None else value


def torch_group(factory: Callable, mirror: Mirror, kwargs: dict[str, Any], where: str) -> dict[str, Any]:
    """The param-group values `mirror.cls` keeps for `factory(**kwargs)`, checked to be
    something torch runs (its own constructor validates the values)."""
    accepted = inspect.signature(mirror.cls).parameters
    ours = inspect.signature(factory).parameters
    torch_kwargs = {}
    for name, value in kwargs.items():
        key = mirror.renames.get(name, name)
        if key not in accepted:
            # An argument torch lacks must leave the math as torch runs it: at its default.
            if not same(value, ours[name].default):
                raise ValueError(
                    f"{where}: {name}={value!r} has no {mirror.cls.__name__} equivalent; leave it at "
                    f"{ours[name].default!r}, or pass a built transform (Optimizer(params, "
                    f"ps.{factory.__name__}(..., {name}=...))) for purestep's own state_dict layout"
                )
            continue
        if callable(value):
            raise ValueError(
                f"{where}: {name} is a schedule, which {mirror.cls.__name__} cannot hold in a param group; "
                "drive it with a torch.optim.lr_scheduler, or pass a built transform "
                f"(Optimizer(params, ps.{factory.__name__}({name}=schedule)))"
            )
        if key == "ns_coefficients" and not (isinstance(value, (tuple, list)) and len(value) == 3):
            raise ValueError(f"{where}: {mirror.cls.__name__} takes one (a, b, c) for ns_coefficients, got {value!r}")
        torch_kwargs[key] = None if key == "adjust_lr_fn" and value == "original" else value  # torch's spelling
    dummy = torch.zeros(2, 2, requires_grad=True)
    return dict(mirror.cls([dummy], **torch_kwargs).defaults)


def torch_only(factory: Callable, mirror: Mirror | None, kwargs: dict[str, Any]) -> dict[str, Any]:
    """The arguments of `kwargs` that `mirror.cls` takes and `factory` does not (by torch's name)."""
    if mirror is None:
        return {}
    ours = set(inspect.signature(factory).parameters) | set(mirror.renames.values())
    theirs = inspect.signature(mirror.cls).parameters
    return {k: v for k, v in kwargs.items() if k in theirs and k not in ours and k not in IMPLEMENTATION_KEYS}


def checked_torch_only(factory: Callable, mirror: Mirror, given: dict[str, Any], group: dict) -> dict[str, Any]:
    """`given` (from `torch_only`), each checked to be the value `factory` runs (`group`, torch's
    group for it), else refused naming what to use instead."""
    for key, value in given.items():
        if not same(value, group[key]):
            instead = (
                " (Adam with decoupled decay is AdamW: Optimizer(params, ps.adamw, ...))"
                if factory is ps.adam and key == "decoupled_weight_decay"
                else f"; pass a built transform for another {key}"
            )
            raise ValueError(
                f"Optimizer: {key}={value!r}, but ps.{factory.__name__} runs {mirror.cls.__name__}'s "
                f"{key}={group[key]!r}{instead}"
            )
    return given


def factory_kwargs(factory: Callable, mirror: Mirror | None, group: dict[str, Any], where: str) -> dict[str, Any]:
    """The factory's arguments named by a param group (torch's names accepted)."""
    params = inspect.signature(factory).parameters
    back = {v: k for k, v in mirror.renames.items()} if mirror else {}
    out = {}
    for key, value in group.items():
        if key in STRUCTURE_KEYS or (mirror and key in IMPLEMENTATION_KEYS):
            continue
        name = back.get(key, key)
        if name in params:
            out[name] = canonical(key, value)
    return as_numbers(factory, out)  # other keys (timm's "lr_scale", torch's implementation flags) stay, unread


def as_numbers(factory: Callable, kwargs: dict[str, Any]) -> dict[str, Any]:
    """`kwargs` with an int given for a real-valued argument as the float it means.

    torch.optim's users spell defaults as ints (`SGD(params, lr=1, momentum=0, weight_decay=0)`);
    `ps.inject_hyperparams` keeps ints static, so `momentum=0` would build another transform
    than `momentum=0.0` (no momentum buffer, no step count) and a scheduler could not set it
    later. A factory argument is real-valued when its default is a float (or a tuple holding
    one) or its annotation names `float` or `ScalarOrSchedule`."""
    params = inspect.signature(factory).parameters
    out = {}
    for k, v in kwargs.items():
        try:
            out[k] = _as_float(v) if k in params and _real(params[k]) else v
        except OverflowError:
            raise ValueError(f"{k}={v!r} is too large for a float") from None
    return out


def _real(param: inspect.Parameter) -> bool:
    # By the default's type, else the annotation's text ("ScalarOrSchedule", "float | Tensor";
    # one that names "int" too, as `Mapping[int, float]`, is not a real number).
    default = param.default
    if isinstance(default, tuple):
        return any(isinstance(d, float) for d in default)
    annotation = str(param.annotation)
    return (isinstance(default, float) or "float" in annotation or "Scalar" in annotation) and "int" not in annotation


def _as_float(value: Any) -> Any:
    if isinstance(value, (tuple, list)):
        return type(value)(_as_float(v) for v in value)
    return float(value) if isinstance(value, int) and not isinstance(value, bool) else value


# --------------------------------------------------------------------------- #
# Hyperparameter values between param groups and the state.
# --------------------------------------------------------------------------- #


def is_plain(value: Any) -> bool:
    """A value torch.save(weights_only=True) and a param group can hold."""
    if isinstance(value, (tuple, list)):
        return all(is_plain(v) for v in value)
    return value is None or isinstance(value, (bool, int, float, str))


def changed(new: Any, old: Any) -> bool:
    """Whether a group value differs from the one the state holds (tensors: by identity)."""
    if isinstance(new, Tensor) or isinstance(old, Tensor):
        return new is not old  # never a host sync
    if isinstance(new, (tuple, list)) and isinstance(old, (tuple, list)):
        return len(new) != len(old) or any(changed(a, b) for a, b in zip(new, old))
    return new != old


def fill(target: Any, value: Any, where: str) -> None:
    """Write `value` into the live hyperparameter tensor(s) `target`, in place."""
    if isinstance(target, tuple):
        if not isinstance(value, (tuple, list)) or len(value) != len(target):
            raise ValueError(f"{where} must be a tuple of {len(target)} values, got {value!r}")
        for t, v in zip(target, value):
            fill(t, v, where)
    elif isinstance(value, Tensor):
        target.copy_(value.detach().reshape(()))
    else:
        target.fill_(value)


# --------------------------------------------------------------------------- #
# Which state leaf is what.
# --------------------------------------------------------------------------- #


class Leaf(NamedTuple):
    """The role of one state leaf in a param group's state."""

    path: str  # dotted path in the state tree
    kind: str  # "buffer" (one param's), "count" (a step count), "clock" (a schedule's step), "hyperparam" or "other"
    param: str = ""  # the param a buffer belongs to ("" for the other kinds)
    key: str = ""  # the buffer's name in the state_dict


def _child(node: Any, key: Any) -> Any:
    if isinstance(key, pytree.GetAttrKey):
        return getattr(node, key.name)
    if isinstance(key, pytree.MappingKey):
        return node[key.key]
    return node[key.idx]


def classify(state: Any, names: list[str]) -> list[Leaf]:
    """The role of every leaf of a group's state, in flatten order. A buffer's key is its
    torch name (`exp_avg`...) when that is unique for its param, else its field path."""
    raw, _ = pytree.tree_flatten_with_path(state)
    paths = [p for p, _ in ps.tree_flatten_with_path(state)[0]]
    name_set = set(names)
    clocks = {id(c) for c in ps.schedule_clocks(state)}
    out: list[Leaf] = []
    by_path: dict[int, str] = {}
    for (keys, leaf), path in zip(raw, paths):
        if not isinstance(leaf, Tensor):
            raise ValueError(f"optimizer state leaf '{path}' is {type(leaf).__name__}, not a tensor")
        last = keys[-1] if keys else None
        # A param's own buffer: keyed by its name, then by positions in a tuple of them (SOAP's
        # and Kron's per-dimension factors, `gg.<name>.0`), whose key then ends in those positions.
        at = len(keys) - 1
        while at > 0 and isinstance(keys[at], pytree.SequenceKey):
            at -= 1
        mapped = keys[at] if keys else None
        named = isinstance(mapped, pytree.MappingKey) and mapped.key in name_set and at > 0
        if any(isinstance(k, pytree.GetAttrKey) and k.name == "hyperparams" for k in keys):
            out.append(Leaf(path, "hyperparam"))
        elif named and isinstance(mapped, pytree.MappingKey):
            param = mapped.key
            owner = state
            for k in keys[: at - 1]:
                owner = _child(owner, k)
            positions = "".join(f".{getattr(k, 'idx')}" for k in keys[at + 1 :])
            head = path[: len(path) - len(positions) - len(param) - 1]  # the path up to the param's name
            field = getattr(keys[at - 1], "name", None) or head
            key = BUFFER_NAMES.get((type(owner), field), field) if not positions else field + positions
            out.append(Leaf(path, "buffer", param, key))
            by_path[len(out) - 1] = head + positions
        elif isinstance(last, pytree.GetAttrKey) and last.name == "count":
            # A schedule's step is the group's clock, as torch's lr_scheduler steps a group
            # (every step of the group advances it), not a param's own step count.
            out.append(Leaf(path, "clock" if id(leaf) in clocks else "count"))
        else:
            out.append(Leaf(path, "other"))
    seen: dict[tuple[str, str], int] = {}
    for leaf in out:
        if leaf.kind == "buffer":
            seen[(leaf.param, leaf.key)] = seen.get((leaf.param, leaf.key), 0) + 1
    # Two buffers of a param under one key (two Adams in a chain): each keyed by its whole path
    # without the param's name.
    return [
        leaf._replace(key=by_path[i]) if leaf.kind == "buffer" and seen[(leaf.param, leaf.key)] > 1 else leaf
        for i, leaf in enumerate(out)
    ]


# --------------------------------------------------------------------------- #
# torch's layout.
# --------------------------------------------------------------------------- #


def _scalar_dtype() -> torch.dtype:
    # torch.optim keeps `step` as float32 (float64 when that is the default dtype), on the CPU.
    return torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32


def keeps_buffers(mirror: Mirror | None, group: dict) -> bool:
    """Whether torch's class keeps per-param buffers for this group: torch.optim.SGD keeps
    none without momentum (the adapter's state still has one, for a momentum set later)."""
    return not (mirror is not None and mirror.cls is torch.optim.SGD and group.get("momentum") == 0)


def torch_step(count: Tensor) -> Tensor:
    """A purestep step count as torch.optim keeps `step`: a 0-d float on the CPU."""
    return count.detach().to(device="cpu", dtype=_scalar_dtype())


def check_torch_layout(state: Any, names: list[str], mirror: Mirror) -> None:
    """Refuse a state `mirror.cls` has no place for (a factory that grew new state)."""
    for leaf in classify(state, names):
        if leaf.kind == "other" or (leaf.kind == "buffer" and "." in leaf.key):
            raise ValueError(
                f"state leaf '{leaf.path}' has no place in {mirror.cls.__name__}'s state_dict layout; "
                "pass a built transform for purestep's own layout"
            )


def export_torch(
    state: Any, names: list[str], ids: list[int], mirror: Mirror, group: dict, steps: list[Tensor]
) -> dict[int, dict]:
    """`{param index: {"step"?, buffers...}}` as `mirror.cls.state_dict()` has them, `steps`
    each param's step count (torch's `step`); a param not stepped yet has no entry, as in torch."""
    if not keeps_buffers(mirror, group):
        return {}
    out = {i: {"step": step} if mirror.has_step else {} for i, step in zip(ids, steps) if step.item() != 0}
    for leaf, value in zip(classify(state, names), pytree.tree_leaves(state)):
        if leaf.kind == "buffer" and ids[names.index(leaf.param)] in out:
            out[ids[names.index(leaf.param)]][leaf.key] = value
    return out


def import_torch(
    state: Any, names: list[str], ids: list[int], mirror: Mirror, saved: dict, where: str
) -> tuple[Any, list[int]]:
    """`state` with its buffers taken from a torch.optim `state_dict()["state"]`, and each
    param's step (0 for a param without an entry: torch has not stepped it yet). The state's
    counts and clocks hold the largest step; the adapter gives each param its own (cohorts)."""
    leaves = classify(state, names)
    values, spec = pytree.tree_flatten(state)
    per = [saved.get(i) or {} for i in ids]
    steps = []
    for n, i, entry in zip(names, ids, per):
        if not entry:
            steps.append(0)
        elif not mirror.has_step:
            steps.append(1)  # torch.optim.SGD and Muon keep no count: a buffer means at least one step
        elif "step" not in entry:
            raise ValueError(f"{where}: state[{i}] (param {n!r}) has no 'step'")
        else:
            steps.append(int(torch.as_tensor(entry["step"]).round()))
    wanted = {(leaf.param, leaf.key) for leaf in leaves if leaf.kind == "buffer"}
    for n, i, entry in zip(names, ids, per):
        extra = [k for k in entry if (n, k) not in wanted and k != "step"]
        if extra:
            raise ValueError(f"{where}: state[{i}] (param {n!r}) has {extra}, which this optimizer keeps no place for")
    out = []
    for leaf, value in zip(leaves, values):
        if leaf.kind in ("count", "clock"):
            out.append(torch.full_like(value, max(steps, default=0)))
        elif leaf.kind == "buffer" and steps[names.index(leaf.param)]:
            i = ids[names.index(leaf.param)]
            src = per[names.index(leaf.param)].get(leaf.key)
            out.append(checked_copy(src, value, f"{where}: state[{i}][{leaf.key!r}] (param {leaf.param!r})"))
        elif leaf.kind == "buffer":
            out.append(torch.zeros_like(value))
        else:
            out.append(value)
    return pytree.tree_unflatten(out, spec), steps


def checked_copy(src: Any, like: Tensor, where: str) -> Tensor:
    """A copy of `src` on `like`'s device and dtype, after checking it is a tensor of its shape."""
    if not isinstance(src, Tensor):
        raise ValueError(f"{where} is missing (or not a tensor) in the state_dict")
    if src.shape != like.shape:
        raise ValueError(f"{where} has shape {tuple(src.shape)}, expected {tuple(like.shape)}")
    return src.to(device=like.device, dtype=like.dtype, copy=True)


# --------------------------------------------------------------------------- #
# The generic layout.
# --------------------------------------------------------------------------- #


def export_generic(state: Any, names: list[str], ids: list[int]) -> tuple[dict[int, dict], dict[str, Tensor]]:
    """Per-param buffers by param index, and the group's shared leaves by path (the step
    counts of a group whose params step apart: each param's `step`, added by the adapter)."""
    per: dict[int, dict[str, Tensor]] = {}
    shared: dict[str, Tensor] = {}
    for leaf, value in zip(classify(state, names), pytree.tree_leaves(state)):
        if leaf.kind == "buffer":
            per.setdefault(ids[names.index(leaf.param)], {})[leaf.key] = value
        else:
            shared[leaf.path] = value
    return per, shared


def import_generic(state: Any, names: list[str], ids: list[int], saved: dict, shared: dict, where: str) -> Any:
    """`state` with every leaf taken from a generic-layout state_dict."""
    values, spec = pytree.tree_flatten(state)
    out = []
    for leaf, value in zip(classify(state, names), values):
        if leaf.kind == "buffer":
            i = ids[names.index(leaf.param)]
            src = saved.get(i, {}).get(leaf.key)
            if src is None and leaf.path in shared:  # saved by 0.4, which kept per-dimension factors shared
                src = shared[leaf.path]
            at = f"{where}: state[{i}][{leaf.key!r}] (param {leaf.param!r})"
        else:
            src, at = shared.get(leaf.path), f"{where}: shared_state[{leaf.path!r}]"
        out.append(checked_copy(src, value, f"{at}, which state leaf '{leaf.path}' needs,"))
    return pytree.tree_unflatten(out, spec)


def layout_mismatch(torch_class: type | None, where: str) -> str:
    """Why a state_dict of the other layout does not load here, and what to do."""
    if torch_class is None:
        return (
            f"{where} of the state_dict has torch.optim's layout (no 'shared_state'); this Optimizer runs a "
            "built transform, whose state only loads from its own state_dict. Give Optimizer the factory "
            "(Optimizer(params, ps.adamw, lr=...)) to read torch.optim's layout"
        )
    return (
        f"{where} of the state_dict has purestep's generic layout ('shared_state'), but this Optimizer keeps "
        f"{torch_class.__name__}'s; build it the same way as the one that saved it"
    )
