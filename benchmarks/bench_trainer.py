"""The Trainer's overhead, side by side: `Trainer.fit` against the bare loop it stands for,
on the same GPT, the same batches and the same transform.

    python benchmarks/bench_trainer.py                     # CUDA: a 12-layer 768-wide GPT, compiled
    python benchmarks/bench_trainer.py --device cpu        # small, not compiled: minutes on 2 cores

The bare loop is the one `tests/api/test_trainer.py` proves bitwise equal to the Trainer:
forward, `loss.backward()`, grads scaled to the per-token mean, then `ps.make_update`
(donated; compiled when the model is) of `apply_if_finite(clip + AdamW with a cosine
schedule injected)`. The Trainer adds its bookkeeping: token counting, the
progress display, a metrics line every `log_every` steps (the only host sync), signal
handlers. Each timed rep runs `--steps` steps of one contender then of the other
(round-robin), ending in a device sync; tokens/s is the median over reps.
Target on CUDA (issue 13): the Trainer within 5% of the bare loop.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import msgspec
import torch

sys.path.insert(0, str(Path(__file__).parent))
import _common as C  # noqa: E402

import purestep.core as ps  # noqa: E402
from purestep.api import TrainConfig, Trainer, apply_overrides  # noqa: E402
from purestep.api.models import build_model, lm_loss  # noqa: E402

SIZES = {
    "cuda": ["model.n_layer=12", "model.n_head=12", "model.n_embd=768", "model.block_size=1024", "batch_size=16"],
    "cpu": ["model.n_layer=2", "model.n_head=4", "model.n_embd=128", "model.block_size=128", "batch_size=8"],
}


class Batches:
    """A step-indexed source over a few batches made up front, on the device: data costs nothing to either side."""

    def __init__(self, cfg: TrainConfig, device: torch.device, n: int = 4) -> None:
        g = torch.Generator().manual_seed(0)
        shape = (cfg.batch_size, cfg.model.block_size + 1)
        self.windows = [torch.randint(0, 256, shape, generator=g).to(device) for _ in range(n)]

    def batch(self, step: int, rank: int = 0, world: int = 1, split: str = "train") -> dict:
        w = self.windows[step % len(self.windows)]
        rows = w.shape[0] // world
        w = w[rank * rows : (rank + 1) * rows]
        return {"input": w[:, :-1], "target": w[:, 1:]}


def trainer_contender(cfg: TrainConfig, device: torch.device, steps: int):
    t = Trainer(config=cfg, data=Batches(cfg, device), progress=False, device=str(device))

    def run() -> None:
        # fit() trains `steps` more; the transform (and its schedule) was built for the whole run.
        t.config = msgspec.structs.replace(cfg, steps=t.step + steps)
        t.fit()

    return run


def bare_contender(cfg: TrainConfig, device: torch.device, steps: int):
    torch.manual_seed(cfg.seed)
    model = build_model(cfg.model).to(device)
    forward = torch.compile(model) if cfg.compile else model
    opt = ps.apply_if_finite(cfg.build_optimizer())
    update = ps.make_update(opt, compile=cfg.compile, donate=True)
    params = {k: p.detach() for k, p in model.named_parameters()}
    state = opt.init(params)
    data, step = Batches(cfg, device), [0]
    bf16 = cfg.precision == "bf16"

    def run() -> None:
        for _ in range(steps):
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
                loss, n = lm_loss(forward, data.batch(step[0]))
            loss.backward()
            grads = {k: p.grad for k, p in model.named_parameters()}
            torch._foreach_mul_(list(grads.values()), (1.0 / n.double()).float())
            update(params, grads, state)
            model.zero_grad(set_to_none=True)
            step[0] += 1

    return run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--steps", type=int, default=None, help="steps per timed rep (default: 20 CUDA, 5 CPU)")
    ap.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                    help="compile model and update (default: on CUDA only)")
    ap.add_argument("--set", dest="overrides", action="append", default=[], help="a TrainConfig override")
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args()
    device = torch.device(args.device)
    steps = args.steps or (20 if device.type == "cuda" else 5)
    compile_ = device.type == "cuda" if args.compile is None else args.compile
    precision = "bf16" if device.type == "cuda" else "fp32"
    cfg = apply_overrides(TrainConfig(), [
        *SIZES[device.type], f"compile={compile_}", f"precision={precision}", f"log_every={steps}",
        "optimizer.name=adamw", "optimizer.lr=6e-4", "optimizer.kwargs.weight_decay=0.1",
        "schedule.name=cosine", "schedule.warmup_steps=none", "steps=100000", *args.overrides,
    ])
    fns = {"bare make_update loop": bare_contender(cfg, device, steps), "Trainer.fit": trainer_contender(cfg, device, steps)}
    first = {name: C.first_call(fn, device) for name, fn in fns.items()}
    seconds = C.interleaved(fns, device, warmup=1, reps=args.reps)
    tokens = steps * cfg.batch_size * cfg.model.block_size
    ref = next(iter(fns))
    rows = [[name, f"{sec / steps * 1e3:.1f}", f"{tokens / sec:,.0f}", f"{seconds[ref] / sec:.3f}", f"{first[name]:.1f}"]
            for name, sec in seconds.items()]
    n_params = sum(p.numel() for p in build_model(cfg.model).parameters())
    body = (
        f"GPT {cfg.model.n_layer} layers x {cfg.model.n_embd}, {n_params / 1e6:.1f}M params, batch "
        f"{cfg.batch_size} x {cfg.model.block_size} tokens, {precision}, compile={compile_}; AdamW + clip + "
        f"cosine schedule, apply_if_finite; {args.reps} reps of {steps} steps, median.\n\n"
        + C.table(["contender", "ms / step", "tokens/s", "throughput / bare", "first rep s"], rows)
        + "\n\ntarget (CUDA): Trainer throughput / bare >= 0.95\n"
    )
    print(body)
    if not args.no_write:
        print(C.write_result("trainer", "Trainer.fit against the bare make_update loop", device, body))


if __name__ == "__main__":
    main()
