"""Faults and crafted input: nothing lost, no checkpoint that saves but cannot load, no hang, no raw traceback."""

from __future__ import annotations

import errno
import json
import math
import os
import signal
from pathlib import Path

import hypothesis
import msgspec
import pytest
import torch
from hypothesis import strategies as st

import purestep.api._report as report
from purestep.api import CheckpointError, CheckpointManager, ConfigError, RunDirError, TrainConfig, apply_overrides
from purestep.api import load_checkpoint
from purestep.api.checkpoint._format import MANIFEST, encode_manifest, read_manifest
from purestep.api.checkpoint._reader import Chunk, assemble
from purestep.api.cli import _number, main
from purestep.api._config_files import MAX_YAML_NODES, read_config_file
from tests.api._worker import trainer


def reseal(path: Path, **fields) -> None:
    """Rewrite a checkpoint's manifest with `fields` replaced and a valid checksum (a crafted manifest)."""
    manifest = msgspec.structs.replace(read_manifest(path), **fields)
    (path / MANIFEST).write_bytes(encode_manifest(manifest))


def saved_run(tmp_path: Path, steps=(1, 2)) -> CheckpointManager:
    manager = CheckpointManager(tmp_path, keep_last=5)
    for s in steps:
        manager.save(s, params={"w": torch.full((3,), float(s))}, metadata={"note": s})
    return manager


# --------------------------------------------------------------------------- #
# Data that is lost or silently unusable.
# --------------------------------------------------------------------------- #


def test_a_failed_rewrite_of_metrics_keeps_every_record_and_names_the_file(tmp_path, monkeypatch):
    path = tmp_path / "metrics.jsonl"
    lines = [json.dumps({"step": i, "loss": 1.0}) + "\n" for i in range(1, 2001)]
    path.write_text("".join(lines))
    real_open = open

    def full(file, mode="r", *args, **kwargs):
        if "w" in mode and Path(file).name.startswith("."):
            raise OSError(errno.EFBIG, "File too large")
        return real_open(file, mode, *args, **kwargs)

    monkeypatch.setattr(report, "open", full, raising=False)
    with pytest.raises(RunDirError, match=f"{path}: cannot rewrite \\(File too large\\)"):
        report.MetricsFile(path, True).keep_until(1000)
    assert path.read_text() == "".join(lines) and [p.name for p in tmp_path.iterdir()] == ["metrics.jsonl"]
    monkeypatch.undo()
    report.MetricsFile(path, True).keep_until(1000)
    assert path.read_text() == "".join(lines[:1000])


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fnuz, torch.float8_e5m2fnuz])  # complex saves (test_checkpoint)
def test_a_dtype_that_would_not_load_is_refused_at_save_naming_the_leaf(tmp_path, dtype):
    manager = saved_run(tmp_path, steps=(1,))
    with pytest.raises(ValueError, match=f"opt_state leaf 'm' has dtype {dtype}, which a checkpoint cannot hold"):
        manager.save(2, params={"w": torch.zeros(3)}, opt_state={"m": torch.zeros(3).to(dtype)})
    assert manager.latest().name == "step_00000001"  # nothing published, nothing pruned


def test_evaluation_over_no_batches_and_batches_without_tensors_are_errors(tmp_path):
    t = trainer(None, "steps=3", "checkpoint_every=0")
    t.eval_data = iter(())  # an empty (or used-up one-shot) source
    with pytest.raises(ValueError, match="eval_data: the evaluation ran over no batches"):
        t.evaluate()
    t.loss_fn = lambda model, batch: torch.zeros((), requires_grad=True)  # a plain mean loss: rows counted
    t.batches = iter([[[1, 2, 3]]])  # one micro-batch of plain lists
    with pytest.raises(TypeError, match=r"a batch \(list\) holds no tensor to count its rows by"):
        t.train_step()


# --------------------------------------------------------------------------- #
# Damaged or crafted checkpoints: named, never applied, the older one used.
# --------------------------------------------------------------------------- #


@pytest.mark.parametrize(
    "fields, why",
    [
        ({"python_rng": [3, "x", None]}, "python_rng is not a random-module state"),
        ({"python_rng": [3, list(range(7)), 2**80]}, "python_rng is not a random-module state"),
        ({"metadata": {"trainer": {"tokens": "many"}}}, "metadata.trainer"),
        ({"metadata": {"trainer": {"skip": [[1, 2, 3]]}}}, "metadata.trainer"),
        ({"metadata": {"trainer": {"elapsed": -1.0}}}, "metadata.trainer"),
        ({"metadata": {"trainer": {"tokens": 2**70}}}, "metadata.trainer"),
    ],
)
def test_a_resealed_manifest_with_wrong_values_falls_back_before_anything_is_applied(tmp_path, fields, why, capsys):
    t = trainer(tmp_path, "steps=4", "checkpoint_every=2")
    t.fit()
    reseal(tmp_path / "checkpoints" / "step_00000004", **fields)
    back = trainer(tmp_path, "steps=4")
    back.fit(resume=True)  # step 4 refused: resumed from step 2 and trained on
    err = capsys.readouterr().err
    assert "skipping checkpoint step_00000004" in err and why in err and "resumed from" in err and "step 2" in err
    assert back.step == 4


