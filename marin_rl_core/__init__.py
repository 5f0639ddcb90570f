"""marinrl's core: protocols, data types, the plugin system and the job machinery.

This is the public surface plugins import from. It is flat (``from marin_rl_core import Env``)
and cheap to import: nothing here pulls in JAX, levanter or Ray. Modules that need them
(``marin_rl_core.training_batch``, ``marin_rl_core.model`` ...) are imported on demand.
"""

from marin_rl_core.errors import (
    ConfigError,
    DuplicatePluginError,
    ExitCode,
    FeatureNotAvailableError,
    FieldValueError,
    MarinRLError,
    PluginContractError,
    PluginImportError,
    UnknownPluginError,
    one_of,
)
from marin_rl_core.hookspecs import (
    PROJECT,
    CurriculumPlugin,
    EnvPlugin,
    LossPlugin,
    PluginRecord,
    StoragePlugin,
    WeightTransferPlugin,
    hookimpl,
    hookspec,
)
from marin_rl_core.protocols import (
    CurriculumPolicy,
    Env,
    RLLossModule,
    RolloutReader,
    RolloutStorage,
    RolloutWriter,
    WeightTransfer,
    WeightTransferClient,
    WeightTransferServer,
)
from marin_rl_core.registry import Registry, RegistrySpec, build_registry, registry_from_spec
from marin_rl_core.types import (
    LessonConfig,
    LessonDependency,
    LessonStats,
    Problem,
    Rollout,
    RolloutBatch,
    RolloutGroup,
    RolloutMetadata,
    SamplingParams,
    Score,
)

__all__ = [
    "PROJECT",
    "ConfigError",
    "CurriculumPlugin",
    "CurriculumPolicy",
    "DuplicatePluginError",
    "Env",
    "EnvPlugin",
    "FieldValueError",
    "ExitCode",
    "FeatureNotAvailableError",
    "LessonConfig",
    "LessonDependency",
    "LessonStats",
    "LossPlugin",
    "MarinRLError",
    "PluginContractError",
    "PluginImportError",
    "PluginRecord",
    "Problem",
    "RLLossModule",
    "Registry",
    "RegistrySpec",
    "Rollout",
    "RolloutBatch",
    "RolloutGroup",
    "RolloutMetadata",
    "RolloutReader",
    "RolloutStorage",
    "RolloutWriter",
    "SamplingParams",
    "Score",
    "StoragePlugin",
    "UnknownPluginError",
    "WeightTransfer",
    "WeightTransferClient",
    "WeightTransferPlugin",
    "WeightTransferServer",
    "build_registry",
    "hookimpl",
    "hookspec",
    "one_of",
    "registry_from_spec",
]
