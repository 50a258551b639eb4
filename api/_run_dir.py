"""A Trainer's run directory: opening it (fresh or resumed), saving and restoring checkpoints.

Resume rules: a run directory that holds a run is only continued with `resume=True`
(`--resume`); the newest checkpoint that loads is restored, bit-for-bit on CPU with a
step-indexed data source; a setting changed since that checkpoint is applied and said
in one line, or refused naming it when a resumed run cannot take it (`resume_changes`);
a run that has done its steps says there is nothing to do.
"""

from __future__ import annotations

import collections
import dataclasses
from pathlib import Path
from typing import Annotated, Any, cast

import msgspec

import torch.utils._pytree as pytree
from torch import Tensor

import purestep.core as ps

from . import distributed as D
from ._report import MetricsFile, log
from .checkpoint import MANIFEST, Checkpoint, CheckpointManager, checkpoint_dir, read_manifest, read_worker
from .config import resume_changes
from .errors import CheckpointError, ConfigError, RunDirError

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


def finished(config: Any, loop: LoopState) -> bool:
    """Whether a run at `loop` has done its `config.steps` (or spent its `time_budget`)."""
    budget = config.time_budget
    return loop.step >= config.steps or (budget is not None and loop.elapsed >= budget)


@dataclasses.dataclass
class TrainState:
    """What a checkpoint saves of a run and restores into, in place: the params (the
    model's tensors by name, as the update sees them), the optimizer state, the EMA (or
    None) and the `LoopState`."""

    params: dict[str, Tensor]
    opt_state: Any
    ema: Any
    loop: LoopState


class RunDir:
    """A Trainer's run directory (`out`), or none: what it holds and who may write it.

    It owns the lock (held from `open` until `release`, see `CheckpointManager.hold`: a
    second writer, fresh or resuming, is refused naming the holder), the checkpoints under
    `out/checkpoints` (`CheckpointManager`), `metrics.jsonl` (`MetricsFile`) and the step
    last saved. Without `out` there are no checkpoints and the metrics go nowhere. `save`,
    `restore` and `open` read and write a `TrainState`'s tensors and loop, in place.
    """

    def __init__(self, out: str | Path | None, config: Any, world: Any, *, sharded: bool) -> None:
        self.out = Path(out) if out is not None else None
        self.config, self.world = config, world
        # DiLoCo's workers each train their own params and inner state between syncs: the files
        # layout (whole tensors, gathered within a worker) with one file per worker beyond the first.
        self.worker = D.worker_of(world) if config.diloco.sync_every is not None else None
        index, _, leads = self.worker or (0, 1, False)
        self.checkpoints = (
            None
            if self.out is None
            else CheckpointManager(
                self.out,
                keep_last=config.keep_last or 1 << 30,
                world=world,
                distributed=sharded and self.worker is None,
                background=config.async_checkpoint,
                worker=index if leads and index >= 1 else None,
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

    def save(self, state: TrainState) -> Path | None:
        """Write the checkpoint of `state` at its step (collective); the path on the main rank."""
        if self.checkpoints is None:
            return None
        step = state.loop.step
        path = self.checkpoints.save(
            step,
            params=state.params,
            opt_state=state.opt_state,
            ema=state.ema,
            config=self.config,
            data_state={"step": step, "seed": self.config.seed},
            metadata={
                "trainer": state.loop.state_dict(),
                "world_size": self.world.size,
                **({"workers": self.worker[1]} if self.worker else {}),
            },
        )
        self.saved_at = step
        return path

    def restore(self, state: TrainState) -> Checkpoint | None:
        """Load the newest checkpoint that loads into `state`'s tensors and loop, in place; None when none does."""
        if self.checkpoints is None:
            return None
        c = self.checkpoints.restore(
            params_like=state.params, opt_state_like=state.opt_state, ema_like=state.ema, check=LoopState.check
        )
        if c is None:
            return None
        # Into the tensors the compiled, donated update already holds.
        D.copy_into_(state.params, c.params)
        D.copy_into_(state.opt_state, c.opt_state)
        if state.ema is not None:
            D.copy_into_(state.ema, c.ema)
        self._own_worker_state(state, c)
        state.loop.load_state_dict({**c.manifest.metadata.get("trainer", {}), "step": c.step})
        self.saved_at = c.step
        if self.world.size == c.manifest.metadata.get("world_size", 1):
            c.restore_rng()
        return c

    def _own_worker_state(self, state: TrainState, c: Checkpoint) -> None:
        """Each DiLoCo worker beyond the first takes its own params and state from its file (a
        checkpoint of as many workers); with another number of workers every worker goes on
        from worker 0's."""
        if self.worker is None:
            return
        index, count, _ = self.worker
        saved = c.manifest.metadata.get("workers", 1)
        if saved != count:
            if self.world.main:
                log(
                    f"warning: {self.checkpoint_path(c.step).name} was written by {saved} DiLoCo worker(s), this run "
                    f"has {count}: every worker goes on from worker 0's params and optimizer state"
                )
            return
        if index >= 1:
            read_worker(self.checkpoint_path(c.step), c.manifest, index, (state.params, state.opt_state, state.ema))

    def open(self, state: TrainState, resume: bool, hyperparams: dict[str, Any]) -> bool:
        """Hold the run directory and prepare it for training, resuming into `state` if asked (a
        resumed run keeps `hyperparams`, its own constant ones); False when there is nothing
        left to train."""
        config, world, loop = self.config, self.world, state.loop
        if self.out is None or self.checkpoints is None:
            if config.checkpoint_every:
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
            changes = resume_changes(manifest.config if manifest else None, config, manifest.step if manifest else 0)
            if latest is None and not checkpoints.has_candidates():
                # Killed before its first checkpoint (metrics only): start over, as Lightning's ckpt_path="last" does.
                if world.main:
                    log(
                        f"warning: {out} holds no checkpoint (the run stopped before its first); "
                        "starting from step 0, its metrics.jsonl is rewritten"
                    )
            elif self.restore(state) is None:
                raise RunDirError(
                    f"{out}: no checkpoint in {out / 'checkpoints'} loads (see the warnings above); "
                    "move the damaged ones aside to start over from step 0, or pass a new --out"
                )
            else:
                _take_hyperparams(state.opt_state, hyperparams)
                if world.main:
                    log(f"resumed from {checkpoint_dir(out, loop.step)} at step {loop.step}")
                    for message in changes:
                        log(f"resume: {message}")
                    budget = config.time_budget
                    if budget is not None and loop.elapsed >= budget and loop.step < config.steps:
                        log(
                            f"nothing to do: the run spent its time_budget ({loop.elapsed:.0f} of {budget:g} s) at "
                            f"step {loop.step}; pass a larger --set time_budget=... to train on"
                        )
                    elif finished(config, loop):
                        log(
                            f"nothing to do: the run finished at step {loop.step} (steps={config.steps}); "
                            "pass a larger --steps to train on"
                        )
                if finished(config, loop):
                    return False
        D.barrier(world)
        if world.main:
            out.mkdir(parents=True, exist_ok=True)
            self.metrics.keep_until(loop.step)  # drop what was logged after the checkpoint resumed from
        return True


def _take_hyperparams(opt_state: Any, hyperparams: dict[str, Any]) -> None:
    """A resumed run keeps its own constant hyperparameters, not the checkpoint's (schedules re-evaluate the rest)."""
    held = ps.get_hyperparams(opt_state)
    for key, value in hyperparams.items():
        for dst, src in zip(pytree.tree_leaves(held[key]), pytree.tree_leaves(value)):
            dst.copy_(src)
