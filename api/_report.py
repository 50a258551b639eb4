"""What a run says while it runs: `metrics.jsonl`, progress on the terminal, and stop signals."""

from __future__ import annotations

import json
import math
import os
import signal
import sys
import threading
from pathlib import Path
from typing import Any

from torch import Tensor

from . import distributed as D
from .errors import RunDirError


def log(message: str) -> None:
    """One line on stderr, prefixed `purestep:`."""
    print(f"purestep: {message}", file=sys.stderr, flush=True)


# --------------------------------------------------------------------------- #
# metrics.jsonl
# --------------------------------------------------------------------------- #


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """The records of a `metrics.jsonl`. A torn last line (a run killed mid-write) is
    dropped; a bad line anywhere else is a `RunDirError` naming the file and line."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise RunDirError(f"{path}: no such file; is {path.parent} a purestep run directory?") from None
    lines = text.split("\n")
    records = []
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            if i == len(lines):  # no newline after it: the line being written when the run died
                break
            raise RunDirError(f"{path}:{i}: not a JSON line") from None
        if not isinstance(record, dict) or not isinstance(record.get("step"), int):
            raise RunDirError(f"{path}:{i}: not a metrics record (a JSON object with a 'step')")
        records.append(record)
    return records


def _plain(value: Any) -> Any:
    # Strict JSON: a non-finite number is written as its name ("nan", "inf").
    return repr(value) if isinstance(value, float) and not math.isfinite(value) else value


class MetricsFile:
    """`metrics.jsonl` of a run directory, written by the main rank only (no-op elsewhere)."""

    def __init__(self, path: Path | None, main: bool) -> None:
        self.path = path if main else None

    def keep_until(self, step: int) -> None:
        """Start the file afresh, keeping the records up to `step` (those of the checkpoint resumed from).

        Written to a new file that then replaces the old one (as checkpoints are): a write
        that fails (full disk, file-size limit, a kill) leaves the old records as they were.
        """
        if self.path is None:
            return
        kept = [r for r in read_metrics(self.path) if r["step"] <= step] if self.path.exists() else []
        tmp = self.path.with_name(f".{self.path.name}.tmp-{os.getpid()}")
        try:
            with open(tmp, "w") as f:
                f.write("".join(json.dumps(r) + "\n" for r in kept))
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.path)
        except OSError as e:
            tmp.unlink(missing_ok=True)
            raise RunDirError(
                f"{self.path}: cannot rewrite ({e.strerror}); its records are kept as they were"
            ) from None

    def write(self, record: dict[str, Any]) -> None:
        """Append one record; a `RunDirError` naming the file when it cannot (full disk...)."""
        if self.path is not None:
            line = json.dumps({k: _plain(v) for k, v in record.items()}, allow_nan=False)
            try:
                with open(self.path, "a") as f:
                    f.write(line + "\n")
            except OSError as e:
                raise RunDirError(f"{self.path}: cannot append a record ({e.strerror})") from None


# --------------------------------------------------------------------------- #
# Progress: a tqdm bar on a terminal, plain lines otherwise.
# --------------------------------------------------------------------------- #


class Progress:
    """Progress of the main rank on stderr: a tqdm bar on a terminal, else one line per log."""

    def __init__(self, enabled: bool, total: int, initial: int) -> None:
        self.enabled, self.bar = enabled, None
        if enabled and sys.stderr.isatty():
            from tqdm import tqdm

            self.bar = tqdm(total=total, initial=initial, unit="step", dynamic_ncols=True, leave=True)

    def step(self, step: int) -> None:
        if self.bar is not None:
            self.bar.update(step - self.bar.n)

    def metrics(self, record: dict[str, Any]) -> None:
        if not self.enabled or record.get("loss") is None:
            return
        lr = f"{record['lr']:.2e}" if record.get("lr") is not None else "-"
        norm = f"{record['grad_norm']:.3f}" if record.get("grad_norm") is not None else "-"
        if self.bar is not None:
            self.bar.set_postfix(loss=f"{record['loss']:.3f}", lr=lr, tok_s=f"{record['tokens_per_s']:.0f}")
        else:
            self.line(
                f"step {record['step']:6d}  loss {record['loss']:.4f}  lr {lr}  "
                f"grad norm {norm}  {record['tokens_per_s']:.0f} tok/s"
            )

    def line(self, text: str) -> None:
        if self.enabled:
            (self.bar.write if self.bar is not None else log)(text)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


# --------------------------------------------------------------------------- #
# Stop signals.
# --------------------------------------------------------------------------- #


class StopSignals:
    """While active, SIGTERM (a cluster's notice before it kills), SIGHUP (the terminal or
    ssh session closed) and SIGINT (Ctrl-C) ask the loop to stop after the current step;
    a second Ctrl-C stops at once."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)  # SIGHUP: the terminal or ssh session closed

    def __init__(self, announce: bool) -> None:
        self.announce = announce
        self.signum: int | None = None
        self.previous: dict[int, Any] = {}

    def __enter__(self) -> "StopSignals":
        if threading.current_thread() is threading.main_thread():  # handlers can only be set there
            self.previous = {s: signal.signal(s, self._handle) for s in self.SIGNALS}
        return self

    def _handle(self, signum: int, frame: Any) -> None:
        if self.signum is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.signum = signum
        if self.announce:
            try:  # after SIGHUP the terminal may be gone
                log(
                    f"{signal.Signals(signum).name}: stopping after this step to save a checkpoint (Ctrl-C again: at once)"
                )
            except OSError:
                pass

    def agreed(self, world: Any, log_due: bool) -> bool:
        """Whether to stop now: at once in one process; under torchrun, at a log step, all ranks together."""
        if not world.distributed:
            return self.signum is not None
        if not log_due:
            return False
        import torch

        flag = torch.tensor(float(self.signum is not None), device=world.device)
        return float(D.all_reduce_sum(flag, world)) > 0

    def __exit__(self, *exc: Any) -> None:
        for s, handler in self.previous.items():
            signal.signal(s, handler)


def read(t: Tensor | None) -> float | None:
    """A 0-d device tensor on the host (a sync: only when a log line is due)."""
    return None if t is None else float(t.full_tensor() if D.is_dtensor(t) else t)  # type: ignore[attr-defined]
