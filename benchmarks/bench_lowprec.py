"""Low-precision optimizer state and bf16 params, side by side: state bytes, step time and
training quality of AdamW with float32, bf16 and 8-bit moments, bf16 params with Kahan
compensation, and plain bf16 params.

    python benchmarks/bench_lowprec.py                                  # full: 100M-param step, 480 training steps
    python benchmarks/bench_lowprec.py --size 4e6 --tensors 4 --steps 60 --no-compile  # a short CPU check

1. State bytes: `ps.adamw(...).init(params)` for a `--size` tree, measured as the bytes of
   the distinct storages the state holds (and, on CUDA, the growth of
   `torch.cuda.memory_allocated`), not computed from dtypes.
2. Step time: `ps.make_update(opt, compile=True, donate=True)` at `--size` params, fp32
   against bf16 (stochastic and nearest rounding) and 8-bit moments, timed round-robin;
   then ("stores") AdamW's elementwise step on one flat buffer with its moments stored
   as fp32, bf16 to nearest (`.to`), the random bits alone, the integer-op rounding
   alone, and both (stochastic): what each piece of the bf16 state's step costs.
3. Quality: the demo GPT (`purestep.api` model and data, the demo's size and batch)
   trained `--steps` steps (4x the demo's 120 by default) with AdamW (warmup + cosine,
   clipping 1.0) per variant from the same init and batches; validation loss on fixed
   batches along the way; torchao's and torch-optimi's equivalents where they import.
   Writes the val losses (markdown + JSON) and a loss-curve PNG under `results/`.
   `--seed` sets the init and the batch order (the validation batches stay fixed);
   `--merge` joins runs of several seeds into a per-run table (each against the fp32 run of
   its seed), a mean/min/max table across seeds and a plot of the mean with the spread.
   `--bf16-compute float32` (the CPU default) keeps the bf16-param variants' params stored
   and updated in bf16 but runs their forward and backward on the params cast to float32
   (bf16 values, float32 activations; grads rounded to bf16 at the cast), for CPUs without
   bf16 matmul units; `bfloat16` (the CUDA default) computes in bf16.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch
import torch.utils._pytree as pytree

sys.path.insert(0, str(Path(__file__).parent))
import _common as C  # noqa: E402
from bench_optimizer import make_leaves  # noqa: E402

import purestep.core as ps  # noqa: E402
import purestep.core._low_precision as lp  # noqa: E402
from purestep.api.cli import demo_config  # noqa: E402
from purestep.api.data import ByteCorpus, stdlib_corpus  # noqa: E402
from purestep.api.models import GPT  # noqa: E402

BF16, FP8 = torch.bfloat16, torch.float8_e4m3fn
MOMENTS = {
    "fp32": {},
    "bf16": dict(mu_dtype=BF16, nu_dtype=BF16),
    "bf16 nearest": dict(mu_dtype=BF16, nu_dtype=BF16, rounding="nearest"),
    "8-bit": dict(mu_dtype=FP8, nu_dtype=FP8),
}
PEAK_LR, BETAS, WD, CLIP = 3e-3, (0.9, 0.95), 0.01, 1.0  # the demo's AdamW side
# Bytes one AdamW step moves per param: read p, g, m, v and write p, m, v (8-bit: 1-byte
# codes plus a float32 scale per 256 elements for each moment, read and written).
STEP_BYTES = {"fp32": 28, "bf16": 20, "bf16 nearest": 20, "8-bit": 16 + 4 * 4 / 256}
TARGETS = {"bf16 moments": 0.01, "bf16 params + Kahan": 0.01, "8-bit moments": 0.02}


# --------------------------------------------------------------------------- #
# 1 and 2: bytes and step time.
# --------------------------------------------------------------------------- #


def storage_bytes(tree: Any) -> int:
    """Bytes of the distinct storages behind a tree's tensors, as allocated."""
    seen = {}
    for t in pytree.tree_leaves(tree):
        s = t.untyped_storage()
        seen[(s.device, s.data_ptr())] = s.nbytes()
    return sum(seen.values())


