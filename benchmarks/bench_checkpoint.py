"""How long a checkpoint save blocks the training loop: synchronous against in the background.

    python benchmarks/bench_checkpoint.py                       # one process, files layout
    OMP_NUM_THREADS=1 torchrun --nproc_per_node=2 benchmarks/bench_checkpoint.py --dcp   # FSDP2 shards

The trees are a GPT's params and its AdamW state (`--dim` sets the size; 384 gives 42.7M
params, 128 MiB of params and twice that of state). Each repeat saves through a
`CheckpointManager` with `background=False` and with `background=True` (interleaved), and
reports the time `save()` took (what the loop waits for) and, for the background save, the
time until its `wait()` returned (the whole write). Beside them, the physical floor of the
blocking part: copying the same bytes once in memory (`torch.Tensor.copy_` into a
preallocated buffer), measured in the same run. The disk is the machine's temporary
directory (`--dir` to pick another).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import _common as C  # noqa: E402

import purestep.core as ps  # noqa: E402
from purestep.api import distributed as D  # noqa: E402
from purestep.api.checkpoint import CheckpointManager  # noqa: E402
from purestep.api.models import GPT  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dim", type=int, default=384)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--dcp", action="store_true", help="under torchrun: FSDP2 params, the sharded DCP layout")
    ap.add_argument("--dir", default=None)
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args()
    world = D.setup("fsdp" if args.dcp else "single", "cpu")
    torch.manual_seed(0)
    model = GPT(dim=args.dim, n_layers=24, n_heads=4, seq_len=64)
    if args.dcp:
        model = D.wrap(model, world)
    params = {k: p.detach() for k, p in model.named_parameters()}
    opt = ps.adamw(1e-4)
    state = opt.init(params)
    leaves = [D.local(x) for x in ps.tree_leaves((params, state)) if x.is_floating_point()]
    nbytes = sum(x.numel() * x.element_size() for x in leaves)
    root = Path(args.dir or tempfile.mkdtemp(prefix="purestep-bench-ckpt-"))
    if args.dcp:
        root = Path(D.broadcast_object(str(root), world))
    managers = {
        bg: CheckpointManager(root / ("bg" if bg else "sync"), keep_last=1, world=world, distributed=args.dcp, background=bg)
        for bg in (False, True)
    }
    copies = [torch.empty_like(x) for x in leaves]
    times: dict[str, list[float]] = {"sync": [], "background": [], "background, whole write": [], "copy": []}
    for rep in range(args.reps + 1):  # the first repeat warms the file system and the allocator up
        for bg, manager in managers.items():
            D.barrier(world)
            t = time.perf_counter()
            manager.save(rep, params=params, opt_state=state)
            blocked = time.perf_counter() - t
            manager.wait()
            D.barrier(world)
            whole = time.perf_counter() - t
            if rep:
                times["background" if bg else "sync"].append(blocked)
                if bg:
                    times["background, whole write"].append(whole)
        t = time.perf_counter()
        for dst, src in zip(copies, leaves):
            dst.copy_(src)
        if rep:
            times["copy"].append(time.perf_counter() - t)
    for manager in managers.values():
        manager.release()
    if not world.main:
        D.teardown(world)
        return
    med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    rows = [
        ["save(), synchronous", f"{med['sync']:.0f}", "1.00"],
        ["save(), background: what the loop waits for", f"{med['background']:.0f}", f"{med['background'] / med['sync']:.2f}"],
        ["background: until its write is published", f"{med['background, whole write']:.0f}", f"{med['background, whole write'] / med['sync']:.2f}"],
        ["floor: one in-memory copy of the same bytes", f"{med['copy']:.0f}", f"{med['copy'] / med['sync']:.2f}"],
    ]
    n = sum(p.numel() for p in model.parameters())
    layout = f"DCP, {world.size} ranks" if args.dcp else "files, one process"
    body = (
        f"## {n / 1e6:.1f}M params + AdamW state ({nbytes / 2**20:.0f} MiB on rank 0), {layout}, "
        f"median of {args.reps}\n\n" + C.table(["what", "ms", "/ synchronous"], rows) + "\n"
    )
    print(body, flush=True)
    if not args.no_write:
        print(C.write_result(f"checkpoint-{'dcp' if args.dcp else 'files'}", "Checkpoint saves: what blocks the loop", torch.device("cpu"), body))
    D.teardown(world)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
