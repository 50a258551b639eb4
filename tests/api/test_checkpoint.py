"""Checkpoints: bit-exact round trips, loud failures naming the file, atomic saves, keep_last."""

from __future__ import annotations

import hashlib
import random
import shutil
from pathlib import Path

import msgspec
import pytest
import torch

import purestep.core as ps
from purestep.api import (
    CheckpointError,
    checkpoint_dir,
    latest_checkpoint,
    load_checkpoint,
    read_manifest,
    save_checkpoint,
)
from purestep.api.checkpoint._format import encode_manifest
from purestep.api.checkpoint import FileEntry, load_distributed


def trained_state(steps: int = 3):
    """Params, AdamW state and an EMA tree after a few real steps, in several dtypes."""
    g = torch.Generator().manual_seed(0)
    params = {
        "layers.0.weight": torch.randn(4, 3, generator=g, dtype=torch.float64),
        "layers.0.bias": torch.randn(4, generator=g, dtype=torch.float32),
        "head.weight": torch.randn(2, 4, generator=g).to(torch.bfloat16),
        "scale": torch.randn((), generator=g, dtype=torch.float64),
    }
    opt = ps.chain(ps.clip_by_global_norm(1.0), ps.inject_hyperparams(ps.adamw)(lr=1e-2, weight_decay=0.1))
    state = opt.init(params)
    ema_init, ema_update = ps.params_ema(0.9)
    ema = ema_init(params)
    for _ in range(steps):
        grads = {k: torch.randn(v.shape, generator=g).to(v.dtype) for k, v in params.items()}
        updates, state = opt.update(grads, state, params)
        params = ps.apply_updates(params, updates)
        ema = ema_update(ema, params)
    return opt, params, state, ema


def assert_trees_equal(a, b):
    pa, pb = ps.tree_flatten_with_path(a)[0], ps.tree_flatten_with_path(b)[0]
    assert [p for p, _ in pa] == [p for p, _ in pb]
    for (path, x), (_, y) in zip(pa, pb):
        assert x.dtype == y.dtype and x.shape == y.shape, path
        assert torch.equal(x, y), path


def reseal(path: Path, files: dict[str, Path | None]) -> None:
    """Relist files in a checkpoint's manifest and seal it again, as its writer would (what a buggy tool or an
    attacker can do): each name maps to the real file whose sha256 and size it gets, or None to unlist it."""
    manifest = read_manifest(path)
    listed = dict(manifest.files)
    for name, real in files.items():
        listed.pop(name, None)
        if real is not None:
            data = real.read_bytes()
            listed[name] = FileEntry(sha256=hashlib.sha256(data).hexdigest(), size=len(data))
    (path / "manifest.json").write_bytes(encode_manifest(msgspec.structs.replace(manifest, files=listed)))


@pytest.fixture
def run(tmp_path):
    """A run directory with two good checkpoints (steps 1 and 3)."""
    opt, params, state, ema = trained_state(1)
    save_checkpoint(checkpoint_dir(tmp_path, 1), params=params, opt_state=state, ema=ema, step=1)
    opt, params, state, ema = trained_state(3)
    save_checkpoint(checkpoint_dir(tmp_path, 3), params=params, opt_state=state, ema=ema, step=3)
    return tmp_path


def test_round_trip_is_bit_exact_for_params_opt_state_and_ema(tmp_path):
    opt, params, state, ema = trained_state()
    path = save_checkpoint(
        tmp_path / "ck", params=params, opt_state=state, ema=ema, step=3,
        config={"lr": 1e-2}, data_state={"epoch": 0, "offset": 96}, metadata={"note": "hi"},
    )
    like = opt.init(params)
    loaded = load_checkpoint(path, opt_state_like=like, ema_like=ema)
    assert loaded.step == 3
    assert list(loaded.params) == list(params)
    assert_trees_equal(loaded.params, params)
    assert_trees_equal(loaded.opt_state, state)
    assert type(loaded.opt_state[1]) is type(state[1])
    assert_trees_equal(loaded.ema, ema)
    assert type(loaded.ema) is type(ema) and int(loaded.ema.count) == 3
    assert loaded.manifest.config == {"lr": 1e-2}
    assert loaded.manifest.data_state == {"epoch": 0, "offset": 96}
    assert loaded.manifest.metadata == {"note": "hi"}
    assert loaded.manifest.versions["torch"] == str(torch.__version__)
    # Without a template the state comes back flat, by key path.
    flat = load_checkpoint(path).opt_state
    assert set(flat) == set(ps.tree_paths(state))
    # Only safetensors and the JSON manifest are written: no pickle.
    assert sorted(p.name for p in path.iterdir()) == [
        "ema.safetensors", "manifest.json", "opt_state.safetensors", "params.safetensors", "rng.safetensors",
    ]


