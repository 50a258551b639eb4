"""Cold compile time against the number of tensors: purestep's compiled donated AdamW
(`ps.make_update`, flat buffers; and the per-leaf path with `flat=False`) against the
compiled torch.optim recipe (`torch.compile(AdamW(capturable=True).step)`).

    python benchmarks/bench_compile.py                     # 25, 100, 200 tensors, 10M params
    python benchmarks/bench_compile.py --tensors 25,100 --device cpu

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
from bench_optimizer import BETAS, EPS, LR, WD, make_leaves  # noqa: E402

import purestep.core as ps  # noqa: E402


def ours(numel: int, n: int, device: torch.device, flat: bool) -> float:
    names = [f"p{i}" for i in range(n)]
    params = dict(zip(names, make_leaves(numel, n, device, seed=0)))
    grads = dict(zip(names, make_leaves(numel, n, device, seed=1)))
    opt = ps.adamw(LR, betas=BETAS, eps=EPS, weight_decay=WD)
    state = opt.init(params)
    update = ps.make_update(opt, compile=True, donate=True, flat=flat)
    return C.first_call(lambda: update(params, grads, state), device)


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
    args = ap.parse_args()
    device = torch.device(args.device)
    counts = [int(x) for x in args.tensors.split(",")]
    rows, firsts = [], {}
    for n in counts:
        row = {}
        contenders = [("purestep flat", lambda: ours(int(args.numel), n, device, True))]
        if not args.no_leaves:
            contenders.append(("purestep per-leaf", lambda: ours(int(args.numel), n, device, False)))
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
        print(C.write_result("compile", f"Cold compile time vs tensor count ({args.numel / 1e6:.0f}M params)", device, body))


if __name__ == "__main__":
    main()