def state_bytes(params: dict, device: torch.device) -> dict[str, dict[str, int]]:
    out = {}
    for name in ("fp32", "bf16", "8-bit"):
        C.sync(device)
        before = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
        state = ps.adamw(1e-3, **MOMENTS[name]).init(params)
        C.sync(device)
        grown = torch.cuda.memory_allocated(device) - before if device.type == "cuda" else None
        out[name] = {"storage": storage_bytes(state), "allocated": grown}
        del state
    return out


def step_times(
    numel: int, n: int, device: torch.device, reps: int, names: list[str]
) -> tuple[dict[str, float], dict[str, float]]:
    fns, first = {}, {}
    for name in names:
        opt = ps.adamw(1e-3, weight_decay=WD, **MOMENTS[name])
        params = {f"g{i}": t for i, t in enumerate(make_leaves(numel, n, device, seed=0))}
        # Each contender its own grads, as in training: the flat update re-points the grad
        # tensors into its grad buffer, and grads shared by two contenders would be copied
        # into each one's buffer on every call (8 more bytes per param, for all alike).
        grads = {f"g{i}": t for i, t in enumerate(make_leaves(numel, n, device, seed=1))}
        state = opt.init(params)
        update = ps.make_update(opt, compile=True, donate=True)
        fns[name] = lambda u=update, p=params, g=grads, s=state: u(p, g, s)
        first[name] = C.first_call(fns[name], device)
        print(f"  compiled {name}: {first[name]:.1f} s", flush=True)
    return C.interleaved(fns, device, warmup=2, reps=reps), first


def _store(kind: str, x: torch.Tensor, seed: torch.Tensor, half: int) -> torch.Tensor:
    """A float32 moment stored in bf16 four ways (the pieces of `lp.round_to`)."""
    if kind == "fp32":
        return x
    if kind == "nearest (.to)":
        return x.to(BF16)
    if kind == "hash only":  # the random bits, used (never true) so they are computed, without the rounding
        bits = (lp._random_bits(x, seed=seed) >> (16 * half)) & 0xFFFF
        return torch.where(bits > 0xFFFF, x + 1, x).to(BF16)
    if kind == "rounding only":  # the integer-op rounding with fixed bits, without the hash
        return lp._round_bf16(x, torch.full_like(x, 0x5A5A, dtype=torch.int32)).to(BF16)
    return lp.round_to(x, BF16, half=half, seed=seed)  # stochastic: hash + rounding


STORES = ("fp32", "nearest (.to)", "hash only", "rounding only", "stochastic")


def store_costs(numel: int, device: torch.device, reps: int) -> dict[str, float]:
    """AdamW's elementwise step on one flat buffer, compiled, with μ and ν stored each way
    of `STORES`: which piece of the bf16 state's step costs what."""

    def step(p, g, m, v, seed, kind):
        m2 = 0.9 * m.float() + 0.1 * g
        v2 = 0.999 * v.float() + 0.001 * g * g
        p.copy_(p - 1e-3 * (m2 / (torch.sqrt(v2 * 1.001) + 1e-8) * 1.1 + WD * p))
        m.copy_(_store(kind, m2, seed, 0))
        v.copy_(_store(kind, v2, seed, 1))

    g = torch.randn(numel, device=device)
    seed = lp.leaf_seed(3, device)
    fns = {}
    for kind in STORES:
        dtype = torch.float32 if kind == "fp32" else BF16
        args = (torch.randn(numel, device=device), g, torch.randn(numel, device=device).to(dtype),
                torch.rand(numel, device=device).to(dtype), seed)
        fn = torch.compile(functools.partial(step, kind=kind), fullgraph=True)
        fns[kind] = lambda fn=fn, a=args: fn(*a)
        fns[kind]()
    return C.interleaved(fns, device, warmup=2, reps=reps)


# --------------------------------------------------------------------------- #
# 3: training quality on the demo model.
# --------------------------------------------------------------------------- #


