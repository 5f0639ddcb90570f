"""The run configuration: its schema (:mod:`~marin_rl_core.config.schema`), the converter that
structures it (:mod:`~marin_rl_core.config.converter`), loading and overrides
(:mod:`~marin_rl_core.config.loading`), validation (:mod:`~marin_rl_core.config.validation`)
and the derived ``model.max_seq_len`` of a checkpoint
(:mod:`~marin_rl_core.config.sequence_length`). The public names are re-exported here."""

from marin_rl_core.config.converter import (
    dump_config,
    lesson_env_config,
    make_converter,
    unstructure_config,
)
from marin_rl_core.config.loading import parse_override, read_config_file, resolve_config
from marin_rl_core.config.schema import (
    CHOICE_TYPES,
    CurriculumChoice,
    EnvChoice,
    EpisodesConfig,
    EvalConfig,
    FaultsConfig,
    LessonConfig,
    LessonDependency,
    LoggingConfig,
    LossChoice,
    MeshConfig,
    ModelConfig,
    PluginChoice,
    ReplayBufferConfig,
    ResourcesConfig,
    RLJobConfig,
    RoleResources,
    SamplingParams,
    StorageChoice,
    TrainerConfig,
    WeightTransferChoice,
)
from marin_rl_core.config.validation import validate_config

__all__ = [
    "CHOICE_TYPES",
    "CurriculumChoice",
    "EnvChoice",
    "EpisodesConfig",
    "EvalConfig",
    "FaultsConfig",
    "LessonConfig",
    "LessonDependency",
    "LoggingConfig",
    "LossChoice",
    "MeshConfig",
    "ModelConfig",
    "PluginChoice",
    "RLJobConfig",
    "ReplayBufferConfig",
    "ResourcesConfig",
    "RoleResources",
    "SamplingParams",
    "StorageChoice",
    "TrainerConfig",
    "WeightTransferChoice",
    "dump_config",
    "lesson_env_config",
    "make_converter",
    "parse_override",
    "read_config_file",
    "resolve_config",
    "unstructure_config",
    "validate_config",
]