def test_resuming_from_a_checkpoint_continues_bit_for_bit(tmp_path):
    opt, params, state, _ = trained_state(3)
    g = torch.Generator().manual_seed(5)
    grads = [{k: torch.randn(v.shape, generator=g).to(v.dtype) for k, v in params.items()} for _ in range(4)]
    save_checkpoint(tmp_path / "ck", params=params, opt_state=state, step=3)
    loaded = load_checkpoint(tmp_path / "ck", opt_state_like=opt.init(params))
    a, sa, b, sb = params, state, loaded.params, loaded.opt_state
    for gr in grads:
        u, sa = opt.update(gr, sa, a)
        a = ps.apply_updates(a, u)
        u, sb = opt.update(gr, sb, b)
        b = ps.apply_updates(b, u)
    assert_trees_equal(a, b)
    assert_trees_equal(sa, sb)


@pytest.mark.parametrize("distributed", [False, True], ids=["files", "dcp"])
def test_params_that_are_views_into_one_flat_buffer_save_only_their_own_elements(tmp_path, distributed):
    # A compiled, donated make_update keeps params and state as views into flat buffers.
    flat = torch.arange(100_000, dtype=torch.float32)
    params = {"a": flat[10:20].view(2, 5), "b": flat[500:503], "c": flat[7:8].view(())}
    path = save_checkpoint(tmp_path / "ck", params=params, step=1, distributed=distributed)
    assert_trees_equal(load_checkpoint(path).params, params)
    assert sum(p.stat().st_size for p in path.glob("*.safetensors") if p.name != "rng.safetensors") < 2000


def test_rng_states_are_saved_and_restored(tmp_path):
    torch.manual_seed(11)
    random.seed(11)
    path = save_checkpoint(tmp_path / "ck", params={"w": torch.zeros(1)}, step=0)
    expected = (torch.rand(5), random.random())
    torch.manual_seed(0)
    random.seed(0)
    load_checkpoint(path).restore_rng()
    got = (torch.rand(5), random.random())
    assert torch.equal(expected[0], got[0]) and expected[1] == got[1]
    assert load_checkpoint(path).rng["torch.cpu"].dtype == torch.uint8


@pytest.mark.parametrize("name", ["params", "opt_state", "ema", "rng"])
def test_a_flipped_byte_in_any_file_fails_naming_it_while_the_previous_loads(run, name):
    path = checkpoint_dir(run, 3) / f"{name}.safetensors"
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=f"{name}.safetensors: corrupted"):
        load_checkpoint(checkpoint_dir(run, 3))
    assert load_checkpoint(checkpoint_dir(run, 1)).step == 1


def test_a_truncated_file_fails_naming_it(run):
    path = checkpoint_dir(run, 3) / "opt_state.safetensors"
    path.write_bytes(path.read_bytes()[:-10])
    with pytest.raises(CheckpointError, match="opt_state.safetensors: truncated"):
        load_checkpoint(checkpoint_dir(run, 3))
    assert load_checkpoint(checkpoint_dir(run, 1)).step == 1


def test_a_missing_file_fails_naming_it(run):
    (checkpoint_dir(run, 3) / "ema.safetensors").unlink()
    with pytest.raises(CheckpointError, match="ema.safetensors: missing"):
        load_checkpoint(checkpoint_dir(run, 3))
    (checkpoint_dir(run, 3) / "manifest.json").unlink()
    with pytest.raises(CheckpointError, match="manifest.json: missing"):
        load_checkpoint(checkpoint_dir(run, 3))
    assert load_checkpoint(checkpoint_dir(run, 1)).step == 1


