"""Schedule-free learning: the `schedule_free` wrapper and the eval params it implies.

Training params are y; the base optimizer's step moves z; the eval params x are an
explicit output, `schedule_free_eval_params(state, params)`, never a hidden mode.
The update rule is written once, on `schedule_free_adamw` in `_alias.py`.
"""

from __future__ import annotations

from typing import Any, Iterator, NamedTuple

import torch
import torch.utils._pytree as pytree
from torch import Tensor

from . import _foreach as ls
from . import _tree as tr
from ._base import (
    OptState,
    Params,
    ScalarOrSchedule,
    Transform,
    as_float64,
    check_beta,
    check_betas,
    check_hyperparam,
    check_int,
    check_lr,
    check_nonnegative,
    leaf_device,
    once,
    require_params,
    resolve,
    zero_count,
)
from .engine.needs import Needs, with_needs
from ._weight_decay import decayed
from ._blocks import scale_by_adam, scale_by_lr
from ._combine import chain


class ScheduleFreeState(NamedTuple):
    """State of `schedule_free`: z, the averaging weights and the base state."""

    count: Tensor  # type: ignore[assignment]  # (), int64: updates applied
    b1: Tensor  # (), float64: the β₁ of the last update (x is recovered from y and z with it)
    weight_sum: Tensor  # (), float64: Σ of the averaging weights so far
    max_lr: Tensor  # (), float64: the largest lr seen so far
    z: Params  # the base optimizer's iterate
    base_state: OptState


def warmup_lr(lr: ScalarOrSchedule, warmup_steps: int) -> ScalarOrSchedule:
    """`lr · min(1, (t + 1) / warmup_steps)`, schedule-free's built-in linear warmup (t from 0)."""
    if warmup_steps == 0:
        return lr

    def schedule(step: Any) -> Any:
        step = torch.as_tensor(step, dtype=torch.float64)
        value = resolve(lr, step.to(torch.int64)) if callable(lr) else lr
        return value * torch.clamp((step + 1.0) / warmup_steps, max=1.0)

    return schedule


def schedule_free(
    base: Transform,
    lr: ScalarOrSchedule,
    b1: ScalarOrSchedule = 0.9,
    *,
    r: float = 0.0,
    weight_lr_power: float = 2.0,
) -> Transform:
    """Schedule-free averaging around `base`, whose update is the z step; see `schedule_free_adamw`.

    `base` must return the lr-scaled step of z (e.g. `chain(scale_by_adam(0.0, β₂),
    add_decayed_weights(λ), scale_by_lr(lr))`) and `lr` must be the same value or schedule
    it uses: it sets the averaging weights `(t+1)ʳ · max_lr^weight_lr_power`.
    Params passed to `update` are the training params y.

    Examples:
        >>> import torch, purestep.core as ps
        >>> t = ps.schedule_free(ps.chain(ps.scale_by_adam(0.0), ps.scale_by_lr(0.1)), lr=0.1)
        >>> p = {"w": torch.zeros(2)}
        >>> u, state = t.update({"w": torch.ones(2)}, t.init(p), p)
        >>> u["w"], ps.schedule_free_eval_params(state, ps.apply_updates(p, u))["w"]
        (tensor([-0.1000, -0.1000]), tensor([-0.1000, -0.1000]))

    References:
        Defazio et al., The Road Less Scheduled, 2024.
    """
    if not isinstance(base, Transform):
        raise ValueError(f"base must be a Transform, got {type(base).__name__}")
    check_hyperparam("lr", lr)
    check_nonnegative("lr", lr)
    check_hyperparam("b1", b1)
    check_beta("b1", b1)
    if isinstance(b1, (int, float)) and b1 == 0:
        raise ValueError("b1 must be > 0 for schedule-free: the eval params x = y + (1 - 1/b1)·(z - y)")
    check_hyperparam("r", r)
    check_nonnegative("r", r)
    check_hyperparam("weight_lr_power", weight_lr_power)
    check_nonnegative("weight_lr_power", weight_lr_power)

    def init(params: Params) -> ScheduleFreeState:
        leaves = pytree.tree_leaves(params)
        count = zero_count(leaf_device(leaves))
        f64 = lambda v: as_float64(v, count.device)  # noqa: E731
        z = pytree.tree_map(torch.clone, params)
        return ScheduleFreeState(count, f64(resolve(b1, count)), f64(0.0), f64(-1.0), z, base.init(params))

    def update(grads, state, params=None, **extra):
        require_params(params, "schedule_free", "the training params y")
        ys = tr.check_match(params, state.z, "params", "z", dtype=False)
        zs, spec = pytree.tree_flatten(state.z)
        lr_t = as_float64(resolve(lr, state.count), state.count.device)
        beta1 = as_float64(resolve(b1, state.count), state.count.device)
        max_lr = torch.maximum(state.max_lr, lr_t)
        t = (state.count + 1).to(torch.float64)
        weight = t**r * max_lr**weight_lr_power
        weight_sum = state.weight_sum + weight
        # c = w / Σw, 0 while every weight is 0 (lr = 0)
        c = once(torch.where(weight_sum > 0, weight / torch.where(weight_sum > 0, weight_sum, 1.0), 0.0))
        steps, base_state = base.update(grads, state.base_state, params, **extra)
        steps = tr.check_match(steps, state.z, "base updates", "z", dtype=False)
        # y ← (1-c)·y + c·z + (1 - β₁(1-c))·Δz,  z ← z + Δz   (Δz = -lr·ĝ, the base step)
        out = ls.lincomb(c, ls.sub(zs, ys), 1.0 - beta1 * (1.0 - c), steps)
        out = ls.cast_like(out, ys)
        z = ls.cast_like(ls.add(zs, steps), zs)
        new = ScheduleFreeState(state.count + 1, beta1, weight_sum, max_lr, pytree.tree_unflatten(z, spec), base_state)
        return pytree.tree_unflatten(out, spec), new

    return with_needs(Transform(init, update), Needs(parts=lambda tree: [(base, None)]))


