"""The drop-in adapter, side by side: `purestep.api.Optimizer(params, ps.adamw, ...)` against
torch.optim.AdamW (foreach, fused) on the same params, at ~10M fp32 params in 50 tensors.

    python benchmarks/bench_adapter.py                  # CPU (or CUDA where present)
    python benchmarks/bench_adapter.py --device cuda
    python benchmarks/bench_adapter.py --threads 1      # CPU time of one thread: robust on a shared machine

Contenders, timed round-robin (warm-up, then the median of `--reps` steps):
- `torch AdamW foreach` / `torch AdamW fused`: `opt.step()` with the grads in `p.grad`.
- `adapter default`: `Optimizer(params, ps.adamw, lr=...)` as constructed with no `compile`
  argument: at this size it compiles (`AUTO_COMPILE_NUMEL`); its first step is timed apart.
- `adapter eager`: the same with `compile=False`.
- `adapter default, reads state[p]` / `reads all state`: the default adapter, with code that
  reads one param's `step` (`float(opt.state[p]["step"])`) or every entry of `opt.state`
  before each step, as logging or a wrapper optimizer would: what reading costs a step.
- `make_update compiled` / `make_update eager`: `ps.make_update(ps.inject_hyperparams(ps.adamw)(...),
  compile=..., donate=True)`, the update the adapter runs, called on plain tensors without the
  adapter, so the adapter's own overhead shows (`--no-raw` skips them).

Prints ms per step, each contender's time over fused and over foreach, achieved GB/s
against the 28 bytes per param an fp32 AdamW step moves, and the first (compiling) step;
beside them the physical limit, the in-place bandwidth of `a.add_(b)` over as many floats
(12 B/elem) in the same round-robin, and the fraction of it fused and the adapter reach.
On CPU each step is timed twice over, by the wall clock and by the process's CPU time
(`time.process_time`, all its threads), with the minor page faults it took: on a machine
shared with other jobs, `--threads 1` and the CPU-time columns measure the work a step
does rather than how long it waited for a core.
"""

from __future__ import annotations

import argparse
import resource
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import _common as C  # noqa: E402
from bench_optimizer import make_leaves  # noqa: E402

import purestep.core as ps  # noqa: E402
from purestep.api import Optimizer  # noqa: E402
from purestep.api.optimizer import AUTO_COMPILE_NUMEL  # noqa: E402

LR, BETAS, EPS, WD = 1e-3, (0.9, 0.999), 1e-8, 0.01


def contenders(numel: int, n: int, device: torch.device, raw: bool):
    grads = make_leaves(numel, n, device, seed=1)

    def torch_params() -> list[torch.nn.Parameter]:
        params = [torch.nn.Parameter(t) for t in make_leaves(numel, n, device, seed=0)]
        for p, g in zip(params, grads):
            p.grad = g.clone()  # its own: a compiled update re-points the grads it is given
        return params

    fns, first = {}, {}
    for kind in ("foreach", "fused"):
        opt = torch.optim.AdamW(torch_params(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, **{kind: True})
        fns[f"torch AdamW {kind}"] = opt.step
    for name, compile in (("adapter default", None), ("adapter eager", False)):
        opt = Optimizer(torch_params(), ps.adamw, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, compile=compile)
        first[name] = C.first_call(opt.step, device)
        fns[name] = opt.step
    for name, read in (("adapter default, reads state[p]", "one"), ("adapter default, reads all state", "all")):
        opt = Optimizer(torch_params(), ps.adamw, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD)
        p0 = opt.param_groups[0]["params"][0]

        def step(opt=opt, p0=p0, read=read):
            if read == "one":
                float(opt.state[p0]["step"])
            else:
                sum(len(entry) for entry in opt.state.values())
            opt.step()

        first[name] = C.first_call(step, device)
        fns[name] = step
    # The physical limit beside the peers: the in-place bandwidth `a.add_(b)` reaches
    # (12 B/elem) over the same number of floats, timed in the same round-robin.
    a, b = torch.ones(numel, device=device), torch.ones(numel, device=device)
    fns["in-place add_ (bandwidth)"] = lambda: a.add_(b, alpha=1e-3)
    if raw:
        names = [f"p{i}" for i in range(n)]
        transform = ps.inject_hyperparams(ps.adamw)(LR, betas=BETAS, eps=EPS, weight_decay=WD)  # as the adapter runs it
        for name, compile in (("make_update compiled", True), ("make_update eager", False)):
            params = dict(zip(names, make_leaves(numel, n, device, seed=0)))
            tree = dict(zip(names, (g.clone() for g in grads)))
            state = transform.init(params)
            update = ps.make_update(transform, compile=compile, donate=True)
            call = lambda update=update, params=params, tree=tree, state=state: update(params, tree, state)  # noqa: E731
            first[name] = C.first_call(call, device)
            fns[name] = call
    return fns, first


def interleaved(fns: dict, device: torch.device, reps: int, warmup: int = 3) -> dict[str, dict[str, float]]:
    """Per contender, medians over `reps` round-robin steps of wall seconds, CPU seconds
    (`process_time`) and minor page faults (as `C.interleaved`, with CPU time and faults)."""
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    C.sync(device)
    got: dict[str, dict[str, list[float]]] = {k: {"wall": [], "cpu": [], "faults": []} for k in fns}
    for _ in range(reps):
        for name, fn in fns.items():
            C.sync(device)
            faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            wall, cpu = time.perf_counter(), time.process_time()
            fn()
            C.sync(device)
            got[name]["wall"].append(time.perf_counter() - wall)
            got[name]["cpu"].append(time.process_time() - cpu)
            got[name]["faults"].append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults)
    return {k: {m: statistics.median(v) for m, v in d.items()} for k, d in got.items()}


