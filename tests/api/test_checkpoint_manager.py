"""CheckpointManager: crashes at any point of a save, kill -9, keep_last on a full disk, fallback, errors in one line."""

from __future__ import annotations

import contextlib
import errno
import os
import random
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import safetensors
import safetensors.torch
import torch

from purestep.api.checkpoint import CheckpointError, CheckpointManager, checkpoint_dir, load_distributed, read_manifest
from purestep.api.checkpoint import verify_checkpoint
from purestep.api.cli import main

from .test_checkpoint import assert_trees_equal, reseal, trained_state

WORKER = Path(__file__).with_name("_worker.py")


def hidden(run: Path) -> list[str]:
    return sorted(p.name for p in (run / "checkpoints").iterdir() if p.name.startswith("."))


def visible(run: Path) -> list[str]:
    return sorted(p.name for p in (run / "checkpoints").iterdir() if not p.name.startswith("."))


def same(a, b) -> bool:
    try:
        assert_trees_equal(a, b)
        return True
    except AssertionError:
        return False


class Crash(BaseException):
    """The process died here: nothing after it runs, not even cleanup handlers."""


# Every file-system step a save takes goes through one of these.
PRIMITIVES = [(os, "rename"), (os, "mkdir"), (os, "fsync"), (shutil, "rmtree"), (safetensors.torch, "save_file")]


@contextlib.contextmanager
def dies_at(k: int | None):
    """Record the save's file-system steps; with `k`, die at step k: it and every later step raise `Crash`."""
    steps: list[str] = []
    with pytest.MonkeyPatch.context() as mp:
        for module, name in PRIMITIVES:
            def step(*args, _real=getattr(module, name), _name=name, **kwargs):
                steps.append(_name)
                if k is not None and len(steps) > k:
                    raise Crash(f"killed at step {k} ({_name})")
                return _real(*args, **kwargs)

            mp.setattr(module, name, step)
        yield steps


@pytest.fixture(scope="module")
def two_steps(tmp_path_factory):
    """A run with checkpoints at steps 1 and 3 (params, AdamW state, EMA), and what each holds."""
    run = tmp_path_factory.mktemp("template")
    saved = {}
    for step in (1, 3):
        opt, params, state, ema = trained_state(step)
        CheckpointManager(run, keep_last=2).save(step, params=params, opt_state=state, ema=ema)
        saved[step] = (params, state, ema)
    return run, opt, saved


@pytest.mark.parametrize("distributed", [False, True], ids=["files", "dcp"])
@pytest.mark.parametrize("new_step", [5, 3], ids=["new step", "re-save of the newest"])
def test_a_crash_at_any_point_of_a_save_loses_nothing_and_the_next_save_cleans_up(two_steps, tmp_path, distributed,
                                                                                   new_step):
    template, opt, saved = two_steps
    _, params, state, ema = trained_state(5)
    contents = {step: [trees] for step, trees in saved.items()}  # what a checkpoint of each step may hold
    contents.setdefault(new_step, []).append((params, state, ema))

    def save(manager: CheckpointManager, step: int) -> None:
        manager.save(step, params=params, opt_state=state, ema=ema)

    manager = CheckpointManager(shutil.copytree(template, tmp_path / "count"), keep_last=2, distributed=distributed)
    with dies_at(None) as steps:  # count the steps of a save that does not crash
        save(manager, new_step)
    assert len(steps) >= 10 and {"rename", "fsync", "rmtree", "mkdir"} <= set(steps)
    like = dict(params_like=params, opt_state_like=opt.init(params), ema_like=ema)
    for k in range(len(steps)):
        run = shutil.copytree(template, tmp_path / f"crash{k}")
        with pytest.raises(Crash), dies_at(k):
            save(CheckpointManager(run, keep_last=2, distributed=distributed), new_step)
        manager = CheckpointManager(run, keep_last=2, distributed=distributed)
        # keep_last=2 may have deleted step 1 to make room, never step 3, and a re-saved step 3 never hides.
        assert read_manifest(manager.latest()).step in (3, new_step), (k, steps[k])
        back = manager.restore(**like)
        assert back.step in (3, new_step), (k, steps[k])
        assert any(all(same(getattr(back, g), tree) for g, tree in zip(("params", "opt_state", "ema"), trees))
                   for trees in contents[back.step]), (k, steps[k])
        save(manager, 7)  # the next save removes what the crash left
        assert hidden(run) == [], (k, steps[k])
        for name in visible(run):
            verify_checkpoint(run / "checkpoints" / name)