def _states(tree: Any) -> Iterator[ScheduleFreeState]:
    if isinstance(tree, ScheduleFreeState):
        yield tree
        return
    if isinstance(tree, dict):
        children: Any = tree.values()
    elif isinstance(tree, (tuple, list)):
        children = tree
    else:
        return
    for child in children:
        yield from _states(child)


def schedule_free_eval_params(state: OptState, params: Params) -> Params:
    """The eval params x = y + (1 - 1/β₁)·(z - y) from a schedule-free state and the training params y.

    `state` is any optimizer state holding a `ScheduleFreeState` (a `chain`, `partition`,
    ... of one); leaves no schedule-free state covers are returned as they are.

    Examples:
        >>> import torch, purestep.core as ps
        >>> opt = ps.schedule_free_adamw(lr=0.1)
        >>> y = {"w": torch.zeros(2)}
        >>> u, state = opt.update({"w": torch.ones(2)}, opt.init(y), y)
        >>> y = ps.apply_updates(y, u)
        >>> ps.schedule_free_eval_params(state, y)["w"]
        tensor([-0.1000, -0.1000])
    """
    found = list(_states(state))
    if not found:
        raise ValueError(
            "state holds no schedule-free state: build the optimizer with ps.schedule_free_adamw or ps.schedule_free"
        )
    pairs, spec = tr.tree_flatten_with_path(params)
    out = {path: y for path, y in pairs}
    for sf in found:
        if pytree.tree_structure(sf.z) == spec:
            zs = dict(zip((p for p, _ in pairs), pytree.tree_leaves(sf.z)))
        elif isinstance(sf.z, dict) and all(k in out for k in sf.z):
            zs = sf.z  # a partition's or mask's flat dict(path -> z)
        else:
            raise ValueError(
                "params are not structured like the schedule-free state's z: pass the params the optimizer was built for"
            )
        for path, z in zs.items():
            y = out[path]
            if z.shape != y.shape:
                raise ValueError(f"params leaf '{path}' has shape {tuple(y.shape)} but z has {tuple(z.shape)}")
            # x = y + (1 - 1/β₁)·(z - y), schedulefree's eval(): y.lerp(z, 1 - 1/β₁)
            weight = (1.0 - 1.0 / sf.b1).to(device=y.device, dtype=y.dtype)
            out[path] = torch.lerp(y, z.to(y.dtype), weight)
    return tr.tree_unflatten([out[p] for p, _ in pairs], spec)


def schedule_free_adamw(
    lr: ScalarOrSchedule = 0.0025,
    betas: tuple[ScalarOrSchedule, ScalarOrSchedule] = (0.9, 0.999),
    eps: float = 1e-8,
    weight_decay: ScalarOrSchedule = 0.0,
    warmup_steps: int = 0,
    r: float = 0.0,
    weight_lr_power: float = 2.0,
) -> Transform:
    """Schedule-free AdamW, = `schedulefree.AdamWScheduleFree`; params in training are y.

    ηₜ = η·min(1, (t+1)/warmup);  v ← β₂·v + (1-β₂)·g²;  ĝ = g / (√(v/(1-β₂ᵗ⁺¹)) + ε) + λ·y;
    wₜ = (t+1)ʳ·max_{s≤t}(ηₛ)^p;  c = wₜ / Σ_{s≤t} wₛ;
    y ← (1-c)·y + c·z + ηₜ·(β₁(1-c) - 1)·ĝ;  z ← z - ηₜ·ĝ,
    with η = `lr`, (β₁, β₂) = `betas`, ε = `eps`, λ = `weight_decay` (at y), r = `r`,
    p = `weight_lr_power`, t the update count from 0. Evaluate at x = y + (1 - 1/β₁)·(z - y):
    `ps.schedule_free_eval_params(state, params)`.

    Warning:
        No train()/eval() modes: params stay y; x is an explicit output.

    Examples:
        >>> import torch, purestep.core as ps
        >>> opt = ps.schedule_free_adamw(lr=0.1, warmup_steps=10)
        >>> y = {"w": torch.ones(2)}
        >>> updates, state = opt.update({"w": torch.ones(2)}, opt.init(y), y)
        >>> updates["w"]  # first update: lr·1/10 of warmup, c = 1 so y moves onto z
        tensor([-0.0100, -0.0100])

    References:
        Defazio et al., The Road Less Scheduled, 2024.
    """
    check_lr(lr)
    b1, b2 = check_betas(betas)
    check_int("warmup_steps", warmup_steps)
    lr_t = warmup_lr(lr, warmup_steps)
    base = chain(scale_by_adam(0.0, b2, eps), decayed(weight_decay), scale_by_lr(lr_t))
    return schedule_free(base, lr_t, b1, r=r, weight_lr_power=weight_lr_power)
