"""purestep.api: the thin stateful layer (Optimizer adapter, Trainer, checkpoints, config, CLI)."""

from .checkpoint import Checkpoint as Checkpoint
from .checkpoint import CheckpointError as CheckpointError
from .checkpoint import Manifest as Manifest
from .checkpoint import checkpoint_dir as checkpoint_dir
from .checkpoint import latest_checkpoint as latest_checkpoint
from .checkpoint import load_checkpoint as load_checkpoint
from .checkpoint import read_manifest as read_manifest
from .checkpoint import save_checkpoint as save_checkpoint
from .optimizer import Optimizer as Optimizer

__all__: list[str] = [
    "Optimizer",
    "save_checkpoint",
    "load_checkpoint",
    "latest_checkpoint",
    "checkpoint_dir",
    "read_manifest",
    "Checkpoint",
    "CheckpointError",
    "Manifest",
]
