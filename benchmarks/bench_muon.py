"""ps.muon (`ps.make_update(compile=True, donate=True)`) against torch.optim.Muon, side by side.

Transformer-shaped matrices: per layer 4 attention matrices (d × d) and 2 MLP matrices
(4d × d and d × 4d). Prints ms per optimizer step and the ratio theirs / ours.

    python benchmarks/bench_muon.py --layers 12 --dim 768          # the issue's shape (GPU-sized)
    python benchmarks/bench_muon.py --layers 4 --dim 256 --steps 5 # what a 2-core CPU can time
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time

import torch

import purestep.core as ps


def shapes(layers: int, dim: int) -> dict[str, tuple[int, int]]:
    out = {}
    for i in range(layers):
        for name in ("q", "k", "v", "o"):
            out[f"layers.{i}.attn.{name}.weight"] = (dim, dim)
        out[f"layers.{i}.mlp.up.weight"] = (4 * dim, dim)
        out[f"layers.{i}.mlp.down.weight"] = (dim, 4 * dim)
    return out


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def time_steps(step, steps: int, warmup: int, device: torch.device) -> list[float]:
    for _ in range(warmup):
        step()
    sync(device)
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        step()
        sync(device)
        times.append(1e3 * (time.perf_counter() - t0))
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--ns-dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--no-compile", action="store_true")
    args = parser.parse_args()
    device = torch.device(args.device)
    ns_dtype = getattr(torch, args.ns_dtype)
    g = torch.Generator(device="cpu").manual_seed(0)
    spec = shapes(args.layers, args.dim)
    params = {k: torch.randn(s, generator=g).div_(s[1] ** 0.5).to(device) for k, s in spec.items()}
    grads = {k: torch.randn(s, generator=g).to(device) for k, s in spec.items()}

    # theirs: torch.optim.Muon (one matrix at a time, bf16 Newton-Schulz)
    tensors = [torch.nn.Parameter(p.clone()) for p in params.values()]
    for t, gr in zip(tensors, grads.values()):
        t.grad = gr.clone()
    ref = torch.optim.Muon(tensors, lr=0.02, weight_decay=0.01, momentum=0.95, nesterov=True)
    theirs = time_steps(ref.step, args.steps, args.warmup, device)

    # ours: the compiled, donated update (make_update), as a training loop runs it
    opt = ps.muon(lr=0.02, weight_decay=0.01, ns_dtype=ns_dtype)
    ours_params = {k: v.clone() for k, v in params.items()}
    state = opt.init(ours_params)
    update = ps.make_update(opt, compile=not args.no_compile, donate=True)

    def ours_step() -> None:
        update(ours_params, grads, state)

    t0 = time.perf_counter()
    ours_step()
    sync(device)
    compile_s = time.perf_counter() - t0
    ours = time_steps(ours_step, args.steps, args.warmup, device)

    n = sum(p.numel() for p in params.values())
    ours_ms, theirs_ms = statistics.median(ours), statistics.median(theirs)
    print(f"torch {torch.__version__}, {platform.processor() or platform.machine()}, device {device}, "
          f"threads {torch.get_num_threads()}")
    print(f"{args.layers} layers x (4 x {args.dim}x{args.dim} + {4 * args.dim}x{args.dim} + {args.dim}x{4 * args.dim}), "
          f"{len(spec)} matrices, {n / 1e6:.1f}M params; ns_dtype ours {args.ns_dtype}, theirs bfloat16")
    print(f"first call (compile) {compile_s:.1f} s; median of {args.steps} steps after {args.warmup} warmup")
    print(f"{'':24s}{'ms/step':>10s}")
    print(f"{'torch.optim.Muon':24s}{theirs_ms:10.1f}")
    print(f"{'ps.muon':24s}{ours_ms:10.1f}")
    print(f"ratio theirs/ours: {theirs_ms / ours_ms:.2f}x")


if __name__ == "__main__":
    main()