def schedule(steps: int) -> Callable:
    warmup = max(1, steps // 20)  # the demo's 5%
    return ps.warmup_cosine_schedule(PEAK_LR, warmup, steps, final=PEAK_LR / 10)


def ours(kw: dict, compensated: bool, steps: int) -> ps.Transform:
    parts = [ps.clip_by_global_norm(CLIP), ps.adamw(schedule(steps), betas=BETAS, eps=1e-8, weight_decay=WD, **kw)]
    return ps.chain(*parts, ps.compensated_updates()) if compensated else ps.chain(*parts)


VARIANTS: dict[str, tuple[torch.dtype, dict, bool]] = {
    # name: (param dtype, moment options, Kahan-compensated updates)
    "fp32": (torch.float32, {}, False),
    "bf16 moments": (torch.float32, MOMENTS["bf16"], False),
    "8-bit moments": (torch.float32, MOMENTS["8-bit"], False),
    "bf16 params + Kahan": (BF16, {}, True),  # bf16 moments too: the state follows the params
    "bf16 params, plain": (BF16, {}, False),
}


def make_model(dtype: torch.dtype, device: torch.device, seed: int) -> torch.nn.Module:
    cfg = demo_config().model
    torch.manual_seed(seed)
    model = GPT(vocab_size=cfg.vocab_size, dim=cfg.n_embd, n_layers=cfg.n_layer, n_heads=cfg.n_head, seq_len=cfg.block_size)
    return model.to(device=device, dtype=dtype)


def compute_view(tensors: dict, compute: torch.dtype) -> dict:
    """The floating tensors cast to the compute dtype, differentiably (a bf16 leaf gets a bf16
    grad back through the cast); a no-op, the same tensors, where they already are that dtype."""
    return {k: t.to(compute) if t.is_floating_point() else t for k, t in tensors.items()}


def forward_in(model: torch.nn.Module, compute: torch.dtype) -> Callable:
    """`model`'s forward with its params and buffers, whatever dtype they are stored in, cast to
    `compute` (float32: bf16 weights with float32 activations, for CPUs without bf16 matmul units)."""
    def forward(x: torch.Tensor) -> torch.Tensor:
        tensors = {**dict(model.named_parameters()), **dict(model.named_buffers())}
        return torch.func.functional_call(model, compute_view(tensors, compute), (x,))
    return forward


def val_loss(forward: Callable, val: list) -> float:
    with torch.no_grad():
        total = sum(torch.nn.functional.cross_entropy(forward(b["input"]).flatten(0, 1).float(), b["target"].flatten())
                    for b in val)
    return float(total) / len(val)


def train_ours(name: str, data: ByteCorpus, val: list, steps: int, eval_every: int, device, compile: bool,
               seed: int, bf16_compute: torch.dtype) -> dict:
    dtype, kw, compensated = VARIANTS[name]
    compute = bf16_compute if dtype == BF16 else dtype  # float32 variants compute in float32, as stored
    model = make_model(dtype, device, seed)
    apply_fn, params, buffers = ps.functional_model(model)
    buffers = compute_view(buffers, compute)
    opt = ours(kw, compensated, steps)

    def loss_fn(p, batch):  # p: the stored (bf16 or float32) params; grads come back in that dtype
        logits, _ = apply_fn(compute_view(p, compute), buffers, batch["input"])
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), batch["target"].flatten())

    step = ps.make_step(loss_fn, opt, compile=compile, donate=True)
    state = opt.init(params)
    return _loop(lambda b: step(params, state, b)[2]["loss"], forward_in(model, compute), data, val, steps,
                 eval_every, device)


def _loop(run_step: Callable, forward: Callable, data: ByteCorpus, val: list, steps: int, eval_every: int, device) -> dict:
    train, curve = [], [(0, val_loss(forward, val))]
    t = time.perf_counter()
    for i in range(steps):
        batch = {k: v.to(device) for k, v in data.batch(i).items()}
        train.append(float(run_step(batch)))
        if (i + 1) % eval_every == 0 or i + 1 == steps:
            curve.append((i + 1, val_loss(forward, val)))
    return {"train": train, "val": curve, "seconds": time.perf_counter() - t}


