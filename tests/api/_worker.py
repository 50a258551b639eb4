"""A tiny training run for the api tests; launched in process, as a subprocess, or under torchrun.

`python tests/api/_worker.py OUT STRATEGY STEPS [--resume] [--nan-at STEP] [--die-at STEP] [--set k=v ...]`
`python tests/api/_worker.py save-forever OUT`: checkpoint after checkpoint until killed
`torchrun ... tests/api/_worker.py checkpoint-drill OUT`: the CheckpointManager on FSDP2-sharded trees
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

from purestep.api import TrainConfig, apply_overrides
from purestep.api.cli import build_trainer, leave

TINY = [
    "batch_size=8", "log_every=1", "checkpoint_every=4", "keep_last=10", "seed=3",
    "model.n_embd=32", "model.n_layer=2", "model.n_head=2", "model.block_size=32", "data.max_bytes=300000",
    "optimizer.name=muon_adamw", "optimizer.lr=0.02", 'optimizer.kwargs={"adamw_lr": 0.003, "ns_dtype": "float32"}',
    "schedule.name=warmup_cosine", "schedule.warmup_steps=2", "ema_decay=0.9",
]


class NanGrad(torch.autograd.Function):
    """Identity forward; NaN gradient backward (an injected numerical fault)."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return g * float("nan")


def tiny_config(*overrides: str) -> TrainConfig:
    return apply_overrides(TrainConfig(), [*TINY, *overrides])


def trainer(
    out: Path | None, *overrides: str, nan_at: int | None = None, spikes: tuple[int, ...] = (), die_at: int | None = None
):
    """A Trainer of the tiny config; NaN gradients at batch `nan_at` (rank 0 only), x100 loss at
    `spikes`; rank 1 killed (`os._exit`) at batch `die_at` of torchrun's first attempt."""
    t = build_trainer(tiny_config(*overrides), out, progress=False)
    inner = t.loss_fn

    def loss_fn(model, batch):
        loss, n = inner(model, batch)
        if t.step == nan_at and t.world.rank == 0:
            loss = NanGrad.apply(loss)
        if t.step == die_at and t.world.rank == 1 and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0":
            print(f"rank 1 dies at step {t.step}", flush=True)
            os._exit(3)
        if t.step in spikes:
            loss = loss * 100
        return loss, n

    t.loss_fn = loss_fn
    return t


def save_forever(out: Path) -> None:
    """Save 4 MB checkpoints with keep_last=2, one after another, printing each step, until killed."""
    from purestep.api.checkpoint import CheckpointManager

    manager = CheckpointManager(out, keep_last=2)
    latest = manager.latest()
    step = (manager.load(latest, params_like={"w": torch.zeros(1 << 20)}).step + 1) if latest else 0
    while True:
        manager.save(step, params={"w": torch.full((1 << 20,), float(step))}, metadata={"step": step})
        print(step, flush=True)
        step += 1


