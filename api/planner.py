"""`purestep plan`: a run planned before its cluster exists, on one CPU.

For a config (or the demo) and a world size, each planned rank joins torch's fake process
group as that rank of the world (collectives return at once; nothing is sent), the model is
built on the meta device and wrapped as the Trainer wraps it (FSDP2, HSDP, TP, EP: the
config's strategy and degrees applied to the world), and only this rank's blocks are made
(`to_empty`, about 1/world of the model). The Trainer's update is built from the config and
stepped twice on random grads of those blocks: the first step plans the path, the second is
counted. What it reports:

- bytes per rank of the params, grads, optimizer state and EMA: the largest rank, the mean,
  and the ideal (one whole copy over the ranks), for every rank of the world, read from the
  placements (`ps.bytes_per_rank`) after the step (state over HSDP's replicas re-placed), and
  one row of each tensor (blocks are whole rows: the largest rank may hold up to about a row
  of each tensor more than its even share);
- the collectives of one step on each planned rank, by kind, with the bytes it sends;
- how the update runs (`update.explain()`: the path, and why it was chosen);
- the owners' balance: the whole-matrix work per rank (`ps.owner_work`) of the leaves the
  optimizer computes at their owners (Muon's and NorMuon's hidden matrices, SOAP's and Kron's
  matrices), the largest rank against the mean;
- the seconds each planned rank took.

The planned ranks' values (collectives, the path) are theirs; bytes and work cover every
rank, computed from shapes and placements alone.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections import Counter
from typing import Any, Iterator, Sequence

import torch
import torch.distributed as dist
import torch.utils._pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

import purestep.core as ps

from . import distributed as D
from ._build import trainer_transform
from .config import TrainConfig
from .errors import ConfigError
from .models import build_model

MUON_FAMILY = ("muon", "muon_adamw", "normuon", "normuon_adamw")  # whole-matrix math on hidden matrices
OWNED_FAMILY = ("soap", "kron")  # whole-matrix math and state on every matrix


class _Collectives(TorchDispatchMode):
    """Counts the collectives dispatched inside it while `counting` (functional and c10d ops)
    and the bytes this rank sends with each (its input tensors). It answers the functional
    all_to_all itself with zeros of the shape the rank receives: the fake group fills it by
    repeating the input and fails where a rank receives but sends nothing (an owner whose
    own block of a matrix is empty). The values of a planned step are arbitrary anyway."""

    SKIP = ("wait_tensor", "_wrap_tensor_autograd")

    def __init__(self) -> None:
        super().__init__()
        self.counting = False
        self.calls: Counter[str] = Counter()
        self.bytes: Counter[str] = Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = func.__name__.split(".")[0]
        if self.counting and func.namespace in ("_c10d_functional", "c10d") and name not in self.SKIP:
            kind = name.removesuffix("_").lstrip("_")
            # c10d's gathers, scatters and all-to-alls take (output, input); the rest send their first argument
            sent = (
                args[1]
                if func.namespace == "c10d" and any(k in kind for k in ("gather", "scatter", "alltoall"))
                else args[0]
            )
            self.calls[kind] += 1
            self.bytes[kind] += sum(
                t.numel() * t.element_size() for t in pytree.tree_leaves(sent) if isinstance(t, torch.Tensor)
            )
        if func.namespace == "_c10d_functional" and name == "all_to_all_single":
            x, out_splits = args[0], args[1]
            return x.new_zeros((sum(out_splits), *x.shape[1:]))
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def _fake_rank(rank: int, world: int, per_node: int) -> Iterator[None]:
    """This process as `rank` of a fake world of `world` ranks, `per_node` a node (torchrun's variables set)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    env = {"WORLD_SIZE": str(world), "RANK": str(rank), "LOCAL_RANK": str(rank % per_node),
           "LOCAL_WORLD_SIZE": str(min(per_node, world))}  # fmt: skip
    saved = {k: os.environ.get(k) for k in env}
    if dist.is_initialized():
        raise RuntimeError("purestep plan runs in a process with no process group of its own; one is initialized")
    os.environ.update(env)
    dist.init_process_group("fake", rank=rank, world_size=world, store=FakeStore())
    try:
        yield
    finally:
        dist.destroy_process_group()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _stats(per_rank: list[int], whole: int) -> dict[str, float]:
    world = len(per_rank)
    ideal = whole / world
    return {"max": max(per_rank), "mean": sum(per_rank) / world, "ideal": ideal,
            "max_over_ideal": max(per_rank) / ideal if ideal else 0.0}  # fmt: skip


def _row_bytes(tree: Any) -> int:
    """One row of each tensor of `tree` of a dim or more (the granularity blocks of rows are cut at)."""
    seen: dict[int, int] = {}
    for x in pytree.tree_leaves(tree):
        if isinstance(x, torch.Tensor) and x.dim() and x.shape[0]:
            seen[id(x)] = x.numel() // x.shape[0] * x.element_size()
    return sum(seen.values())


