"""Run configuration: frozen msgspec Structs, loaded from TOML, YAML or JSON, with `key.sub=value` overrides.

Every error is a `ConfigError` that carries the dotted field path (`error.field`) and
where the bad value came from (`error.source`: the file, or the `--set` override).
Names in the optimizer and schedule sections are resolved through `purestep.core`'s
public names when the transform is built, so a new optimizer needs no registration here.
"""

from __future__ import annotations

import json
import typing
from pathlib import Path
from typing import Any, Annotated, Iterable, Literal, Union

import msgspec
from msgspec import Meta

import purestep.core as ps

from ._build import build_optimizer, build_schedule
from ._sections import DataConfig, DiLoCoConfig, ModelConfig, OptimizerConfig, ScheduleConfig, _Section
from ._sections import NonNegativeFloat, NonNegativeInt, PositiveInt
from ._config_files import read_config_file
from .errors import ConfigError as ConfigError


class TrainConfig(_Section):  # type: ignore[misc]  # msgspec's frozen Struct, not a dataclass
    """A training run. The `Trainer` reads every field; the command adds only `--out`,
    `--steps`, `--resume` and `--set`.

    The loop: `steps` optimizer steps (or `time_budget` seconds, None: no limit) of
    `batch_size` rows, the global batch over all ranks, split into `grad_accum`
    micro-batches; `seed` seeds the model's init and the data. Metrics every `log_every`
    steps; evaluation on `eval_batches` validation batches every `eval_every` steps (0:
    never); a checkpoint every `checkpoint_every` steps (0: only at the end; a finished
    run always has one), of which `keep_last` are kept; with `async_checkpoint` a save
    blocks the loop only while the state is copied to host memory, and is written in the
    background (see `CheckpointManager`'s `background`). `strategy`, `precision` and
    `compile` say how it runs; `ema_decay` keeps an EMA of the params (None: none).

    `strategy`: "single", "ddp", "fsdp" (FSDP2 over every rank) or "hsdp" (FSDP2 inside
    each of `replicate` groups of ranks, the groups replicas of each other: a
    (replicate, shard) mesh; 0 takes one replica per node, torchrun's ranks / its
    LOCAL_WORLD_SIZE), "tp" (tensor parallelism over every rank: the model's `tp_plan`,
    the built-in GPT's torchtitan plan, splits each block's projections by heads and
    hidden units; every rank sees the whole batch) or "fsdp+tp" (tensor parallelism within
    groups of `tp` ranks, 0: one group per node, and FSDP2 over the groups: a (dp, tp)
    mesh) or "hsdp+tp" (tensor parallelism within groups of `tp` ranks and HSDP over the
    groups, `replicate` replicas of them: a (replicate, shard, tp) mesh). Every
    data-parallel rank takes its own part of each batch on all of them.
    Under "hsdp", `shard_state_over_replicas` (on by default) keeps 1/`replicate` of each
    rank's block of the optimizer state (and EMA) per rank: the replicas split the state
    instead of each holding all of it. FSDP2 then shards within each replica only, and the
    update averages the replicas' grads (a reduce_scatter) and gathers the params (an
    all_gather): the bytes across replicas of HSDP's all-reduce (`ps.make_update`'s
    `shard_state_over_replicas`). The first metrics line says the `state_bytes` this rank holds.
    Under "fsdp", `ep` = N > 1 splits a mixture-of-experts model's experts over groups of N
    ranks (the model's `ep_plan`; the built-in GPT with `model.kwargs` experts): each rank
    holds E/N experts, token slots travel to their expert's rank and back (all_to_all), FSDP2
    shards the experts over the ranks / N groups and everything else over every rank.

    `precision`: "fp32"; "bf16" (alias "bf16-mixed"): float32 params, forward and
    backward under bf16 autocast; "bf16-true": the model's params (and floating buffers
    and inputs) in bf16, no autocast, `ps.compensated_updates()` chained last in the
    transform so updates below bf16's precision accumulate (its Kahan buffer is in the
    optimizer state and the checkpoints); moments then follow the params' dtype (bf16,
    rounded stochastically) unless `optimizer.kwargs.mu_dtype`/`nu_dtype` say otherwise,
    and the EMA is kept in float32. "fp16" is refused (it needs loss scaling), and so
    is "bf16-true" under `strategy = "fsdp"`. A step whose loss exceeds
    `spike_factor` x the mean of the last `spike_window` accepted losses is skipped (0:
    never; on, it reads the loss every step), and `spike_rewind` such spikes in a row
    rewind to the last checkpoint.

    The sections describe the objects the `Trainer` builds when it is not given them:
    `optimizer` + `schedule` the transform, `model` the GPT, `data` the corpus. Given an
    object (`transform=`, `model=`, `data=`), a section changed from its defaults would
    be ignored, so it is refused (a `ConfigError` naming the field); the one exception is
    `optimizer.clip_grad_norm`, which the Trainer chains in front of a given transform. The
    `diloco` section wraps whichever transform runs in DiLoCo's outer loop (`DiLoCoConfig`).

    Examples:
        >>> from purestep.api import TrainConfig, apply_overrides
        >>> cfg = apply_overrides(TrainConfig(), ["optimizer.lr=1e-3", "strategy=ddp"])
        >>> cfg.optimizer.lr, cfg.strategy
        (0.001, 'ddp')
    """

    steps: PositiveInt = 1000
    seed: Annotated[int, Meta(ge=0, lt=1 << 32)] = 0
    batch_size: PositiveInt = 32
    grad_accum: PositiveInt = 1
    checkpoint_every: NonNegativeInt = 0
    keep_last: Union[PositiveInt, None] = 3
    async_checkpoint: bool = False
    log_every: PositiveInt = 10
    eval_every: NonNegativeInt = 0
    time_budget: Union[Annotated[float, Meta(gt=0)], None] = None
    strategy: Literal["single", "ddp", "fsdp", "hsdp", "tp", "fsdp+tp", "hsdp+tp"] = "single"
    replicate: NonNegativeInt = 0
    shard_state_over_replicas: bool = True
    tp: NonNegativeInt = 0
    ep: NonNegativeInt = 0
    precision: Literal["fp32", "bf16", "bf16-mixed", "bf16-true", "fp16"] = "fp32"
    compile: bool = False
    ema_decay: Union[Annotated[float, Meta(gt=0, lt=1)], None] = None
    eval_batches: PositiveInt = 4
    spike_factor: NonNegativeFloat = 0.0
    spike_window: PositiveInt = 20
    spike_rewind: PositiveInt = 3
    optimizer: OptimizerConfig = OptimizerConfig()
    schedule: ScheduleConfig = ScheduleConfig()
    model: ModelConfig = ModelConfig()
    data: DataConfig = DataConfig()
    diloco: DiLoCoConfig = DiLoCoConfig()

    def __post_init__(self) -> None:
        if self.batch_size % self.grad_accum:
            raise ConfigError("grad_accum", f"{self.grad_accum} does not divide batch_size={self.batch_size}")
        if self.model.n_embd % self.model.n_head:
            raise ConfigError(
                "model.n_embd", f"{self.model.n_embd} is not divisible by model.n_head={self.model.n_head}"
            )
        if self.precision == "fp16":
            raise ConfigError("precision", "'fp16' needs loss scaling, which the Trainer does not run; use 'bf16'")
        if self.precision == "bf16-true" and self.strategy in ("fsdp", "hsdp", "fsdp+tp", "hsdp+tp"):
            raise ConfigError(
                "precision",
                f"'bf16-true' is not supported with strategy='{self.strategy}' (FSDP2 keeps "
                "float32 sharded params and casts them to bf16 for compute itself); use precision='bf16'",
            )
        if self.diloco.sync_every is not None and self.strategy not in ("single", "ddp", "hsdp"):
            raise ConfigError(
                "diloco.sync_every",
                f"DiLoCo's workers are the ranks of strategy='ddp', the replicas of 'hsdp' (or the one process "
                f"of 'single'); strategy='{self.strategy}' is not built for it",
            )
        d = self.diloco
        if d.sync_every is not None and d.sync_every % d.fragments:
            raise ConfigError("diloco.fragments", f"{d.fragments} does not divide diloco.sync_every={d.sync_every}")
        if d.sync_every is not None and d.delay >= d.sync_every // d.fragments:
            raise ConfigError(
                "diloco.delay",
                f"{d.delay} is not below sync_every / fragments = {d.sync_every // d.fragments} (a fragment's "
                "outer step must land before the next fragment's sync)",
            )
        if self.replicate and self.strategy not in ("hsdp", "hsdp+tp"):
            raise ConfigError(
                "replicate",
                f"{self.replicate} replicas asked for, but strategy='{self.strategy}'; "
                "the replicate degree is HSDP's (strategy='hsdp' or 'hsdp+tp')",
            )
        if self.ep > 1 and self.strategy != "fsdp":
            raise ConfigError(
                "ep",
                f"an expert-parallel degree of {self.ep} asked for, but strategy='{self.strategy}'; "
                "expert parallelism is built beside strategy='fsdp'",
            )
        if self.tp and self.strategy not in ("tp", "fsdp+tp", "hsdp+tp"):
            raise ConfigError(
                "tp",
                f"a tensor-parallel degree of {self.tp} asked for, but strategy='{self.strategy}'; "
                "set strategy='tp', 'fsdp+tp' or 'hsdp+tp'",
            )

    @property
    def autocast(self) -> bool:
        """Whether the forward and backward run under bf16 autocast ("bf16" or "bf16-mixed")."""
        return self.precision in ("bf16", "bf16-mixed")

    @property
    def bf16_params(self) -> bool:
        """Whether the params themselves are bf16, updated with compensation ("bf16-true")."""
        return self.precision == "bf16-true"

    def build_schedule(self) -> Any:
        """The lr: `optimizer.lr`, or a `ps.*_schedule` of it as the schedule section says."""
        return build_schedule(self.schedule, self.optimizer.lr, self.steps)

    def build_optimizer(self) -> ps.Transform:
        """The transform the optimizer and schedule sections describe, the one the Trainer runs.

        Built with `ps.inject_hyperparams`, the schedule inside: the lr of the last update
        is `ps.get_hyperparams(state)["lr"]`, and `Optimizer` param groups expose it.
        """
        return build_optimizer(self.optimizer, self.build_schedule())


