"""Running a compiled, donated update over flat buffers (`packed`; planned by `needs`).

`FlatUpdate` (make_update) and `FlatStep` (make_step) plan a layout once, allocate one
buffer per group for params, grads and every state entry, re-point the user's tensors
(`Tensor.set_`) to views into them, and run the compiled step on the buffers; on CUDA,
from the second call on, as one CUDA-graph replay. The user keeps the same tensor
objects with the same values; a param tensor replaced or moved (its address changed)
makes the next call plan and bind anew.
"""

from __future__ import annotations

import abc
import dataclasses
from typing import Any, Callable

import torch
import torch.utils._pytree as pytree
from torch import Tensor

from .. import _tree as tr
from .program import Program
from .clock import HostClock
from .compiling import compile_own
from .donate import bind_tree, copy_into, repoint_, write_back
from .needs import plan
from .packed import NotPacked, Packed, check_viewable, pack_like


@dataclasses.dataclass
class _Bound:
    """A layout bound to the user's tensors: the buffers, what they stand for, the compiled step."""

    groups: list  # the layout's `_Group`s
    specs: list  # tree specs of packed (params, grads, state, ema)
    buffers: list  # their leaves: the flat buffers and the state's scalars
    grad_views: list[Tensor]  # per param leaf, its view into the grad buffers
    params: list[Tensor]  # the leaves bound (their local blocks over shards)
    param_spec: Any
    param_ptrs: list[int]  # their addresses once bound: a change means rebinding
    state: Any  # the state (and EMA) trees bound, as the user holds them
    ema: Any
    keys: list[str] | None  # the param names, for dict trees (a fast path for grads)
    fn: Callable  # the step over the buffers (compiled)
    clock: HostClock  # the call count of the branches known on the host (`clock`)
    # CUDA, per branch known on the host (None: none): calls before capture, the captured graph and its outputs
    calls: dict = dataclasses.field(default_factory=dict)
    graphs: dict = dataclasses.field(default_factory=dict)
    input_key: Any = None  # make_step on CUDA: the batch's structure and shapes, and its static copies
    inputs: Any = None


class OwnTensors:
    """What the buffers of a flat runner stand for in one process: the user's own tensors.

    The runner is given this object (`sharded.ShardBlocks` over FSDP2's and TP's blocks): it
    says which tensors the buffers stand for (`local`), plans their layout (`plan`, `agree`:
    the ranks' answers made one), how much room a param buffer needs past its end (`slack`),
    how the params move into the buffers (`bind_params`) and what follows a run (`after_run`:
    copies back where a param could not move), whether a grad that views another buffer is
    re-pointed (`repoint_grad_views`), and what `explain()` says of it (`describe`)."""

    repoint_grad_views = False  # a grad viewing someone else's buffer (DDP's bucket) is copied, left be

    def local(self, tree: Any) -> Any:
        return tree

    def local_leaves(self, leaves: list) -> list:
        return leaves

    def plan(self, transform: Any, params: Any) -> Any:
        return plan(transform, params)

    def agree(self, ok: bool, params: Any, runner: Any) -> bool:
        return ok

    def slack(self, params: Any, group: Any) -> int:
        return 0

    def bind_params(self, params: Any, packed_params: Packed, groups: list, p_raw: list[Tensor]) -> None:
        bind_tree(params, packed_params, "params")

    def after_run(self) -> None:
        pass

    def describe(self, pack: Any, params: Any) -> str:
        return pack.summary


