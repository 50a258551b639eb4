"""`Optimizer`: any purestep transform as a `torch.optim.Optimizer`, updating params in place."""

from __future__ import annotations

from typing import Any, Callable, Iterable

import torch
import torch.utils._pytree as pytree
from torch import Tensor

import purestep.core as ps

# optax field names -> the names torch.optim gives the same per-param buffers.
_TORCH_NAMES = {"mu": "exp_avg", "nu": "exp_avg_sq", "trace": "momentum_buffer"}
# Keys of a param group that are structure, not hyperparameters.
_STRUCTURE_KEYS = ("params", "param_names")


class _ParamGroup(dict):
    """A param group whose missing keys say how to make a hyperparameter reachable."""

    def __missing__(self, key: str) -> Any:
        raise KeyError(
            f"{key!r}: this param group holds no hyperparameter {key!r}; build the transform with "
            f"ps.inject_hyperparams(factory)({key}=...) so schedulers and param groups can set it"
        )


class _Group:
    """What the adapter keeps per param group: its transform, state and pushed values."""

    def __init__(self, transform: ps.Transform, names: list[str], run: Callable, state: Any) -> None:
        self.transform = transform
        self.names = names
        self.run = run
        self.state = state
        self.pushed: dict[str, Any] = {}  # hyperparameter -> the value last written into state


