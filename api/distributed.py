"""Process groups, DDP / FSDP2 wrapping and the few collectives the Trainer needs.

Launch with `torchrun` (multi-node by torchrun's own flags); a plain `python` run is a
world of one. CPU runs use gloo, CUDA runs NCCL. Under FSDP2 parameters, gradients and
the optimizer state are `DTensor`s sharded on dim 0: purestep's transforms run on them
unchanged, and DTensor turns whole-tensor reductions (the global grad norm of
`clip_by_global_norm`, Muon's matrix products) into collectives, so nothing is ever
computed on a local shard as if it were the whole tensor. Elementwise state (Adam
moments, the params EMA) stays shard-local.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass
from typing import Any, Callable, cast

import torch
import torch.distributed as dist
import torch.utils._pytree as pytree
from torch import Tensor, nn

from purestep.core.engine.dtensor import full_tree as full_tree  # the one set of DTensor helpers
from purestep.core.engine.dtensor import is_dtensor as is_dtensor
from purestep.core.engine.dtensor import local as local

STRATEGIES = ("single", "ddp", "fsdp", "hsdp", "tp", "fsdp+tp", "hsdp+tp")
TP = ("tp", "fsdp+tp", "hsdp+tp")  # the strategies with tensor parallelism
FSDP = ("fsdp", "hsdp", "fsdp+tp", "hsdp+tp")  # the strategies whose params FSDP2 shards


@dataclass(frozen=True)
class World:
    """Where this process runs: `rank` of `size`, its `device`, and the strategy."""

    rank: int
    size: int
    local_rank: int
    device: torch.device
    strategy: str
    replicate: int = 1  # HSDP's replicas (the mesh's first dim); 1 on the other strategies
    tp: int = 1  # the tensor-parallel degree (the (dp, tp) mesh's second dim); 1 without TP
    ep: int = 1  # the expert-parallel degree (the (efsdp, ep) mesh's second dim); 1 without EP

    @property
    def main(self) -> bool:
        return self.rank == 0

    @property
    def dp_rank(self) -> int:
        """This rank's place among the data-parallel ranks (the ranks of a TP group see the same rows)."""
        return self.rank // self.tp

    @property
    def dp_size(self) -> int:
        """The number of data-parallel ranks: the ranks, less tensor parallelism's."""
        return self.size // self.tp

    @property
    def distributed(self) -> bool:
        return self.strategy != "single"