class _FlatRunner(abc.ABC):
    """Planning and binding shared by `FlatUpdate` and `FlatStep` (see the module docstring):
    the buffers stand for `leaves`' tensors (`OwnTensors` in one process)."""

    grads_in = True  # grads come from the caller (make_step computes its own)

    def __init__(self, program: Program, leaves: OwnTensors | None = None) -> None:
        self.transform, self.pure, self.averaging = program.transform, program.pure, program.averaging
        self.metrics = program.metrics  # `pure` returns its metrics last; the step hands them back
        self.leaves = leaves if leaves is not None else OwnTensors()
        self.bound: _Bound | None = None
        self.why_not: str | None = None  # why the last `plans` said no
        self._planned: tuple[list[int], Any] | None = None

    def layout(self) -> dict[str, list[str]] | None:
        if self.bound is None:
            return None
        return {g.key: [m.path for m in g.members] for g in self.bound.groups}

    def describe(self, params: Any) -> str:
        """What runs on these params, for `explain()` (once `plans` said yes)."""
        return self.leaves.describe(self.plan_for(params), params)

    @abc.abstractmethod
    def _compile(self, specs: list[pytree.TreeSpec], device: torch.device) -> Callable:
        """The step over the buffers, compiled: each runner's own (an update's, a step's)."""

    def _bound(self) -> _Bound:
        """The binding, once the first call made it."""
        assert self.bound is not None, "not bound yet: the first call binds"
        return self.bound

    def plan_for(self, params: Any) -> Any:
        """The layout for these params, planned once (`plans` then binding reuse it)."""
        key = [id(x) for x in pytree.tree_leaves(params)]
        if self._planned is None or self._planned[0] != key:
            self._planned = (key, self.leaves.plan(self.transform, params))
        return self._planned[1]

    # -- binding -------------------------------------------------------------
    def plans(self, params: Any, agree: bool = True) -> bool:
        """Whether the transform runs on packed buffers for these params (`why_not` if not);
        `agree` matters over shards only (the ranks' answers in one collective)."""
        try:
            self.plan_for(params)
            self.why_not, ok = None, True
        except NotPacked as e:
            self.why_not, ok = e.reason, False
        return self.leaves.agree(ok, params, self) if agree else ok

    def _bind(self, params: Any, opt_state: Any, ema_state: Any) -> None:
        pack = self.plan_for(params)
        user_state, user_ema = opt_state, ema_state  # kept to tell a new state tree from this one
        local = self.leaves.local
        params, opt_state, ema_state = local(params), local(opt_state), local(ema_state)
        groups, spec = pack.groups, pack.orig_spec
        pairs, _ = tr.tree_flatten_with_path(params)
        p_raw = [torch.empty(g.numel + self.leaves.slack(params, g), dtype=g.dtype, device=g.device) for g in groups]
        p_buf = [r[: g.numel].view(g.shape) for g, r in zip(groups, p_raw)]
        # make_step computes its grads inside the step: no grad buffer to keep.
        g_buf = [torch.zeros(g.shape, dtype=g.dtype, device=g.device) for g in groups] if self.grads_in else []
        packed_params, packed_grads = Packed(pack, p_buf), (Packed(pack, g_buf) if self.grads_in else None)
        self.leaves.bind_params(params, packed_params, groups, p_raw)
        with torch.no_grad():
            packed_state = self.transform.init(packed_params)
            packed_ema = self.averaging[0](packed_params) if self.averaging is not None else None
        check_viewable(packed_state, packed_params)
        bind_tree(opt_state, packed_state, "opt_state")
        if self.averaging is not None:
            bind_tree(ema_state, packed_ema, "ema_state")
        if pack.shard is not None:
            pack.shard.active = True  # planned: from now on the reductions span the ranks
        trees = (packed_params, packed_grads, packed_state, packed_ema)
        flat = [pytree.tree_flatten(t) for t in trees]
        g_views = [v for g, b in zip(groups, g_buf) for v in g.views(b)] if self.grads_in else []
        order = [m.index for g in groups for m in g.members]
        self.bound = _Bound(
            groups=groups,
            specs=[s for _, s in flat],
            buffers=[leaves for leaves, _ in flat],
            grad_views=[g_views[order.index(i)] for i in range(len(order))] if g_views else [],
            params=[x for _, x in pairs],
            param_spec=spec,
            param_ptrs=[x.data_ptr() for _, x in pairs],
            state=user_state,
            ema=user_ema,
            keys=list(params) if type(params) is dict else None,
            fn=self._compile([s for _, s in flat], groups[0].device if groups else torch.device("cpu")),
            clock=HostClock(pack.phases),
        )

    def _grads_in(self, grads: Any) -> None:
        b = self._bound()
        views, keys = b.grad_views, b.keys
        if keys is not None and type(grads) is dict and list(grads) == keys:
            leaves = list(grads.values())
        else:
            leaves = tr.check_match(grads, pytree.tree_unflatten(b.params, b.param_spec))
        stale = [(v, g) for v, g in zip(views, leaves) if g.data_ptr() != v.data_ptr() or g.shape != v.shape]
        with torch.no_grad():
            for v, g in stale:
                if g._is_view() and not self.leaves.repoint_grad_views:  # a view into a DDP bucket: copy, leave it be
                    v.copy_(g)
                else:
                    # One copy into the flat grad buffer; the grad tensor then views it, so a
                    # `loss.backward()` after `zero_grad(set_to_none=False)` writes there directly.
                    repoint_(g, v, "grads")

    def _params_moved(self, params: Any) -> bool:
        leaves = self.leaves.local_leaves(list(params.values()) if type(params) is dict else pytree.tree_leaves(params))
        b = self._bound()
        return len(leaves) != len(b.params) or any(
            x is not y or x.data_ptr() != ptr for x, y, ptr in zip(leaves, b.params, b.param_ptrs)
        )

    def _take_in_state(self, opt_state: Any, ema_state: Any) -> None:
        b = self._bound()
        if opt_state is not b.state:
            bind_tree(self.leaves.local(opt_state), pytree.tree_unflatten(b.buffers[2], b.specs[2]), "opt_state")
            b.state = opt_state
        if self.averaging is not None and ema_state is not b.ema:
            bind_tree(self.leaves.local(ema_state), pytree.tree_unflatten(b.buffers[3], b.specs[3]), "ema_state")
            b.ema = ema_state


