"""Checkpoints written in the background (issue 28): `CheckpointManager(background=True)` and
the Trainer's `async_checkpoint`. A save returns once the state is copied; the loop may go
on changing it; a failure is raised by the next call that waits; a process killed during
the write leaves the last good checkpoint loadable and nothing of the new one taken.
(The 2-rank FSDP2 cases, both layouts, are in tests/api/test_distributed.py's drill.)"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch

import purestep.core as ps
from purestep.api.checkpoint import CheckpointError, CheckpointManager, load_checkpoint


def _trees():
    params = {"w": torch.randn(64, 32), "b": torch.randn(32)}
    opt = ps.adamw(1e-2)
    state = opt.init(params)
    updates, state = opt.update({k: torch.randn_like(v) for k, v in params.items()}, state, params)
    return ps.apply_updates(params, updates), state


def test_a_background_save_holds_the_state_as_it_was_at_the_save(tmp_path):
    params, state = _trees()
    manager = CheckpointManager(tmp_path, keep_last=2, background=True)
    before = {k: v.clone() for k, v in params.items()}
    nu = ps.tree_get(state, "nu")["w"].clone()
    path = manager.save(1, params=params, opt_state=state)
    with torch.no_grad():  # the loop goes on while the write runs
        for v in params.values():
            v.add_(1000.0)
        ps.tree_get(state, "nu")["w"].zero_()
    assert manager.wait() == path and manager.latest() == path
    c = load_checkpoint(path)
    assert all(torch.equal(c.params[k], before[k]) for k in before)
    assert torch.equal(c.opt_state["0.nu.w"], nu)  # loaded without a like-tree: by key path
    # Each save waits for the one before; keep_last holds.
    for step in (2, 3, 4):
        manager.save(step, params=params, opt_state=state)
    manager.wait()
    assert [p.name for p in sorted((tmp_path / "checkpoints").iterdir())] == ["step_00000003", "step_00000004"]
    assert manager.restore(params_like=params, opt_state_like=state).step == 4


def test_a_failed_background_save_is_raised_by_the_next_wait_and_loses_nothing(tmp_path, monkeypatch):
    params, state = _trees()
    manager = CheckpointManager(tmp_path, keep_last=3, background=True)
    manager.save(1, params=params, opt_state=state)
    manager.wait()
    import purestep.api.checkpoint._files as files

    def full_disk(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(files, "write_tensors", full_disk)
    manager.save(2, params=params, opt_state=state)  # returns: the write fails in the background
    with pytest.raises(CheckpointError, match=r"step_00000002: cannot write the checkpoint: .*No space left on device"):
        manager.save(3, params=params, opt_state=state)  # waits for step 2 first
    assert manager.latest().name == "step_00000001"
    assert [p.name for p in (tmp_path / "checkpoints").iterdir()] == ["step_00000001"]  # no temporary left
    monkeypatch.undo()
    assert manager.restore(params_like=params, opt_state_like=state).step == 1


def test_a_process_killed_during_a_background_write_leaves_the_last_good_checkpoint(tmp_path):
    script = textwrap.dedent(
        f"""
        import os, torch
        import purestep.api.checkpoint._io as io
        from purestep.api.checkpoint import CheckpointManager
        params = {{"w": torch.full((256, 256), 1.0)}}
        manager = CheckpointManager({str(tmp_path)!r}, background=True)
        manager.save(1, params=params)
        manager.wait()
        real = io.write_tensors
        def dies_midway(path, tensors):  # the second save's first file, half written: then the kill
            real(path, tensors)
            with open(path, "r+b") as f:
                f.truncate(os.path.getsize(path) // 2)
            os._exit(9)
        io._files.write_tensors = dies_midway
        params["w"].fill_(2.0)
        manager.save(2, params=params)
        manager.wait()
        """
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 9, done.stderr
    manager = CheckpointManager(tmp_path)
    assert manager.latest().name == "step_00000001"
    c = manager.restore(params_like={"w": torch.zeros(256, 256)})
    assert c.step == 1 and bool((c.params["w"] == 1.0).all())
    assert len(list((tmp_path / "checkpoints").iterdir())) == 2  # the dead write's temporary, never taken
    manager.save(3, params={"w": torch.zeros(256, 256)})  # the next save removes it
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_00000001", "step_00000003"]


def test_the_trainer_with_async_checkpoint_writes_the_same_checkpoints(tmp_path):
    from purestep.api import TrainConfig, Trainer, apply_overrides

    def run(out, *extra):
        cfg = apply_overrides(
            TrainConfig(),
            [
                "steps=6",
                "checkpoint_every=2",
                "batch_size=4",
                "log_every=3",
                "model.n_layer=1",
                "model.n_embd=32",
                "model.n_head=2",
                "model.block_size=16",
                *extra,
            ],
        )
        t = Trainer(config=cfg, out=out, progress=False)
        t.fit()
        return t

    sync = run(tmp_path / "sync")
    bg = run(tmp_path / "bg", "async_checkpoint=true")
    for step in (2, 4, 6):
        name = f"checkpoints/step_{step:08d}"
        a, b = load_checkpoint(tmp_path / "sync" / name), load_checkpoint(tmp_path / "bg" / name)
        assert all(torch.equal(a.params[k], b.params[k]) for k in a.params), step
    assert not any(p.name.startswith(".") for p in (tmp_path / "bg" / "checkpoints").iterdir())
    assert all(torch.equal(x, y) for x, y in zip(sync.params().values(), bg.params().values()))


def test_an_interrupted_wait_keeps_the_save_pending_and_load_waits(tmp_path, monkeypatch):
    """Ctrl-C while `wait()` joins the write: the save stays pending, so the next save waits
    for it (its temporary directory and host buffers are not reused under it); `load` waits too."""
    import threading

    params, state = _trees()
    manager = CheckpointManager(tmp_path, keep_last=5, background=True)
    gate = threading.Event()
    import purestep.api.checkpoint._files as files

    real = files.write_tensors

    def held(path, tensors):  # the disk is slow until the gate opens
        gate.wait(30)
        return real(path, tensors)

    monkeypatch.setattr(files, "write_tensors", held)
    path = manager.save(1, params=params, opt_state=state)
    job = manager._pending._job
    monkeypatch.setattr(job.finished, "wait", lambda *a: (_ for _ in ()).throw(KeyboardInterrupt()))
    with pytest.raises(KeyboardInterrupt):
        manager.wait()
    assert manager._pending is not None  # still pending
    monkeypatch.undo()
    monkeypatch.setattr(files, "write_tensors", held)
    gate.set()
    c = manager.load(path, params_like=params, opt_state_like=state)  # waits for the write
    assert c.step == 1 and manager._pending is None
