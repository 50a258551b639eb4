"""DiLoCo's cost, side by side in one process: the compiled donated step of `ps.diloco(adamw)`
against AdamW's alone (between syncs, and on a sync step), and the bytes a worker sends per
sync with DiLoCo's mean against SparseLoCo's compressed form, measured on what the exchange
function is handed.

    python benchmarks/bench_diloco.py                # 10M fp32 params in 40 tensors
    python benchmarks/bench_diloco.py --out auto     # also writes benchmarks/results/<date>-diloco-cpu.md

Between syncs a DiLoCo step runs the inner update and the `torch.cond` that keeps the anchor
and the outer state: its physical floor is the inner step's bytes (AdamW: 28 B/param), and
whatever the cond's untaken branch copies comes on top. The in-place `add_` bandwidth of the
same run is the yardstick for both.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import _common as C  # noqa: E402

import purestep.core as ps  # noqa: E402


def leaves(numel: int, n: int, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    cols = [256, 512, 1024, 64]
    return {f"p{i}": torch.randn(max(1, numel // n // cols[i % 4]), cols[i % 4], generator=g) for i in range(n)}


def payload_bytes(tree) -> int:
    return sum(x.numel() * x.element_size() for x in ps.tree_leaves(tree))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", type=float, default=10e6)
    ap.add_argument("--tensors", type=int, default=40)
    ap.add_argument("--sync-every", type=int, default=1000, help="H: large, so the timed steps are between syncs")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    device = torch.device("cpu")
    C.warm_compiler(device)
    numel, n = int(a.size), a.tensors
    grads = leaves(numel, n, seed=1)
    inner = ps.adamw(1e-3, weight_decay=0.01)
    outer = ps.sgd(0.7, momentum=0.9, nesterov=True)
    contenders = {
        "adamw alone": inner,
        "diloco(adamw)": ps.diloco(inner, outer, a.sync_every),
        "streaming diloco(adamw), 4 fragments": ps.diloco(inner, outer, a.sync_every, fragments=4),
    }
    fns, first = {}, {}
    for name, t in contenders.items():
        params = leaves(numel, n, seed=0)
        state = t.init(params)
        update = ps.make_update(t, compile=True, donate=True)
        fns[name] = lambda u=update, p=params, s=state: u(p, grads, s)
        first[name] = C.first_call(fns[name], device)
    x, y = torch.randn(numel), torch.randn(numel)
    fns["in-place add_ (bandwidth)"] = lambda: x.add_(y, alpha=1e-3)
    times = C.interleaved(fns, device, reps=a.reps)
    # A sync step: H = 1, every call syncs (the outer step and the landing on the anchor).
    sync_t = ps.diloco(inner, outer, 1)
    params = leaves(numel, n, seed=0)
    state = sync_t.init(params)
    sync_update = ps.make_update(sync_t, compile=True, donate=True)
    first["diloco(adamw), every step a sync"] = C.first_call(lambda: sync_update(params, grads, state), device)
    times.update(
        C.interleaved(
            {"diloco(adamw), every step a sync": lambda: sync_update(params, grads, state)}, device, reps=a.reps
        )
    )

    # Bytes one worker hands its exchange per sync, on a 2-D model of the same size.
    sent: dict[str, int] = {}
    for name, kwargs in {
        "DiLoCo (reduce: the mean)": {"reduce": lambda tree: (sent.__setitem__("mean", payload_bytes(tree)), tree)[1]},
        "SparseLoCo, density 1%, 2 bits": {
            "compression": ps.TopK(density=0.01, bits=2),
            "gather": lambda tree: (
                sent.__setitem__("sparse", payload_bytes(tree)),
                ps.tree_map(lambda z: z.unsqueeze(0), tree),
            )[1],
        },
    }.items():
        t = ps.diloco(ps.sgd(1e-3), ps.sgd(1.0), 1, **kwargs)
        p = leaves(numel, n, seed=0)
        t.update(grads, t.init(p), p)
    add_bytes = 12 * numel
    bw = add_bytes / times["in-place add_ (bandwidth)"] / 1e9
    rows = []
    base = times["adamw alone"]
    for name, s in times.items():
        rows.append([name, f"{s * 1e3:.2f}", f"{s / base:.3f}", f"{first.get(name, 0):.1f}" if name in first else ""])
    body = C.table(["contender", "ms / step (median)", "time / adamw alone", "compile s"], rows)
    body += (
        f"\n\nPhysical limit: in-place `add_` moved {bw:.1f} GB/s; an fp32 AdamW step moves 28 B/param, "
        f"{28 * numel / bw / 1e9 * 1e3:.2f} ms at that bandwidth. Between syncs DiLoCo's floor is that same step.\n\n"
        + C.table(
            ["exchange per sync", "bytes sent by one worker", "of DiLoCo's"],
            [
                ["DiLoCo (reduce: the mean)", f"{sent['mean']:,}", "1.000"],
                ["SparseLoCo, density 1%, 2 bits", f"{sent['sparse']:,}", f"{sent['sparse'] / sent['mean']:.4f}"],
            ],
        )
        + f"\n\n{numel / 1e6:.0f}M fp32 params in {n} tensors; the timed DiLoCo steps are between syncs (H = {a.sync_every}). "
        "SparseLoCo's bytes are what `gather` is handed: an int32 place in its tile per kept entry (NCCL and gloo carry no int16), a uint8 code "
        "(2 bits used: packing four per byte would cut a further 0.75 B per kept entry), a 4-entry table per tensor."
    )
    print(body)
    if a.out:
        print(C.write_result("diloco", "DiLoCo: the step between syncs and the bytes of a sync", device, body))


if __name__ == "__main__":
    main()
