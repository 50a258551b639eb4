"""FSDP2 on 2 ranks (torchrun) against one process; CUDA parts gated.

The 2-rank runs use gloo on the CPU unless the machine has a GPU per rank, so the suite
passes on a one-GPU machine; the single-process references then run on the CPU too.
"""

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
from purestep.api.checkpoint._format import read_tensors

from ._worker import trainer

WORKER = Path(__file__).with_name("_worker.py")


ON_CPU = torch.cuda.device_count() < 2  # fewer GPUs than ranks: every rank, and the references, on the CPU


def torchrun(*args: str, nproc: int = 2, restarts: int = 0) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
    cmd += [f"--max-restarts={restarts}", str(WORKER), *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1", **({"CUDA_VISIBLE_DEVICES": ""} if ON_CPU else {})}
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return out


@pytest.fixture
def same_device_as_the_ranks(monkeypatch):
    """The in-process reference runs where the torchrun ranks run (the CPU when GPUs are fewer than ranks)."""
    if ON_CPU:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


def test_fsdp2_on_two_ranks_matches_one_process_skips_nan_together_and_resumes_on_one(
    tmp_path, same_device_as_the_ranks
):
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
    assert {f.split("-model-")[0] for f in fsdp.manifest.files if f.startswith("shard-")} == {
        "shard-00001",
        "shard-00002",
    }
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


def resumes_like_one_process(tmp_path, saved: str, other: str, strategy: str) -> None:
    """The 8-step run in `tmp_path / saved`, resumed to step 12 under `strategy` on 2 ranks (in
    `tmp_path / other`) and in one plain process, equals the single-process run resumed there."""
    shutil.copytree(tmp_path / saved, tmp_path / other)
    torchrun(str(tmp_path / other), strategy, "12", "--resume", "--nan-at", "5", nproc=2)
    resumed = trainer(tmp_path / saved, "steps=12", nan_at=5)  # one plain process
    resumed.fit(resume=True)
    ref = trainer(tmp_path / "single", "steps=12", nan_at=5)
    ref.fit(resume=True)
    on_ranks = load_checkpoint(tmp_path / other / "checkpoints" / "step_00000012")
    assert on_ranks.manifest.world_size == 2
    for k, p in ref.named.items():
        torch.testing.assert_close(resumed.named[k], p, rtol=1e-3, atol=1e-5)
        torch.testing.assert_close(on_ranks.params[k], p.detach(), rtol=1e-3, atol=1e-5)


def test_hsdp_on_four_ranks_matches_one_process_and_resumes_on_fsdp_and_on_one_process(
    tmp_path, same_device_as_the_ranks
):
    """strategy="hsdp" on a (2 replicas, 2 shards) mesh: the Trainer's sharded update runs
    with the optimizer state sharded across the replicas (its default), equal to one process,
    each rank holding about 1/4 of the state; its DCP checkpoint (the state saved as the global
    tensors) resumes under HSDP with whole blocks per replica, on FSDP2 over 2 ranks and in one
    plain process (resharded across meshes on load)."""
    out = torchrun(str(tmp_path / "hsdp"), "hsdp", "8", "--nan-at", "5", "--set", "replicate=2", nproc=4)
    assert out.stderr.count("step 6: skip_nonfinite") == 4  # every rank skipped the step rank 0 poisoned
    assert "path sharded" in out.stdout, out.stdout  # the update ran on the shards, not on whole DTensors
    assert "the optimizer state over its 2 replicas x 2 shards" in out.stdout, out.stdout
    ref = trainer(tmp_path / "single", "steps=8", nan_at=5)
    ref.fit()
    hsdp = load_checkpoint(tmp_path / "hsdp" / "checkpoints" / "step_00000008")
    assert hsdp.manifest.layout == "dcp" and hsdp.manifest.world_size == 4
    for k, p in ref.named.items():
        torch.testing.assert_close(hsdp.params[k], p.detach(), rtol=1e-3, atol=1e-5)
    first = lambda run: json.loads((tmp_path / run / "metrics.jsonl").read_text().splitlines()[0])  # noqa: E731
    # the state and EMA this rank holds: 1/4 of one process's, but for the scalars and uneven rows
    assert first("hsdp")["state_bytes"] <= first("single")["state_bytes"] / 4 * 1.05, (first("hsdp"), first("single"))
    # The same checkpoint resumed on the same mesh with a whole copy of the state per replica.
    shutil.copytree(tmp_path / "hsdp", tmp_path / "hsdp_whole")
    out = torchrun(
        str(tmp_path / "hsdp_whole"),
        "hsdp",
        "12",
        "--resume",
        "--nan-at",
        "5",
        "--set",
        "replicate=2",
        "--set",
        "shard_state_over_replicas=false",
        nproc=4,
    )
    assert "HSDP, 2 replicas x 2 shards" in out.stdout, out.stdout
    shutil.copytree(tmp_path / "single", tmp_path / "single_whole")  # one process resumed from step 8
    ref12 = trainer(tmp_path / "single_whole", "steps=12", nan_at=5)
    ref12.fit(resume=True)
    whole = load_checkpoint(tmp_path / "hsdp_whole" / "checkpoints" / "step_00000012")
    for k, p in ref12.named.items():
        torch.testing.assert_close(whole.params[k], p.detach(), rtol=1e-3, atol=1e-5)
    resumes_like_one_process(tmp_path, "hsdp", "fsdp2", "fsdp")


def test_tensor_parallel_on_four_and_eight_ranks_matches_one_process_and_resumes_across_meshes(
    tmp_path, same_device_as_the_ranks
):
    """strategy="fsdp+tp" on a (dp 2, tp 2) mesh: the GPT's torchtitan plan splits q, k, v, gate
    and up by columns (heads, hidden units) and proj and down by rows over each TP pair, FSDP2
    shards over the pairs, each pair reads its own rows of the batch. Equal to one process (a
    NaN step skipped by every rank); its checkpoint resumes under TP alone on 2 ranks and in one
    plain process. strategy="hsdp+tp" on 8 ranks (replicate 2, shard 2, tp 2) with QK-clip equals
    one process with QK-clip."""
    out = torchrun(
        str(tmp_path / "fsdp_tp"), "fsdp+tp", "8", "--nan-at", "5", "--set", "tp=2", "--set", "eval_every=4", nproc=4
    )
    assert out.stderr.count("step 6: skip_nonfinite") == 4, out.stderr[-3000:]
    assert "path sharded" in out.stdout, out.stdout  # muon_adamw on TP blocks: owner-computes over row x column blocks
    ref = trainer(tmp_path / "single", "steps=8", "eval_every=4", nan_at=5)
    ref.fit()
    saved = load_checkpoint(tmp_path / "fsdp_tp" / "checkpoints" / "step_00000008")
    assert saved.manifest.layout == "dcp" and saved.manifest.world_size == 4
    for k, p in ref.named.items():
        torch.testing.assert_close(saved.params[k], p.detach(), rtol=1e-3, atol=1e-5)
    logged = [json.loads(line) for line in (tmp_path / "fsdp_tp" / "metrics.jsonl").read_text().splitlines()]
    ref_logged = [json.loads(line) for line in (tmp_path / "single" / "metrics.jsonl").read_text().splitlines()]
    losses = lambda rows: [r["loss"] for r in rows if "loss" in r]  # noqa: E731
    assert losses(logged) == pytest.approx(losses(ref_logged), rel=1e-4)
    val = lambda rows: [r["val_loss"] for r in rows if "val_loss" in r]  # noqa: E731
    assert len(val(logged)) == 2 and val(logged) == pytest.approx(val(ref_logged), rel=1e-4)  # evaluation under TP
    # each row counted once, not once per TP rank
    assert (
        saved.manifest.metadata["trainer"]["tokens"]
        == load_checkpoint(tmp_path / "single" / "checkpoints" / "step_00000008").manifest.metadata["trainer"]["tokens"]
        > 0
    )
    # HSDP beside TP on 8 ranks, a (replicate 2, shard 2, tp 2) mesh: TP within pairs, HSDP over
    # them; with QK-clip, each head's max logit gathered from the TP rank holding it (max over
    # the data-parallel ranks), the clip run on each rank's W_q/W_k blocks.
    qk = "optimizer.qk_clip=0.04"
    out = torchrun(
        str(tmp_path / "hsdp_tp"),
        "hsdp+tp",
        "8",
        "--nan-at",
        "5",
        "--set",
        "tp=2",
        "--set",
        "replicate=2",
        "--set",
        "eval_every=4",
        "--set",
        qk,
        nproc=8,
    )
    assert out.stderr.count("step 6: skip_nonfinite") == 8, out.stderr[-3000:]
    assert "path sharded" in out.stdout and "blocks over 8 ranks" in out.stdout, out.stdout
    clipped = trainer(tmp_path / "single_qk", "steps=8", "eval_every=4", qk, nan_at=5)
    clipped.fit()
    three = load_checkpoint(tmp_path / "hsdp_tp" / "checkpoints" / "step_00000008")
    assert three.manifest.world_size == 8
    for k, p in clipped.named.items():
        torch.testing.assert_close(three.params[k], p.detach(), rtol=1e-3, atol=1e-5)
    logged = [json.loads(line) for line in (tmp_path / "hsdp_tp" / "metrics.jsonl").read_text().splitlines()]
    qk_logged = [json.loads(line) for line in (tmp_path / "single_qk" / "metrics.jsonl").read_text().splitlines()]
    assert losses(logged) == pytest.approx(losses(qk_logged), rel=1e-4)
    assert val(logged) == pytest.approx(val(qk_logged), rel=1e-4)
    heads = lambda rows: [r["max_logit"] for r in rows if "max_logit" in r]  # noqa: E731
    assert heads(logged) == pytest.approx(heads(qk_logged), rel=1e-4)
    assert max(heads(qk_logged)) > 0.04  # the clip acted
    assert losses(qk_logged) != pytest.approx(losses(ref_logged), rel=1e-6)  # and changed the run
    resumes_like_one_process(tmp_path, "fsdp_tp", "tp", "tp")


def test_tensor_parallel_degrees_and_options_that_do_not_fit_fail_in_one_line(monkeypatch):
    from purestep.api import ConfigError, TrainConfig, apply_overrides
    from purestep.api import distributed as D
    from purestep.api.models import GPT

    monkeypatch.setenv("WORLD_SIZE", "4")
    with pytest.raises(ValueError, match="tp=3 does not divide the 4 ranks"):
        D.setup("fsdp+tp", "cpu", tp=3)
    with pytest.raises(ValueError, match="'tp' runs tensor parallelism over every rank"):
        D.setup("tp", "cpu", tp=2)
    with pytest.raises(ValueError, match="tp=2 is tensor parallelism's degree"):
        D.setup("fsdp", "cpu", tp=2)
    with pytest.raises(ValueError, match=r"replicate=3 does not divide the 2 data-parallel ranks \(4 ranks / tp=2\)"):
        D.setup("hsdp+tp", "cpu", tp=2, replicate=3)
    with pytest.raises(ValueError, match="strategy='hsdp\\+tp': tp=3 does not divide the 4 ranks"):
        D.setup("hsdp+tp", "cpu", tp=3)
    with pytest.raises(ValueError, match="model.n_heads=4 heads"):
        GPT(dim=32, n_heads=4, n_layers=1).tp_plan(3)
    with pytest.raises(ValueError, match="ep=3 does not divide the 4 ranks"):
        D.setup("fsdp", "cpu", ep=3)
    with pytest.raises(ValueError, match="ep=2 is expert parallelism's degree, built beside strategy='fsdp'"):
        D.setup("hsdp", "cpu", ep=2)
    with pytest.raises(ValueError, match="splits the model's 4 experts"):
        GPT(dim=32, n_heads=4, n_layers=1, experts=4).ep_plan(3)
    with pytest.raises(ValueError, match="needs a GPT with experts"):
        GPT(dim=32, n_heads=4, n_layers=1).ep_plan(2)
    for overrides, field in (
        (["strategy=fsdp", "tp=2"], "tp"),
        (["strategy=ddp", "ep=2"], "ep"),
        (["strategy=fsdp+tp", "precision=bf16-true"], "precision"),
    ):
        with pytest.raises(ConfigError) as e:
            apply_overrides(TrainConfig(), overrides)
        assert e.value.field == field


def test_hsdp_degrees_that_do_not_divide_the_ranks_fail_in_one_line(monkeypatch):
    from purestep.api import ConfigError, TrainConfig, apply_overrides
    from purestep.api import distributed as D

    monkeypatch.setenv("WORLD_SIZE", "4")
    with pytest.raises(ValueError, match="replicate=3 does not divide the 4 ranks"):
        D.setup("hsdp", "cpu", replicate=3)
    with pytest.raises(ConfigError) as e:
        apply_overrides(TrainConfig(), ["strategy=fsdp", "replicate=2"])
    assert e.value.field == "replicate"


def test_ddp_on_two_ranks_ends_with_the_single_process_params(tmp_path, same_device_as_the_ranks):
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


DILOCO_SGD = [
    "optimizer.name=sgd",
    "optimizer.lr=0.5",
    "optimizer.kwargs={}",
    "optimizer.clip_grad_norm=none",
    "schedule.name=constant",
    "schedule.warmup_steps=none",
    "ema_decay=none",
]


def test_diloco_under_ddp_and_hsdp_makes_ranks_or_replicas_workers_and_syncing_every_step_is_ddp(
    tmp_path, same_device_as_the_ranks
):
    """`[diloco]` under DDP: no grad all-reduce, each rank a worker on its own rows, the
    pseudo-gradients averaged at each sync. With plain SGD inside, an outer SGD of lr 1 and
    no momentum, and a sync every step, the average of the workers' SGD steps from one point
    is DDP's step: the run must end on the one-process params (the check fails if the workers'
    pseudo-gradients were never averaged; that no grad all-reduce runs between syncs is the
    path's to show: eager in place on plain tensors, no DDP wrapper).
    The exchange is SparseLoCo's all-gather, keeping every entry unquantized: the mean is the
    same one (the plain all_reduce mean is the same pattern, checked on one rank in
    tests/core/test_diloco.py). Under HSDP (2 replicas x 2 shards) each replica is a worker:
    FSDP2 averages within it, the plain all_reduce mean across the replicas at the sync, and the
    same end must come out."""
    exchange = ["diloco.compression=sparseloco", "diloco.density=1", "diloco.bits=none"]
    diloco = ["diloco.sync_every=1", "diloco.outer_lr=1", "diloco.outer_momentum=0", *exchange]
    sets = [f"--set={o}" for o in [*DILOCO_SGD, *diloco]]
    out = torchrun(str(tmp_path / "diloco"), "ddp", "4", *sets)
    assert "path eager in place" in out.stdout, out.stdout[-2000:]  # compiled: tests/core/test_diloco.py
    ref = trainer(tmp_path / "single", "steps=4", *DILOCO_SGD)
    ref.fit()
    got = load_checkpoint(tmp_path / "diloco" / "checkpoints" / "step_00000004")
    start = trainer(None, "steps=4", *DILOCO_SGD)
    moved = 0.0
    for k, p in ref.named.items():
        torch.testing.assert_close(got.params[k], p.detach(), rtol=1e-4, atol=1e-6)
        torch.testing.assert_close(got.opt_state[f"anchor.{k}"], p.detach(), rtol=1e-4, atol=1e-6)
        moved = max(moved, (p.detach() - start.named[k].detach()).abs().max().item())
    assert moved > 1e-3
    sets = [f"--set={o}" for o in [*DILOCO_SGD, *diloco[:3], "replicate=2"]]
    out = torchrun(str(tmp_path / "diloco_hsdp"), "hsdp", "4", *sets, nproc=4)
    assert "path sharded" in out.stdout and "FSDP over 2 rank(s)" in out.stdout, out.stdout[-2000:]
    got = load_checkpoint(tmp_path / "diloco_hsdp" / "checkpoints" / "step_00000004")
    for k, p in ref.named.items():
        torch.testing.assert_close(got.params[k], p.detach(), rtol=1e-4, atol=1e-6)
        torch.testing.assert_close(got.opt_state[f"anchor.{k}"], p.detach(), rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize(
    "strategy, nproc, extra", [("ddp", 2, ()), ("hsdp", 4, ("replicate=2", "async_checkpoint=true"))]
)
def test_a_killed_diloco_worker_costs_the_steps_since_the_checkpoint_and_each_worker_resumes_its_own_state(
    tmp_path, same_device_as_the_ranks, strategy, nproc, extra
):
    """DiLoCo (Muon + AdamW inside, Nesterov outside, a sync every 2 steps, checkpoints every
    4), each DDP rank or each HSDP replica (of 2 ranks) a worker: rank 1 is killed at step 6;
    torchrun restarts every rank, which resume at step 4, each worker with its own params and
    inner state (worker 1's from its file in the checkpoint, each rank taking its block), and
    end on the bits of the run that was never killed. Under HSDP the checkpoints are written
    in the background (the worker file staged on its lead rank)."""
    sets = [f"--set={o}" for o in ("diloco.sync_every=2", "checkpoint_every=4", *extra)]
    torchrun(str(tmp_path / "whole"), strategy, "8", *sets, nproc=nproc)
    killed = torchrun(
        str(tmp_path / "killed"), strategy, "8", "--resume", "--die-at", "6", *sets, nproc=nproc, restarts=1
    )
    assert "rank 1 dies at step 6" in killed.stdout and "at step 4" in killed.stderr + killed.stdout, killed.stderr[
        -2000:
    ]
    for step in ("step_00000004", "step_00000008"):
        ran = {run: tmp_path / run / "checkpoints" / step for run in ("whole", "killed")}
        main = {run: load_checkpoint(path) for run, path in ran.items()}
        own = {run: read_tensors(path / "worker-00001.safetensors") for run, path in ran.items()}
        for key, value in own["whole"].items():
            assert torch.equal(own["killed"][key], value), (step, key)
        for tree in ("params", "opt_state"):
            for key, value in getattr(main["whole"], tree).items():
                assert torch.equal(getattr(main["killed"], tree)[key], value), (step, tree, key)
    # The workers' inner states differ between syncs (the file is not worker 0's again)...
    inner = [k for k in own["whole"] if k.startswith("opt_state.inner_state") and own["whole"][k].is_floating_point()]
    assert any(not torch.equal(own["whole"][k], main["whole"].opt_state[k.removeprefix("opt_state.")]) for k in inner)
    # ...while the anchor is the workers' common one.
    anchor = [k for k in own["whole"] if k.startswith("opt_state.anchor.")]
    assert anchor and all(
        torch.equal(own["whole"][k], main["whole"].opt_state[k.removeprefix("opt_state.")]) for k in anchor
    )


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


def test_single_process_checkpoint_resumes_under_fsdp2_on_two_ranks(tmp_path, same_device_as_the_ranks):
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


def test_checkpoint_manager_on_two_fsdp2_ranks_falls_back_refuses_shapes_and_fails_saves_together(tmp_path):
    # Both layouts, FSDP2-sharded params and AdamW state: saved, loaded whole and resharded, a damaged
    # newest checkpoint skipped by both ranks together, a shape mismatch refused on both, and a save
    # that fails on rank 1 only fails on both and publishes nothing; the same saved in the background.
    torchrun("checkpoint-drill", str(tmp_path))
    seen = [json.loads((tmp_path / f"seen-{rank}.json").read_text()) for rank in (0, 1)]
    assert seen[0] | {"rank": 1} == seen[1]  # both ranks saw the same
    for layout in ("dcp", "files"):
        assert seen[0][f"{layout}_layout"] == layout
        assert seen[0][f"{layout}_whole_equal"] and seen[0][f"{layout}_sharded_equal"]
        assert seen[0][f"{layout}_restored"] == 2 and seen[0][f"{layout}_fallback"] == 1
        assert (
            "params '1.weight' is [2, 4] torch.float32 in the checkpoint, but [3, 4]"
            in seen[0][f"{layout}_shape_error"]
        )
    assert "step_00000003: cannot write the checkpoint: rank 1: No space left on device" in seen[0]["failed_save"]
    assert seen[0]["after_failed_save"] == ["step_00000001", "step_00000002"]
    # In the background (issue 28): what was there at the save, whatever the loop did after;
    # a rank's failure raised at the wait on both, nothing published.
    assert seen[0]["bg-dcp_copied_at_save"] and seen[0]["bg-files_copied_at_save"]
    failed = seen[0]["failed_background_save"]
    assert "step_00000005: cannot write the checkpoint: rank 1: No space left on device" in failed
    assert seen[0]["after_failed_background_save"] == ["step_00000001", "step_00000002"]
    # The drop-in Optimizer on FSDP2 params: torch.distributed.checkpoint's state_dict API takes no step.
    assert seen[0]["adapter_state_shown"] and seen[0]["adapter_dcp_no_step"] and seen[0]["adapter_dcp_state_equal"]


def test_more_ranks_per_node_than_gpus_fails_in_one_line_naming_both_counts(monkeypatch):
    from purestep.api import distributed as D

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: pytest.fail(f"set_device({d}) before the check"))
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    for strategy in ("ddp", "fsdp"):  # every rank fails, rank 0 too: its GPU exists, the launch is still wrong
        with pytest.raises(
            ValueError, match=r"^2 processes per node need 2 GPUs, but this node has 1: launch at most"
        ) as e:
            D.setup(strategy)
        assert len(str(e.value).splitlines()) == 1
    with pytest.raises(ValueError, match=r"device cuda:3 asked for, but this node has 1 GPU\(s\)"):
        D.setup("ddp", "cuda:3")


FSDP2_EAGER_DONATED = """
import torch, torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
import purestep.core as ps

dist.init_process_group("gloo")
torch.manual_seed(0)
ref = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
model.load_state_dict(ref.state_dict())
fully_shard(model, mesh=init_device_mesh("cpu", (dist.get_world_size(),)))
opt = ps.adamw(1e-2, weight_decay=0.1)
params = {k: p.detach() for k, p in model.named_parameters()}
ref_params = {k: p.detach() for k, p in ref.named_parameters()}  # plain tensors, the module's own storage
state, ref_state = opt.init(params), opt.init(ref_params)
update = ps.make_update(opt, donate=True)
for _ in range(3):
    x = torch.randn(3, 4)
    model(x).sum().backward()
    ref(x).sum().backward()
    update(params, {k: p.grad for k, p in model.named_parameters()}, state)
    update(ref_params, {k: p.grad for k, p in ref.named_parameters()}, ref_state)
    model.zero_grad()
    ref.zero_grad()
for k, p in model.named_parameters():
    torch.testing.assert_close(p.full_tensor(), ref_params[k])
print("ok")
"""


def test_eager_donated_update_runs_on_fsdp2_params(tmp_path):
    # DTensor has no sharding rule for _foreach_copy_: the donated write-back goes leaf by leaf.
    script = tmp_path / "eager_donated.py"
    script.write_text(FSDP2_EAGER_DONATED)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1", str(script)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and "ok" in out.stdout, out.stdout[-3000:] + out.stderr[-3000:]


def test_expert_parallel_dispatch_with_uneven_routing_equals_whole_experts_forward_and_backward():
    """Top-2 of 4 experts, a different token count per rank, the experts over both ranks (ep =
    world, no FSDP2): uneven all_to_all splits, outputs and expert grads equal to whole
    experts on each rank's tokens (tests/api/_ep_worker.py)."""
    script = Path(__file__).with_name("_ep_worker.py")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(script)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert out.stdout.count(" ok, slots per expert ") == 2, out.stdout


def test_fewer_experts_per_ep_rank_than_ranks_to_shard_them_split_their_rows_and_match_one_process(
    tmp_path, same_device_as_the_ranks
):
    """2 experts over EP 2 x FSDP 2: one expert per EP rank, 2 ranks to shard it over. FSDP2's
    chunks of the expert dim would leave one rank of each pair holding it whole and the other
    nothing; the Trainer shards the experts' rows instead (`Shard(1)` over "efsdp"), every rank
    holds half an expert, Muon assembles each at its owner. Equal to one process after 4 steps."""
    moe = 'model.kwargs={"experts": 2, "top_k": 2}'
    out = torchrun(str(tmp_path / "ep"), "fsdp", "4", "--set", moe, "--set", "ep=2", nproc=4)
    assert "path sharded" in out.stdout, out.stdout
    ref = trainer(tmp_path / "single", "steps=4", moe)
    ref.fit()
    got = load_checkpoint(tmp_path / "ep" / "checkpoints" / "step_00000004")
    for k, p in ref.named.items():
        torch.testing.assert_close(got.params[k], p.detach(), rtol=1e-3, atol=1e-5)


def test_moe_gpt_with_expert_parallelism_matches_one_process_and_resumes_across_ep_degrees(
    tmp_path, same_device_as_the_ranks
):
    """The GPT with 4 routed experts per block (`model.kwargs.experts`) on 4 ranks with
    `ep=2`: each EP pair splits the experts (2 per rank), token slots travel to their
    expert's rank and back (all_to_all), FSDP2 shards each expert leaf over the 2 pairs (one
    whole expert per rank, Muon orthogonalizing it where it lies, on the sharded path) and
    everything else over all 4 ranks; the balance loss joins the loss. Equal to one process
    after 4 steps, losses included. Its checkpoint resumes on FSDP2 over 2 ranks without
    expert parallelism (2 whole experts per rank) and in one plain process, each equal to the
    single-process run. Every token goes to all 4 experts (softmax-weighted): with top-2,
    float noise in the grads' reduction order flips a near-tie routing choice and moves
    upstream params by ~6e-5 in 4 steps (measured), so the routing choice itself is checked
    in one process (tests/api/test_trainer.py)."""
    moe = 'model.kwargs={"experts": 4, "top_k": 4}'
    out = torchrun(str(tmp_path / "ep"), "fsdp", "4", "--set", moe, "--set", "ep=2", nproc=4)
    assert "path sharded" in out.stdout and "blocks over 4 ranks" in out.stdout, out.stdout
    ref = trainer(tmp_path / "single", "steps=4", moe)
    ref.fit()
    got = load_checkpoint(tmp_path / "ep" / "checkpoints" / "step_00000004")
    assert got.params["blocks.0.mlp.experts.gate"].shape[0] == 4 and got.manifest.world_size == 4
    for k, p in ref.named.items():
        torch.testing.assert_close(got.params[k], p.detach(), rtol=1e-3, atol=1e-5)
    logged = [json.loads(line) for line in (tmp_path / "ep" / "metrics.jsonl").read_text().splitlines()]
    ref_logged = [json.loads(line) for line in (tmp_path / "single" / "metrics.jsonl").read_text().splitlines()]
    assert [r["loss"] for r in logged if "loss" in r] == pytest.approx(
        [r["loss"] for r in ref_logged if "loss" in r], rel=1e-4
    )
    # across EP degrees: EP 2 x FSDP 2 -> FSDP2 on 2 ranks, and -> one plain process
    shutil.copytree(tmp_path / "ep", tmp_path / "fsdp")
    out = torchrun(str(tmp_path / "fsdp"), "fsdp", "8", "--resume", "--set", moe)
    assert "path sharded" in out.stdout, out.stdout
    resumed = trainer(tmp_path / "ep", "steps=8", moe)
    resumed.fit(resume=True)
    ref = trainer(tmp_path / "single", "steps=8", moe)
    ref.fit(resume=True)
    on_two = load_checkpoint(tmp_path / "fsdp" / "checkpoints" / "step_00000008")
    assert on_two.manifest.world_size == 2
    for k, p in ref.named.items():
        torch.testing.assert_close(on_two.params[k], p.detach(), rtol=1e-3, atol=1e-5)
        torch.testing.assert_close(resumed.named[k], p, rtol=1e-3, atol=1e-5)
