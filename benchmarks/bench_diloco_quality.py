"""DiLoCo's quality against DDP on the demo corpus: 2 workers (2 CPU ranks under torchrun),
the same tokens and steps, 3 seeds, final validation loss side by side (issue 42).

    python benchmarks/bench_diloco_quality.py --out auto     # writes benchmarks/results/<date>-diloco-quality-cpu.md

Every run is the demo's recipe (`purestep.api.cli.demo_config`: the 4-layer byte GPT, batch 16
split over the 2 ranks, warmup + cosine, clipping 1.0, EMA off here) for `--steps` steps under
`strategy = "ddp"`, changed only as each row says: AdamW inside (lr 3e-3), or the demo's
Muon + AdamW; DiLoCo's `[diloco]` section with `sync_every` H, the outer Nesterov SGD of lr 0.7
and momentum 0.9 (the DiLoCo paper's; MuLoCo uses the same outer step). The validation loss is
the Trainer's own evaluation (`eval_batches` fixed batches) at the last step, of the params
(for DiLoCo: each worker's params after the last step's sync or its local steps since, rank 0's).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

RESULTS = Path(__file__).parent / "results"
ADAMW = ["optimizer.name=adamw", "optimizer.lr=0.003", 'optimizer.kwargs={"weight_decay": 0.01}']
RUNS = {  # name -> overrides
    "DDP, AdamW": ADAMW,
    "DiLoCo H=10, AdamW inside": [*ADAMW, "diloco.sync_every=10"],
    "DiLoCo H=50, AdamW inside": [*ADAMW, "diloco.sync_every=50"],
    "DDP, Muon + AdamW": [],
    "MuLoCo H=10 (Muon + AdamW inside)": ["diloco.sync_every=10"],
}
EXTRA = {  # not run by default: the outer step at small H
    "DiLoCo H=10, AdamW inside, outer momentum 0": [*ADAMW, "diloco.sync_every=10", "diloco.outer_momentum=0"],
    "DiLoCo H=10, AdamW inside, outer lr 1, momentum 0": [
        *ADAMW, "diloco.sync_every=10", "diloco.outer_momentum=0", "diloco.outer_lr=1"],
}
DEFAULT = list(RUNS)
RUNS.update(EXTRA)


def worker(out: str, steps: int, overrides: list[str]) -> None:
    """Under torchrun: one run of the demo's recipe with `overrides`."""
    from purestep.api import apply_overrides
    from purestep.api.cli import build_trainer, demo_config

    base = [f"steps={steps}", "strategy=ddp", f"eval_every={steps}", "checkpoint_every=0", "ema_decay=none",
            "spike_factor=0", "log_every=10", "diloco.outer_lr=0.7", "diloco.outer_momentum=0.9"]
    trainer = build_trainer(apply_overrides(demo_config(), [*base, *overrides]), Path(out), progress=False)
    trainer.fit()


def run(name: str, seed: int, steps: int, root: Path) -> float:
    out = root / f"run{list(RUNS).index(name)}-seed{seed}"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", __file__, "--worker",
           str(out), str(steps), f"seed={seed}", *RUNS[name]]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    done = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"{name} seed {seed} failed:\n{done.stdout[-2000:]}{done.stderr[-3000:]}")
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [r["val_loss"] for r in rows if "val_loss" in r][-1]


def main() -> None:
    if sys.argv[1:2] == ["--worker"]:
        return worker(sys.argv[2], int(sys.argv[3]), sys.argv[4:])
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--runs", nargs="+", default=DEFAULT, choices=list(RUNS))
    ap.add_argument("--out", default=None, help="a markdown path, or 'auto'")
    args = ap.parse_args()
    losses: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for seed in args.seeds:  # seed-major: a cut-short run still has every row at some seeds
            for name in args.runs:
                losses.setdefault(name, []).append(run(name, seed, args.steps, Path(tmp)))
                print(f"{name} seed {seed}: {losses[name][-1]:.4f}", flush=True)
    lines = [
        f"# DiLoCo against DDP on the demo corpus ({datetime.date.today()})",
        "",
        f"Machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores; 2 ranks (gloo, CPU), "
        f"OMP_NUM_THREADS=1; Python {platform.python_version()}; torch {__import__('torch').__version__}.",
        "",
        f"Command: `python benchmarks/{Path(__file__).name} {shlex.join(sys.argv[1:])}`",
        "",
        f"The demo's recipe for {args.steps} steps, 2 workers (ranks) of 8 rows a step each, seeds "
        f"{args.seeds}; final validation loss (mean, min..max over seeds), and against the DDP run of "
        "the same inner optimizer.",
        "",
        "| run | val loss (mean) | min..max | per seed | vs DDP |",
        "|---|---|---|---|---|",
    ]
    for name, vals in losses.items():
        base = losses.get("DDP, Muon + AdamW" if "Muon" in name else "DDP, AdamW")  # the same inner optimizer
        delta = f"{(statistics.mean(vals) / statistics.mean(base) - 1) * 100:+.1f}%" if base else "n/a"
        lines.append(f"| {name} | {statistics.mean(vals):.4f} | {min(vals):.4f}..{max(vals):.4f} | "
                     f"{', '.join(f'{v:.4f}' for v in vals)} | {delta} |")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        path = RESULTS / f"{datetime.date.today()}-diloco-quality-cpu.md" if args.out == "auto" else Path(args.out)
        path.write_text(text)


if __name__ == "__main__":
    main()
