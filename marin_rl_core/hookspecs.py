"""Every hook a marinrl plugin can implement, and the records the registration hooks yield.

This module is the reference for plugin authors. A plugin is a module with functions decorated
``@marin_rl_core.hookimpl`` whose names match the hookspecs below; it is found through an entry
point in group ``marinrl`` (or ``--plugin module.path``). Hooks are called by
:class:`marin_rl_core.registry.Registry` and nothing else.

All hooks run in the process that builds the registry: the CLI driver, and each Ray worker, which
rebuilds the driver's exact plugin set. They must be cheap: import JAX, levanter or Ray inside
``build``, never at module import, so that ``marinrl --help`` stays fast.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any, ClassVar

import attrs
import pluggy

from marin_rl_core.types import LessonConfig

if TYPE_CHECKING:
    from marin_rl_core.generation import EngineSpec
    from marin_rl_core.protocols import (
        CurriculumPolicy,
        Env,
        GenerationEngine,
        MultiTurnEnv,
        RewardFunction,
        RLLossModule,
        RolloutStorage,
        WeightTransfer,
    )
    from marin_rl_core.types import RunInfo

PROJECT = "marinrl"
"""The marker name, the entry-point group and the hook-name prefix."""

hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


def _check_config_class(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if not (isinstance(value, type) and attrs.has(value)):
        raise TypeError(f"{attribute.name} must be an attrs class, got {value!r}")


@attrs.frozen(kw_only=True)
class PluginRecord:
    """What a registration hook yields for each name it provides.

    Args:
        name: the name users select it by (``--env NAME``); lowercase, ``[a-z0-9_-]``.
        summary: one line for ``marinrl plugins list``.
        config_class: an ``attrs`` class whose every field has a default; its fields are the
            plugin's config keys (``[loss] kl_coef = 0.05``).
        build: returns the object implementing the kind's protocol; its arguments are the
            kind's (``build_parameters``: ``build(config)`` for most, ``build(config, run)`` for
            a storage, ...). A ``build`` that cannot take them is refused when the record is
            made, so the plugin fails to load (exit 7) rather than the job after start.
    """

    kind: ClassVar[str] = ""
    protocol_name: ClassVar[str] = ""
    build_parameters: ClassVar[tuple[str, ...]] = ("config",)

    name: str
    summary: str
    config_class: type = attrs.field(validator=_check_config_class)
    build: Callable[..., Any]

    def __attrs_post_init__(self) -> None:
        import re

        if not re.fullmatch(r"[a-z0-9][a-z0-9_-]*", self.name):
            raise ValueError(f"plugin name {self.name!r} must match [a-z0-9][a-z0-9_-]*")
        if "\n" in self.summary.strip():
            raise ValueError(f"summary of {self.name!r} must be one line")
        _check_build(self)


def _check_build(record: PluginRecord) -> None:
    """``record.build`` is callable with the kind's arguments (``build_parameters``)."""
    import inspect

    build, wanted = record.build, record.build_parameters
    if not callable(build):
        raise TypeError(f"{record.kind} plugin {record.name!r}: build must be callable")
    try:
        signature = inspect.signature(build)
    except (TypeError, ValueError):  # a builtin or C callable: nothing to read
        return
    try:
        signature.bind(*wanted)
    except TypeError as exc:
        shown = getattr(build, "__qualname__", repr(build))
        raise TypeError(
            f"{record.kind} plugin {record.name!r}: build must take ({', '.join(wanted)}) "
            f"(docs/hooks.md), but {shown}{signature} cannot ({exc})"
        ) from None


@attrs.frozen(kw_only=True)
class EnvPlugin(PluginRecord):
    """An :class:`~marin_rl_core.protocols.Env` (single-turn: ``score``) or a
    :class:`~marin_rl_core.protocols.MultiTurnEnv` (``reset`` + ``step``). ``build(config)``
    returns one.

    Args:
        default_lessons: ``default_lessons(config) -> [LessonConfig, ...]``, the curriculum a
            run uses when it names this env and defines no lessons of its own. ``None`` means a
            single lesson with the env's config.
        preflight: ``preflight(config) -> [problem, ...]``: cheap checks of one lesson's env
            config that ``marinrl run`` makes before anything is written or started (a data
            file that exists, an optional package installed, a dataset name known); each
            problem is a sentence that names the fix. Nothing heavy here: no model, no
            download, no env built. The job refuses to start on any (exit 3), instead of the
            workers failing after start.
    """

    kind: ClassVar[str] = "env"
    protocol_name: ClassVar[str] = "Env"
    build: Callable[[Any], Env | MultiTurnEnv | Any]
    default_lessons: Callable[[Any], Sequence[LessonConfig]] | None = None
    preflight: Callable[[Any], Sequence[str]] | None = None


@attrs.frozen(kw_only=True)
class LossPlugin(PluginRecord):
    """An :class:`~marin_rl_core.protocols.RLLossModule`. ``build(config) -> RLLossModule``."""

    kind: ClassVar[str] = "loss"
    protocol_name: ClassVar[str] = "RLLossModule"
    build: Callable[[Any], RLLossModule]


@attrs.frozen(kw_only=True)
class StoragePlugin(PluginRecord):
    """A :class:`~marin_rl_core.protocols.RolloutStorage`.
    ``build(config, run) -> RolloutStorage`` (``run``: :class:`~marin_rl_core.types.RunInfo`)."""

    kind: ClassVar[str] = "storage"
    protocol_name: ClassVar[str] = "RolloutStorage"
    build_parameters: ClassVar[tuple[str, ...]] = ("config", "run")
    build: Callable[[Any, RunInfo], RolloutStorage]


