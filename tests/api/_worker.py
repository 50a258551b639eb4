"""A tiny training run for the api tests; launched in process, as a subprocess, or under torchrun.

`python tests/api/_worker.py OUT STRATEGY STEPS [--resume] [--nan-at STEP] [--set k=v ...]`
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import torch

from purestep.api import TrainConfig, apply_overrides
from purestep.api.cli import build_trainer

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


def trainer(out: Path | None, *overrides: str, nan_at: int | None = None, spikes: tuple[int, ...] = ()):
    """A Trainer of the tiny config; NaN gradients at batch `nan_at` (rank 0 only), x100 loss at `spikes`."""
    t = build_trainer(tiny_config(*overrides), out, progress=False)
    inner = t.loss_fn

    def loss_fn(model, batch):
        loss, n = inner(model, batch)
        if t.step == nan_at and t.world.rank == 0:
            loss = NanGrad.apply(loss)
        if t.step in spikes:
            loss = loss * 100
        return loss, n

    t.loss_fn = loss_fn
    return t


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("out", type=Path)
    p.add_argument("strategy")
    p.add_argument("steps", type=int)
    p.add_argument("--resume", action="store_true")
    p.add_argument("--nan-at", type=int)
    p.add_argument("--set", dest="overrides", action="append", default=[])
    a = p.parse_args()
    torch.set_num_threads(1)
    t = trainer(a.out, f"strategy={a.strategy}", f"steps={a.steps}", *a.overrides, nan_at=a.nan_at)
    t.fit(resume=a.resume)
    t.close()
    if int(os.environ.get("RANK", "0")) == 0:
        print("done", t.step, t.updates)
