"""Transforms and schedules from config sections, by `purestep.core`'s public names.

A core factory that rejects its arguments raises a `ValueError` about one of them; the
`ConfigError` names the config field of the argument found by calling the factory
again without each optional argument in turn (the one whose removal makes the call
succeed), never by reading the message.
"""

from __future__ import annotations

import inspect
from typing import TYPE_CHECKING, Any, Callable

import msgspec
import torch
from torch import Tensor

import purestep.core as ps

from .errors import ConfigError

if TYPE_CHECKING:  # the config module builds through this one
    from ._sections import OptimizerConfig, ScheduleConfig

Argument = tuple[str, Any, str]  # (keyword, value, config field)


def _public(name: str, what: str, field: str) -> Any:
    if name not in ps.__all__ or not callable(getattr(ps, name, None)):
        raise ConfigError(field, f"{name!r} is not a public purestep.core {what}")
    return getattr(ps, name)


def _argument(name: str, value: Any, field: str) -> Any:
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) >= 1 << 63:
        raise ConfigError(field, f"{value} is out of range (|value| < 2**63)")
    if isinstance(value, list):
        return tuple(_argument(name, v, field) for v in value)
    rule = name in ("mask", "labels", "batch_dims") or name.endswith(("_mask", "_labels"))
    if isinstance(value, str) and rule:
        return _public(value, "function", field)
    allowed: tuple[type, ...] = (
        (dict,) + ((bool,) if name.endswith("mask") else ()) + ((int,) if name == "batch_dims" else ())
    )
    if rule and (not isinstance(value, allowed) or (name == "batch_dims" and isinstance(value, bool))):
        what = "an int or a table of ints per param" if name == "batch_dims" else "a table per param"
        raise ConfigError(
            field,
            f"{value!r} is neither the name of a public purestep.core function (e.g. "
            f"'{'decay_mask' if name.endswith('mask') else 'muon_labels'}') nor {what}",
        )
    if isinstance(value, str) and name.endswith("dtype"):
        dtype = getattr(torch, value, None)
        if not isinstance(dtype, torch.dtype):
            raise ConfigError(field, f"{value!r} is not a torch dtype (e.g. 'bfloat16', 'float32')")
        return dtype
    return value


def _call(factory: Callable, args: list[Argument], section: str) -> Any:
    """`factory(**args)`; a rejected call raises a `ConfigError` naming the culprit's field."""
    try:
        return factory(**{k: v for k, v, _ in args})
    except (ValueError, TypeError) as error:
        required = {p for p, v in inspect.signature(factory).parameters.items() if v.default is v.empty}
        for i in reversed(range(len(args))):
            if args[i][0] in required:
                continue
            try:
                factory(**{k: v for j, (k, v, _) in enumerate(args) if j != i})
            except (ValueError, TypeError):
                continue
            raise ConfigError(args[i][2], str(error)) from None
        raise ConfigError(section, str(error)) from None


def _refuse_unused(section: ScheduleConfig, used: set[str], name: str) -> None:
    for field, value, default in (
        ("warmup_steps", section.warmup_steps, None),
        ("decay_steps", section.decay_steps, None),
        ("final_lr", section.final_lr, 0.0),
    ):
        if value != default and f"schedule.{field}" not in used:
            raise ConfigError(f"schedule.{field}", f"{name} takes no such argument")


def build_schedule(section: ScheduleConfig, lr: float, steps: int) -> Any:
    """`ps.<section.name>_schedule` with its first argument `lr`, or `lr` for "constant"."""
    if section.name == "constant" and not section.kwargs:
        _refuse_unused(section, set(), "a constant lr")
        return lr
    name = section.name if section.name.endswith("_schedule") else f"{section.name}_schedule"
    if name not in ps.__all__:
        known = sorted(n[: -len("_schedule")] for n in ps.__all__ if n.endswith("_schedule"))
        raise ConfigError("schedule.name", f"{section.name!r} is not a purestep schedule; one of {known}")
    factory = getattr(ps, name)
    params = inspect.signature(factory).parameters
    first = next(iter(params))
    warmup = section.warmup_steps if section.warmup_steps is not None else steps // 20
    offered = {
        "steps": (steps, "steps"),
        "total_steps": (steps, "steps"),
        "warmup_steps": (warmup, "schedule.warmup_steps"),
        "decay_steps": (section.decay_steps, "schedule.decay_steps"),
        "final": (section.final_lr, "schedule.final_lr"),
        "end": (section.final_lr, "schedule.final_lr"),
    }
    args: list[Argument] = [(first, lr, "optimizer.lr")]
    args += [(arg, value, field) for arg, (value, field) in offered.items() if arg in params and value is not None]
    _refuse_unused(section, {field for _, _, field in args}, name)
    for arg, value in section.kwargs.items():
        field = f"schedule.kwargs.{arg}"
        if arg not in params or arg == first:
            raise ConfigError(field, f"{name} has no argument {arg!r} (it takes {list(params)[1:]})")
        args.append((arg, _argument(arg, value, field), field))
    given = {k for k, _, _ in args}
    missing = [p for p, v in params.items() if v.default is v.empty and p not in given]
    if missing:
        field = offered[missing[0]][1] if missing[0] in offered else f"schedule.kwargs.{missing[0]}"
        raise ConfigError(field, f"{name} needs {missing[0]!r}; set it in the config")
    return _call(factory, args, "schedule")