def setup(
    strategy: str = "single", device: str | None = None, *, replicate: int = 0, tp: int = 0, ep: int = 0
) -> World:
    """Join the process group torchrun describes (if any) and pick this rank's device.

    On CUDA each process of a node takes the GPU of its `LOCAL_RANK`; a launch with more
    processes per node than the node has GPUs fails here, in one line naming both counts.
    `replicate`: HSDP's replicate degree (0: one replica per node); it must divide the ranks
    (under "hsdp+tp", the ranks / `tp`).
    `tp`: the tensor-parallel degree of "fsdp+tp" and "hsdp+tp" (0: the ranks of a node) and
    "tp" (0 or every rank); it must divide the ranks.
    `ep`: the expert-parallel degree under "fsdp" (0 or 1: none); it must divide the ranks.
    """
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy must be one of {STRATEGIES}, got {strategy!r}")
    size = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if strategy in TP:
        per_node = int(os.environ.get("LOCAL_WORLD_SIZE", str(size)))
        tp = tp or (size if strategy == "tp" else per_node)
        if size % tp:
            raise ValueError(
                f"strategy='{strategy}': tp={tp} does not divide the {size} ranks; pick a divisor of {size} (dp x tp = ranks)"
            )
        if strategy == "tp" and tp != size:
            raise ValueError(
                f"strategy='{strategy}': tp={tp} does not cover the {size} ranks; 'tp' runs tensor parallelism over "
                "every rank (use 'fsdp+tp' for dp x tp)"
            )
    elif tp:
        raise ValueError(f"tp={tp} is tensor parallelism's degree; strategy is {strategy!r}")
    if strategy in ("hsdp", "hsdp+tp"):
        groups = size // (tp or 1)  # the data-parallel ranks: replicas x shards
        nodes = max(1, size // int(os.environ.get("LOCAL_WORLD_SIZE", str(size))))
        replicate = replicate or min(nodes, groups)
        if groups % replicate:
            over = (
                f"the {groups} data-parallel ranks ({size} ranks / tp={tp})"
                if strategy == "hsdp+tp"
                else f"the {size} ranks"
            )
            raise ValueError(
                f"strategy='{strategy}': replicate={replicate} does not divide {over}; "
                f"pick a divisor of {groups} (replicas x shards = {groups})"
            )
    elif replicate:
        raise ValueError(f"replicate={replicate} is HSDP's degree; strategy is {strategy!r}")
    replicas = replicate if strategy in ("hsdp", "hsdp+tp") else 1
    if ep > 1 and strategy != "fsdp":
        raise ValueError(
            f"ep={ep} is expert parallelism's degree, built beside strategy='fsdp'; strategy is {strategy!r}"
        )
    if ep > 1 and size % ep:
        raise ValueError(f"strategy='fsdp': ep={ep} does not divide the {size} ranks; pick a divisor of {size}")
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    dev = torch.device(device)
    if dev.type == "cuda":
        dev = _local_gpu(dev, local_rank)
        torch.cuda.set_device(dev)
    if strategy == "single":
        if size > 1:
            raise ValueError(
                f"strategy='single' but torchrun started {size} processes; pass --set strategy=ddp or strategy=fsdp"
            )
        return World(0, 1, 0, dev, strategy)
    if not dist.is_initialized():
        if "MASTER_ADDR" not in os.environ:  # a plain `python` run: a world of one
            os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
            os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
            os.environ.setdefault("RANK", "0")
            os.environ.setdefault("WORLD_SIZE", "1")
        backend = "nccl" if dev.type == "cuda" else "gloo"
        timeout = datetime.timedelta(minutes=10)
        # torchrun's restarts (--max-restarts) keep the agent's store, and with it the keys the
        # ranks of the failed attempt left there (gloo's addresses, NCCL's id): a restarted rank
        # would connect to a dead peer. Each attempt gets keys of its own.
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT")
        store, at, of = next(dist.rendezvous("env://", timeout=timeout)) if attempt else (None, -1, -1)
        dist.init_process_group(
            backend,
            timeout=timeout,
            device_id=dev if dev.type == "cuda" else None,
            store=dist.PrefixStore(f"purestep/attempt_{attempt}/", store) if store is not None else None,
            rank=at,
            world_size=of,
        )
    return World(dist.get_rank(), dist.get_world_size(), local_rank, dev, strategy, replicas, tp or 1, max(ep, 1))


def _local_gpu(dev: torch.device, local_rank: int) -> torch.device:
    """This process's GPU: `cuda:LOCAL_RANK` unless an index was given; checked against the node's GPU count."""
    count = torch.cuda.device_count()
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", str(local_rank + 1)))
    if dev.index is None and per_node > count:
        raise ValueError(
            f"{per_node} processes per node need {per_node} GPUs, but this node has {count}: "
            f"launch at most {count} (torchrun --nproc_per_node={count}) or run on CPU"
        )
    index = local_rank if dev.index is None else dev.index
    if index >= count:
        raise ValueError(f"device cuda:{index} asked for, but this node has {count} GPU(s) (cuda:0..cuda:{count - 1})")
    return torch.device("cuda", index)


def teardown(world: World) -> None:
    if world.distributed and dist.is_initialized():
        # Every rank leaves together: a gloo rank that tears down while its peer still
        # finishes (rank 0 writing the last checkpoint) can abort at exit.
        dist.barrier()
        dist.destroy_process_group()


def blocks_of(model: nn.Module) -> list[nn.Module]:
    """The repeated blocks FSDP2 shards one by one: the first ModuleList named blocks/layers/h."""
    for name in ("blocks", "layers", "h"):
        for module in model.modules():
            child = getattr(module, name, None)
            if isinstance(child, nn.ModuleList):
                return list(child)
    return []


_MESHES: dict[tuple, Any] = {}


def hsdp_mesh(world: World) -> Any:
    """HSDP's (replicate, shard) device mesh of `world`, made once."""
    from torch.distributed.device_mesh import init_device_mesh

    shape = (world.replicate, world.size // world.replicate)
    key = (dist.group.WORLD, world.device.type, shape)  # per process group (`purestep plan` makes several)
    if key not in _MESHES:
        _MESHES[key] = init_device_mesh(world.device.type, shape, mesh_dim_names=("replicate", "shard"))
    return _MESHES[key]


def ep_mesh(world: World) -> dict[str, Any]:
    """Expert parallelism's meshes of `world`, made once: `"ep"` and `"efsdp"`, the dims of an
    (efsdp, ep) mesh (EP groups of `world.ep` consecutive ranks), and `"dp"`, that mesh
    flattened (every rank)."""
    from torch.distributed.device_mesh import init_device_mesh

    from purestep.core import _compat as compat

    shape = (world.size // world.ep, world.ep)
    key = (dist.group.WORLD, world.device.type, shape, "ep")
    if key not in _MESHES:
        mesh = init_device_mesh(world.device.type, shape, mesh_dim_names=("efsdp", "ep"))
        _MESHES[key] = {"ep": mesh["ep"], "efsdp": mesh["efsdp"], "dp": compat.flatten_mesh(mesh, "dp")}
    return _MESHES[key]


def replica_layout(config: Any, world: World) -> tuple[bool, bool]:
    """(the state over HSDP's replicas, FSDP2 within each replica alone) for a `TrainConfig` on
    `world`: either with the state over the replicas or with DiLoCo's workers (the replicas)."""
    local_sgd = config.diloco.sync_every is not None
    hsdp = world.strategy == "hsdp" and world.replicate > 1
    over_replicas = hsdp and config.shard_state_over_replicas and not local_sgd
    return over_replicas, over_replicas or (hsdp and local_sgd)


def wrap(
    model: nn.Module,
    world: World,
    *,
    precision: str = "fp32",
    local_sgd: bool = False,
    replicas_apart: bool = False,
) -> nn.Module:
    """`model` on `world.device` (cast to bf16 for precision "bf16-true"), wrapped for the
    strategy (DDP, or FSDP2 per block then root, over every rank or, for HSDP, over a
    (replicate, shard) mesh; FSDP2 on CUDA casts to bf16 for "bf16"). With tensor
    parallelism the model's `tp_plan(degree)` is applied over the mesh's "tp" dim first
    (for "fsdp+tp", FSDP2 then shards over its "dp" dim; for "hsdp+tp", HSDP over its
    (replicate, shard) dims). With expert parallelism (`world.ep` > 1, under "fsdp") the
    model's `ep_plan(degree)` splits its experts over the (efsdp, ep) mesh's "ep" dim, FSDP2
    shards each experts module over "efsdp" (along a dim "efsdp" divides where an ep rank holds fewer
    experts than "efsdp" has ranks; the model's expert grads are already the mean over its EP group's
    ranks, `Experts`) and the rest over all ranks. `local_sgd` (DiLoCo's workers, under DDP): no grad all-reduce between workers, so no DDP wrapper. `replicas_apart` (HSDP): FSDP2 over the
    mesh's shard dim alone, the replicas' grads left to the update (`ps.make_update`'s
    `shard_state_over_replicas` given `hsdp_mesh(world)`, or DiLoCo's sync)."""
    if precision == "bf16-true" and world.strategy in FSDP:
        raise ValueError(
            f"precision='bf16-true' is not supported with strategy='{world.strategy}'; use precision='bf16'"
        )
    dtype = torch.bfloat16 if precision == "bf16-true" else None
    on_meta = any(p.is_meta for p in model.parameters())  # planned (`purestep plan`): blocks made after wrapping
    model = model.to(dtype=dtype) if on_meta else model.to(world.device, dtype=dtype)
    if world.strategy == "ddp" and not local_sgd:
        ids = [world.device.index] if world.device.type == "cuda" else None
        return nn.parallel.DistributedDataParallel(model, device_ids=ids)
    if world.strategy in TP:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.parallel import parallelize_module

        plan = getattr(model, "tp_plan", None)
        if not callable(plan):
            raise ValueError(
                f"strategy='{world.strategy}' needs a model with a tp_plan(degree) method giving its tensor-parallel "
                f"plan (the built-in GPT has one); {type(model).__name__} has none"
            )
        if world.strategy == "hsdp+tp":  # (replicate, shard, tp): FSDP2 over the first two, HSDP
            shape = (world.replicate, world.dp_size // world.replicate, world.tp)
            mesh = init_device_mesh(world.device.type, shape, mesh_dim_names=("replicate", "shard", "tp"))
        else:
            mesh = init_device_mesh(world.device.type, (world.dp_size, world.tp), mesh_dim_names=("dp", "tp"))
        parallelize_module(model, mesh["tp"], plan(world.tp))
    experts: list[str] = []
    if world.ep > 1:
        from torch.distributed.tensor.parallel import parallelize_module

        ep_plan = getattr(model, "ep_plan", None)
        if not callable(ep_plan):
            raise ValueError(
                f"ep={world.ep} needs a model with an ep_plan(degree) method giving its expert-parallel plan "
                f"(the built-in GPT with experts has one); {type(model).__name__} has none"
            )
        plan_of = ep_plan(world.ep)
        parallelize_module(model, ep_mesh(world)["ep"], plan_of)
        experts = list(plan_of)
    if world.strategy in FSDP:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
        from torch.distributed.tensor import Shard

        kwargs: dict[str, Any] = {}
        if experts:
            kwargs["mesh"] = ep_mesh(world)["dp"]
        if world.strategy == "hsdp":
            kwargs["mesh"] = hsdp_mesh(world)["shard"] if replicas_apart else hsdp_mesh(world)
        if world.strategy == "fsdp+tp":
            kwargs["mesh"] = mesh["dp"]
        if world.strategy == "hsdp+tp":
            kwargs["mesh"] = mesh["replicate", "shard"]
        if world.device.type == "cuda" and precision in ("bf16", "bf16-mixed"):
            kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        efsdp = world.size // world.ep
        for name in experts:
            module = model.get_submodule(name)
            # Fewer experts on an EP rank than efsdp ranks: FSDP2's chunks of the expert dim would leave them
            # whole on the first rank (49x at 512 ranks): split each along a dim the ranks divide (FSDP2: evenly)
            few = min(local(p).shape[0] for p in module.parameters()) < efsdp
            dim = lambda p: next((d for d in range(1, p.dim()) if p.shape[d] % efsdp == 0), 0)  # noqa: E731
            split = {"shard_placement_fn": lambda p: Shard(dim(p))} if few else {}
            fully_shard(module, **{**kwargs, "mesh": ep_mesh(world)["efsdp"], **split})
        for block in blocks_of(model):
            fully_shard(block, **kwargs)
        fully_shard(model, **kwargs)
    return model


def _workers(world: World) -> tuple[Any, int] | None:
    """DiLoCo's workers: (their process group, their number), None for one. Under DDP every
    rank is one; under HSDP every replica (its ranks' blocks meet their peers' in the other
    replicas: the replicate dim's group)."""
    if world.strategy == "hsdp" and world.replicate > 1:
        return hsdp_mesh(world).get_group("replicate"), world.replicate
    if world.strategy == "ddp" and world.size > 1:
        return dist.group.WORLD, world.size
    return None


def worker_of(world: World) -> tuple[int, int, bool] | None:
    """This rank's DiLoCo worker (`_workers`): (its index, the number of workers, whether this
    rank leads it: writes its checkpoint file), None for one worker. The worker of an HSDP
    rank is its replica (`hsdp_mesh`: rank r is in replica r // shard), led by its first rank."""
    workers = _workers(world)
    if workers is None:
        return None
    if world.strategy == "hsdp":
        shard = world.size // world.replicate
        return world.rank // shard, workers[1], world.rank % shard == 0
    return world.rank, workers[1], True


def worker_mean(world: World) -> Callable[[Any], Any] | None:
    """DiLoCo's `reduce`: the mean of a tree over the workers (`_workers`), one all_reduce per
    leaf (functional collectives: they trace into a compiled step); None for one worker."""
    workers = _workers(world)
    if workers is None:
        return None
    group, n = workers

    def reduce(tree: Any) -> Any:
        import torch.distributed._functional_collectives as fc

        return pytree.tree_map(lambda x: fc.wait_tensor(fc.all_reduce(x, "sum", cast(Any, group))) / n, tree)

    return reduce


def worker_gather(world: World) -> Callable[[Any], Any] | None:
    """DiLoCo's `gather` (SparseLoCo's exchange): every worker's leaves stacked on a new
    leading dim, one all_gather per leaf; None for one worker."""
    workers = _workers(world)
    if workers is None:
        return None
    group = cast(Any, workers[0])

    def gather(tree: Any) -> Any:
        import torch.distributed._functional_collectives as fc

        return pytree.tree_map(lambda x: fc.wait_tensor(fc.all_gather_tensor(x.unsqueeze(0), 0, group)), tree)

    return gather


def unwrap(model: nn.Module) -> nn.Module:
    """The user's module inside a DDP wrapper or a torch.compile wrapper."""
    while True:
        if isinstance(model, nn.parallel.DistributedDataParallel):
            model = cast(nn.Module, model.module)
        elif hasattr(model, "_orig_mod"):
            model = cast(nn.Module, model._orig_mod)
        else:
            return model


def current_world() -> World:
    """The world of the default process group (a world of one without one), for code given no `World`."""
    if dist.is_available() and dist.is_initialized():
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        device = (
            torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
        )
        return World(dist.get_rank(), dist.get_world_size(), local_rank, device, "ddp")
    return World(0, 1, 0, torch.device("cpu"), "single")


# The collectives: every one is a no-op in a world of one, and every rank of a larger world must call it.


def all_reduce_sum(t: Tensor, world: World) -> Tensor:
    """`t` summed over ranks (in place; returned)."""
    if world.size > 1:
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t


def sum_over_rows(t: Tensor, world: World) -> Tensor:
    """`t`, a sum over this rank's batch rows, summed over every row of the global batch: over
    the ranks, each TP group's copy counted once (its ranks computed the same rows)."""
    total = all_reduce_sum(t, world)
    return total / world.tp if world.tp > 1 else total


def all_reduce_max(t: Tensor, world: World) -> Tensor:
    """`t`'s elementwise max over ranks (in place; returned)."""
    if world.size > 1:
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t


def max_over_heads(t: Tensor, world: World) -> Tensor:
    """Each head's max over ranks of `t`, (layers, this rank's heads): without tensor
    parallelism an all-reduce MAX; with it each rank holds its TP group's heads
    `[r·H/tp, (r+1)·H/tp)` (column-parallel q and k split by heads, a TP rank's place in its
    group at rank % tp), so one all_gather puts every group's heads side by side and the max
    runs over the data-parallel ranks: (layers, heads) on every rank."""
    if world.tp == 1:
        return all_reduce_max(t, world)
    got = [torch.empty_like(t) for _ in range(world.size)]
    dist.all_gather(got, t.contiguous())
    layers, local = t.shape
    every = torch.stack(got).view(world.dp_size, world.tp, layers, local).amax(dim=0)  # (tp, layers, local)
    return every.permute(1, 0, 2).reshape(layers, world.tp * local)


def broadcast_object(obj: Any, world: World, group: Any = None) -> Any:
    """Rank 0's `obj` on every rank (over `group`, the default process group if None)."""
    if world.size == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0, group=group)
    return box[0]


def gather_object(obj: Any, world: World, group: Any = None) -> list[Any]:
    """Every rank's `obj`, in rank order, on rank 0 (an empty list elsewhere)."""
    if world.size == 1:
        return [obj]
    out: list[Any] | None = [None] * world.size if world.main else None
    dist.gather_object(obj, out, dst=0, group=group)
    return out if out is not None else []


_SIDE_GROUPS: dict[int, Any] = {}


def side_group(world: World) -> Any:
    """A gloo process group over every rank beside the default one, made once (a collective
    the first time): for collectives a background thread runs while the training loop runs
    its own on the default group (an asynchronous checkpoint's). None in a world of one."""
    if world.size == 1:
        return None
    key = id(dist.distributed_c10d._get_default_group())
    if key not in _SIDE_GROUPS:
        _SIDE_GROUPS.clear()  # a group of an earlier default group is gone with it
        _SIDE_GROUPS[key] = dist.new_group(backend="gloo")
    return _SIDE_GROUPS[key]


def agree(error: str | None, world: World) -> str | None:
    """The first rank's error (a message, or None) on every rank, so that all ranks fail or go on together."""
    if world.size == 1:
        return error
    out: list[Any] = [None] * world.size
    dist.all_gather_object(out, error)
    return next((e for e in out if e is not None), None)


def barrier(world: World) -> None:
    """Wait for every rank."""
    if world.size > 1:
        dist.barrier()


def copy_whole_into_(dst: Tensor, whole: Tensor) -> None:
    """`whole` (a plain tensor of `dst`'s global shape) into `dst`; a DTensor takes its own block."""
    with torch.no_grad():
        if not is_dtensor(dst):
            dst.copy_(whole)
            return
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        d = cast(Any, dst)
        shape, offset = compute_local_shape_and_global_offset(d.shape, d.device_mesh, d.placements)
        local(dst).copy_(whole[tuple(slice(o, o + n) for o, n in zip(offset, shape))])


def copy_into_(dst_tree: Any, src_tree: Any) -> None:
    """Write each leaf of `src_tree` into the same leaf of `dst_tree` (DTensor or plain), no autograd."""
    with torch.no_grad():
        for d, s in zip(pytree.tree_leaves(dst_tree), pytree.tree_leaves(src_tree)):
            if isinstance(d, Tensor) and d is not s:
                local(d).copy_(local(s))
