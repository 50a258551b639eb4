"""The training step: `make_step` (grads + update), `make_update` (update only), `functional_model`.

The step is one pure function `(params, opt_state, batch) -> (params, opt_state, metrics)`.
`compile=True` hands it to `torch.compile(fullgraph=True)`; `donate=True` writes the
results back into the input tensors, which inductor turns into in-place kernels, so a
compiled donated step moves the bytes `torch.optim.AdamW(fused=True)` moves.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch._inductor.config as _inductor_config
import torch.utils._pytree as pytree
from torch import Tensor

from .engine import packed as _flat
from .engine import ops as lay
from . import _lists as ls
from . import _tree as tr
from ._base import OptState, Params, PyTree, Transform, check_int
from ._combine import apply_in_place
from .engine import sharded as _sharded
from .engine import Engine, explain_pure
from .engine.flat import FlatStep, FlatUpdate

Metrics = dict[str, Any]


# --------------------------------------------------------------------------- #
# nn.Module -> pure function.
# --------------------------------------------------------------------------- #


def functional_model(module: torch.nn.Module) -> tuple[Callable[..., tuple[Any, dict]], dict, dict]:
    """An `nn.Module` as a pure `(apply_fn, params, buffers)`.

    `apply_fn(params, buffers, *args, **kwargs) -> (output, new_buffers)` runs the
    module's `forward` with the given tensors (`torch.func.functional_call`). Buffers
    the forward updates in place (BatchNorm's running statistics) are updated in a
    copy, returned as `new_buffers`: the inputs are never mutated. Train/eval behaviour
    follows the module's mode (`module.train()` / `module.eval()`).

    Returns:
      `(apply_fn, params, buffers)`; `params` and `buffers` are `dict(name -> Tensor)`
      detached from autograd that share storage with the module, so a `donate=True`
      step keeps the module up to date. Clone them for an independent copy.

    Examples:
        >>> import torch, purestep.core as ps
        >>> net = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.BatchNorm1d(2))
        >>> apply_fn, params, buffers = ps.functional_model(net)
        >>> out, new_buffers = apply_fn(params, buffers, torch.randn(4, 3))
        >>> out.shape, int(new_buffers["1.num_batches_tracked"]), int(buffers["1.num_batches_tracked"])
        (torch.Size([4, 2]), 1, 0)
    """
    if not isinstance(module, torch.nn.Module):
        raise ValueError(f"functional_model needs a torch.nn.Module, got {type(module).__name__}")
    params = {}
    for name, p in module.named_parameters():
        params[name] = p.detach()
        params[name]._purestep_source = p  # type: ignore[attr-defined]  # a flat-buffer step re-points the module's own Parameter too
    buffers = {name: b.detach() for name, b in module.named_buffers()}

    def apply_fn(params: dict, buffers: dict, *args: Any, **kwargs: Any) -> tuple[Any, dict]:
        # Copies, because the forward may write into its buffers (BatchNorm).
        new_buffers = {name: b.clone() for name, b in buffers.items()}
        out = torch.func.functional_call(module, (params, new_buffers), args, kwargs, tie_weights=True, strict=False)
        return out, new_buffers

    return apply_fn, params, buffers


def functional_ensemble(modules: Any) -> tuple[Callable[..., tuple[Any, dict]], dict, dict]:
    """N `nn.Module`s of one architecture as `(apply_fn, params, buffers)` for `torch.func.vmap`.

    Like `functional_model`, with every param and buffer stacked on a new dim 0 (member i
    at index i) and `apply_fn` running one member: `vmap(apply_fn)(params, buffers, x)`.

    Warning:
        `torch.func.stack_module_state` returns params that require grad, so a step over
        them records an autograd graph that grows with every step (meta-gradients need it,
        an ensemble does not); these params are detached copies instead.

    Examples:
        >>> import torch, purestep.core as ps
        >>> apply_fn, params, buffers = ps.functional_ensemble([torch.nn.Linear(3, 2) for _ in range(4)])
        >>> params["weight"].shape, params["weight"].requires_grad
        (torch.Size([4, 2, 3]), False)
        >>> torch.func.vmap(apply_fn)(params, buffers, torch.randn(4, 5, 3))[0].shape
        torch.Size([4, 5, 2])
    """
    modules = list(modules) if isinstance(modules, (list, tuple, torch.nn.ModuleList)) else []
    if not modules or not all(isinstance(m, torch.nn.Module) for m in modules):
        raise ValueError(f"functional_ensemble needs a non-empty list of torch.nn.Modules, got {modules!r}")
    apply_fn, _, _ = functional_model(modules[0])
    stacked = []
    for kind in ("named_parameters", "named_buffers"):
        first = dict(getattr(modules[0], kind)())
        members = [dict(getattr(m, kind)()) for m in modules]
        for i, member in enumerate(members):
            for name in [*first, *(n for n in member if n not in first)]:
                a, b = first.get(name), member.get(name)
                if a is None or b is None or a.shape != b.shape or a.dtype != b.dtype:
                    got = "missing" if b is None else f"{tuple(b.shape)} {b.dtype}"
                    want = "missing" if a is None else f"{tuple(a.shape)} {a.dtype}"
                    raise ValueError(f"module {i} has '{name}' {got} but module 0 has {want}: members must match")
        stacked.append({name: torch.stack([m[name].detach() for m in members]) for name in first})
    return apply_fn, stacked[0], stacked[1]


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


def _apply(optimizer: Transform, params: Params, grads: PyTree, opt_state: OptState) -> tuple[Params, OptState, PyTree]:
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return tr.apply_updates(params, updates), opt_state, updates


def _copy_into(dst_tree: PyTree, src_tree: PyTree, what: str) -> None:
    """Write each leaf of `src_tree` into the same leaf of `dst_tree` (donation)."""
    dst, dst_spec = pytree.tree_flatten(dst_tree)
    src, src_spec = pytree.tree_flatten(src_tree)
    if dst_spec != src_spec:
        raise ValueError(
            f"donate=True needs the new {what} structured like the old one; the transform changed "
            f"{dst_spec} into {src_spec}"
        )
    pairs = [(d, s) for d, s in zip(dst, src) if isinstance(d, Tensor) and d is not s]
    if not pairs:
        return
    with torch.no_grad():
        # DTensor (FSDP2 params) has no sharding rule for `_foreach_copy_`: copy leaf by leaf.
        plain = all(type(d) in (Tensor, torch.nn.Parameter) for d, _ in pairs)
        if plain and ls.use_foreach([d for d, _ in pairs]):
            torch._foreach_copy_([d for d, _ in pairs], [s for _, s in pairs])
        else:
            for d, s in pairs:
                if _sharded.is_dtensor(s):  # a reduction's result may be Partial, or a DTensor for a plain leaf
                    s = s.redistribute(d.device_mesh, d.placements) if _sharded.is_dtensor(d) else s.full_tensor()  # type: ignore[attr-defined]
                d.copy_(s)


def _storages(*trees: Any) -> set[int]:
    """The addresses of the storages behind every tensor leaf of `trees`."""
    return {x.untyped_storage().data_ptr() for x in ls.tensors_in(*trees) if type(x) in (Tensor, torch.nn.Parameter)}


def _leaf_pairs(dst: Any, src: Any, out: list) -> bool:
    """Collect the matching tensor leaves of two trees of dicts, lists, tuples and
    NamedTuples into `out` (a walk, without pytree's specs); False for any other node or a
    difference in structure, which the caller leaves to pytree."""
    if dst is src:
        return True  # a subtree updated in place: nothing to adopt
    if isinstance(dst, Tensor) or isinstance(src, Tensor):
        if isinstance(dst, Tensor) and isinstance(src, Tensor):
            out.append((dst, src))
            return True
        return False
    kind = type(dst)
    if kind is not type(src):
        return False
    if issubclass(kind, dict):  # a `Packed` tree of buffers too
        return list(dst) == list(src) and all(_leaf_pairs(dst[k], src[k], out) for k in dst)
    if kind is tuple or kind is list or tr.is_namedtuple(dst):
        return len(dst) == len(src) and all(_leaf_pairs(a, b, out) for a, b in zip(dst, src))
    return dst is None or kind in (int, float, bool, str)


class _Taken:
    """The storages a donated update may not adopt: those of the trees given (read on
    first use: an update that wrote its state in place never needs them) and those
    adopted already."""

    def __init__(self, *trees: Any) -> None:
        self.trees: tuple | None = trees
        self.ptrs: set[int] = set()

    def __contains__(self, ptr: int) -> bool:
        if self.trees is not None:
            self.ptrs |= _storages(*self.trees)
            self.trees = None
        return ptr in self.ptrs

    def add(self, ptr: int) -> None:
        self.ptrs.add(ptr)


# Smaller new state leaves (step counters) are copied: cheaper than the storage checks.
_ADOPT_MIN_BYTES = 1 << 16


def _adopt_into(dst_tree: PyTree, src_tree: PyTree, what: str, taken: _Taken) -> None:
    """Donation without copies: each `dst` leaf takes over the storage of its new value
    (`Tensor.set_`), so the tensor objects stay the same and nothing is copied.

    A new value is adopted only when it is a tensor of the same dtype, device, shape and
    strides whose storage nothing else uses: not a storage in `taken` (the grads, params,
    old state: a state that kept the caller's grad would otherwise alias it from then
    on), nor one adopted already. Anything else (and anything small) is copied, as
    `_copy_into` does; a leaf that is its own new value (updated in place) is left alone.
    """
    pairs: list[tuple[Tensor, Tensor]] = []
    if not _leaf_pairs(dst_tree, src_tree, pairs):  # another kind of node, or a mismatch to report
        _copy_into(dst_tree, src_tree, what)
        return
    copies = []
    for d, s in pairs:
        if d is s:
            continue
        if (
            type(d) is Tensor
            and type(s) is Tensor
            and s.storage_offset() == 0
            and s.dtype == d.dtype
            and s.nbytes >= _ADOPT_MIN_BYTES
        ):
            storage = s.untyped_storage()
            ptr = storage.data_ptr()
            # The whole of a storage no one else holds, laid out as `d` was.
            if (
                ptr not in taken
                and storage.nbytes() == s.nbytes
                and s.shape == d.shape
                and s.stride() == d.stride()
                and s.device == d.device
            ):
                taken.add(ptr)
                d.set_(s)  # type: ignore[call-overload]  # (torch's stubs list set_ by storage only)
                continue
        copies.append((d, s))
    if copies:
        _copy_into([d for d, _ in copies], [s for _, s in copies], what)


def _update_metrics(grads: PyTree, new_state: OptState) -> Metrics:
    """`make_update(..., metrics=True)`'s metrics, 0-d tensors and no host sync: `grad_norm`
    (the global norm of the grads given, before any clipping; over FSDP2 shards, of the
    whole grads), `lr` (as make_step's) and `skipped` (True when `apply_if_finite` skipped
    this update; present when the transform holds exactly one)."""
    if lay.is_packed(grads):  # flat buffers or this rank's shards: the reduction protocol's norm
        norm = lay.global_norm(grads)
    else:
        norm = tr.tree_global_norm(grads)
        if _sharded.is_dtensor(norm):  # whole DTensors (the per-leaf DTensor path)
            norm = norm.full_tensor()  # type: ignore[attr-defined]  # a DTensor
    metrics: Metrics = {"grad_norm": norm}
    lr = _lr_metric(new_state)
    if lr is not None:
        metrics["lr"] = lr
    finite = [v for _, v in tr.find_all(new_state, "last_finite") if isinstance(v, Tensor)]
    if len(finite) == 1:
        metrics["skipped"] = torch.logical_not(finite[0])
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
    device = _sharded.local(leaves[0]).device if leaves else torch.device("cpu")
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


# Inductor inlines 0-d scalar math (bias corrections, schedules) into every element's
# loop; realizing any reused expression of more than a few ops computes it once instead
# (on CPU an inlined `pow` per vector made the AdamW step ~10x slower).
_INDUCTOR_OPTIONS: dict[str, Any] = {"realize_opcount_threshold": 4}
# torch < 2.12 asserts in `ForeachKernelSchedulerNode.reorder_loops_by_dep_pair` when foreach
# ops meet per-tensor reductions over tensors of several shapes, as in Muon's graph on CUDA
# (pytorch/pytorch#176591, fixed by #176849): loop reordering after fusion stays off there.
if torch.torch_version.TorchVersion(torch.__version__) < (2, 12):  # type: ignore[operator]
    _INDUCTOR_OPTIONS["loop_ordering_after_fusion"] = False
# Keep a narrowing cast's rounding where the compiled code rounds and widens again (Muon's
# bf16 emulation, low-precision moments read back): without it inductor fuses the round
# trip away and the compiled step silently differs from the eager one.
if hasattr(_inductor_config, "emulate_precision_casts"):
    _INDUCTOR_OPTIONS["emulate_precision_casts"] = True
# Per device type, for the flat and sharded paths. There the per-step scalars are realized
# by `ps.once` where they are computed (bias corrections, schedules, the clip factor), and
# 0-d coefficients of elementwise math are cast to its dtype once (`_lists`' coefficients): a
# low threshold for every node would also materialize large intermediates read twice, as
# apply_if_finite's new state (checked, then selected), which measurably slowed the CPU
# step (see benchmarks/README.md, "ps.once").
# Inlined into a large kernel, float64 `pow`s per element make a CUDA step compute-bound:
# `once` keeps them out.
_FLAT_INDUCTOR_OPTIONS = {k: v for k, v in _INDUCTOR_OPTIONS.items() if k != "realize_opcount_threshold"}
_FLAT_OPTIONS = {"cpu": _FLAT_INDUCTOR_OPTIONS, "cuda": _FLAT_INDUCTOR_OPTIONS}


def _maybe_compile(fn: Callable, compile: bool) -> Callable:
    return torch.compile(fn, fullgraph=True, options=_INDUCTOR_OPTIONS) if compile else fn


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
) -> Callable[..., tuple]:
    """The optimizer half of a step, for gradients from `loss.backward()`.

    `update(params, grads, opt_state) -> (params, opt_state)` applies `optimizer` once.
    With `ema=ps.params_ema(decay)` the averaged params are updated in the same call:
    `update(params, grads, opt_state, ema_state) -> (params, opt_state, ema_state)`.
    `update(..., grad_scale=s, found_inf=f)` is torch's fused-optimizer AMP protocol
    (`torch.amp.GradScaler` sets `grad_scale` and `found_inf` on an optimizer whose
    `_step_supports_amp_scaling` is True): the update runs on `grads / s` and, where `f > 0`,
    changes nothing (params, state, counts, EMA), decided on the device with no host sync,
    inside the same compiled kernels.
    With `metrics=True` a dict of 0-d tensors comes last, computed in the same call with no
    host sync, as `make_step`'s: `grad_norm` (of the grads given, before any clipping; over
    FSDP2 shards the whole grads'), `lr` (the injected `lr`, when the state holds exactly
    one), `skipped` (whether `apply_if_finite` skipped this update, when it holds one).
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

    Eager donation (`donate=True` without compile) applies the update in place without
    materializing it where the transform has an in-place form (`with_in_place`): a
    chain folds its affine tail (weight decay, lr) into the coefficients of
    `p ← a·p + b·u`, and `scale_by_adam` then runs torch.optim.AdamW's step on CPU, block
    of leaves by block, with μ and ν updated in their own storage. The params then equal
    the pure update to rounding, not bitwise (AdamW: μ and ν bitwise torch.optim's, the
    params to an ulp or so per step). Other new state leaves adopt their new storage
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
    all-gathers from there). See the README's "Under FSDP2". `update.explain()` says which
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
    if not isinstance(metrics, bool):
        raise ValueError(f"metrics must be True or False, got {metrics!r}")

    def pure(params, grads, opt_state, ema_state=None, amp=None):
        # -> (params, opt_state[, ema_state][, metrics]); amp: (grad_scale, found_inf) 0-d tensors
        tr.check_match(grads, params, "grads", "params")
        if amp is not None:  # torch's fused AMP protocol: g / grad_scale, inside the same kernels
            grads = pytree.tree_map(lambda g: g / amp[0].to(g.dtype), grads)
        new_params, new_state, _ = _apply(optimizer, params, grads, opt_state)
        new_ema = None if averaging is None else averaging[1](ema_state, new_params)
        if amp is not None:  # found_inf: nothing changes, params, state and EMA (counts included)
            skip = amp[1] > 0
            keep = lambda old, new: pytree.tree_map(lambda o, n: torch.where(skip, o, n), old, new)  # noqa: E731
            new_params, new_state = keep(params, new_params), keep(opt_state, new_state)
            new_ema = None if averaging is None else keep(ema_state, new_ema)
        out = (new_params, new_state) + (() if averaging is None else (new_ema,))
        if not metrics:
            return out
        step_metrics = _update_metrics(grads, new_state)
        if amp is not None:
            skipped = amp[1] > 0
            step_metrics["skipped"] = skipped | step_metrics["skipped"] if "skipped" in step_metrics else skipped
        return out + (step_metrics,)

    def in_place(params, grads, opt_state, ema_state=None, amp=None):
        out = pure(params, grads, opt_state, ema_state, amp)
        _copy_into(params, out[0], "params")
        _copy_into(opt_state, out[1], "opt_state")
        if averaging is not None:
            _copy_into(ema_state, out[2], "ema_state")
        return out[-1] if metrics else None

    def eager_in_place(params, grads, opt_state, ema_state=None, amp=None):
        # Uncompiled donation: the update goes into the params in place (`apply_in_place`:
        # a chain folds its decay and lr into the last transform's own in-place apply), and
        # state leaves not updated in place adopt the storage of their new values.
        if amp is not None:  # a skip decided on the device: the pure update, selected, then copied in
            return in_place(params, grads, opt_state, ema_state, amp)
        tr.check_match(grads, params, "grads", "params")
        new_state = apply_in_place(optimizer, grads, opt_state, params)
        taken = _Taken(params, grads, opt_state, ema_state)
        _adopt_into(opt_state, new_state, "opt_state", taken)
        if averaging is not None:
            _adopt_into(ema_state, averaging[1](ema_state, params), "ema_state", taken)
        return _update_metrics(grads, opt_state) if metrics else None  # grads are only read

    inner = pure if not donate else in_place if compile else eager_in_place
    inner = _maybe_compile(inner, compile)

    def sharded():
        if compile:
            return _sharded.ShardedUpdate(optimizer, pure, averaging, _FLAT_OPTIONS, metrics=metrics)
        return _sharded.ShardedEager(optimizer, eager_in_place, averaging)

    engine = Engine(
        flat=FlatUpdate(optimizer, pure, averaging, _FLAT_OPTIONS, metrics=metrics) if compile and flat else None,
        sharded=sharded if flat else None,
        per_leaf=inner,
        per_leaf_dtensor=in_place,  # eager: dynamo does not trace copies into DTensors
        compile=compile,
        flat_asked=flat,
    )

    def update(
        params: Params,
        grads: PyTree,
        opt_state: OptState,
        *ema_state: Any,
        grad_scale: Tensor | None = None,
        found_inf: Tensor | None = None,
    ) -> tuple:
        if len(ema_state) != (averaging is not None):
            want = "(params, grads, opt_state, ema_state)" if averaging else "(params, grads, opt_state)"
            raise TypeError(f"update takes {want}; got {3 + len(ema_state)} arguments")
        amp = _amp_inputs(grads, grad_scale, found_inf)
        extra = {} if amp is None else {"amp": amp}
        if not donate:
            return inner(params, grads, opt_state, *ema_state, **extra)
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

    def grads_of(params, batch, buffers, with_buffers):
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

    def loss_and_grads(params, batch, buffers, with_buffers):
        # Flat buffers (`FlatStep`): the loss sees per-leaf views; the grads are packed after.
        named = params.unpack() if _flat.is_packed(params) else params
        if micro_batches == 1:
            grads, loss, aux, buffers = grads_of(named, batch, buffers, with_buffers)
        else:
            grads, losses, auxes = None, [], []
            for micro in _split_batch(batch, micro_batches):
                g, loss, aux, buffers = grads_of(named, micro, buffers, with_buffers)
                grads = g if grads is None else pytree.tree_map(torch.add, grads, g)
                losses.append(loss)
                auxes.append(aux)
            grads = pytree.tree_map(lambda g: g / micro_batches, grads)
            loss = torch.stack(losses).mean()
            aux = pytree.tree_map(lambda *xs: torch.stack(xs), *auxes) if has_aux else None
        if _flat.is_packed(params):
            grads = _flat.pack_like(params, grads)
        return grads, loss, aux, buffers

    def metrics_of(loss, grads, aux, updates, new_state):
        metrics = {"loss": loss, "grad_norm": tr.tree_global_norm(grads), "update_norm": tr.tree_global_norm(updates)}
        lr = _lr_metric(new_state)
        if lr is not None:
            metrics["lr"] = lr
        if has_aux:
            metrics["aux"] = aux
        return metrics

    def pure(params, opt_state, batch, buffers=None, with_buffers=False):
        grads, loss, aux, buffers = loss_and_grads(params, batch, buffers, with_buffers)
        new_params, new_state, updates = _apply(optimizer, params, grads, opt_state)
        return new_params, new_state, metrics_of(loss, grads, aux, updates, new_state), buffers

    def in_place(params, opt_state, batch, buffers=None, with_buffers=False):
        new_params, new_state, metrics, new_buffers = pure(params, opt_state, batch, buffers, with_buffers)
        _copy_into(params, new_params, "params")
        _copy_into(opt_state, new_state, "opt_state")
        if with_buffers:
            _copy_into(buffers, new_buffers, "buffers")
        return metrics

    def eager_in_place(params, opt_state, batch, buffers=None, with_buffers=False):
        # Uncompiled donation, as make_update's: p += u in place and the state leaves adopt
        # the storage of their new values (the updates themselves are kept for
        # `update_norm`, so no folding into the apply: bitwise the pure step's results).
        grads, loss, aux, new_buffers = loss_and_grads(params, batch, buffers, with_buffers)
        updates, new_state = optimizer.update(grads, opt_state, params)
        metrics = metrics_of(loss, grads, aux, updates, new_state)
        tr.apply_updates_(params, updates)
        _adopt_into(opt_state, new_state, "opt_state", _Taken(params, grads, opt_state, buffers, new_buffers))
        if with_buffers:  # copied: functional_model's buffers share storage with the module
            _copy_into(buffers, new_buffers, "buffers")
        return metrics

    inner = pure if not donate else in_place if compile else eager_in_place
    inner = _maybe_compile(inner, compile)
    engine = Engine(
        flat=FlatStep(optimizer, pure, None, _FLAT_OPTIONS) if compile and flat else None,
        sharded=None,  # FSDP2 computes grads in its own forward/backward: use make_update there
        per_leaf=inner,
        per_leaf_dtensor=inner,
        compile=compile,
        flat_asked=flat,
    )

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
