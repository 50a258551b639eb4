"""Run configuration: frozen msgspec Structs, loaded from TOML, YAML or JSON, with `key.sub=value` overrides.

Every error names the field path (`optimizer.lr: Expected float >= 0.0`). Names in the
optimizer and schedule sections are resolved through `purestep.core`'s public names when
the transform is built, so a new optimizer needs no registration here.
"""

from __future__ import annotations

import inspect
import json
import re
import typing
from pathlib import Path
from typing import Any, Annotated, Iterable, Literal, Union

import msgspec
import torch
from msgspec import Meta

import purestep.core as ps

PositiveInt = Annotated[int, Meta(ge=1)]
NonNegativeInt = Annotated[int, Meta(ge=0)]
NonNegativeFloat = Annotated[float, Meta(ge=0)]


class ConfigError(ValueError):
    """A config that cannot be loaded; the message starts with the field path (and file)."""


class _Section(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    pass


class OptimizerConfig(_Section):
    """`[optimizer]`: any purestep optimizer by its public name, e.g. `adamw`, `muon_adamw`.

    `kwargs` are its keyword arguments (`weight_decay`, `betas`...); a string naming a
    public purestep function passes that function (`mask = "decay_mask"`), a string for
    a `*dtype` argument names a torch dtype (`ns_dtype = "bfloat16"`). `lr` is the peak
    learning rate the schedule shapes; `clip_grad_norm` chains `ps.clip_by_global_norm`
    in front (None: no clipping).
    """

    name: str = "adamw"
    lr: NonNegativeFloat = 3e-4
    kwargs: dict[str, Any] = {}
    clip_grad_norm: Union[Annotated[float, Meta(gt=0)], None] = 1.0


class ScheduleConfig(_Section):
    """`[schedule]`: the lr schedule, `ps.<name>_schedule` (`"constant"`: a fixed lr).

    The schedule's first argument (`value`/`init`/`peak`) is `optimizer.lr`; `steps` /
    `total_steps` are the run's `steps`; `warmup_steps` (None: 5% of the steps),
    `decay_steps` and `final_lr` go to the arguments of those names (`final`, `end`);
    `kwargs` holds any other argument.
    """

    name: str = "constant"
    warmup_steps: Union[NonNegativeInt, None] = None
    decay_steps: Union[NonNegativeInt, None] = None
    final_lr: NonNegativeFloat = 0.0
    kwargs: dict[str, Any] = {}


class ModelConfig(_Section):
    """`[model]`: a GPT-style model (the demo's); `kwargs` for a model of your own."""

    name: str = "gpt"
    vocab_size: PositiveInt = 256
    block_size: PositiveInt = 128
    n_layer: PositiveInt = 4
    n_head: PositiveInt = 4
    n_embd: PositiveInt = 128
    dropout: Annotated[float, Meta(ge=0, lt=1)] = 0.0
    kwargs: dict[str, Any] = {}

    def __post_init__(self) -> None:
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd: {self.n_embd} is not divisible by n_head={self.n_head}")


class DataConfig(_Section):
    """`[data]`: `source = "stdlib"` (the Python standard library's sources, on every
    machine) or a path to a text file or directory."""

    source: str = "stdlib"
    max_bytes: Union[PositiveInt, None] = 2_000_000
    val_fraction: Annotated[float, Meta(ge=0, lt=1)] = 0.05
    kwargs: dict[str, Any] = {}


class TrainConfig(_Section):
    """A training run.

    `steps` optimizer steps of `batch_size` sequences (the global batch, split into
    `grad_accum` micro-batches); a checkpoint every `checkpoint_every` steps (0: only at
    the end), of which `keep_last` are kept; metrics every `log_every` steps; evaluation
    every `eval_every` steps (0: never); `time_budget` seconds (None: no limit);
    `ema_decay` keeps an EMA of the params (None: none). Evaluation averages
    `eval_batches` validation batches. A step whose loss exceeds `spike_factor` x the
    mean of the last `spike_window` accepted losses is skipped (0: never), and
    `spike_rewind` such spikes in a row rewind to the last checkpoint.

    Example:
        >>> from purestep.api import TrainConfig, apply_overrides
        >>> cfg = apply_overrides(TrainConfig(), ["optimizer.lr=1e-3", "strategy=ddp"])
        >>> cfg.optimizer.lr, cfg.strategy
        (0.001, 'ddp')
    """

    steps: PositiveInt = 1000
    seed: int = 0
    batch_size: PositiveInt = 32
    grad_accum: PositiveInt = 1
    checkpoint_every: NonNegativeInt = 0
    keep_last: Union[PositiveInt, None] = 3
    log_every: PositiveInt = 10
    eval_every: NonNegativeInt = 0
    time_budget: Union[Annotated[float, Meta(gt=0)], None] = None
    strategy: Literal["single", "ddp", "fsdp"] = "single"
    precision: Literal["fp32", "bf16", "fp16"] = "fp32"
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

    def __post_init__(self) -> None:
        if self.batch_size % self.grad_accum:
            raise ValueError(f"grad_accum: {self.grad_accum} does not divide batch_size={self.batch_size}")
        self.build_optimizer()  # names and arguments are checked now, not at step 1

    def build_schedule(self) -> Any:
        """The lr: `optimizer.lr`, or a `ps.*_schedule` of it as the schedule section says."""
        return build_schedule(self.schedule, self.optimizer.lr, self.steps)

    def build_optimizer(self, *, inject: bool = True) -> ps.Transform:
        """The purestep transform the optimizer and schedule sections describe.

        With `inject` (the default) it is built with `ps.inject_hyperparams`, so the lr
        in use is `ps.tree_get(state, "lr")` and `Optimizer` param groups expose it.
        """
        return build_optimizer(self.optimizer, self.build_schedule(), inject=inject)


# --------------------------------------------------------------------------- #
# Building transforms from sections.
# --------------------------------------------------------------------------- #


def _public(name: str, what: str, field: str) -> Any:
    if name not in ps.__all__ or not callable(getattr(ps, name, None)):
        raise ValueError(f"{field}: {name!r} is not a public purestep.core {what}")
    return getattr(ps, name)


def _argument(name: str, value: Any, field: str) -> Any:
    if isinstance(value, list):
        return tuple(_argument(name, v, field) for v in value)
    if isinstance(value, str) and (name in ("mask", "labels") or name.endswith(("_mask", "_labels"))):
        return _public(value, "function", field)
    if isinstance(value, str) and name.endswith("dtype"):
        dtype = getattr(torch, value, None)
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"{field}: {value!r} is not a torch dtype (e.g. 'bfloat16', 'float32')")
        return dtype
    return value


