"""A run directory has one writer at a time; resuming and stepping lead on instead of dead-ending."""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from purestep.api import CheckpointManager, RunDirError
from purestep.api.checkpoint import _lock
from purestep.api.cli import main
from tests.api._worker import trainer

HOLD = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    from purestep.api import CheckpointManager
    run = Path(sys.argv[1])
    manager = CheckpointManager(run)
    manager.hold()
    (run / "checkpoints").mkdir(exist_ok=True)
    (run / "checkpoints" / ".step_00000001.tmp-0123456789ab").mkdir()  # a save in flight
    print("held", flush=True)
    time.sleep(120)
""")


@pytest.fixture
def held(tmp_path):
    """A run directory held by another process (killed at the end, never released by it)."""
    run = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(run)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "held"
    yield run, proc
    proc.kill()
    proc.wait()


def test_a_second_writer_is_refused_naming_the_holder_and_a_killed_holder_frees_the_directory(held, capsys):
    run, proc = held
    who = f"pid {proc.pid} on {socket.gethostname()} since "
    with pytest.raises(RunDirError, match=f"{run}: in use by another run \\({who}"):
        trainer(run, "steps=3").fit()
    with pytest.raises(RunDirError, match=who):  # CheckpointManager from Python: the same lock
        CheckpointManager(run).save(1, params={"w": torch.zeros(2)})
    with pytest.raises(RunDirError, match=who):  # and its cleanup never touches the live writer's temporary
        CheckpointManager(run).cleanup()
    assert (run / "checkpoints" / ".step_00000001.tmp-0123456789ab").is_dir()
    for flag in ((), ("--resume",)):
        with pytest.raises(SystemExit) as e:
            main(["demo", "--out", str(run), "--steps", "3", *flag])
        err = capsys.readouterr().err
        assert e.value.code == 2 and err.count("\n") == 1 and who in err, err
    proc.kill()
    proc.wait()  # killed, never released: the OS lets go of its lock
    t = trainer(run, "steps=3")
    t.fit()
    assert t.step == 3 and not (run / "checkpoints" / ".step_00000001.tmp-0123456789ab").exists()
    assert "pid " + str(os.getpid()) in (run / _lock.LOCK_FILE).read_text()


def test_one_process_shares_its_hold_and_lets_go_when_the_last_holder_does(tmp_path):
    a, b = CheckpointManager(tmp_path), CheckpointManager(tmp_path)
    a.save(1, params={"w": torch.zeros(2)})
    b.save(2, params={"w": torch.ones(2)})  # same process: not a second writer
    probe = f"import fcntl, os, sys; fd = os.open(sys.argv[1], os.O_RDWR); fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)"
    lock = str(tmp_path / _lock.LOCK_FILE)
    assert subprocess.run([sys.executable, "-c", probe, lock], capture_output=True).returncode != 0
    a.release()
    assert subprocess.run([sys.executable, "-c", probe, lock], capture_output=True).returncode != 0  # b still holds
    b.release()
    assert subprocess.run([sys.executable, "-c", probe, lock], capture_output=True).returncode == 0


def test_a_file_system_without_locks_warns_once_and_trains_unlocked(tmp_path, monkeypatch, capsys):
    def no_locks(fd, op):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(fcntl, "flock", no_locks)
    manager = CheckpointManager(tmp_path)
    manager.save(1, params={"w": torch.zeros(2)})
    manager.save(2, params={"w": torch.zeros(2)})
    err = capsys.readouterr().err
    assert err.count("does not lock files (No locks available)") == 1
    assert manager._lock.enforced is False and manager.latest().name == "step_00000002"
    assert f"pid {os.getpid()}" in (tmp_path / _lock.LOCK_FILE).read_text()


def test_resume_of_a_run_killed_before_its_first_checkpoint_starts_over_with_a_warning(tmp_path, capsys):
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 9.0}) + "\n")
    with pytest.raises(RunDirError, match="already holds a run; pass --resume"):
        trainer(tmp_path, "steps=3").fit()
    t = trainer(tmp_path, "steps=3")
    t.fit(resume=True)
    assert "holds no checkpoint (the run stopped before its first); starting from step 0" in capsys.readouterr().err
    steps = [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert t.step == 3 and steps == [1, 2, 3]  # the old record is gone, the new run's are there
    # Damaged checkpoints only: no silent restart over them; the message says what to do.
    for path in (tmp_path / "checkpoints").iterdir():
        for f in path.glob("*.safetensors"):
            f.write_bytes(b"\0" * 8)
    with pytest.raises(RunDirError, match="loads .see the warnings above.; move the damaged ones aside"):
        trainer(tmp_path, "steps=4").fit(resume=True)


def test_train_step_before_fit_opens_the_data_and_writes_nothing(tmp_path):
    t = trainer(tmp_path / "run", "steps=4")
    before = {k: p.detach().clone() for k, p in t.named.items()}
    records = [t.train_step(), t.train_step()]  # the warmup's lr is 0 at the first
    assert t.step == 2 and all(torch.isfinite(r["loss"]) for r in records)
    assert any(not torch.equal(before[k], p.detach()) for k, p in t.named.items())
    assert not (tmp_path / "run").exists()
    t.fit()  # fit goes on from there
    assert t.step == 4 and Path(tmp_path / "run" / "checkpoints" / "step_00000004").is_dir()


def test_the_loop_state_is_one_record_saved_with_the_checkpoint_and_loaded_back(tmp_path):
    from purestep.api import load_checkpoint

    t = trainer(tmp_path, "steps=4", "spike_factor=8.0", "spike_window=2")
    t.fit()
    saved = load_checkpoint(tmp_path / "checkpoints" / "step_00000004").manifest.metadata["trainer"]
    assert saved == t.loop.state_dict() and saved["step"] == 4 and saved["tokens"] > 0 and len(saved["recent"]) == 2
    back = trainer(tmp_path, "steps=6")
    back.fit(resume=True)  # resumed from step 4, trained on to 6
    assert back.step == 6 and back.loop.state_dict()["tokens"] == saved["tokens"] * 6 // 4