def _follow(schedule: Callable, ratio: float) -> Callable:
    """`schedule` scaled by `ratio`: another lr that keeps the shape of the main one."""
    return lambda count: schedule(count) * ratio


def build_optimizer(section: OptimizerConfig, lr: Any) -> ps.Transform:
    """`ps.inject_hyperparams(ps.<section.name>)(lr=lr, **section.kwargs)`, behind
    `ps.clip_by_global_norm` if asked. With a schedule for `lr`, every other `*_lr`
    keyword follows it, scaled to its own peak."""
    factory = _public(section.name, "optimizer", "optimizer.name")
    params = inspect.signature(factory).parameters
    if "lr" not in params:
        raise ConfigError("optimizer.name", f"{section.name!r} is not a purestep optimizer (it takes no lr)")
    args: list[Argument] = [("lr", lr, "optimizer.lr")]
    for arg, value in section.kwargs.items():
        field = f"optimizer.kwargs.{arg}"
        if arg == "lr":
            raise ConfigError(field, "set optimizer.lr instead")
        if arg not in params:
            raise ConfigError(
                field,
                f"{section.name} has no argument {arg!r} (it takes {[p for p in params if p != 'lr']}); "
                f"with a new optimizer.name, set its own optimizer.kwargs (--set 'optimizer.kwargs={{}}' clears them)",
            )
        value = _argument(arg, value, field)
        if callable(lr) and arg.endswith("_lr") and isinstance(value, (int, float)) and section.lr > 0:
            value = _follow(lr, value / section.lr)
        args.append((arg, value, field))
    transform = _call(ps.inject_hyperparams(factory), args, "optimizer")
    if not isinstance(transform, ps.Transform):
        raise ConfigError("optimizer.name", f"{section.name!r} is not a purestep optimizer")
    if section.clip_grad_norm is not None:
        transform = _clipped(transform, section.clip_grad_norm)
    return transform


def _clipped(transform: ps.Transform, max_norm: float) -> ps.Transform:
    """`transform` behind `ps.clip_by_global_norm(max_norm)` (`optimizer.clip_grad_norm`)."""
    return ps.chain(ps.clip_by_global_norm(max_norm), transform)


def qk_clip_for(model: Any, threshold: float) -> ps.Transform:
    """`ps.qk_clip` over `model`'s attention heads (`model.qk_heads()`), with the model set to
    record each head's max logit in its forward (`optimizer.qk_clip`)."""
    if not callable(getattr(model, "qk_heads", None)) or not callable(getattr(model, "track_max_logits", None)):
        raise ConfigError(
            "optimizer.qk_clip",
            "needs a model that reports its attention heads (qk_heads(), track_max_logits(), take_max_logits(), "
            "as the built-in GPT)",
        )
    model.track_max_logits()
    return ps.qk_clip(threshold, model.qk_heads())


def trainer_transform(
    config: Any, transform: ps.Transform | None, params: dict[str, Tensor], model: Any, workers: Any
) -> ps.Transform:
    """The transform the Trainer runs: `transform` (None: the config's optimizer, with its
    clip), `optimizer.clip_grad_norm` in front of a given one (refused when it clips
    already), `optimizer.qk_clip` behind it (over `model`'s heads), `ps.compensated_updates()`
    last for bf16 params (unless it holds one), all in `ps.apply_if_finite`; with `[diloco]`,
    that inside `ps.diloco` (the skip inside: every worker counts every step, so the syncs
    line up; `workers` the exchange between them: `(reduce, gather)`)."""
    if transform is None:
        section = config.optimizer
        takes = inspect.signature(_public(section.name, "optimizer", "optimizer.name")).parameters
        if getattr(model, "experts", 0) and "batch_dims" in takes and "batch_dims" not in section.kwargs:
            # a mixture of experts: Muon's matrices are each expert's (the model's table)
            section = msgspec.structs.replace(section, kwargs={**section.kwargs, "batch_dims": model.batch_dims()})
        transform = build_optimizer(section, config.build_schedule())
    elif config.optimizer.clip_grad_norm is not None:
        if ps.contains(transform, ps.clip_by_global_norm, params):
            raise ConfigError("optimizer.clip_grad_norm", "the given transform clips already; set it to None")
        transform = _clipped(transform, config.optimizer.clip_grad_norm)
    if config.optimizer.qk_clip is not None:
        transform = ps.chain(transform, qk_clip_for(model, config.optimizer.qk_clip))
    if config.bf16_params and not ps.contains(transform, ps.compensated_updates, params):
        transform = ps.chain(transform, ps.compensated_updates())  # last: it sees the final update
    transform = ps.apply_if_finite(transform)
    d = config.diloco
    if d.sync_every is not None:
        outer = ps.sgd(d.outer_lr, momentum=d.outer_momentum, nesterov=d.outer_momentum > 0)
        reduce, gather = workers
        compression = None
        if d.compression == "sparseloco":
            compression = ps.TopK(density=d.density, bits=d.bits, error_decay=d.error_decay)
            reduce = None  # the compressed form travels through gather
        else:
            gather = None
        transform = ps.diloco(
            transform,
            outer,
            d.sync_every,
            reduce,
            fragments=d.fragments,
            delay=d.delay,
            alpha=d.alpha,
            compression=compression,
            gather=gather,
        )
    return transform
