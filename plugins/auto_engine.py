"""The ``auto`` generation engine (the default): builds the engine measured fastest for the
rollout worker's platform (:data:`~marin_rl_core.rollout.samplers.AUTO_ENGINES`: ``kv`` on CPU
and GPU, levanter's ``paged`` on TPU), or the next one when the first cannot run the model, and
logs which.
"""

from __future__ import annotations

import logging

import attrs

from marin_rl_core import EnginePlugin, EngineSpec, hookimpl

logger = logging.getLogger(__name__)


@attrs.frozen(kw_only=True)
class AutoEngineConfig:
    """No settings: name the engine (``--engine kv``) to set its own."""


def build(config: AutoEngineConfig, spec: EngineSpec):  # type: ignore[no-untyped-def]
    from marin_rl_core import auto_engine_name

    if spec.build_engine is None:
        raise ValueError("the auto engine needs EngineSpec.build_engine to build the one it picks")
    names = auto_engine_name(spec.platform)
    for i, name in enumerate(names):
        try:
            engine = spec.build_engine(name)
        except ValueError as exc:  # this engine cannot run this model: the next one
            if i == len(names) - 1:
                raise
            logger.info(
                "engine auto: %s cannot run this model (%s); trying %s", name, exc, names[i + 1]
            )
            continue
        logger.info("engine auto: %s (the fastest measured on %s)", name, spec.platform)
        return engine
    raise AssertionError("unreachable")


@hookimpl
def marinrl_register_engines():
    yield EnginePlugin(
        name="auto",
        summary="The engine measured fastest on this platform: kv on CPU/GPU, paged on TPU.",
        config_class=AutoEngineConfig,
        build=build,
    )