# --------------------------------------------------------------------------- #
# From plain data: locating the bad field.
# --------------------------------------------------------------------------- #


def _is_struct(tp: Any) -> bool:
    return isinstance(tp, type) and issubclass(tp, msgspec.Struct)


def _fields(cls: Any) -> dict[str, Any]:
    return {f.name: f.type for f in msgspec.structs.fields(cls)}


def _locate(data: dict[str, Any], cls: Any, prefix: str = "") -> ConfigError | None:
    """The first field of `data` that `cls` rejects, found field by field."""
    fields = _fields(cls)
    for key in data:
        if key not in fields:
            return ConfigError(prefix + key, f"unknown field (fields: {', '.join(fields)})")
    for key, value in data.items():
        if _is_struct(fields[key]) and isinstance(value, dict):
            found = _locate(value, fields[key], f"{prefix}{key}.")
            if found is not None:
                return found
            continue
        try:
            msgspec.convert(value, fields[key])
        except msgspec.ValidationError as e:
            return ConfigError(prefix + key, str(e))
    return None


def _convert(data: Any, source: str | None) -> TrainConfig:
    if not isinstance(data, dict):
        raise ConfigError("", f"expected a table of fields, got {type(data).__name__}", source)
    try:
        config = msgspec.convert(data, TrainConfig)
    except msgspec.ValidationError as e:
        if isinstance(e.__cause__, ConfigError):  # raised by __post_init__, with its field
            raise e.__cause__.at(source) from None
        raise (_locate(data, TrainConfig) or ConfigError("", str(e))).at(source) from None
    # The config stays data: its optimizer and schedule are built here once, as a check of
    # their names and arguments when the file or overrides are read (not at step 1).
    try:
        config.build_optimizer()
    except ConfigError as e:
        raise e.at(source) if source is not None else e from None
    return config


