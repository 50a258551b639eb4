"""What `apply_if_finite` costs the compiled step in one process: clip + AdamW with and without it.

    python benchmarks/bench_skip.py                 # CPU (CUDA where present), ~5M params in 33 tensors
    python benchmarks/bench_skip.py --threads 1     # one thread: robust on a shared machine

Contenders, `ps.make_update(transform, compile=True, donate=True)` on plain tensors, timed
round-robin (median of `--reps` rounds of `--steps` steps each):

- `clip+AdamW`: `chain(clip_by_global_norm(1.0), adamw(1e-3, weight_decay=0.1))`;
- `clip+AdamW+apply_if_finite`: the same inside `apply_if_finite` (its check is the grads'
  global norm, the value the clip reads: issue 32);
- `clip+AdamW+apply_if_finite, full check`: the same inner transform declared without
  `bounded`, so every float of the new state is checked too (what every inner transform
  paid before);
- `in-place add_ (bandwidth)`: `a.add_(b)` over as many floats (12 B/elem), the physical limit
  beside them: a clip + AdamW step must move 32 B/param (g read twice, p, m, v read and written).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import _common as C  # noqa: E402

import purestep.core as ps  # noqa: E402

SHAPES = [(512, 512)] * 16 + [(512,)] * 16 + [(1024, 1024)]


def inner() -> ps.Transform:
    return ps.chain(ps.clip_by_global_norm(1.0), ps.adamw(1e-3, weight_decay=0.1))


def contenders(device: torch.device) -> dict:
    # The same math on the same flat buffers, declared without `bounded`: apply_if_finite checks the state too.
    hidden = inner()
    unbounded = ps.with_needs(
        ps.Transform(hidden.init, lambda g, s, p=None, **e: hidden.update(g, s, p, **e)),
        ps.Needs(parts=lambda tree: [(hidden, None)]),
    )
    transforms = {
        "clip+AdamW": inner(),
        "clip+AdamW+apply_if_finite": ps.apply_if_finite(inner()),
        "clip+AdamW+apply_if_finite, full check": ps.apply_if_finite(unbounded),
    }
    fns = {}
    for name, t in transforms.items():
        g = torch.Generator(device=device).manual_seed(0)
        params = {f"p{i}": torch.randn(s, generator=g, device=device) for i, s in enumerate(SHAPES)}
        grads = {k: torch.randn(v.shape, generator=g, device=device) * 1e-2 for k, v in params.items()}
        state = t.init(params)
        update = ps.make_update(t, compile=True, donate=True, flat=True)
        fns[name] = (lambda update=update, p=params, g=grads, s=state: update(p, g, s)), update
    return fns


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--steps", type=int, default=10, help="steps per round")
    ap.add_argument("--reps", type=int, default=7, help="rounds (the spread is over them)")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args()
    device = torch.device(args.device)
    if args.threads:
        torch.set_num_threads(args.threads)
    runs = contenders(device)
    n = sum(torch.Size(s).numel() for s in SHAPES)
    a, b = torch.ones(n, device=device), torch.ones(n, device=device)
    fns = {k: f for k, (f, _) in runs.items()}
    fns["in-place add_ (bandwidth)"] = lambda: a.add_(b, alpha=1e-3)
    for fn in fns.values():
        for _ in range(3):
            fn()
    rounds: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(args.reps):
        for name, fn in fns.items():
            C.sync(device)
            t = time.perf_counter()
            for _ in range(args.steps):
                fn()
            C.sync(device)
            rounds[name].append((time.perf_counter() - t) / args.steps * 1e3)
    med = {k: statistics.median(v) for k, v in rounds.items()}
    base = med["clip+AdamW"]
    limit = 32 * n / (12 * n / (med["in-place add_ (bandwidth)"] / 1e3)) * 1e3  # ms at the add_ bandwidth
    rows = []
    for name, v in rounds.items():
        path = runs[name][1].explain().split(":")[0] if name in runs else ""
        extra = [f"{med[name] / limit:.2f}"] if name in runs else [""]
        rows.append([name, f"{med[name]:.2f} ({min(v):.2f}-{max(v):.2f})", f"{med[name] / base:.3f}", *extra, path])
    body = (
        f"## {n / 1e6:.1f}M fp32 params in {len(SHAPES)} tensors, {args.reps} rounds of {args.steps} steps\n\n"
        + C.table(["contender", "ms / step, median (spread over rounds)", "/ clip+AdamW", "x the bandwidth limit", "path"], rows)
        + f"\n\nPhysical limit: in-place `add_` moved {12 * n / med['in-place add_ (bandwidth)'] / 1e6:.1f} GB/s; a clip + "
        f"AdamW step must move 32 B/param, {limit:.2f} ms at that rate. apply_if_finite costs "
        f"{(med['clip+AdamW+apply_if_finite'] / base - 1) * 100:+.0f}% of the clip+AdamW step (target <= +10%); "
        f"checking the new state too, {(med['clip+AdamW+apply_if_finite, full check'] / base - 1) * 100:+.0f}%.\n"
    )
    print(body, flush=True)
    if not args.no_write:
        print(C.write_result("skip", "apply_if_finite's cost in the compiled step", device, body))


if __name__ == "__main__":
    main()
