"""The purestep command: errors in one line, demo, plot, inspect."""

from __future__ import annotations

import subprocess
import sys

import pytest

from purestep.api.cli import main

TINY_DEMO = [
    "--steps", "4", "--set", "model.n_embd=32", "--set", "model.n_layer=1", "--set", "model.n_head=2",
    "--set", "model.block_size=32", "--set", "batch_size=4", "--set", "data.max_bytes=200000",
    "--set", "eval_every=2", "--set", "eval_batches=1", "--set", "checkpoint_every=2", "--set", "schedule.warmup_steps=1",
]


def run(*argv: str) -> int:
    with pytest.raises(SystemExit) as e:
        main(list(argv))
    return e.value.code


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("demo")
    assert run("demo", "--out", str(out), *TINY_DEMO) == 0
    return out


@pytest.mark.parametrize(
    "text, field",
    [
        ("stepz = 10\n", "stepz"),  # unknown field
        ("steps = 'ten'\n", "steps"),  # wrong type
        ("[optimizer]\nlr = -1.0\n", "optimizer.lr"),  # out of range
        ("strategy = 'fsdp2x'\n", "strategy"),
    ],
)
def test_bad_config_exits_nonzero_with_one_line_naming_the_field(tmp_path, capsys, text, field):
    cfg = tmp_path / "run.toml"
    cfg.write_text(text)
    assert run("train", str(cfg), "--out", str(tmp_path / "out")) != 0
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and field in err and "Traceback" not in err
    assert not (tmp_path / "out").exists()


def test_console_errors_have_no_traceback(tmp_path):
    missing = tmp_path / "nope.toml"
    out = subprocess.run([sys.executable, "-m", "purestep.api", "train", str(missing)], capture_output=True, text=True)
    assert out.returncode != 0
    assert out.stderr.strip().splitlines() == [f"purestep: error: {missing}: no such config file"]


def test_bad_override_names_the_field(capsys):
    assert run("demo", "--set", "optimizer.kwargs.weight_decay=-1") != 0
    err = capsys.readouterr().err
    assert "weight_decay" in err and len(err.strip().splitlines()) == 1


def test_demo_trains_prints_a_sample_and_refuses_to_overwrite(demo_run, capsys):
    assert (demo_run / "checkpoints" / "step_00000004" / "manifest.json").is_file()
    assert run("demo", "--out", str(demo_run), *TINY_DEMO) == 2
    assert "already holds a run" in capsys.readouterr().err


def test_resume_continues_from_the_latest_checkpoint(demo_run, capsys):
    assert run("demo", "--out", str(demo_run), "--resume", *TINY_DEMO, "--steps", "6") == 0
    assert "resumed from" in capsys.readouterr().err
    assert (demo_run / "checkpoints" / "step_00000006").is_dir()


def test_plot_writes_a_png(demo_run):
    assert run("plot", str(demo_run)) == 0
    assert (demo_run / "metrics.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_inspect_prints_the_tensor_table(demo_run, capsys):
    ckpt = demo_run / "checkpoints" / "step_00000004"
    assert run("inspect", str(ckpt)) == 0
    out = capsys.readouterr().out
    assert "step       4" in out and "sha256 ok" in out
    assert "params/blocks.0.attn.qkv.weight" in out and "[96, 32]" in out and "F32" in out
    (ckpt / "ema.safetensors").write_bytes(b"broken")
    assert run("inspect", str(ckpt)) == 1
    assert "DAMAGED" in capsys.readouterr().out


def test_plot_of_a_missing_run_names_the_file(tmp_path, capsys):
    assert run("plot", str(tmp_path)) == 2
    assert "metrics.jsonl" in capsys.readouterr().err