def _whole_bytes(tree: Any) -> int:
    """The bytes of one whole copy of `tree` (each DTensor as its global tensor, each tensor once)."""
    seen: dict[int, int] = {}
    for x in pytree.tree_leaves(tree):
        if isinstance(x, torch.Tensor):
            seen[id(x)] = x.numel() * x.element_size()
    return sum(seen.values())


def _owned_leaves(cfg: TrainConfig, params: dict[str, torch.Tensor]) -> tuple[str, Any] | None:
    """What the optimizer computes at the leaves' owners, and which leaves (`ps.owner_work`'s)."""
    name = cfg.optimizer.name
    if name in ("muon_adamw", "normuon_adamw"):
        labels = ps.muon_labels(params)
        return f"{name}'s hidden matrices", {k: labels[k] == "muon" for k in params}
    if name in MUON_FAMILY:
        return f"{name}'s matrices", None
    if name in OWNED_FAMILY:
        return f"{name}'s leaves", dict.fromkeys(params, True)  # each leaf's step and state at its owner
    return None


def _largest(params: dict[str, torch.Tensor], mask: Any) -> int:
    """The work of the largest single matrix among the owned leaves: no rank can do less than it."""
    costs = [
        p.shape[0] * (p.numel() // p.shape[0]) * min(p.shape[0], p.numel() // p.shape[0])
        for k, p in params.items()
        if p.dim() and p.numel() and (p.dim() >= 2 if mask is None else mask[k])
    ]
    return max(costs, default=0)


def plan_rank(cfg: TrainConfig, world: int, rank: int, per_node: int = 8) -> dict[str, Any]:
    """One rank of `world` planned (see the module docstring): its bytes over every rank, its
    collectives per step, the update's path and the owners' work."""
    start = time.perf_counter()
    with _fake_rank(rank, world, per_node):
        place = D.setup(cfg.strategy, "cpu", replicate=cfg.replicate, tp=cfg.tp, ep=cfg.ep)
        local_sgd = cfg.diloco.sync_every is not None
        over_replicas, apart = D.replica_layout(cfg, place)
        with torch.device("meta"):
            model = build_model(cfg.model)
        module = D.wrap(model, place, precision=cfg.precision, local_sgd=local_sgd, replicas_apart=apart)
        module.to_empty(device="cpu")  # this rank's blocks alone
        gen = torch.Generator().manual_seed(rank)
        params = ps.functional_model(D.unwrap(module))[1]
        with torch.no_grad():
            for p in params.values():
                D.local(p).copy_(torch.randn(D.local(p).shape, generator=gen) * 0.02)
        workers = (D.worker_mean(place), D.worker_gather(place)) if local_sgd else (None, None)
        transform = trainer_transform(cfg, None, params, D.unwrap(module), workers)
        ema = ps.params_ema(cfg.ema_decay, dtype=torch.float32 if cfg.bf16_params else None) if cfg.ema_decay else None
        update = ps.make_update(
            transform,
            donate=True,
            ema=ema,
            metrics=True,
            shard_state_over_replicas=D.hsdp_mesh(place) if over_replicas else False,
        )
        state = transform.init(params)
        averaged = ema[0](params) if ema is not None else None
        grads = {k: torch.zeros_like(p) for k, p in params.items()}
        with torch.no_grad():
            for g in grads.values():
                D.local(g).copy_(torch.randn(D.local(g).shape, generator=gen) * 1e-3)
        step = lambda: update(params, grads, state, *(() if ema is None else (averaged,)))  # noqa: E731
        counted = _Collectives()
        with counted:
            step()  # the path chosen, the state placed
            counted.counting = True
            step()
        owned = _owned_leaves(cfg, params)
        balance = None
        if owned is not None:
            work = ps.owner_work(params, owned[1])
            balance = {"what": owned[0], **_stats(work, sum(work)), "largest_matrix": _largest(params, owned[1])}
        trees = {"params": params, "grads": grads, "optimizer state": state}
        if averaged is not None:
            trees["ema"] = averaged
        report = {
            "rank": rank,
            "explain": update.explain(),
            "collectives": {k: {"calls": counted.calls[k], "bytes": counted.bytes[k]} for k in sorted(counted.calls)},
            "bytes": {
                k: {**_stats(ps.bytes_per_rank(t, world), _whole_bytes(t)), "one_row_each": _row_bytes(t)}
                for k, t in trees.items()
            },
            "owner_work": balance,
            "params": sum(p.numel() for p in params.values()),
            "leaves": len(params),
            "strategy": place.strategy,
            "degrees": {"replicate": place.replicate, "tp": place.tp, "ep": place.ep},
        }
    report["seconds"] = time.perf_counter() - start
    return report


def _planned(cfg: TrainConfig, world: int, rank: int, per_node: int) -> dict[str, Any]:
    """`plan_rank` in a process of its own (what it reports, or the error it met, named)."""
    try:
        return plan_rank(cfg, world, rank, per_node)
    except ConfigError as e:
        return {"error": ("config", e.field, e.message)}
    except ValueError as e:  # the strategy's degrees (`D.setup`), a transform's arguments
        return {"error": ("value", str(e))}


def _in_own_process(cfg: TrainConfig, world: int, rank: int, per_node: int) -> dict[str, Any]:
    """Each rank is planned in a fresh process: torch keeps objects made under one fake
    group (meshes, by equality, not by rank) that the next would reuse as its own."""
    import concurrent.futures
    import multiprocessing

    context = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(max_workers=1, mp_context=context) as pool:
        report = pool.submit(_planned, cfg, world, rank, per_node).result()
    if "error" in report:
        kind, *args = report["error"]
        raise ConfigError(*args) if kind == "config" else ValueError(*args)
    return report


def plan(cfg: TrainConfig, world: int, *, ranks: Sequence[int] | None = None, per_node: int = 8) -> dict[str, Any]:
    """A run of `cfg` over `world` ranks planned as each rank of `ranks` (None: the first and
    the last, whose blocks are the uneven tail): a dict of the report (see the module
    docstring) with one entry per planned rank under "ranks"."""
    if isinstance(world, bool) or not isinstance(world, int) or world < 1:
        raise ConfigError("world", f"{world!r} must be a whole number of ranks >= 1")
    if cfg.optimizer.qk_clip is not None:
        raise ConfigError(
            "optimizer.qk_clip", "a plan runs no forward, and QK-clip reads its max logits; plan without it"
        )
    if cfg.strategy == "single" and world > 1:
        raise ConfigError(
            "strategy", f"'single' runs one rank; plan {world} with --set strategy=fsdp (or hsdp, tp, ...)"
        )
    ranks = sorted({0, world - 1}) if ranks is None else list(ranks)
    for r in ranks:
        if not 0 <= r < world:
            raise ConfigError("ranks", f"rank {r} is not one of the {world} ranks")
    planned = [_in_own_process(cfg, world, r, per_node) for r in ranks]
    first = planned[0]
    return {
        "world": world,
        "strategy": first["strategy"],
        "degrees": first["degrees"],
        "optimizer": cfg.optimizer.name,
        "params": first["params"],
        "leaves": first["leaves"],
        "bytes": first["bytes"],
        "owner_work": first["owner_work"],
        "ranks": [{k: p[k] for k in ("rank", "seconds", "explain", "collectives")} for p in planned],
    }


def _count(n: int) -> str:
    return f"{n / 1e9:.3g}B" if n >= 1e9 else f"{n / 1e6:.3g}M"


def _mb(n: float) -> str:
    return f"{n / 2**20:,.1f} MiB" if n >= 2**20 else f"{n / 2**10:,.1f} KiB"


def format_plan(report: dict[str, Any]) -> str:
    """The report as the command prints it."""
    d = report["degrees"]
    mesh = ", ".join(f"{k} {v}" for k, v in d.items() if v > 1)
    lines = [
        f"purestep plan: {_count(report['params'])} params in {report['leaves']} tensors, {report['optimizer']}, "
        f"strategy {report['strategy']} over {report['world']} ranks" + (f" ({mesh})" if mesh else ""),
        "",
        f"{'bytes per rank':18s} {'largest':>12s} {'mean':>12s} {'whole/ranks':>12s} {'largest/that':>14s}",
    ]
    for name, s in report["bytes"].items():
        lines.append(
            f"{name:18s} {_mb(s['max']):>12s} {_mb(s['mean']):>12s} {_mb(s['ideal']):>12s} {s['max_over_ideal']:>14.2f}"
        )
    w = report["owner_work"]
    if w is not None:
        bound = max(w["mean"], w["largest_matrix"])  # no rank does less than the mean, or than one whole matrix
        lines += ["", f"owners' balance ({w['what']} at their owners, m·n·min(m, n) each): the largest rank "
                  f"{w['max']:.3g}, the mean {w['mean']:.3g}, the largest matrix {w['largest_matrix']:.3g}: "
                  f"{w['max'] / bound if bound else 0:.2f}x the bound max(mean, largest matrix)"]  # fmt: skip
    for r in report["ranks"]:
        calls = ", ".join(f"{k} {v['calls']} x ({_mb(v['bytes'])})" for k, v in r["collectives"].items()) or "none"
        lines += ["", f"rank {r['rank']} (planned in {r['seconds']:.1f} s)", f"  collectives per step: {calls}"]
        lines += ["  " + line for line in r["explain"].splitlines()]
    return "\n".join(lines)