def _field_of(error: Exception, section: str, names: dict[str, str]) -> str:
    """Turn a core ValueError ('weight_decay must be >= 0, got -1') into 'section.kwargs.weight_decay: ...'."""
    message = str(error)
    match = re.match(r"([A-Za-z_]\w*)(\[\d+\])?", message)
    if match and match.group(1) in names:
        return f"{names[match.group(1)]}{match.group(2) or ''}: {message}"
    return f"{section}: {message}"


def build_schedule(section: ScheduleConfig, lr: float, steps: int) -> Any:
    """`ps.<section.name>_schedule` with its first argument `lr`, or `lr` for "constant"."""
    if section.name == "constant" and not section.kwargs:
        return lr
    name = section.name if section.name.endswith("_schedule") else f"{section.name}_schedule"
    if name not in ps.__all__:
        known = sorted(n[: -len("_schedule")] for n in ps.__all__ if n.endswith("_schedule"))
        raise ValueError(f"schedule.name: {section.name!r} is not a purestep schedule; one of {known}")
    factory = getattr(ps, name)
    params = list(inspect.signature(factory).parameters)
    kwargs: dict[str, Any] = {params[0]: lr}
    fields = {params[0]: "optimizer.lr"}
    warmup = section.warmup_steps if section.warmup_steps is not None else steps // 20
    offered = {
        "steps": (steps, "steps"),
        "total_steps": (steps, "steps"),
        "warmup_steps": (warmup, "schedule.warmup_steps"),
        "decay_steps": (section.decay_steps, "schedule.decay_steps"),
        "final": (section.final_lr, "schedule.final_lr"),
        "end": (section.final_lr, "schedule.final_lr"),
    }
    for arg, (value, field) in offered.items():
        if arg in params and value is not None:
            kwargs[arg] = value
            fields[arg] = field
    used = set(fields.values())
    for field, value, default in (
        ("warmup_steps", section.warmup_steps, None),
        ("decay_steps", section.decay_steps, None),
        ("final_lr", section.final_lr, 0.0),
    ):
        if value != default and f"schedule.{field}" not in used:
            raise ValueError(f"schedule.{field}: {name} takes no such argument")
    for arg, value in section.kwargs.items():
        if arg not in params or arg == params[0]:
            raise ValueError(f"schedule.kwargs.{arg}: {name} has no argument {arg!r} (it takes {params[1:]})")
        kwargs[arg] = _argument(arg, value, f"schedule.kwargs.{arg}")
        fields[arg] = f"schedule.kwargs.{arg}"
    missing = [p for p, v in inspect.signature(factory).parameters.items() if v.default is v.empty and p not in kwargs]
    if missing:
        field = offered[missing[0]][1] if missing[0] in offered else f"schedule.kwargs.{missing[0]}"
        raise ValueError(f"{field}: {name} needs {missing[0]!r}; set it in the config")
    try:
        return factory(**kwargs)
    except (ValueError, TypeError) as e:
        raise ValueError(_field_of(e, "schedule", fields)) from None


