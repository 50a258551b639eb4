"""The optimizer step under FSDP2: purestep's sharded path vs torch's AdamW on the same DTensor params.

Run under torchrun, one thread per rank (gloo on CPU, NCCL on CUDA):

    OMP_NUM_THREADS=1 torchrun --nproc_per_node=2 benchmarks/bench_fsdp.py --size 5M --out auto

The model is `purestep.api.models.GPT` with 24 blocks (147 parameter tensors), `fully_shard`
per block then the root; dim 128 gives 5.2M params, dim 384 42.7M. Parts:

- `step`: the optimizer step alone, medians of `--steps` interleaved steps, `--reps` times:
  purestep `apply_if_finite(chain(clip_by_global_norm(1.0), adamw))` through
  `make_update(compile=True, donate=True)` and without compile, the same without
  `apply_if_finite`, against `clip_grad_norm_` + `AdamW(fused=True)` and `(foreach=True)`;
  the bytes a step must move (32 B/param: p, m, v read and written, g read twice: clip and
  step) against the in-place bandwidth measured in the same run (`mul_`: 8 B/elem).
- `muon`: `ps.muon_adamw(ns_dtype=float32)` on FSDP2 (owner-computes) vs the same update on
  the whole model in one process (rank 0 alone, the other rank idle: one thread each) vs
  `torch.optim.Muon` on the DTensor matrices + `AdamW(fused=True)` for the rest.
- `normuon`: `ps.normuon_adamw(ns_dtype=float32)` on FSDP2, owner-computes (compiled and
  eager), against the per-leaf DTensor path (`flat=False`, what NorMuon ran before its
  per-row state was laid out over shards) and the same update in one process.
- `collectives`: collectives per step of each purestep step, counted with the profiler,
  at two model sizes (24 and 6 blocks) to show it does not grow with the tensor count.
- `trainer`: the Trainer end to end (forward, backward, step) under FSDP2 vs a plain FSDP2
  loop with fused AdamW on the same model and batches: tokens/s.

Each purestep contender owns its model (built from the same seed): the sharded path moves
the params' storage into its flat buffers, so two of them on one model would rebind on
every call. The torch contenders share one model.
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

RESULTS = Path(__file__).parent / "results"
SIZES = {"5M": 128, "43M": 384}


def build(dim: int, n_layers: int = 24, sharded: bool = True) -> torch.nn.Module:
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = GPT(dim=dim, n_layers=n_layers, n_heads=4, seq_len=64)
    if sharded:
        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
    return model


def grads_of(model: torch.nn.Module) -> dict:
    """One forward/backward on a fixed batch; the grads are kept and reused by every step."""
    x = torch.randint(0, 256, (4, 64), generator=torch.Generator().manual_seed(1))
    model(x).float().logsumexp(-1).mean().backward()
    return {k: p.grad for k, p in model.named_parameters()}


def recipe(clip_and_skip: bool = True) -> ps.Transform:
    opt = ps.chain(ps.clip_by_global_norm(1.0), ps.adamw(1e-4, weight_decay=0.1))
    return ps.apply_if_finite(opt) if clip_and_skip else opt


def purestep_step(dim: int, transform: ps.Transform, compile: bool, n_layers: int = 24, flat: bool = True):
    model = build(dim, n_layers)
    params = dict(model.named_parameters())
    grads = grads_of(model)
    state = transform.init(params)
    update = ps.make_update(transform, compile=compile, donate=True, flat=flat)
    return (lambda: update(params, grads, state)), update


def barrier_timed(fn) -> float:
    dist.barrier()
    t = time.perf_counter()
    fn()
    dist.barrier()
    return time.perf_counter() - t


def interleaved(fns: dict, steps: int, warmup: int = 3) -> dict[str, float]:
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    times = {k: [] for k in fns}
    for _ in range(steps):
        for name, fn in fns.items():
            times[name].append(barrier_timed(fn))
    return {k: statistics.median(v) for k, v in times.items()}


def bandwidth(numel: int) -> float:
    """In-place bytes per second of this rank: `mul_` over `numel` float32 (8 B/elem)."""
    x = torch.ones(numel)
    x.mul_(1.0)
    t = time.perf_counter()
    for _ in range(5):
        x.mul_(1.0)
    return 8 * numel * 5 / (time.perf_counter() - t)


def count_collectives(fn) -> int:
    """Collectives one call of `fn` issues on this rank (profiler events of c10d ops)."""
    fn()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn()
    names = ("all_reduce", "all_to_all", "all_gather", "reduce_scatter", "broadcast")
    return sum(1 for e in prof.events() if "c10d" in e.name and any(n in e.name for n in names) and "wait" not in e.name)


def part_step(dim: int, args) -> list[str]:
    rank = dist.get_rank()
    runs = {
        "purestep clip+AdamW+apply_if_finite, compiled": purestep_step(dim, recipe(), True),
        "purestep clip+AdamW+apply_if_finite, eager": purestep_step(dim, recipe(), False),
        "purestep clip+AdamW, compiled": purestep_step(dim, recipe(False), True),
    }
    fns = {k: f for k, (f, _) in runs.items()}
    model = build(dim)
    grads_of(model)
    fused = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1, fused=True)
    foreach = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1, foreach=True)

    def torch_step(opt):
        def step():
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
        return step

    fns["torch clip_grad_norm_ + AdamW(fused=True)"] = torch_step(fused)
    fns["torch clip_grad_norm_ + AdamW(foreach=True)"] = torch_step(foreach)
    medians = [interleaved(fns, args.steps) for _ in range(args.reps)]
    local = sum(p.to_local().numel() for p in model.parameters())
    bw = bandwidth(4 * local)  # a buffer the size of the step's working set (p, g, m, v)
    if rank != 0:
        return []
    n = sum(p.numel() for p in model.parameters())
    fused_ms = statistics.median(m["torch clip_grad_norm_ + AdamW(fused=True)"] for m in medians) * 1e3
    foreach_ms = statistics.median(m["torch clip_grad_norm_ + AdamW(foreach=True)"] for m in medians) * 1e3
    limit_ms = 32 * local / bw * 1e3
    lines = [
        f"### Step, {n / 1e6:.1f}M params ({len(list(model.parameters()))} tensors), {local / 1e6:.2f}M on rank 0",
        "",
        f"In-place bandwidth on this rank: {bw / 1e9:.1f} GB/s; the bytes a clip + AdamW step must move "
        f"(32 B/param) take {limit_ms:.1f} ms at that rate.",
        "",
        "| contender | median ms (spread over reps) | / fused | / foreach | x the bandwidth limit | path |",
        "|---|---|---|---|---|---|",
    ]
    for name in fns:
        per_rep = [m[name] * 1e3 for m in medians]
        ms = statistics.median(per_rep)
        path = runs[name][1].explain().split(":")[0] if name in runs else ""
        lines.append(
            f"| {name} | {ms:.1f} ({min(per_rep):.1f}-{max(per_rep):.1f}) | {ms / fused_ms:.2f} | {ms / foreach_ms:.2f} | "
            f"{ms / limit_ms:.2f} | {path} |"
        )
    return lines + [""]


def part_muon(dim: int, args) -> list[str]:
    rank = dist.get_rank()
    transform = ps.muon_adamw(lr=0.02, adamw_lr=3e-4, ns_dtype=torch.float32)
    sharded, update = purestep_step(dim, transform, True)
    model = build(dim)
    grads_of(model)
    matrices = [p for n, p in model.named_parameters() if ps.muon_labels({n: p})[n] == "muon"]
    rest = [p for n, p in model.named_parameters() if ps.muon_labels({n: p})[n] != "muon"]
    muon = torch.optim.Muon(matrices, lr=0.02, adjust_lr_fn="original")
    adamw = torch.optim.AdamW(rest, lr=3e-4, fused=True)

    def torch_step():
        muon.step()
        adamw.step()

    medians = [interleaved({"sharded": sharded, "torch": torch_step}, args.steps) for _ in range(args.reps)]
    # The same update on the whole model in one process: rank 0 alone, the other rank waits.
    whole_ms: list[float] = []
    if rank == 0:
        plain = build(dim, sharded=False)
        params = dict(plain.named_parameters())
        grads = grads_of(plain)
        state = transform.init(params)
        one = ps.make_update(transform, compile=True, donate=True)
        for _ in range(3):
            one(params, grads, state)
        for _ in range(args.reps):
            ts = []
            for _ in range(args.steps):
                t = time.perf_counter()
                one(params, grads, state)
                ts.append(time.perf_counter() - t)
            whole_ms.append(statistics.median(ts) * 1e3)
    dist.barrier()
    if rank != 0:
        return []
    ours = statistics.median(m["sharded"] for m in medians) * 1e3
    theirs = statistics.median(m["torch"] for m in medians) * 1e3
    one_ms = statistics.median(whole_ms)
    return [
        f"### Muon (`muon_adamw(ns_dtype=float32)`), {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M params, "
        f"{len(matrices)} matrices",
        "",
        "| contender | median ms (spread) | / one process |",
        "|---|---|---|",
        f"| purestep on FSDP2, 2 ranks (owner-computes) | {ours:.1f} ({min(m['sharded'] for m in medians) * 1e3:.1f}-"
        f"{max(m['sharded'] for m in medians) * 1e3:.1f}) | {ours / one_ms:.2f} |",
        f"| purestep, the whole model in one process (1 thread) | {one_ms:.1f} ({min(whole_ms):.1f}-{max(whole_ms):.1f}) | 1.00 |",
        f"| torch.optim.Muon + AdamW(fused) on the DTensors, 2 ranks | {theirs:.1f} | {theirs / one_ms:.2f} |",
        "",
        f"Path: {update.explain()}.",
        "",
    ]


def part_normuon(dim: int, args) -> list[str]:
    """NorMuon on FSDP2: owner-computes (compiled and eager) against the per-leaf DTensor
    path it took before its per-row state was laid out over shards (every matrix's
    Newton-Schulz on whole DTensors, `flat=False`), and the whole model in one process."""
    rank = dist.get_rank()
    transform = ps.normuon_adamw(lr=0.02, adamw_lr=3e-4, ns_dtype=torch.float32)
    compiled, update = purestep_step(dim, transform, True)
    eager, _ = purestep_step(dim, transform, False)
    per_leaf, fallback = purestep_step(dim, transform, False, flat=False)
    medians = [interleaved({"compiled": compiled, "eager": eager, "per-leaf": per_leaf}, args.steps) for _ in range(args.reps)]
    whole_ms: list[float] = []
    if rank == 0:
        plain = build(dim, sharded=False)
        params = dict(plain.named_parameters())
        grads = grads_of(plain)
        state = transform.init(params)
        one = ps.make_update(transform, compile=True, donate=True)
        for _ in range(3):
            one(params, grads, state)
        for _ in range(args.reps):
            ts = []
            for _ in range(args.steps):
                t = time.perf_counter()
                one(params, grads, state)
                ts.append(time.perf_counter() - t)
            whole_ms.append(statistics.median(ts) * 1e3)
    dist.barrier()
    if rank != 0:
        return []
    one_ms = statistics.median(whole_ms)
    row = lambda k: (statistics.median(m[k] for m in medians) * 1e3, min(m[k] for m in medians) * 1e3,  # noqa: E731
                     max(m[k] for m in medians) * 1e3)
    lines = [f"### NorMuon (`normuon_adamw(ns_dtype=float32)`), {sum(p.numel() for p in plain.parameters()) / 1e6:.1f}M params", "",
             "| contender | median ms (spread) | / one process |", "|---|---|---|"]
    for key, what in (("compiled", "purestep on FSDP2, 2 ranks, owner-computes, compiled"),
                      ("eager", "purestep on FSDP2, 2 ranks, owner-computes, eager"),
                      ("per-leaf", "purestep on FSDP2, 2 ranks, per-leaf DTensor (`flat=False`: the path before)")):
        med, lo, hi = row(key)
        lines.append(f"| {what} | {med:.1f} ({lo:.1f}-{hi:.1f}) | {med / one_ms:.2f} |")
    lines += [f"| purestep, the whole model in one process (1 thread) | {one_ms:.1f} ({min(whole_ms):.1f}-{max(whole_ms):.1f}) | 1.00 |",
              "", f"Paths: {update.explain()}; {fallback.explain()}.", ""]
    return lines


def part_collectives(args) -> list[str]:
    rows = []
    for n_layers in (24, 6):
        for name, transform in (
            ("clip+AdamW+apply_if_finite", recipe()),
            ("lamb", ps.lamb(1e-3, weight_decay=0.1)),
            ("muon_adamw", ps.muon_adamw(lr=0.02, adamw_lr=3e-4, ns_dtype=torch.float32)),
        ):
            fn, _ = purestep_step(SIZES["5M"], transform, True, n_layers)
            fn()
            rows.append((name, n_layers, 3 + 6 * n_layers, count_collectives(fn)))
    if dist.get_rank() != 0:
        return []
    lines = ["### Collectives per step (compiled, sharded path)", "", "| transform | tensors | collectives |", "|---|---|---|"]
    lines += [f"| {name} | {tensors} | {count} |" for name, _, tensors, count in rows]
    return lines + [""]


class _Stream:
    """An endless iterable the Trainer may open again (each pass starts over)."""

    def __init__(self, make) -> None:
        self.make = make

    def __iter__(self):
        return self.make()


def part_trainer(dim: int, args) -> list[str]:
    from purestep.api import Trainer
    from purestep.api.config import OptimizerConfig, TrainConfig

    rank, world = dist.get_rank(), dist.get_world_size()
    batch, seq = 8, 64
    data = torch.randint(0, 256, (64, batch, seq + 1), generator=torch.Generator().manual_seed(0))

    def batches():
        i = 0
        while True:
            b = data[i % len(data)]
            yield (b[rank::world, :-1], b[rank::world, 1:])
            i += 1

    def lm_loss(model, b):
        x, y = b
        return torch.nn.functional.cross_entropy(model(x).flatten(0, 1).float(), y.flatten())

    # The plain FSDP2 loop with torch's fused AdamW (the model compiled when the Trainer's is).
    model = build(dim)
    forward = torch.compile(model) if args.compile else model
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1, fused=True)
    it = batches()

    def plain():
        loss = lm_loss(forward, next(it))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=False)

    from purestep.api.data import train_batches

    cfg = TrainConfig(strategy="fsdp", steps=10**6, batch_size=batch, log_every=10**6, compile=args.compile,
                      optimizer=OptimizerConfig(clip_grad_norm=None))
    # The same GPT, transform and batches; the Trainer wraps the model in FSDP2 itself.
    torch.manual_seed(0)
    trainer = Trainer(GPT(dim=dim, n_layers=24, n_heads=4, seq_len=seq), recipe(False), lm_loss, cfg,
                      data=_Stream(batches), progress=False)
    trainer.batches = train_batches(trainer.data, 0, rank, world)
    fns = {"Trainer.train_step (FSDP2, purestep sharded step)": trainer.train_step, "plain FSDP2 loop, fused AdamW": plain}
    medians = [interleaved(fns, args.steps) for _ in range(args.reps)]
    if rank != 0:
        return []
    tokens = batch * seq
    how = "model and update compiled" if args.compile else "eager"
    lines = [f"### End to end: forward, backward, step ({how}, {batch}x{seq} tokens a step)", "",
             "| loop | tokens/s (spread) | / plain |", "|---|---|---|"]
    base = statistics.median(tokens / m["plain FSDP2 loop, fused AdamW"] for m in medians)
    for name in fns:
        per = [tokens / m[name] for m in medians]
        lines.append(f"| {name} | {statistics.median(per):.0f} ({min(per):.0f}-{max(per):.0f}) | {statistics.median(per) / base:.2f} |")
    return lines + [""]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size", choices=sorted(SIZES), default="5M")
    ap.add_argument("--parts", nargs="+", default=["step", "muon", "normuon", "collectives", "trainer"],
                    choices=["step", "muon", "normuon", "collectives", "trainer"])
    ap.add_argument("--steps", type=int, default=20, help="interleaved steps per repeat (median)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--compile", action="store_true", help="trainer part: compile the model (both loops) and the update")
    ap.add_argument("--out", default=None, help="a markdown path, or 'auto' for benchmarks/results/<date>-fsdp-<size>-cpu.md")
    args = ap.parse_args()
    if args.steps < 1 or args.reps < 1:
        ap.error("--steps and --reps must be >= 1")
    dist.init_process_group("gloo")
    dim = SIZES[args.size]
    lines: list[str] = []
    for part in args.parts:
        lines += {"step": lambda: part_step(dim, args), "muon": lambda: part_muon(dim, args),
                  "normuon": lambda: part_normuon(dim, args),
                  "collectives": lambda: part_collectives(args), "trainer": lambda: part_trainer(dim, args)}[part]()
    if dist.get_rank() == 0:
        head = [
            f"# FSDP2 step, {args.size} ({datetime.date.today()})",
            "",
            f"Machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, {dist.get_world_size()} ranks "
            f"(gloo, CPU), OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')}; torch {torch.__version__}, Python "
            f"{platform.python_version()}; load average {os.getloadavg()[0]:.2f}.",
            "",
            f"Command: `OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')} torchrun --nproc_per_node={dist.get_world_size()} "
            f"benchmarks/{Path(sys.argv[0]).name} {' '.join(sys.argv[1:])}`",
            "",
        ]
        text = "\n".join(head + lines)
        print(text)
        if args.out:
            tag = "-compiled" if args.compile and "trainer" in args.parts else ""
            path = RESULTS / f"{datetime.date.today()}-fsdp-{args.size}{tag}-cpu.md" if args.out == "auto" else Path(args.out)
            path.write_text(text + "\n")
    dist.barrier()  # no rank leaves while another still talks to it (gloo aborts at exit otherwise)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
