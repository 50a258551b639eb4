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
import purestep.core._precision as lp  # noqa: E402
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


def make_model(dtype: torch.dtype, device: torch.device) -> torch.nn.Module:
    cfg = demo_config().model
    torch.manual_seed(0)
    model = GPT(vocab_size=cfg.vocab_size, dim=cfg.n_embd, n_layers=cfg.n_layer, n_heads=cfg.n_head, seq_len=cfg.block_size)
    return model.to(device=device, dtype=dtype)


def val_loss(model: torch.nn.Module, val: list) -> float:
    with torch.no_grad():
        total = sum(torch.nn.functional.cross_entropy(model(b["input"]).flatten(0, 1).float(), b["target"].flatten())
                    for b in val)
    return float(total) / len(val)


def train_ours(name: str, data: ByteCorpus, val: list, steps: int, eval_every: int, device, compile: bool) -> dict:
    dtype, kw, compensated = VARIANTS[name]
    model = make_model(dtype, device)
    apply_fn, params, buffers = ps.functional_model(model)
    opt = ours(kw, compensated, steps)

    def loss_fn(p, batch):
        logits, _ = apply_fn(p, buffers, batch["input"])
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), batch["target"].flatten())

    step = ps.make_step(loss_fn, opt, compile=compile, donate=True)
    state = opt.init(params)
    return _loop(lambda b: step(params, state, b)[2]["loss"], model, data, val, steps, eval_every, device)


def _loop(run_step: Callable, model, data: ByteCorpus, val: list, steps: int, eval_every: int, device) -> dict:
    train, curve = [], [(0, val_loss(model, val))]
    t = time.perf_counter()
    for i in range(steps):
        batch = {k: v.to(device) for k, v in data.batch(i).items()}
        train.append(float(run_step(batch)))
        if (i + 1) % eval_every == 0 or i + 1 == steps:
            curve.append((i + 1, val_loss(model, val)))
    return {"train": train, "val": curve, "seconds": time.perf_counter() - t}


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


def train_peer(make: tuple, data: ByteCorpus, val: list, steps: int, eval_every: int, device) -> dict:
    dtype, factory = make
    model = make_model(dtype, device)
    opt = factory(model.parameters())
    lr_at = schedule(steps)
    counter = [0]

    def run_step(batch: dict) -> torch.Tensor:
        for group in opt.param_groups:
            group["lr"] = float(lr_at(counter[0]))
        counter[0] += 1
        logits = model(batch["input"])
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), batch["target"].flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    return _loop(run_step, model, data, val, steps, eval_every, device)


def plot(runs: dict[str, dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_train, ax_val) = plt.subplots(1, 2, figsize=(12, 4.5))
    for name, r in runs.items():
        k = max(1, len(r["train"]) // 50)  # a running mean over ~2% of the run
        smooth = [sum(r["train"][max(0, i - k + 1) : i + 1]) / len(r["train"][max(0, i - k + 1) : i + 1])
                  for i in range(len(r["train"]))]
        ax_train.plot(range(1, len(smooth) + 1), smooth, label=name, lw=1)
        ax_val.plot(*zip(*r["val"]), "o-", label=name, ms=3, lw=1)
    ax_train.set(xlabel="step", ylabel="train loss (running mean)", title="training loss")
    ax_val.set(xlabel="step", ylabel="validation loss", title="validation loss")
    finals = [r["val"][-1][1] for r in runs.values()]
    ax_val.set_ylim(min(finals) - 0.1, max(finals) + 0.6)
    ax_val.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


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
    parser.add_argument("--tag", default="", help="results as <date>-lowprec-<tag>-<device>.* (parts run apart keep apart files)")
    args = parser.parse_args()
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
        data = ByteCorpus(stdlib_corpus(cfg.data.max_bytes), seq_len=cfg.model.block_size, batch_size=cfg.batch_size,
                          seed=cfg.seed)
        val = [{k: v.to(device) for k, v in data.batch(i, split="val").items()} for i in range(args.val_batches)]
        eval_every = args.eval_every or max(1, args.steps // 8)
        stem = f"{time.strftime('%Y-%m-%d')}-{name_of(args.tag)}-{device.type}"
        C.RESULTS.mkdir(parents=True, exist_ok=True)
        runs = {}

        def done(name: str) -> None:  # the JSON grows variant by variant, so a run cut short keeps what it finished
            print(f"  val loss {runs[name]['val'][-1][1]:.4f} ({runs[name]['seconds']:.0f} s)", flush=True)
            (C.RESULTS / f"{stem}.json").write_text(json.dumps(
                {n: {"val": r["val"], "train": r["train"], "seconds": r["seconds"]} for n, r in runs.items()}, indent=0))

        wanted = (lambda name: True) if args.only is None else (lambda name: name in args.only)  # noqa: E731
        for name in filter(wanted, VARIANTS):
            print(f"training: {name}", flush=True)
            runs[name] = train_ours(name, data, val, args.steps, eval_every, device, not args.no_compile)
            done(name)
        if "peers" not in args.skip:
            for name, make in peers(args.steps).items():
                if wanted(name):
                    print(f"training: {name}", flush=True)
                    runs[name] = train_peer(make, data, val, args.steps, eval_every, device)
                    done(name)
        for path in args.merge:
            for name, r in json.loads(path.read_text()).items():
                runs.setdefault(name, r)
            print(f"merged: {path}")
        order = [*VARIANTS, *(n for n in runs if n not in VARIANTS)]
        runs = {n: runs[n] for n in order if n in runs}
        if "fp32" not in runs:
            print("no fp32 run to compare with (train it or --merge its JSON): JSON written, no table")
            return
        base = runs["fp32"]["val"][-1][1]
        rows = []
        for name, r in runs.items():
            final = r["val"][-1][1]
            gap = final / base - 1
            target = TARGETS.get(name)
            met = "" if target is None else ("yes" if gap <= target else "no")
            rows.append([name, f"{final:.4f}", f"{100 * gap:+.2f}%", "" if target is None else f"≤ {100 * target:.0f}%",
                         met, f"{r['seconds']:.0f}"])
        plot(runs, C.RESULTS / f"{stem}.png")
        if args.merge:  # the merged runs' JSON, with this run's, in one file
            (C.RESULTS / f"{stem}.json").write_text(json.dumps(runs, indent=0))
        body.append(
            f"## Training quality (demo GPT, {args.steps} steps, AdamW peak lr {PEAK_LR}, warmup + cosine, "
            f"clip {CLIP}; val loss over {args.val_batches} fixed batches)\n\n"
            + C.table(["variant", "final val loss", "vs fp32", "target", "met", "seconds"], rows)
            + f"\n\nCurves: `{stem}.png`; per-step train and val losses: `{stem}.json`."
        )
        print(C.table(["variant", "final val loss", "vs fp32", "target", "met", "seconds"], rows))

    if body:
        path = C.write_result(name_of(args.tag), "Low-precision optimizer state and bf16 params", device, "\n\n".join(body))
        print(f"results: {path}")


if __name__ == "__main__":
    main()