def compute_check(data: ByteCorpus, held: ByteCorpus, steps: int, device, seed: int) -> list[list[str]]:
    """`--bf16-compute float32` against a real bf16 forward and backward: the same bf16 weights (the
    model after `steps` emulated bf16-params + Kahan steps), the loss and the bf16 grads of a few
    batches computed both ways."""
    model = make_model(BF16, device, seed)
    apply_fn, params, buffers = ps.functional_model(model)
    buffers32, opt = compute_view(buffers, torch.float32), ours({}, True, steps)

    def loss_fn(p, batch):
        logits, _ = apply_fn(compute_view(p, torch.float32), buffers32, batch["input"])
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), batch["target"].flatten())

    step, state = ps.make_step(loss_fn, opt, donate=True), opt.init(params)
    for i in range(steps):
        step(params, state, {k: v.to(device) for k, v in data.batch(i).items()})

    def loss_and_grad(compute: torch.dtype, batch: dict) -> tuple[float, torch.Tensor]:
        model.zero_grad(set_to_none=True)
        logits = forward_in(model, compute)(batch["input"])
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), batch["target"].flatten())
        loss.backward()
        assert all(p.grad.dtype == BF16 for p in model.parameters())  # bf16 grads either way
        return float(loss.detach()), torch.cat([p.grad.double().flatten() for p in model.parameters()])

    rows = []
    for split, corpus, i in [("val", held, 0), ("val", held, 1), ("train", data, steps), ("train", data, steps + 1)]:
        batch = {k: v.to(device) for k, v in corpus.batch(i, split=split).items()}
        (lb, gb), (lf, gf) = loss_and_grad(BF16, batch), loss_and_grad(torch.float32, batch)
        cos = float(gb @ gf / (gb.norm() * gf.norm()))
        rows.append([f"{split} {i}", f"{lb:.5f}", f"{lf:.5f}", f"{100 * (lf / lb - 1):+.4f}%", f"{cos:.5f}",
                     f"{float((gf - gb).norm() / gb.norm()):.4f}"])
        print("  " + " | ".join(rows[-1]), flush=True)
    return rows


def peers(steps: int) -> dict[str, Callable]:
    """torchao's and torch-optimi's equivalents that import here: name -> (model dtype, optimizer factory)."""
    found: dict[str, Any] = {}
    try:
        import optimi

        found["torch-optimi bf16 params + Kahan"] = (BF16, lambda ps_: optimi.AdamW(
            ps_, lr=PEAK_LR, betas=BETAS, eps=1e-8, weight_decay=WD, kahan_sum=True))
    except ImportError:
        print("torch-optimi: not installed, skipped (pip install torch-optimi)")
    try:
        from torchao.optim import AdamW8bit, _AdamW

        found["torchao AdamW8bit"] = (torch.float32, lambda ps_: AdamW8bit(ps_, lr=PEAK_LR, betas=BETAS, weight_decay=WD))
        found["torchao bf16 params + stochastic rounding"] = (BF16, lambda ps_: _AdamW(
            ps_, lr=PEAK_LR, betas=BETAS, weight_decay=WD, bf16_stochastic_round=True))
    except ImportError:
        print("torchao: not installed, skipped (pip install torchao)")
    return found


def train_peer(make: tuple, data: ByteCorpus, val: list, steps: int, eval_every: int, device,
               seed: int, bf16_compute: torch.dtype) -> dict:
    dtype, factory = make
    compute = bf16_compute if dtype == BF16 else dtype
    model = make_model(dtype, device, seed)
    forward = forward_in(model, compute)  # the peer's optimizer steps the stored (bf16) Parameters
    opt = factory(model.parameters())
    lr_at = schedule(steps)
    counter = [0]

    def run_step(batch: dict) -> torch.Tensor:
        for group in opt.param_groups:
            group["lr"] = float(lr_at(counter[0]))
        counter[0] += 1
        logits = forward(batch["input"])
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), batch["target"].flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    return _loop(run_step, forward, data, val, steps, eval_every, device)


