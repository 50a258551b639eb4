"""The training step: `make_step` (grads + update), `make_update` (update only), `functional_model`.

The step is one pure function `(params, opt_state, batch) -> (params, opt_state, metrics)`.
`compile=True` hands it to `torch.compile(fullgraph=True)`; `donate=True` writes the
results back into the input tensors, which inductor turns into in-place kernels, so a
compiled donated step moves the bytes `torch.optim.AdamW(fused=True)` moves.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, ClassVar

import torch
import torch.utils._pytree as pytree
from torch import Tensor

from . import _tree as tr
from ._base import check_bool, OptState, Params, PyTree, Transform, check_int
from ._combine import skipped_updates
from .engine import Engine, compile_per_leaf, explain_pure
from .engine.per_leaf import eager
from .engine import ops as lay
from .engine.donate import copy_into
from .engine.dtensor import is_dtensor, local
from .engine.packed import is_packed, pack_like
from .engine.replicas import check_over_replicas

Metrics = dict[str, Any]


# --------------------------------------------------------------------------- #
# Pieces shared by make_step and make_update.
# --------------------------------------------------------------------------- #


def _check_optimizer(optimizer: Any) -> None:
    if not isinstance(optimizer, Transform):
        raise ValueError(f"optimizer must be a ps.Transform (e.g. ps.adamw(1e-3)), got {type(optimizer).__name__}")


def _check_ema(ema: Any) -> tuple[Callable, Callable] | None:
    if ema is None:
        return None
    if isinstance(ema, tuple) and len(ema) == 2 and all(callable(f) for f in ema):
        return ema[0], ema[1]
    raise ValueError(f"ema must be an (init, update) pair such as ps.params_ema(0.999), got {ema!r}")


def _apply(
    optimizer: Transform, params: Params, grads: PyTree, opt_state: OptState, extra: dict | None = None
) -> tuple[Params, OptState, PyTree]:
    updates, opt_state = optimizer.update(grads, opt_state, params, **(extra or {}))
    return tr.apply_updates(params, updates), opt_state, updates


def _update_metrics(grads: PyTree, new_state: OptState) -> Metrics:
    """`make_update(..., metrics=True)`'s metrics, 0-d tensors and no host sync: `grad_norm`
    (the global norm of the grads given, before any clipping; over FSDP2 shards, of the
    whole grads), `lr` (as make_step's) and `skipped` (True when `apply_if_finite` skipped
    this update; from the outermost `apply_if_finite`, see `ps.skipped_updates`)."""
    if lay.is_packed(grads):  # flat buffers or this rank's shards: the reduction protocol's norm
        norm = lay.global_norm(grads)
    else:
        norm = tr.tree_global_norm(grads)
        if is_dtensor(norm):  # whole DTensors (the per-leaf DTensor path)
            norm = norm.full_tensor()  # type: ignore[attr-defined]  # a DTensor
    metrics: Metrics = {"grad_norm": norm}
    lr = _lr_metric(new_state)
    if lr is not None:
        metrics["lr"] = lr
    skips = skipped_updates(new_state)
    if skips is not None:
        metrics["skipped"] = skips[0]
    return metrics


def _amp_inputs(grads: PyTree, grad_scale: Tensor | None, found_inf: Tensor | None) -> tuple[Tensor, Tensor] | None:
    """`(grad_scale, found_inf)` as 0-d float32 tensors on the grads' device (1 and 0 for the
    one not given), or None when neither is: torch's fused-optimizer AMP protocol."""
    if grad_scale is None and found_inf is None:
        return None
    for name, value in (("grad_scale", grad_scale), ("found_inf", found_inf)):
        if value is not None and not (isinstance(value, Tensor) and value.numel() == 1):
            raise ValueError(f"{name} must be a one-element tensor (as torch.amp.GradScaler sets it), got {value!r}")
    leaves = [x for x in pytree.tree_leaves(grads) if isinstance(x, Tensor)]
    device = local(leaves[0]).device if leaves else torch.device("cpu")
    as_scalar = lambda v, default: (
        torch.full((), default, dtype=torch.float32, device=device)
        if v is None  # noqa: E731
        else v.reshape(()).to(device=device, dtype=torch.float32, non_blocking=True)
    )
    return as_scalar(grad_scale, 1.0), as_scalar(found_inf, 0.0)