class Optimizer(torch.optim.Optimizer):
    """A `torch.optim.Optimizer` that runs a purestep transform in place.

    Each param group is a pytree `dict(name -> param)` (names from `named_parameters()`,
    else the param's index), so masks and labels such as `ps.decay_mask` see names.
    A group dict may carry its own `"transform"`. When a transform was built with
    `ps.inject_hyperparams`, its hyperparameters (`lr`, `betas`, `weight_decay`...) appear
    in every `param_groups[i]` as plain values, and whatever writes them there
    (a `torch.optim.lr_scheduler`, a group dict, your code) reaches the state through
    `ps.set_hyperparam` at the next `step`.

    Args:
      params: `model.parameters()`, `model.named_parameters()`, or param-group dicts
        (`{"params": ..., "lr": 1e-4}` or `{"params": ..., "transform": ps.sgd(0.1)}`).
      transform: any `ps.Transform`, e.g. `ps.inject_hyperparams(ps.adamw)(lr=1e-3)`.
      compile: run the update under `torch.compile` (through `ps.make_update`).

    Warning:
        The state is created at construction (torch.optim creates it at the first step),
        for all params of a group at once: a step where some params of a group have a
        grad and others have `None` raises, since a pure transform cannot skip a leaf.
        Build the optimizer from the trainable params only. As in torch.optim,
        `state_dict()` returns references to the live state tensors.

    Example:
        >>> import torch, purestep.core as ps
        >>> from purestep.api import Optimizer
        >>> model = torch.nn.Linear(3, 1)
        >>> opt = Optimizer(model.named_parameters(), ps.inject_hyperparams(ps.adamw)(lr=1e-2))
        >>> sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
        >>> model(torch.randn(8, 3)).pow(2).mean().backward()
        >>> opt.step(); sched.step(); opt.zero_grad()
        >>> opt.param_groups[0]["lr"]
        0.005
    """

    def __init__(
        self,
        params: Iterable[Any],
        transform: ps.Transform,
        *,
        compile: bool = False,
    ) -> None:
        if not isinstance(transform, ps.Transform):
            raise ValueError(
                f"transform must be a ps.Transform (e.g. ps.adamw(1e-3)), got {type(transform).__name__}"
            )
        self.transform = transform
        self._compile = compile
        self._groups: list[_Group] = []
        self._n_params = 0
        super().__init__(params, defaults={})
        # What schedulers read (OneCycleLR checks for "betas"/"momentum" here).
        self.defaults = {k: v for k, v in self.param_groups[0].items() if k not in _STRUCTURE_KEYS}

    # ------------------------------------------------------------------ groups

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group (as torch.optim); it may set hyperparameters or its own `"transform"`."""
        if not isinstance(param_group, dict):
            raise TypeError(f"param_group must be a dict, got {type(param_group).__name__}")
        param_group = _ParamGroup(param_group)
        transform = param_group.pop("transform", None) or self.transform
        if not isinstance(transform, ps.Transform):
            raise ValueError(f"param group 'transform' must be a ps.Transform, got {type(transform).__name__}")
        given = {k: v for k, v in param_group.items() if k not in _STRUCTURE_KEYS}
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        params = group["params"]
        index = len(self.param_groups) - 1
        names = list(group.get("param_names") or [str(self._n_params + i) for i in range(len(params))])
        if len(set(names)) != len(names):
            dup = next(n for n in names if names.count(n) > 1)
            raise ValueError(f"param group {index} names two params {dup!r}; param names must be unique")
        for p, n in zip(params, names):
            if p.is_sparse:
                raise ValueError(f"param {n!r} is sparse; purestep transforms need dense tensors")
        self._n_params += len(params)
        with torch.no_grad():
            state = transform.init(dict(zip(names, (p.detach() for p in params))))
        g = _Group(transform, names, self._make_run(transform), state)
        exposed = _injected(state)
        for key, value in given.items():
            if key not in exposed:
                raise ValueError(
                    f"param group {index} sets {key!r}, which its transform does not hold as a "
                    f"hyperparameter (it holds: {sorted(exposed) or 'none'}); build it with "
                    f"ps.inject_hyperparams(factory)({key}=...) or give the group its own 'transform'"
                )
        for key, value in exposed.items():
            group.setdefault(key, value)
            g.pushed[key] = value
        self._groups.append(g)

    def _make_run(self, transform: ps.Transform) -> Callable[[dict, dict, Any], Any]:
        update = ps.make_update(transform, compile=self._compile, donate=True)

        def run(params: dict, grads: dict, state: Any) -> Any:
            return update(params, grads, state)[1]

        return run

    def _push_hyperparams(self, group: dict[str, Any], g: _Group) -> None:
        for key, old in g.pushed.items():
            new = group[key]
            if _changed(new, old):
                g.state = ps.set_hyperparam(g.state, key, new)
                g.pushed[key] = new

    # ------------------------------------------------------------------ step

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        """One update of every group; `closure` (re)computes the loss and grads first."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group, g in zip(self.param_groups, self._groups):
            params = group["params"]
            grads = [p.grad for p in params]
            missing = [n for n, gr in zip(g.names, grads) if gr is None]
            if len(missing) == len(grads):
                continue  # nothing to do, as torch.optim
            if missing:
                raise ValueError(
                    f"params {missing[:3]} have no grad while others in their group do; a purestep "
                    "transform updates a whole tree, so build the Optimizer from the params that train "
                    "(e.g. [p for p in model.parameters() if p.requires_grad])"
                )
            for n, gr in zip(g.names, grads):
                if gr.is_sparse:
                    raise ValueError(f"param {n!r} has a sparse grad; purestep transforms need dense grads")
            self._push_hyperparams(group, g)
            tree = dict(zip(g.names, (p.detach() for p in params)))
            g.state = g.run(tree, dict(zip(g.names, grads)), g.state)
        return loss

    # ------------------------------------------------------------------ state

    @property
    def opt_states(self) -> list[Any]:
        """The transform state of each param group (a pytree of tensors)."""
        return [g.state for g in self._groups]

    def state_dict(self) -> dict[str, Any]:  # type: ignore[override]
        """`{"state": {param index: {name: tensor}}, "param_groups": [...]}`, tensors and plain values only.

        Per-param buffers take torch's names where one exists (`mu` -> `exp_avg`,
        `nu` -> `exp_avg_sq`, `trace` -> `momentum_buffer`); state shared by a group
        (step counts, injected hyperparameters) is under the group's `"shared_state"`.
        """
        state: dict[int, dict[str, Tensor]] = {}
        groups = []
        first = 0
        for group, g in zip(self.param_groups, self._groups):
            ids = list(range(first, first + len(g.names)))
            first += len(g.names)
            leaves, _ = ps.tree_flatten_with_path(g.state)
            shared = {}
            for (path, leaf), (kind, key) in zip(leaves, _layout(g.state, g.names)):
                if kind == "shared":
                    shared[key] = leaf
                else:
                    state.setdefault(ids[g.names.index(kind)], {})[key] = leaf
            packed = {k: v for k, v in group.items() if k != "params"}
            packed["params"] = ids
            packed["shared_state"] = shared
            groups.append(packed)
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:  # type: ignore[override]
        """Restore what `state_dict` returned; the run then continues bit for bit."""
        saved_groups = state_dict["param_groups"]
        if len(saved_groups) != len(self.param_groups):
            raise ValueError(
                f"state_dict has {len(saved_groups)} param groups, this optimizer has {len(self.param_groups)}"
            )
        saved_state = state_dict["state"]
        new_states = []
        for index, (saved, group, g) in enumerate(zip(saved_groups, self.param_groups, self._groups)):
            ids = list(saved["params"])
            if len(ids) != len(g.names):
                raise ValueError(
                    f"param group {index} of the state_dict has {len(ids)} params, this optimizer's has {len(g.names)}"
                )
            if "param_names" in saved and "param_names" in group and list(saved["param_names"]) != g.names:
                diff = next(a for a, b in zip(saved["param_names"], g.names) if a != b)
                raise ValueError(f"param group {index}: the state_dict names a param {diff!r} this optimizer lacks")
            shared = saved.get("shared_state", {})
            leaves, spec = ps.tree_flatten_with_path(g.state)
            out = []
            for (path, cur), (kind, key) in zip(leaves, _layout(g.state, g.names)):
                if kind == "shared":
                    src = shared.get(key)
                    where = f"param group {index} shared_state[{key!r}]"
                else:
                    src = saved_state.get(ids[g.names.index(kind)], {}).get(key)
                    where = f"state[{ids[g.names.index(kind)]}][{key!r}] (param {kind!r})"
                if not isinstance(src, Tensor):
                    raise ValueError(f"state_dict has no tensor at {where}, which state leaf '{path}' needs")
                if src.shape != cur.shape:
                    raise ValueError(f"state_dict {where} has shape {tuple(src.shape)}, expected {tuple(cur.shape)}")
                out.append(src.to(device=cur.device, dtype=cur.dtype, copy=True))
            new_states.append(ps.tree_unflatten(out, spec))
        for saved, group, g, state in zip(saved_groups, self.param_groups, self._groups, new_states):
            g.state = state
            for k, v in saved.items():
                if k not in ("params", "param_names", "shared_state"):
                    group[k] = v
            # The state holds the values in use; a group value that differs is pushed next step.
            g.pushed = _injected(state)


