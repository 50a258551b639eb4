"""The Trainer on one CPU process: a thin shell over make_update, its config honoured or
refused, resume (SIGKILL, SIGTERM, Ctrl-C, changed settings), data sources, skips."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import msgspec
import pytest
import torch

import purestep.core as ps
from purestep.api import ConfigError, DataConfig, RunDirError, TrainConfig, Trainer, apply_overrides, load_checkpoint
from purestep.api.data import build_data
from purestep.api.models import build_model, lm_loss

from tests.core.test_host_sync import no_host_reads

from ._worker import tiny_config, trainer

WORKER = Path(__file__).with_name("_worker.py")
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def records(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def events(run: Path) -> list[dict]:
    return [r for r in records(run) if "event" in r]


def assert_same_checkpoint(a: Path, b: Path) -> None:
    ca, cb = load_checkpoint(a), load_checkpoint(b)
    assert ca.step == cb.step
    for group in ("params", "opt_state", "ema"):
        ta, tb = getattr(ca, group), getattr(cb, group)
        assert ta.keys() == tb.keys()
        for k in ta:
            assert torch.equal(ta[k], tb[k]), f"{group}/{k} differs"


def worker(out: Path, steps: int, *extra: str) -> subprocess.Popen:
    cmd = [sys.executable, str(WORKER), str(out), "single", str(steps), *extra]
    return subprocess.Popen(cmd, env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def wait_for(path: Path, proc: subprocess.Popen, lines: int = 1) -> None:
    deadline = time.time() + 120
    while time.time() < deadline and proc.poll() is None:
        if path.exists() and path.read_text().count("\n") >= lines:
            return
        time.sleep(0.01)
    raise AssertionError(f"{path} never reached {lines} lines (exit {proc.poll()})")


@pytest.fixture(scope="module")
def whole_run(tmp_path_factory):
    """The uninterrupted 40-step run that interrupted ones must end bit-identical to."""
    out = tmp_path_factory.mktemp("whole")
    proc = worker(out, 40)
    assert proc.wait() == 0, proc.stderr.read()
    return out / "checkpoints" / "step_00000040"


# --------------------------------------------------------------------------- #
# The step is make_update's.
# --------------------------------------------------------------------------- #


def test_trainer_equals_a_bare_make_update_loop_bitwise():
    cfg = tiny_config("steps=5", "checkpoint_every=0", "ema_decay=none", "optimizer.clip_grad_norm=0.5")
    t = Trainer(config=cfg, progress=False)
    t.fit()

    # The ~20-line loop the Trainer stands for, on the same model, data and transform.
    torch.manual_seed(cfg.seed)
    model, data = build_model(cfg.model), build_data(cfg)
    opt = ps.apply_if_finite(cfg.build_optimizer())
    update = ps.make_update(opt, donate=True)
    params = {k: p.detach() for k, p in model.named_parameters()}
    state = opt.init(params)
    for step in range(cfg.steps):
        loss, n = lm_loss(model, data.batch(step))
        loss.backward()
        grads = {k: p.grad.mul_((1.0 / n.double()).float()) for k, p in model.named_parameters()}
        update(params, grads, state)
        model.zero_grad(set_to_none=True)
    for k, p in t.named.items():
        assert torch.equal(p, params[k]), k
    assert float(ps.get_hyperparams(state)["lr"]) == t.lr() and t.lr() > 0  # one lr path: the injected schedule


def test_a_train_step_never_reads_a_device_value(monkeypatch):
    t = Trainer(config=tiny_config("steps=4", "log_every=100", "checkpoint_every=0"), progress=False)
    t.batches = iter([[t.data.batch(i)] for i in range(4)])  # batches made up front: the step alone is watched
    t.train_step()  # first call: the batch size check
    calls = []
    for name in ("item", "tolist", "__float__", "__int__", "__bool__", "__index__"):
        real = getattr(torch.Tensor, name)
        monkeypatch.setattr(torch.Tensor, name, lambda self, *a, _n=name, _r=real: calls.append(_n) or _r(self, *a))
    with no_host_reads(monkeypatch):  # and no 0-d tensor bound as a number by an op (a sync on CUDA)
        for _ in range(3):
            record = t.train_step()
    monkeypatch.undo()
    assert calls == [] and t.step == 4
    assert record["loss"].dim() == 0 and "grad_norm" not in record  # clip_by_global_norm's state holds it


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_cuda_train_step_never_syncs():
    t = Trainer(config=tiny_config("steps=4", "log_every=100", "checkpoint_every=0"), progress=False)
    t.batches = iter([[t.data.batch(i)] for i in range(4)])
    t.train_step()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(3):
            t.train_step()
    finally:
        torch.cuda.set_sync_debug_mode("default")


def test_a_compiled_trainer_trains_the_module_through_the_flat_buffers():
    # compile=True: the model is compiled and the update runs donated over flat buffers, into
    # which the module's own parameters are re-pointed: the forward must see every update.
    cfg = apply_overrides(TrainConfig(), ["steps=4", "batch_size=8", "log_every=1"])
    eager = _linear_run(cfg, ps.adamw(1e-2))
    eager.fit()
    compiled = _linear_run(apply_overrides(cfg, ["compile=true"]), ps.adamw(1e-2))
    compiled.fit()
    assert compiled.update.layout() is not None  # the flat path, not the per-leaf one
    for k, p in eager.named.items():
        assert compiled.named[k].data_ptr() == compiled.params()[k].data_ptr()
        torch.testing.assert_close(compiled.named[k], p, rtol=1e-5, atol=1e-6)
    assert compiled.last["loss"] == pytest.approx(eager.last["loss"], rel=1e-5)


# --------------------------------------------------------------------------- #
# bf16 params: precision="bf16-true".
# --------------------------------------------------------------------------- #


def test_bf16_true_equals_a_bare_loop_over_bf16_params_with_compensated_updates_bitwise():
    cfg = tiny_config("steps=5", "checkpoint_every=0", "precision=bf16-true")
    t = Trainer(config=cfg, progress=False)
    assert {p.dtype for p in t.named.values()} == {torch.bfloat16}
    t.fit()

    torch.manual_seed(cfg.seed)
    model, data = build_model(cfg.model).to(torch.bfloat16), build_data(cfg)
    opt = ps.apply_if_finite(ps.chain(cfg.build_optimizer(), ps.compensated_updates()))
    averager = ps.params_ema(cfg.ema_decay, dtype=torch.float32)  # a bf16 EMA would stop moving
    update = ps.make_update(opt, donate=True, ema=averager)
    params = {k: p.detach() for k, p in model.named_parameters()}
    state, ema = opt.init(params), averager[0](params)
    for step in range(cfg.steps):
        loss, n = lm_loss(model, data.batch(step))
        loss.backward()
        grads = {k: p.grad.mul_((1.0 / n.double()).float()) for k, p in model.named_parameters()}
        update(params, grads, state, ema)
        model.zero_grad(set_to_none=True)
    compensation = ps.tree_get(t.opt_state, "compensation")
    assert compensation.keys() == params.keys() and any(bool(c.any()) for c in compensation.values())
    for k, p in t.named.items():
        assert torch.equal(p, params[k]), k
        assert torch.equal(compensation[k], ps.tree_get(state, "compensation")[k]), k
        assert t.ema.params[k].dtype == torch.float32 and torch.equal(t.ema.params[k], ema.params[k]), k


def _resume_from_step_4_ends_on_the_same_bits(tmp_path: Path, run: tuple[str, ...]) -> None:
    """The 8-step run in tmp_path/"whole" again from its step-4 checkpoint: the same final checkpoint."""
    shutil.copytree(tmp_path / "whole", tmp_path / "cut")
    shutil.rmtree(tmp_path / "cut" / "checkpoints" / "step_00000008")
    rest = trainer(tmp_path / "cut", *run)
    rest.fit(resume=True)
    assert rest.step == 8
    assert_same_checkpoint(tmp_path / "whole" / "checkpoints" / "step_00000008", tmp_path / "cut" / "checkpoints" / "step_00000008")


def test_bf16_true_checkpoints_the_compensation_buffer_and_resumes_bitwise(tmp_path):
    run = ("precision=bf16-true", "steps=8", "checkpoint_every=4")
    whole = trainer(tmp_path / "whole", *run)
    whole.fit()
    losses = [r["loss"] for r in records(tmp_path / "whole") if "loss" in r]
    assert len(losses) == 8 and losses[-1] < losses[0] - 0.2
    for step in (4, 8):
        c = load_checkpoint(tmp_path / "whole" / "checkpoints" / f"step_{step:08d}")
        buffers = {k.split(".compensation.")[1]: v for k, v in c.opt_state.items() if ".compensation." in k}
        assert buffers.keys() == whole.named.keys() and any(bool(b.any()) for b in buffers.values())
        assert {b.dtype for b in buffers.values()} | {p.dtype for p in c.params.values()} == {torch.bfloat16}
    for k, b in ps.tree_get(whole.opt_state, "compensation").items():
        assert torch.equal(buffers[k], b), k
    # The run again from its step-4 checkpoint: the buffer it restores decides the next updates.
    _resume_from_step_4_ends_on_the_same_bits(tmp_path, run)


def test_single_worker_diloco_syncs_on_schedule_and_resumes_bitwise_between_syncs(tmp_path):
    """`[diloco]` in one process (MuLoCo's single-worker recipe): the anchor moves at the
    syncs only and the checkpoint holds it with the outer momentum; resumed from step 4 (a
    step after the sync at 3), the run ends on the same bits."""
    run = ("steps=8", "checkpoint_every=4", "diloco.sync_every=3", "diloco.outer_lr=0.7")
    whole = trainer(tmp_path / "whole", *run)
    assert isinstance(whole.opt_state, ps.DiLoCoState)
    start = {k: v.clone() for k, v in whole.opt_state.anchor.items()}
    whole.fit()
    c = load_checkpoint(tmp_path / "whole" / "checkpoints" / "step_00000004")
    moved = {k for k, v in start.items() if not torch.equal(c.opt_state[f"anchor.{k}"], v)}
    assert moved == set(start)  # moved at the sync of step 3
    assert any(k.startswith("outer_state.") for k in c.opt_state) and int(c.opt_state["count"]) == 4
    _resume_from_step_4_ends_on_the_same_bits(tmp_path, run)
    with pytest.raises(ConfigError, match="diloco.sync_every"):
        tiny_config("diloco.sync_every=3", "strategy=fsdp")
    with pytest.raises(ConfigError, match="diloco.fragments"):
        tiny_config("diloco.sync_every=3", "diloco.fragments=2")
    with pytest.raises(ConfigError, match="diloco.delay"):
        tiny_config("diloco.sync_every=4", "diloco.fragments=2", "diloco.delay=2")
    streaming = trainer(None, "steps=4", "checkpoint_every=0", "diloco.sync_every=4", "diloco.fragments=2", "diloco.delay=1", "diloco.alpha=0.5")
    streaming.fit()
    assert len(streaming.opt_state.outer_state) == 2 and streaming.step == 4


def test_bf16_true_casts_a_given_model_and_its_float_inputs_and_keeps_a_given_compensation():
    cfg = apply_overrides(TrainConfig(), ["steps=3", "batch_size=8", "precision=bf16-true"])
    t = _linear_run(cfg, ps.chain(ps.sgd(lr=1e-3), ps.compensated_updates(method="stochastic")))
    before = {k: p.detach().clone() for k, p in t.named.items()}
    t.fit()  # float32 batches into a bf16 Linear: cast, or the forward raises a dtype error
    assert {p.dtype for p in t.named.values()} == {torch.bfloat16}
    assert all(not torch.equal(t.named[k], before[k]) for k in before)
    compensation = ps.tree_get(t.opt_state, "compensation")  # one: the given one, no Kahan buffer chained on
    assert all(c.numel() == 0 for c in compensation.values())


# --------------------------------------------------------------------------- #
# The config: honoured or refused.
# --------------------------------------------------------------------------- #


def _linear_run(cfg: TrainConfig, transform, **kwargs) -> Trainer:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    x = torch.randn(8, 4)
    data = [(x, 1e4 * torch.randn(8, 3))]  # gradients in the thousands

    def loss_fn(m, batch):
        return ((m(batch[0]) - batch[1]) ** 2).mean()

    return Trainer(model, transform, loss_fn, cfg, data=data, progress=False, **kwargs)


def test_a_given_transform_is_clipped_as_the_config_says_and_ema_decay_is_kept():
    cfg = apply_overrides(TrainConfig(), ["steps=3", "batch_size=8", "ema_decay=0.5"])  # clip_grad_norm: 1.0
    t = _linear_run(cfg, ps.sgd(lr=1.0))
    before = {k: p.detach().clone() for k, p in t.named.items()}
    ref = torch.nn.Linear(4, 3)
    ref.load_state_dict({k: v.clone() for k, v in before.items()})
    averaged = torch.optim.swa_utils.AveragedModel(ref, multi_avg_fn=torch.optim.swa_utils.get_ema_multi_avg_fn(0.5))
    opt = torch.optim.SGD(ref.parameters(), lr=1.0)
    x, y = t.data[0]
    for _ in range(3):
        opt.zero_grad()
        ((ref(x) - y) ** 2).mean().backward()
        assert torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0) > 1000  # the norm that went through unclipped
        opt.step()
        averaged.update_parameters(ref)
    t.fit()
    for k, p in ref.named_parameters():
        torch.testing.assert_close(t.named[k], p.detach(), rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(t.ema.params[k], dict(averaged.module.named_parameters())[k].detach(), rtol=1e-6, atol=1e-6)
    assert t.last["grad_norm"] > 1000  # the pre-clip norm, from the clip's state


@pytest.mark.parametrize(
    "overrides, given, field",
    [
        (["optimizer.lr=0.1"], {}, "optimizer.lr"),  # a transform is given: the section would be ignored
        (["schedule.name=cosine", "schedule.warmup_steps=none"], {}, "schedule.name"),
        (["model.n_layer=2"], {}, "model.n_layer"),  # a model is given
        (["data.max_bytes=1000"], {}, "data.max_bytes"),  # data is given
        (["ema_decay=0.9"], {"ema": ps.params_ema(0.9)}, "ema_decay"),
        (["checkpoint_every=2"], {}, "checkpoint_every"),  # no run directory
        (["eval_every=2"], {}, "eval_every"),  # an iterable has no validation split
        (["batch_size=16"], {}, "batch_size"),  # the data gives 8 rows a step
    ],
)
def test_a_field_the_trainer_would_ignore_is_refused_naming_it(overrides, given, field):
    cfg = apply_overrides(TrainConfig(), ["batch_size=8", "steps=2", *overrides])
    with pytest.raises(ConfigError) as e:
        _linear_run(cfg, ps.sgd(lr=0.1), **given).fit()
    assert e.value.field == field


def test_a_transform_that_clips_already_is_refused_unless_the_config_lets_it():
    cfg = apply_overrides(TrainConfig(), ["batch_size=8", "steps=2"])
    clipping = ps.chain(ps.clip_by_global_norm(2.0), ps.sgd(lr=0.1))
    with pytest.raises(ConfigError) as e:
        _linear_run(cfg, clipping)
    assert e.value.field == "optimizer.clip_grad_norm"
    t = _linear_run(apply_overrides(cfg, ["optimizer.clip_grad_norm=none"]), clipping)
    t.fit()
    assert t.last["grad_norm"] > 1000


# --------------------------------------------------------------------------- #
# Data sources.
# --------------------------------------------------------------------------- #


class Windows(torch.utils.data.Dataset):
    def __init__(self, corpus):
        self.corpus = corpus

    def __len__(self):
        return 64

    def __getitem__(self, i):
        return self.corpus.batch(i, 0, 8)  # one row of a fixed batch, as a dataset item


def _loader(cfg):
    corpus = build_data(cfg)  # the tiny corpus, a step-indexed source, cut into dataset items
    flat = lambda items: {k: torch.cat([it[k] for it in items]) for k in items[0]}  # noqa: E731
    gen = torch.Generator().manual_seed(7)
    return torch.utils.data.DataLoader(Windows(corpus), batch_size=4, shuffle=True, generator=gen, collate_fn=flat)


def test_a_dataloader_trains_with_grad_accum_and_resumes_exactly_when_seeded(tmp_path):
    # A constant lr: the cut run's shorter `steps` must not reshape the schedule.
    cfg = tiny_config("steps=6", "grad_accum=2", "checkpoint_every=3", "schedule.name=constant", "schedule.warmup_steps=none")
    assert len(_loader(cfg)) == 16  # batches a pass: the 12 of a run fit in one, the resume's start a second
    cfg = msgspec.structs.replace(cfg, data=DataConfig())  # the data is given: its section stays at the defaults
    whole = Trainer(config=cfg, data=_loader(tiny_config()), out=tmp_path / "whole", progress=False)
    whole.fit()
    assert whole.step == 6 and whole.last["loss"] < 5.6
    half = Trainer(config=apply_overrides(cfg, ["steps=3"]), data=_loader(tiny_config()), out=tmp_path / "cut", progress=False)
    half.fit()
    rest = Trainer(config=cfg, data=_loader(tiny_config()), out=tmp_path / "cut", progress=False)
    rest.fit(resume=True)  # 3 steps x 2 batches drawn again and dropped: a second pass of the loader
    for k, p in whole.named.items():
        assert torch.equal(rest.named[k], p), k


def test_a_one_shot_iterator_is_refused():
    cfg = apply_overrides(TrainConfig(), ["batch_size=8", "steps=2"])
    with pytest.raises(ValueError, match="one-shot iterator"):
        Trainer(torch.nn.Linear(4, 3), ps.sgd(0.1), lambda m, b: m(b).sum(), cfg, data=iter([torch.randn(8, 4)])).fit()


# --------------------------------------------------------------------------- #
# Progress.
# --------------------------------------------------------------------------- #


def test_progress_is_on_by_default_plain_lines_off_a_terminal(capsys):
    Trainer(config=tiny_config("steps=3", "log_every=1", "checkpoint_every=0")).fit()
    err = capsys.readouterr().err
    assert "step      1  loss 5.5" in err and "step      2  loss" in err and "tok/s" in err


def test_progress_on_a_terminal_is_a_tqdm_bar(monkeypatch, capsys):
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    Trainer(config=tiny_config("steps=3", "log_every=1", "checkpoint_every=0")).fit()
    err = capsys.readouterr().err
    assert "3/3" in err and ("step/s" in err or "s/step" in err)


# --------------------------------------------------------------------------- #
# Interruptions and resume.
# --------------------------------------------------------------------------- #


def test_sigkill_mid_run_then_resume_is_bit_identical(tmp_path, whole_run):
    cut = tmp_path / "cut"
    proc = worker(cut, 40)
    mid = cut / "checkpoints" / "step_00000008"
    deadline = time.time() + 120
    while not (mid / "manifest.json").exists() and time.time() < deadline and proc.poll() is None:
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    assert proc.wait() == -signal.SIGKILL, "the run ended before it could be killed"
    assert not (cut / "checkpoints" / "step_00000040").exists()
    with open(cut / "metrics.jsonl", "a") as f:
        f.write('{"step": 99, "lo')  # the line being written when the run died
    resumed = worker(cut, 40, "--resume")
    assert resumed.wait() == 0, resumed.stderr.read()
    assert "resumed from" in resumed.stderr.read()
    assert_same_checkpoint(cut / "checkpoints" / "step_00000040", whole_run)
    steps = [r["step"] for r in records(cut)]
    assert steps == sorted(steps) and steps[-1] == 40  # nothing logged twice after the rewind to the checkpoint


@pytest.mark.parametrize(
    "sig, extra",
    [(signal.SIGTERM, ()), (signal.SIGINT, ()), (signal.SIGHUP, ()), (signal.SIGTERM, ("--set", "async_checkpoint=true"))],
    ids=["SIGTERM", "Ctrl-C", "SIGHUP", "SIGTERM, checkpoints in the background"],
)
def test_a_stop_signal_saves_the_step_reached_and_exits_cleanly(tmp_path, whole_run, sig, extra):
    proc = worker(tmp_path, 40, *extra)
    wait_for(tmp_path / "metrics.jsonl", proc, lines=6)
    proc.send_signal(sig)
    err = proc.stderr.read()
    assert proc.wait() == 128 + sig, err
    assert "Traceback" not in err and f"stopped by {signal.Signals(sig).name} at step" in err
    step = int(err.split("at step ")[1].split(";")[0])
    assert 6 <= step < 40 and load_checkpoint(tmp_path / "checkpoints" / f"step_{step:08d}").step == step
    if sig == signal.SIGTERM:  # and the resumed run ends where the uninterrupted one does
        resumed = worker(tmp_path, 40, "--resume", *extra)
        assert resumed.wait() == 0, resumed.stderr.read()
        assert_same_checkpoint(tmp_path / "checkpoints" / "step_00000040", whole_run)


def test_a_finished_run_has_a_checkpoint_and_resuming_it_has_nothing_to_do(tmp_path, capsys):
    t = trainer(tmp_path, "steps=3", "checkpoint_every=0")
    t.fit()
    assert [p.name for p in (tmp_path / "checkpoints").iterdir()] == ["step_00000003"]
    t = trainer(tmp_path, "steps=3", "checkpoint_every=0")
    t.fit(resume=True)
    assert "nothing to do: the run finished at step 3" in capsys.readouterr().err
    assert t.step == 3 and len(records(tmp_path)) == 3


def test_resume_applies_a_changed_hyperparameter_and_says_so(tmp_path, capsys):
    trainer(tmp_path, "steps=4", "optimizer.kwargs.adamw_weight_decay=0.1").fit()
    t = trainer(tmp_path, "steps=6", "optimizer.kwargs.adamw_weight_decay=0.3")
    t.fit(resume=True)
    err = capsys.readouterr().err
    assert "resume: optimizer.kwargs.adamw_weight_decay changed from 0.1 to 0.3: applied" in err
    assert "resume: steps changed from 4 to 6: reshapes the lr schedule: the lr at step 4 is" in err
    assert float(ps.get_hyperparams(t.opt_state)["adamw_weight_decay"]) == 0.3


@pytest.mark.parametrize("change, field", [("seed=4", "seed"), ("optimizer.name=adamw", "optimizer.name"),
                                           ("model.n_embd=64", "model.n_embd"), ("ema_decay=none", "ema_decay"),
                                           ("precision=bf16-true", "precision")])
def test_resume_refuses_a_change_it_cannot_take_naming_it(tmp_path, change, field):
    trainer(tmp_path, "steps=3").fit()
    with pytest.raises(ConfigError) as e:
        overrides = [change, "optimizer.kwargs={}"] if field == "optimizer.name" else [change]
        trainer(tmp_path, "steps=5", *overrides).fit(resume=True)
    assert e.value.field == field and "since the checkpoint" in str(e.value)


def test_corrupted_checkpoint_fails_loudly_and_resume_falls_back(tmp_path, capsys):
    trainer(tmp_path, "steps=8").fit()
    bad = tmp_path / "checkpoints" / "step_00000008" / "params.safetensors"
    data = bytearray(bad.read_bytes())
    data[len(data) // 2] ^= 0xFF
    bad.write_bytes(bytes(data))
    t = trainer(tmp_path, "steps=10")
    t.fit(resume=True)
    err = capsys.readouterr().err
    assert "warning" in err and "step_00000008" in err
    assert "resumed from" in err and "step_00000004" in err
    assert t.step == 10 and t.updates == 10


def test_resume_refuses_when_no_checkpoint_loads(tmp_path):
    trainer(tmp_path, "steps=4").fit()
    (tmp_path / "checkpoints" / "step_00000004" / "opt_state.safetensors").write_bytes(b"junk")
    with pytest.raises(RunDirError, match="no checkpoint in .* loads .see the warnings above.; move the damaged ones aside"):
        trainer(tmp_path, "steps=6").fit(resume=True)


def test_run_dir_holding_another_run_is_refused(tmp_path):
    trainer(tmp_path, "steps=3").fit()
    with pytest.raises(RunDirError, match="already holds a run"):
        trainer(tmp_path, "steps=3").fit()


# --------------------------------------------------------------------------- #
# Numerics the Trainer owns.
# --------------------------------------------------------------------------- #


def test_nonfinite_gradients_skip_the_step_on_the_device_and_are_logged(tmp_path):
    t = trainer(tmp_path, "steps=6", nan_at=2)
    before = {k: p.detach().clone() for k, p in t.named.items()}
    t.fit()
    assert t.updates == 5 and t.step == 6
    assert [(e["step"], e["event"], e["skipped"]) for e in events(tmp_path)] == [(3, "skip_nonfinite", 1)]
    assert int(ps.skipped_updates(t.opt_state)[1]) == int(t.nonfinite()) == 1
    assert all(torch.isfinite(p).all() for p in t.named.values())
    assert any(not torch.equal(before[k], p) for k, p in t.named.items())


def test_loss_spike_is_skipped_and_repeated_spikes_rewind(tmp_path):
    t = trainer(tmp_path, "steps=16", "spike_factor=3", "spike_window=3", "spike_rewind=2", spikes=(5, 9, 10))
    t.fit()
    log = [(e["step"], e["event"]) for e in events(tmp_path)]
    assert log == [(6, "skip_spike"), (10, "skip_spike"), (11, "skip_spike"), (11, "rewind")]
    assert events(tmp_path)[3]["to"] == 8 and events(tmp_path)[3]["skipped"] == [8, 11]  # batches 8..10 skipped
    # Applied: batches 0-4, 6-7 and 11-15; the spikes at 9 and 10 were undone by the rewind to 8.
    assert t.step == 16 and t.skip == [[8, 11]] and t.updates == 5 + 2 + 5


def test_grad_accumulation_matches_the_full_batch():
    a = trainer(None, "steps=3", "checkpoint_every=0", "optimizer.name=adamw", "optimizer.kwargs={}")
    b = trainer(None, "steps=3", "checkpoint_every=0", "optimizer.name=adamw", "optimizer.kwargs={}", "grad_accum=4")
    a.fit()
    b.fit()
    for k, p in a.named.items():
        torch.testing.assert_close(b.named[k], p, rtol=1e-3, atol=1e-4)  # Adam amplifies rounding in tiny grads


def test_time_budget_stops_the_run_and_drives_the_schedule_by_progress():
    t = trainer(None, "steps=100000", "checkpoint_every=0", "time_budget=3", "schedule.final_lr=0.0")
    t.fit()
    assert 2 <= t.step < 100000 and t.elapsed >= 3
    # By step count the schedule would still be at its peak; by progress it has decayed.
    assert t.lr() < 0.02 * 0.9


def test_a_time_budget_under_ddp_ends_on_every_rank_together(tmp_path):
    # Each rank times its own steps; they must agree when the budget is spent, or one waits forever.
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(WORKER),
           str(tmp_path), "ddp", "100000", "--set", "time_budget=4", "--set", "checkpoint_every=0", "--set", "log_every=2"]
    out = subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    step = int(out.stdout.split("done ")[1].split()[0])
    assert 2 <= step < 100000 and step % 2 == 0  # stopped at a log step, where the ranks agree
    assert load_checkpoint(tmp_path / "checkpoints" / f"step_{step:08d}").manifest.metadata["trainer"]["elapsed"] >= 4



def test_a_given_transform_that_clips_already_is_refused_naming_the_field():
    cfg = apply_overrides(TrainConfig(), ["optimizer.clip_grad_norm=1.0", "model.n_embd=32", "model.n_layer=1",
                                          "model.n_head=2", "model.block_size=32", "data.max_bytes=200000"])
    clips = ps.masked(ps.chain(ps.clip_by_global_norm(0.5), ps.adamw(1e-3)), lambda p: {k: True for k in p})
    with pytest.raises(ConfigError, match="optimizer.clip_grad_norm"):
        Trainer(None, clips, None, cfg)
    Trainer(None, ps.adamw(1e-3), None, cfg)  # one that does not clip gets the clip in front
    # A given transform with a skip of its own: the Trainer counts its own (the outermost) skips.
    t = Trainer(None, ps.apply_if_finite(ps.adamw(1e-3)), None, cfg)
    t.train_step()
    assert int(t.nonfinite()) == 0 and t.updates == 1


def test_the_trainer_reads_a_given_transforms_declarations_and_initializes_it_once():
    devices = []
    inner = ps.adamw(1e-3)

    def init(params):
        devices.append(next(iter(params.values())).device.type)
        return inner.init(params)

    given = ps.Transform(init, inner.update)
    cfg = apply_overrides(TrainConfig(), ["optimizer.clip_grad_norm=1.0", "precision=bf16-true", "model.n_embd=32",
                                          "model.n_layer=1", "model.n_head=2", "model.block_size=32", "data.max_bytes=200000"])
    t = Trainer(None, given, None, cfg)
    assert devices == ["cpu"], devices  # clip and compensation looked for in the declarations: no init run for it
    assert len([n for n in ps.tree_leaves(t.opt_state)]) > 0


# --------------------------------------------------------------------------- #
# QK-clip: optimizer.qk_clip.
# --------------------------------------------------------------------------- #


def _head_max_logits(model, batch) -> torch.Tensor:
    """Each block's heads' max pre-softmax logit on `batch`, computed here from the weights."""
    import math

    x = model.embed(batch["input"])
    out = []
    for block in model.blocks:
        h = block.attn_norm(x)
        B, T, C = h.shape
        H = block.attn.n_heads
        q, k = (w(h).view(B, T, H, C // H).transpose(1, 2) for w in (block.attn.q, block.attn.k))
        from purestep.api.models import apply_rope

        q, k = apply_rope(q, model.rope_cos, model.rope_sin), apply_rope(k, model.rope_cos, model.rope_sin)
        s = (q @ k.transpose(-2, -1)) / math.sqrt(C // H)
        s = s.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), float("-inf"))
        out.append(s.amax(dim=(0, 2, 3)))
        x = block(x, model.rope_cos, model.rope_sin)
    return torch.stack(out)


def test_qk_clip_in_the_trainer_caps_each_heads_max_logit_and_equals_a_bare_loop():
    """optimizer.qk_clip=τ: the GPT records each head's max logit in its forward, the Trainer
    hands them (all-reduced) to ps.qk_clip chained after the optimizer. With lr 0 the clip alone
    moves the weights: the heads above τ come out at τ exactly, the others as they were."""
    cfg = tiny_config("steps=1", "checkpoint_every=0", "ema_decay=none", "optimizer.name=adamw", "optimizer.kwargs={}",
                      "optimizer.lr=0.0", "schedule.warmup_steps=0")
    torch.manual_seed(cfg.seed)
    probe_model, data = build_model(cfg.model), build_data(cfg)
    batch = data.batch(0)
    with torch.no_grad():
        before = _head_max_logits(probe_model, batch)
    tau = float(before.median())
    t = Trainer(config=apply_overrides(cfg, [f"optimizer.qk_clip={tau}"]), progress=False)
    t.fit()
    with torch.no_grad():
        after = _head_max_logits(D_unwrap(t), batch)
    torch.testing.assert_close(after, torch.clamp(before, max=tau), rtol=1e-4, atol=1e-4)
    assert bool((before > tau).any()) and "max_logit" in t.last
    t.evaluate(1)  # an evaluation's forwards record no logits for the next step's clip
    assert D_unwrap(t).take_max_logits() == {}
    # A model that does not report its heads is refused naming the field.
    with pytest.raises(ConfigError, match="optimizer.qk_clip"):
        _linear_run(apply_overrides(TrainConfig(), ["steps=1", "batch_size=8", "optimizer.qk_clip=50.0"]), ps.sgd(0.1))


def D_unwrap(t):
    from purestep.api import distributed as D

    return D.unwrap(t.module)


MOE = 'model.kwargs={"experts": 4, "top_k": 2}'


def test_moe_gpt_routes_like_a_per_token_reference_and_muon_sees_each_expert_as_a_matrix():
    """The MoE layer against a loop over tokens (each token's top-2 experts, their softmax
    weights renormalized); its balance loss against Switch's E·Σ f_e·P_e by hand; the
    Trainer's muon_adamw given the model's batch_dims table (each expert its own matrix),
    which differs from Muon on the flattened (E, m, n) leaf."""
    from purestep.api._build import trainer_transform
    from purestep.api.models import GPT

    torch.manual_seed(0)
    model = GPT(dim=16, n_layers=1, n_heads=2, seq_len=8, experts=4, top_k=2)
    moe = model.blocks[0].mlp
    torch.nn.init.normal_(moe.experts.down, std=0.1)
    t = torch.randn(12, 16)
    with torch.no_grad():
        y = moe(t)
        probs = moe.router(t).softmax(-1)
        ref = torch.zeros_like(t)
        hits = torch.zeros(4)
        for i in range(12):
            w, idx = probs[i].topk(2)
            for wj, e in zip(w / w.sum(), idx):
                x = moe.experts
                ref[i] += wj * (x.down[e] @ (torch.nn.functional.silu(x.gate[e] @ t[i]) * (x.up[e] @ t[i])))
                hits[e] += 1
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(moe.balance_loss, 4 * (hits / 24 * probs.mean(0)).sum(), rtol=1e-5, atol=1e-7)
    cfg = tiny_config(MOE, "model.n_layer=1", "optimizer.kwargs={}", "optimizer.clip_grad_norm=none",
                      "schedule.name=constant", "schedule.warmup_steps=none")
    params = {k: p.detach().clone() for k, p in model.named_parameters()}
    grads = {k: torch.randn_like(p) for k, p in params.items()}
    got = trainer_transform(cfg, None, params, model, (None, None))
    experts = ps.muon_adamw(lr=cfg.optimizer.lr, batch_dims=model.batch_dims())
    flattened = ps.muon_adamw(lr=cfg.optimizer.lr)
    updates = {name: t.update(grads, t.init(params), params)[0]["blocks.0.mlp.experts.gate"] for name, t in
               (("got", got), ("experts", experts), ("flattened", flattened))}
    direction = {k: u / u.norm() for k, u in updates.items()}
    torch.testing.assert_close(direction["got"], direction["experts"], rtol=1e-4, atol=1e-6)
    assert not torch.allclose(direction["got"], direction["flattened"], atol=1e-3)
    with pytest.raises(ValueError, match="top_k=5 must be between 1 and experts=4"):
        GPT(experts=4, top_k=5)