def _lr_metric(opt_state: OptState) -> Tensor | None:
    """The lr the step used, when exactly one injected hyperparameter is called `lr`."""
    found = [hp["lr"] for _, hp in tr.find_all(opt_state, "hyperparams") if isinstance(hp, dict) and "lr" in hp]
    if len(found) == 1 and isinstance(found[0], Tensor):
        return found[0].detach().clone()
    return None


# --------------------------------------------------------------------------- #
# The programs: what make_update and make_step compute, as data for the engine.
# --------------------------------------------------------------------------- #


@dataclasses.dataclass(frozen=True, eq=False)
class UpdateProgram:
    """`make_update`'s update as data: the transform, the EMA pair, whether metrics come
    back. The engine's paths run its two forms (core/README.md): `pure` (new trees; the
    flat and sharded paths compile it over their buffers) and `in_place` (pure, then copied
    into the inputs: the per-leaf compiled and DTensor paths); uncompiled donation is the
    engine's `per_leaf.eager`, which asks `metrics_of` for the metrics."""

    transform: Transform
    averaging: tuple[Callable, Callable] | None
    metrics: bool
    kind: ClassVar[str] = "update"  # grads come from the caller

    def pure(self, params, grads, opt_state, ema_state=None, amp=None, extra=None):
        """-> (params, opt_state[, ema_state][, metrics]); amp: (grad_scale, found_inf) 0-d
        tensors; extra: the transform's own keyword inputs (`hessian=`, `max_logits=`)."""
        averaging = self.averaging
        tr.check_match(grads, params, "grads", "params")
        if amp is not None:  # torch's fused AMP protocol: g / grad_scale, inside the same kernels
            grads = pytree.tree_map(lambda g: g / amp[0].to(g.dtype), grads)
        new_params, new_state, _ = _apply(self.transform, params, grads, opt_state, extra)
        new_ema = None if averaging is None else averaging[1](ema_state, new_params)
        if amp is not None:  # found_inf: nothing changes, params, state and EMA (counts included)
            skip = amp[1] > 0
            keep = lambda old, new: pytree.tree_map(lambda o, n: torch.where(skip, o, n), old, new)  # noqa: E731
            new_params, new_state = keep(params, new_params), keep(opt_state, new_state)
            new_ema = None if averaging is None else keep(ema_state, new_ema)
        out = (new_params, new_state) + (() if averaging is None else (new_ema,))
        if not self.metrics:
            return out
        step_metrics = _update_metrics(grads, new_state)
        if amp is not None:
            skipped = amp[1] > 0
            step_metrics["skipped"] = skipped | step_metrics["skipped"] if "skipped" in step_metrics else skipped
        return out + (step_metrics,)

    def in_place(self, params, grads, opt_state, ema_state=None, amp=None, extra=None, defer_scalars=False):
        """`pure`, copied into the inputs; `defer_scalars`: -> (result, the 0-d leaves' copies
        left to the caller, see `donate.copy_scalars`)."""
        out = self.pure(params, grads, opt_state, ema_state, amp, extra)
        deferred: list | None = [] if defer_scalars else None
        copy_into(params, out[0], "params", deferred)
        copy_into(opt_state, out[1], "opt_state", deferred)
        if self.averaging is not None:
            copy_into(ema_state, out[2], "ema_state", deferred)
        result = out[-1] if self.metrics else None
        return (result, deferred) if defer_scalars else result

    def metrics_of(self, grads, new_state):
        return _update_metrics(grads, new_state)


