"""marinrl's core: protocols, data types, the plugin system and the job machinery.

This is the public surface plugins import from, and the only one (``tests/test_public_api.py``
holds the built-in plugins and the examples to it). It is flat (``from marin_rl_core import
Env``) and cheap to import: nothing here pulls in JAX, levanter or Ray. What a plugin of each
kind needs beyond the contracts is here too, imported on first use (:data:`LAZY`): a loss's
training batch, per-token losses and shared objectives; a storage's rollout format; a weight
transfer's leaf helpers; the built-in engines. Tests use :mod:`marin_rl_core.testing` as well.
"""

from typing import Any

from marin_rl_core.agent_clients import AgentClients
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
    WeightMismatchError,
    one_of,
)
from marin_rl_core.generation import EngineSpec, GenerationRequest, Sample, requests_for
from marin_rl_core.hookspecs import (
    PROJECT,
    CurriculumPlugin,
    EnginePlugin,
    EnvPlugin,
    LossPlugin,
    PluginRecord,
    RewardPlugin,
    StoragePlugin,
    WeightTransferPlugin,
    hookimpl,
    hookspec,
)
from marin_rl_core.protocols import (
    LOSS_AGGREGATIONS,
    AgentEnv,
    CurriculumPolicy,
    Env,
    Episode,
    GenerationEngine,
    LossPlan,
    MultiTurnEnv,
    RewardFunction,
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
    Action,
    AgentCommand,
    AgentEndpoint,
    LessonConfig,
    LessonDependency,
    LessonStats,
    Problem,
    ReceivedWeights,
    RewardInput,
    Rollout,
    RolloutBatch,
    RolloutGroup,
    RolloutMetadata,
    RunInfo,
    SamplingParams,
    Score,
    Step,
)

LAZY: dict[str, tuple[str, str]] = {
    # a loss: the training batch it is given, its per-token losses, the shared objectives
    "TrainingBatch": ("marin_rl_core.learner.training_batch", "TrainingBatch"),
    "batch_logprobs_and_entropy": (
        "marin_rl_core.learner.training_batch", "batch_logprobs_and_entropy"
    ),
    "batch_hidden_states": ("marin_rl_core.learner.training_batch", "batch_hidden_states"),
    "training_batch_from_rollouts": (
        "marin_rl_core.learner.training_batch", "training_batch_from_rollouts"
    ),
    "TokenLoss": ("marin_rl_core.learner.loss", "TokenLoss"),
    "as_named": ("marin_rl_core.learner.loss", "as_named"),
    "whiten": ("marin_rl_core.learner.loss", "whiten"),
    "step_loss": ("marin_rl_core.learner.loss", "step_loss"),
    "PolicyGradientConfig": ("marin_rl_core.learner.policy_gradient", "PolicyGradientConfig"),
    "PolicyGradientLoss": ("marin_rl_core.learner.policy_gradient", "PolicyGradientLoss"),
    "policy_gradient_loss": ("marin_rl_core.learner.policy_gradient", "policy_gradient_loss"),
    # a storage: rollout batches as bytes, and where a run's files are
    "serialize_rollout_batch": ("marin_rl_core.rollout_serialization", "serialize_rollout_batch"),
    "deserialize_rollout_batch": (
        "marin_rl_core.rollout_serialization", "deserialize_rollout_batch"
    ),
    "RolloutDecodeError": ("marin_rl_core.rollout_serialization", "RolloutDecodeError"),
    "absolute_run_dir": ("marin_rl_core.rundir", "absolute"),
    # a weight transfer: a model's arrays as described leaves, checked against the receiver's
    "array_leaves": ("marin_rl_core.weight_leaves", "array_leaves"),
    "describe_leaves": ("marin_rl_core.weight_leaves", "describe"),
    "check_fits": ("marin_rl_core.weight_leaves", "check_fits"),
    # an env: a single-turn env driven as a one-step episode
    "as_multi_turn": ("marin_rl_core.rollout.episode_state", "as_multi_turn"),
    # an engine: the built-in ones (to wrap or build on) and the policy model
    "KVCacheEngine": ("marin_rl_core.rollout.kv_engine", "KVCacheEngine"),
    "SamplingEngine": ("marin_rl_core.rollout.inference", "SamplingEngine"),
    "DenseSampler": ("marin_rl_core.rollout.dense_sampler", "DenseSampler"),
    "auto_engine_name": ("marin_rl_core.rollout.samplers", "auto_engine_name"),
    # an engine of one's own: the trainer's logits, its token draws and keys, the request checks
    "next_token_logits": ("marin_rl_core.models.logprobs", "next_token_logits"),
    "draw_next_tokens": ("marin_rl_core.rollout.next_token", "draw_next_tokens"),
    "row_keys": ("marin_rl_core.rollout.inference", "row_keys"),
    "check_requests": ("marin_rl_core.rollout.inference", "check_requests"),
    # a model of one's own beside the policy (a judge, a reward model): a checkpoint and its tokenizer
    "load_hf_checkpoint": ("marin_rl_core.models.build", "load_hf_checkpoint"),
    "load_tokenizer": ("marin_rl_core.models.tokenizer", "load_tokenizer"),
    "RewardModel": ("marin_rl_core.models.reward_model", "RewardModel"),
}  # fmt: skip
"""Public names imported on first use: ``name -> (module, attribute)``."""


def __getattr__(name: str) -> Any:
    if name not in LAZY:
        raise AttributeError(f"module 'marin_rl_core' has no attribute {name!r}")
    import importlib

    module, attribute = LAZY[name]
    value = getattr(importlib.import_module(module), attribute)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *LAZY])


__all__ = [
    *LAZY,
    "LOSS_AGGREGATIONS",
    "LossPlan",
    "PROJECT",
    "Action",
    "AgentClients",
    "AgentCommand",
    "AgentEndpoint",
    "AgentEnv",
    "Episode",
    "MultiTurnEnv",
    "Step",
    "ConfigError",
    "CurriculumPlugin",
    "CurriculumPolicy",
    "DuplicatePluginError",
    "EnginePlugin",
    "EngineSpec",
    "Env",
    "EnvPlugin",
    "FieldValueError",
    "ExitCode",
    "FeatureNotAvailableError",
    "GenerationEngine",
    "GenerationRequest",
    "LessonConfig",
    "LessonDependency",
    "LessonStats",
    "LossPlugin",
    "MarinRLError",
    "PluginContractError",
    "PluginImportError",
    "PluginRecord",
    "Problem",
    "ReceivedWeights",
    "RewardFunction",
    "RewardInput",
    "RewardPlugin",
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
    "RunInfo",
    "Sample",
    "SamplingParams",
    "Score",
    "StoragePlugin",
    "UnknownPluginError",
    "WeightMismatchError",
    "WeightTransfer",
    "WeightTransferClient",
    "WeightTransferPlugin",
    "WeightTransferServer",
    "build_registry",
    "hookimpl",
    "hookspec",
    "one_of",
    "registry_from_spec",
    "requests_for",
]
