"""The adapter's bookkeeping per param group, and torch's `state` dict shown over it."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import torch
import torch.utils._pytree as pytree
from torch import Tensor

import purestep.core as ps
from purestep.core.engine.dtensor import at_owner

from . import _layout as L
from ._torch_state import TorchState

MISSING = object()
# A compiled group compiles at most this many cohorts over its life (each when it first
# runs); later ones run eagerly (equal to rounding): a group whose params keep missing grads
# at random (unrouted experts) would otherwise compile at every split.
COMPILED_COHORTS = 8


class ParamGroup(dict):
    """A param group whose missing keys say how to make a hyperparameter reachable."""

    def __missing__(self, key: str) -> Any:
        raise KeyError(
            f"{key!r}: this param group holds no hyperparameter {key!r}; build the transform with "
            f"ps.inject_hyperparams(factory)({key}=...), or give Optimizer the factory "
            f"(Optimizer(params, ps.adamw, {key}=...)), so schedulers and param groups can set it"
        )


@dataclasses.dataclass
class Cohort:
    """The params of a group that share one step history, stepped by their own update.

    torch.optim keeps a step count per param: a param without a grad at a step does not
    advance it, one whose state is reset starts it over. A purestep state has one count per
    transform, so the adapter splits a group into cohorts when its params' histories part
    (some have a grad and others not, a reset, a loaded or assigned `step`): each cohort's
    state holds the group's buffers of its params (the same tensors) and its own counts,
    clocks (schedules' steps, advanced with the group's) and hyperparameters."""

    members: list[int]  # positions of its params in the group
    state: Any
    update: Callable | None  # made when it first runs (see COMPILED_COHORTS)
    tree: dict[str, Tensor]  # its params by name
    count_at: list[int]  # where its step counts sit among its state's leaves
    clock_at: list[int]  # where its schedules' steps sit

    @property
    def hyper(self) -> dict[str, Any]:
        return ps.get_hyperparams(self.state)

    def leaves(self) -> list[Tensor]:
        """Its state's leaves, flattened once per state tree (a donated update keeps the tree)."""
        cached = self.__dict__.get("_leaves")
        if cached is None or cached[0] is not self.state:
            self._leaves = (self.state, ps.tree_leaves(self.state))
        return self._leaves[1]

    def step(self) -> Tensor:
        """Its step count (torch's `step` of each of its params); for a state that keeps none
        (SGD without momentum), the updates its group applied, as its schedules count them."""
        at = self.count_at or self.clock_at
        if not at:
            raise ValueError(
                "this param group's state keeps no step count and no schedule step, so it has no "
                "per-param `step` to show; pass the transform through ps.inject_hyperparams"
            )
        return self.leaves()[at[0]]