@dataclasses.dataclass(frozen=True, eq=False)
class StepProgram:
    """`make_step`'s step as data: grads of `loss_fn` (micro-batched), then the transform.
    Its forms take `(params, opt_state, batch, buffers, with_buffers)` and return the
    metrics (`pure` also the new trees); on flat buffers the loss sees per-leaf views."""

    transform: Transform
    loss_fn: Callable[..., Any]
    has_aux: bool
    micro_batches: int
    kind: ClassVar[str] = "step"  # grads computed inside
    averaging: ClassVar[None] = None
    metrics: ClassVar[bool] = True

    def grads_of(self, params, batch, buffers, with_buffers):
        has_aux, loss_fn = self.has_aux, self.loss_fn

        def inner(p):
            if not with_buffers:
                out = loss_fn(p, batch)
                return out if has_aux else (out, ())
            out = loss_fn(p, batch, buffers)
            if not isinstance(out, tuple) or len(out) != (3 if has_aux else 2):
                want = "(loss, aux, new_buffers)" if has_aux else "(loss, new_buffers)"
                raise ValueError(f"with buffers, loss_fn(params, batch, buffers) must return {want}")
            return out[0], (out[1] if has_aux else (), out[-1])

        grads, (loss, aux) = torch.func.grad_and_value(inner, has_aux=True)(params)
        if with_buffers:
            aux, buffers = aux
        return grads, loss, aux, buffers

    def loss_and_grads(self, params, batch, buffers, with_buffers):
        # Flat buffers (`FlatStep`): the loss sees per-leaf views; the grads are packed after.
        k = self.micro_batches
        named = params.unpack() if is_packed(params) else params
        if k == 1:
            grads, loss, aux, buffers = self.grads_of(named, batch, buffers, with_buffers)
        else:
            grads, losses, auxes = None, [], []
            for micro in _split_batch(batch, k):
                g, loss, aux, buffers = self.grads_of(named, micro, buffers, with_buffers)
                grads = g if grads is None else pytree.tree_map(torch.add, grads, g)
                losses.append(loss)
                auxes.append(aux)
            grads = pytree.tree_map(lambda g: g / k, grads)
            loss = torch.stack(losses).mean()
            aux = pytree.tree_map(lambda *xs: torch.stack(xs), *auxes) if self.has_aux else None
        if is_packed(params):
            grads = pack_like(params, grads)
        return grads, loss, aux, buffers

    def metrics_of(self, loss, grads, aux, updates, new_state):
        metrics = {"loss": loss, "grad_norm": tr.tree_global_norm(grads), "update_norm": tr.tree_global_norm(updates)}
        lr = _lr_metric(new_state)
        if lr is not None:
            metrics["lr"] = lr
        if self.has_aux:
            metrics["aux"] = aux
        return metrics

    def pure(self, params, opt_state, batch, buffers=None, with_buffers=False):
        grads, loss, aux, buffers = self.loss_and_grads(params, batch, buffers, with_buffers)
        new_params, new_state, updates = _apply(self.transform, params, grads, opt_state)
        return new_params, new_state, self.metrics_of(loss, grads, aux, updates, new_state), buffers

    def in_place(self, params, opt_state, batch, buffers=None, with_buffers=False, defer_scalars=False):
        new_params, new_state, metrics, new_buffers = self.pure(params, opt_state, batch, buffers, with_buffers)
        deferred: list | None = [] if defer_scalars else None
        copy_into(params, new_params, "params", deferred)
        copy_into(opt_state, new_state, "opt_state", deferred)
        if with_buffers:
            copy_into(buffers, new_buffers, "buffers", deferred)
        return (metrics, deferred) if defer_scalars else metrics


# --------------------------------------------------------------------------- #
# make_update.
# --------------------------------------------------------------------------- #