def test_kill_9_while_saving_never_loses_the_last_checkpoint(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    rng = random.Random(0)
    like = {"w": torch.zeros(1 << 20)}
    newest = -1
    for _ in range(2):
        proc = subprocess.Popen([sys.executable, str(WORKER), "save-forever", str(tmp_path)], stdout=subprocess.PIPE,
                                env=env, text=True)
        first = int(proc.stdout.readline())  # one save done: kill it somewhere in the next ones
        assert first == newest + 1  # it resumed from the newest checkpoint the last kill left
        while rng.random() < 0.5:
            proc.stdout.readline()
        proc.kill()
        proc.wait()
        back = CheckpointManager(tmp_path, keep_last=2).restore(params_like=like)
        assert back is not None and back.step >= first
        assert torch.equal(back.params["w"], torch.full((1 << 20,), float(back.step)))
        newest = back.step
    manager = CheckpointManager(tmp_path, keep_last=2)
    manager.save(newest + 1, params=like)
    assert hidden(tmp_path) == [] and len(visible(tmp_path)) == 2


def test_keep_last_never_needs_room_for_one_more_checkpoint(tmp_path, monkeypatch):
    real = safetensors.torch.save_file
    on_disk: list[int] = []

    def counting(tensors, filename, metadata=None):
        on_disk.append(sum(p.is_dir() for p in Path(filename).parent.parent.iterdir()))  # the one written included
        return real(tensors, filename, metadata=metadata)

    monkeypatch.setattr(safetensors.torch, "save_file", counting)
    manager = CheckpointManager(tmp_path, keep_last=3)
    for step in range(1, 8):
        manager.save(step, params={"w": torch.full((4,), float(step))}, opt_state={"m": torch.zeros(4)})
    assert max(on_disk) == 3
    assert visible(tmp_path) == ["step_00000005", "step_00000006", "step_00000007"] and hidden(tmp_path) == []


def test_keep_last_never_deletes_the_last_good_checkpoint_before_its_successor_is_complete(tmp_path, monkeypatch):
    # keep_last=1: the only checkpoint stays until the new one is published.
    manager = CheckpointManager(tmp_path / "one", keep_last=1)
    manager.save(1, params={"w": torch.ones(2)})
    real = safetensors.torch.save_file
    present: list[list[str]] = []

    def watching(tensors, filename, metadata=None):
        present.append(visible(Path(filename).parent.parent.parent))
        return real(tensors, filename, metadata=metadata)

    monkeypatch.setattr(safetensors.torch, "save_file", watching)
    manager.save(2, params={"w": torch.ones(2)})
    assert present and all(names == ["step_00000001"] for names in present)
    assert visible(tmp_path / "one") == ["step_00000002"]
    # keep_last=2 with a good step 1 and a damaged step 3: room is made by deleting the damaged one.
    run = tmp_path / "two"
    for step in (1, 3):
        CheckpointManager(run, keep_last=2).save(step, params={"w": torch.full((2,), float(step))})
    (checkpoint_dir(run, 3) / "params.safetensors").write_bytes(b"junk")
    present.clear()
    CheckpointManager(run, keep_last=2).save(5, params={"w": torch.full((2,), 5.0)})
    assert present and all("step_00000001" in names for names in present)
    assert visible(run) == ["step_00000001", "step_00000005"]


def test_restore_falls_back_past_damaged_checkpoints_with_one_warning_line_each(tmp_path, capsys):
    manager = CheckpointManager(tmp_path, keep_last=5)
    for step in (1, 2, 3):
        manager.save(step, params={"w": torch.full((2,), float(step))})
    (checkpoint_dir(tmp_path, 3) / "params.safetensors").write_bytes(b"junk")
    manifest = checkpoint_dir(tmp_path, 2) / "manifest.json"
    manifest.write_text(manifest.read_text().replace('"step": 2', '"step": 20'))
    back = manager.restore(params_like={"w": torch.zeros(2)})  # a rewind is the same call
    assert back.step == 1 and torch.equal(back.params["w"], torch.ones(2))
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2
    assert "step_00000003" in err[0] and "params.safetensors: truncated" in err[0]
    assert "step_00000002" in err[1] and "checksum mismatch" in err[1]
    (checkpoint_dir(tmp_path, 1) / "manifest.json").unlink()
    assert manager.restore(params_like={"w": torch.zeros(2)}) is None
    assert manager.latest() == checkpoint_dir(tmp_path, 3)  # sealed; its damaged file shows only when it loads


@pytest.mark.parametrize("distributed", [False, True], ids=["files", "dcp"])
def test_a_checkpoint_of_another_shape_is_refused_naming_the_tensor_and_both_shapes(tmp_path, distributed):
    torch.manual_seed(0)
    small, big = torch.nn.Linear(4, 1), torch.nn.Linear(4, 3)
    manager = CheckpointManager(tmp_path, distributed=distributed)
    path = manager.save(1, params={k: p.detach() for k, p in small.named_parameters()})
    before = {k: v.clone() for k, v in big.state_dict().items()}
    like = {k: p.detach() for k, p in big.named_parameters()}
    shapes = r"params 'weight' is \[1, 4\] torch.float32 in the checkpoint, but \[3, 4\] torch.float32 in params"
    with pytest.raises(CheckpointError, match=shapes + "_like"):
        manager.load(path, params_like=like)
    with pytest.raises(CheckpointError, match=shapes):
        load_distributed(path, params=like)
    for k, v in big.state_dict().items():  # nothing was broadcast into the model
        assert torch.equal(v, before[k])


def test_cleanup_removes_leftovers_and_puts_back_a_checkpoint_whose_replacement_never_arrived(tmp_path, capsys):
    manager = CheckpointManager(tmp_path, keep_last=5)
    for step in (1, 2):
        manager.save(step, params={"w": torch.full((2,), float(step))})
    folder = tmp_path / "checkpoints"
    (folder / ".step_00000003.tmp-0123456789ab").mkdir()  # a save killed while writing
    (folder / ".step_00000003.tmp-0123456789ab" / "params.safetensors").write_bytes(b"half")
    shutil.copytree(folder / "step_00000001", folder / ".step_00000001.old-0123456789ab")  # replaced, then killed
    os.rename(folder / "step_00000002", folder / ".step_00000002.old-ba9876543210")  # killed mid re-save of step 2
    shutil.copytree(folder / "step_00000001", folder / ".step_00000001.del-0123456789ab")  # killed while deleting
    (folder / ".keep-me").mkdir()  # not ours
    assert manager.latest() == folder / ".step_00000002.old-ba9876543210"  # step 2 is not hidden by the crash
    assert manager.restore(params_like={"w": torch.zeros(2)}).step == 2
    manager.cleanup()
    assert sorted(p.name for p in folder.iterdir()) == [".keep-me", "step_00000001", "step_00000002"]
    assert manager.latest() == folder / "step_00000002"


# --------------------------------------------------------------------------- #
# Errors: one line naming the path, exit code 2 from the command line.
# --------------------------------------------------------------------------- #


@pytest.mark.parametrize("where", ["fsync", "safetensors", "dcp"])
def test_a_full_disk_is_one_line_naming_the_checkpoint_and_leaves_no_trace(tmp_path, monkeypatch, where):
    manager = CheckpointManager(tmp_path, keep_last=2, distributed=where == "dcp")
    manager.save(1, params={"w": torch.ones(2)})
    full = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    if where == "safetensors":  # what safetensors itself raises when the disk fills
        full = safetensors.SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    def no_space(*args, **kwargs):
        raise full

    monkeypatch.setattr(*((safetensors.torch, "save_file") if where == "safetensors" else (os, "fsync")), no_space)
    with pytest.raises(CheckpointError) as e:
        manager.save(2, params={"w": torch.ones(2)})
    message = str(e.value)
    assert len(message.splitlines()) == 1 and "No space left on device" in message
    assert message.startswith(f"{checkpoint_dir(tmp_path, 2)}: cannot write the checkpoint")
    monkeypatch.undo()
    assert visible(tmp_path) == ["step_00000001"] and hidden(tmp_path) == []
    assert manager.restore(params_like={"w": torch.zeros(2)}).step == 1


def test_a_read_only_output_directory_is_one_line_naming_it(tmp_path, monkeypatch):
    def read_only(path, *args, **kwargs):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(path))

    monkeypatch.setattr(os, "mkdir", read_only)
    with pytest.raises(CheckpointError, match=rf"^{tmp_path}.*step_00000001: cannot write the checkpoint: "
                                              r"Read-only file system \(.*checkpoints"):
        CheckpointManager(tmp_path).save(1, params={"w": torch.ones(2)})


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only directories")
def test_a_directory_without_write_permission_is_one_line_naming_it(tmp_path):
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "checkpoints").chmod(0o555)
    try:
        with pytest.raises(CheckpointError, match="cannot write the checkpoint: Permission denied"):
            CheckpointManager(tmp_path).save(1, params={"w": torch.ones(2)})
    finally:
        (tmp_path / "checkpoints").chmod(0o755)


