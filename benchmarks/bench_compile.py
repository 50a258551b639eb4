"""Cold compile time against the number of tensors: purestep's compiled donated AdamW
(`ps.make_update`, flat buffers; and the per-leaf path with `flat=False`) against the
compiled torch.optim recipe (`torch.compile(AdamW(capturable=True).step)`).

    python benchmarks/bench_compile.py                     # 25, 100, 200 tensors, 10M params
    python benchmarks/bench_compile.py --tensors 25,100 --device cpu
    python benchmarks/bench_compile.py --optimizer muon --tensors 24,96 --dim 128  # Muon: 6 matrices a layer

With `--optimizer muon` the params are bench_muon's transformer matrices (6 per layer, 3
shapes) and the peer is `torch.compile(torch.optim.Muon(...).step)`: the flat path stacks
same-shape matrices, so its graph grows with the shapes, not the matrix count.

Each contender is compiled in a fresh dynamo state with inductor's caches disabled, and
the first call (trace + compile + one step) is timed. Targets: at 100 tensors at most half
the recipe's time; from 25 to 200 tensors at most 1.5x growth.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import _common as C  # noqa: E402
import bench_muon  # noqa: E402
from bench_optimizer import BETAS, EPS, LR, WD, make_leaves  # noqa: E402

import purestep.core as ps  # noqa: E402


def muon_trees(n: int, dim: int, device: torch.device) -> tuple[dict, dict]:
    spec = bench_muon.shapes(max(1, n // 6), dim)
    g = torch.Generator().manual_seed(0)
    params = {k: torch.randn(s, generator=g).div_(s[1] ** 0.5).to(device) for k, s in spec.items()}
    return params, {k: torch.randn(s, generator=g).to(device) for k, s in spec.items()}


def ours(numel: int, n: int, device: torch.device, flat: bool, optimizer: str = "adamw", dim: int = 0) -> float:
    if optimizer == "muon":
        params, grads = muon_trees(n, dim, device)
        opt = ps.muon(lr=0.02, weight_decay=0.01)
    else:
        names = [f"p{i}" for i in range(n)]
        params = dict(zip(names, make_leaves(numel, n, device, seed=0)))
        grads = dict(zip(names, make_leaves(numel, n, device, seed=1)))
        opt = ps.adamw(LR, betas=BETAS, eps=EPS, weight_decay=WD)
    state = opt.init(params)
    update = ps.make_update(opt, compile=True, donate=True, flat=flat)
    return C.first_call(lambda: update(params, grads, state), device)


def muon_recipe(n: int, dim: int, device: torch.device) -> float:
    params, grads = muon_trees(n, dim, device)
    tensors = [torch.nn.Parameter(p) for p in params.values()]
    for t, g in zip(tensors, grads.values()):
        t.grad = g
    opt = torch.optim.Muon(tensors, lr=0.02, weight_decay=0.01, momentum=0.95, nesterov=True)
    return C.first_call(torch.compile(opt.step, fullgraph=False), device)


def recipe(numel: int, n: int, device: torch.device) -> float:
    params = [torch.nn.Parameter(t) for t in make_leaves(numel, n, device, seed=0)]
    for p, g in zip(params, make_leaves(numel, n, device, seed=1)):
        p.grad = g
    opt = torch.optim.AdamW(params, lr=torch.tensor(LR), betas=BETAS, eps=EPS, weight_decay=WD, foreach=True, capturable=True)
    return C.first_call(torch.compile(opt.step, fullgraph=False), device)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tensors", default="25,100,200")
    ap.add_argument("--numel", type=float, default=10e6)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--no-leaves", action="store_true", help="skip the per-leaf path (slow to compile)")
    ap.add_argument("--no-write", action="store_true")
    ap.add_argument("--optimizer", default="adamw", choices=["adamw", "muon"])
    ap.add_argument("--dim", type=int, default=128, help="Muon's model width")
    args = ap.parse_args()
    muon = args.optimizer == "muon"
    device = torch.device(args.device)
    counts = [int(x) for x in args.tensors.split(",")]
    rows, firsts = [], {}
    C.warm_compiler(device)
    for n in counts:
        row = {}
        contenders = [("purestep flat", lambda: ours(int(args.numel), n, device, True, args.optimizer, args.dim))]
        if not args.no_leaves:
            contenders.append(("purestep per-leaf", lambda: ours(int(args.numel), n, device, False, args.optimizer, args.dim)))
        if muon:
            contenders.append(("torch compiled recipe", lambda: muon_recipe(n, args.dim, device)))
        else:
            contenders.append(("torch compiled recipe", lambda: recipe(int(args.numel), n, device)))
        for name, fn in contenders:
            torch._dynamo.reset()
            row[name] = fn()
            print(f"{n} tensors, {name}: {row[name]:.1f} s", flush=True)
        firsts[n] = row
        rows.append([str(n)] + [f"{row[k]:.1f}" for k in row] + [f"{row['purestep flat'] / row['torch compiled recipe']:.2f}"])
    names = list(firsts[counts[0]])
    body = C.table(["tensors"] + [f"{k} (s)" for k in names] + ["flat / recipe"], rows)
    if len(counts) > 1:
        growth = firsts[counts[-1]]["purestep flat"] / firsts[counts[0]]["purestep flat"]
        body += f"\n\nflat compile growth {counts[0]} -> {counts[-1]} tensors: {growth:.2f}x (target <= 1.5x)\n"
    print(body)
    if not args.no_write:
        what = f"Muon, {args.dim}-wide layers" if muon else f"AdamW, {args.numel / 1e6:.0f}M params"
        print(C.write_result(f"compile-{args.optimizer}" if muon else "compile", f"Cold compile time vs tensor count ({what})", device, body))


if __name__ == "__main__":
    main()
