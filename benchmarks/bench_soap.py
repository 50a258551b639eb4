"""SOAP's step cost: a step between refreshes against AdamW plus the rotations, and a refresh.

    python benchmarks/bench_soap.py                      # 8 hidden 256x256 matrices + 8 vectors, 1 thread
    python benchmarks/bench_soap.py --dim 512 --out auto

Contenders, each a `make_update(donate=True)` step on the same params (eager, and the two
marked compiled with `compile=True`), timed round-robin (medians of `--reps`):
- `adamw`: `ps.adamw`, the elementwise floor of any Adam-like step;
- `rotations`: what SOAP adds between refreshes and nothing else: each matrix gradient
  rotated into its eigenbasis, the Adam direction rotated back (Q_Lᵀ·G·Q_R and back, two
  d×d Gram matrices accumulated), written as plain matmuls;
- `soap step`: a SOAP step that does not refresh (precondition_frequency larger than the run);
- `soap refresh`: a SOAP step that refreshes every time (precondition_frequency=1): one
  power-iteration step and a QR per factor on top;
- peers, where installed (`pip install -e ".[bench]"`), on the same params and grads:
  HeavyBall's `SOAP` (which compiles its step with torch.compile) and pytorch-optimizer's
  `SOAP`, a step between refreshes each; their grads are set afresh before each step
  (HeavyBall clears them), a copy of 0.5 MB.
The claim checked: soap step ≈ adamw + rotations, and a refresh costs its QRs on top, once
every `precondition_frequency` steps.
"""

from __future__ import annotations

import argparse

import torch

import purestep.core as ps
from _common import interleaved, table, write_result


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--mats", type=int, default=8)
    p.add_argument("--reps", type=int, default=15)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", default=None)
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    dev = torch.device("cpu")
    gen = torch.Generator().manual_seed(0)
    shapes = [(a.dim, a.dim)] * a.mats + [(a.dim,)] * a.mats
    params = {f"p{i}": torch.randn(s, generator=gen) for i, s in enumerate(shapes)}
    grads = {k: torch.randn(v.shape, generator=gen) for k, v in params.items()}

    def stepper(opt, compile=False):
        mine = {k: v.clone() for k, v in params.items()}
        state, step = opt.init(mine), ps.make_update(opt, compile=compile, donate=True)
        box = [mine, state]
        for _ in range(2):  # past SOAP's set-up step
            box[:] = step(box[0], {k: g.clone() for k, g in grads.items()}, box[1])

        def run():
            box[:] = step(box[0], grads, box[1])
        return run

    mats = [k for k, v in params.items() if v.dim() == 2]
    qs = {k: torch.linalg.qr(torch.randn(a.dim, a.dim, generator=gen))[0] for k in mats}
    gram = {k: torch.zeros(a.dim, a.dim) for k in mats}

    def rotations():
        for k in mats:
            g, q = grads[k], qs[k]
            rotated = q.T @ g @ q  # into the basis
            _ = q @ rotated @ q.T  # the direction back
            gram[k].lerp_(g @ g.T, 0.05)
            gram[k].lerp_(g.T @ g, 0.05)

    def peer(make):
        mine = [torch.nn.Parameter(v.clone()) for v in params.values()]
        opt = make(mine)

        def run():
            for p, g in zip(mine, grads.values()):
                p.grad = g.clone()
            opt.step()
        for _ in range(2):  # past the set-up step (and HeavyBall's compile)
            run()
        return run

    peers = {}
    try:
        import heavyball
        peers["heavyball SOAP"] = lambda ps_: heavyball.SOAP(ps_, lr=1e-3, precondition_frequency=10**9)
    except ImportError:
        print("heavyball not installed: no HeavyBall peer")
    try:
        import pytorch_optimizer
        peers["pytorch-optimizer SOAP"] = lambda ps_: pytorch_optimizer.SOAP(ps_, lr=1e-3, precondition_frequency=10**9)
    except ImportError:
        print("pytorch_optimizer not installed: no pytorch-optimizer peer")

    fns = {
        "adamw": stepper(ps.adamw(1e-3)),
        "rotations": rotations,
        "soap step": stepper(ps.soap(1e-3, precondition_frequency=10**9)),
        "soap refresh": stepper(ps.soap(1e-3, precondition_frequency=1)),
        "adamw, compiled": stepper(ps.adamw(1e-3), compile=True),
        "soap step, compiled": stepper(ps.soap(1e-3, precondition_frequency=10**9), compile=True),
        **{name: peer(make) for name, make in peers.items()},
    }
    med = interleaved(fns, dev, reps=a.reps)
    ms = {k: v * 1e3 for k, v in med.items()}
    rows = [[k, f"{ms[k]:.2f}", f"{ms[k] / ms['adamw']:.2f}", f"{ms[k] / (ms['adamw'] + ms['rotations']):.2f}"] for k in fns]
    rows.append(["adamw + rotations (the floor)", f"{ms['adamw'] + ms['rotations']:.2f}",
                 f"{(ms['adamw'] + ms['rotations']) / ms['adamw']:.2f}", "1.00"])
    n = sum(v.numel() for v in params.values())
    body = (
        f"{a.mats} matrices {a.dim}x{a.dim} + {a.mats} vectors ({n / 1e6:.2f}M params), donated steps, "
        f"{a.threads} thread(s), medians of {a.reps}, round-robin.\n\n"
        + table(["step", "ms", "x adamw", "x floor"], rows)
        + "\n\nThe floor of a step between refreshes is AdamW's elementwise work plus the rotations' matmuls (4 "
        "d×d×d products per matrix, and two Gram matrices); a refresh adds a QR and a matmul per factor, once every "
        "precondition_frequency steps (10 by default). Eagerly on the CPU SOAP's two branches per leaf are "
        "plain Python branches on the step count (a torch.cond elsewhere, where reading the count would wait "
        "for the device); as a cond the step pays on top of the floor the fresh copies a cond's outputs must "
        "be (moments, factors and bases: no output may alias an input), plain branches return theirs as they "
        "are, and compiled the copies are fused or gone. The peers run their own SOAP (HeavyBall's defaults "
        "differ from the paper's in places), timed for the same work: a step between refreshes.\n"
    )
    print(body)
    if a.out:
        print(write_result(f"soap-{a.dim}", "SOAP step cost against AdamW and its rotations", dev, body))


if __name__ == "__main__":
    main()