def checkpoint_drill(out: Path) -> None:
    """Under torchrun: DCP and plain saves of FSDP2-sharded trees, fallback, shape errors, a rank failing a save.

    Each rank writes what it saw to OUT/seen-<rank>.json.
    """
    import json

    import purestep.core as ps
    from purestep.api import distributed as D
    from purestep.api.checkpoint import CheckpointError, CheckpointManager, load_checkpoint

    world = D.setup("fsdp", "cpu")
    torch.manual_seed(0)
    model = D.wrap(torch.nn.Sequential(torch.nn.Linear(6, 4), torch.nn.Linear(4, 2)), world)
    params = {k: p.detach() for k, p in model.named_parameters()}
    opt = ps.adamw(1e-2)
    state = opt.init(params)
    seen: dict[str, object] = {"rank": world.rank}
    for distributed, run in ((True, out / "dcp"), (False, out / "files")):
        manager = CheckpointManager(run, keep_last=2, world=world, distributed=distributed)
        for step in (1, 2):
            with torch.no_grad():
                for p in params.values():
                    p.add_(1.0)
            manager.save(step, params=params, opt_state=state)
        like = {k: torch.zeros_like(v) for k, v in params.items()}
        seen[f"{run.name}_layout"] = load_checkpoint(run / "checkpoints" / "step_00000002").manifest.layout
        whole = load_checkpoint(run / "checkpoints" / "step_00000002").params  # in one process, no collective
        full = D.full_tree(params)  # a collective: every rank gathers every tensor
        seen[f"{run.name}_whole_equal"] = all(torch.equal(whole[k], full[k]) for k in params)
        restored = manager.restore(params_like=like, opt_state_like=state)
        seen[f"{run.name}_restored"] = restored.step
        seen[f"{run.name}_sharded_equal"] = all(
            torch.equal(D.local(restored.params[k]), D.local(v)) for k, v in params.items()
        )
        D.barrier(world)
        if world.main:  # damage the newest checkpoint: every rank must fall back to the older one together
            pattern = "shard-00002-model-00001-*" if distributed else "params.safetensors"  # rank 1's params shard
            (victim,) = (run / "checkpoints" / "step_00000002").glob(pattern)
            data = bytearray(victim.read_bytes())
            data[-1] ^= 1
            victim.write_bytes(bytes(data))
        D.barrier(world)
        seen[f"{run.name}_fallback"] = manager.restore(params_like=like, opt_state_like=state).step
        wrong = D.wrap(torch.nn.Sequential(torch.nn.Linear(6, 4), torch.nn.Linear(4, 3)), world)
        try:
            wrong_like = {k: p.detach() for k, p in wrong.named_parameters()}
            manager.load(run / "checkpoints" / "step_00000001", params_like=wrong_like)
            seen[f"{run.name}_shape_error"] = None
        except CheckpointError as e:
            seen[f"{run.name}_shape_error"] = str(e)
    # In the background: the save returns once the state is copied; training goes on changing
    # it; the checkpoint holds what it was at the save (both layouts).
    for distributed, run in ((True, out / "bg-dcp"), (False, out / "bg-files")):
        manager = CheckpointManager(run, keep_last=2, world=world, distributed=distributed, background=True)
        before = D.full_tree(params)
        manager.save(4, params=params, opt_state=state)
        with torch.no_grad():
            for p in params.values():
                p.add_(100.0)  # the loop's next steps, while the write runs
        manager.wait()
        whole = load_checkpoint(run / "checkpoints" / "step_00000004").params
        seen[f"{run.name}_copied_at_save"] = all(torch.equal(whole[k], before[k]) for k in params)
        with torch.no_grad():
            for p in params.values():
                p.sub_(100.0)
    # A save that fails on rank 1 only fails on every rank, and publishes nothing.
    manager = CheckpointManager(out / "dcp", keep_last=5, world=world, distributed=True)
    if world.rank == 1:
        import purestep.api.checkpoint._dcp as layout

        def broken(*args, **kwargs):
            raise OSError(28, "No space left on device")

        layout.hash_and_fsync = broken
    try:
        manager.save(3, params=params, opt_state=state)
        seen["failed_save"] = None
    except CheckpointError as e:
        seen["failed_save"] = str(e)
    D.barrier(world)
    seen["after_failed_save"] = sorted(p.name for p in (out / "dcp" / "checkpoints").iterdir())
    # The same in the background: the save returns, the failure comes at the wait, on every rank.
    manager = CheckpointManager(out / "dcp", keep_last=5, world=world, distributed=True, background=True)
    manager.save(5, params=params, opt_state=state)
    try:
        manager.wait()
        seen["failed_background_save"] = None
    except CheckpointError as e:
        seen["failed_background_save"] = str(e)
    D.barrier(world)
    seen["after_failed_background_save"] = sorted(p.name for p in (out / "dcp" / "checkpoints").iterdir())
    seen.update(adapter_dcp(world))
    (out / f"seen-{world.rank}.json").write_text(json.dumps(seen))
    D.teardown(world)


def adapter_dcp(world) -> dict[str, bool]:
    """The drop-in Optimizer on FSDP2 params through torch.distributed.checkpoint's state_dict API:
    no step taken by get_optimizer_state_dict (grads None), the state back equal after set."""
    import purestep.core as ps
    from purestep.api import Optimizer
    from purestep.api import distributed as D
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

    torch.manual_seed(1)
    model = D.wrap(torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Linear(8, 2)), world)
    opt = Optimizer(model.parameters(), ps.adamw(1e-2, weight_decay=0.1))
    for _ in range(2):
        opt.zero_grad()
        model(torch.randn(4, 6)).pow(2).mean().backward()
        opt.step()
    opt.zero_grad()
    before = [D.local(p).detach().clone() for p in model.parameters()]
    mine = {i: {k: D.local(v).clone() for k, v in s.items()} for i, s in opt.state_dict()["state"].items()}
    for _ in range(2):
        sd = get_optimizer_state_dict(model, opt)
    no_step = all(torch.equal(a, D.local(p)) for a, p in zip(before, model.parameters()))
    set_optimizer_state_dict(model, opt, sd)
    back = opt.state_dict()["state"]
    equal = all(torch.equal(D.local(back[i][k]), v) for i, s in mine.items() for k, v in s.items())
    return {"adapter_dcp_no_step": no_step, "adapter_dcp_state_equal": equal, "adapter_state_shown": bool(opt.state)}


if __name__ == "__main__":
    if sys.argv[1] in ("save-forever", "checkpoint-drill"):
        torch.set_num_threads(1)
        (save_forever if sys.argv[1] == "save-forever" else checkpoint_drill)(Path(sys.argv[2]))
        leave(0)
    p = argparse.ArgumentParser()
    p.add_argument("out", type=Path)
    p.add_argument("strategy")
    p.add_argument("steps", type=int)
    p.add_argument("--resume", action="store_true")
    p.add_argument("--nan-at", type=int)
    p.add_argument("--die-at", type=int)
    p.add_argument("--set", dest="overrides", action="append", default=[])
    a = p.parse_args()
    torch.set_num_threads(1)
    t = trainer(a.out, f"strategy={a.strategy}", f"steps={a.steps}", *a.overrides, nan_at=a.nan_at, die_at=a.die_at)
    t.fit(resume=a.resume)
    if int(os.environ.get("RANK", "0")) == 0:
        print("done", t.step, t.updates)
        print("path", t.update.explain())
    t.close()
    if t.world.distributed:
        leave(0)  # as the purestep command ends a torchrun rank
