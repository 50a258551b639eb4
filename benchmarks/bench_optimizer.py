"""Optimizer step, side by side: purestep's compiled donated AdamW against torch.optim.AdamW
(foreach, fused, compiled recipe) and heavyball's AdamW, at ~10M and ~100M fp32 params.

    python benchmarks/bench_optimizer.py                 # 10M and 100M params (100M takes minutes)
    python benchmarks/bench_optimizer.py --sizes 10e6    # 10M only

Prints ms per step, the ratio to fused torch AdamW, achieved GB/s against the 28 bytes
per param an fp32 AdamW step must move (read p, g, m, v; write p, m, v), that as a
fraction of the in-place bandwidth `a.add_(b, alpha=c)` reaches in the same run
(12 bytes per element), and compile time (first call) of the compiled contenders.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import _common as C  # noqa: E402

import purestep.core as ps  # noqa: E402

LR, BETAS, EPS, WD = 1e-3, (0.9, 0.999), 1e-8, 0.01


def make_leaves(numel: int, n: int, device: torch.device, seed: int) -> list[torch.Tensor]:
    """`n` tensors of mixed 2-D shapes totalling about `numel` elements."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    per = numel // n
    shapes = []
    for i in range(n):
        cols = [256, 512, 1024, 64][i % 4]
        shapes.append((max(1, per // cols), cols))
    return [torch.randn(s, generator=g).to(device) for s in shapes]


def contenders(numel: int, n: int, device: torch.device, with_heavyball: bool, with_recipe: bool = True):
    grads = make_leaves(numel, n, device, seed=1)

    def torch_params():
        ps_ = [torch.nn.Parameter(t) for t in make_leaves(numel, n, device, seed=0)]
        for p, g in zip(ps_, grads):
            p.grad = g
        return ps_

    fns, first = {}, {}
    for kind in ("foreach", "fused"):
        opt = torch.optim.AdamW(torch_params(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, **{kind: True})
        fns[f"torch AdamW {kind}"] = opt.step

    # The PyTorch compiled-optimizer recipe: lr as a tensor (so an lr change does not
    # recompile; that needs capturable=True), opt.step under torch.compile.
    if with_recipe:
        recipe = torch.optim.AdamW(
            torch_params(), lr=torch.tensor(LR), betas=BETAS, eps=EPS, weight_decay=WD, foreach=True, capturable=True
        )
        recipe_step = torch.compile(recipe.step, fullgraph=False)
        first["torch AdamW compiled recipe"] = C.first_call(recipe_step, device)
        fns["torch AdamW compiled recipe"] = recipe_step

    if with_heavyball:
        try:
            import heavyball

            hb_params = torch_params()
            hb = heavyball.AdamW(hb_params, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD)

            def hb_step():  # heavyball clears .grad after a step: give it the grads again
                for p, g in zip(hb_params, grads):
                    p.grad = g
                hb.step()

            first["heavyball AdamW"] = C.first_call(hb_step, device)
            fns["heavyball AdamW"] = hb_step
        except Exception as e:  # noqa: BLE001 - optional contender
            print(f"heavyball skipped: {type(e).__name__}: {e}")

    names = [f"p{i}" for i in range(n)]
    params = dict(zip(names, make_leaves(numel, n, device, seed=0)))
    gtree = dict(zip(names, grads))
    opt = ps.adamw(LR, betas=BETAS, eps=EPS, weight_decay=WD)
    state = opt.init(params)
    update = ps.make_update(opt, compile=True, donate=True)
    first["purestep make_update"] = C.first_call(lambda: update(params, gtree, state), device)
    fns["purestep make_update"] = lambda: update(params, gtree, state)

    a, b = torch.randn(numel, device=device), torch.randn(numel, device=device)
    fns["in-place add_ (bandwidth)"] = lambda: a.add_(b, alpha=1e-3)
    return fns, first


def run(numel: int, n: int, device: torch.device, reps: int, with_heavyball: bool, with_recipe: bool = True) -> str:
    fns, first = contenders(numel, n, device, with_heavyball, with_recipe)
    t = C.interleaved(fns, device, reps=reps)
    bw = 12 * numel / t["in-place add_ (bandwidth)"] / 1e9
    fused = t["torch AdamW fused"]
    rows = []
    for name, sec in t.items():
        if name.startswith("in-place"):
            rows.append([name, f"{sec * 1e3:.2f}", "", f"{bw:.1f}", "1.00", ""])
            continue
        gbs = 28 * numel / sec / 1e9
        comp = f"{first[name]:.1f}" if name in first else ""
        rows.append([name, f"{sec * 1e3:.2f}", f"{sec / fused:.3f}", f"{gbs:.1f}", f"{gbs / bw:.2f}", comp])
    header = ["contender", "ms / step (median)", "time / fused", "GB/s (28 B/param)", "of add_ bandwidth", "compile s"]
    out = f"## {numel / 1e6:.0f}M fp32 params in {n} tensors, {reps} timed steps\n\n" + C.table(header, rows)
    out += (
        f"\n\npurestep / fused: {t['purestep make_update'] / fused:.3f}; "
        f"purestep / foreach: {t['purestep make_update'] / t['torch AdamW foreach']:.3f}; "
        f"purestep of add_ bandwidth: {28 * numel / t['purestep make_update'] / 1e9 / bw:.2f}"
    )
    if "torch AdamW compiled recipe" in first:
        out += f"; compile purestep / recipe: {first['purestep make_update'] / first['torch AdamW compiled recipe']:.2f}"
    out += "\n"
    print(out, flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default="10e6,100e6", help="comma-separated param counts")
    ap.add_argument("--tensors", type=int, default=100)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--no-heavyball", action="store_true")
    ap.add_argument("--no-recipe", action="store_true", help="skip the compiled torch recipe (slow to compile)")
    ap.add_argument("--no-write", action="store_true", help="print only, write no results file")
    args = ap.parse_args()
    device = torch.device(args.device)
    body = "\n".join(
        run(int(float(s)), args.tensors, device, args.reps, not args.no_heavyball, not args.no_recipe) for s in args.sizes.split(",")
    )
    if not args.no_write:
        print(C.write_result("optimizer-" + "-".join(f"{float(x) / 1e6:.0f}M" for x in args.sizes.split(",")), "AdamW optimizer step", device, body))


if __name__ == "__main__":
    main()
