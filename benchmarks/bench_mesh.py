"""The optimizer step on a 2-D mesh (HSDP): purestep's sharded path vs torch's AdamW on the same DTensor params.

Run under torchrun, 4 ranks, one thread each (gloo on CPU):

    OMP_NUM_THREADS=1 torchrun --nproc_per_node=4 benchmarks/bench_mesh.py --out auto

The model is `purestep.api.models.GPT` (dim 128, 24 blocks: 5.2M params in 147 tensors),
`fully_shard(block, mesh=mesh)` per block then the root, `mesh` a (replicate 2, shard 2)
`init_device_mesh`. Parts:

- `step`: the optimizer step alone, interleaved medians of `--steps` steps, `--reps` times:
  `apply_if_finite(chain(clip_by_global_norm(1.0), adamw))` through `make_update(compile=True,
  donate=True)` against `clip_grad_norm_` + `AdamW(fused=True)` on the same params, beside the
  bytes the step must move (32 B/param of this rank's shard) at the in-place bandwidth measured
  in the same run; then both run `--check` steps from the same params and grads and the
  largest relative difference of the params is reported.
- `muon`: `muon_adamw(ns_dtype=float32)` on the mesh: the Newton-Schulz FLOPs each rank runs
  (the profiler's matmul FLOPs of one step) against the whole model's in one process, and the
  step time against that one process.
- `replicas`: `make_update(..., shard_state_over_replicas=True)` against the same step with a
  whole state per replica and against torch's clip + fused AdamW: state bytes per rank
  (`ps.state_bytes`), step time, and the bytes handed to collectives across the replicas in one
  forward, backward and step (torch.distributed's collectives counted).
- `collectives`: collectives per step of the compiled clip + AdamW + apply_if_finite step and
  of Muon, at 24 and 6 blocks (they must not grow with the tensor count).
- `tp`: FSDP2 beside tensor parallelism on a (dp 2, tp 2) mesh: the GPT's `tp_plan` (each
  block's q, k, v, gate and up column-parallel, `attn.proj` and `mlp.down` row-parallel) over
  `mesh["tp"]`, then `fully_shard` over `mesh["dp"]` (params on
  two meshes). purestep's step runs on each rank's blocks there (the sharded path; Muon's
  whole matrices on whole DTensors): clip + AdamW + apply_if_finite, and AdamW alone against
  `AdamW(fused=True)` (torch's own `clip_grad_norm_` refuses the mixed meshes), with the
  equality check of AdamW alone. `tp-muon`: `muon` on that layout (each matrix assembled at its
  owner from its row x column blocks).
- `hsdp-tp`, `hsdp-tp-muon` (8 ranks): `tp` and `muon` on torchtitan's 3-D layout, a
  (replicate 2, shard 2, tp 2) mesh: the TP plan over "tp", HSDP over (replicate, shard).
- `ep`: `muon` on the MoE GPT (4 experts per block, 6 blocks) with expert parallelism 2
  beside FSDP2 2 (the Trainer's `ep = 2`): each expert's Newton-Schulz runs once, where it lies.
- `owners`: SOAP and Kron on HSDP 2x2 (6 blocks): each leaf's refit, preconditioner and state
  at its owner (`engine/owners.py`): eigen/QR work, matmul FLOPs and state bytes per rank
  against one process, step time, and the params against one process's.

4 ranks on a 2-core machine oversubscribe it: only ratios measured in one run compare.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

import purestep.core as ps
from purestep.api.models import GPT

sys.path.insert(0, str(Path(__file__).parent))
from bench_fsdp import bandwidth, count_collectives, grads_of, interleaved, recipe  # noqa: E402

RESULTS = Path(__file__).parent / "results"


def build(mesh, n_layers: int = 24, dim: int = 128) -> torch.nn.Module:
    """The GPT, FSDP2 per block then the root over `mesh` (a (replicate, shard) mesh: HSDP; its
    `["shard"]` slice: FSDP2 within each replica alone)."""
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = GPT(dim=dim, n_layers=n_layers, n_heads=4, seq_len=64)
    if mesh is not None:
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
    return model


def purestep_step(mesh, transform: ps.Transform, n_layers: int = 24, over_replicas=False):
    """`over_replicas`: True (HSDP on `mesh`), or "apart" (FSDP2 on mesh["shard"], the update given `mesh`)."""
    model = build(mesh["shard"] if over_replicas == "apart" else mesh, n_layers)
    params = dict(model.named_parameters())
    grads = grads_of(model)
    state = transform.init(params)
    over = mesh if over_replicas == "apart" else over_replicas
    update = ps.make_update(transform, compile=True, donate=True, shard_state_over_replicas=over)
    step = lambda: update(params, grads, state)  # noqa: E731
    step.state = state
    return step, update, model


class Traffic:
    """Bytes of the collectives issued while counting, per process group (torch.distributed's
    collectives wrapped: FSDP2's and purestep's eager ones go through them)."""

    OPS = ("all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor", "all_to_all_single", "all_gather")

    def __init__(self) -> None:
        self.bytes: dict[tuple, int] = {}
        self.on = False
        for name in self.OPS:
            setattr(dist, name, self._wrap(getattr(dist, name), name))

    def _wrap(self, fn, name):
        def counted(*args, **kwargs):
            if self.on:
                group = kwargs.get("group")
                ranks = tuple(dist.get_process_group_ranks(group)) if group is not None else tuple(range(dist.get_world_size()))
                # the bytes this rank sends in a ring over the group's k ranks: an all_reduce of n bytes
                # 2(k-1)/k·n, a reduce_scatter of an n-byte input (k-1)/k·n, an all_gather of an n-byte input (k-1)·n
                t = args[1] if name in ("all_gather_into_tensor", "reduce_scatter_tensor") else args[0]
                n = sum(x.numel() * x.element_size() for x in (t if isinstance(t, list) else [t]))
                k = len(ranks)
                sent = {"all_reduce": 2 * (k - 1) / k * n, "reduce_scatter_tensor": (k - 1) / k * n,
                        "all_gather_into_tensor": (k - 1) * n}.get(name, (k - 1) / k * n)
                self.bytes[(name, ranks)] = self.bytes.get((name, ranks), 0) + sent
            return fn(*args, **kwargs)

        return counted

    def count(self, fn) -> dict:
        self.bytes, self.on = {}, True
        try:
            fn()
        finally:
            self.on = False
        return dict(self.bytes)


TRAFFIC: Traffic | None = None


def against_torch(mesh, ours, ours_model, steps: int) -> float:
    """`steps` of `ours` (clip + AdamW on `ours_model`) and of torch's `clip_grad_norm_` + fused
    AdamW on the same model and grads: the largest relative difference of the params."""
    theirs = build(mesh)
    theirs_grads = grads_of(theirs)
    opt = torch.optim.AdamW(theirs.parameters(), lr=1e-4, weight_decay=0.1, fused=True)
    for _ in range(steps):
        ours()
        for p, g in zip(theirs.parameters(), theirs_grads.values()):
            p.grad = g
        torch.nn.utils.clip_grad_norm_(theirs.parameters(), 1.0)
        opt.step()
    with torch.no_grad():
        return max(float((a.full_tensor() - b.full_tensor()).abs().max() / b.full_tensor().abs().max().clamp(min=1e-12))
                   for a, b in zip(ours_model.parameters(), theirs.parameters()))


def part_replicas(mesh, args) -> list[str]:
    """HSDP 2x2 with the optimizer state sharded across the replicas against the same step with a
    whole copy per replica and against torch's clip_grad_norm_ + AdamW(fused=True): state bytes
    per rank, step time, and the bytes crossing replicas in a training step (forward, backward,
    optimizer step)."""
    global TRAFFIC
    TRAFFIC = TRAFFIC or Traffic()
    over, over_update, over_model = purestep_step(mesh, recipe(), over_replicas=True)
    apart, apart_update, apart_model = purestep_step(mesh, recipe(), over_replicas="apart")
    whole, _, whole_model = purestep_step(mesh, recipe())
    model = build(mesh)
    grads_of(model)
    fused = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1, fused=True)

    def torch_step():
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        fused.step()

    fns = {"purestep, state over the replicas (HSDP)": over,
           "purestep, state over the replicas (FSDP2 per replica, the mesh given)": apart,
           "purestep, a whole state per replica (HSDP)": whole,
           "torch clip_grad_norm_ + AdamW(fused=True) (HSDP)": torch_step}
    medians = [interleaved(fns, args.steps) for _ in range(args.reps)]
    models = dict(zip(fns, (over_model, apart_model, whole_model, model)))

    def train_step(m, fn):
        def go():
            grads_of(m)  # forward and backward: FSDP2's all-gathers, reduce-scatters and, under HSDP, the all-reduce
            fn()
        return go

    trains = {name: train_step(models[name], fn) for name, fn in fns.items()}
    train_medians = [interleaved(trains, max(args.steps // 2, 3)) for _ in range(args.reps)]
    local = lambda x: x._local_tensor if hasattr(x, "_local_tensor") else x  # noqa: E731
    torch_bytes = sum(local(t).numel() * local(t).element_size() for st in fused.state.values() for t in st.values())
    one = ps.state_bytes(recipe().init({k: torch.empty(p.shape) for k, p in model.named_parameters()}))
    sizes = torch.tensor([ps.state_bytes(over.state), ps.state_bytes(apart.state), ps.state_bytes(whole.state),
                          torch_bytes], dtype=torch.float64)
    most = sizes.clone()
    dist.all_reduce(most, op=dist.ReduceOp.MAX)
    replicas = tuple(dist.get_process_group_ranks(mesh.get_group("replicate")))
    traffic = {key: TRAFFIC.count(trains[name]) for key, name in zip(("over", "apart", "whole", "torch"), fns)}
    across = {k: sum(b for (op, ranks), b in t.items() if ranks == replicas) for k, t in traffic.items()}
    ops = {k: sorted({op for (op, ranks), _ in t.items() if ranks == replicas}) for k, t in traffic.items()}
    # Equality with torch from the same params and grads, `--check` steps (the mesh-given form:
    # the same grads in both replicas, so their mean is torch's).
    ours, _, ours_model = purestep_step(mesh, recipe(), over_replicas="apart")
    worst = against_torch(mesh, ours, ours_model, args.check)
    if dist.get_rank() != 0:
        return []
    fused_ms = statistics.median(m[list(fns)[-1]] for m in medians) * 1e3
    fused_train = statistics.median(m[list(fns)[-1]] for m in train_medians) * 1e3
    n = sum(p.numel() for p in model.parameters())
    lines = [
        f"### Optimizer state over HSDP's replicas (2x2), {n / 1e6:.1f}M params",
        "",
        f"`explain()`: {over_update.explain()}",
        "",
        f"`explain()` with the mesh given: {apart_update.explain()}",
        "",
        "| contender | optimizer step ms (spread) | / fused | training step ms (spread) | / fused | state bytes, "
        "largest rank | / one process's | bytes sent across replicas per training step, rank 0 (collectives) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for (name, key), size in zip(zip(fns, ("over", "apart", "whole", "torch")), most.tolist()):
        per_rep = [m[name] * 1e3 for m in medians]
        ms = statistics.median(per_rep)
        train_rep = [m[name] * 1e3 for m in train_medians]
        train = statistics.median(train_rep)
        lines.append(f"| {name} | {ms:.1f} ({min(per_rep):.1f}-{max(per_rep):.1f}) | {ms / fused_ms:.2f} | "
                     f"{train:.1f} ({min(train_rep):.1f}-{max(train_rep):.1f}) | {train / fused_train:.2f} | "
                     f"{size / 1e6:.2f} MB | {size / one:.3f} | {across[key] / 1e6:.2f} MB ({', '.join(ops[key])}) |")
    lines += ["", f"One process holds {one / 1e6:.2f} MB of state. The training step: forward, backward and "
              "optimizer step on a fixed batch. Bytes sent across replicas: the collectives over the replicate group "
              "in one training step, counted as a ring sends them (an all_reduce of n bytes 2(k-1)/k·n per rank, a "
              "reduce_scatter (k-1)/k·n of its input, an all_gather (k-1)·n of its input); under HSDP FSDP2 "
              "all-reduces the grads across the replicas in its backward; with the mesh given, the update's "
              "reduce_scatter and all_gather are all.",
              "", f"Equality after {args.check} steps from the same params and grads (state over the replicas against "
              f"torch): largest relative difference of the params {worst:.2e} (float32).", ""]
    return lines


def part_step(mesh, args) -> list[str]:
    mine, update, _ = purestep_step(mesh, recipe())
    model = build(mesh)
    grads_of(model)
    fused = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1, fused=True)

    def torch_step():
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        fused.step()

    fns = {"purestep clip+AdamW+apply_if_finite, compiled": mine, "torch clip_grad_norm_ + AdamW(fused=True)": torch_step}
    medians = [interleaved(fns, args.steps) for _ in range(args.reps)]
    local = sum(p.to_local().numel() for p in model.parameters())
    bw = bandwidth(4 * local)
    # Equality: both from the same params, the same grads, `--check` steps.
    ours, _, ours_model = purestep_step(mesh, recipe())
    worst = against_torch(mesh, ours, ours_model, args.check)
    if dist.get_rank() != 0:
        return []
    n = sum(p.numel() for p in model.parameters())
    fused_ms = statistics.median(m["torch clip_grad_norm_ + AdamW(fused=True)"] for m in medians) * 1e3
    limit_ms = 32 * local / bw * 1e3
    lines = [
        f"### Step on HSDP 2x2, {n / 1e6:.1f}M params ({len(list(model.parameters()))} tensors), {local / 1e6:.2f}M on rank 0",
        "",
        f"`explain()`: {update.explain()}",
        "",
        f"In-place bandwidth on this rank: {bw / 1e9:.1f} GB/s; 32 B/param of this rank's shard take {limit_ms:.1f} ms at that rate.",
        "",
        "| contender | median ms (spread over reps) | / fused | x the bandwidth limit |",
        "|---|---|---|---|",
    ]
    for name in fns:
        per_rep = [m[name] * 1e3 for m in medians]
        ms = statistics.median(per_rep)
        lines.append(f"| {name} | {ms:.1f} ({min(per_rep):.1f}-{max(per_rep):.1f}) | {ms / fused_ms:.2f} | {ms / limit_ms:.2f} |")
    lines += ["", f"Equality after {args.check} steps from the same params and grads: largest relative difference "
              f"of the params {worst:.2e} (float32).", ""]
    return lines


def _matmul_flops(fn) -> float:
    for _ in range(3):  # warm: the first calls of a compiled step also run the compiler's own matmuls
        fn()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], with_flops=True) as prof:
        fn()
    return float(sum(e.flops or 0 for e in prof.key_averages() if e.key in ("aten::bmm", "aten::baddbmm", "aten::mm", "aten::addmm")))


def part_muon(mesh, args, label: str = "HSDP 2x2", model_fn=None, whole_fn=None) -> list[str]:
    """`whole_fn`: the same model in this process alone (the GPT of `build(None)` by default);
    every rank reads the same batch, so the mesh's grads are the one process's."""
    opt = lambda: ps.muon_adamw(lr=0.02, adamw_lr=1e-3, ns_dtype=torch.float32)  # noqa: E731
    if model_fn is None:
        mine, update, model = purestep_step(mesh, opt())
    else:
        model = model_fn()
        params, grads = dict(model.named_parameters()), grads_of(model)
        state, update = opt().init(params), ps.make_update(opt(), compile=True, donate=True)
        mine = lambda: update(params, grads, state)  # noqa: E731
    flops = torch.tensor([_matmul_flops(mine)])
    every = [torch.zeros(1) for _ in range(dist.get_world_size())]
    dist.all_gather(every, flops)
    times = interleaved({"mesh": mine}, args.steps)
    calls = 3 + 1 + 3 + args.steps  # the mesh step's calls so far (_matmul_flops: 3 warm + 1; interleaved: 3 warm + the timed)
    mesh_params = {k: v.full_tensor() for k, v in model.named_parameters()}
    one_ms = whole_flops = worst = None
    if dist.get_rank() == 0:  # the same update on the whole model, in this process alone
        model = (whole_fn or (lambda: build(None)))()
        params = dict(model.named_parameters())
        grads = grads_of(model)
        state = opt().init(params)
        whole = ps.make_update(opt(), compile=True, donate=True)
        step = lambda: whole(params, grads, state)  # noqa: E731
        whole_flops = _matmul_flops(step)
        import time

        ts = []
        for _ in range(calls - 4):
            t = time.perf_counter()
            step()
            ts.append(time.perf_counter() - t)
        one_ms = statistics.median(ts) * 1e3
        with torch.no_grad():  # both ran `calls` steps from the same params and grads
            worst = max(float((mesh_params[k] - p).abs().max() / p.abs().max().clamp(min=1e-12)) for k, p in params.items())
    dist.barrier()
    if dist.get_rank() != 0:
        return []
    per_rank = [float(f) for f in every]
    n = len(per_rank)
    return [
        f"### Muon on {label} (`muon_adamw(ns_dtype=float32)`, owner-computes over all {n} ranks)",
        "",
        f"`explain()`: {update.explain()}",
        "",
        "| | value |",
        "|---|---|",
        f"| Newton-Schulz (matmul) GFLOPs per rank, ranks 0-{n - 1} | {', '.join(f'{f / 1e9:.3f}' for f in per_rank)} |",
        f"| the whole model's in one process | {whole_flops / 1e9:.3f} |",
        f"| largest rank / whole model | {max(per_rank) / whole_flops:.3f} (target: at most 1/{n} plus one matrix) |",
        f"| step, mesh / one process | {times['mesh'] * 1e3:.1f} ms / {one_ms:.1f} ms = {times['mesh'] * 1e3 / one_ms:.2f}x |",
        f"| params after {calls} steps, mesh vs one process: largest relative difference | {worst:.2e} (target: 1e-6) |",
        "",
    ]


class LinalgWork:
    """The d³ of every eigh and QR (and n·d² of every triangular solve) issued while counting:
    the eigen work SOAP's and Kron's refits do, which the profiler's FLOPs leave out."""

    def __init__(self) -> None:
        self.total, self.on = 0.0, False
        for name, cost in (
            ("eigh", lambda a, *r, **k: a.shape[-1] ** 3),
            ("qr", lambda a, *r, **k: a.shape[-2] * a.shape[-1] ** 2),
            ("solve_triangular", lambda a, b, *r, **k: b.numel() * a.shape[-1]),
        ):
            setattr(torch.linalg, name, self._wrap(getattr(torch.linalg, name), cost))

    def _wrap(self, fn, cost):
        def counted(*args, **kwargs):
            if self.on:
                self.total += float(cost(*args, **kwargs))
            return fn(*args, **kwargs)

        return counted

    def count(self, fn, calls: int) -> tuple[float, float]:
        """(linalg work, profiler matmul FLOPs) of `calls` calls of `fn`."""
        self.total, self.on = 0.0, True
        try:
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], with_flops=True) as prof:
                for _ in range(calls):
                    fn()
        finally:
            self.on = False
        mm = float(
            sum(
                e.flops or 0
                for e in prof.key_averages()
                if e.key in ("aten::bmm", "aten::baddbmm", "aten::mm", "aten::addmm")
            )
        )
        return self.total, mm


