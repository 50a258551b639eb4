"""The third and fourth releases' optimizer families side by side on the demo GPT, and a μP transfer check.

    python benchmarks/bench_families.py quality --optimizers adamw muon ademamix cautious_adamw --seed 0
    python benchmarks/bench_families.py quality --optimizers normuon soap --seed 0   # needs normuon/soap in purestep
    python benchmarks/bench_families.py quality --optimizers adamw kron --lr-mults 0.5 1 2 --seed 0   # an lr grid
    python benchmarks/bench_families.py quality --merge results/A.json results/B.json ... --tag quality480
    python benchmarks/bench_families.py timing                      # step time, all optimizers round-robin
    python benchmarks/bench_families.py mup                         # loss vs lr at widths 64/128/256, SP and μP

1. `quality`: the demo GPT (`purestep.api` model and data, the demo's size and batch) trained
   `--steps` steps (480 = 4x the demo's, as `bench_lowprec.py`) with each optimizer from the same
   init and batches (`--seed` sets both; the validation batches stay fixed), warmup + cosine to a
   tenth of the peak (5% warmup), clipping 1.0, eager `make_step(donate=True)`. Each run's JSON
   grows optimizer by optimizer; `--merge` joins JSONs of several processes/seeds into one table
   (mean, min..max final validation loss per optimizer) and one plot.
2. `timing`: a whole training step (forward, backward, update) and the update alone
   (`make_update(donate=True)` on the GPT's params), each optimizer in turn round-robin, median
   of `--reps`, eager and compiled, as ratios to AdamW.
3. `mup`: a small GPT (`TinyGPT` below: 2 blocks, 4 heads, sequence 64) at widths 64, 128 and
   256, trained `--mup-steps` steps with Adam at each lr of a grid, in the standard
   parametrization (`ps.adamw`, 1/√d attention, a plain readout) and in μP (`ps.mup_adamw` with
   the width-64 model's params (meta tensors) as `base_shapes`, `mup.MuReadout`'s readout and 1/d
   attention; at width 64 the two are the same model and optimizer). Hidden and embedding inits
   are torch's defaults, already μP's (variance 1/fan-in, and constant). One PNG: final
   validation loss against lr per width.
"""

from __future__ import annotations

import argparse
import inspect
import json
import math
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent))
import _common as C  # noqa: E402

import purestep.core as ps  # noqa: E402
from purestep.api.cli import demo_config  # noqa: E402
from purestep.api.data import ByteCorpus, stdlib_corpus  # noqa: E402
from purestep.api.models import GPT  # noqa: E402

CLIP, WD = 1.0, 0.01
ADAMW_LR, MUON_LR = 3e-3, 0.02  # the demo's two lrs (AdamW side, Muon side)
KRON_LR = 1e-3  # kron_torch's, HeavyBall's and pytorch_optimizer's default
NS_DTYPE = torch.bfloat16 if torch.cuda.is_available() else torch.float32  # as the demo: bf16 matmuls are slow on CPU


LR_MULT = [1.0]  # the grid's multiplier of every peak lr below (set per run by `quality --lr-mults`)


