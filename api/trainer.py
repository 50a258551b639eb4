"""The Trainer: a plain loop over `ps.make_update`, run on one process, DDP, FSDP2/HSDP or TP.

One step, as `Trainer.train_step` spells it out:

    for each of grad_accum micro-batches (the data source splits them):
        loss_sum, tokens = loss_fn(model, micro); loss_sum.backward()
    loss_sum, tokens = all-reduce                      # async; a TP group's rows counted once
    grads *= data-parallel ranks / tokens             # the per-token mean over the global batch
    params, opt_state, ema = update(params, grads, opt_state, ema)

`update` is `ps.make_update` of the transform wrapped in `ps.apply_if_finite` (with `[diloco]`,
that inside `ps.diloco`), so a non-finite step is skipped on the device (with precision
"bf16-true" the transform ends in `ps.compensated_updates()`, so bf16 params do not drift); the
lr is the transform's own injected schedule; the grad norm is `clip_by_global_norm`'s state.
The loss, grad norm, lr and skip count are read from the device only when a log line is due.
Everything else (logging, evaluation, checkpoints, preemption, the time budget: `api/_loop.py`)
happens between steps.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any, Callable, cast

import torch
import torch.utils._pytree as pytree
from torch import Tensor, nn

import purestep.core as ps

from . import _run_dir as run_dir
from ._loop import Loop
from . import distributed as D
from ._report import read
from ._build import trainer_transform
from .config import TrainConfig, refuse_ignored
from .errors import ConfigError
from .data import batch_rows, build_data, check_rows, eval_batches, is_step_indexed, to_device, train_batches
from .models import build_model, lm_loss, peak_flops


class Trainer(Loop):
    """Train a model as a `TrainConfig` says: one process, DDP, FSDP2/HSDP or TP (under torchrun).

    Every field of the config is honoured or refused (see `TrainConfig`). The model, the
    transform and the data are built from the config's sections unless given.

    Args:
      model: an `nn.Module` (None: the GPT of the `model` section). Under FSDP2 each block
        of `model.blocks` / `layers` / `h` is sharded, then the root.
      transform: any `ps.Transform` (None: `config.build_optimizer()`, an injected
        schedule inside). `optimizer.clip_grad_norm` is chained in front of a given one,
        and refused when it clips already. With precision "bf16-true",
        `ps.compensated_updates()` is chained behind it (a transform that already holds a
        `ps.CompensatedUpdatesState`, e.g. `method="stochastic"`, is kept as it is). The
        Trainer wraps it in `ps.apply_if_finite`, and that in `ps.diloco` with `[diloco]`.
      loss_fn: `loss_fn(model, batch) -> (loss_sum, tokens)`: the loss summed over the
        micro-batch's tokens and their count; gradients are divided by the token count of
        the whole global batch, so accumulation and data parallelism weight every token
        equally. A plain mean loss (a 0-d tensor) counts as one token per row. None: the
        GPT's `lm_loss` (only with a model built from the config).
      config: a `TrainConfig` (None: the defaults).
      data: a step-indexed source (`batch(step, rank, world)`, bit-identical resume), or
        an iterable of batches such as a `DataLoader` (see `purestep.api.data`). None:
        the corpus of the `data` section.
      eval_data: validation batches for an iterable `data` (a step-indexed source has its
        own `split="val"`).
      out: the run directory (metrics.jsonl, checkpoints/); None keeps nothing on disk.
      ema: an averaging pair such as `ps.params_swa()` (None: `config.ema_decay`'s EMA, if
        any; in float32 for "bf16-true", where a bf16 average would stop moving).
      progress: progress on rank 0, a tqdm bar on a terminal, else a line per log (None: on).
      device: this rank's device (None: its GPU, else the CPU).

    Under a `time_budget` the injected schedules run on progress: before each update
    the Trainer sets their step to `progress x steps` (progress = elapsed / budget), so
    a warmup + cosine schedule runs its whole course in the budget.
    """

    def __init__(
        self,
        model: nn.Module | None = None,
        transform: ps.Transform | None = None,
        loss_fn: Callable[[nn.Module, Any], Any] | None = None,
        config: TrainConfig | None = None,
        *,
        data: Any = None,
        eval_data: Any = None,
        out: str | Path | None = None,
        ema: Any = None,
        progress: bool | None = None,
        device: str | None = None,
    ) -> None:
        self.config = cfg = config if config is not None else TrainConfig()
        refuse_ignored(cfg, {"transform": transform, "model": model, "data": data, "ema": ema})
        if loss_fn is None and model is not None:
            raise ValueError("loss_fn: a given model needs its loss_fn(model, batch) -> loss or (loss_sum, tokens)")
        self.world = D.setup(cfg.strategy, device, replicate=cfg.replicate, tp=cfg.tp, ep=cfg.ep)
        torch.manual_seed(cfg.seed)
        self.loss_fn = loss_fn or lm_loss
        self.data = data if data is not None else build_data(cfg)
        self.eval_data = self.data if eval_data is None and is_step_indexed(self.data) else eval_data
        if cfg.eval_every and self.eval_data is None:
            raise ConfigError("eval_every", "the data has no validation split; pass eval_data= or set eval_every=0")
        k, w = cfg.grad_accum, self.world.dp_size
        if is_step_indexed(self.data) and cfg.batch_size % (k * w):
            raise ConfigError("batch_size", f"{cfg.batch_size} rows do not split into {w} rank(s) x {k} micro-batches")
        local_sgd = cfg.diloco.sync_every is not None  # DiLoCo's workers: no grad all-reduce
        over_replicas, apart = D.replica_layout(cfg, self.world)
        model = model if model is not None else build_model(cfg.model)
        self.module = D.wrap(model, self.world, precision=cfg.precision, local_sgd=local_sgd, replicas_apart=apart)
        self.model: Any = torch.compile(self.module) if cfg.compile else self.module
        self.named = dict(D.unwrap(self.module).named_parameters())
        # Detached aliases that a compiled, donated update re-points into its flat buffers
        # together with the module's own parameters (see ps.make_update).
        self._params = ps.functional_model(D.unwrap(self.module))[1]
        self.fsdp = self.world.strategy in D.FSDP  # FSDP2-sharded params (HSDP, FSDP+TP: over a 2-D mesh)
        params = self.params()
        self.qk = cfg.optimizer.qk_clip is not None  # QK-clip: the model reports its heads' max logits
        self.max_logit: Tensor | None = None
        workers = (D.worker_mean(self.world), D.worker_gather(self.world)) if local_sgd else (None, None)
        self.transform = trainer_transform(cfg, transform, params, D.unwrap(self.module), workers)
        if ema is None and cfg.ema_decay:
            ema = ps.params_ema(cfg.ema_decay, dtype=torch.float32 if cfg.bf16_params else None)
        # Donated on every strategy: under FSDP2 the update runs on flat buffers of this
        # rank's shards (ps.make_update's sharded path), in place in FSDP2's own storage.
        # metrics=True: the grad norm (before any clipping) and the lr come back from the update
        # itself, computed in its own pass (over FSDP2 shards, of the whole grads).
        self.update = ps.make_update(
            self.transform,
            compile=cfg.compile,
            donate=True,
            ema=ema,
            metrics=True,
            shard_state_over_replicas=D.hsdp_mesh(self.world) if over_replicas else False,
        )
        self.opt_state = self.transform.init(params)
        self.update_metrics: dict[str, Tensor] = {}  # the last update's (device tensors)
        self.ema = ema[0](params) if ema is not None else None
        self.hyperparams = {k: pytree.tree_map(torch.clone, v) for k, v in ps.get_hyperparams(self.opt_state).items()}
        self.run = run_dir.RunDir(out, cfg, self.world, sharded=self.fsdp)  # the lock, checkpoints, metrics
        self.progress = self.world.main if progress is None else progress and self.world.main
        flops = getattr(D.unwrap(self.module), "flops_per_token", None)
        self.flops_per_token = flops() if callable(flops) else None
        self.peak_flops = peak_flops(self.world.device)
        # Where the run stands, saved with every checkpoint; the rest is this process's own.
        self.loop = run_dir.LoopState(torch.zeros((), dtype=torch.float64, device=self.world.device), cfg.spike_window)
        self.nonfinite_logged = 0
        self.last: dict[str, Any] = {}
        self.batches: Any = None
        self.rows_checked = False

    # ------------------------------------------------------------------ #
    # Where the run stands (`self.loop`, a `LoopState`).
    # ------------------------------------------------------------------ #

    @property
    def step(self) -> int:
        """Batches consumed so far (updates applied plus steps skipped)."""
        return self.loop.step

    @property
    def elapsed(self) -> float:
        """Seconds trained so far (agreed over the ranks; what `time_budget` counts)."""
        return self.loop.elapsed

    @property
    def skip(self) -> list[list[int]]:
        """The [start, stop) batch ranges skipped after a rewind."""
        return self.loop.skip

    # ------------------------------------------------------------------ #
    # The pieces of a step.
    # ------------------------------------------------------------------ #

    def params(self) -> dict[str, Tensor]:
        """The model's parameters as the update sees them (sharing storage with the module)."""
        return self._params

    def _autocast(self) -> contextlib.AbstractContextManager:
        # FSDP2 on CUDA casts through its MixedPrecisionPolicy instead.
        on = self.config.autocast and not (self.fsdp and self.world.device.type == "cuda")
        return torch.autocast(self.world.device.type, dtype=torch.bfloat16, enabled=on)

    def _inputs(self, batch: Any) -> Any:
        """`batch` on this rank's device; its floating tensors in bf16 when the params are ("bf16-true")."""
        batch = to_device(batch, self.world.device)
        if not self.config.bf16_params:
            return batch
        bf16 = lambda t: t.to(torch.bfloat16) if isinstance(t, Tensor) and t.is_floating_point() else t  # noqa: E731
        return pytree.tree_map(bf16, batch)

    def _sync(self, last: bool) -> contextlib.AbstractContextManager:
        """Reduce gradients only on the last micro-batch."""
        if isinstance(self.module, torch.nn.parallel.DistributedDataParallel) and not last:
            return self.module.no_sync()
        if self.fsdp:
            cast(Any, self.module).set_requires_gradient_sync(last)
        return contextlib.nullcontext()

    def _batches(self, start: int) -> Any:
        """This data-parallel rank's micro-batches from step `start` on (a TP group's ranks read the same)."""
        return train_batches(self.data, start, self.world.dp_rank, self.world.dp_size, self.config.grad_accum)

    def _loss(self, batch: Any) -> tuple[Tensor, Tensor]:
        out = self.loss_fn(self.model, batch)
        if isinstance(out, tuple):
            return out[0], torch.as_tensor(out[1], device=self.world.device)
        rows = batch_rows(batch)
        return out * rows, torch.tensor(rows, device=self.world.device)

    def _max_logits(self) -> dict[str, Tensor]:
        """Each head's max logit over this step's batch on every rank (one collective; under
        tensor parallelism every TP rank's heads gathered: `D.max_over_heads`)."""
        got = cast(Any, D.unwrap(self.module)).take_max_logits()
        names = list(got)
        both = D.max_over_heads(torch.stack([got[n] for n in names]), self.world)
        self.max_logit = both.max()  # logged
        return dict(zip(names, both.unbind(0)))

    def _clocks(self) -> list[Tensor]:
        """The step counters the injected schedules read."""
        return ps.schedule_clocks(self.opt_state)

    def _progress(self) -> float:
        done, budget = self.loop.step / self.config.steps, self.config.time_budget
        return max(done, self.loop.elapsed / budget) if budget else done

    # ------------------------------------------------------------------ #
    # One step.
    # ------------------------------------------------------------------ #

    def train_step(self) -> dict[str, Any]:
        """Consume the batch of `self.loop.step` and apply one update; returns device tensors, never syncs.

        Reads the loss on the host only when spike detection is on (`spike_factor > 0`).
        Called on its own (before or without `fit`), it opens the data at `self.loop.step` and
        writes nothing to the run directory: no metrics, no checkpoints.
        """
        if any(a <= self.loop.step < b for a, b in self.loop.skip):
            self.loop.step, self.loop.skipped = self.loop.step + 1, self.loop.skipped + 1
            return {"event": "skip_rewound_batch"}
        if self.batches is None:  # called before fit(): the data opens at this step
            self.batches = self._batches(self.loop.step)
        micro = next(self.batches)
        if not self.rows_checked:
            self.rows_checked = check_rows(micro, self.world.dp_size, self.config.batch_size)
        loss_sum, tokens = [], []
        for i, batch in enumerate(micro):
            with self._sync(i == len(micro) - 1), self._autocast():
                ls, n = self._loss(self._inputs(batch))
            ls.backward()
            loss_sum.append(ls.detach().double())
            tokens.append(n.double())
        total = D.sum_over_rows(torch.stack([cast(Tensor, sum(loss_sum)), cast(Tensor, sum(tokens))]), self.world)
        n = total[1].clamp(min=1.0)
        loss = total[0] / n
        grads = {k: p.grad if p.grad is not None else torch.zeros_like(p) for k, p in self.named.items()}
        record: dict[str, Any] = {"loss": loss, "tokens": total[1]}
        logits = self._max_logits() if self.qk else None  # this step's forwards' (a skipped step drops them)
        if self.config.spike_factor and self._spiked(float(loss)):
            record["event"] = "skip_spike"
        else:
            # DDP and FSDP2 average grads over the data-parallel ranks; this makes them the per-token mean.
            torch._foreach_mul_([D.local(g) for g in grads.values()], (self.world.dp_size / n).float())
            if self.config.time_budget:
                for clock in self._clocks():
                    clock.fill_(int(self._progress() * self.config.steps))
            params = self.params()
            inputs = {"max_logits": logits} if logits is not None else {}
            out = self.update(params, grads, self.opt_state, *(() if self.ema is None else (self.ema,)), **inputs)
            self.opt_state, self.ema = out[1], (out[2] if self.ema is not None else None)
            self.update_metrics = out[-1]  # read when a log line is due
        # Zeroed in place, not dropped: the next backward writes where the update reads.
        torch._foreach_zero_([D.local(g) for g in grads.values()])
        self.loop.step += 1
        self.loop.tokens += total[1]
        if "event" in record:
            self.loop.skipped += 1
        return record

    def _spiked(self, loss: float) -> bool:
        k, recent = self.config.spike_factor, self.loop.recent
        if len(recent) == recent.maxlen and loss > k * (sum(recent) / len(recent)):
            self.loop.spikes += 1
            return True
        recent.append(loss)
        self.loop.spikes = 0
        return False

    def nonfinite(self) -> Tensor:
        """How many steps `apply_if_finite` skipped for non-finite gradients (a device tensor)."""
        skips = ps.skipped_updates(self.opt_state)  # the Trainer's own: the outermost
        assert skips is not None, "the Trainer's transform is wrapped in apply_if_finite"
        return skips[1]

    @property
    def updates(self) -> int:
        """Updates applied to the params so far (reads the skip count from the device)."""
        return self.loop.step - self.loop.skipped - int(self.nonfinite())

    def lr(self) -> float | None:
        """The injected `lr` the last update used (None when the transform injects none)."""
        return read(ps.get_hyperparams(self.opt_state).get("lr"))

    # ------------------------------------------------------------------ #
    # Evaluation.
    # ------------------------------------------------------------------ #

    @torch.no_grad()
    def evaluate(self, batches: int | None = None) -> float:
        """Mean loss per token over `batches` validation batches (the same ones every time)."""
        w = self.world
        self.model.eval()
        total = torch.zeros(2, dtype=torch.float64, device=w.device)
        for batch in eval_batches(self.eval_data, batches or self.config.eval_batches, w.dp_rank, w.dp_size):
            with self._autocast():
                ls, n = self._loss(self._inputs(batch))
            total += torch.stack([ls.double(), n.double()])
        self.model.train()
        if self.qk:  # the eval forwards' max logits drive no clip
            cast(Any, D.unwrap(self.module)).take_max_logits()
        loss_sum, n = D.sum_over_rows(total, w).tolist()
        if n == 0:
            raise ValueError(
                "eval_data: the evaluation ran over no batches (an empty source, or a one-shot iterator used up by an "
                "earlier evaluation); pass a re-iterable eval_data such as a list or a DataLoader"
            )
        return loss_sum / n