@pytest.mark.parametrize("damage", ["utf8", "deep", "fifo"])
def test_a_manifest_or_file_that_cannot_be_read_is_named_and_skipped_without_hanging(tmp_path, damage):
    manager = saved_run(tmp_path)
    newest = tmp_path / "checkpoints" / "step_00000002"
    if damage == "utf8":
        data = bytearray((newest / MANIFEST).read_bytes())
        data[data.index(b'"step"') + 1] = 0xFF
        (newest / MANIFEST).write_bytes(bytes(data))
    elif damage == "deep":
        (newest / MANIFEST).write_text("[" * 5000 + "]" * 5000)
    else:
        os.unlink(newest / "params.safetensors")
        os.mkfifo(newest / "params.safetensors")  # a reader that opened it would wait forever
    signal.alarm(30)  # a hang fails the test instead of the suite
    try:
        with pytest.raises(CheckpointError, match=str(newest)):
            load_checkpoint(newest)
        assert manager.restore(params_like={"w": torch.zeros(3)}).step == 1
        manager.save(3, params={"w": torch.zeros(3)})  # pruning and cleanup go past it
        if damage != "fifo":
            assert manager.latest().name == "step_00000003"
    finally:
        signal.alarm(0)


def test_the_pieces_of_a_sharded_tensor_are_checked_in_n_log_n_and_an_overlap_is_named(tmp_path):
    rows = [Chunk("w", f"shard-{i:05d}", "w", (i, 0), (1, 4), torch.float32) for i in range(20000)]
    assert assemble(tmp_path, rows)["w"].shape == (20000, 4)  # pairwise, 2·10⁸ comparisons
    grid = [Chunk("g", "s", "g", (i, j), (1, 1), torch.float32) for i in range(100) for j in range(100)]
    assert assemble(tmp_path, grid)["g"].shape == (100, 100)
    bad = rows[:10000] + [Chunk("w", "shard-evil", "w", (9999, 2), (2, 2), torch.float32)] + rows[10001:]
    with pytest.raises(CheckpointError, match="shard-evil: the pieces of 'w' do not tile .*overlapping"):
        assemble(tmp_path, bad)


def test_a_manager_of_many_saves_keeps_bounded_memory(tmp_path):
    manager = CheckpointManager(tmp_path, keep_last=2)
    for step in range(30):
        manager.save(step, params={"w": torch.zeros(2)})
    assert len(manager._good) <= 2


# --------------------------------------------------------------------------- #
# Runs that end: with a checkpoint and a true message.
# --------------------------------------------------------------------------- #


def test_a_full_disk_on_metrics_stops_the_run_naming_the_file_after_a_checkpoint(tmp_path, monkeypatch):
    t = trainer(tmp_path, "steps=8", "checkpoint_every=0", "log_every=1")
    real = report.MetricsFile.write

    def write(self, record):
        if record.get("step") == 3:
            raise RunDirError(f"{self.path}: cannot append a record (No space left on device)")
        real(self, record)

    monkeypatch.setattr(report.MetricsFile, "write", write)
    with pytest.raises(RunDirError, match="metrics.jsonl: cannot append a record"):
        t.fit()
    assert load_checkpoint(tmp_path / "checkpoints" / "step_00000003").step == 3


def test_a_stop_at_a_checkpointed_step_names_that_checkpoint_and_a_spent_budget_says_so(tmp_path, capsys):
    t = trainer(tmp_path, "steps=3", "checkpoint_every=3")
    t.fit()
    with pytest.raises(SystemExit):
        t._preempted(signal.SIGTERM)
    assert f"checkpoint {tmp_path / 'checkpoints' / 'step_00000003'}" in capsys.readouterr().err
    t = trainer(tmp_path / "budget", "steps=1000", "time_budget=0.5", "checkpoint_every=0")
    t.fit()
    back = trainer(tmp_path / "budget", "steps=1000", "time_budget=0.5", "checkpoint_every=0")
    back.fit(resume=True)
    err = capsys.readouterr().err
    assert "spent its time_budget" in err and "pass a larger --set time_budget" in err and "larger --steps" not in err