# --------------------------------------------------------------------------- #
# Helpers.
# --------------------------------------------------------------------------- #


def _changed(new: Any, old: Any) -> bool:
    if isinstance(new, Tensor) or isinstance(old, Tensor):
        return new is not old  # never a host sync
    if isinstance(new, (tuple, list)) and isinstance(old, (tuple, list)):
        return len(new) != len(old) or any(_changed(a, b) for a, b in zip(new, old))
    return new != old


def _plain(value: Any) -> Any:
    if isinstance(value, tuple):
        return tuple(_plain(v) for v in value)
    return value.item() if isinstance(value, Tensor) else value


def _injected(state: Any) -> dict[str, Any]:
    """Hyperparameters held by `ps.inject_hyperparams` states, as plain values (unique names only)."""
    found: dict[str, list[Any]] = {}

    def walk(node: Any) -> None:
        if isinstance(node, ps.InjectHyperparamsState):
            for k, v in node.hyperparams.items():
                found.setdefault(k, []).append(v)
        if isinstance(node, dict):
            children = node.values()
        elif isinstance(node, (list, tuple)):
            children = node
        else:
            return
        for child in children:
            walk(child)

    walk(state)
    return {k: _plain(v[0]) for k, v in found.items() if len(v) == 1}


def _layout(state: Any, names: list[str]) -> list[tuple[str, str]]:
    """For each state leaf: `(param name, buffer key)` when it belongs to one param, else
    `("shared", path)`. Buffer keys take torch's names where they are unambiguous."""
    raw, _ = pytree.tree_flatten_with_path(state)
    dotted = [p for p, _ in ps.tree_flatten_with_path(state)[0]]
    name_set = set(names)
    out: list[tuple[str, str]] = []
    for (keys, leaf), path in zip(raw, dotted):
        if not isinstance(leaf, Tensor):
            raise ValueError(f"optimizer state leaf '{path}' is {type(leaf).__name__}, not a tensor")
        last = keys[-1] if keys else None
        name = getattr(last, "key", None)
        if isinstance(last, pytree.MappingKey) and name in name_set and len(keys) > 1:
            field = path[: -len(name) - 1]
            out.append((name, field))
        else:
            out.append(("shared", path))
    # Short torch-style keys (exp_avg...) where the field name is unique for that param.
    short: dict[tuple[str, str], int] = {}
    for kind, field in out:
        if kind != "shared":
            leaf_field = field.rsplit(".", 1)[-1]
            k = (kind, _TORCH_NAMES.get(leaf_field, leaf_field))
            short[k] = short.get(k, 0) + 1
    result = []
    for kind, field in out:
        if kind == "shared":
            result.append((kind, field))
            continue
        leaf_field = field.rsplit(".", 1)[-1]
        key = _TORCH_NAMES.get(leaf_field, leaf_field)
        result.append((kind, key if short[(kind, key)] == 1 else field))
    return result
