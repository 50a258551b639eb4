"""purestep.api: the thin stateful layer (Optimizer adapter, Trainer, checkpoints, config, CLI)."""

__all__: list[str] = []
