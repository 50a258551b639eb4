"""The `purestep` command: `train CONFIG`, `demo`, `plot RUN_DIR`, `inspect CKPT`, `plan CONFIG --world N`.

Errors a user can fix (a bad config field, a missing file, a corrupted checkpoint, a run
directory that holds another run) print one line naming the field or file and exit 2.
Run it data-parallel with `torchrun --nproc_per_node=N $(which purestep) ... --set strategy=fsdp` (or
`--set strategy=hsdp --set replicate=R`: FSDP2 inside R replica groups; `--set strategy=tp`: tensor
parallelism over every rank; `--set strategy=fsdp+tp --set tp=T`: TP within groups of T, FSDP2 over them;
`--set strategy=hsdp+tp --set tp=T --set replicate=R`: TP within groups of T, HSDP over them;
`--set strategy=fsdp --set ep=N`: a mixture-of-experts model's experts split over groups of N).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import sys
from pathlib import Path
from typing import Any, Sequence

import torch

from . import checkpoint as ckpt
from ._report import read_metrics
from .config import DataConfig, ModelConfig, OptimizerConfig, ScheduleConfig, TrainConfig, apply_overrides
from .config import load_config
from .data import decode, encode
from .errors import CheckpointError, ConfigError, RunDirError, UsageError
from .planner import format_plan, plan
from .trainer import Trainer


def demo_config() -> TrainConfig:
    """The demo's recipe: a 4-layer byte-level GPT, Muon + AdamW, warmup + cosine, clipping, EMA."""
    ns_dtype = "bfloat16" if torch.cuda.is_available() else "float32"  # bf16 matmuls are slow on CPU
    return TrainConfig(
        steps=120,
        batch_size=16,
        log_every=10,
        eval_every=50,
        eval_batches=4,
        checkpoint_every=50,
        keep_last=2,
        ema_decay=0.99,
        spike_factor=4.0,
        optimizer=OptimizerConfig(
            name="muon_adamw",
            lr=0.02,
            clip_grad_norm=1.0,
            kwargs={"adamw_lr": 3e-3, "ns_dtype": ns_dtype, "weight_decay": 0.01, "adamw_weight_decay": 0.01},
        ),
        schedule=ScheduleConfig(name="warmup_cosine", final_lr=0.002),  # warmup: 5% of the steps
        model=ModelConfig(n_layer=4, n_head=4, n_embd=128, block_size=128),
        data=DataConfig(source="stdlib", max_bytes=2_000_000),
    )


# --------------------------------------------------------------------------- #
# A run from a config.
# --------------------------------------------------------------------------- #


def build_trainer(cfg: TrainConfig, out: Path | None, *, progress: bool) -> Any:
    """The `Trainer` of `cfg`: model, data and transform built from its sections."""
    return Trainer(config=cfg, out=out, progress=progress)


def _sample(trainer: Any, prompt: str = "def ", n: int = 160) -> str:
    model = trainer.module
    gen = torch.Generator().manual_seed(0)
    model.eval()
    ids = model.generate(encode(prompt).to(trainer.world.device), n, generator=gen)
    model.train()
    return decode(ids)


def run(cfg: TrainConfig, out: Path | None, *, resume: bool, sample: bool = False) -> dict[str, Any]:
    main = int(os.environ.get("RANK", "0")) == 0
    trainer = build_trainer(cfg, out, progress=main)
    try:
        if main:
            n = sum(p.numel() for p in trainer.named.values())
            print(
                f"purestep: {n / 1e6:.2f}M params, {cfg.steps} steps of {cfg.batch_size} x {cfg.model.block_size} "
                f"tokens, {cfg.optimizer.name}, strategy={cfg.strategy}, run dir {out}",
                flush=True,
            )
        first = trainer.evaluate() if sample else None
        summary = trainer.fit(resume=resume)
        if sample:
            text = _sample(trainer)
            last = trainer.evaluate()
            if main:
                print(f"validation loss {first:.3f} -> {last:.3f} (nats per byte; 5.55 is uniform)")
                print("sample:\n" + text)
        if main and out is not None:
            print(f"metrics: {out / 'metrics.jsonl'}   plot: purestep plot {out}")
        return summary
    finally:
        trainer.close()


# --------------------------------------------------------------------------- #
# plot and inspect.
# --------------------------------------------------------------------------- #


