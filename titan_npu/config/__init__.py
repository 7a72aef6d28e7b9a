"""Configuration: the schema dataclasses (here), loading TOML/YAML with dialect aliases and CLI overrides
(config.loader: load_config, save_config, parse_overrides, config_to_dict, config_from_dict) and validation
(config.validate).

The package itself exports only the schema, which everything depends on; loading and validation know the model
families (models/registry.py), which depend on the schema, so they are imported from their own modules.
"""

from titan_npu.config.schema import (
    ActivationCheckpointConfig,
    CheckpointConfig,
    CommConfig,
    CompileConfig,
    DataConfig,
    Float8Config,
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

__all__ = [
    "ActivationCheckpointConfig",
    "CheckpointConfig",
    "CommConfig",
    "CompileConfig",
    "DataConfig",
    "Float8Config",
    "JobConfig",
    "LRSchedulerConfig",
    "MetricsConfig",
    "ModelConfig",
    "OptimizerConfig",
    "ParallelConfig",
    "ProfilingConfig",
    "TrainingConfig",
    "ValidationConfig",
]
