"""The Trainer's loop: `fit` (steps until the run is done, logging, evaluation, checkpoints,
preemption by a signal, the time budget) and the checkpoints of a run (`save`, `rewind`),
around the one step `Trainer.train_step` takes. A mixin of `Trainer`: the attributes it
reads are the Trainer's, listed below."""

from __future__ import annotations

import contextlib
import time
from pathlib import Path
from typing import Any, Callable, cast

import torch
from torch import Tensor

import purestep.core as ps

from . import _run_dir as run_dir
from . import distributed as D
from ._report import Progress, StopSignals, log, read
from .config import TrainConfig
from .errors import CheckpointError, RunDirError


class Loop:
    """`fit` and the checkpoints of a `Trainer` (see the module docstring)."""

    # The Trainer's, set in its __init__ (see `Trainer`).
    config: TrainConfig
    world: D.World
    loop: run_dir.LoopState
    run: run_dir.RunDir
    model: Any
    opt_state: Any
    ema: Any
    hyperparams: dict[str, Any]
    update_metrics: dict[str, Tensor]
    last: dict[str, Any]
    nonfinite_logged: int
    batches: Any
    progress: bool
    flops_per_token: float | None
    peak_flops: float | None
    qk: bool
    max_logit: Tensor | None
    params: Callable[[], dict[str, Tensor]]
    train_step: Callable[[], dict[str, Any]]
    evaluate: Callable[..., float]
    nonfinite: Callable[[], Tensor]
    lr: Callable[[], float | None]
    _batches: Callable[[int], Any]

    # ------------------------------------------------------------------ #
    # Checkpoints.
    # ------------------------------------------------------------------ #

    def state(self) -> run_dir.TrainState:
        """What a checkpoint saves of this run: the params, optimizer state, EMA and loop (the Trainer's own tensors)."""
        return run_dir.TrainState(self.params(), self.opt_state, self.ema, self.loop)

    def save(self) -> Path | None:
        """Write a checkpoint of this step (collective; the path on the main rank)."""
        return self.run.save(self.state())

    def rewind(self) -> dict[str, Any]:
        """Back to the last checkpoint after repeated loss spikes; the batches since are skipped."""
        at = self.loop.step
        c = self.run.restore(self.state())
        self.loop.spikes = 0
        if c is None:
            log(f"step {at}: repeated loss spikes but no checkpoint to rewind to; skipping on")
            return {"to": None}
        self.nonfinite_logged = int(self.nonfinite())
        self.loop.skip.append([self.loop.step, at])
        log(
            f"step {at}: repeated loss spikes: rewound to step {self.loop.step}, skipping batches {self.loop.step}..{at - 1}"
        )
        return {"to": self.loop.step, "skipped": [self.loop.step, at]}

    def finished(self) -> bool:
        """Whether the run has done its `steps` (or spent its `time_budget`)."""
        return run_dir.finished(self.config, self.loop)

    # ------------------------------------------------------------------ #
    # The loop.
    # ------------------------------------------------------------------ #

    def _log(self, record: dict[str, Any], since: tuple[float, float]) -> tuple[float, float]:
        """Read the step's device values (a sync), write them to metrics.jsonl and the progress display."""
        now, tokens = time.perf_counter(), float(self.loop.tokens)
        tok_s = (tokens - since[1]) / max(now - since[0], 1e-9)
        norm = self.update_metrics.get("grad_norm")  # the last update's grads' (non-finite on a skipped one)
        line = {
            "step": self.loop.step,
            "loss": read(record.get("loss")),
            "lr": self.lr(),
            "grad_norm": read(norm),
            "tokens_per_s": tok_s,
            "time": self.loop.elapsed,
        }
        if not self.last:  # the run's first line: the optimizer state this rank holds (after an update placed it)
            line["state_bytes"] = ps.state_bytes((self.opt_state, self.ema))
        if self.flops_per_token and self.peak_flops:
            line["mfu"] = self.flops_per_token * tok_s / (self.peak_flops * self.world.size)
        if self.qk and self.max_logit is not None:
            line["max_logit"] = read(self.max_logit)  # before this step's clip
        nonfinite = int(self.nonfinite())
        if nonfinite > self.nonfinite_logged:
            event = {"step": self.loop.step, "event": "skip_nonfinite", "skipped": nonfinite - self.nonfinite_logged}
            self.run.metrics.write(event)
            log(
                f"step {self.loop.step}: skip_nonfinite ({event['skipped']} step(s) with non-finite gradients since the last log)"
            )
            self.nonfinite_logged = nonfinite
        if line["loss"] is not None:
            self.last.update(line)
            self.run.metrics.write(line)
        return now, tokens

    def fit(self, *, resume: bool = False) -> dict[str, Any]:
        """Train until `config.steps` batches (or `config.time_budget` seconds); return the last metrics.

        A checkpoint is written every `checkpoint_every` steps and at the end. SIGTERM or
        Ctrl-C stops the run after the current step with a checkpoint, then raises
        `SystemExit(128 + signal)` (no traceback); `fit(resume=True)` continues it.

        The run directory is held for the call (an OS lock, see `CheckpointManager.hold`):
        another process writing to it, fresh or resuming, gets a `RunDirError` naming
        the holder, and so does this one while another holds it.
        """
        try:
            return self._fit(resume)
        finally:
            self.run.release()  # the run directory is this run's until it returns

    def _fit(self, resume: bool) -> dict[str, Any]:
        if not self.run.open(self.state(), resume, self.hyperparams):
            return dict(self.last, step=self.loop.step)
        self.nonfinite_logged = int(self.nonfinite())  # a resumed run logs only its new skips
        # batches the source gave out
        start = max([self.loop.step] + [b for a, b in self.loop.skip if a <= self.loop.step])
        self.batches = self._batches(start)
        self.model.train()
        try:
            self._loop()
        except RunDirError:  # metrics.jsonl could not be written
            self._save_before_failing()
            raise
        if self.run.saved_at != self.loop.step:
            self.save()  # a finished run always has a checkpoint
        return dict(self.last, step=self.loop.step)

    def _loop(self) -> None:
        cfg, w = self.config, self.world
        since = (time.perf_counter(), float(self.loop.tokens))
        with StopSignals(w.main) as stop, contextlib.closing(Progress(self.progress, cfg.steps, self.loop.step)) as bar:
            spent = 0.0
            while not self.finished():
                t0 = time.perf_counter()
                record = self.train_step()
                spent += time.perf_counter() - t0
                due = self.loop.step % cfg.log_every == 0 or self.loop.step >= cfg.steps
                # One process counts the time every step; under torchrun the ranks agree on it (and
                # so on the budget and the schedule's progress) at log steps.
                if due or not w.distributed:
                    self.loop.elapsed, spent = self.loop.elapsed + self._agreed(spent), 0.0
                    due = due or self.finished()
                bar.step(self.loop.step)
                if record.get("event") == "skip_spike":
                    self.run.metrics.write(
                        {"step": self.loop.step, "event": "skip_spike", "loss": read(record["loss"])}
                    )
                    log(f"step {self.loop.step}: loss spike skipped (loss {read(record['loss']):.4g})")
                    if self.loop.spikes >= cfg.spike_rewind:
                        self.run.metrics.write({"step": self.loop.step, "event": "rewind", **self.rewind()})
                if due and "loss" in record:
                    since = self._log(record, since)
                    bar.metrics(self.last)
                if cfg.eval_every and self.loop.step % cfg.eval_every == 0:
                    self.last["val_loss"] = self.evaluate()
                    self.run.metrics.write({"step": self.loop.step, "val_loss": self.last["val_loss"]})
                    bar.line(f"step {self.loop.step:6d}  val loss {self.last['val_loss']:.4f}")
                if cfg.checkpoint_every and self.loop.step % cfg.checkpoint_every == 0:
                    self.save()
                if stop.agreed(self.world, due):
                    self._preempted(cast(int, stop.signum))  # agreed: a signal came

    def _agreed(self, seconds: float) -> float:
        """`seconds` averaged over the ranks (a collective under torchrun)."""
        if not self.world.distributed:
            return seconds
        t = torch.tensor(seconds, dtype=torch.float64, device=self.world.device)
        return float(D.all_reduce_sum(t, self.world)) / self.world.size

    def _preempted(self, signum: int) -> None:
        import signal

        if not self.run.holds_checkpoints():
            where = "no run directory, nothing saved"
        else:
            path = self.save() if self.run.saved_at != self.loop.step else self.run.checkpoint_path(self.loop.step)
            where = f"checkpoint {path}"
        if self.world.main:
            try:  # after SIGHUP the terminal may be gone
                log(
                    f"stopped by {signal.Signals(signum).name} at step {self.loop.step}; {where}; "
                    "resume with --resume / fit(resume=True)"
                )
            except OSError:
                pass
        raise SystemExit(128 + signum)

    def _save_before_failing(self) -> None:
        """A last checkpoint when the run directory fails under a single-process run (a full
        disk stops metrics.jsonl first: checkpoints may still fit). Under torchrun the other
        ranks are inside a collective, so nothing is attempted."""
        if not self.run.holds_checkpoints() or self.world.distributed or self.run.saved_at == self.loop.step:
            return
        try:
            log(f"checkpoint {self.save()} written before stopping")
        except (CheckpointError, OSError, RunDirError):
            pass

    def close(self) -> None:
        """Let go of the run directory and leave the process group (under torchrun)."""
        self.run.release()
        D.teardown(self.world)