def build_optimizer(section: OptimizerConfig, lr: Any = None, *, inject: bool = True) -> ps.Transform:
    """`ps.<section.name>(lr=lr, **section.kwargs)`, behind `ps.clip_by_global_norm` if asked."""
    factory = _public(section.name, "optimizer", "optimizer.name")
    params = inspect.signature(factory).parameters
    if "lr" not in params:
        raise ValueError(f"optimizer.name: {section.name!r} is not a purestep optimizer (it takes no lr)")
    kwargs = {}
    fields = {"lr": "optimizer.lr"}
    for arg, value in section.kwargs.items():
        if arg == "lr":
            raise ValueError("optimizer.kwargs.lr: set optimizer.lr instead")
        if arg not in params:
            raise ValueError(
                f"optimizer.kwargs.{arg}: {section.name} has no argument {arg!r} "
                f"(it takes {[p for p in params if p != 'lr']})"
            )
        kwargs[arg] = _argument(arg, value, f"optimizer.kwargs.{arg}")
        fields[arg] = f"optimizer.kwargs.{arg}"
    lr = section.lr if lr is None else lr
    try:
        transform = (ps.inject_hyperparams(factory) if inject else factory)(lr=lr, **kwargs)
    except (ValueError, TypeError) as e:
        raise ValueError(_field_of(e, "optimizer", fields)) from None
    if not isinstance(transform, ps.Transform):
        raise ValueError(f"optimizer.name: {section.name!r} is not a purestep optimizer")
    if section.clip_grad_norm is not None:
        transform = ps.chain(ps.clip_by_global_norm(section.clip_grad_norm), transform)
    return transform


# --------------------------------------------------------------------------- #
# Loading and overriding.
# --------------------------------------------------------------------------- #


def _yaml_loader() -> Any:
    import yaml

    class Loader(yaml.SafeLoader):
        pass

    # YAML 1.1 reads `1e-3` (no dot) as a string; read it as a float, as TOML and JSON do.
    exponent_only = re.compile(r"^[-+]?\d[\d_]*[eE][-+]?\d+$")
    Loader.add_implicit_resolver("tag:yaml.org,2002:float", exponent_only, list("-+0123456789"))
    return Loader


def _read(path: Path) -> Any:
    if not path.is_file():
        raise ConfigError(f"{path}: no such config file")
    data = path.read_bytes()
    suffix = path.suffix.lower()
    try:
        if suffix == ".toml":
            return msgspec.toml.decode(data)
        if suffix in (".yaml", ".yml"):
            import yaml

            return yaml.load(data, Loader=_yaml_loader()) or {}
        if suffix == ".json":
            return msgspec.json.decode(data)
    except Exception as e:  # each parser has its own error type
        raise ConfigError(f"{path}: not valid {suffix[1:].upper()}: {e}") from None
    raise ConfigError(f"{path}: unknown config format {suffix!r}; use .toml, .yaml, .yml or .json")


