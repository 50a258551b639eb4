"""`Optimizer`: any purestep transform as a `torch.optim.Optimizer`, updating params in place."""

from __future__ import annotations

import inspect
from typing import Any, Callable, Iterable, cast

import torch
from torch import Tensor

import purestep.core as ps

from . import _layout as L
from . import _state_dict as SD
from ._group import Group, ParamGroup, real, refuse_grads
from ._torch_state import TorchState

# A group with at least this many elements compiles its update by default (see `Optimizer`).
AUTO_COMPILE_NUMEL = 1 << 22


class Optimizer(torch.optim.Optimizer):
    """A `torch.optim.Optimizer` that runs a purestep transform in place.

    Give it a transform (`ps.chain(...)`, `ps.inject_hyperparams(ps.lion)(lr=...)`, any
    `ps.Transform`), or a factory and its arguments the torch.optim way:
    `Optimizer(model.parameters(), ps.adamw, lr=1e-3, weight_decay=0.1)` runs
    `ps.inject_hyperparams(ps.adamw)(...)` per param group, so a group dict may set any
    of the factory's arguments (`{"params": ..., "lr": 1e-4, "nesterov": True}`) and every
    hyperparameter appears in `param_groups[i]`, where schedulers, `GradScaler` and your
    code change it; the change reaches the state at the next `step`. With a built transform,
    the hyperparameters held by `ps.inject_hyperparams` appear in the groups the same way.

    Each group's params form a pytree `dict(name -> param)` (names from `named_parameters()`,
    else the param's index), so masks and labels such as `ps.decay_mask` see names.

    `state_dict()` of `ps.sgd`, `ps.adam`, `ps.adamw` and `ps.muon` given as factories has
    torch's layout: it loads into `torch.optim.SGD`/`Adam`/`AdamW`/`Muon` and theirs loads
    into it (`exp_avg`, `exp_avg_sq`, `max_exp_avg_sq`, `momentum_buffer`, a float `step` per
    param for Adam/AdamW, torch's group keys). Any other transform, or a group with its own
    `"transform"`, gives the generic layout: per-param buffers under torch-style names
    where one exists, state a group shares under the group's `"shared_state"`.

    How it runs: each group's update is `ps.make_update(transform, compile=..., donate=True)`,
    writing params and state in place. `compile=None` compiles a group of at least
    `AUTO_COMPILE_NUMEL` (4M) elements and runs smaller ones eagerly (AdamW there runs
    torch's in-place step, equal to the pure update to rounding: see `ps.make_update`); the
    first compiled step costs the compile (tens of seconds on a CPU, see the README), later
    ones run fused kernels
    over flat buffers: the params, their grads and the state are re-pointed into a few
    contiguous buffers (see `ps.make_update`), so after `zero_grad(set_to_none=False)` a
    backward writes straight into the update's grad buffer; with the default
    `set_to_none=True` each step first copies the fresh grads in.

    Args:
      params: `model.parameters()`, `model.named_parameters()`, or param-group dicts
        (`{"params": ..., "lr": 1e-4}` or `{"params": ..., "transform": ps.sgd(0.1)}`).
      transform: a `ps.Transform`, or a factory returning one (`ps.adamw`) with
        `hyperparams` as its arguments.
      compile: True, False, or None for the size rule above.
      **hyperparams: the factory's arguments (only with a factory).

    Warning:
        The state is created at construction (torch.optim creates it at the first step),
        for all params of a group at once. Step counts are per param, as torch's: a param
        whose grad is `None` while others of its group have one is skipped (its value, its
        buffers and its step count stay as they were), a param whose `state` entry is popped
        or emptied starts over from the transform's `init` (its count from 0), an assigned or
        loaded `step` is that param's alone. The group then runs as cohorts of params sharing
        one history, each its own update (a compiled group compiles each cohort when it first
        runs, never per step, and at most 8 in all: params that keep missing grads at random,
        as unrouted experts, run eagerly past that). A transform whose state holds more than per-param buffers, step counts
        and schedules (a statistic over the group, as Prodigy's estimate or a clip's norm), or
        that cannot run on part of the group (a mask or labels given as a tree of the whole
        group), and a `differentiable` group keep one count per group: a skipped param is
        held as it was while the group's count advances. A param's shape, dtype and
        device must stay as they were at construction (build the optimizer after
        `model.to(...)`); its storage may change (`p.data = ...`) as in torch.optim, but in
        a compiled group that makes the next step re-bind the flat buffers and compile
        again: copy new values in instead (`p.copy_(new)` under `torch.no_grad()`). As in
        torch.optim, `state_dict()` returns references to the live state tensors.

    Examples:
        >>> import torch, purestep.core as ps
        >>> from purestep.api import Optimizer
        >>> model = torch.nn.Linear(3, 1)
        >>> opt = Optimizer(model.parameters(), ps.adamw, lr=1e-2)
        >>> sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
        >>> model(torch.randn(8, 3)).pow(2).mean().backward()
        >>> opt.step(); sched.step(); opt.zero_grad()
        >>> opt.param_groups[0]["lr"], sorted(opt.state_dict()["state"][0])
        (0.005, ['exp_avg', 'exp_avg_sq', 'step'])
        >>> torch.optim.AdamW(model.parameters()).load_state_dict(opt.state_dict())
    """

    state: TorchState  # type: ignore[assignment]  # torch's defaultdict, with the buffers shown when read

    def __init__(
        self,
        params: Iterable[Any],
        transform: ps.Transform | Callable[..., ps.Transform],
        *,
        compile: bool | None = None,
        foreach: bool | None = None,
        fused: bool | None = None,
        capturable: bool = False,
        differentiable: bool = False,
        **hyperparams: Any,
    ) -> None:
        if differentiable and compile:
            raise ValueError(
                "differentiable=True runs the pure update eagerly, so autograd records it; drop compile=True"
            )
        self._differentiable = bool(differentiable)
        if differentiable:
            compile = False
        if fused and compile is None:
            compile = True  # purestep's fused step: one compiled kernel over flat buffers
        # torch's fused-optimizer AMP protocol: GradScaler then sets `grad_scale` and `found_inf`
        # on the optimizer instead of unscaling the grads and reading found_inf on the host; the
        # step unscales and skips inside its own kernels (`ps.make_update`'s grad_scale/found_inf).
        self._step_supports_amp_scaling = bool(fused) and not differentiable
        mirror = L.mirrors().get(transform) if callable(transform) and not isinstance(transform, ps.Transform) else None
        if mirror is not None and "lr" not in hyperparams:  # `Optimizer(params, ps.adamw)` as `AdamW(params)`
            hyperparams = {**hyperparams, "lr": inspect.signature(mirror.cls).parameters["lr"].default}
        flags = {"foreach": foreach, "fused": fused, "capturable": capturable, "differentiable": differentiable}
        self._init_args = (transform, compile, {**hyperparams, **{k: v for k, v in flags.items() if v}})
        self.transform = transform
        self._compile = compile
        self._groups: list[Group] = []
        self._where: dict[int, tuple[int, int]] = {}  # id(param) -> (group, position): `state[p]` finds it at once
        self._n_params = 0
        self._factory: Callable[..., ps.Transform] | None = None
        self._kwargs: dict[str, Any] = {}
        self._mirror: L.Mirror | None = None
        defaults: dict[str, Any] = {}
        if isinstance(transform, ps.Transform):
            if hyperparams:
                raise ValueError(
                    f"hyperparameters {sorted(hyperparams)} go with a factory (Optimizer(params, ps.adamw, "
                    "lr=1e-3)); a built transform already holds its values"
                )
        elif callable(transform) and not isinstance(transform, type):
            self._factory, self._mirror = transform, L.mirrors().get(transform)
            # torch's own arguments the factory lacks (Adam's `decoupled_weight_decay`), as torch's
            # users spell them: kept in the groups at the value the factory runs, refused otherwise.
            torch_only = L.torch_only(transform, self._mirror, hyperparams)
            try:
                bound = inspect.signature(transform).bind(
                    **{k: v for k, v in hyperparams.items() if k not in torch_only}
                )
            except TypeError as e:
                raise ValueError(f"Optimizer arguments for {_name(transform)}: {e}") from None
            bound.apply_defaults()
            self._kwargs = L.as_numbers(transform, dict(bound.arguments))
            if self._mirror is not None:
                defaults = L.torch_group(transform, self._mirror, self._kwargs, "Optimizer")
                defaults.update(L.checked_torch_only(transform, self._mirror, torch_only, defaults))
            else:
                defaults = {k: v for k, v in self._kwargs.items() if L.is_plain(v)}
        else:
            raise ValueError(
                f"transform must be a ps.Transform (e.g. ps.adamw(1e-3)) or a factory (ps.adamw), "
                f"got {getattr(transform, '__name__', type(transform).__name__)}"
            )
        flags = {"foreach": foreach, "fused": fused, "capturable": capturable, "differentiable": differentiable}
        defaults.update(
            {k: v for k, v in flags.items() if k in defaults or v}
        )  # what the caller said, as torch keeps it
        super().__init__(params, defaults)
        self.state = TorchState(self._expose_all, self._expose_one)  # torch's state, the buffers filled in when read
        if self._factory is None:  # what schedulers read (OneCycleLR checks for "betas"/"momentum")
            self.defaults = {k: v for k, v in self.param_groups[0].items() if k not in L.STRUCTURE_KEYS}

    def __setattr__(self, name: str, value: Any) -> None:
        if name == "state" and "state" in self.__dict__ and not isinstance(value, TorchState):
            self.state.fresh()  # what it showed, to compare with at the next step
            # code replaced the state dict: taken in at the next step (its entries are code's own dicts)
            replaced = TorchState(self._expose_all, self._expose_one)
            for key, entry in value.items():
                dict.__setitem__(replaced, key, entry)
                replaced._held(key, entry)
            replaced.edited, replaced.stale, value = True, False, replaced
        super().__setattr__(name, value)

    @property
    def torch_class(self) -> type | None:
        """The torch.optim class whose layout `state_dict()` has, or None for the generic layout."""
        mirror = self._groups[0].mirror if self._groups else None
        return mirror.cls if mirror is not None and all(g.mirror is mirror for g in self._groups) else None

    @property
    def opt_states(self) -> list[Any]:
        """The transform state of each param group (a pytree of tensors)."""
        for g in self._groups:
            g.sync()
        return [g.state for g in self._groups]

    # ------------------------------------------------------------------ groups

    @torch.compiler.disable  # as torch.optim's
    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group (as torch.optim); it may set hyperparameters or its own `"transform"`."""
        if not isinstance(param_group, dict):
            raise TypeError(f"param_group must be a dict, got {type(param_group).__name__}")
        param_group = ParamGroup(param_group)
        own = param_group.pop("transform", None)
        if own is not None and not isinstance(own, ps.Transform):
            raise ValueError(f"param group 'transform' must be a ps.Transform, got {type(own).__name__}")
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        index = len(self.param_groups) - 1
        where = f"param group {index}"
        params = group["params"]
        names = list(group.get("param_names") or [str(self._n_params + i) for i in range(len(params))])
        if len(set(names)) != len(names):
            dup = next(n for n in names if names.count(n) > 1)
            raise ValueError(f"{where} names two params {dup!r}; param names must be unique")
        for p, n in zip(params, names):
            if p.is_sparse:
                raise ValueError(f"param {n!r} is sparse; purestep transforms need dense tensors")
        self._n_params += len(params)

        mirror, static = None, {}
        if own is None and self._factory is not None:
            kwargs = {**self._kwargs, **L.factory_kwargs(self._factory, self._mirror, group, where)}
            if self._mirror is not None:
                mirror = self._mirror
                expect = L.torch_group(self._factory, mirror, kwargs, where)
                known = set(expect) | set(kwargs) | set(mirror.renames.values())
                unknown = [k for k in group if k in _HYPERPARAMETERS and k not in known]
                if unknown:  # it would do nothing; other unknown keys (timm's "lr_scale") are kept, unread
                    raise ValueError(
                        f"{where} sets {unknown[0]!r}, which neither {_name(self._factory)} nor "
                        f"{mirror.cls.__name__} takes"
                    )
                for key, value in expect.items():
                    if key not in L.IMPLEMENTATION_KEYS and not L.same(group.get(key, value), value):
                        raise ValueError(
                            f"{where} sets {key}={group[key]!r}, but {_name(self._factory)} runs "
                            f"{mirror.cls.__name__}'s {key}={value!r}"
                        )
                    group.setdefault(key, value)
            transform = ps.inject_hyperparams(self._factory)(**kwargs)
            # Keys neither the factory nor torch's class takes (timm's "lr_scale") stay in the group, unread.
            known = set(kwargs) | (set(expect) | set(mirror.renames.values()) if mirror is not None else set())
            static = {
                k: v
                for k, v in group.items()
                if k in known and k not in L.STRUCTURE_KEYS and k not in L.IMPLEMENTATION_KEYS
            }
        else:
            transform = own if own is not None else self.transform
        numel = sum(p.numel() for p in params)
        compiled = self._compile if self._compile is not None else numel >= AUTO_COMPILE_NUMEL
        if any(p.is_complex() for p in params):
            # As torch.optim: a complex param is its real view (..., 2). A compiled update would
            # re-point the view, not the param, so a group holding one runs eagerly.
            compiled = False
        g = Group(transform, names, cast(list[Tensor], real(params)), compiled, self._differentiable)
        if mirror is not None:
            L.check_torch_layout(g.state, names, mirror)
        g.mirror = mirror
        for key in g.pushed:
            static.pop(key, None)
        g.static = static
        if self._factory is None:
            # Other keys stay in the group, unread, as in torch (timm's "lr_scale"); an optimizer
            # hyperparameter the transform does not hold would silently do nothing: refused.
            unknown = [k for k in param_group if k in _HYPERPARAMETERS and k not in g.pushed]
            if unknown:
                raise ValueError(
                    f"{where} sets {unknown[0]!r}, which its transform does not hold as a hyperparameter "
                    f"(it holds: {sorted(g.pushed) or 'none'}); build it with "
                    f"ps.inject_hyperparams(factory)({unknown[0]}=...) or give the group its own 'transform'"
                )
            for key, value in g.pushed.items():
                group.setdefault(key, value)
        else:
            group.update(g.pushed)  # the values as the state holds them
        self._push(group, g, index)
        self._groups.append(g)
        self._where.update((id(p), (index, j)) for j, p in enumerate(params))
        if isinstance(self.state, TorchState):  # torch.optim's __init__ adds the first groups to a plain dict
            self.state.mark_stale()

    def _push(self, group: dict[str, Any], g: Group, index: int) -> None:
        """Write group values that changed into the state; refuse a changed structural one."""
        for key, old in g.pushed.items():
            new = group[key]
            if new is not old and L.changed(new, old):
                for target in g.hyper_targets(key):
                    L.fill(target, new, f"param group {index} {key!r}")
                g.pushed[key] = new
        for key, value in g.static.items():
            new = group.get(key)
            if new is not value and not L.same(L.canonical(key, new), L.canonical(key, value)):
                raise ValueError(
                    f"param group {index} has {key}={group.get(key)!r}, but its transform was built with "
                    f"{key}={value!r}; that is structure, not a hyperparameter: build a new Optimizer"
                )

    # ------------------------------------------------------------------ step

    @torch.compiler.disable
    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        """One update of every group whose params have grads; `closure` (re)computes loss and grads first.

        Outside autograd, as torch.optim; with `differentiable=True` autograd records the step
        (torch's `differentiable`: params that are non-leaf tensors, e.g. clones, carry it).
        Inside a `torch.compile`d function it runs as it is (a graph break): it is compiled
        already where compiling pays (`compile=`), and dynamo does not trace its bookkeeping."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        with torch.set_grad_enabled(self._differentiable):
            self._step()
        return loss

    def _step(self) -> None:
        if self.state.edited or self.state.touched or self.state.untracked:
            self._take_edits()
        for index, (group, g) in enumerate(zip(self.param_groups, self._groups)):
            params = cast(list[Tensor], real(group["params"]))
            grads = real([p.grad for p in group["params"]])
            missing = sum(gr is None for gr in grads)  # not list.count: that calls Tensor.__eq__
            if missing == len(grads):
                continue  # nothing to do, as torch.optim
            if any(gr is not None and gr.is_sparse for gr in grads):
                refuse_grads(g.names, grads)
            if g.lazy:
                g.materialize(params, f"param group {index}")
            if [p.data_ptr() for p in params] != g.addresses:
                g.moved(params)
            self._push(group, g, index)
            amp = {k: v for k in ("grad_scale", "found_inf") if (v := getattr(self, k, None)) is not None}
            g.run(params, grads, amp)
        self.state.mark_stale(steps_only=True)  # `state` shows the new steps when it is next read

    # ------------------------------------------------------------------ state

    @torch.compiler.disable  # as torch.optim's
    def state_dict(self) -> dict[str, Any]:  # type: ignore[override]
        """`{"state": {param index: {name: tensor}}, "param_groups": [...]}`, tensors and plain values only.

        torch's layout when `torch_class` is set, else the generic one (see the class docstring).
        The hooks of `register_state_dict_pre_hook` / `register_state_dict_post_hook` run as in torch.
        """
        for pre_hook in self._optimizer_state_dict_pre_hooks.values():
            pre_hook(self)
        out = self._state_dict()
        for post_hook in self._optimizer_state_dict_post_hooks.values():
            result = post_hook(self, out)
            out = result if result is not None else out
        return out

    def _state_dict(self) -> dict[str, Any]:
        return SD.export(self)

    @torch.compiler.disable  # as torch.optim's
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:  # type: ignore[override]
        """Restore a `state_dict` of this layout (from this class, or from `torch_class`).

        Everything is checked before anything is applied: a refused state dict leaves the
        optimizer as it was. A state dict saved with param names (`named_parameters()`)
        loads into an optimizer built without them, and the reverse, as in torch. The hooks
        of `register_load_state_dict_pre_hook` / `_post_hook` run as in torch.
        """
        for pre_hook in self._optimizer_load_state_dict_pre_hooks.values():
            result = pre_hook(self, state_dict)
            state_dict = result if result is not None else state_dict
        self._load_state_dict(state_dict)
        for post_hook in self._optimizer_load_state_dict_post_hooks.values():
            post_hook(self)

    def _load_state_dict(self, state_dict: dict[str, Any]) -> None:
        SD.load(self, state_dict)

    def _expose_all(self, skip: set[int] | frozenset[int] = frozenset(), steps_only: bool = False) -> None:
        for group, g in zip(self.param_groups, self._groups):
            if not g.lazy and L.keeps_buffers(g.mirror, group):
                g.expose(self.state, group["params"], skip=skip, steps_only=steps_only)

    def _expose_one(self, param: Tensor, steps_only: bool = False) -> bool:
        """`state[param]` alone shown; False when `param` is none of this optimizer's params."""
        at = self._where.get(id(param))
        groups = self.param_groups
        if at is None or not (  # not found where it was put (code changed the groups)
            at[0] < len(groups) and at[1] < len(groups[at[0]]["params"]) and groups[at[0]]["params"][at[1]] is param
        ):
            at = next(
                (
                    (i, j)
                    for i, group in enumerate(self.param_groups)
                    for j, p in enumerate(group["params"])
                    if p is param
                ),
                None,
            )
            if at is None:
                return False
            self._where[id(param)] = at
        group, g = self.param_groups[at[0]], self._groups[at[0]]
        if not g.lazy and L.keeps_buffers(g.mirror, group):
            g.expose(self.state, group["params"], only={at[1]}, steps_only=steps_only)
        return True

    def _take_edits(self) -> None:
        """What code changed in `state` since the last step, taken in (see `Group.take_edits`):
        every param's entry after a read of the whole state, else the entries read one by one."""
        # Entries that are code's own dicts are checked at every step: a write to one tells nothing.
        whole, touched = self.state.edited, {**self.state.touched, **self.state.untracked}
        self.state.edited, self.state.touched = False, {}
        for index, (group, g) in enumerate(zip(self.param_groups, self._groups)):
            if g.lazy:
                continue
            if whole:
                g.take_edits(self.state, group["params"], index)
                continue
            only = {j for j, p in enumerate(group["params"]) if id(p) in touched}
            if only:
                g.take_edits(self.state, group["params"], index, only=only)
        self.state.mark_stale()  # shown again, as they now are, when next read

    def _extras(self, params: list[Tensor], g: Group) -> list[dict[str, Any]]:
        """What else code put into `self.state[param]` (a wrapper's slow weights, say), per param."""
        own = [{"step"} if g.has_step else set() for _ in params]
        for _, j, key in g.buffers:
            own[j].add(key)
        return [{k: v for k, v in self.state.get(p, {}).items() if k not in own[j]} for j, p in enumerate(params)]

    def _check_push(self, values: dict[str, Any], g: Group, state: Any, index: int) -> None:
        """What `_push` would refuse, found on copies of the new state's hyperparameters."""
        hyper = ps.get_hyperparams(state)
        for key in g.pushed:
            if key not in values:
                raise ValueError(f"param group {index} of the state_dict lacks {key!r}")
            target = hyper.get(key, g.hyper[key])
            scratch = tuple(t.clone() for t in target) if isinstance(target, tuple) else target.clone()
            try:
                L.fill(scratch, values[key], f"param group {index} {key!r}")
            except (TypeError, RuntimeError, OverflowError) as e:
                raise ValueError(
                    f"param group {index} {key!r}: {values[key]!r} is not a value it can take ({e})"
                ) from None
        for key, value in g.static.items():
            new = values.get(key)
            if new is not value and not L.same(L.canonical(key, new), L.canonical(key, value)):
                raise ValueError(
                    f"param group {index} has {key}={new!r}, but its transform was built with "
                    f"{key}={value!r}; that is structure, not a hyperparameter: build a new Optimizer"
                )

    # ------------------------------------------------------------------ copies

    def __getstate__(self) -> dict[str, Any]:  # type: ignore[override]
        """What `copy.deepcopy`, `pickle` and `torch.save` keep: how it was built, its groups and its state."""
        transform, compile, hyperparams = self._init_args
        groups = [{k: v for k, v in group.items()} for group in self.param_groups]
        return {"init": (transform, compile, hyperparams), "groups": groups, "state_dict": self.state_dict()}

    def __setstate__(self, saved: dict[str, Any]) -> None:  # type: ignore[override]
        if "init" not in saved:  # torch's own format (torch.optim.Optimizer.__getstate__'s keys)
            super().__setstate__(saved)
            return
        transform, compile, hyperparams = saved["init"]
        # Optimizer's own __init__, not type(self)'s: a subclass may take other arguments.
        Optimizer.__init__(self, saved["groups"], transform, compile=compile, **hyperparams)
        self.load_state_dict(saved["state_dict"])


# --------------------------------------------------------------------------- #
# Helpers.
# --------------------------------------------------------------------------- #


# Keys that set an optimizer's hyperparameter in torch.optim: a group setting one the transform
# does not hold is refused (it would do nothing); any other key is kept, unread.
_HYPERPARAMETERS = frozenset(
    {
        "lr",
        "weight_decay",
        "momentum",
        "betas",
        "eps",
        "nesterov",
        "dampening",
        "amsgrad",
        "maximize",
        "alpha",
        "initial_accumulator_value",
        "lr_decay",
        "rho",
    }
)


def _name(factory: Callable) -> str:
    return f"ps.{getattr(factory, '__name__', repr(factory))}"