def part_owners(mesh, args) -> list[str]:
    """SOAP and Kron on HSDP 2x2 (the GPT at 6 blocks): each leaf's refit, preconditioner and
    state at one rank (engine.owners), against the same update on the whole model in one process."""
    work = LinalgWork()
    cases = {
        "soap(precondition_frequency=2)": lambda: ps.soap(3e-3, precondition_frequency=2),
        "kron(update_prob=1.0)": lambda: ps.kron(1e-3, update_prob=1.0),
    }
    out = [
        "### SOAP and Kron on HSDP 2x2, each leaf's math and state at its owner (6 blocks, 1.4M params)",
        "",
        "Work from the first call (SOAP: the eigenbasis set up, then a QR refresh every 2nd update; Kron: a refit",
        "every update): eigh/QR d³ and triangular solves (`torch.linalg`, counted per call) and the profiler's",
        "matmul FLOPs (projections, Gram matrices, preconditioning), per rank against one process.",
        "",
        "| optimizer | eigen/QR/solve work per rank / one process (target: 1/4 + the largest leaf's share) | matmul FLOPs per rank / one process | state bytes per rank / one process | step, mesh / one process | params after the steps, largest relative difference |",
        "|---|---|---|---|---|---|",
    ]
    calls = 4 + 3 + args.steps  # counted, then interleaved's warm-up and timed calls
    for label, make in cases.items():
        model = build(mesh, n_layers=6)
        params, grads = dict(model.named_parameters()), grads_of(model)
        opt = make()
        state = opt.init(params)
        update = ps.make_update(opt, donate=True)
        step = lambda: update(params, grads, state)  # noqa: E731
        mine = torch.tensor([*work.count(step, 4), float(ps.state_bytes(state))])
        every = [torch.zeros(3) for _ in range(dist.get_world_size())]
        dist.all_gather(every, mine)
        t_mesh = interleaved({"mesh": step}, args.steps)["mesh"]
        mesh_params = {k: v.full_tensor() for k, v in model.named_parameters()}
        if dist.get_rank() == 0:
            alone = build(None, n_layers=6)
            p1, g1 = dict(alone.named_parameters()), grads_of(alone)
            s1 = opt.init(p1)
            one = ps.make_update(opt, donate=True)
            step1 = lambda: one(p1, g1, s1)  # noqa: E731
            whole = [*work.count(step1, 4), float(ps.state_bytes(s1))]
            ts = []
            for _ in range(calls - 4):
                t = time.perf_counter()
                step1()
                ts.append(time.perf_counter() - t)
            t_one = statistics.median(ts[3:])
            with torch.no_grad():
                worst = max(
                    float((mesh_params[k] - p).abs().max() / p.abs().max().clamp(min=1e-12)) for k, p in p1.items()
                )
            ratio = lambda j: ", ".join(f"{float(e[j]) / whole[j]:.3f}" for e in every)  # noqa: E731
            # a leaf's eigen work ~ Σ d³ over its dims (matrices: every dim factored)
            cost = [sum(d**3 for d in p.shape) for p in p1.values() if p.dim() >= 2]
            bound = 1 / len(every) + max(cost) / sum(cost)
            top = max(float(e[0]) for e in every) / whole[0]
            met = "met" if top <= bound else "not met"
            out.append(
                f"| {label} | {ratio(0)} (target {bound:.3f}: {met}) | {ratio(1)} | {ratio(2)} | {t_mesh * 1e3:.0f} ms / {t_one * 1e3:.0f} ms = "
                f"{t_mesh / t_one:.2f}x | {worst:.1e} |"
            )
        dist.barrier()
    out += ["", f"`explain()`: {update.explain()}", ""]
    return out if dist.get_rank() == 0 else []


