"""A Trainer's run directory: opening it (fresh or resumed), saving and restoring checkpoints.

Resume rules: a run directory that holds a run is only continued with `resume=True`
(`--resume`); the newest checkpoint that loads is restored, bit-for-bit on CPU with a
step-indexed data source; a setting changed since that checkpoint is applied and said
in one line, or refused naming it when a resumed run cannot take it (`resume_changes`);
a run that has done its steps says there is nothing to do.
"""

from __future__ import annotations

import collections
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, cast

import msgspec

import torch.utils._pytree as pytree
from torch import Tensor

import purestep.core as ps

from . import distributed as D
from ._report import MetricsFile, log
from .checkpoint import MANIFEST, Checkpoint, CheckpointManager, checkpoint_dir, read_manifest
from .config import resume_changes
from .errors import CheckpointError, ConfigError, RunDirError


if TYPE_CHECKING:
    from .trainer import Trainer

_Count = Annotated[int, msgspec.Meta(ge=0, le=1 << 62)]


class _SavedLoop(msgspec.Struct):
    """The schema of `LoopState.state_dict()` as a checkpoint holds it (every field optional)."""

    step: _Count = 0
    tokens: _Count = 0
    elapsed: Annotated[float, msgspec.Meta(ge=0)] = 0.0
    recent: list[float] = []
    spikes: _Count = 0
    skip: list[tuple[_Count, _Count]] = []
    skipped: _Count = 0


class LoopState:
    """Where a run stands between steps: what a checkpoint saves besides the params, the
    optimizer state and the EMA, as plain data (`state_dict` / `load_state_dict`, the
    pattern of torchtitan's `TrainState`). The Trainer reads and writes these fields only.

    Fields: `step` (batches consumed), `elapsed` (seconds trained, agreed over the ranks),
    `skipped` (steps skipped on the host: loss spikes and rewound batches), `tokens` (a
    0-d device tensor: counted every step without a sync), `recent` (the last losses, for
    spike detection), `spikes` (consecutive spikes), `skip` ([start, stop) batch ranges
    skipped after a rewind).
    """

    def __init__(self, tokens: Tensor, spike_window: int) -> None:
        self.step, self.elapsed, self.skipped, self.spikes = 0, 0.0, 0, 0
        self.tokens = tokens
        self.recent: collections.deque = collections.deque(maxlen=spike_window)
        self.skip: list[list[int]] = []

    def state_dict(self) -> dict[str, Any]:
        """The fields as JSON-able data (reads `tokens` from the device: call between steps)."""
        return {
            "step": self.step,
            "tokens": int(self.tokens),
            "elapsed": self.elapsed,
            "recent": list(self.recent),
            "spikes": self.spikes,
            "skip": [list(r) for r in self.skip],
            "skipped": self.skipped,
        }

    @staticmethod
    def check(path: Path, manifest: Any) -> None:
        """Refuse (CheckpointError naming the manifest) a saved loop state that would not load."""
        try:
            msgspec.convert(manifest.metadata.get("trainer", {}), _SavedLoop)
        except (msgspec.ValidationError, AttributeError) as e:
            raise CheckpointError(f"{path / MANIFEST}: metadata.trainer: {e}") from None

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """The fields from `state_dict()`'s data; a field it lacks (an older checkpoint) starts afresh."""
        self.step, self.elapsed = int(state.get("step", 0)), float(state.get("elapsed", 0.0))
        self.tokens.fill_(state.get("tokens", 0))
        self.spikes, self.skipped = int(state.get("spikes", 0)), int(state.get("skipped", 0))
        self.skip = [list(r) for r in state.get("skip", [])]
        self.recent = collections.deque(state.get("recent", []), maxlen=self.recent.maxlen)


