"""purestep.api: the thin stateful layer (Optimizer adapter, Trainer, checkpoints, config, CLI)."""

from .checkpoint import Checkpoint as Checkpoint
from .checkpoint import CheckpointManager as CheckpointManager
from .checkpoint import Manifest as Manifest
from .checkpoint import checkpoint_dir as checkpoint_dir
from .checkpoint import latest_checkpoint as latest_checkpoint
from .checkpoint import load_checkpoint as load_checkpoint
from .checkpoint import read_manifest as read_manifest
from .checkpoint import save_checkpoint as save_checkpoint
from .config import DataConfig as DataConfig
from .config import DiLoCoConfig as DiLoCoConfig
from .config import ModelConfig as ModelConfig
from .config import OptimizerConfig as OptimizerConfig
from .config import ScheduleConfig as ScheduleConfig
from .config import TrainConfig as TrainConfig
from .config import apply_overrides as apply_overrides
from .config import load_config as load_config
from .errors import CheckpointError as CheckpointError
from .errors import ConfigError as ConfigError
from .errors import RunDirError as RunDirError
from .fault_tolerance import TorchFT as TorchFT
from .optimizer import Optimizer as Optimizer
from .planner import plan as plan
from .trainer import Trainer as Trainer

__all__: list[str] = [
    "Optimizer",
    "Trainer",
    "save_checkpoint",
    "load_checkpoint",
    "latest_checkpoint",
    "checkpoint_dir",
    "read_manifest",
    "Checkpoint",
    "CheckpointError",
    "CheckpointManager",
    "Manifest",
    "TrainConfig",
    "OptimizerConfig",
    "ScheduleConfig",
    "ModelConfig",
    "DataConfig",
    "DiLoCoConfig",
    "ConfigError",
    "RunDirError",
    "TorchFT",
    "load_config",
    "apply_overrides",
    "plan",
]