def build_tp(n_layers: int = 24, dim: int = 128) -> torch.nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import parallelize_module

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(0)
    model = GPT(dim=dim, n_layers=n_layers, n_heads=4, seq_len=64)
    parallelize_module(model, mesh["tp"], model.tp_plan(2))  # torchtitan's plan: q, k, v, gate, up colwise; proj, down rowwise
    for block in model.blocks:
        fully_shard(block, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    return model


def build_hsdp_tp(n_layers: int = 24, dim: int = 128) -> torch.nn.Module:
    """The GPT on 8 ranks' (replicate 2, shard 2, tp 2) mesh: the TP plan over "tp", HSDP over
    (replicate, shard) (torchtitan's 3-D layout, the Trainer's `strategy = "hsdp+tp"`)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import parallelize_module

    mesh = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("replicate", "shard", "tp"))
    torch.manual_seed(0)
    model = GPT(dim=dim, n_layers=n_layers, n_heads=4, seq_len=64)
    parallelize_module(model, mesh["tp"], model.tp_plan(2))
    for block in model.blocks:
        fully_shard(block, mesh=mesh["replicate", "shard"])
    fully_shard(model, mesh=mesh["replicate", "shard"])
    return model


def moe_gpt(n_layers: int = 6, dim: int = 128) -> torch.nn.Module:
    torch.manual_seed(0)
    return GPT(dim=dim, n_layers=n_layers, n_heads=4, seq_len=64, experts=4, top_k=2)


def build_ep() -> torch.nn.Module:
    """The MoE GPT (4 experts per block) on 4 ranks with expert parallelism 2 beside FSDP2 2
    (the Trainer's `ep = 2`: `purestep.api.distributed.wrap`)."""
    from purestep.api import distributed as D

    rank = dist.get_rank()
    return D.wrap(moe_gpt(), D.World(rank, 4, rank, torch.device("cpu"), "fsdp", ep=2))


def part_tp(mesh, args, build=build_tp, label: str = "FSDP2 beside TP on (dp 2, tp 2)") -> list[str]:
    def step_of(transform, n_layers: int = 24):
        model = build(n_layers)
        params, grads = dict(model.named_parameters()), grads_of(model)
        state, update = transform.init(params), ps.make_update(transform, compile=True, donate=True)
        return (lambda: update(params, grads, state)), update, model

    clipped, update, model = step_of(recipe())
    plain, _, _ = step_of(ps.adamw(1e-4, weight_decay=0.1))
    theirs = build()
    grads_of(theirs)
    fused = torch.optim.AdamW(theirs.parameters(), lr=1e-4, weight_decay=0.1, fused=True)
    fns = {"purestep clip+AdamW+apply_if_finite": clipped, "purestep AdamW": plain,
           "torch AdamW(fused=True), no clip (clip_grad_norm_ refuses the meshes)": fused.step}
    medians = [interleaved(fns, args.steps) for _ in range(args.reps)]
    ours, _, ours_model = step_of(ps.adamw(1e-4, weight_decay=0.1))
    ref = build()
    ref_grads = grads_of(ref)
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-4, weight_decay=0.1, fused=True)
    for _ in range(args.check):
        ours()
        for p, g in zip(ref.parameters(), ref_grads.values()):
            p.grad = g
        opt.step()
    with torch.no_grad():
        worst = max(float((a.full_tensor() - b.full_tensor()).abs().max() / b.full_tensor().abs().max().clamp(min=1e-12))
                    for a, b in zip(ours_model.parameters(), ref.parameters()))
    counts = []
    for layers in (24, 6):
        for name, transform in (("clip + AdamW + apply_if_finite", recipe()),
                                ("muon_adamw", ps.muon_adamw(lr=0.02, adamw_lr=1e-3, ns_dtype=torch.float32))):
            fn, _, m = step_of(transform, layers)
            counts.append((name, len(list(m.parameters())), count_collectives(fn)))
    if dist.get_rank() != 0:
        return []
    fused_ms = statistics.median(m[list(fns)[2]] for m in medians) * 1e3
    n = sum(p.numel() for p in model.parameters())
    lines = [f"### {label}, {n / 1e6:.1f}M params ({len(list(model.parameters()))} tensors)", "",
             f"`explain()`: {update.explain()}", "", "| contender | median ms (spread over reps) | / fused |", "|---|---|---|"]
    for name in fns:
        per_rep = [m[name] * 1e3 for m in medians]
        ms = statistics.median(per_rep)
        lines.append(f"| {name} | {ms:.1f} ({min(per_rep):.1f}-{max(per_rep):.1f}) | {ms / fused_ms:.2f} |")
    lines += ["", f"Equality of AdamW alone after {args.check} steps from the same params and grads: largest relative "
              f"difference of the params {worst:.2e} (float32).", "",
              f"Collectives per step on {label} (rank 0, profiler; at 24 and 6 blocks)", "",
              "| step | tensors | collectives |", "|---|---|---|", *[f"| {n} | {t} | {c} |" for n, t, c in counts], ""]
    return lines


def part_collectives(mesh, args) -> list[str]:
    rows = []
    for layers in (24, 6):
        for name, transform in (("clip + AdamW + apply_if_finite", recipe()),
                                ("muon_adamw", ps.muon_adamw(lr=0.02, adamw_lr=1e-3, ns_dtype=torch.float32))):
            fn, _, model = purestep_step(mesh, transform, layers)
            rows.append((name, len(list(model.parameters())), count_collectives(fn)))
    if dist.get_rank() != 0:
        return []
    return ["### Collectives per step on HSDP 2x2 (rank 0, profiler)", "", "| step | tensors | collectives |", "|---|---|---|",
            *[f"| {n} | {t} | {c} |" for n, t, c in rows], ""]


def main() -> None:
    from torch.distributed.device_mesh import init_device_mesh

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--parts", nargs="+", default=["step", "muon", "collectives"],
                    choices=["step", "muon", "collectives", "tp", "tp-muon", "replicas", "ep", "hsdp-tp", "hsdp-tp-muon", "owners"])
    ap.add_argument("--steps", type=int, default=10, help="interleaved steps per repeat (median)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--check", type=int, default=5, help="steps of the equality check")
    ap.add_argument("--out", default=None, help="a markdown path, or 'auto' for benchmarks/results/<date>-mesh-hsdp-cpu.md")
    args = ap.parse_args()
    dist.init_process_group("gloo")
    world = dist.get_world_size()
    eight = {"hsdp-tp", "hsdp-tp-muon"}  # the parts on 8 ranks; every other part on 4
    if world != (8 if set(args.parts) <= eight else 4) or (world == 8 and not set(args.parts) <= eight):
        raise SystemExit("bench_mesh.py runs its hsdp-tp parts on 8 ranks and the others on 4: torchrun --nproc_per_node=N")
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard")) if world == 4 else None
    lines: list[str] = []
    hsdp_tp = "HSDP beside TP on (replicate 2, shard 2, tp 2)"
    for part in args.parts:
        lines += {"step": part_step, "muon": part_muon, "collectives": part_collectives, "tp": part_tp,
                  "replicas": part_replicas, "owners": part_owners,
                  "tp-muon": lambda mesh, args: part_muon(mesh, args, "FSDP+TP 2x2", build_tp),
                  "hsdp-tp": lambda mesh, args: part_tp(mesh, args, build_hsdp_tp, hsdp_tp),
                  "hsdp-tp-muon": lambda mesh, args: part_muon(mesh, args, hsdp_tp, build_hsdp_tp),
                  "ep": lambda mesh, args: part_muon(mesh, args, "EP 2 x FSDP 2 (MoE GPT, 4 experts per block, 6 blocks)",
                                                     build_ep, moe_gpt)}[part](mesh, args)
    if dist.get_rank() == 0:
        head = [
            f"# The step on an HSDP mesh ({datetime.date.today()})",
            "",
            f"Machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, {world} ranks (gloo, CPU, "
            f"oversubscribed: compare ratios of one run), OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')}; "
            f"torch {torch.__version__}, Python {platform.python_version()}; load average {os.getloadavg()[0]:.2f}.",
            "",
            f"Command: `OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')} torchrun --nproc_per_node={world} "
            f"benchmarks/{Path(sys.argv[0]).name} {' '.join(sys.argv[1:])}`",
            "",
        ]
        text = "\n".join(head + lines)
        print(text)
        if args.out:
            path = RESULTS / f"{datetime.date.today()}-mesh-hsdp-cpu.md" if args.out == "auto" else Path(args.out)
            path.write_text(text + "\n")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
