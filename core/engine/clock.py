"""Quiet calls known on the host: a donated step counts calls, so the calls on which a
transform's periodic branch is not taken need no `torch.cond`.

A transform whose update takes a branch on some calls only, as a function of its call count
alone (DiLoCo's syncs), declares which calls are quiet (`Needs(phase=Phase(...))`). In
compiled code the branch is otherwise a `torch.cond`, whose outputs are new tensors: on
every call the branch not taken hands back a copy of every state leaf it carries (DiLoCo's
anchor and outer state: two copies of the params on every call between syncs). A donated
step on flat buffers (`flat`, `sharded`) instead keeps the count on the host (`HostClock`):
it reads the count from the state once, when it meets a state tree, adds one per call, and
tells each declared transform whether this call is quiet (`quiet`) while the step runs. A
quiet call runs a program with no branch at all; the others run the program with the
`torch.cond`s. Two compiled programs at most, each compiled once.

The count is read again, with one host read, whenever the step sees a new state tree or
a state count written in place since its last call (the tensor's version counter: a
checkpoint loaded into the same tensors), so the host count never drifts from the state.
"""

from __future__ import annotations

from typing import Any, Callable, Hashable, NamedTuple

import torch.utils._pytree as pytree
from torch import Tensor

from .dtensor import local


class Phase(NamedTuple):
    """Which calls of a transform are quiet, a function of its call count alone (see the
    module docstring)."""

    key: Hashable  # names `quiet`: transforms with equal keys are quiet at equal counts
    state: type  # the state class whose `count` counts the transform's calls
    quiet: Callable[[int], bool]  # whether call n (the calls so far, this one included) takes no branch


# Whether the call running now is quiet, by `Phase.key`; empty outside a donated call. A traced
# step reads it (`quiet`), so Dynamo keeps a compiled program for each answer, guarded on it.
_current: dict[Hashable, bool] = {}


def quiet(key: Hashable) -> bool:
    """Inside an update: True when the host knows this call is quiet for the transforms
    declared under `key`; False when it is not or the host does not know (the update
    decides on the device, with `torch.cond`)."""
    return _current.get(key, False)


class HostClock:
    """The call count of a donated step's state trees, on the host, for the declared phases."""

    def __init__(self, phases: list[Phase]) -> None:
        self.phases = phases
        self.kinds = tuple({p.state for p in phases})
        self.state: Any = None  # the state tree last read, its counts and their versions
        self.counts: list[Tensor] = []
        self.versions: list[int] = []
        self.n: int | None = None

    def _counts(self, state: Any) -> list[Tensor]:
        found = pytree.tree_leaves(state, is_leaf=lambda x: isinstance(x, self.kinds))
        return [local(getattr(s, "count")) for s in found if isinstance(s, self.kinds)]

    def _read(self, state: Any) -> None:
        counts = self._counts(state)
        values = {int(c) for c in counts}  # one host read per state tree met
        self.state, self.counts = state, counts
        # Counts that disagree (states stepped apart): the branches are left to the device.
        self.n = values.pop() if len(values) == 1 else None
        self.versions = [c._version for c in counts]

    def start(self, state: Any) -> Hashable:
        """Before a call: say which transforms this call is quiet for; returns that (a key
        per compiled program)."""
        if not self.phases:
            return None
        if state is not self.state or [c._version for c in self.counts] != self.versions:
            self._read(state)
        if self.n is None:
            return None
        self.n += 1
        _current.update((p.key, bool(p.quiet(self.n))) for p in self.phases)
        return tuple(_current[p.key] for p in self.phases)

    def stop(self) -> None:
        """After a call (also one that raised): nothing known outside it; the counts'
        versions as the step left them."""
        _current.clear()
        if self.phases:
            self.versions = [c._version for c in self.counts]