def make_update(
    optimizer: Transform,
    *,
    compile: bool = False,
    donate: bool = False,
    ema: Any = None,
    flat: bool = True,
    metrics: bool = False,
    shard_state_over_replicas: Any = False,
) -> Callable[..., tuple]:
    """The optimizer half of a step, for gradients from `loss.backward()`.

    `update(params, grads, opt_state) -> (params, opt_state)` applies `optimizer` once.
    With `ema=ps.params_ema(decay)` the averaged params are updated in the same call:
    `update(params, grads, opt_state, ema_state) -> (params, opt_state, ema_state)`.
    Other keywords go to the transform's update as its own inputs (`update(..., hessian=h)`
    for Sophia, `max_logits=` for `qk_clip`); a tree of them shaped like the params is packed
    with the grads on flat buffers.
    `update(..., grad_scale=s, found_inf=f)` is torch's fused-optimizer AMP protocol
    (`torch.amp.GradScaler` sets `grad_scale` and `found_inf` on an optimizer whose
    `_step_supports_amp_scaling` is True): the update runs on `grads / s` and, where `f > 0`,
    changes nothing (params, state, counts, EMA), decided on the device with no host sync,
    inside the same compiled kernels.
    With `metrics=True` a dict of 0-d tensors comes last, computed in the same call with no
    host sync, as `make_step`'s: `grad_norm` (of the grads given, before any clipping; over
    FSDP2 shards the whole grads'), `lr` (the injected `lr`, when the state holds exactly
    one), `skipped` (whether `apply_if_finite` skipped this update, when it holds one: the
    outermost; its running total is `ps.skipped_updates(opt_state)`).
    Clipping, weight decay, the step counter and the EMA then fuse into the same
    compiled kernels: one pass over memory instead of one per piece.

    Args:
      optimizer: any `ps.Transform`, e.g. `ps.chain(ps.clip_by_global_norm(1.0), ps.adamw(1e-3))`.
      compile: run the update under `torch.compile(fullgraph=True)`. Schedules
        advancing and hyperparameters changed with `set_hyperparam` do not recompile.
      donate: write the results into the input tensors and return the input trees
        (they alias); the grads are only read. Without it the update is pure.
      ema: an `(init, update)` averaging pair such as `ps.params_ema(0.999)`, or None.
      flat: with `compile=True, donate=True`, run over flat buffers (below); False keeps
        one kernel per leaf.
      metrics: also return the step's metrics (above), so a loop needs no look into the state.
      shard_state_over_replicas: HSDP (`donate=True`): each rank keeps 1/R of its block of
        every state leaf (R replicas; the state's DTensors re-placed in place, global to
        `full_tensor()` and checkpoints). True on HSDP's own params; the (replicate, shard)
        `DeviceMesh`, with FSDP2 over `mesh["shard"]`, and the update averages the replicas'
        grads itself (HSDP's bytes). docs/guides/distributed.md shows both.

    Eager donation (`donate=True` without compile) applies the update in place without
    materializing it where the transform has an in-place form (`with_in_place`): a
    chain folds its affine tail (weight decay, lr) into the coefficients of
    `p ← a·p + b·u`, and `scale_by_adam` then runs torch's fused AdamW kernel on CPU (or
    its foreach step, block of leaves by block, where that kernel does not take them), with
    μ and ν updated in their own storage. The params then equal the pure update to
    rounding, not bitwise (an ulp or so per step). Other new state leaves adopt their new storage
    (`Tensor.set_`) or, when small or shared, are copied back.

    Flat buffers (`compile=True, donate=True, flat=True`): on the first call the params,
    the optimizer state (and EMA) move into one contiguous buffer per group of leaves
    that share device, dtype and the transform's per-leaf rules (mask values, partition
    labels, `scale_per_leaf` multipliers; leaves that need per-leaf math, as Muon's
    matrices and trust ratios, form one (k, *shape) stack per shape; a transform whose
    results differ packed keeps the per-leaf path), and the compiled update runs on those
    buffers: kernels and compile time grow with the number of groups, not of tensors. On
    CUDA the step is then replayed as one CUDA graph. The tensors you passed stay the
    same objects holding the same values, re-pointed (`Tensor.set_`) into the buffers:

    - update params and state in place (`p.copy_(...)`, `load_state_dict`), or pass new
      trees: a new state tree (a loaded checkpoint, `set_hyperparam`) or a param whose
      storage changed is copied into the buffers on the next call;
    - another tensor that shares a param's old storage (a `.detach()` taken before the
      first call) keeps the old values; take it after, or from `functional_model`;
    - grads are copied into a flat grad buffer and the grad tensors passed are re-pointed
      into it, so a `loss.backward()` after `zero_grad(set_to_none=False)` writes there
      directly and the next call copies nothing;
    - transforms whose state is not shaped like the params keep a per-leaf path, except
      per-row statistics of whole matrices (a leading part of each leaf's shape, as
      NorMuon's second moment), which get buffers of their own.

    FSDP2 (DTensor params, grads and state), `donate=True`, compiled or not: the same flat
    buffers over this rank's row blocks; tree-wide reductions are local partials plus one
    batched collective each, Muon's orthogonalization runs once per matrix on an owner rank,
    and the params keep their storage objects, whose memory moves into the buffers (FSDP2
    all-gathers from there); docs/guides/distributed.md shows it. `update.explain()` says which
    path runs and why; `update.layout()` shows the buffers.

    Examples:
        >>> import torch, purestep.core as ps
        >>> opt = ps.sgd(lr=0.5)
        >>> update = ps.make_update(opt, donate=True)
        >>> params = {"w": torch.ones(2)}
        >>> state = opt.init(params)
        >>> new_params, state = update(params, {"w": torch.ones(2)}, state)
        >>> new_params["w"], new_params is params
        (tensor([0.5000, 0.5000]), True)
    """
    _check_optimizer(optimizer)
    averaging = _check_ema(ema)
    check_bool("metrics", metrics)
    check_over_replicas(shard_state_over_replicas, donate)

    program = UpdateProgram(optimizer, averaging, metrics)
    pure = compile_per_leaf(program.pure) if compile else program.pure
    engine = Engine(program, compile=compile, flat=flat, over_replicas=shard_state_over_replicas)

    def update(
        params: Params,
        grads: PyTree,
        opt_state: OptState,
        *ema_state: Any,
        grad_scale: Tensor | None = None,
        found_inf: Tensor | None = None,
        **inputs: Any,
    ) -> tuple:
        if len(ema_state) != (averaging is not None):
            want = "(params, grads, opt_state, ema_state)" if averaging else "(params, grads, opt_state)"
            raise TypeError(f"update takes {want}; got {3 + len(ema_state)} arguments")
        amp = _amp_inputs(grads, grad_scale, found_inf)
        extra: dict[str, Any] = {} if amp is None else {"amp": amp}
        if inputs:  # the transform's own keyword inputs, passed to its update
            extra["extra"] = inputs
        if not donate:
            return pure(params, grads, opt_state, *ema_state, **extra)
        run = engine.path_for(params, grads)
        with torch.no_grad():  # a donated update is never differentiated: record no graph
            out = run(params, grads, opt_state, *ema_state, **extra)
        return (params, opt_state, *ema_state) + ((out,) if metrics else ())

    update.explain = engine.explain if donate else explain_pure  # type: ignore[attr-defined]
    update.layout = engine.layout  # type: ignore[attr-defined]
    return update


