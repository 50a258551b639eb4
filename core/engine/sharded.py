"""The compiled, donated update over FSDP2 shards: flat buffers of this rank's shards.

FSDP2 params (and grads, and any state built from them) are `DTensor`s sharded on dim 0:
each rank holds a contiguous block of rows of every leaf, `Tensor`-typed, in
`DTensor._local_tensor`. Elementwise math does not care that a block is not the whole
leaf, so the flat runner given `ShardBlocks` lays the local blocks out in flat buffers as `flat` does
in one process and runs the compiled step there: one kernel per group, no DTensor
dispatch. What is not elementwise goes through `ops`, which the params' placement
(`placement.Placement`, read by `mesh.placement`) serves:

- reductions over the tree (the grad norm, `apply_if_finite`'s count, per-leaf norms) are
  local partial sums and one batched `all_reduce` each (functional collectives, so they
  trace into the compiled step);
- whole-matrix math (Muon) is owner-computes: every matrix gets an owner rank (balanced
  by Newton-Schulz cost, recomputed from the shapes, never saved), the blocks travel to
  their owners in one `all_to_all_single`, the owner runs the math once per matrix
  (same-shape matrices batched), and the results' rows travel back in a second one.

The storage rule. FSDP2 all-gathers a param before each forward from the storage of its
sharded local tensor (`FSDPParam._sharded_param_data` shares that storage, padded). The
user's DTensors therefore keep their storage *objects*: the memory behind each one is
moved into the flat buffer (`UntypedStorage._swap_data_ptr_`: the storage's old memory is
released, every tensor on it, FSDP's own included, now reads and writes the buffer), so
an update in the buffer is what the next all-gather sends. A param whose storage holds
more than its own block (a view into something larger) is copied back after each step
instead. State and grad leaves are re-pointed (`Tensor.set_`) as in one process; a grad
FSDP2 accumulates into (`grad._local_tensor += ...`) is then written in the buffer directly.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import Tensor

from .. import _tree as tr
from .program import Program
from .donate import aliases, copy_into, move_storage
from .dtensor import is_dtensor, local, local_tree
from .flat import FlatUpdate, OwnTensors
from .mesh import describe as describe
from .mesh import placement
from .needs import plan
from .packed import NotPacked, Packed, PackSpec
from .per_leaf import eager
from .placement import Declined


class ShardBlocks(OwnTensors):
    """What the flat runner's buffers stand for over shards: this rank's blocks of the
    DTensor params (see the module docstring), planned on their placement."""

    repoint_grad_views = True  # FSDP2 accumulates into `grad._local_tensor`: let it write the buffer

    def __init__(self) -> None:
        self.copy_back: list[tuple[Tensor, Tensor]] = []

    def local(self, tree: Any) -> Any:
        return local_tree(tree)

    def local_leaves(self, leaves: list) -> list:
        return [local(x) for x in leaves]

    def plan(self, transform: Any, params: Any) -> Any:
        try:
            info = placement(params)
            tags = [info.tags(i) for i in range(len(info.shapes))]
            return plan(transform, local_tree(params), tags=tags, shard=info)
        except Declined as e:  # a placement or mesh the sharded path does not take
            raise NotPacked(str(e)) from e

    def agree(self, ok: bool, params: Any, runner: Any) -> bool:
        return _agree(ok, params, runner)

    def slack(self, params: Any, group: Any) -> int:
        """Room for the padding FSDP2 keeps past a block (its storage is the padded shard)."""
        leaves = pytree.tree_leaves(params)
        return max(
            [
                leaves[m.index].untyped_storage().nbytes() // leaves[m.index].element_size() - m.numel
                for m in group.members
            ]
            + [0]
        )

    def bind_params(self, params: Any, packed_params: Packed, groups: list, p_raw: list[Tensor]) -> None:
        """The user's param blocks into the buffers, keeping their storage objects."""
        views = {m.index: v for g, b in zip(groups, packed_params.values()) for m, v in zip(g.members, g.views(b))}
        raw_end = {m.index: r.data_ptr() + r.nbytes for g, r in zip(groups, p_raw) for m in g.members}
        self.copy_back = []
        pairs, _ = tr.tree_flatten_with_path(params)
        for i, (path, x) in enumerate(pairs):
            user, view = local(x), views[i]
            if user.shape != view.shape or user.dtype != view.dtype:
                raise ValueError(
                    f"param '{path}': expected {tuple(view.shape)} {view.dtype}, got {tuple(user.shape)} {user.dtype}"
                )
            if aliases(user, view):
                continue
            if not move_storage(user, view, raw_end[i] - view.data_ptr()):
                with torch.no_grad():
                    view.copy_(user)
                if user.numel():
                    self.copy_back.append((user, view))
        for x in pytree.tree_leaves(params):  # the buffers live as long as the params do
            x._purestep_buffers = p_raw

    def after_run(self) -> None:
        if self.copy_back:
            copy_into([u for u, _ in self.copy_back], [v for _, v in self.copy_back], "params")

    def describe(self, pack: Any, params: Any) -> str:
        return f"flat buffers over this rank's blocks; {describe(params)}"


