"""The drop-in adapter, side by side: `purestep.api.Optimizer(params, ps.adamw, ...)` against
torch.optim.AdamW (foreach, fused) on the same params, at ~10M fp32 params in 50 tensors.

    python benchmarks/bench_adapter.py                  # CPU (or CUDA where present)
    python benchmarks/bench_adapter.py --device cuda

Contenders, timed round-robin (warm-up, then the median of `--reps` steps):
- `torch AdamW foreach` / `torch AdamW fused`: `opt.step()` with the grads in `p.grad`.
- `adapter default`: `Optimizer(params, ps.adamw, lr=...)` as constructed with no `compile`
  argument: at this size it compiles (`AUTO_COMPILE_NUMEL`); its first step is timed apart.
- `adapter eager`: the same with `compile=False`.
- `make_update compiled`: `ps.make_update(ps.inject_hyperparams(ps.adamw)(...), compile=True,
  donate=True)`, the update the adapter runs, called on plain tensors without the adapter,
  so the adapter's own overhead shows (`--no-raw` skips it).

Prints ms per step, each contender's time over fused and over foreach, achieved GB/s
against the 28 bytes per param an fp32 AdamW step moves, and the first (compiling) step.
"""

from __future__ import annotations

import argparse
import sys
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
    if raw:
        names = [f"p{i}" for i in range(n)]
        params = dict(zip(names, make_leaves(numel, n, device, seed=0)))
        tree = dict(zip(names, (g.clone() for g in grads)))
        transform = ps.inject_hyperparams(ps.adamw)(LR, betas=BETAS, eps=EPS, weight_decay=WD)  # as the adapter runs it
        state = transform.init(params)
        update = ps.make_update(transform, compile=True, donate=True)
        first["make_update compiled"] = C.first_call(lambda: update(params, tree, state), device)
        fns["make_update compiled"] = lambda: update(params, tree, state)
    return fns, first


def run(numel: int, n: int, device: torch.device, reps: int, raw: bool) -> str:
    fns, first = contenders(numel, n, device, raw)
    t = C.interleaved(fns, device, reps=reps)
    fused, foreach = t["torch AdamW fused"], t["torch AdamW foreach"]
    rows = []
    for name, sec in t.items():
        step1 = f"{first[name]:.1f}" if name in first else ""
        rows.append(
            [name, f"{sec * 1e3:.2f}", f"{sec / fused:.3f}", f"{sec / foreach:.3f}", f"{28 * numel / sec / 1e9:.1f}", step1]
        )
    header = ["contender", "ms / step (median)", "time / fused", "time / foreach", "GB/s (28 B/param)", "first step s"]
    default = "compiled" if numel >= AUTO_COMPILE_NUMEL else "eager"
    out = (
        f"## {numel / 1e6:.0f}M fp32 params in {n} tensors, {reps} timed steps (default path: {default})\n\n"
        + C.table(header, rows)
        + f"\n\nadapter default / fused: {t['adapter default'] / fused:.3f} (target <= 1.05); "
        f"adapter eager / foreach: {t['adapter eager'] / foreach:.3f} (target <= 1)"
    )
    if raw:
        out += f"; adapter default / make_update compiled: {t['adapter default'] / t['make_update compiled']:.3f}"
    print(out + "\n", flush=True)
    return out + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--numel", type=float, default=10e6)
    ap.add_argument("--tensors", type=int, default=50)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--no-raw", action="store_true", help="skip the adapter-less make_update contender")
    ap.add_argument("--no-write", action="store_true", help="print only, write no results file")
    args = ap.parse_args()
    if args.reps < 20:
        ap.error("--reps must be at least 20 (medians of fewer steps are noise on a shared machine)")
    device = torch.device(args.device)
    body = run(int(args.numel), args.tensors, device, args.reps, not args.no_raw)
    if not args.no_write:
        print(C.write_result(f"adapter-{args.numel / 1e6:.0f}M", "Optimizer adapter vs torch.optim.AdamW", device, body))


if __name__ == "__main__":
    main()