def _number(value: Any) -> float:
    """A metric as a float for plotting; a non-finite one ("nan", "inf", written as names) or a missing one is a gap."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return math.nan
    return float(value) if math.isfinite(value) else math.nan


def plot(run_dir: Path, png: Path | None = None) -> Path:
    """Draw loss (and validation loss), lr and grad norm against step into a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = read_metrics(run_dir / "metrics.jsonl")
    train = [r for r in records if r.get("loss") is not None and "event" not in r]
    if not train:
        raise UsageError(f"{run_dir / 'metrics.jsonl'}: holds no logged steps yet")
    val = [r for r in records if "val_loss" in r]
    events = [r for r in records if "event" in r]
    fig, axes = plt.subplots(3, 1, figsize=(7, 8), sharex=True)
    steps = [r["step"] for r in train]
    axes[0].plot(steps, [_number(r["loss"]) for r in train], label="train")
    if val:
        axes[0].plot([r["step"] for r in val], [_number(r["val_loss"]) for r in val], "o-", label="validation")
    for r in events:
        axes[0].axvline(r["step"], color="red", alpha=0.3, lw=1)
    axes[0].set_ylabel("loss")
    axes[0].legend()
    axes[1].plot(steps, [_number(r.get("lr")) for r in train])
    axes[1].set_ylabel("lr")
    axes[2].plot(steps, [_number(r.get("grad_norm")) for r in train])
    axes[2].set_ylabel("grad norm")
    axes[2].set_xlabel("step")
    fig.suptitle(str(run_dir))
    fig.tight_layout()
    png = png or run_dir / "metrics.png"
    fig.savefig(png, dpi=100)
    plt.close(fig)
    return png


def inspect_checkpoint(path: Path) -> int:
    """Print a checkpoint's step, config, files (sha256 status) and tensor table; 1 if a file is damaged."""
    if not path.exists():
        raise UsageError(f"{path}: no such checkpoint or run directory")
    if not (path / ckpt.MANIFEST).is_file():
        found = ckpt.latest_checkpoint(path)
        if found is None:
            raise UsageError(f"{path}: holds no checkpoint (no {ckpt.MANIFEST})")
        path = found
    manifest = ckpt.read_manifest(path)
    print(f"checkpoint {path}")
    print(f"step       {manifest.step}")
    if manifest.layout == "dcp":
        print(f"layout     torch.distributed.checkpoint shards from {manifest.world_size} rank(s)")
    print(f"versions   {json.dumps(manifest.versions)}")
    if manifest.config is not None:
        print(f"config     {json.dumps(manifest.config, sort_keys=True)}")
    if manifest.data_state is not None:
        print(f"data       {json.dumps(manifest.data_state)}")
    bad = 0
    rows: list[tuple[str, str, list[int], str, int]] = []
    for filename, entry in manifest.files.items():
        try:
            ckpt.verify_file(path / filename, entry)
            status = "sha256 ok"
        except CheckpointError as e:
            status, bad = f"DAMAGED: {e}", bad + 1
        print(f"file       {filename:24s} {entry.size:>12,d} bytes  {status}")
        if status != "sha256 ok":
            continue
        for name, shape, dtype in ckpt.read_header(path / filename)[0]:  # CheckpointError if malformed
            rows.append((filename.removesuffix(".safetensors"), name, list(shape), dtype, math.prod(shape)))
    width = max((len(f"{g}/{n}") for g, n, *_ in rows), default=10)
    print(f"\n{'tensor':{width}s}  {'shape':18s} {'dtype':8s} {'elements':>12s}")
    for group, name, dims, dtype, numel in rows:
        print(f"{group + '/' + name:{width}s}  {str(dims):18s} {dtype:8s} {numel:>12,d}")
    print(f"{len(rows)} tensors, {sum(r[4] for r in rows):,d} elements" + (f"; {bad} damaged file(s)" if bad else ""))
    return 1 if bad else 0


# --------------------------------------------------------------------------- #
# The command line.
# --------------------------------------------------------------------------- #