class FlatUpdate(_FlatRunner):
    """A compiled, donated update over packed buffers (see the module docstring).

    `__call__(params, grads, opt_state[, ema_state])` updates the user's trees in place.
    `program` is make_update's (`UpdateProgram`): its `pure` form, the update as a pure
    function of trees, is what runs compiled over the buffers."""

    def _compile(self, specs: list[pytree.TreeSpec], device: torch.device) -> Callable:
        pure, averaging, metrics = self.pure, self.averaging, self.metrics

        def step(p, g, s, e, amp=None, extra=None, like_params=()):
            trees = [pytree.tree_unflatten(x, sp) for x, sp in zip((p, g, s, e), specs)]
            if extra:  # the transform's own inputs; those shaped like the params packed as the grads are
                extra = {k: pack_like(trees[0], v) if k in like_params else v for k, v in extra.items()}
            out = pure(trees[0], trees[1], trees[2], trees[3] if averaging is not None else None, amp, extra)
            for dst, src in zip((p, s) + ((e,) if averaging is not None else ()), out):
                write_back(dst, src)
            return out[-1] if metrics else None

        # An update's buffers never change size: it compiles static (Dynamo's sizes remembered
        # from another update would otherwise make its shape arithmetic symbolic, and the
        # owner assignment of the sharded path sorts the plan's sizes: `compile_own`).
        return compile_own(step, device, static=True)

    def __call__(
        self, params: Any, grads: Any, opt_state: Any, ema_state: Any = None, amp: Any = None, extra: Any = None
    ) -> Any:
        b = self.bound
        if b is None or self._params_moved(params):
            self._bind(params, opt_state, ema_state)
            b = self._bound()
        self._take_in_state(opt_state, ema_state)
        self._grads_in(self.leaves.local(grads))
        branch = b.clock.start(opt_state)
        try:
            # With torch's AMP inputs (0-d tensors, new ones each call) or the transform's own
            # inputs the same compiled step runs with them, outside any CUDA graph (a graph reads
            # its inputs at fixed addresses).
            if amp is None and not extra:
                out = _run(b, b.buffers, branch)
            else:
                extra = {k: self.leaves.local(v) for k, v in (extra or {}).items()}
                like = tuple(sorted(k for k, v in extra.items() if pytree.tree_structure(v) == b.param_spec))
                out = b.fn(*b.buffers, amp, extra, like)
        finally:
            b.clock.stop()
        self.leaves.after_run()
        if out is not None and amp is None and not extra and branch in b.graphs:  # a graph rewrites its outputs
            out = pytree.tree_map(lambda x: x.clone() if isinstance(x, Tensor) else x, out)
        return out


