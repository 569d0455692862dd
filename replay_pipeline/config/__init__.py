"""The configuration: its schema (every field, default, bound and meaning:
replay_pipeline/config/schema.py), the rules it must satisfy (rules.py: pure, no I/O), its
composition from conf/ and the command line (compose.py), and the frozen form a run carries
(settings.py). What needs I/O to check is replay_pipeline/run/preflight.py's.
"""

from replay_pipeline.config.compose import config_dir_override, flatten, load_config, register_configs, to_dataclass
from replay_pipeline.config.rules import DASK_REASON, DASK_RETIRED, RAY_INSTALL, buffer_storage_problems, validate
from replay_pipeline.config.schema import (CONF_DIR, GENERATOR_BACKENDS, LOOP_ENGINES, LOOP_MODES,
                                           LOSS_AGGREGATIONS, TASK_DEFAULTS, VLLM_DTYPES, VLLM_ONLY_FIELDS,
                                           AlgoConfig, BufferConfig, Config, ConfigError, GeneratorConfig,
                                           LoopConfig, ModelConfig, RayConfig, RewardConfig, TaskConfig,
                                           TrackingConfig, WarmStartConfig, bounded, owned)

__all__ = ["CONF_DIR", "config_dir_override", "DASK_REASON", "DASK_RETIRED", "RAY_INSTALL", "GENERATOR_BACKENDS", "LOOP_ENGINES", "LOOP_MODES", "LOSS_AGGREGATIONS",
           "TASK_DEFAULTS", "VLLM_DTYPES", "VLLM_ONLY_FIELDS", "AlgoConfig", "BufferConfig", "Config",
           "ConfigError", "GeneratorConfig", "LoopConfig", "ModelConfig", "RayConfig", "RewardConfig", "TaskConfig",
           "TrackingConfig",
           "WarmStartConfig", "bounded", "buffer_storage_problems", "flatten", "load_config", "owned",
           "register_configs", "to_dataclass", "validate"]
