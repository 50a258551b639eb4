"""The sharded update on FSDP2 (2 CPU ranks, gloo) equals one process: one torchrun run.

Covers AdamW + global-norm clip, Muon and NorMuon (owner-computes; NorMuon with both step
sizes) with AdamW, LAMB (trust-ratio
norms), AGC, cautious AdamW (per-leaf counts), Prodigy (tree-wide sums), MARS (per-leaf
norms), ADOPT/LaProp/AdamC, Muon and NorMuon with batched expert leaves (each rank its own experts), `apply_if_finite` skipping on every rank when one rank's grad block holds a
NaN, uneven blocks and a rank holding an empty one, compiled and eager, and a forward after
the update (FSDP2 all-gathers the updated params), and every collective's payload on the
params' device with no object collective inside a step (`Payloads`: NCCL refuses CPU tensors). Resumes across world sizes run through the
Trainer in tests/api/test_distributed.py.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

WORKER = Path(__file__).with_name("_fsdp_step_worker.py")


def test_sharded_update_on_two_fsdp2_ranks_equals_one_process():
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(WORKER)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    done = [line.split()[1:3] for line in out.stdout.splitlines() if line.startswith("ok ")]
    assert done == [
        ["adamw+clip+skip", "compile=False"], ["adamw+clip+skip", "compile=True"],
        ["muon_adamw", "compile=False"], ["muon_adamw", "compile=True"],
        ["normuon_adamw", "compile=False"], ["normuon_adamw", "compile=True"],
        ["normuon_original", "compile=False"], ["lamb", "compile=False"], ["adaptive_clip", "compile=False"], ["cautious_adamw", "compile=False"],
        ["prodigy", "compile=False"], ["prodigy", "compile=True"], ["mars", "compile=False"],
        ["adopt/laprop/adamc", "compile=False"], ["muon_batch_dims", "compile=False"], ["muon_split", "compile=False"],
        ["normuon_batch_dims", "compile=False"], ["normuon_batch_dims", "compile=True"],
        ["kron", "compile=False"], ["soap", "compile=False"], ["qk_clip_rows", "compile=False"], ["empty_branch", "compile=False"], ["per-leaf-DTensor", "compile=False"],
        ["payloads", "checked:"],
    ], out.stdout


def test_sharded_update_on_an_hsdp_mesh_of_four_ranks_equals_one_process_and_keeps_replicas_identical():
    """HSDP: `fully_shard(..., mesh=init_device_mesh("cpu", (2, 2)))`, a (replicate, shard)
    mesh; then FSDP+TP and TP alone on the same 4 ranks. Reductions and owner-computes run within each replica's shard group; the replicas
    must hold bitwise the same params and state after every case, every case equal to one
    process, a NaN in both replicas' block skipped by every rank."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=4", str(WORKER), "hsdp"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    done = [line.split()[2:4] for line in out.stdout.splitlines() if line.startswith("ok hsdp ")]
    assert done == [
        ["adamw+clip+skip", "compile=False"], ["adamw+clip+skip", "compile=True"],
        ["muon_adamw", "compile=False"], ["muon_adamw", "compile=True"],
        ["normuon_adamw", "compile=False"], ["lamb", "compile=False"], ["prodigy", "compile=False"],
        ["soap", "compile=False"],
    ], out.stdout
    # The state sharded across the replicas (shard_state_over_replicas=True): each rank holds
    # 1/4 of every state leaf (ps.state_bytes), the state's full tensors are one process's,
    # the params bitwise equal across replicas and equal to one process.
    done = [line.split()[2:4] for line in out.stdout.splitlines() if line.startswith("ok over-replicas ")]
    assert done == [
        ["adamw+clip+skip", "compile=False"], ["adamw+clip+skip", "compile=True"],
        ["muon_adamw", "compile=False"], ["normuon_adamw", "compile=False"], ["muon_split", "compile=False"],
    ], out.stdout
    # FSDP2 over mesh["shard"] in each replica, each replica on its own half of the batch, the
    # update given the mesh: it averages the replicas' grads itself (a reduce_scatter).
    done = [line.split()[2:4] for line in out.stdout.splitlines() if line.startswith("ok replicas-apart ")]
    assert done == [["adamw+clip+skip", "compile=True"], ["muon_adamw", "compile=False"]], out.stdout
    # Tensor parallelism (FSDP2 over mesh["dp"] beside TP over mesh["tp"]; TP alone beside plain
    # params): torch's own clip_grad_norm_ refuses the mixed meshes. Elementwise math and
    # reductions run on each rank's blocks (the sharded path: weights count each block once),
    # Muon's matrices assembled at their owners from row x column blocks, NorMuon's per-row
    # statistics summed over a row's column blocks (ops.row_sums, one collective), QK-clip's
    # factors for the rows each block holds (ops.held_rows); Kron's and SOAP's per-leaf math and state at each leaf's owner.
    lines = [line.split() for line in out.stdout.splitlines() if line.startswith(("ok fsdp+tp ", "ok tp "))]
    want = [
        (layout, name, f"compile={c}")
        for layout in ("fsdp+tp", "tp")
        for name in ("adamw+clip+skip", "muon_adamw", "normuon_adamw", "lamb", "qk_clip", "kron", "soap")
        for c in ((False, True) if name in ("adamw+clip+skip", "muon_adamw", "normuon_adamw") else (False,))
    ]
    assert [tuple(line[1:4]) for line in lines] == want, out.stdout
    on_blocks = {"adamw+clip+skip", "muon_adamw", "normuon_adamw", "lamb", "qk_clip"}
    for line in lines:
        path = "path='sharded'" if line[2] in on_blocks else "path='per-leaf"
        assert line[5].startswith(path), line
