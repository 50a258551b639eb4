"""The purestep command: errors in one line, demo, plot, inspect."""

from __future__ import annotations

import os
import resource
import signal
import subprocess
import sys

import pytest
import torch

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
    assert "params/blocks.0.attn.q.weight" in out and "[32, 32]" in out and "F32" in out
    (ckpt / "ema.safetensors").write_bytes(b"broken")
    assert run("inspect", str(ckpt)) == 1
    assert "DAMAGED" in capsys.readouterr().out


def test_plot_of_a_missing_run_names_the_file(tmp_path, capsys):
    assert run("plot", str(tmp_path)) == 2
    assert "metrics.jsonl" in capsys.readouterr().err


# --------------------------------------------------------------------------- #
# Errors of the world outside: one line, exit 2, never a traceback.
# --------------------------------------------------------------------------- #

TINY_SET = [arg for arg in TINY_DEMO if arg not in ("--steps", "4")]


def command(*argv: str, preexec_fn=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "purestep.api", *argv], capture_output=True, text=True,
                          preexec_fn=preexec_fn, env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=300)


def one_error_line(out: subprocess.CompletedProcess, *names: str) -> str:
    lines = [ln for ln in out.stderr.splitlines() if ln.startswith("purestep: error:")]
    assert out.returncode == 2 and len(lines) == 1 and "Traceback" not in out.stderr, out.stderr
    assert all(name in lines[0] for name in names), lines[0]
    return lines[0]


def test_bf16_true_from_the_command_line_trains_bf16_params_and_checkpoints_the_kahan_buffer(tmp_path):
    from purestep.api import load_checkpoint

    assert run("demo", "--out", str(tmp_path), *TINY_DEMO, "--set", "precision=bf16-true") == 0
    c = load_checkpoint(tmp_path / "checkpoints" / "step_00000004")
    assert {p.dtype for p in c.params.values()} == {torch.bfloat16}
    buffers = [k for k in c.opt_state if ".compensation." in k]
    assert len(buffers) == len(c.params)


def test_bf16_true_under_fsdp_is_one_line_naming_precision(capsys):
    assert run("demo", "--set", "precision=bf16-true", "--set", "strategy=fsdp") == 2
    err = capsys.readouterr().err.strip()
    assert "precision: 'bf16-true' is not supported with strategy='fsdp'" in err and "\n" not in err


def test_an_override_error_names_set(capsys):
    assert run("demo", "--set", "optimizer.kwargs.eps=0") == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("purestep: error: --set optimizer.kwargs.eps=0: optimizer.kwargs.eps: ") and "\n" not in err


def test_output_into_a_closed_pipe_ends_quietly(demo_run):
    proc = subprocess.Popen([sys.executable, "-m", "purestep.api", "inspect", str(demo_run)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    proc.stdout.close()  # `| head` having read its fill
    err = proc.stderr.read()
    assert proc.wait() == 128 + signal.SIGPIPE and err == ""


def test_a_full_disk_is_one_line_naming_the_path(tmp_path):
    def small_files():  # every file this process writes is cut at 64 KiB: a disk that fills up
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 16, 1 << 16))

    out = command("demo", "--out", str(tmp_path / "run"), "--steps", "2", *TINY_SET, preexec_fn=small_files)
    one_error_line(out, str(tmp_path / "run"))


@pytest.fixture
def read_only_dir(tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    mounted = False
    if os.access(ro, os.W_OK):  # root ignores the mode: mount a read-only file system there
        mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=64k", "tmpfs", str(ro)]).returncode == 0
        if not mounted:
            pytest.skip("cannot make a read-only directory here")
    yield ro
    if mounted:
        subprocess.run(["umount", str(ro)])
    ro.chmod(0o755)


def test_a_read_only_output_directory_is_one_line_naming_it(read_only_dir):
    out = command("demo", "--out", str(read_only_dir / "run"), "--steps", "2", *TINY_SET)
    one_error_line(out, str(read_only_dir / "run"))


def test_an_empty_data_file_is_one_line_naming_it(tmp_path):
    (tmp_path / "empty.txt").write_bytes(b"")
    out = command("demo", "--out", str(tmp_path / "run"), *TINY_SET, "--set", f"data.source={tmp_path / 'empty.txt'}")
    one_error_line(out, "data.source", str(tmp_path / "empty.txt"))


def test_a_torn_last_metrics_line_is_dropped_and_a_broken_one_named(demo_run, tmp_path, capsys):
    run_dir = tmp_path / "copy"
    run_dir.mkdir()
    lines = (demo_run / "metrics.jsonl").read_text().splitlines()
    (run_dir / "metrics.jsonl").write_text("\n".join(lines) + '\n{"step": 5, "lo')  # killed mid-write
    assert run("plot", str(run_dir)) == 0
    (run_dir / "metrics.jsonl").write_text(lines[0] + "\n{oops\n" + "\n".join(lines[1:]) + "\n")
    assert run("plot", str(run_dir)) == 2
    assert capsys.readouterr().err.strip() == f"purestep: error: {run_dir / 'metrics.jsonl'}:2: not a JSON line"


def test_a_yaml_alias_bomb_is_refused_fast(tmp_path):
    from .test_config import alias_bomb

    (tmp_path / "bomb.yaml").write_bytes(alias_bomb(9).encode())  # 10**9 nodes in ~500 bytes
    assert len(alias_bomb(9)) < 600
    one_error_line(command("train", str(tmp_path / "bomb.yaml")), "bomb.yaml", "aliases expand")