def _version() -> str:
    import purestep

    return purestep.__version__


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="purestep", description="Train with purestep.")
    p.add_argument("--version", action="version", version=f"purestep {_version()}")
    sub = p.add_subparsers(dest="command", required=True)

    def run_flags(q: argparse.ArgumentParser) -> None:
        q.add_argument("--out", type=Path, help="run directory (metrics.jsonl, checkpoints/)")
        q.add_argument("--steps", type=int, help="override the number of steps")
        q.add_argument("--resume", action="store_true", help="continue from the run directory's latest checkpoint")
        q.add_argument(
            "--set",
            dest="overrides",
            action="append",
            default=[],
            metavar="KEY=VALUE",
            help="override a config field, e.g. --set optimizer.lr=1e-3 (repeatable)",
        )

    train = sub.add_parser("train", help="train from a TOML/YAML/JSON config")
    train.add_argument("config", type=Path)
    run_flags(train)
    demo = sub.add_parser("demo", help="train a small GPT on the Python standard library's sources")
    run_flags(demo)
    pl = sub.add_parser("plot", help="plot loss, lr and grad norm of a run to a PNG")
    pl.add_argument("run_dir", type=Path)
    pl.add_argument("--out", type=Path, help="PNG path (default RUN_DIR/metrics.png)")
    ins = sub.add_parser("inspect", help="show a checkpoint's step, config and tensors")
    ins.add_argument("checkpoint", type=Path)
    pn = sub.add_parser(
        "plan", help="plan a run over N ranks on this machine: bytes per rank, collectives, paths (fake ranks)"
    )
    pn.add_argument("config", help="a TOML/YAML/JSON config, or 'demo'")
    pn.add_argument("--world", type=int, required=True, help="the number of ranks to plan for")
    pn.add_argument("--ranks", help="the ranks to plan as, comma-separated (default: the first and the last)")
    pn.add_argument("--per-node", type=int, default=8, help="ranks per node (HSDP's replicas, TP's degree; default 8)")
    pn.add_argument("--json", action="store_true", help="print the report as JSON")
    pn.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                    help="override a config field (repeatable)")  # fmt: skip
    return p


def _demo_out(out: Path | None, resume: bool) -> Path:
    if out is not None:
        return out
    base = Path("runs/demo")
    if resume or int(os.environ.get("WORLD_SIZE", "1")) > 1 or not base.exists():
        return base
    i = 2
    while Path(f"{base}-{i}").exists():
        i += 1
    return Path(f"{base}-{i}")


def _main(argv: Sequence[str] | None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "plot":
        print(plot(args.run_dir, args.out))
        return 0
    if args.command == "inspect":
        return inspect_checkpoint(args.checkpoint)
    if args.command == "plan":
        if args.config == "demo":
            cfg = apply_overrides(demo_config(), args.overrides)
        else:
            cfg = load_config(Path(args.config), args.overrides)
        ranks = None
        if args.ranks:
            try:
                ranks = [int(r) for r in args.ranks.split(",")]
            except ValueError:
                raise UsageError(f"--ranks {args.ranks!r}: comma-separated rank numbers, e.g. 0,4095") from None
        report = plan(cfg, args.world, ranks=ranks, per_node=args.per_node)
        print(json.dumps(report, indent=1) if args.json else format_plan(report))
        return 0
    overrides = list(args.overrides) + ([f"steps={args.steps}"] if args.steps is not None else [])
    if args.command == "train":
        cfg = load_config(args.config, overrides)
        out = args.out or Path("runs") / args.config.stem
    else:
        cfg = apply_overrides(demo_config(), overrides)
        out = _demo_out(args.out, args.resume)
    run(cfg, out, resume=args.resume, sample=args.command == "demo")
    return 0


def main(argv: Sequence[str] | None = None) -> None:
    """Entry point of the `purestep` console script."""
    try:
        code = _main(argv)
    except BrokenPipeError:
        # Whoever read our output has gone (`purestep inspect ... | head`): stop quietly, as a
        # program killed by SIGPIPE does, and keep the interpreter from flushing into the pipe.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        code = 128 + signal.SIGPIPE
    except (ConfigError, UsageError, RunDirError, CheckpointError) as e:
        print(f"purestep: error: {e}", file=sys.stderr)
        code = 2
    except OSError as e:  # disk full, a read-only directory...: the path and the reason
        print(
            f"purestep: error: {e.filename}: {e.strerror}" if e.filename else f"purestep: error: {e}", file=sys.stderr
        )
        code = 2
    except ValueError as e:  # core validation (hyperparameters), named by the message
        print(f"purestep: error: {e}", file=sys.stderr)
        code = 2
    except KeyboardInterrupt:
        print("purestep: interrupted", file=sys.stderr)
        code = 130
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        leave(code)
    sys.exit(code)


def leave(code: int) -> None:
    """End a torchrun rank now, its files and streams flushed and its process group gone:
    the C++ teardown of torch.distributed at interpreter exit can abort a rank whose run
    finished ("terminate called without an active exception", seen with gloo on torch 2.13),
    which torchrun would report as a failure."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
