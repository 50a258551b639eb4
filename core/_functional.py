"""`nn.Module`s as pure functions: `functional_model` (one module) and `functional_ensemble` (N of one architecture, for vmap)."""

from __future__ import annotations

from typing import Any, Callable

import torch


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
