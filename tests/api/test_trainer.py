"""The Trainer on one CPU process: resume after SIGKILL, corrupted checkpoints, NaN and spike skips."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from purestep.api import CheckpointError, load_checkpoint
from purestep.api.trainer import RunDirError

from ._worker import trainer

WORKER = Path(__file__).with_name("_worker.py")


def events(run: Path) -> list[dict]:
    return [r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if "event" in r]


def assert_same_checkpoint(a: Path, b: Path) -> None:
    ca, cb = load_checkpoint(a), load_checkpoint(b)
    assert ca.step == cb.step
    for group in ("params", "opt_state", "ema"):
        ta, tb = getattr(ca, group), getattr(cb, group)
        assert ta.keys() == tb.keys()
        for k in ta:
            assert torch.equal(ta[k], tb[k]), f"{group}/{k} differs"


def test_sigkill_mid_run_then_resume_is_bit_identical(tmp_path):
    cmd = [sys.executable, str(WORKER)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    subprocess.run([*cmd, str(tmp_path / "whole"), "single", "40"], check=True, env=env, capture_output=True)

    cut = tmp_path / "cut"
    proc = subprocess.Popen([*cmd, str(cut), "single", "40"], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    mid = cut / "checkpoints" / "step_00000008"
    deadline = time.time() + 120
    while not (mid / "manifest.json").exists() and time.time() < deadline and proc.poll() is None:
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    assert proc.wait() == -signal.SIGKILL, "the run ended before it could be killed"
    assert not (cut / "checkpoints" / "step_00000040").exists()

    out = subprocess.run([*cmd, str(cut), "single", "40", "--resume"], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert "resumed from" in out.stderr
    assert_same_checkpoint(cut / "checkpoints" / "step_00000040", tmp_path / "whole" / "checkpoints" / "step_00000040")
    steps = [json.loads(line)["step"] for line in (cut / "metrics.jsonl").read_text().splitlines()]
    assert steps == sorted(steps) and steps[-1] == 40  # nothing logged twice after the rewind to the checkpoint


def test_corrupted_checkpoint_fails_loudly_and_resume_falls_back(tmp_path, capsys):
    t = trainer(tmp_path, "steps=8")
    t.fit()
    bad = tmp_path / "checkpoints" / "step_00000008" / "params.safetensors"
    data = bytearray(bad.read_bytes())
    data[len(data) // 2] ^= 0xFF
    bad.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="params.safetensors"):
        load_checkpoint(bad.parent)

    t = trainer(tmp_path, "steps=10")
    t.fit(resume=True)
    err = capsys.readouterr().err
    assert "warning" in err and str(bad.parent) in err
    assert "resumed from" in err and "step_00000004" in err
    assert t.step == 10 and t.updates == 10


def test_resume_refuses_when_no_checkpoint_loads(tmp_path):
    trainer(tmp_path, "steps=4").fit()
    (tmp_path / "checkpoints" / "step_00000004" / "opt_state.safetensors").write_bytes(b"junk")
    with pytest.raises(RunDirError, match="nothing to resume"):
        trainer(tmp_path, "steps=6").fit(resume=True)


def test_run_dir_holding_another_run_is_refused(tmp_path):
    trainer(tmp_path, "steps=3").fit()
    with pytest.raises(RunDirError, match="already holds a run"):
        trainer(tmp_path, "steps=3").fit()


def test_nonfinite_gradients_skip_the_step_and_are_logged(tmp_path):
    t = trainer(tmp_path, "steps=6", nan_at=2)
    before = {k: p.detach().clone() for k, p in t.named.items()}
    t.fit()
    assert t.updates == 5 and t.step == 6
    assert [(e["step"], e["event"]) for e in events(tmp_path)] == [(3, "skip_nonfinite")]
    assert all(torch.isfinite(p).all() for p in t.named.values())
    assert any(not torch.equal(before[k], p) for k, p in t.named.items())


def test_loss_spike_is_skipped_and_repeated_spikes_rewind(tmp_path):
    t = trainer(tmp_path, "steps=16", "spike_factor=3", "spike_window=3", "spike_rewind=2", spikes=(5, 9, 10))
    t.fit()
    log = [(e["step"], e["event"]) for e in events(tmp_path)]
    assert log[:3] == [(6, "skip_spike"), (10, "skip_spike"), (11, "skip_spike")]
    rewind = events(tmp_path)[2]["rewind"]
    assert rewind == {"to": 8, "skipped": [8, 11]}  # back to the step-8 checkpoint; batches 8..10 skipped
    assert [e for e in log[3:] if e[1] != "skip_rewound_batch"] == []
    assert t.step == 16 and t.skip == [[8, 11]]


def test_grad_accumulation_matches_the_full_batch(tmp_path):
    a = trainer(None, "steps=3", "checkpoint_every=0", "optimizer.name=adamw", "optimizer.kwargs={}")
    b = trainer(None, "steps=3", "checkpoint_every=0", "optimizer.name=adamw", "optimizer.kwargs={}", "grad_accum=4")
    a.fit()
    b.fit()
    for k, p in a.named.items():
        torch.testing.assert_close(b.named[k], p, rtol=1e-3, atol=1e-4)  # Adam amplifies rounding in tiny grads


def test_time_budget_stops_the_run_and_drives_the_schedule_by_progress(tmp_path):
    t = trainer(None, "steps=100000", "checkpoint_every=0", "time_budget=3", "schedule.final_lr=0.0")
    t.fit()
    assert 2 <= t.step < 100000 and t.elapsed >= 3
    # By step count the schedule would still be at its peak; by progress it has decayed.
    assert t.lr() < 0.02 * 0.9