# --------------------------------------------------------------------------- #
# Overrides.
# --------------------------------------------------------------------------- #


def _accepts_str(tp: Any) -> bool:
    origin = typing.get_origin(tp)
    if tp is str:
        return True
    if origin is Annotated:
        return _accepts_str(typing.get_args(tp)[0])
    if origin is Literal:
        return all(isinstance(a, str) for a in typing.get_args(tp))
    if origin is Union:
        return any(_accepts_str(a) for a in typing.get_args(tp) if a is not type(None))
    return False


def _parse_value(text: str, tp: Any) -> Any:
    if text.lower() in ("none", "null"):
        return None
    if _accepts_str(tp):
        return text
    if text in ("True", "False"):
        return text == "True"
    try:
        return json.loads(text)
    except ValueError:
        return text  # a bare word for a dict entry (kwargs.mask=decay_mask); the schema checks the rest


def _set(data: dict[str, Any], override: str) -> None:
    key, sep, text = override.partition("=")
    key = key.strip()
    if not sep or not key:
        raise ConfigError("", "expected key.sub=value")
    parts = key.split(".")
    cls: Any = TrainConfig
    node = data
    for i, part in enumerate(parts):
        here = ".".join(parts[: i + 1])
        fields = _fields(cls)
        if part not in fields:
            raise ConfigError(here, f"unknown field (fields: {', '.join(fields)})")
        tp, last = fields[part], i == len(parts) - 1
        if last:
            node[part] = _parse_value(text.strip(), tp)
            return
        if not _is_struct(tp) and typing.get_origin(tp) is not dict:
            raise ConfigError(key, f"{here} is a value, not a table")
        if not isinstance(node.get(part), dict):  # an earlier override made it null or a number
            raise ConfigError(here, f"is {node.get(part)!r}, not a table, so {key} cannot be set; set the whole table")
        if _is_struct(tp):
            node, cls = node[part], tp
            continue
        node[part][".".join(parts[i + 1 :])] = _parse_value(text.strip(), Any)  # a kwargs entry
        return


