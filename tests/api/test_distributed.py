"""FSDP2 on 2 CPU ranks (gloo, torchrun) against one process; CUDA parts gated."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from purestep.api import load_checkpoint

from ._worker import trainer

WORKER = Path(__file__).with_name("_worker.py")


def torchrun(*args: str, nproc: int = 2) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", str(WORKER), *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return out


def test_fsdp2_on_two_ranks_matches_one_process_skips_nan_together_and_resumes_on_one(tmp_path):
    # muon_adamw + global-norm clip + EMA: Muon must orthogonalise whole matrices and the
    # clip must use the global norm, or the sharded run drifts from the single one.
    out = torchrun(str(tmp_path / "fsdp"), "fsdp", "8", "--nan-at", "5")
    assert out.stderr.count("step 6: skip_nonfinite") == 2  # both ranks skipped the step rank 0 poisoned
    ref = trainer(tmp_path / "single", "steps=8", nan_at=5)
    ref.fit()

    fsdp = load_checkpoint(tmp_path / "fsdp" / "checkpoints" / "step_00000008")  # loads whole, in one process
    assert fsdp.manifest.metadata["world_size"] == 2
    # Written by torch.distributed.checkpoint's safetensors storage, each rank its own shards.
    assert fsdp.manifest.layout == "dcp" and fsdp.manifest.world_size == 2
    assert {f.split("-model-")[0] for f in fsdp.manifest.files if f.startswith("shard-")} == {"shard-00001", "shard-00002"}
    for k, p in ref.named.items():
        torch.testing.assert_close(fsdp.params[k], p.detach(), rtol=1e-3, atol=1e-5)
    for k, e in ref.ema.params.items():  # the shard-local EMA, gathered
        torch.testing.assert_close(fsdp.ema[f"params.{k}"], e, rtol=1e-3, atol=1e-5)
    logged = [json.loads(line) for line in (tmp_path / "fsdp" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in logged if "event" in r] == [6]

    # Resume the 2-rank run under FSDP2 on 1 rank: DCP reshards the saved shards on load.
    shutil.copytree(tmp_path / "fsdp", tmp_path / "fsdp1")
    torchrun(str(tmp_path / "fsdp1"), "fsdp", "12", "--resume", "--nan-at", "5", nproc=1)
    # Resume the 2-rank run on 1 plain process; it continues as the single-process run does.
    resumed = trainer(tmp_path / "fsdp", "steps=12", nan_at=5)
    resumed.fit(resume=True)
    ref = trainer(tmp_path / "single", "steps=12", nan_at=5)
    ref.fit(resume=True)
    resharded = load_checkpoint(tmp_path / "fsdp1" / "checkpoints" / "step_00000012")
    assert resharded.manifest.world_size == 1
    for k, p in ref.named.items():
        torch.testing.assert_close(resumed.named[k], p, rtol=1e-3, atol=1e-5)
        torch.testing.assert_close(resharded.params[k], p.detach(), rtol=1e-3, atol=1e-5)


def test_ddp_on_two_ranks_ends_with_the_single_process_params(tmp_path):
    # Same seed and global batch: each rank takes half of every batch, DDP averages the grads.
    torchrun(str(tmp_path / "ddp"), "ddp", "6")
    ref = trainer(tmp_path / "single", "steps=6")
    ref.fit()
    ddp = load_checkpoint(tmp_path / "ddp" / "checkpoints" / "step_00000006")
    assert ddp.manifest.metadata["world_size"] == 2 and ddp.manifest.layout == "files"
    moved = 0.0
    start = trainer(None, "steps=6")  # the same init, untrained: the check must be able to fail
    for k, p in ref.named.items():
        torch.testing.assert_close(ddp.params[k], p.detach(), rtol=1e-3, atol=1e-5)
        moved = max(moved, (p.detach() - start.named[k].detach()).abs().max().item())
    assert moved > 1e-3
    for k, e in ref.ema.params.items():
        torch.testing.assert_close(ddp.ema[f"params.{k}"], e, rtol=1e-3, atol=1e-5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_bf16_run_trains(tmp_path):
    t = trainer(tmp_path, "steps=6", "precision=bf16")
    first = t.evaluate()
    t.fit()
    assert t.world.device.type == "cuda" and t.evaluate() < first


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_fsdp2_on_two_gpus_trains(tmp_path):
    torchrun(str(tmp_path), "fsdp", "6", "--set", "precision=bf16")
    assert load_checkpoint(tmp_path / "checkpoints" / "step_00000006").step == 6


def test_single_process_checkpoint_resumes_under_fsdp2_on_two_ranks(tmp_path):
    # 1 -> 2 ranks: the whole-tensor checkpoint is sharded on load; the run then saves DCP shards.
    trainer(tmp_path / "single", "steps=4").fit()
    shutil.copytree(tmp_path / "single", tmp_path / "fsdp")
    torchrun(str(tmp_path / "fsdp"), "fsdp", "6", "--resume")
    ref = trainer(tmp_path / "single", "steps=6")
    ref.fit(resume=True)
    fsdp = load_checkpoint(tmp_path / "fsdp" / "checkpoints" / "step_00000006")
    assert fsdp.manifest.layout == "dcp" and fsdp.manifest.world_size == 2
    for k, p in ref.named.items():
        torch.testing.assert_close(fsdp.params[k], p.detach(), rtol=1e-3, atol=1e-5)