class Group:
    """What the adapter keeps per param group besides torch's group dict."""

    def __init__(
        self,
        transform: ps.Transform,
        names: list[str],
        params: list[Tensor],
        compiled: bool,
        differentiable: bool = False,
    ) -> None:
        self.names = names
        self.compiled = compiled
        self.differentiable = differentiable
        # Differentiable: the pure update (autograd records it), its result copied into the params.
        self.update = ps.make_update(transform, compile=compiled, donate=not differentiable)
        self.compiles = int(compiled)  # compiled updates made (the first, and cohorts': COMPILED_COHORTS)
        # The params themselves, not detached aliases: a compiled update re-points the
        # tensors it is given into its flat buffers, and the model must follow.
        self.tree = dict(zip(names, params))
        self.transform = transform
        # Params on the meta device (deferred init): the state waits for real ones (`materialize`);
        # until then it is built on one-element stand-ins, which hold the hyperparameters.
        self.lazy = any(p.is_meta for p in params)
        self.addresses = [0 if p.is_meta else p.data_ptr() for p in params]
        self.meta = [(p.shape, p.dtype, p.device) for p in params]
        stand_ins = {n: torch.zeros([1] * p.dim(), dtype=p.dtype) for n, p in self.tree.items()} if self.lazy else None
        with torch.no_grad():
            self.state = transform.init(stand_ins if self.lazy else self.tree)
        self.mirror: L.Mirror | None = None
        self.static: dict[str, Any] = {}  # group key -> the value the transform was built with
        self.shown: dict[tuple[int, str], Any] = {}  # (param index, key) -> the object `state` shows
        self.live: set[int] = set()  # params whose entries show the live buffers (a step changes only steps)
        self.refresh()

    def leaves(self) -> Any:
        """The state's leaves, flattened once per state tree: a donated update keeps the tree and
        its tensor objects (their values change in place), so reading `state` does not flatten it."""
        cached = getattr(self, "_leaves", None)
        if cached is None or cached[0] is not self.state:
            self._leaves = (self.state, ps.tree_leaves(self.state))
        return self._leaves[1]

    def refresh(self) -> None:
        """Re-read the injected hyperparameters after the state was replaced."""
        self.shown, self.live = {}, set()
        self.hyper = ps.get_hyperparams(self.state)  # key -> the live 0-d tensor(s)
        self.pushed = {k: plain(v) for k, v in self.hyper.items()}  # key -> value in the state
        self.index_buffers()

    def index_buffers(self) -> None:
        """Where each param's own buffers sit among the state's leaves: (leaf, param, name)."""
        roles = [] if self.lazy else L.classify(self.state, self.names)
        self.buffers = [(i, self.names.index(r.param), r.key) for i, r in enumerate(roles) if r.kind == "buffer"]
        self.counts = [i for i, r in enumerate(roles) if r.kind == "count"]  # every step count's leaf
        self.clocks = [i for i, r in enumerate(roles) if r.kind == "clock"]  # every schedule's step
        self.count = self.counts[0] if self.counts else None  # the one shown as torch's `step`
        # Per-param step counts, as torch.optim keeps them, where the state is per-param buffers,
        # counts, clocks and hyperparameters alone (a statistic over the group, as Prodigy's
        # estimate or a clip's norm, would be one per cohort) and the transform takes a part of
        # the group (a mask or labels given as a tree of the whole group's structure do not).
        # Otherwise, and for `differentiable` groups (whose updates make new state tensors),
        # the group keeps one count (see `hold`).
        self.cohortable = (
            bool(roles)
            and bool(self.counts)
            and all(r.kind != "other" for r in roles)
            and not self.differentiable
            and self._takes_parts()
            and not any(at_owner(x) for x in pytree.tree_leaves(self.state))  # state at a leaf's owner: one layout
        )
        self.reset_cohorts()

    def _takes_parts(self) -> bool:
        """Whether the transform takes a part of the group's params (`ps.takes_parts`: read
        from its declarations), asked once."""
        if "_parts" not in self.__dict__:
            self._parts = len(self.names) <= 1 or ps.takes_parts(self.transform, self.tree)
        return self._parts

    # ------------------------------------------------------------------ cohorts

    def reset_cohorts(self) -> None:
        """One cohort: every param, the group's state and update."""
        whole = Cohort(list(range(len(self.names))), self.state, self.update, self.tree, self.counts, self.clocks)
        self.cohorts = [whole]
        self.owner = [whole] * len(self.names)

    def _set_cohorts(self, cohorts: list[Cohort]) -> None:
        self.cohorts = cohorts
        self.owner = [cohorts[0]] * len(self.names)
        for c in cohorts:
            for j in c.members:
                self.owner[j] = c

    def _cohort(self, members: list[int], source: Cohort, step: float | None) -> Cohort:
        """A cohort of `members` (params of `source`): the group's buffers of those params, its
        clocks and hyperparameters as they are, its counts `source`'s (or `step`)."""
        names = [self.names[j] for j in members]
        tree = {n: self.tree[n] for n in names}
        with torch.no_grad():
            fresh = self.transform.init(tree)
            roles = L.classify(fresh, names)
            values, spec = pytree.tree_flatten(fresh)
            mine = self.leaves()
            at = {(self.names[j], key): i for i, j, key in self.buffers}
            for i, r in enumerate(roles):
                if r.kind == "buffer":
                    values[i] = mine[at[r.param, r.key]]  # the same tensor: one buffer, one owner
            state = pytree.tree_unflatten(values, spec)
            for new, old in zip(ps.tree_leaves(ps.get_hyperparams(state)), ps.tree_leaves(self.hyper)):
                new.copy_(old)
            theirs = source.leaves()
            count_at = [i for i, r in enumerate(roles) if r.kind == "count"]
            clock_at = [i for i, r in enumerate(roles) if r.kind == "clock"]
            for i, k in zip(count_at, source.count_at):
                values[i].copy_(theirs[k]) if step is None else values[i].fill_(step)
            for i, k in zip(clock_at, source.clock_at):
                values[i].copy_(theirs[k])
        return Cohort(members, state, None, tree, count_at, clock_at)

    def regroup(self, key: Callable[[int], Any], step: Callable[[Any], float | None]) -> None:
        """Part each cohort by `key(param position)`; a part keyed k takes the step `step(k)`
        (None: its cohort's). A cohort left whole keeps its state and update."""
        out = []
        for c in self.cohorts:
            parts: dict[Any, list[int]] = {}
            for j in c.members:
                parts.setdefault(key(j), []).append(j)
            if len(parts) == 1:
                value = step(next(iter(parts)))
                if value is not None:
                    with torch.no_grad():
                        leaves = c.leaves()
                        for i in c.count_at:
                            leaves[i].fill_(value)
                out.append(c)
                continue
            out += [self._cohort(members, c, step(k)) for k, members in parts.items()]
        self._set_cohorts(out)

    def set_steps(self, steps: list[float]) -> None:
        """Each param's own step count (a loaded or assigned torch `step`)."""
        self.regroup(lambda j: steps[j], lambda k: k)

    def hyper_targets(self, key: str) -> list[Any]:
        """The live tensor(s) of hyperparameter `key` in the group's state and every cohort's."""
        return [self.hyper[key]] + [c.hyper[key] for c in self.cohorts if c.state is not self.state]

    def step_of(self, j: int) -> Tensor:
        """Param `j`'s step count."""
        return self.owner[j].step()

    def torch_steps(self) -> list[Tensor]:
        """Each param's step count as torch keeps `step` (a CPU float), read once per cohort."""
        read = {id(c): L.torch_step(c.step()) for c in self.cohorts}
        return [read[id(c)].clone() for c in self.owner]

    def sync(self) -> None:
        """The group's state shows the clocks its cohorts keep and, for its step counts, the
        largest of theirs (each param's own count is in `state_dict()` and `state`)."""
        if len(self.cohorts) > 1:
            first, mine = self.cohorts[0], self.leaves()
            with torch.no_grad():
                for i, k in zip(self.clocks, first.clock_at):
                    mine[i].copy_(first.leaves()[k])
                for n, i in enumerate(self.counts):
                    mine[i].copy_(torch.stack([c.leaves()[c.count_at[n]] for c in self.cohorts]).max())

    def run(self, params: list[Tensor], grads: list[Tensor | None], amp: dict[str, Tensor]) -> None:
        """One update of the params with grads (a param without one is skipped, as torch.optim
        skips it, its step count included)."""
        missing = [gr is None for gr in grads]
        held = None
        if any(missing):
            if self.cohortable:
                self.regroup(lambda j: missing[j], lambda k: None)
            else:
                held = self.hold(params, grads)
        idle = []
        for c in self.cohorts:
            if all(missing[j] for j in c.members):
                idle.append(c)
                continue
            if c.update is None:  # its first run: compiled while the group has compiles left
                compiled = self.compiled and self.compiles < COMPILED_COHORTS
                self.compiles += compiled
                c.update = ps.make_update(self.transform, compile=compiled, donate=not self.differentiable)
            names = [self.names[j] for j in c.members]
            # Differentiable: the update reads clones (its graph may save what it reads; the params change next).
            tree = {n: params[j].clone() for n, j in zip(names, c.members)} if self.differentiable else c.tree
            gs = {
                n: grads[j] if grads[j] is not None else torch.zeros_like(params[j]) for n, j in zip(names, c.members)
            }
            new_params, c.state = c.update(tree, gs, c.state, **amp)[:2]
            if self.differentiable:
                for j, new in zip(c.members, new_params.values()):
                    params[j].copy_(new)
        for c in idle:  # the group stepped: its schedules' steps advance for every cohort
            leaves = c.leaves()
            for i in c.clock_at:
                leaves[i].add_(1 if "found_inf" not in amp else (amp["found_inf"] == 0).to(leaves[i].dtype))
        if len(self.cohorts) == 1:
            self.state = self.cohorts[0].state
        if held is not None:
            self.give_back(params, held)

    def materialize(self, params: list[Tensor], where: str) -> None:
        """The state of params built on the meta device, once they are real (`to_empty` and init)."""
        if any(p.is_meta for p in params):
            raise ValueError(
                f"{where}: its params are still on the meta device; materialize them before the first step or "
                "state_dict load (model.to_empty(device=...) keeps the Parameter objects this optimizer holds under "
                "torch.__future__.set_swap_module_params_on_conversion(True); otherwise build the optimizer after it)"
            )
        with torch.no_grad():
            state = self.transform.init(self.tree)
        for new, old in zip(ps.tree_leaves(ps.get_hyperparams(state)), ps.tree_leaves(self.hyper)):
            new.copy_(old)  # the values the group set while the params were meta
        self.state, self.lazy, self.shown, self.live = state, False, {}, set()
        self.meta = [(p.shape, p.dtype, p.device) for p in params]
        self.addresses = [p.data_ptr() for p in params]
        self.hyper = ps.get_hyperparams(self.state)
        self.index_buffers()

    def moved(self, params: list[Tensor]) -> None:
        """Params whose storage changed (model.to(...), p.data = ..., a compiled update's
        flat buffers): fine unless their shape, dtype or device changed under the state."""
        for n, p, (shape, dtype, device) in zip(self.names, params, self.meta):
            if (p.shape, p.dtype, p.device) != (shape, dtype, device):
                raise ValueError(
                    f"param {n!r} is now {p.dtype} {tuple(p.shape)} on {p.device}, but the Optimizer was built "
                    f"for {dtype} {tuple(shape)} on {device}; build the Optimizer after model.to(...)/.half()"
                )
        self.addresses = [p.data_ptr() for p in params]

    @property
    def has_step(self) -> bool:
        """Whether the group shows torch's per-param `step` (its factory mirrors Adam or AdamW)."""
        return self.mirror is not None and self.mirror.has_step and self.count is not None

    def expose(
        self,
        state: TorchState,
        params: list[Tensor],
        only: set[int] | None = None,
        skip: frozenset[int] | set[int] = frozenset(),
        steps_only: bool = False,
    ) -> None:
        """`state[param]` shows the param's own buffers (the live state tensors, torch's
        names where the factory mirrors a torch class), as torch.optim's state does: code
        that reads it, and torch.distributed.checkpoint's `get_state_dict` (which steps an
        optimizer whose state is empty), see what there is. `only`: those positions alone;
        `skip`: the ids of params shown already (their entries are left as code left them);
        `steps_only`: after a step, whose buffers are the same tensors (their values moved
        on in place), only the steps of entries that show them are new."""
        leaves = self.leaves()
        show = [j for j in (range(len(params)) if only is None else sorted(only)) if id(params[j]) not in skip]
        if not show:
            return
        wanted = {j for j in show if not (steps_only and j in self.live)}
        # A complex param shows a view of its buffer, which a step may re-point (not live).
        self.live.update(j for j in show if not (self.differentiable or params[j].is_complex()))
        for i, j, key in self.buffers:
            if j in wanted:
                p = params[j]
                value = torch.view_as_complex(leaves[i]) if p.is_complex() else leaves[i]
                dict.__setitem__(state.entry(p), key, value)  # shown, not written: no edit to take in
                self.shown[j, key] = value
        if self.has_step:  # torch's per-param `step`: the param's count, as torch keeps it (a CPU float)
            steps: dict[int, Tensor] = {}  # per cohort, read once
            for j in show:
                c = self.owner[j]
                if id(c) not in steps:
                    steps[id(c)] = L.torch_step(c.step())
                step = self.shown[j, "step"] = steps[id(c)].clone()
                dict.__setitem__(state.entry(params[j]), "step", step)

    def take_edits(self, state: TorchState, params: list[Tensor], index: int, only: set[int] | None = None) -> None:
        """What code changed in `state` for this group's params since the last step, taken in
        as torch.optim would.

        A buffer assigned a new tensor (`state[p]["exp_avg"] = t`) is copied into the
        transform's state. A param whose entry was deleted or emptied (`state.pop(p)`,
        `state[p] = {}`, `state.clear()`, a new `state` dict) starts over as torch.optim's
        lazy init would: its buffers as the transform's `init` makes them; when every param of
        a group starts over, so does the group's whole state, step count included. An entry
        that lost some of its buffers starts over too, then takes the ones it holds. An
        assigned `step` sets that param's step count."""
        leaves = self.leaves()
        keys = [(i, j, key) for i, j, key in self.buffers] + (
            [(self.count, j, "step") for j in range(len(params))] if self.has_step else []
        )
        if only is not None:  # only these params were read (one by one): only theirs can have changed
            keys = [k for k in keys if k[1] in only]
        reset, assigned, steps = set(), [], {}
        for i, j, key in keys:
            entry, shown = dict.get(state, params[j]), self.shown.get((j, key), MISSING)
            if entry is None or key not in entry:
                if shown is not MISSING:
                    reset.add(j)  # a key it showed is gone: the param starts over
            elif entry[key] is not shown:
                assigned.append((i, j, key, entry))
        if reset:  # first, so that what an emptied entry was given again is taken after
            self.start_over(params, reset)
        for i, j, key, entry in assigned:
            value = entry[key]
            if key == "step":
                steps[self.names[j]] = float(value)
                self.shown[j, key] = value  # taken: not again at the next step
                self.live.discard(j)  # its entry shows code's tensor until shown anew
                continue
            new = torch.as_tensor(value)
            new = torch.view_as_real(new) if new.is_complex() else new
            if new.shape != leaves[i].shape:
                raise ValueError(
                    f"optimizer.state[param {self.names[j]!r}][{key!r}] was set to shape {tuple(new.shape)}; "
                    f"that buffer is {tuple(leaves[i].shape)}"
                )
            with torch.no_grad():
                leaves[i].copy_(new)
            dict.__setitem__(entry, key, value)  # taken in: not an edit to take again
            self.shown[j, key] = value
            self.live.discard(j)  # it shows the tensor code gave, not the live buffer
        if steps:
            self.regroup(lambda j: steps.get(self.names[j]), lambda k: k)

    def start_over(self, params: list[Tensor], which: set[int]) -> None:
        """The buffers of the params in `which` as `init` makes them, and their step counts
        from 0 (a cohort of their own); all of the state (the injected hyperparameters aside)
        when `which` is every param."""
        with torch.no_grad():
            fresh = ps.tree_leaves(self.transform.init(self.tree))
            leaves = ps.tree_leaves(self.state)
            if len(which) == len(params):  # all of it, the hyperparameters the groups set aside
                hyper = {id(t) for t in ps.tree_leaves(self.hyper)}
                starts = [i for i, leaf in enumerate(leaves) if id(leaf) not in hyper]
            else:
                starts = [i for i, j, _ in self.buffers if j in which]
            for i in starts:
                leaves[i].copy_(fresh[i])
        if len(which) == len(params):
            self.reset_cohorts()
        elif self.cohortable:
            self.regroup(lambda j: j in which, lambda k: 0.0 if k else None)
        for j in which:
            for key in [k for (jj, k) in self.shown if jj == j]:
                del self.shown[j, key]
            self.live.discard(j)

    def hold(self, params: list[Tensor], grads: list[Tensor | None]) -> tuple[list, list]:
        """Copies of the params without a grad and of their own state buffers, put back after the
        group's update (run with zero grads for them), in a group whose state is more than
        per-param buffers and counts (not `cohortable`): they are skipped, as torch.optim skips
        them, but the group's shared state (a step count, an estimate over the group) advances."""
        skipped = {n for n, gr in zip(self.names, grads) if gr is None}
        roles = L.classify(self.state, self.names)
        leaves = ps.tree_leaves(self.state)
        buffers = [(i, leaves[i].clone()) for i, r in enumerate(roles) if r.kind == "buffer" and r.param in skipped]
        values = [(i, p.detach().clone()) for i, (n, p) in enumerate(zip(self.names, params)) if n in skipped]
        return values, buffers

    def give_back(self, params: list[Tensor], held: tuple[list, list]) -> None:
        values, buffers = held
        leaves = ps.tree_leaves(self.state)
        for i, v in values:
            params[i].copy_(v)
        for i, v in buffers:
            leaves[i].copy_(v)


def real(tensors: list[Tensor | None]) -> list[Tensor | None]:
    """Complex tensors as their real views (..., 2), as torch.optim treats complex params."""
    return [torch.view_as_real(t) if t is not None and t.is_complex() else t for t in tensors]


def refuse_grads(names: list[str], grads: list[Tensor | None]) -> None:
    sparse = next(n for n, gr in zip(names, grads) if gr is not None and gr.is_sparse)
    raise ValueError(f"param {sparse!r} has a sparse grad; purestep transforms need dense grads")


def plain(value: Any) -> Any:
    """A hyperparameter's value as a param group holds it (tensors read once, here)."""
    if isinstance(value, tuple):
        return tuple(plain(v) for v in value)
    return value.item() if isinstance(value, Tensor) else value