@attrs.frozen(kw_only=True)
class WeightTransferPlugin(PluginRecord):
    """A :class:`~marin_rl_core.protocols.WeightTransfer`. ``build(config) -> WeightTransfer``."""

    kind: ClassVar[str] = "weight_transfer"
    protocol_name: ClassVar[str] = "WeightTransfer"
    build: Callable[[Any], WeightTransfer]


@attrs.frozen(kw_only=True)
class CurriculumPlugin(PluginRecord):
    """A :class:`~marin_rl_core.protocols.CurriculumPolicy`.
    ``build(config, lessons) -> CurriculumPolicy``."""

    kind: ClassVar[str] = "curriculum"
    protocol_name: ClassVar[str] = "CurriculumPolicy"
    build_parameters: ClassVar[tuple[str, ...]] = ("config", "lessons")
    build: Callable[[Any, Sequence[LessonConfig]], CurriculumPolicy]


@attrs.frozen(kw_only=True)
class EnginePlugin(PluginRecord):
    """A :class:`~marin_rl_core.protocols.GenerationEngine`.
    ``build(config, spec) -> GenerationEngine`` (``spec``:
    :class:`~marin_rl_core.generation.EngineSpec`: the model, sequence length, EOS, mesh and
    memory budget). Called once in each rollout worker (and by ``marinrl eval``).

    Args:
        exact_logprobs: the engine's logprobs equal the trainer's for the same tokens (to float
            rounding), as every loss's importance ratio needs. ``False`` (a remote server with
            kernels of its own, say): ``marinrl eval`` uses it, ``marinrl run`` refuses it before
            the job starts.
    """

    kind: ClassVar[str] = "engine"
    protocol_name: ClassVar[str] = "GenerationEngine"
    build_parameters: ClassVar[tuple[str, ...]] = ("config", "spec")
    build: Callable[[Any, EngineSpec], GenerationEngine]
    exact_logprobs: bool = True


@attrs.frozen(kw_only=True)
class RewardPlugin(PluginRecord):
    """A :class:`~marin_rl_core.protocols.RewardFunction`: a term of a combined reward
    (``[[reward.terms]]``: its ``fn``). ``build(config) -> RewardFunction``. Called once in
    each rollout worker (and by ``marinrl eval``).

    Args:
        preflight: ``preflight(config) -> [problem, ...]``: cheap checks of a term's config
            that ``marinrl run`` makes before anything starts (a judge without an endpoint),
            each a sentence naming the fix, as an env's ``preflight``.
    """

    kind: ClassVar[str] = "reward"
    protocol_name: ClassVar[str] = "RewardFunction"
    build: Callable[[Any], RewardFunction]
    preflight: Callable[[Any], Sequence[str]] | None = None


RECORD_TYPES: dict[str, type[PluginRecord]] = {
    cls.kind: cls
    for cls in (
        EnvPlugin,
        LossPlugin,
        StoragePlugin,
        WeightTransferPlugin,
        CurriculumPlugin,
        EnginePlugin,
        RewardPlugin,
    )
}
"""Every plugin kind, by its name in configs and on the command line."""


# --- registration: called once per registry build, results cached -----------------------------


@hookspec
def marinrl_register_envs() -> Iterable[EnvPlugin]:
    """Yield an :class:`EnvPlugin` for each environment this plugin provides.

    Called once when a registry is built, in every process that builds one. All results are
    collected; a name yielded by two plugins is an error listing both.
    """


@hookspec
def marinrl_register_losses() -> Iterable[LossPlugin]:
    """Yield a :class:`LossPlugin` for each RL loss (``--loss NAME``) this plugin provides.

    Called once per registry build; all results are collected.
    """


@hookspec
def marinrl_register_storages() -> Iterable[StoragePlugin]:
    """Yield a :class:`StoragePlugin` for each rollout storage (``--storage NAME``).

    Called once per registry build; all results are collected.
    """


@hookspec
def marinrl_register_weight_transfers() -> Iterable[WeightTransferPlugin]:
    """Yield a :class:`WeightTransferPlugin` for each weight-sync mechanism
    (``--weight-transfer NAME``).

    Called once per registry build; all results are collected.
    """


@hookspec
def marinrl_register_curricula() -> Iterable[CurriculumPlugin]:
    """Yield a :class:`CurriculumPlugin` for each curriculum policy (``--curriculum NAME``).

    Called once per registry build; all results are collected.
    """


@hookspec
def marinrl_register_engines() -> Iterable[EnginePlugin]:
    """Yield an :class:`EnginePlugin` for each generation engine (``--engine NAME``,
    ``[engine] name``): what rollout workers sample the policy with.

    Called once per registry build; all results are collected.
    """


@hookspec
def marinrl_register_rewards() -> Iterable[RewardPlugin]:
    """Yield a :class:`RewardPlugin` for each reward function (a ``[[reward.terms]]`` entry's
    ``fn``) this plugin provides.

    Called once per registry build; all results are collected.
    """


REGISTRATION_HOOKS: dict[str, str] = {
    "env": "marinrl_register_envs",
    "loss": "marinrl_register_losses",
    "storage": "marinrl_register_storages",
    "weight_transfer": "marinrl_register_weight_transfers",
    "curriculum": "marinrl_register_curricula",
    "engine": "marinrl_register_engines",
    "reward": "marinrl_register_rewards",
}