def schedule(peak: float, steps: int) -> Callable:
    peak = peak * LR_MULT[0]
    return ps.warmup_cosine_schedule(peak, max(1, steps // 20), steps, final=peak / 10)


def _alpha_warmup(alpha: float, steps: int) -> Callable:
    """AdEMAMix's α scheduler (the paper's): linear from 0 over `steps`."""
    return lambda t: alpha * torch.clamp(t / steps, max=1.0)


def _b3_warmup(b_start: float, b_end: float, steps: int) -> Callable:
    """AdEMAMix's β₃ scheduler (the paper's): from β_start to β_end over `steps`, linear in the
    EMA's half-life."""
    lo, hi = math.log(b_start), math.log(b_end)

    def b3(t):
        frac = torch.clamp(t / steps, max=1.0)
        return torch.exp(lo * hi / ((1 - frac) * hi + frac * lo))

    return b3


def _accepted(factory: Callable, kwargs: dict) -> dict:
    params = inspect.signature(factory).parameters
    return {k: v for k, v in kwargs.items() if k in params}


def _hybrid(name: str, steps: int) -> ps.Transform:
    """`muon_adamw` or `normuon_adamw` with the demo's recipe (Muon lr 0.02, AdamW side 3e-3,
    decay 0.01 both sides, both lrs on the schedule)."""
    factory = getattr(ps, name)
    return factory(**_accepted(factory, dict(
        lr=schedule(MUON_LR, steps), weight_decay=WD, ns_dtype=NS_DTYPE, adamw_lr=schedule(ADAMW_LR, steps),
        adamw_weight_decay=WD)))


OPTIMIZERS: dict[str, Callable[[int], ps.Transform]] = {
    # name: steps -> transform (the clipping goes in front of each)
    "adamw": lambda steps: ps.adamw(schedule(ADAMW_LR, steps), betas=(0.9, 0.95), weight_decay=WD),
    "muon": lambda steps: _hybrid("muon_adamw", steps),
    "normuon": lambda steps: _hybrid("normuon_adamw", steps),
    "soap": lambda steps: ps.soap(schedule(ADAMW_LR, steps), betas=(0.95, 0.95), weight_decay=WD),
    "ademamix": lambda steps: ps.ademamix(schedule(ADAMW_LR, steps), b1=0.9, b2=0.95, b3=_b3_warmup(0.9, 0.999, steps),
                                          alpha=_alpha_warmup(5.0, steps), weight_decay=WD),
    "cautious_adamw": lambda steps: ps.cautious_adamw(schedule(ADAMW_LR, steps), betas=(0.9, 0.95), weight_decay=WD),
    # The fourth release's, each at the AdamW recipe's lr and schedule (Prodigy: its lr is a
    # multiplier of the learned step, shaped by the same schedule from 1).
    "adopt": lambda steps: ps.adopt(schedule(ADAMW_LR, steps), b1=0.9, b2=0.9999, weight_decay=WD),
    "prodigy": lambda steps: ps.prodigy(schedule(1.0, steps), b1=0.9, b2=0.95, weight_decay=WD),
    "mars": lambda steps: ps.mars(schedule(ADAMW_LR, steps), b1=0.95, b2=0.99, weight_decay=WD),
    "laprop": lambda steps: ps.laprop(schedule(ADAMW_LR, steps), b1=0.9, b2=0.95, weight_decay=WD),
    "adamc": lambda steps: ps.adamc(schedule(ADAMW_LR, steps), b1=0.9, b2=0.95, weight_decay=WD),
    "adamw_cwd": lambda steps: ps.adamw(schedule(ADAMW_LR, steps), betas=(0.9, 0.95), weight_decay=WD,
                                        cautious_weight_decay=True),
    # PSGD-Kron at the references' lr (its update has RMS <= 1.1, as Adam's about 1), refits with
    # their probability schedule (every step for the first 500).
    "kron": lambda steps: ps.kron(schedule(KRON_LR, steps), b1=0.9, weight_decay=WD),
}
NEEDS = {"normuon": "normuon_adamw", "soap": "soap", "ademamix": "ademamix", "cautious_adamw": "cautious_adamw"}


def build(name: str, steps: int, lr_mult: float = 1.0) -> ps.Transform:
    if name in NEEDS and not hasattr(ps, NEEDS[name]):
        raise SystemExit(f"{name}: this purestep has no ps.{NEEDS[name]} (it comes with issue 21's other branch)")
    LR_MULT[0] = lr_mult
    try:
        return ps.chain(ps.clip_by_global_norm(CLIP), OPTIMIZERS[name](steps))
    finally:
        LR_MULT[0] = 1.0


# --------------------------------------------------------------------------- #
# 1 and 2: quality and step time on the demo GPT.
# --------------------------------------------------------------------------- #


def demo_model(seed: int) -> nn.Module:
    cfg = demo_config().model
    torch.manual_seed(seed)
    return GPT(vocab_size=cfg.vocab_size, dim=cfg.n_embd, n_layers=cfg.n_layer, n_heads=cfg.n_head, seq_len=cfg.block_size)


def demo_data(seed: int, val_batches: int) -> tuple[ByteCorpus, list]:
    cfg = demo_config()
    tokens = stdlib_corpus(cfg.data.max_bytes)
    data = ByteCorpus(tokens, seq_len=cfg.model.block_size, batch_size=cfg.batch_size, seed=cfg.seed + seed)
    held = ByteCorpus(tokens, seq_len=cfg.model.block_size, batch_size=cfg.batch_size, seed=cfg.seed)
    return data, [held.batch(i, split="val") for i in range(val_batches)]


def val_loss(model: nn.Module, val: list) -> float:
    with torch.no_grad():
        total = sum(F.cross_entropy(_logits(model(b["input"])).flatten(0, 1), b["target"].flatten()) for b in val)
    return float(total) / len(val)


def _logits(out: Any) -> torch.Tensor:
    return out[0] if isinstance(out, tuple) else out


def train(model: nn.Module, opt: ps.Transform, data: ByteCorpus, val: list, steps: int, eval_every: int,
          compile: bool = False) -> dict:
    """`steps` steps of `make_step(donate=True)` on `model`'s params (updated in place, so the
    model evaluates them); train losses, val losses every `eval_every`, step seconds."""
    apply_fn, params, buffers = ps.functional_model(model)

    def loss_fn(p, batch):
        return F.cross_entropy(_logits(apply_fn(p, buffers, batch["input"])).flatten(0, 1), batch["target"].flatten())

    step = ps.make_step(loss_fn, opt, compile=compile, donate=True)
    state = opt.init(params)
    train_losses, curve, step_seconds = [], [(0, val_loss(model, val))], []
    for i in range(steps):
        t = time.perf_counter()
        loss = float(step(params, state, data.batch(i))[2]["loss"])
        step_seconds.append(time.perf_counter() - t)
        train_losses.append(loss)
        if not math.isfinite(loss):
            curve.append((i + 1, float("nan")))
            break
        if (i + 1) % eval_every == 0 or i + 1 == steps:
            curve.append((i + 1, val_loss(model, val)))
    return {"train": train_losses, "val": curve, "step_ms_median": 1e3 * statistics.median(step_seconds),
            "seconds": sum(step_seconds)}


def quality_tables(runs: dict[tuple[str, int], dict]) -> str:
    by_name: dict[str, dict[int, dict]] = {}
    for (name, seed), r in runs.items():
        by_name.setdefault(name, {})[seed] = r
    base = by_name.get("adamw", {})
    rows, per_run = [], []
    for name, seeds in by_name.items():
        finals = [r["val"][-1][1] for r in seeds.values()]
        mean = sum(finals) / len(finals)
        paired = [100 * (seeds[s]["val"][-1][1] / base[s]["val"][-1][1] - 1) for s in seeds if s in base]
        vs = f"{sum(paired) / len(paired):+.2f}% ({min(paired):+.2f} .. {max(paired):+.2f})" if paired else ""
        ms = statistics.median(r["step_ms_median"] for r in seeds.values())
        rows.append([name, ", ".join(map(str, sorted(seeds))), f"{mean:.4f}", f"{min(finals):.4f} .. {max(finals):.4f}",
                     f"{statistics.stdev(finals):.4f}" if len(finals) > 1 else "", vs, f"{ms:.0f}"])
        for s, r in sorted(seeds.items()):
            per_run.append([name, str(s), f"{r['val'][-1][1]:.4f}", f"{r['step_ms_median']:.0f}", f"{r['seconds']:.0f}"])
    return (C.table(["optimizer", "seeds", "mean final val loss", "min .. max", "std", "vs AdamW, same seed (mean, min .. max)",
                     "step ms (median of the runs' medians)"], rows)
            + "\n\n### Per run\n\n" + C.table(["optimizer", "seed", "final val loss", "median step ms", "train seconds"], per_run))


def plot_quality(runs: dict[tuple[str, int], dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_train, ax_val) = plt.subplots(1, 2, figsize=(13, 4.5))
    names = list(dict.fromkeys(name for name, _ in runs))
    for name, color in zip(names, plt.rcParams["axes.prop_cycle"].by_key()["color"] * 2):
        seeds = [r for (n, _), r in runs.items() if n == name]
        train = [sum(c) / len(c) for c in zip(*(r["train"] for r in seeds))]
        k = max(1, len(train) // 40)
        smooth = [sum(train[max(0, i - k + 1): i + 1]) / len(train[max(0, i - k + 1): i + 1]) for i in range(len(train))]
        ax_train.plot(range(1, len(smooth) + 1), smooth, lw=1, color=color, label=f"{name} ({len(seeds)})")
        steps = [s for s, _ in seeds[0]["val"]]
        vals = list(zip(*([v for _, v in r["val"]] for r in seeds)))
        ax_val.plot(steps, [sum(v) / len(v) for v in vals], "o-", ms=3, lw=1, color=color, label=f"{name} ({len(seeds)})")
        if len(seeds) > 1:
            ax_val.fill_between(steps, [min(v) for v in vals], [max(v) for v in vals], color=color, alpha=0.15, lw=0)
    finals = [r["val"][-1][1] for r in runs.values()]
    ax_val.set_ylim(min(finals) - 0.1, max(finals) + 0.6)
    ax_train.set(xlabel="step", ylabel="train loss (running mean over seeds)", title="training loss")
    ax_val.set(xlabel="step", ylabel="validation loss", title="validation loss (mean over seeds, min..max shaded)")
    ax_val.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def quality(args: argparse.Namespace) -> str:
    runs: dict[tuple[str, int, float], dict] = {}
    stem = f"{time.strftime('%Y-%m-%d')}-families-{args.tag or 'quality'}-cpu"
    C.RESULTS.mkdir(parents=True, exist_ok=True)
    eval_every = args.eval_every or max(1, args.steps // 8)
    dump = lambda: (C.RESULTS / f"{stem}.json").write_text(  # noqa: E731
        json.dumps({f"{n} | seed {s} | lr x{m:g}": r for (n, s, m), r in runs.items()}, indent=0))
    if args.optimizers:
        data, val = demo_data(args.seed, args.val_batches)
        for name in args.optimizers:
            for mult in args.lr_mults:
                opt = build(name, args.steps, mult)
                print(f"training: {name} (seed {args.seed}, {args.steps} steps, lr x{mult:g})", flush=True)
                runs[(name, args.seed, mult)] = r = train(demo_model(args.seed), opt, data, val, args.steps, eval_every)
                r.update(optimizer=name, seed=args.seed, lr_mult=mult)
                print(f"  val loss {r['val'][-1][1]:.4f}, median step {r['step_ms_median']:.0f} ms", flush=True)
                dump()
    for path in args.merge:
        for r in json.loads(path.read_text()).values():
            runs.setdefault((r["optimizer"], r["seed"], r.get("lr_mult", 1.0)), r)
    order = list(OPTIMIZERS)
    runs = {k: runs[k] for k in sorted(runs, key=lambda k: (order.index(k[0]), k[2], k[1]))}
    if args.merge:
        dump()
    tuned, grid = tune(runs)
    plot_quality(tuned, C.RESULTS / f"{stem}.png")
    table = quality_tables(tuned)
    print(grid + "\n\n" + table)
    head = (f"## Training quality (demo GPT, {args.steps} steps, warmup + cosine to peak/10, clip {CLIP}, decay {WD}; "
            f"val loss over {args.val_batches} fixed batches, the same for every seed)")
    if grid:
        head += ("\n\n### The lr grid (seed 0; each optimizer's peak lr times the multiplier; the best, marked, is the "
                 f"lr of the table below)\n\n{grid}\n\n### At each optimizer's best lr")
    return f"{head}\n\n{table}\n\nCurves: `{stem}.png`; per-step losses: `{stem}.json`."


def tune(runs: dict[tuple[str, int, float], dict]) -> tuple[dict[tuple[str, int], dict], str]:
    """Each optimizer's runs at its best lr multiplier (the lowest final val loss on the lowest
    seed that ran the grid), and the grid's table ("" when only one lr ran)."""
    final = lambda r: r["val"][-1][1] if math.isfinite(r["val"][-1][1]) else float("inf")  # noqa: E731
    mults = sorted({m for _, _, m in runs})
    best: dict[str, float] = {}
    rows = []
    for name in dict.fromkeys(n for n, _, _ in runs):
        seed = min(s for n, s, _ in runs if n == name)
        tried = {m: final(r) for (n, s, m), r in runs.items() if n == name and s == seed}
        best[name] = min(tried, key=tried.get)
        rows.append([name, str(seed), *(("**%.4f**" if m == best[name] else "%.4f") % tried[m] if m in tried else ""
                                        for m in mults)])
    grid = C.table(["optimizer", "seed", *(f"lr x{m:g}" for m in mults)], rows) if len(mults) > 1 else ""
    return {(n, s): r for (n, s, m), r in runs.items() if m == best[n]}, grid


def timing(args: argparse.Namespace) -> str:
    names = [n for n in (args.optimizers or list(OPTIMIZERS)) if n not in NEEDS or hasattr(ps, NEEDS[n])]
    device = torch.device("cpu")
    data, _ = demo_data(0, 1)
    batch = data.batch(0)
    rows = []
    for compiled in (False, True):
        steps, updates = {}, {}
        for name in names:
            model = demo_model(0)
            apply_fn, params, buffers = ps.functional_model(model)
            opt = build(name, 480)

            def loss_fn(p, b, apply_fn=apply_fn, buffers=buffers):
                return F.cross_entropy(apply_fn(p, buffers, b["input"])[0].flatten(0, 1), b["target"].flatten())

            step = ps.make_step(loss_fn, opt, compile=compiled, donate=True)
            state = opt.init(params)
            steps[name] = lambda step=step, params=params, state=state: step(params, state, batch)
            params2 = {k: v.detach().clone() for k, v in params.items()}
            grads = {k: torch.randn_like(v) * 1e-2 for k, v in params.items()}
            update = ps.make_update(opt, compile=compiled, donate=True)
            state2 = opt.init(params2)
            updates[name] = lambda update=update, p=params2, g=grads, s=state2: update(p, g, s)
        print(f"timing ({'compiled' if compiled else 'eager'}): {names}", flush=True)
        step_t = C.interleaved(steps, device, warmup=3, reps=args.reps)
        update_t = C.interleaved(updates, device, warmup=3, reps=args.reps)
        for name in names:
            rows.append(["compiled" if compiled else "eager", name, f"{1e3 * step_t[name]:.1f}",
                         f"{step_t[name] / step_t['adamw']:.2f}", f"{1e3 * update_t[name]:.2f}",
                         f"{update_t[name] / update_t['adamw']:.2f}"])
    table = C.table(["mode", "optimizer", "train step ms", "ratio to AdamW", "update ms", "ratio to AdamW"], rows)
    print(table)
    n = sum(p.numel() for p in demo_model(0).parameters())
    return (f"## Step time (demo GPT, {n / 1e6:.2f}M params, batch {demo_config().batch_size} x "
            f"{demo_config().model.block_size}; each optimizer in turn, round-robin, median of {args.reps}; "
            f"update = `make_update(donate=True)` alone on random grads)\n\n{table}")


# --------------------------------------------------------------------------- #
# 3: μP transfer.
# --------------------------------------------------------------------------- #

MUP_WIDTHS, MUP_BASE, MUP_HEADS, MUP_LAYERS, MUP_SEQ, MUP_BATCH = (64, 128, 256), 64, 4, 2, 64, 16


class Block(nn.Module):
    def __init__(self, d: int, mup: bool) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d, bias=False), nn.Linear(d, d, bias=False)
        self.fc, self.out = nn.Linear(d, 4 * d, bias=False), nn.Linear(4 * d, d, bias=False)
        head_dim, base_head_dim = d // MUP_HEADS, MUP_BASE // MUP_HEADS
        # μP scales attention logits by 1/d_head (times √(base d_head), so the base model is the SP one).
        self.scale = math.sqrt(base_head_dim) / head_dim if mup else 1 / math.sqrt(head_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, MUP_HEADS, d // MUP_HEADS).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class Readout(nn.Linear):
    """`mup.MuReadout`'s math with the width multiplier fixed at construction: the input divided
    by it, the init scaled by its square root (`MuReadout._rescale_parameters`). mup's module reads
    `self.weight.infshape`, which the plain tensors of a functional call (`ps.functional_model`)
    do not carry."""

    def __init__(self, d: int, n: int, width_mult: float) -> None:
        super().__init__(d, n, bias=False)
        self.width_mult = width_mult
        with torch.no_grad():
            self.weight.mul_(width_mult**0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x / self.width_mult)


class TinyGPT(nn.Module):
    """A 2-block byte-level GPT; `mup=True` swaps in a μP readout and 1/d attention."""

    def __init__(self, d: int, mup: bool) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(256, d), nn.Embedding(MUP_SEQ, d)
        self.blocks = nn.ModuleList(Block(d, mup) for _ in range(MUP_LAYERS))
        self.ln_f = nn.LayerNorm(d)
        self.head = Readout(d, 256, d / MUP_BASE) if mup else nn.Linear(d, 256, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def mup_model(width: int, mup: bool, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return TinyGPT(width, mup)


def mup_transfer(args: argparse.Namespace) -> str:
    tokens = stdlib_corpus(demo_config().data.max_bytes)
    data = ByteCorpus(tokens, seq_len=MUP_SEQ, batch_size=MUP_BATCH, seed=args.seed)
    val = [ByteCorpus(tokens, seq_len=MUP_SEQ, batch_size=MUP_BATCH, seed=0).batch(i, split="val") for i in range(4)]
    with torch.device("meta"):
        base_shapes = dict(TinyGPT(MUP_BASE, True).named_parameters())  # the base model's params tree: its shapes
    lrs = [float(x) for x in args.lrs]
    results: dict[str, dict[int, dict[float, float]]] = {"SP": {}, "μP": {}}
    for width in MUP_WIDTHS:
        for kind in ("SP", "μP"):
            for lr in lrs:
                model = mup_model(width, kind == "μP", args.seed)
                sched = schedule(lr, args.mup_steps)
                opt = (ps.mup_adamw(sched, betas=(0.9, 0.95), base_shapes=base_shapes) if kind == "μP"
                       else ps.adamw(sched, betas=(0.9, 0.95), weight_decay=0.0))
                r = train(model, ps.chain(ps.clip_by_global_norm(CLIP), opt), data, val, args.mup_steps, args.mup_steps)
                loss = r["val"][-1][1]
                results[kind].setdefault(width, {})[lr] = loss
                print(f"  {kind} width {width} lr {lr:.2e}: val loss {loss:.4f} ({r['seconds']:.0f} s)", flush=True)
    stem = f"{time.strftime('%Y-%m-%d')}-families-mup{'-' + args.tag if args.tag else ''}-cpu"
    (C.RESULTS / f"{stem}.json").write_text(json.dumps({k: {str(w): v for w, v in d.items()} for k, d in results.items()}, indent=0))
    _plot_mup(results, C.RESULTS / f"{stem}.png")
    rows = []
    for kind, by_width in results.items():
        best_base = min(by_width[MUP_BASE], key=lambda lr: by_width[MUP_BASE][lr])
        for width, losses in by_width.items():
            best = min(losses, key=lambda lr: losses[lr])
            rows.append([kind, str(width), f"{best:.2e}", f"{losses[best]:.4f}", f"{losses[best_base]:.4f}",
                         f"{losses[best_base] - losses[best]:+.4f}"])
    table = C.table(["parametrization", "width", "best lr", "its val loss", f"val loss at width {MUP_BASE}'s best lr",
                     "cost of reusing it"], rows)
    print(table)
    return (f"## μP transfer (TinyGPT: {MUP_LAYERS} blocks, {MUP_HEADS} heads, sequence {MUP_SEQ}, batch {MUP_BATCH}; "
            f"{args.mup_steps} steps of Adam(W) (betas 0.9, 0.95, no decay) per point, warmup + cosine, clip {CLIP}; "
            f"one seed; val loss over 4 fixed batches)\n\n{table}\n\nCurves: `{stem}.png`; values: `{stem}.json`.")


def _plot_mup(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5), sharey=True)
    for ax, (kind, by_width) in zip(axes, results.items()):
        for width, losses in by_width.items():
            lrs = sorted(losses)
            ax.plot(lrs, [losses[lr] for lr in lrs], "o-", ms=4, label=f"width {width}")
        ax.set_xscale("log")
        title = "standard parametrization (ps.adamw)" if kind == "SP" else "μP (ps.mup_adamw, μP readout, 1/d attention)"
        ax.set(xlabel="peak lr", title=title)
        ax.legend(fontsize=8)
    axes[0].set_ylabel("final validation loss")
    finite = [v for d in results.values() for losses in d.values() for v in losses.values() if math.isfinite(v)]
    axes[0].set_ylim(min(finite) - 0.05, min(max(finite), min(finite) + 1.5) + 0.05)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("part", choices=["quality", "timing", "mup"])
    parser.add_argument("--optimizers", nargs="*", default=None, choices=list(OPTIMIZERS))
    parser.add_argument("--steps", type=int, default=4 * demo_config().steps)
    parser.add_argument("--eval-every", type=int, default=0, help="default: steps / 8")
    parser.add_argument("--val-batches", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--lr-mults", nargs="*", type=float, default=[1.0], help="quality: the lr grid, as multipliers")
    parser.add_argument("--merge", nargs="*", default=[], type=Path)
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--mup-steps", type=int, default=100)
    parser.add_argument("--lrs", nargs="*", default=["1e-3", "2e-3", "4e-3", "8e-3", "1.6e-2", "3.2e-2"])
    parser.add_argument("--tag", default="")
    args = parser.parse_args()
    if args.seed < 0 or args.steps < 1:
        parser.error("--seed must be >= 0 and --steps >= 1")
    torch.set_num_threads(args.threads)
    if args.part == "quality":
        if args.optimizers is None and not args.merge:
            args.optimizers = list(OPTIMIZERS)
        body = quality(args)
    elif args.part == "timing":
        body = timing(args)
    else:
        body = mup_transfer(args)
    tag = f"families-{args.part}" + (f"-{args.tag}" if args.tag else "")
    path = C.write_result(tag, "Optimizer families: AdEMAMix, cautious AdamW, μP (issue 21)", torch.device("cpu"), body)
    print(f"results: {path}")


if __name__ == "__main__":
    main()
