"""The folded chain, side by side: clip_by_global_norm + adamw + params_ema in one compiled,
donated `make_update`, against torch's separate passes: `clip_grad_norm_` + fused AdamW +
a `_foreach_lerp_` EMA of the params.

    python benchmarks/bench_folded.py                  # 10M fp32 params in 100 tensors
    python benchmarks/bench_folded.py --sizes 10e6,100e6

Bytes per param: the folded chain reads g for the norm (4), then one fused kernel reads
p, g, m, v, ema and writes p, m, v, ema (36): 40. The separate passes: norm (4), in-place
clip of g (8), fused AdamW (28), EMA lerp (12): 52, so 1.3x is the bandwidth bound.
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

MAX_NORM, DECAY = 1.0, 0.999


def run(numel: int, n: int, device: torch.device, reps: int) -> str:
    grads = make_leaves(numel, n, device, seed=1)
    # torch: clip_grad_norm_ scales .grad in place, so keep a pristine copy to restore.
    tparams = [torch.nn.Parameter(t) for t in make_leaves(numel, n, device, seed=0)]
    for p, g in zip(tparams, grads):
        p.grad = g.clone()
    fused = torch.optim.AdamW(tparams, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, fused=True)
    ema_params = [p.detach().clone() for p in tparams]

    def torch_step():
        torch.nn.utils.clip_grad_norm_(tparams, MAX_NORM, foreach=True)
        fused.step()
        with torch.no_grad():
            torch._foreach_lerp_(ema_params, [p.detach() for p in tparams], 1.0 - DECAY)

    names = [f"p{i}" for i in range(n)]
    params = dict(zip(names, make_leaves(numel, n, device, seed=0)))
    gtree = dict(zip(names, grads))
    opt = ps.chain(ps.clip_by_global_norm(MAX_NORM), ps.adamw(LR, betas=BETAS, eps=EPS, weight_decay=WD))
    ema = ps.params_ema(DECAY)
    state, avg = opt.init(params), ema.init(params)
    update = ps.make_update(opt, ema=ema, compile=True, donate=True)
    compile_s = C.first_call(lambda: update(params, gtree, state, avg), device)

    a, b = torch.randn(numel, device=device), torch.randn(numel, device=device)
    fns = {
        "torch clip_grad_norm_ + fused AdamW + _foreach_lerp_ EMA": torch_step,
        "purestep make_update(clip + adamw, ema=)": lambda: update(params, gtree, state, avg),
        "in-place add_ (bandwidth)": lambda: a.add_(b, alpha=1e-3),
    }
    t = C.interleaved(fns, device, reps=reps)
    bw = 12 * numel / t["in-place add_ (bandwidth)"] / 1e9
    bytes_of = {0: 52, 1: 40}
    rows = []
    for i, (name, sec) in enumerate(t.items()):
        if i == 2:
            rows.append([name, f"{sec * 1e3:.2f}", "", "12", f"{bw:.1f}", "1.00"])
            continue
        gbs = bytes_of[i] * numel / sec / 1e9
        rows.append([name, f"{sec * 1e3:.2f}", f"{t[list(t)[0]] / sec:.3f}", str(bytes_of[i]), f"{gbs:.1f}", f"{gbs / bw:.2f}"])
    header = ["contender", "ms / step (median)", "speed-up over torch", "bytes/param", "GB/s", "of add_ bandwidth"]
    speedup = t[list(t)[0]] / t[list(t)[1]]
    out = (
        f"## {numel / 1e6:.0f}M fp32 params in {n} tensors, {reps} timed steps\n\n" + C.table(header, rows)
        + f"\n\nfolded speed-up: {speedup:.3f}x (target >= 1.25x; bytes allow 1.3x); purestep compile: {compile_s:.1f} s\n"
    )
    print(out, flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default="10e6")
    ap.add_argument("--tensors", type=int, default=100)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args()
    device = torch.device(args.device)
    body = "\n".join(run(int(float(s)), args.tensors, device, args.reps) for s in args.sizes.split(","))
    if not args.no_write:
        print(C.write_result("folded-" + "-".join(f"{float(x) / 1e6:.0f}M" for x in args.sizes.split(",")), "Folded clip + AdamW + EMA vs separate passes", device, body))


if __name__ == "__main__":
    main()
