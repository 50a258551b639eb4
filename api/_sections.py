"""The sections of a `TrainConfig` that `_build` reads too (the optimizer and the schedule)
and the other plain ones; `config` re-exports them beside `TrainConfig`."""

from __future__ import annotations

from typing import Any, Annotated, Literal, Union

import msgspec
from msgspec import Meta

PositiveInt = Annotated[int, Meta(ge=1)]
Size = Annotated[int, Meta(ge=1, le=1 << 31)]  # a model dimension: beyond this no tensor of it can be allocated
NonNegativeInt = Annotated[int, Meta(ge=0)]
NonNegativeFloat = Annotated[float, Meta(ge=0)]


class _Section(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    pass


class OptimizerConfig(_Section):  # type: ignore[misc]  # msgspec's frozen Struct, not a dataclass
    """`[optimizer]`: any purestep optimizer by its public name, e.g. `adamw`, `muon_adamw`.

    `kwargs` are its keyword arguments (`weight_decay`, `betas`...); a string naming a
    public purestep function passes that function (`mask = "decay_mask"`), a string for
    a `*dtype` argument names a torch dtype (`ns_dtype = "bfloat16"`). `lr` is the peak
    learning rate the schedule shapes; any other `*_lr` keyword (`muon_adamw`'s
    `adamw_lr`) follows the same shape scaled to its own peak. `clip_grad_norm` chains
    `ps.clip_by_global_norm` in front (None: no clipping). `qk_clip` chains Kimi K2's QK-clip
    after it (`ps.qk_clip`): each attention head's W_q and W_k are rescaled when its max
    logit over the step's batch exceeds the threshold (None: off; needs a model that reports
    its heads, as the built-in GPT does).
    """

    name: str = "adamw"
    lr: NonNegativeFloat = 3e-4
    kwargs: dict[str, Any] = {}
    clip_grad_norm: Union[Annotated[float, Meta(gt=0)], None] = 1.0
    qk_clip: Union[Annotated[float, Meta(gt=0)], None] = None


class ScheduleConfig(_Section):  # type: ignore[misc]  # msgspec's frozen Struct, not a dataclass
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


class ModelConfig(_Section):  # type: ignore[misc]  # msgspec's frozen Struct, not a dataclass
    """`[model]`: the byte-level GPT of `purestep.api.models` (`kwargs`: more `GPT` arguments)."""

    name: str = "gpt"
    vocab_size: Size = 256
    block_size: Size = 128
    n_layer: Size = 4
    n_head: Size = 4
    n_embd: Size = 128
    dropout: Annotated[float, Meta(ge=0, lt=1)] = 0.0
    kwargs: dict[str, Any] = {}


class DataConfig(_Section):  # type: ignore[misc]  # msgspec's frozen Struct, not a dataclass
    """`[data]`: `source = "stdlib"` (the Python standard library's sources, on every
    machine) or a path to a text file or a folder of `.py` files; bytes are tokens."""

    source: str = "stdlib"
    max_bytes: Union[PositiveInt, None] = 2_000_000
    val_fraction: Annotated[float, Meta(gt=0, lt=1)] = 0.05
    kwargs: dict[str, Any] = {}


class DiLoCoConfig(_Section):  # type: ignore[misc]  # msgspec's frozen Struct, not a dataclass
    """`[diloco]`: DiLoCo's outer loop around the optimizer (`ps.diloco`), on when
    `sync_every` is set: every `sync_every` steps the workers average their pseudo-gradients
    and the anchor takes an outer SGD step (`outer_lr`, Nesterov momentum `outer_momentum`;
    0: none). The workers are the ranks under `strategy = "ddp"` (no grad all-reduce: each
    rank trains on its own rows, and the sync is the only traffic between them), the
    replica groups under `"hsdp"` (FSDP2 within each replica, no all-reduce across them: the
    sync is the only traffic across replicas; each worker keeps its own whole state); under
    `"single"` the one process is one worker (MuLoCo's single-worker recipe). Streaming
    DiLoCo: `fragments` runs of the params synced in turn, each `delay` steps after its
    pseudo-gradient was averaged, the synced params `alpha` local (`ps.diloco`'s meanings).
    `compression = "sparseloco"`: each worker sends the `density` share of its
    error-fed pseudo-gradient largest in each tile, in `bits` bits (`ps.TopK`; SparseLoCo's
    paper runs it with `outer_lr = 1`, `outer_momentum = 0`).
    """

    sync_every: Union[PositiveInt, None] = None
    outer_lr: NonNegativeFloat = 0.7
    outer_momentum: Annotated[float, Meta(ge=0, lt=1)] = 0.9
    fragments: PositiveInt = 1
    delay: NonNegativeInt = 0
    alpha: Annotated[float, Meta(ge=0, le=1)] = 0.0
    compression: Union[Literal["sparseloco"], None] = None
    density: Annotated[float, Meta(gt=0, le=1)] = 0.03125
    bits: Union[Annotated[int, Meta(ge=1, le=8)], None] = 2
    error_decay: Annotated[float, Meta(ge=0, le=1)] = 0.95