def test_plot_draws_non_finite_points_as_gaps(tmp_path):
    records = [{"step": 1, "loss": 2.0, "lr": 0.1, "grad_norm": 1.0}, {"step": 2, "loss": "nan", "lr": 0.1},
               {"step": 3, "loss": "inf", "lr": 0.1, "grad_norm": "nan"}, {"step": 4, "loss": 1.5, "lr": 0.1}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    assert [_number(r["loss"]) for r in records][::3] == [2.0, 1.5]
    assert all(math.isnan(_number(v)) for v in ("nan", "inf", None, True))
    with pytest.raises(SystemExit) as e:
        main(["plot", str(tmp_path)])
    assert e.value.code == 0 and (tmp_path / "metrics.png").stat().st_size > 0


# --------------------------------------------------------------------------- #
# Config and command line: one line naming the field or the file.
# --------------------------------------------------------------------------- #


@pytest.mark.parametrize(
    "overrides, field",
    [
        (['model.kwargs={"mlp_ratio": -10}'], "model.kwargs.mlp_ratio"),
        (["model.vocab_size=4611686018427387904"], "model.vocab_size"),
        (['optimizer.kwargs={"weight_decay": 1267650600228229401496703205376}'], "optimizer.kwargs.weight_decay"),
        (["seed=-10000000000000"], "seed"),
        (["optimizer=null", "optimizer.lr=1"], "optimizer"),
        (["optimizer.kwargs=5", "optimizer.kwargs.x=1"], "optimizer.kwargs"),
    ],
)
def test_values_that_would_crash_later_are_refused_naming_the_field(overrides, field):
    from purestep.api.models import build_model

    with pytest.raises(ConfigError) as e:
        build_model(apply_overrides(TrainConfig(), overrides).model)
    assert e.value.field == field, e.value


def test_yaml_keys_that_are_not_names_and_oversized_documents_are_refused_before_building(tmp_path):
    for text in ("1: 2\n", "optimizer:\n  null: 1\n"):
        (tmp_path / "k.yaml").write_text(text)
        with pytest.raises(ConfigError, match="unknown field .*a key must be a name"):
            read_config_file(tmp_path / "k.yaml")
    (tmp_path / "big.yaml").write_text("steps: [" + ", ".join("1" for _ in range(MAX_YAML_NODES + 10)) + "]\n")
    with pytest.raises(ConfigError, match=f"more than {MAX_YAML_NODES:,} values") as e:
        read_config_file(tmp_path / "big.yaml")
    assert "alias" not in str(e.value)


# --------------------------------------------------------------------------- #
# Bounded fuzzing: every input ends in success or the layer's own error.
# --------------------------------------------------------------------------- #

VALUES = st.one_of(
    st.integers(-(2**70), 2**70), st.floats(allow_nan=True), st.text(max_size=5), st.none(), st.booleans(),
    st.lists(st.integers(-3, 3), max_size=3), st.dictionaries(st.sampled_from(["x", "lr", "mlp_ratio"]), st.integers(-5, 5)),
)
KEYS = st.sampled_from([
    "steps", "seed", "batch_size", "grad_accum", "optimizer", "optimizer.lr", "optimizer.name", "optimizer.kwargs",
    "optimizer.kwargs.weight_decay", "schedule.name", "schedule.warmup_steps", "model.n_embd", "model.vocab_size",
    "model.kwargs", "model.kwargs.mlp_ratio", "data.max_bytes", "time_budget", "precision", "ema_decay", "nope.x",
])


@hypothesis.settings(max_examples=300, deadline=None, derandomize=True)
@hypothesis.given(st.lists(st.tuples(KEYS, VALUES), min_size=1, max_size=3))
def test_fuzzed_overrides_give_a_config_or_a_config_error(pairs):
    overrides = [f"{k}={json.dumps(v)}" for k, v in pairs]
    try:
        cfg = apply_overrides(TrainConfig(), overrides)
    except ConfigError:
        return
    assert isinstance(cfg, TrainConfig)


@hypothesis.settings(max_examples=200, deadline=None, derandomize=True)
@hypothesis.given(st.data())
def test_fuzzed_resealed_manifests_load_or_raise_a_checkpoint_error(tmp_path_factory, data):
    root = tmp_path_factory.mktemp("fuzz")
    manager = saved_run(root, steps=(1,))
    path = root / "checkpoints" / "step_00000001"
    raw = json.loads((path / MANIFEST).read_text())
    key = data.draw(st.sampled_from(sorted(k for k in raw if k != "checksum")))
    raw[key] = data.draw(st.one_of(VALUES, st.just({"trainer": {"step": "x"}}), st.just([3, [1] * 625, None])))
    try:
        manifest = msgspec.convert(raw, type(read_manifest(path)))
    except msgspec.ValidationError:
        return  # a value the schema refuses: read_manifest refuses it too (checked below without resealing)
    (path / MANIFEST).write_bytes(encode_manifest(manifest))
    try:
        manager.load(path, params_like={"w": torch.zeros(3)})
    except CheckpointError:
        pass