def _touches(override: str, field: str) -> bool:
    key = override.partition("=")[0].strip()
    return key == field or field.startswith(key + ".") or key.startswith(field + ".")


def apply_overrides(config: TrainConfig, overrides: Iterable[str]) -> TrainConfig:
    """A new config with `key.sub=value` overrides applied, each value parsed to its field's type.

    A `ConfigError` from an override says it came from `--set <override>` (every
    override, when the bad field is none of theirs: `--set batch_size=10` breaking `grad_accum`).
    """
    overrides, data = list(overrides), msgspec.to_builtins(config)
    for override in overrides:
        try:
            _set(data, override)
        except ConfigError as e:
            raise e.at(f"--set {override}") from None
    try:
        return _convert(data, None)
    except ConfigError as e:
        culprits = [o for o in overrides if _touches(o, e.field)][-1:] or overrides
        raise e.at(" ".join(f"--set {o}" for o in culprits)) from None


def load_config(path: str | Path, overrides: Iterable[str] = ()) -> TrainConfig:
    """Load a `TrainConfig` from a `.toml`, `.yaml`/`.yml` or `.json` file, then apply `overrides`.

    Raises `ConfigError` naming the field and its source: the file, or the override.
    """
    return apply_overrides(_convert(read_config_file(Path(path)), str(path)), overrides)