# --------------------------------------------------------------------------- #
# make_step.
# --------------------------------------------------------------------------- #


def _split_batch(batch: PyTree, k: int) -> list[PyTree]:
    """`batch` cut into `k` equal micro-batches along dim 0 of every tensor leaf."""
    leaves, spec = pytree.tree_flatten(batch)
    pieces = []
    for path, leaf in tr.tree_flatten_with_path(batch)[0]:
        if not isinstance(leaf, Tensor):
            pieces.append([leaf] * k)
            continue
        n = leaf.shape[0] if leaf.dim() > 0 else 0
        if leaf.dim() == 0 or n % k:
            raise ValueError(
                f"micro_batches={k} must divide the batch size: batch leaf '{path or '<root>'}' has "
                f"shape {tuple(leaf.shape)}; use a batch size that is a multiple of {k}"
            )
        pieces.append(leaf.unflatten(0, (k, n // k)).unbind(0))
    return [pytree.tree_unflatten([p[i] for p in pieces], spec) for i in range(k)]


def make_step(
    loss_fn: Callable[..., Any],
    optimizer: Transform,
    *,
    has_aux: bool = False,
    micro_batches: int = 1,
    compile: bool = False,
    donate: bool = False,
    flat: bool = True,
) -> Callable[..., tuple]:
    """One training step: gradients of `loss_fn`, then `optimizer`, as one function.

    `step(params, opt_state, batch) -> (params, opt_state, metrics)`, with
    `loss_fn(params, batch) -> loss` (or `(loss, aux)` with `has_aux`) and gradients by
    `torch.func.grad_and_value`. `metrics` holds 0-d tensors, computed without a host
    sync: `loss` (mean over micro-batches), `grad_norm` (global norm of the averaged
    grads, before any clipping), `update_norm` (global norm of the applied update), and
    `lr` when the state holds exactly one injected `lr`
    (`ps.inject_hyperparams(ps.adamw)(lr=...)`: the value this step used; a schedule
    baked into a plain `ps.adamw(lr=schedule)` has no state entry to read); with
    `has_aux`, `aux` (stacked on a new dim 0 when `micro_batches > 1`).

    Buffers (BatchNorm statistics, see `functional_model`) are threaded through:
    `step(params, opt_state, batch, buffers) -> (params, opt_state, metrics, buffers)`
    calls `loss_fn(params, batch, buffers)`, which returns `(loss, new_buffers)` or
    `(loss, aux, new_buffers)`; micro-batches update the buffers one after another.

    Args:
      loss_fn: `(params, batch[, buffers]) -> loss`, a 0-d tensor.
      optimizer: any `ps.Transform`.
      has_aux: `loss_fn` also returns an auxiliary output.
      micro_batches: split the batch on dim 0 into this many equal parts and average
        their gradients (= the full-batch step for a mean loss); `ValueError` when it
        does not divide the batch.
      compile: `torch.compile(fullgraph=True)`; advancing schedules, `set_hyperparam`
        and new batches of the same shape do not recompile.
      donate: update params, state (and buffers) in place; the returned trees are the
        input trees. Without it the step is pure: differentiable (meta-gradients) and
        `torch.func.vmap`-able (ensembles).
      flat: with `compile=True, donate=True`, params and state live in flat buffers and
        the update runs over them, as in `make_update` (whose docstring states the rules);
        the loss sees per-leaf views, and on CUDA the whole step is one CUDA-graph replay
        (the batch is copied into the graph's own input tensors; metrics are copies).

    Examples:
        >>> import torch, purestep.core as ps
        >>> def loss_fn(params, batch):
        ...     x, y = batch
        ...     return ((x @ params["w"] - y) ** 2).mean()
        >>> opt = ps.inject_hyperparams(ps.adamw)(lr=0.1)
        >>> params = {"w": torch.zeros(3, 1)}
        >>> state = opt.init(params)
        >>> step = ps.make_step(loss_fn, opt)
        >>> params, state, metrics = step(params, state, (torch.ones(8, 3), torch.ones(8, 1)))
        >>> sorted(metrics), metrics["loss"]
        (['grad_norm', 'loss', 'lr', 'update_norm'], tensor(1.))
    """
    if not callable(loss_fn):
        raise ValueError(f"loss_fn must be callable, got {loss_fn!r}")
    _check_optimizer(optimizer)
    check_int("micro_batches", micro_batches, 1)

    program = StepProgram(optimizer, loss_fn, has_aux, micro_batches)
    inner = program.pure if not donate else program.in_place if compile else eager(program)
    inner = compile_per_leaf(inner) if compile else inner
    engine = Engine(program, compile=compile, flat=flat)

    def step(params: Params, opt_state: OptState, batch: PyTree, buffers: PyTree = None) -> tuple:
        with_buffers = buffers is not None
        if donate:
            metrics = engine.path_for(params)(params, opt_state, batch, buffers, with_buffers)
            new_params, new_state, new_buffers = params, opt_state, buffers
        else:
            new_params, new_state, metrics, new_buffers = inner(params, opt_state, batch, buffers, with_buffers)
        if with_buffers:
            return new_params, new_state, metrics, new_buffers
        return new_params, new_state, metrics

    step.explain = engine.explain if donate else explain_pure  # type: ignore[attr-defined]
    step.layout = engine.layout  # type: ignore[attr-defined]
    return step
