"""purestep.api: the thin stateful layer (Optimizer adapter, Trainer, checkpoints, config, CLI)."""

from .optimizer import Optimizer as Optimizer

__all__: list[str] = [
    "Optimizer",
]