def _run(b: _Bound, args: list, branch: Any = None) -> Any:
    """Call the compiled step; on CUDA, from the second call on, as one CUDA-graph replay
    (every input lives at a fixed address: the buffers, and make_step's batch copies), one
    graph per branch known on the host (`branch`, `clock`)."""
    if not (b.buffers[0] and b.buffers[0][0].is_cuda):
        return b.fn(*args)
    if branch in b.graphs:
        graph, out = b.graphs[branch]
        graph.replay()
        return out
    b.calls[branch] = b.calls.get(branch, 0) + 1
    if b.calls[branch] < 2:  # compile and warm up outside a graph
        return b.fn(*args)
    graph = torch.cuda.CUDAGraph()
    torch.cuda.synchronize()
    with torch.cuda.graph(graph):
        out = b.fn(*args)
    b.graphs[branch] = (graph, out)
    graph.replay()
    return out


class FlatStep(_FlatRunner):
    """`make_step`'s compiled, donated step over packed buffers: the loss and grads are
    taken on per-leaf views of the param buffers, the grads packed, then the update runs
    on the buffers as in `FlatUpdate`. `pure(params, opt_state, batch, buffers, with_buffers)`
    is make_step's pure step, which accepts packed params."""

    grads_in = False

    def _compile(self, specs: list[pytree.TreeSpec], device: torch.device) -> Callable:
        pure, p_spec, s_spec = self.pure, specs[0], specs[2]

        def step(p, s, batch, buffers, with_buffers):
            params, state = pytree.tree_unflatten(p, p_spec), pytree.tree_unflatten(s, s_spec)
            new_params, new_state, metrics, new_buffers = pure(params, state, batch, buffers, with_buffers)
            for dst, src in ((p, new_params), (s, new_state)) + (((buffers, new_buffers),) if with_buffers else ()):
                write_back(dst, src)
            return metrics

        return compile_own(step, device)  # not static: its batches change shape

    def __call__(  # make_step's step: (params, state, batch[, buffers])
        self, params: Any, opt_state: Any, batch: Any, buffers: Any = None, with_buffers: bool = False
    ) -> dict:
        b = self.bound
        if b is None or self._params_moved(params):
            self._bind(params, opt_state, None)
            b = self._bound()
        self._take_in_state(opt_state, None)
        p, s = b.buffers[0], b.buffers[2]
        if not (p and p[0].is_cuda):
            return b.fn(p, s, batch, buffers, with_buffers)
        # A CUDA graph reads its inputs at fixed addresses: the batch (and buffers) are
        # copied into tensors the graph owns; a new structure or shape captures anew.
        key = (
            pytree.tree_structure((batch, buffers)),
            [getattr(x, "shape", x) for x in pytree.tree_leaves((batch, buffers))],
        )
        if b.input_key != key:
            b.input_key, b.graphs, b.calls = key, {}, {}
            b.inputs = pytree.tree_map(lambda x: x.clone() if isinstance(x, Tensor) else x, (batch, buffers))
        else:
            pairs = [
                (d, x)
                for d, x in zip(pytree.tree_leaves(b.inputs), pytree.tree_leaves((batch, buffers)))
                if isinstance(d, Tensor)
            ]
            torch._foreach_copy_([d for d, _ in pairs], [x for _, x in pairs])
        static_batch, static_buffers = b.inputs
        branch = b.clock.start(opt_state)
        try:
            metrics = _run(b, [p, s, static_batch, static_buffers, with_buffers], branch)
        finally:
            b.clock.stop()
        if with_buffers:  # donated buffers: the caller's tensors get the new values
            copy_into(buffers, static_buffers, "buffers")
        # The graph rewrites its outputs on every replay: hand out copies.
        return pytree.tree_map(lambda x: x.clone() if isinstance(x, Tensor) else x, metrics)