def sharded_update(program: Program) -> FlatUpdate:
    """The compiled, donated update over this rank's blocks: `FlatUpdate` given `ShardBlocks`."""
    return FlatUpdate(program, ShardBlocks())


class ShardedEager:
    """The sharded path without compile: each of this rank's blocks is a buffer of its own.

    Eager kernels gain nothing from packing (one op per leaf either way) and would pay for
    the copies and temporaries of large buffers, so here the "buffers" are the user's own
    local blocks, in place, with no binding and no storage moved: the transform runs through
    its in-place forms (`per_leaf.eager(program)`) on a packed tree of one leaf per
    group, which gives `ops` the shard description (reductions across ranks,
    owner-computes)."""

    def __init__(self, program: Program) -> None:
        self.transform, self.eager, self.averaging = program.transform, eager(program), program.averaging
        self.why_not: str | None = None
        self._planned: tuple[list[int], PackSpec, Any, Any] | None = None

    def _plan(self, params: Any) -> tuple[PackSpec, Any, Any]:
        key = [id(x) for x in pytree.tree_leaves(params)]
        if self._planned is None or self._planned[0] != key:
            info = placement(params)
            alone = [(*info.tags(i), ("alone", i)) for i in range(len(info.shapes))]
            pack = plan(self.transform, local_tree(params), tags=alone, shard=info)
            with torch.no_grad():  # the state's structure over this layout (its values are the user's)
                packed = Packed(pack, pytree.tree_leaves(local_tree(params)))
                state_spec = pytree.tree_structure(self.transform.init(packed))
                ema_spec = pytree.tree_structure(self.averaging[0](packed)) if self.averaging is not None else None
            info.active = True
            self._planned = (key, pack, state_spec, ema_spec)
        return self._planned[1:]

    def plans(self, params: Any, agree: bool = True) -> bool:
        try:
            self._plan(params)
            ok = True
        except NotPacked as e:
            self.why_not, ok = e.reason, False
        except Declined as e:  # a placement or mesh the sharded path does not take
            self.why_not, ok = str(e), False
        return _agree(ok, params, self) if agree else ok

    def layout(self) -> None:
        return None

    def describe(self, params: Any) -> str:
        return f"this rank's blocks in place, eager; {describe(params)}"

    def __call__(
        self, params: Any, grads: Any, opt_state: Any, ema_state: Any = None, amp: Any = None, extra: Any = None
    ) -> None:
        pack, state_spec, ema_spec = self._plan(params)

        # Leaf lists, not tree maps: this runs every step, and its trees have hundreds of leaves.
        def packed(tree: Any, spec: Any, what: str) -> Any:
            leaves = [local(x) for x in pytree.tree_leaves(tree)]
            if len(leaves) != spec.num_leaves:
                raise ValueError(f"{what} is not structured like the optimizer's state for these params")
            return pytree.tree_unflatten(leaves, spec)

        p = Packed(pack, [local(x) for x in pytree.tree_leaves(params)])
        g = Packed(pack, [local(x) for x in tr.check_match(grads, params, "grads", "params")])
        e = packed(ema_state, ema_spec, "ema_state") if self.averaging is not None else None
        if extra:
            spec = pytree.tree_structure(params)
            extra = {  # the transform's own inputs; those shaped like the params packed as the grads are
                k: Packed(pack, [local(x) for x in pytree.tree_leaves(v)]) if pytree.tree_structure(v) == spec else v
                for k, v in extra.items()
            }
        return self.eager(p, g, packed(opt_state, state_spec, "opt_state"), e, amp, extra)


def _agree(ok: bool, params: Any, engine: Any) -> bool:
    """Whether every rank can run a sharded path (one collective, at the first call): their
    collectives must match, so a rank that cannot sends all to the per-leaf path."""
    # Every mesh the DTensors live on (a root mesh and its slices under FSDP beside TP), each
    # dim in turn, in an order every rank shares: the flag reaches every rank they span, and
    # none beyond (a pipeline stage's meshes leave the other stages out).
    meshes: dict[tuple, Any] = {}
    device = None  # the params': NCCL takes no CPU tensor
    for x in pytree.tree_leaves(params):
        if is_dtensor(x):
            m = x.device_mesh
            meshes.setdefault((m.mesh_dim_names or (), tuple(m.mesh.shape)), m)
            device = x.device
    flag = torch.tensor([0 if ok else 1], dtype=torch.int64, device=device)
    for key in sorted(meshes):
        for dim in range(meshes[key].ndim):
            group = meshes[key].get_group(dim)
            if torch.distributed.get_world_size(group) > 1:
                torch.distributed.all_reduce(flag, group=group)
    if ok and int(flag[0]):
        engine.why_not = f"{int(flag[0])} other rank(s) cannot plan this transform over their blocks"
    return not int(flag[0])
