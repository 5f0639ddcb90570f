"""The ``paged`` generation engine: levanter's paged-attention ``InferenceEngine``
(:class:`~marin_rl_core.rollout.inference.SamplingEngine`). On TPU it has real ragged
paged-attention kernels; elsewhere its attention is a reference loop over sequences.
"""

from __future__ import annotations

import attrs

from marin_rl_core import EnginePlugin, EngineSpec, hookimpl


@attrs.frozen(kw_only=True)
class PagedEngineConfig:
    """Args:
    max_prefill_tokens: prompt tokens prefilled in one call of levanter's engine.
    """

    max_prefill_tokens: int = attrs.field(default=2048, validator=attrs.validators.ge(1))


def build(config: PagedEngineConfig, spec: EngineSpec):  # type: ignore[no-untyped-def]
    from marin_rl_core import SamplingEngine

    return SamplingEngine(
        spec.model, **spec.engine_kwargs(), max_prefill_tokens=config.max_prefill_tokens
    )


@hookimpl
def marinrl_register_engines():
    yield EnginePlugin(
        name="paged",
        summary="levanter's paged-attention InferenceEngine (real kernels on TPU).",
        config_class=PagedEngineConfig,
        build=build,
    )