def inspect(path: Path, capsys) -> tuple[int, list[str]]:
    with pytest.raises(SystemExit) as e:
        main(["inspect", str(path)])
    return e.value.code, capsys.readouterr().err.strip().splitlines()


def test_inspect_of_a_sealed_but_malformed_safetensors_file_exits_2_with_one_line(tmp_path, capsys):
    path = CheckpointManager(tmp_path).save(1, params={"w": torch.ones(2)})
    file = path / "params.safetensors"
    file.write_bytes((10**9).to_bytes(8, "little") + b"{not json")  # a header that claims 1 GB
    reseal(path, {"params.safetensors": file})
    code, err = inspect(path, capsys)
    assert code == 2 and len(err) == 1 and f"{file}: not a readable safetensors file" in err[0]


def test_inspect_of_a_manifest_naming_a_file_outside_exits_2_with_one_line(tmp_path, capsys):
    path = CheckpointManager(tmp_path).save(1, params={"w": torch.ones(2)})
    shutil.copy(path / "params.safetensors", tmp_path / "elsewhere.safetensors")
    reseal(path, {"params.safetensors": None, "../../elsewhere.safetensors": tmp_path / "elsewhere.safetensors"})
    code, err = inspect(path, capsys)
    assert code == 2 and len(err) == 1 and "lists '../../elsewhere.safetensors'" in err[0]
