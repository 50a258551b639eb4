"""The Trainer: a plain loop over `ps.make_update`, run on one process, DDP or FSDP2.

One step, as `Trainer.train_step` spells it out:

    batch  = data.batch(step, rank, world)            # a pure function of (seed, step)
    for each micro-batch:  loss_sum, tokens = loss_fn(model, micro); loss_sum.backward()
    loss_sum, tokens, |g|^2 = all-reduce                # one collective
    skip the step if not finite, or if loss > k x rolling mean (and rewind on repeats)
    grads *= world / tokens                            # the per-token mean over the global batch
    params, opt_state, ema = update(params, grads, opt_state, ema)

Everything else (logging, evaluation, checkpoints, the time budget) happens between
steps. All update math lives in the transform (`purestep.core`).
"""

from __future__ import annotations

import collections
import contextlib
import json
import math
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch
from torch import Tensor, nn

import purestep.core as ps

from . import checkpoint as ckpt
from . import distributed as D

# Peak dense bf16 FLOP/s of common accelerators, for MFU (per device).
_PEAK_FLOPS = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "L40S": 362e12, "A10G": 125e12, "4090": 165e12}


def _peak_flops(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((v for k, v in _PEAK_FLOPS.items() if k in name), None)


class RunDirError(ValueError):
    """A run directory that cannot be used as asked (holds another run, or nothing to resume)."""


def _log(msg: str) -> None:
    print(f"purestep: {msg}", file=sys.stderr, flush=True)


class Trainer:
    """Train `model` with `transform` on `data`, as `config` (a `TrainConfig`) says.

    Args:
      model: an `nn.Module`; under FSDP2 each block of `model.blocks` / `layers` / `h`
        is sharded, then the root.
      transform: any `ps.Transform`.
      lr_schedule: a multiplier `t -> factor` (as `torch.optim.lr_scheduler.LambdaLR`)
        of every injected `lr` / `*_lr` of `transform`, which must then be built with
        `ps.inject_hyperparams` (`ps.inject_hyperparams(ps.adamw)(lr=3e-4)`). The Trainer
        sets them before each update: `t` is the number of updates applied, or under a
        `time_budget` `progress * steps`, so the schedule runs its course in the budget.
      loss_fn: `loss_fn(model, batch) -> (loss_sum, tokens)`: the loss summed over the
        micro-batch's tokens and their count. Gradients are divided by the token count
        of the whole global batch, so accumulation and data parallelism weight every
        token equally. A plain mean loss (a 0-d tensor) counts as one token per row.
      config: a `TrainConfig`.
      data: an object with `batch(step, rank, world, split="train")` (see `ByteCorpus`).
      out: the run directory (metrics.jsonl, checkpoints/); None keeps nothing on disk.
      ema: an averaging pair such as `ps.params_ema(0.999)`, or None.
      progress: show progress on rank 0: a tqdm bar on a terminal, else a line per log.
    """

    def __init__(
        self,
        model: nn.Module,
        transform: ps.Transform,
        loss_fn: Callable[[nn.Module, Any], Any],
        config: Any,
        *,
        data: Any,
        out: str | Path | None = None,
        lr_schedule: Callable[[Any], Any] | None = None,
        ema: Any = None,
        progress: bool = False,
        device: str | None = None,
    ) -> None:
        self.config, self.data, self.loss_fn, self.lr_schedule = config, data, loss_fn, lr_schedule
        self.out = Path(out) if out is not None else None
        self.progress = progress
        if config.precision == "fp16":
            raise ValueError("precision: 'fp16' needs loss scaling, which the Trainer does not run; use 'bf16'")
        self.world = D.setup(config.strategy, device)
        torch.manual_seed(config.seed)
        self.module = D.wrap(model, self.world, precision=config.precision)
        self.model = torch.compile(self.module) if config.compile else self.module
        self.named = dict(D.unwrap(self.module).named_parameters())
        self.fsdp = self.world.strategy == "fsdp"
        self.transform, self.ema_pair = transform, ema
        # FSDP2 params are DTensors, which foreach copies do not support: update purely, then copy.
        self.update = ps.make_update(transform, compile=config.compile, donate=not self.fsdp, ema=ema)
        params = self.params()
        self.opt_state = transform.init(params)
        self.ema = ema[0](params) if ema is not None else None
        self.base_lrs = self._injected_lrs() if lr_schedule is not None else {}
        flops = getattr(D.unwrap(self.module), "flops_per_token", None)
        self.flops_per_token = flops() if callable(flops) else None
        self.peak_flops = _peak_flops(self.world.device)
        # Progress: batches consumed (the data position), updates applied, and the reliability log.
        self.step, self.updates, self.tokens, self.elapsed = 0, 0, 0, 0.0
        self.recent = collections.deque(maxlen=config.spike_window)
        self.spikes = 0
        self.skip: list[list[int]] = []  # [start, stop) ranges of batches skipped after a rewind
        self.last: dict[str, Any] = {}

    # ------------------------------------------------------------------ #
    # The pieces of a step.
    # ------------------------------------------------------------------ #

    def params(self) -> dict[str, Tensor]:
        return {name: p.detach() for name, p in self.named.items()}

    def _autocast(self) -> contextlib.AbstractContextManager:
        # FSDP2 on CUDA casts through its MixedPrecisionPolicy instead.
        on = self.config.precision == "bf16" and not (self.fsdp and self.world.device.type == "cuda")
        return torch.autocast(self.world.device.type, dtype=torch.bfloat16, enabled=on)

    def _sync(self, last: bool) -> contextlib.AbstractContextManager:
        """Reduce gradients only on the last micro-batch."""
        if self.world.strategy == "ddp" and not last:
            return self.module.no_sync()
        if self.fsdp:
            self.module.set_requires_gradient_sync(last)
        return contextlib.nullcontext()

    def _loss(self, batch: Any) -> tuple[Tensor, Tensor]:
        out = self.loss_fn(self.model, batch)
        if isinstance(out, tuple):
            return out[0], torch.as_tensor(out[1])
        rows = next(t for t in torch.utils._pytree.tree_leaves(batch) if isinstance(t, Tensor)).shape[0]
        return out * rows, torch.tensor(rows)

    def _micro_batches(self, batch: Any) -> list[Any]:
        k = self.config.grad_accum
        leaves, spec = torch.utils._pytree.tree_flatten(batch)
        if any(isinstance(t, Tensor) and t.shape[0] % k for t in leaves):
            raise ValueError(f"grad_accum={k} must divide the per-rank batch size")
        pieces = [t.chunk(k) if isinstance(t, Tensor) else [t] * k for t in leaves]
        return [torch.utils._pytree.tree_unflatten([p[i] for p in pieces], spec) for i in range(k)]

    def _to_device(self, batch: Any) -> Any:
        return torch.utils._pytree.tree_map(
            lambda t: t.to(self.world.device, non_blocking=True) if isinstance(t, Tensor) else t, batch
        )

    def _progress(self) -> float:
        budget = self.config.time_budget
        done = self.step / self.config.steps
        return max(done, self.elapsed / budget) if budget else done

    def _skipped(self, step: int) -> bool:
        return any(a <= step < b for a, b in self.skip)

    # ------------------------------------------------------------------ #
    # One step.
    # ------------------------------------------------------------------ #

    def train_step(self) -> dict[str, Any]:
        """Consume the batch of `self.step` and apply one update (unless the step is skipped)."""
        w, step = self.world, self.step
        if self._skipped(step):
            self.step += 1
            return {"step": self.step, "event": "skip_rewound_batch"}
        batch = self._to_device(self.data.batch(step, w.rank, w.size))
        micro = self._micro_batches(batch)
        loss_sum = torch.zeros((), dtype=torch.float64, device=w.device)
        tokens = torch.zeros((), dtype=torch.float64, device=w.device)
        for i, mb in enumerate(micro):
            with self._sync(i == len(micro) - 1):
                with self._autocast():
                    ls, n = self._loss(mb)
                ls.backward()
            loss_sum += ls.detach().double()
            tokens += n.to(w.device).double()
        grads = {k: p.grad if p.grad is not None else torch.zeros_like(p) for k, p in self.named.items()}
        sq = sum(D.local(g).double().pow(2).sum() for g in grads.values())
        # DDP grads are already identical on every rank; FSDP2 shards add up.
        sq = sq if self.fsdp else sq / w.size
        stats = D.all_reduce_sum(torch.stack([loss_sum, tokens, sq]), w).tolist()
        loss_total, n_tokens, sq_total = stats
        scale = (w.size if w.distributed else 1) / max(n_tokens, 1.0)
        loss, grad_norm = loss_total / max(n_tokens, 1.0), math.sqrt(abs(sq_total)) * scale
        record: dict[str, Any] = {"step": step + 1, "loss": loss, "grad_norm": grad_norm}
        event = self._verdict(loss, grad_norm)
        if event is None:
            with torch.no_grad():
                torch._foreach_mul_([D.local(g) for g in grads.values()], scale)
            self._apply(grads)
            self.recent.append(loss)
            self.spikes = 0
        for p in self.named.values():
            p.grad = None
        self.step += 1
        self.tokens += int(n_tokens)
        if event is not None:
            record["event"] = event
            _log(f"step {step + 1}: {event} (loss {loss:.4g}, grad norm {grad_norm:.4g})")
            if event == "skip_spike" and self.spikes >= self.config.spike_rewind:
                record["rewind"] = self.rewind()
        return record

    def _verdict(self, loss: float, grad_norm: float) -> str | None:
        if not (math.isfinite(loss) and math.isfinite(grad_norm)):
            return "skip_nonfinite"
        k = self.config.spike_factor
        if k > 0 and len(self.recent) == self.recent.maxlen and loss > k * (sum(self.recent) / len(self.recent)):
            self.spikes += 1
            return "skip_spike"
        return None

    def _apply(self, grads: dict[str, Tensor]) -> None:
        if self.lr_schedule is not None:
            t = self._progress() * self.config.steps if self.config.time_budget else self.updates
            factor = self.lr_schedule(t)
            for name, base in self.base_lrs.items():
                self.opt_state = ps.set_hyperparam(self.opt_state, name, base * factor)
        params = self.params()
        extra = (self.ema,) if self.ema_pair is not None else ()
        out = self.update(params, grads, self.opt_state, *extra)
        if self.fsdp:
            D.copy_into_(params, out[0])
        self.opt_state = out[1]
        if self.ema_pair is not None:
            self.ema = out[2]
        self.updates += 1

    def _injected_lrs(self) -> dict[str, float]:
        try:
            hp = ps.tree_get(self.opt_state, "hyperparams")
        except KeyError:
            hp = {}
        lrs = {k: float(v) for k, v in hp.items() if k == "lr" or k.endswith("_lr")}
        if not lrs:
            raise ValueError(
                "lr_schedule needs a transform with an injected lr: build it with "
                "ps.inject_hyperparams(ps.adamw)(lr=...) (the schedule multiplies every injected *lr)"
            )
        return lrs

    def lr(self) -> float | None:
        """The injected lr the last update used (None when the transform injects none)."""
        try:
            return float(ps.tree_get(self.opt_state, "lr"))
        except (KeyError, TypeError, ValueError):
            return None

    # ------------------------------------------------------------------ #
    # Evaluation.
    # ------------------------------------------------------------------ #

    @torch.no_grad()
    def evaluate(self, batches: int | None = None) -> float:
        """Mean loss per token over `batches` validation batches (the same ones every time)."""
        w = self.world
        self.model.eval()
        total = torch.zeros(2, dtype=torch.float64, device=w.device)
        for i in range(batches or self.config.eval_batches):
            batch = self._to_device(self.data.batch(i, w.rank, w.size, split="val"))
            with self._autocast():
                ls, n = self._loss(batch)
            total += torch.stack([ls.double(), n.to(w.device).double()])
        self.model.train()
        loss_sum, n = D.all_reduce_sum(total, w).tolist()
        return loss_sum / max(n, 1.0)

    # ------------------------------------------------------------------ #
    # Checkpoints.
    # ------------------------------------------------------------------ #

    def _trainer_state(self) -> dict[str, Any]:
        return {
            "updates": self.updates, "tokens": self.tokens, "elapsed": self.elapsed,
            "recent": list(self.recent), "spikes": self.spikes, "skip": self.skip,
        }

    def save(self) -> Path | None:
        """Write a checkpoint of this step (collective under FSDP2; rank 0 writes)."""
        if self.out is None:
            return None
        # FSDP2: every rank writes its shards through torch.distributed.checkpoint; the
        # checkpoint still loads whole in one process and on any world size.
        path = None
        if self.world.main or self.fsdp:
            path = ckpt.save_checkpoint(
                ckpt.checkpoint_dir(self.out, self.step), params=self.params(), opt_state=self.opt_state,
                ema=self.ema, step=self.step,
                config=self.config, data_state={"step": self.step, "seed": self.config.seed},
                metadata={"trainer": self._trainer_state(), "world_size": self.world.size},
                keep_last=self.config.keep_last, distributed=self.fsdp,
            )
        D.barrier(self.world)
        return path if self.world.main else None

    def load(self, path: Path) -> None:
        """Restore params, optimizer state, EMA and the loop's position from a checkpoint."""
        params = self.params()
        if self.fsdp and ckpt.read_manifest(path).layout == "dcp":
            # DCP reads this rank's slices of the saved shards, whatever world size wrote them.
            c = ckpt.load_distributed(path, params=params, opt_state=self.opt_state, ema=self.ema)
            D.copy_into_(params, c.params)
            self.opt_state = c.opt_state
            if self.ema is not None:
                self.ema = c.ema
        else:
            c = ckpt.load_checkpoint(path, opt_state_like=self.opt_state, ema_like=self.ema)
            missing = sorted(set(params) - set(c.params))
            if missing:
                raise ckpt.CheckpointError(f"{path}: has no params tensor '{missing[0]}' that the model has")
            D.copy_into_(params, {k: D.shard_like(c.params[k], v) for k, v in params.items()})
            reshard = lambda full, like: torch.utils._pytree.tree_map(D.shard_like, full, like)  # noqa: E731
            self.opt_state = reshard(c.opt_state, self.opt_state)
            if self.ema is not None:
                self.ema = reshard(c.ema, self.ema)
        t = c.manifest.metadata.get("trainer", {})
        self.step, self.updates, self.tokens = c.step, t.get("updates", c.step), t.get("tokens", 0)
        self.elapsed, self.spikes, self.skip = t.get("elapsed", 0.0), t.get("spikes", 0), t.get("skip", [])
        self.recent = collections.deque(t.get("recent", []), maxlen=self.config.spike_window)
        if self.world.size == c.manifest.metadata.get("world_size", 1):
            c.restore_rng()

    def resume(self) -> Path | None:
        """Load the newest checkpoint that loads; a damaged one is reported and skipped."""
        folder = self.out / "checkpoints" if self.out is not None else None
        found = sorted(p for p in folder.iterdir() if (p / ckpt.MANIFEST).is_file()) if folder and folder.is_dir() else []
        for path in reversed(found):
            try:
                self.load(path)
                return path
            except ckpt.CheckpointError as e:
                _log(f"warning: {e}; falling back to the previous checkpoint")
        return None

    def rewind(self) -> dict[str, Any]:
        """Back to the last checkpoint after repeated loss spikes; the batches since are skipped."""
        at = self.step
        path = ckpt.latest_checkpoint(self.out) if self.out is not None else None
        if path is None:
            _log(f"step {at}: repeated loss spikes but no checkpoint to rewind to; skipping on")
            self.spikes = 0
            return {"to": None}
        self.load(path)
        self.skip.append([self.step, at])
        self.spikes = 0
        _log(f"step {at}: repeated loss spikes: rewound to {path.name}, skipping batches {self.step}..{at - 1}")
        return {"to": self.step, "skipped": [self.step, at]}

    # ------------------------------------------------------------------ #
    # The loop.
    # ------------------------------------------------------------------ #

    def _open_run(self, resume: bool) -> None:
        if self.out is None:
            return
        metrics = self.out / "metrics.jsonl"
        held = metrics.exists() or (self.out / "checkpoints").is_dir()
        if held and not resume:
            raise RunDirError(f"{self.out}: already holds a run; pass --resume to continue it or a new --out")
        if resume:
            path = self.resume()
            if path is None and held:
                raise RunDirError(f"{self.out}: no checkpoint that loads; nothing to resume")
            if path is not None and self.world.main:
                _log(f"resumed from {path} at step {self.step}")
        D.barrier(self.world)
        if self.world.main:
            self.out.mkdir(parents=True, exist_ok=True)
            kept = []
            if metrics.exists():  # drop what was logged after the checkpoint we resumed from
                kept = [ln for ln in metrics.read_text().splitlines() if ln.strip() and json.loads(ln)["step"] <= self.step]
            metrics.write_text("".join(ln + "\n" for ln in kept))

    def _write(self, record: dict[str, Any]) -> None:
        if self.out is not None and self.world.main:
            # Strict JSON: a non-finite number is written as its name ("nan", "inf").
            clean = {k: (repr(v) if isinstance(v, float) and not math.isfinite(v) else v) for k, v in record.items()}
            with open(self.out / "metrics.jsonl", "a") as f:
                f.write(json.dumps(clean, allow_nan=False) + "\n")

    def fit(self, *, resume: bool = False) -> dict[str, Any]:
        """Train until `config.steps` batches (or `config.time_budget` seconds); return the last metrics."""
        cfg = self.config
        self._open_run(resume)
        bar = None
        if self.progress and self.world.main and sys.stderr.isatty():
            from tqdm import tqdm

            bar = tqdm(total=cfg.steps, initial=self.step, unit="step", dynamic_ncols=True, leave=True)
        t_log, tokens_log = time.perf_counter(), self.tokens
        self.model.train()
        while self.step < cfg.steps and not (cfg.time_budget and self.elapsed >= cfg.time_budget):
            t0 = time.perf_counter()
            record = self.train_step()
            self.elapsed += time.perf_counter() - t0
            if "event" in record:
                self._write({**record, "time": self.elapsed})
            if bar is not None:
                bar.n = self.step
                bar.refresh()
            if self.step % cfg.log_every == 0 or self.step == cfg.steps:
                now = time.perf_counter()
                tok_s = (self.tokens - tokens_log) / max(now - t_log, 1e-9)
                t_log, tokens_log = now, self.tokens
                log = {"step": self.step, "loss": record.get("loss"), "lr": self.lr(),
                       "grad_norm": record.get("grad_norm"), "tokens_per_s": tok_s, "time": self.elapsed}
                if self.flops_per_token and self.peak_flops:
                    log["mfu"] = self.flops_per_token * tok_s / (self.peak_flops * self.world.size)
                self.last.update(log)
                self._write(log)
                if bar is not None and log["loss"] is not None:
                    bar.set_postfix(loss=f"{log['loss']:.3f}", lr=f"{log['lr'] or 0:.2e}", tok_s=f"{tok_s:.0f}")
                elif self.progress and self.world.main and log["loss"] is not None:  # no terminal: plain lines
                    print(f"step {self.step:5d}  loss {log['loss']:.4f}  lr {log['lr'] or 0:.2e}  "
                          f"grad norm {log['grad_norm']:.3f}  {tok_s:.0f} tok/s", flush=True)
            if cfg.eval_every and self.step % cfg.eval_every == 0:
                self.last["val_loss"] = self.evaluate()
                self._write({"step": self.step, "val_loss": self.last["val_loss"]})
                if self.progress and self.world.main:
                    (bar.write if bar is not None else print)(f"step {self.step:5d}  val loss {self.last['val_loss']:.4f}")
            if cfg.checkpoint_every and self.step % cfg.checkpoint_every == 0:
                self.save()
        if bar is not None:
            bar.close()
        if cfg.checkpoint_every and self.out is not None and self.step % cfg.checkpoint_every:
            self.save()
        return dict(self.last, step=self.step)

    def close(self) -> None:
        D.teardown(self.world)