def _describe(error: msgspec.ValidationError) -> str:
    """msgspec's 'Expected `int`, got `str` - at `$.optimizer.lr`' as 'optimizer.lr: Expected `int`, got `str`'."""
    message = str(error)
    match = re.match(r"^(.*) - at `\$(.*)`$", message, re.S)
    detail, path = (match.group(1), match.group(2)) if match else (message, "")
    path = re.sub(r"\[(\d+)\]", r".\1", path).lstrip(".")
    unknown = re.match(r"Object contains unknown field `(.+)`", detail)
    if unknown:
        field = f"{path}.{unknown.group(1)}" if path else unknown.group(1)
        known = _field_names(path)
        return f"{field}: unknown field" + (f" (fields: {', '.join(known)})" if known else "")
    inner = re.match(r"^([\w.\[\]]+): (.*)$", detail, re.S)
    if inner:  # a __post_init__ error naming its field, relative to the struct at `path`
        sub, detail = inner.groups()
        path = f"{path}.{sub}" if path else sub
    return f"{path or 'config'}: {detail}"


def _struct_at(path: str) -> Any:
    cls: Any = TrainConfig
    for part in [p for p in path.split(".") if p]:
        fields = {f.name: f.type for f in msgspec.structs.fields(cls)}
        if part not in fields or not _is_struct(fields[part]):
            return None
        cls = fields[part]
    return cls


def _field_names(path: str) -> list[str]:
    cls = _struct_at(path)
    return [f.name for f in msgspec.structs.fields(cls)] if cls is not None else []


def _is_struct(tp: Any) -> bool:
    return isinstance(tp, type) and issubclass(tp, msgspec.Struct)


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
    if _accepts_str(tp) and text.lower() not in ("none", "null"):
        return text
    if text.lower() in ("none", "null"):
        return None
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
        raise ConfigError(f"override {override!r}: expected key.sub=value")
    parts = key.split(".")
    cls: Any = TrainConfig
    node = data
    for i, part in enumerate(parts):
        fields = {f.name: f.type for f in msgspec.structs.fields(cls)}
        if part not in fields:
            raise ConfigError(f"{'.'.join(parts[: i + 1])}: unknown field (fields: {', '.join(fields)})")
        tp = fields[part]
        last = i == len(parts) - 1
        if _is_struct(tp) and not last:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"{'.'.join(parts[: i + 1])}: expected a table")
            cls = tp
            continue
        if last:
            node[part] = _parse_value(text.strip(), tp)
            return
        # A dict field (kwargs): the rest of the key names the entry.
        if typing.get_origin(tp) is not dict:
            raise ConfigError(f"{key}: {'.'.join(parts[: i + 1])} is a value, not a table")
        entries = node.setdefault(part, {})
        entries[".".join(parts[i + 1 :])] = _parse_value(text.strip(), Any)
        return


def _convert(data: Any, where: str) -> TrainConfig:
    if not isinstance(data, dict):
        raise ConfigError(f"{where}config: expected a table of fields, got {type(data).__name__}")
    try:
        return msgspec.convert(data, TrainConfig)
    except msgspec.ValidationError as e:
        raise ConfigError(f"{where}{_describe(e)}") from None


def apply_overrides(config: TrainConfig, overrides: Iterable[str]) -> TrainConfig:
    """A new config with `key.sub=value` overrides applied, each value parsed to its field's type."""
    data = msgspec.to_builtins(config)
    for override in overrides:
        _set(data, override)
    return _convert(data, "")


def load_config(path: str | Path, overrides: Iterable[str] = ()) -> TrainConfig:
    """Load a `TrainConfig` from a `.toml`, `.yaml`/`.yml` or `.json` file, then apply `overrides`.

    Raises `ConfigError` naming the file and the field path.
    """
    path = Path(path)
    data = _read(path)
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a table of fields at the top, got {type(data).__name__}")
    for override in overrides:
        _set(data, override)
    return _convert(data, f"{path}: ")
