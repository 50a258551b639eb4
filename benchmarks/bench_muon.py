"""ps.muon (`ps.make_update(compile=True, donate=True)`) against torch.optim.Muon, side by side.

Transformer-shaped matrices: per layer 4 attention matrices (d × d) and 2 MLP matrices
(4d × d and d × 4d). The flat path stacks same-shape matrices into one (k, m, n) buffer
each, so Newton-Schulz runs as one batched matmul chain per shape. Prints ms per optimizer
step (median of interleaved steps) and the ratio theirs / ours, and writes
`results/<date>-muon-<device>.md`. Target (issue 12): at least 1.5x torch.optim.Muon on
CUDA at 8 layers of 1024.

    python benchmarks/bench_muon.py --layers 8 --dim 1024 --device cuda   # the issue's shape
    python benchmarks/bench_muon.py --layers 4 --dim 256 --steps 5        # what a 2-core CPU can time
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import _common as C  # noqa: E402

import purestep.core as ps  # noqa: E402


def shapes(layers: int, dim: int) -> dict[str, tuple[int, int]]:
    out = {}
    for i in range(layers):
        for name in ("q", "k", "v", "o"):
            out[f"layers.{i}.attn.{name}.weight"] = (dim, dim)
        out[f"layers.{i}.mlp.up.weight"] = (4 * dim, dim)
        out[f"layers.{i}.mlp.down.weight"] = (dim, 4 * dim)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--steps", type=int, default=5, help="timed steps of each contender (interleaved)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--ns-dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--no-compile", action="store_true")
    parser.add_argument("--no-write", action="store_true")
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

    # ours: the compiled, donated update (make_update), as a training loop runs it
    opt = ps.muon(lr=0.02, weight_decay=0.01, ns_dtype=ns_dtype)
    ours_params = {k: v.clone() for k, v in params.items()}
    state = opt.init(ours_params)
    update = ps.make_update(opt, compile=not args.no_compile, donate=True)

    def ours_step() -> None:
        update(ours_params, grads, state)

    if not args.no_compile:
        C.warm_compiler(device)
    compile_s = C.first_call(ours_step, device)
    times = C.interleaved({"torch.optim.Muon": ref.step, "ps.muon": ours_step}, device, warmup=args.warmup, reps=args.steps)
    theirs_ms, ours_ms = 1e3 * times["torch.optim.Muon"], 1e3 * times["ps.muon"]
    layout = update.layout() if hasattr(update, "layout") else None
    n = sum(p.numel() for p in params.values())
    body = (
        f"{args.layers} layers x (4 x {args.dim}x{args.dim} + {4 * args.dim}x{args.dim} + {args.dim}x{4 * args.dim}): "
        f"{len(spec)} matrices, {n / 1e6:.1f}M params; ns_dtype ours {args.ns_dtype}, theirs bfloat16; "
        f"{'compiled' if not args.no_compile else 'eager'}, "
        f"{len(layout) if layout else 'no'} flat buffers; median of {args.steps} interleaved steps after {args.warmup} warmup\n\n"
        + C.table(
            ["contender", "ms / step", "first call s"],
            [["torch.optim.Muon", f"{theirs_ms:.2f}", ""], ["ps.muon", f"{ours_ms:.2f}", f"{compile_s:.1f}"]],
        )
        + f"\n\ntheirs / ours: {theirs_ms / ours_ms:.2f}x (target >= 1.5x on CUDA at 8 layers of 1024)\n"
    )
    print(body)
    if not args.no_write:
        print(C.write_result("muon", "ps.muon vs torch.optim.Muon", device, body))


if __name__ == "__main__":
    main()
