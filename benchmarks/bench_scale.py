"""The sharded step at the scale users train, planned on one CPU: `purestep plan` over world
sizes 512 to 16,384 for FSDP, HSDP (state over the replicas), FSDP+TP, HSDP+TP and expert
parallelism.

    python benchmarks/bench_scale.py --out auto                      # the table (an hour or so on 2 cores)
    python benchmarks/bench_scale.py --worlds 4096 16384 --layouts hsdp --out auto

Each cell plans rank 0 of the world (`purestep.api.plan`: torch's fake process group,
the model on meta, this rank's blocks made, the Trainer's update stepped) for the 7B GPT of
`examples/gpt-7b.toml` (EP: its MoE sibling, 8 experts of top-2 per block) with Muon + AdamW
and reports, beside the physical limits:

- optimizer-state bytes per rank: the largest rank against one whole state over the ranks
  (1.00 is the limit), and against the target with the state over HSDP's replicas, 1.05 of it
  plus one row of each state tensor (at most 1.00: met), and the params' (FSDP2's chunks of
  whole rows; under HSDP a copy per replica);
- the owners' balance: Newton-Schulz work of the largest rank against the bound max(mean,
  the largest matrix) (no rank can do less than one whole matrix);
- collectives per step of the planned rank (they must not grow with the layers: the suite's
  tests/api/test_plan.py checks 2 against 8 layers) and the bytes it sends;
- the seconds it took to plan (target: at most 30 s for one rank of 4096).

The numerics at 16 to 256 simulated ranks against one process run in the suite
(tests/core/test_simulated_ranks.py: torch's threaded process group, float64, 1e-12).
"""

from __future__ import annotations

import argparse
import datetime
import platform
import sys
import time
from pathlib import Path

import torch

from purestep.api.config import load_config
from purestep.api.planner import plan

ROOT = Path(__file__).resolve().parent.parent
LAYOUTS = ("fsdp", "hsdp", "fsdp+tp", "hsdp+tp", "ep")


def overrides(layout: str, world: int) -> list[str] | None:
    """The config's strategy and degrees for `layout` on `world` ranks (None: no such layout there)."""
    tp = 8 if world >= 64 else 2
    replicate = max(2, world // 256)
    if layout == "fsdp":
        return ["strategy=fsdp"]
    if layout == "hsdp":
        return ["strategy=hsdp", f"replicate={replicate}"]
    if layout == "fsdp+tp":
        return ["strategy=fsdp+tp", f"tp={tp}"]
    if layout == "hsdp+tp":
        return None if world // tp < 2 * replicate else ["strategy=hsdp+tp", f"tp={tp}", f"replicate={replicate}"]
    return ["strategy=fsdp", f"ep={min(8, world)}", 'model.kwargs={"experts": 8, "top_k": 2}']


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worlds", type=int, nargs="+", default=[512, 4096, 16384])
    parser.add_argument("--ep-worlds", type=int, nargs="+", default=[512, 4096], help="EP's worlds")
    parser.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=LAYOUTS)
    parser.add_argument("--config", type=Path, default=ROOT / "examples" / "gpt-7b.toml")
    parser.add_argument("--out", help="a markdown file for the results ('auto': benchmarks/results/<date>-scale-cpu.md)")
    args = parser.parse_args()
    rows = [
        "| layout | world | mesh | state: largest / (whole/ranks) | state: largest / (1.05 whole/ranks + a row each) | params: largest / (whole/ranks) | "
        "owners: largest / bound | collectives per step (rank 0) | MiB sent | plan s |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    print(rows[0], flush=True)
    for layout in args.layouts:
        for world in args.ep_worlds if layout == "ep" else args.worlds:
            extra = overrides(layout, world)
            if extra is None:
                continue
            try:
                cfg = load_config(args.config, extra)
                start = time.perf_counter()
                report = plan(cfg, world, ranks=[0])
                seconds = time.perf_counter() - start
            except Exception as e:  # a layout this world cannot take: named in its row
                rows.append(f"| {layout} | {world} | {' '.join(extra)} | {type(e).__name__}: {e} | | | | | | |")
                print(rows[-1], flush=True)
                continue
            state, params, work = report["bytes"]["optimizer state"], report["bytes"]["params"], report["owner_work"]
            bound = max(work["mean"], work["largest_matrix"]) if work else 0
            r0 = report["ranks"][0]
            calls = ", ".join(f"{k} {v['calls']}" for k, v in r0["collectives"].items())
            sent = sum(v["bytes"] for v in r0["collectives"].values()) / 2**20
            degrees = ", ".join(f"{k} {v}" for k, v in report["degrees"].items() if v > 1) or "-"
            target = state["max"] / (1.05 * state["ideal"] + state["one_row_each"])
            rows.append(
                f"| {layout} | {world} | {degrees} | {state['max_over_ideal']:.3f} | {target:.3f} | {params['max_over_ideal']:.3f} | "
                f"{work['max'] / bound if bound else 0:.2f} | {calls} | {sent:,.1f} | {seconds:.1f} |"
            )
            print(rows[-1], flush=True)
    header = [
        f"# The sharded step planned at scale ({datetime.date.today()})",
        "",
        f"Machine: {platform.processor() or platform.machine()}, {torch.get_num_threads()} threads; "
        f"torch {torch.__version__}; Python {platform.python_version()}.",
        f"Command: `python benchmarks/bench_scale.py {' '.join(sys.argv[1:])}`",
        f"Config: `{args.config.relative_to(ROOT) if args.config.is_relative_to(ROOT) else args.config}` "
        "(Muon + AdamW, clip, the 7B GPT; EP: 8 experts of top-2 per block).",
        "",
    ]
    text = "\n".join(header + rows) + "\n"
    if args.out:
        out = (
            ROOT / "benchmarks" / "results" / f"{datetime.date.today()}-scale-cpu.md" if args.out == "auto" else Path(args.out)
        )
        out.write_text(text)
        print(f"wrote {out}")


if __name__ == "__main__":
    main()