def by_variant(runs: dict[tuple[str, int], dict]) -> dict[str, dict[int, dict]]:
    """`{(variant, seed): run}` grouped as `{variant: {seed: run}}`, in `runs`' order."""
    out: dict[str, dict[int, dict]] = {}
    for (name, seed), r in runs.items():
        out.setdefault(name, {})[seed] = r
    return out


def plot(runs: dict[tuple[str, int], dict], path: Path) -> None:
    """Per variant the mean over its seeds, the min..max across seeds shaded: train loss, val loss, and the val
    loss against the fp32 run of the same seed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_train, ax_val, ax_gap) = plt.subplots(1, 3, figsize=(18, 4.5))
    fp32 = by_variant(runs).get("fp32", {})
    for (name, seeds), color in zip(by_variant(runs).items(), plt.rcParams["axes.prop_cycle"].by_key()["color"] * 3):
        label = f"{name} ({len(seeds)} seed{'s' * (len(seeds) > 1)})"
        train = [sum(col) / len(col) for col in zip(*(r["train"] for r in seeds.values()))]
        k = max(1, len(train) // 50)  # a running mean over ~2% of the run
        smooth = [sum(train[max(0, i - k + 1) : i + 1]) / len(train[max(0, i - k + 1) : i + 1]) for i in range(len(train))]
        ax_train.plot(range(1, len(smooth) + 1), smooth, label=label, lw=1, color=color)
        steps = [s for s, _ in next(iter(seeds.values()))["val"]]
        vals = list(zip(*([v for _, v in r["val"]] for r in seeds.values())))  # per eval point, one per seed
        ax_val.plot(steps, [sum(v) / len(v) for v in vals], "o-", label=label, ms=3, lw=1, color=color)
        if len(seeds) > 1:
            ax_val.fill_between(steps, [min(v) for v in vals], [max(v) for v in vals], color=color, alpha=0.15, lw=0)
        paired = [s for s in seeds if s in fp32]
        if paired:  # % above the fp32 run of the same seed, per eval point
            gaps = list(zip(*([100 * (v / b - 1) for (_, v), (_, b) in zip(seeds[s]["val"], fp32[s]["val"])] for s in paired)))
            ax_gap.plot(steps, [sum(g) / len(g) for g in gaps], "o-", label=f"{name} ({len(paired)})", ms=3, lw=1, color=color)
            if len(paired) > 1:
                ax_gap.fill_between(steps, [min(g) for g in gaps], [max(g) for g in gaps], color=color, alpha=0.15, lw=0)
    ax_train.set(xlabel="step", ylabel="train loss (running mean)", title="training loss")
    ax_val.set(xlabel="step", ylabel="validation loss", title="validation loss")
    finals = [r["val"][-1][1] for r in runs.values()]
    ax_val.set_ylim(min(finals) - 0.1, max(finals) + 0.6)
    ax_val.legend(fontsize=8)
    ax_gap.set(xlabel="step", ylabel="val loss vs fp32, same seed (%)",
               title="validation loss against fp32 (mean over seeds; min..max shaded)")
    ax_gap.axhline(0, color="k", lw=0.5)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def quality_tables(runs: dict[tuple[str, int], dict]) -> tuple[str, str]:
    """Per run: final val loss against the fp32 run of the same seed; across seeds: mean, min and max of that gap."""
    base = {seed: r["val"][-1][1] for (name, seed), r in runs.items() if name == "fp32"}
    per_run, gaps = [], {}
    for (name, seed), r in runs.items():
        final = r["val"][-1][1]
        gap = final / base[seed] - 1 if seed in base else None
        target = TARGETS.get(name)
        if gap is not None:
            gaps.setdefault(name, []).append(gap)
        met = "" if target is None or gap is None else ("yes" if gap <= target else "no")
        per_run.append([name, str(seed), r.get("bf16_compute", "") if "bf16 params" in name else "", f"{final:.4f}",
                        "no fp32 run" if gap is None else f"{100 * gap:+.2f}%",
                        "" if target is None else f"≤ {100 * target:.0f}%", met, f"{r['seconds']:.0f}"])
    runs_table = C.table(["variant", "seed", "bf16 compute", "final val loss", "vs fp32 (same seed)", "target", "met",
                          "seconds"], per_run)
    rows = []
    for name, seeds in by_variant(runs).items():
        finals = [r["val"][-1][1] for r in seeds.values()]
        g, target = gaps.get(name, []), TARGETS.get(name)
        pct = (lambda x: f"{100 * x:+.2f}%") if g else (lambda x: "")  # noqa: E731
        met = "" if target is None or not g else (f"{sum(x <= target for x in g)}/{len(g)} seeds")
        rows.append([name, ", ".join(map(str, seeds)), f"{sum(finals) / len(finals):.4f}",
                     f"{min(finals):.4f} .. {max(finals):.4f}", pct(sum(g) / len(g)) if g else "",
                     f"{pct(min(g))} .. {pct(max(g))}" if g else "", "" if target is None else f"≤ {100 * target:.0f}%", met])
    seeds_table = C.table(["variant", "seeds", "mean final val loss", "min .. max", "mean vs fp32", "min .. max vs fp32",
                           "target", "met"], rows)
    return runs_table, seeds_table


# --------------------------------------------------------------------------- #


def name_of(tag: str) -> str:
    return f"lowprec-{tag}" if tag else "lowprec"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--size", type=float, default=100e6, help="params for the bytes and step-time parts")
    parser.add_argument("--tensors", type=int, default=100, help="tensors the --size params are split into")
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--steps", type=int, default=4 * demo_config().steps, help="training steps per variant")
    parser.add_argument("--eval-every", type=int, default=0, help="default: steps / 8")
    parser.add_argument("--val-batches", type=int, default=8)
    parser.add_argument("--no-compile", action="store_true", help="train eagerly (compiling 5 variants takes minutes on a CPU)")
    parser.add_argument("--skip", nargs="*", default=[], choices=["bytes", "timing", "stores", "training", "peers"])
    parser.add_argument("--moments", nargs="*", default=list(MOMENTS), choices=list(MOMENTS),
                        help="the step-time contenders, fp32 among them (the ratios are to it)")
    parser.add_argument("--threads", type=int, default=0, help="torch threads for the timing parts (default: torch's)")
    parser.add_argument("--only", nargs="*", default=None, help="train only these variants (names as printed)")
    parser.add_argument("--merge", nargs="*", default=[], type=Path,
                        help="training JSONs of runs split over processes (same settings, e.g. --only), joined into "
                             "this run's table and plot (variants this run trains win)")
    parser.add_argument("--seed", type=int, default=0, help="model init and batch order (validation batches stay fixed)")
    parser.add_argument("--bf16-compute", choices=["bfloat16", "float32"], default=None,
                        help="the forward/backward dtype of the bf16-param variants (ours and the peers'): bfloat16 "
                             "(default on CUDA) or float32, the bf16-stored params cast up (default on CPU, which has no "
                             "bf16 matmul units here); the params stay bf16 and the optimizer updates them in bf16 either way")
    parser.add_argument("--check-compute", type=int, default=0, metavar="STEPS",
                        help="before training: compare --bf16-compute float32 with a real bf16 forward/backward on the "
                             "bf16 weights STEPS steps in (loss and grads on a few batches)")
    parser.add_argument("--tag", default="", help="results as <date>-lowprec-<tag>-<device>.* (parts run apart keep apart files)")
    args = parser.parse_args()
    if args.check_compute < 0 or args.seed < 0:
        parser.error(f"--check-compute and --seed take a count >= 0, got {args.check_compute} and {args.seed}")
    device = torch.device(args.device)
    numel = int(args.size)
    body: list[str] = []

    if "bytes" not in args.skip:
        print(f"state bytes, AdamW over {numel / 1e6:.0f}M params", flush=True)
        params = {f"g{i}": t for i, t in enumerate(make_leaves(numel, args.tensors, device, seed=0))}
        sizes = state_bytes(params, device)
        del params
        rows = []
        for name, s in sizes.items():
            ratio = s["storage"] / sizes["fp32"]["storage"]
            alloc = "" if s["allocated"] is None else f"{s['allocated'] / 1e6:.1f}"
            rows.append([name, f"{s['storage'] / 1e6:.1f}", alloc, f"{ratio:.3f}", f"{s['storage'] / numel:.3f}"])
            print(f"  {name:7s} {s['storage'] / 1e6:9.1f} MB  {ratio:.3f}x fp32")
        body.append(f"## State bytes (AdamW, {numel / 1e6:.0f}M params in {args.tensors} tensors)\n\n" + C.table(
            ["moments", "storage MB", "CUDA allocated MB", "ratio to fp32", "bytes/param"], rows))

    if "fp32" not in args.moments:
        parser.error("--moments must include fp32 (the ratios are to it)")
    args.moments = ["fp32", *(m for m in args.moments if m != "fp32")]
    if args.threads:
        torch.set_num_threads(args.threads)
    if "timing" not in args.skip:
        print(f"step time, compiled donated make_update, {numel / 1e6:.0f}M params", flush=True)
        times, first = step_times(numel, args.tensors, device, args.reps, args.moments)
        rows = []
        for name, t in times.items():
            rows.append([name, f"{1e3 * t:.1f}", f"{t / times['fp32']:.3f}", f"{STEP_BYTES[name] * numel / t / 1e9:.2f}",
                         f"{first[name]:.1f}"])
            print(f"  {name:13s} {1e3 * t:8.1f} ms  {t / times['fp32']:.3f}x fp32")
        body.append(f"## Step time (AdamW, compiled and donated, {numel / 1e6:.0f}M params in {args.tensors} tensors, median of {args.reps})\n\n" + C.table(
            ["moments", "ms/step", "ratio to fp32", "GB/s", "first call s"], rows))

    if "stores" not in args.skip:
        print(f"AdamW's elementwise step on one buffer of {numel / 1e6:.0f}M, moments stored each way", flush=True)
        costs = store_costs(numel, device, args.reps)
        near = costs["nearest (.to)"]
        rows = [[k, f"{1e3 * t:.1f}", f"{t / costs['fp32']:.3f}", f"{t / near:.3f}"] for k, t in costs.items()]
        for row in rows:
            print("  " + "  ".join(row))
        body.append(f"## What the bf16 store costs (AdamW's elementwise step on one flat buffer of {numel / 1e6:.0f}M, "
                    f"compiled, median of {args.reps})\n\n"
                    + C.table(["μ, ν stored as", "ms/step", "ratio to fp32", "ratio to nearest"], rows))

    if "training" not in args.skip:
        cfg = demo_config()
        tokens = stdlib_corpus(cfg.data.max_bytes)
        # Batch order from --seed; the validation batches are the same for every seed.
        data = ByteCorpus(tokens, seq_len=cfg.model.block_size, batch_size=cfg.batch_size, seed=cfg.seed + args.seed)
        held = ByteCorpus(tokens, seq_len=cfg.model.block_size, batch_size=cfg.batch_size, seed=cfg.seed)
        val = [{k: v.to(device) for k, v in held.batch(i, split="val").items()} for i in range(args.val_batches)]
        eval_every = args.eval_every or max(1, args.steps // 8)
        bf16_compute = args.bf16_compute or ("bfloat16" if device.type == "cuda" else "float32")
        compute = {"bfloat16": BF16, "float32": torch.float32}[bf16_compute]
        stem = f"{time.strftime('%Y-%m-%d')}-{name_of(args.tag)}-{device.type}"
        C.RESULTS.mkdir(parents=True, exist_ok=True)
        runs: dict[tuple[str, int], dict] = {}

        def save() -> None:  # keyed "variant" for one seed, "variant | seed N" for several
            one = len({seed for _, seed in runs}) == 1
            (C.RESULTS / f"{stem}.json").write_text(json.dumps(
                {(n if one else f"{n} | seed {seed}"): {"variant": n, "seed": seed, **r} for (n, seed), r in runs.items()},
                indent=0))

        def done(name: str) -> None:  # the JSON grows variant by variant, so a run cut short keeps what it finished
            r = runs[(name, args.seed)]
            print(f"  val loss {r['val'][-1][1]:.4f} ({r['seconds']:.0f} s)", flush=True)
            r.update(seed=args.seed, bf16_compute=bf16_compute)
            save()

        if args.check_compute:
            print(f"--bf16-compute float32 vs bfloat16 on the same bf16 weights ({args.check_compute} steps in)", flush=True)
            rows = compute_check(data, held, args.check_compute, device, args.seed)
            body.append(f"## bf16 compute check: the same bf16 weights (after {args.check_compute} emulated bf16 params + "
                        "Kahan steps), loss and bf16 grads from a real bf16 forward/backward and from the float32 "
                        "compute of `--bf16-compute float32`\n\n" + C.table(
                            ["batch", "loss, bf16 compute", "loss, float32 compute", "difference", "grad cosine",
                             "grad rel. L2 difference"], rows))
        wanted = (lambda name: True) if args.only is None else (lambda name: name in args.only)  # noqa: E731
        for name in filter(wanted, VARIANTS):
            print(f"training: {name} (seed {args.seed})", flush=True)
            runs[(name, args.seed)] = train_ours(name, data, val, args.steps, eval_every, device, not args.no_compile,
                                                 args.seed, compute)
            done(name)
        if "peers" not in args.skip:
            for name, make in peers(args.steps).items():
                if wanted(name):
                    print(f"training: {name} (seed {args.seed})", flush=True)
                    runs[(name, args.seed)] = train_peer(make, data, val, args.steps, eval_every, device, args.seed, compute)
                    done(name)
        for path in args.merge:
            for key, r in json.loads(path.read_text()).items():  # JSONs before --seed: keyed by variant, seed 0
                runs.setdefault((r.get("variant", key), r.get("seed", 0)), r)
            print(f"merged: {path}")
        names = [*VARIANTS, *(n for n, _ in runs if n not in VARIANTS)]
        runs = {k: runs[k] for k in sorted(runs, key=lambda k: (names.index(k[0]), k[1]))}
        if runs and not any(name == "fp32" for name, _ in runs):
            print("no fp32 run to compare with (train it or --merge its JSON): JSON written, no table")
        elif runs:
            runs_table, seeds_table = quality_tables(runs)
            plot(runs, C.RESULTS / f"{stem}.png")
            if args.merge:  # the merged runs' JSON, with this run's, in one file
                save()
            several = len({seed for _, seed in runs}) > 1
            body.append(
                f"## Training quality (demo GPT, {args.steps} steps, AdamW peak lr {PEAK_LR}, warmup + cosine, "
                f"clip {CLIP}; val loss over {args.val_batches} fixed batches, the same for every seed)\n\n"
                + (f"### Across seeds\n\n{seeds_table}\n\n### Per run\n\n" if several else "")
                + runs_table
                + f"\n\nbf16 compute: `float32` = the params are stored, and updated by the optimizer, in bf16; the forward "
                "and backward read them cast to float32 (bf16 values, float32 activations, grads rounded back to bf16 at "
                "the cast); `bfloat16` = a real bf16 forward and backward.\n\n"
                f"Curves: `{stem}.png`; per-step train and val losses: `{stem}.json`."
            )
            print(seeds_table if several else runs_table)

    if body:
        path = C.write_result(name_of(args.tag), "Low-precision optimizer state and bf16 params", device, "\n\n".join(body))
        print(f"results: {path}")


if __name__ == "__main__":
    main()