def run(numel: int, n: int, device: torch.device, reps: int, raw: bool) -> str:
    fns, first = contenders(numel, n, device, raw)
    t = interleaved(fns, device, reps)
    clocks = ["wall"] if device.type == "cuda" else ["wall", "cpu"]
    rows = []
    for name, m in t.items():
        row = [name]
        for clock in clocks:
            fused, foreach = t["torch AdamW fused"][clock], t["torch AdamW foreach"][clock]
            row += [f"{m[clock] * 1e3:.2f}", f"{m[clock] / fused:.3f}", f"{m[clock] / foreach:.3f}"]
        moved = 12 if name.startswith("in-place") else 28  # bytes per element
        row += [f"{moved * numel / m['wall'] / 1e9:.1f}"]
        row += [f"{m['faults']:.0f}"] if device.type == "cpu" else []
        row += [f"{first[name]:.1f}" if name in first else ""]
        rows.append(row)
    header = ["contender"]
    for clock in clocks:
        what = "wall" if clock == "wall" else "CPU"
        header += [f"{what} ms / step (median)", f"{what} / fused", f"{what} / foreach"]
    header += ["GB/s (28 B/param; add_ 12 B, wall)"] + (["page faults / step"] if device.type == "cpu" else []) + ["first step s"]
    default = "compiled" if numel >= AUTO_COMPILE_NUMEL else "eager"
    out = f"## {numel / 1e6:.0f}M fp32 params in {n} tensors, {reps} timed steps (default path: {default})\n\n"
    out += C.table(header, rows) + "\n"
    for clock in clocks:
        fused, foreach = t["torch AdamW fused"][clock], t["torch AdamW foreach"][clock]
        out += (
            f"\n{clock}: adapter default / fused: {t['adapter default'][clock] / fused:.3f} (target <= 1.05); "
            f"adapter eager / foreach: {t['adapter eager'][clock] / foreach:.3f} (target <= 1)"
        )
        if raw:
            out += (
                f"; adapter default / make_update compiled: "
                f"{t['adapter default'][clock] / t['make_update compiled'][clock]:.3f}; "
                f"adapter eager / make_update eager: {t['adapter eager'][clock] / t['make_update eager'][clock]:.3f}"
            )
    bw = 12 * numel / t["in-place add_ (bandwidth)"]["wall"]
    out += (
        f"\n\nPhysical limit: in-place `add_` moved {bw / 1e9:.1f} GB/s in this run; an fp32 AdamW step must move "
        f"28 B/param, so at that bandwidth it would take {28 * numel / bw * 1e3:.2f} ms. Of that bound: fused "
        f"{28 * numel / t['torch AdamW fused']['wall'] / bw:.2f}, adapter default "
        f"{28 * numel / t['adapter default']['wall'] / bw:.2f}."
    )
    print(out + "\n", flush=True)
    return out + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--numel", type=float, default=10e6)
    ap.add_argument("--tensors", type=int, default=50)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--no-raw", action="store_true", help="skip the adapter-less make_update contenders")
    ap.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (CPU); default: torch's")
    ap.add_argument("--no-write", action="store_true", help="print only, write no results file")
    args = ap.parse_args()
    if args.reps < 20:
        ap.error("--reps must be at least 20 (medians of fewer steps are noise on a shared machine)")
    device = torch.device(args.device)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    body = run(int(args.numel), args.tensors, device, args.reps, not args.no_raw)
    if not args.no_write:
        print(C.write_result(f"adapter-{args.numel / 1e6:.0f}M", "Optimizer adapter vs torch.optim.AdamW", device, body))


if __name__ == "__main__":
    main()