class RunDir:
    """A Trainer's run directory (`out`), or none: what it holds and who may write it.

    It owns the lock (held from `open` until `release`, see `CheckpointManager.hold`: a
    second writer, fresh or resuming, is refused naming the holder), the checkpoints under
    `out/checkpoints` (`CheckpointManager`), `metrics.jsonl` (`MetricsFile`) and the step
    last saved. Without `out` there are no checkpoints and the metrics go nowhere. `save`,
    `restore` and `open` read and write the Trainer's model, state and `LoopState`.
    """

    def __init__(self, out: str | Path | None, config: Any, world: Any, *, sharded: bool) -> None:
        self.out = Path(out) if out is not None else None
        self.checkpoints = (
            None
            if self.out is None
            else CheckpointManager(
                self.out,
                keep_last=config.keep_last or 1 << 30,
                world=world,
                distributed=sharded,
                background=config.async_checkpoint,
            )
        )
        self.metrics = MetricsFile(self.out / "metrics.jsonl" if self.out else None, world.main)
        self.saved_at: int | None = None

    def holds_checkpoints(self) -> bool:
        return self.checkpoints is not None

    def release(self) -> None:
        """Let go of the lock (the run directory is a run's until its `fit` returns)."""
        if self.checkpoints is not None:
            self.checkpoints.release()

    def checkpoint_path(self, step: int) -> Path:
        return checkpoint_dir(cast(Path, self.out), step)

    def save(self, t: Trainer) -> Path | None:
        """Write the checkpoint of `t.step` (collective); the path on the main rank."""
        if self.checkpoints is None:
            return None
        path = self.checkpoints.save(
            t.step,
            params=t.params(),
            opt_state=t.opt_state,
            ema=t.ema,
            config=t.config,
            data_state={"step": t.step, "seed": t.config.seed},
            metadata={"trainer": t.loop.state_dict(), "world_size": t.world.size},
        )
        self.saved_at = t.step
        return path

    def restore(self, t: Trainer) -> Checkpoint | None:
        """Load the newest checkpoint that loads into `t`'s model, state and loop, in place; None when none does."""
        if self.checkpoints is None:
            return None
        params = t.params()
        c = self.checkpoints.restore(
            params_like=params, opt_state_like=t.opt_state, ema_like=t.ema, check=LoopState.check
        )
        if c is None:
            return None
        # Into the tensors the compiled, donated update already holds.
        D.copy_into_(params, c.params)
        D.copy_into_(t.opt_state, c.opt_state)
        if t.ema is not None:
            D.copy_into_(t.ema, c.ema)
        t.loop.load_state_dict({**c.manifest.metadata.get("trainer", {}), "step": c.step})
        self.saved_at = c.step
        t.nonfinite_logged = int(t.nonfinite())
        if t.world.size == c.manifest.metadata.get("world_size", 1):
            c.restore_rng()
        return c

    def open(self, t: Trainer, resume: bool) -> bool:
        """Hold the run directory and prepare it for training, resuming if asked; False when there is nothing left to train."""
        if self.out is None or self.checkpoints is None:
            if t.config.checkpoint_every:
                raise ConfigError("checkpoint_every", "checkpoints need a run directory: pass out=")
            return True
        out, checkpoints = self.out, self.checkpoints
        checkpoints.hold()  # before reading anything: a second writer is refused here
        latest = checkpoints.latest()
        held = latest is not None or (out / "metrics.jsonl").exists()
        if held and not resume:
            raise RunDirError(f"{out}: already holds a run; pass --resume to continue it or a new --out")
        if resume and held:
            manifest = read_manifest(latest) if latest is not None else None
            changes = resume_changes(manifest.config if manifest else None, t.config, manifest.step if manifest else 0)
            if latest is None and not checkpoints.has_candidates():
                # Killed before its first checkpoint (metrics only): start over, as Lightning's ckpt_path="last" does.
                if t.world.main:
                    log(
                        f"warning: {out} holds no checkpoint (the run stopped before its first); "
                        "starting from step 0, its metrics.jsonl is rewritten"
                    )
            elif self.restore(t) is None:
                raise RunDirError(
                    f"{out}: no checkpoint in {out / 'checkpoints'} loads (see the warnings above); "
                    "move the damaged ones aside to start over from step 0, or pass a new --out"
                )
            else:
                _take_hyperparams(t)
                if t.world.main:
                    log(f"resumed from {checkpoint_dir(out, t.step)} at step {t.step}")
                    for message in changes:
                        log(f"resume: {message}")
                    budget = t.config.time_budget
                    if budget is not None and t.elapsed >= budget and t.step < t.config.steps:
                        log(
                            f"nothing to do: the run spent its time_budget ({t.elapsed:.0f} of {budget:g} s) at step "
                            f"{t.step}; pass a larger --set time_budget=... to train on"
                        )
                    elif t.finished():
                        log(
                            f"nothing to do: the run finished at step {t.step} (steps={t.config.steps}); "
                            "pass a larger --steps to train on"
                        )
                if t.finished():
                    return False
        D.barrier(t.world)
        if t.world.main:
            out.mkdir(parents=True, exist_ok=True)
            self.metrics.keep_until(t.step)  # drop what was logged after the checkpoint resumed from
        return True


def _take_hyperparams(t: Trainer) -> None:
    """A resumed run keeps its own constant hyperparameters, not the checkpoint's (schedules re-evaluate the rest)."""
    held = ps.get_hyperparams(t.opt_state)
    for key, value in t.hyperparams.items():
        for dst, src in zip(pytree.tree_leaves(held[key]), pytree.tree_leaves(value)):
            dst.copy_(src)