# --------------------------------------------------------------------------- #
# What the Trainer reads.
# --------------------------------------------------------------------------- #


def refuse_ignored(config: TrainConfig, given: dict[str, Any]) -> None:
    """Refuse a field the `Trainer` would ignore: a section whose object it was given
    (`transform=` for optimizer and schedule, `model=`, `data=`), or `ema_decay` with
    `ema=`. `given` maps those argument names to the objects (None: not given)."""
    sections = {"transform": ("optimizer", "schedule"), "model": ("model",), "data": ("data",)}
    defaults = TrainConfig()
    for arg, names in sections.items():
        if given[arg] is None:
            continue
        for name in names:
            ours, default = msgspec.to_builtins(getattr(config, name)), msgspec.to_builtins(getattr(defaults, name))
            if name == "optimizer":  # honoured for a given transform too
                ours.pop("clip_grad_norm"), default.pop("clip_grad_norm")
            for key in ours:
                if ours[key] != default[key]:
                    raise ConfigError(
                        f"{name}.{key}",
                        f"set in the config, but the Trainer was given {arg}=, which "
                        f"replaces the [{name}] section; leave it at its default or drop {arg}=",
                    )
    if given["ema"] is not None and config.ema_decay is not None:
        raise ConfigError("ema_decay", "set in the config and ema= given too; keep one")


# --------------------------------------------------------------------------- #
# Resuming with changed settings.
# --------------------------------------------------------------------------- #

# A resumed run keeps what decides its data stream, its model and its optimizer's kind
# (and the state they shape); anything else changed since the checkpoint is applied.
_KEPT_ON_RESUME = ("seed", "batch_size", "model", "data", "optimizer.name")


def _flat(tree: Any, prefix: str = "") -> dict[str, Any]:
    if not isinstance(tree, dict):
        return {prefix: tree}
    out: dict[str, Any] = {}
    for k, v in tree.items():
        out.update(_flat(v, f"{prefix}.{k}" if prefix else str(k)))
    return out


def resume_changes(saved: dict[str, Any] | None, config: TrainConfig, step: int) -> list[str]:
    """What a resume at `step` from a checkpoint whose config was `saved` (plain data)
    does with the fields `config` changes, one message each; a `ConfigError` for a
    field a resumed run keeps (the data stream, the model, the optimizer's kind)."""
    if saved is None:
        return []
    old, new = _flat(saved), _flat(msgspec.to_builtins(config))
    defaults = _flat(msgspec.to_builtins(TrainConfig()))
    messages = []
    for field in sorted(old.keys() | new.keys()):
        before, after = old.get(field), new.get(field)
        if before == after or (field not in old and after == defaults.get(field, before)):
            continue  # unchanged, or a field newer than the checkpoint, left at its default
        kept = any(field == k or field.startswith(k + ".") for k in _KEPT_ON_RESUME)
        # bf16-true changes the params' dtype and the optimizer state's structure (the Kahan buffer).
        kept = kept or (field == "precision" and (before == "bf16-true") != (after == "bf16-true"))
        if kept or (field == "ema_decay" and (before is None) != (after is None)):
            raise ConfigError(
                field,
                f"changed from {before!r} to {after!r} since the checkpoint; a resumed run "
                "keeps it (set it back, or start a new run in another directory)",
            )
        note = "applied"
        if field == "steps" and config.schedule.name != "constant":
            lr_was = float(msgspec.convert(saved, TrainConfig).build_schedule()(step))
            note = f"reshapes the lr schedule: the lr at step {step} is {float(config.build_schedule()(step)):.3g}, was {lr_was:.3g}"
        said = ["unset" if field not in side else repr(side[field]) for side in (old, new)]
        messages.append(f"{field} changed from {said[0]} to {said[1]}: {note}")
    return messages
