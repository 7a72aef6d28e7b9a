"""Configuration: the schema dataclasses, loading TOML/YAML with dialect aliases and CLI overrides, validation."""

from titan_npu.config.loader import config_from_dict, config_to_dict, load_config, parse_overrides, save_config
from titan_npu.config.schema import (
    ActivationCheckpointConfig,
    CheckpointConfig,
    CommConfig,
    CompileConfig,
    DataConfig,
    JobConfig,
    LRSchedulerConfig,
    MetricsConfig,
    ModelConfig,
    OptimizerConfig,
    ParallelConfig,
    ProfilingConfig,
    TrainingConfig,
    ValidationConfig,
)
from titan_npu.config.validate import validate

__all__ = [
    "ActivationCheckpointConfig",
    "CheckpointConfig",
    "CommConfig",
    "CompileConfig",
    "DataConfig",
    "JobConfig",
    "LRSchedulerConfig",
    "MetricsConfig",
    "ModelConfig",
    "OptimizerConfig",
    "ParallelConfig",
    "ProfilingConfig",
    "TrainingConfig",
    "ValidationConfig",
    "config_from_dict",
    "config_to_dict",
    "load_config",
    "parse_overrides",
    "save_config",
    "validate",
]