def test_a_manifest_edited_by_hand_fails_naming_it(run):
    path = checkpoint_dir(run, 3) / "manifest.json"
    text = path.read_text()
    path.write_text(text.replace('"step": 3', '"step": 4'))
    with pytest.raises(CheckpointError, match="manifest.json: checksum mismatch"):
        load_checkpoint(checkpoint_dir(run, 3))
    path.write_text(text[: len(text) // 2])
    with pytest.raises(CheckpointError, match="manifest.json: unreadable"):
        load_checkpoint(checkpoint_dir(run, 3))
    assert load_checkpoint(checkpoint_dir(run, 1)).step == 1


def test_a_file_swapped_for_another_valid_one_fails(run):
    # Both are valid safetensors files; only the manifest's hashes can tell them apart.
    new, old = checkpoint_dir(run, 3) / "params.safetensors", checkpoint_dir(run, 1) / "params.safetensors"
    new.write_bytes(old.read_bytes())
    with pytest.raises(CheckpointError, match="params.safetensors: corrupted"):
        load_checkpoint(checkpoint_dir(run, 3))


def test_keep_last_keeps_the_newest(tmp_path):
    params = {"w": torch.zeros(2)}
    for step in range(1, 6):
        save_checkpoint(checkpoint_dir(tmp_path, step), params=params, step=step, keep_last=2)
    names = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert names == ["step_00000004", "step_00000005"]


def test_saving_again_at_the_same_path_replaces_it(tmp_path):
    save_checkpoint(tmp_path / "ck", params={"w": torch.zeros(2)}, step=1)
    save_checkpoint(tmp_path / "ck", params={"w": torch.ones(2)}, step=2)
    loaded = load_checkpoint(tmp_path / "ck")
    assert loaded.step == 2 and torch.equal(loaded.params["w"], torch.ones(2))
    assert [p.name for p in tmp_path.iterdir()] == ["ck"]


def test_latest_checkpoint_looks_in_the_run_dir_or_the_folder_itself(run, tmp_path_factory):
    assert latest_checkpoint(run) == checkpoint_dir(run, 3)
    assert latest_checkpoint(run / "checkpoints") == checkpoint_dir(run, 3)
    assert latest_checkpoint(tmp_path_factory.mktemp("empty")) is None
    assert latest_checkpoint(run / "nowhere") is None


def test_a_state_tree_that_does_not_match_names_the_path(run):
    _, params, _, _ = trained_state(0)
    other = ps.sgd(0.1, momentum=0.9).init(params)
    with pytest.raises(CheckpointError, match=r"step_00000003: has no opt_state tensor '1.trace.layers.0.weight', "
                                              r"which opt_state_like has"):
        load_checkpoint(checkpoint_dir(run, 3), opt_state_like=other)
    wrong_dtype = ps.adamw(1e-2).init({k: v.double() for k, v in params.items()})
    like = trained_state(0)[2]
    like = (like[0], like[1]._replace(inner_state=wrong_dtype))
    with pytest.raises(CheckpointError, match=r"opt_state '1.inner_state.0.mu.layers.0.bias' is \[4\] torch.float32 in the "
                       r"checkpoint, but \[4\] torch.float64 in opt_state_like"):
        load_checkpoint(checkpoint_dir(run, 3), opt_state_like=like)


def test_non_tensor_state_leaves_are_refused_naming_the_path(tmp_path):
    with pytest.raises(ValueError, match="opt_state leaf 'step' is int"):
        save_checkpoint(tmp_path / "ck", params={"w": torch.zeros(1)}, opt_state={"step": 3}, step=1)
    assert not (tmp_path / "ck").exists()


def test_config_struct_is_kept_in_the_manifest(tmp_path):
    class Small(msgspec.Struct, frozen=True):
        lr: float = 0.1
        name: str = "adamw"

    path = save_checkpoint(tmp_path / "ck", params={"w": torch.zeros(1)}, step=0, config=Small())
    assert read_manifest(path).config == {"lr": 0.1, "name": "adamw"}
    assert isinstance(read_manifest(Path(path)).files["params.safetensors"].sha256, str)


def test_distributed_save_writes_a_dcp_safetensors_checkpoint_that_loads_whole_and_verifies(tmp_path, capsys):
    # One process, no process group: torch.distributed.checkpoint writes this process's shards
    # (here whole tensors); the FSDP2 multi-rank case runs in test_distributed.py.
    from purestep.api import checkpoint as ck
    from purestep.api.cli import inspect_checkpoint

    opt, params, state, ema = trained_state(3)
    save_checkpoint(checkpoint_dir(tmp_path, 1), params=params, step=1, distributed=True)
    path = save_checkpoint(
        checkpoint_dir(tmp_path, 3), params=params, opt_state=state, ema=ema, step=3, distributed=True,
        config={"lr": 1e-2}, data_state={"offset": 96}, keep_last=1,
    )
    assert latest_checkpoint(tmp_path) == path and not checkpoint_dir(tmp_path, 1).exists()  # keep_last
    manifest = read_manifest(path)
    assert manifest.layout == "dcp" and manifest.world_size == 1 and manifest.data_state == {"offset": 96}
    assert sorted(p.name for p in path.iterdir()) == [  # safetensors + JSON only: no pickle, no .metadata
        "manifest.json", "rng.safetensors", "shard-00001-model-00001-of-00003.safetensors",
        "shard-00001-model-00002-of-00003.safetensors", "shard-00001-model-00003-of-00003.safetensors",
    ]
    assert set(manifest.files) == {p.name for p in path.iterdir()} - {"manifest.json"}
    loaded = load_checkpoint(path, opt_state_like=opt.init(params), ema_like=ema)
    assert list(loaded.params) == list(params) and loaded.step == 3
    assert_trees_equal(loaded.params, params)
    assert_trees_equal(loaded.opt_state, state)
    assert_trees_equal(loaded.ema, ema)
    assert set(load_checkpoint(path).opt_state) == set(ps.tree_paths(state))
    # The DCP route into existing trees (what FSDP2 resumes through) gives the same.
    again = ck.load_distributed(path, params=params, opt_state=state, ema=ema)
    assert_trees_equal(again.params, params)
    assert_trees_equal(again.opt_state, state)
    assert inspect_checkpoint(path) == 0  # `purestep inspect`
    assert "shard-00001-model-00001-of-00003/params.layers.0.weight" in capsys.readouterr().out

    shard = path / "shard-00001-model-00002-of-00003.safetensors"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01
    shard.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="shard-00001-model-00002-of-00003.safetensors: corrupted"):
        load_checkpoint(path)
    with pytest.raises(CheckpointError, match="shard-00001-model-00002-of-00003.safetensors: corrupted"):
        ck.load_distributed(path, params=params, opt_state=state)


# --------------------------------------------------------------------------- #
# Checkpoints that cannot be tricked: only sealed files inside the directory are read.
# --------------------------------------------------------------------------- #


@pytest.mark.parametrize("name", ["../outside.safetensors", "ABSOLUTE", "sub/params.safetensors", ".params.safetensors",
                                  "manifest.json", "params.safetensors.bak"])
def test_a_manifest_cannot_name_a_file_outside_its_directory_or_one_it_does_not_write(tmp_path, name):
    path = save_checkpoint(tmp_path / "run" / "ck", params={"w": torch.ones(2)}, step=1)
    if name == "ABSOLUTE":
        name = str(tmp_path / "elsewhere" / "params.safetensors")
    target = path / name  # an absolute name replaces the directory altogether
    if name != "manifest.json":
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(path / "params.safetensors", target)  # valid and hashed right: followed, it would load
    reseal(path, {"params.safetensors": None, name: path / "params.safetensors"})
    with pytest.raises(CheckpointError, match=f"manifest.json: lists '{name}', which is not a file a 'files' checkpoint"):
        load_checkpoint(path)


@pytest.mark.parametrize("distributed", [False, True], ids=["files", "dcp"])
def test_a_symlink_inside_a_checkpoint_is_refused_even_when_its_target_hashes_right(tmp_path, distributed):
    path = save_checkpoint(tmp_path / "ck", params={"w": torch.ones(2)}, step=1, distributed=distributed)
    file = next(p for p in sorted(path.iterdir()) if p.name.startswith(("params", "shard-00001-model-00001")))
    outside = tmp_path / "outside.safetensors"
    shutil.move(file, outside)
    file.symlink_to(outside)
    with pytest.raises(CheckpointError, match=f"{file.name}: is a symlink"):
        load_checkpoint(path)
    with pytest.raises(CheckpointError, match=f"{file.name}: is a symlink"):
        load_distributed(path, params={"w": torch.zeros(2)})


def test_an_unlisted_safetensors_file_dropped_into_a_dcp_checkpoint_is_never_read(tmp_path):
    good = save_checkpoint(tmp_path / "good", params={"w": torch.zeros(3)}, step=1, distributed=True)
    evil = save_checkpoint(tmp_path / "evil", params={"w": torch.full((3,), 666.0), "backdoor": torch.ones(1)}, step=1,
                           distributed=True)
    dropped = []
    for shard in evil.glob("shard-*"):  # names DCP itself would write for a second rank
        dropped.append(good / shard.name.replace("shard-00001", "shard-00002"))
        shutil.copy(shard, dropped[-1])
    loaded = load_checkpoint(good)
    assert set(loaded.params) == {"w"} and torch.equal(loaded.params["w"], torch.zeros(3))
    assert torch.equal(load_distributed(good, params={"w": torch.ones(3)}).params["w"], torch.zeros(3))
    # Listed and sealed by a tampered manifest, the overlapping shard is refused, never half-loaded.
    reseal(good, {p.name: p for p in dropped})
    with pytest.raises(CheckpointError, match=r"shard-00002-model-00001-of-00001.safetensors: the pieces of 'params.w' "
                                              r"do not tile its shape \[3\] \(overlapping\)"):
        load_checkpoint(good)


@pytest.mark.parametrize("layout", ["files", "dcp"])
def test_complex64_and_complex128_tensors_save_and_load_in_every_layout(tmp_path, layout):
    """safetensors has no complex128 (and DCP's reader no complex dtype): complex leaves are
    stored as their real view, (..., 2), and come back complex, bit for bit."""
    from purestep.api import CheckpointManager

    g = torch.Generator().manual_seed(0)
    params = {"w": torch.randn(3, 2, dtype=torch.complex64, generator=g), "v": torch.randn(4, dtype=torch.complex128, generator=g),
              "r": torch.randn(2, generator=g)}
    opt_state = {"m": params["w"] * 2, "count": torch.tensor(3)}
    manager = CheckpointManager(tmp_path / "run", distributed=layout == "dcp")
    manager.save(7, params=params, opt_state=opt_state, ema={"w": params["w"].conj()})
    restored = manager.restore(params_like={k: torch.zeros_like(v) for k, v in params.items()},
                               opt_state_like={k: torch.zeros_like(v) for k, v in opt_state.items()},
                               ema_like={"w": torch.zeros_like(params["w"])})
    assert restored.manifest.layout == layout and sorted(restored.manifest.complex) == ["ema.w", "opt_state.m", "params.v", "params.w"]
    for got, want in ((restored.params, params), (restored.opt_state, opt_state), (restored.ema, {"w": params["w"].conj()})):
        for k in want:
            assert got[k].dtype == want[k].dtype and torch.equal(got[k], want[k]), k
    whole = load_checkpoint(tmp_path / "run" / "checkpoints" / "step_00000007")  # flat, in one process
    assert whole.params["v"].dtype == torch.complex128 and torch.equal(whole.params["v"], params["v"])
    with pytest.raises(CheckpointError, match=r"\[3, 2\] torch.complex64 in the checkpoint"):
        manager.load(tmp_path / "run" / "checkpoints" / "step_00000007", params_like={**params, "w": torch.zeros(3, 2)})
