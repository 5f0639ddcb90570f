"""The ``kv`` generation engine: a KV cache in slots, decode rounds compiled as one loop on the
device, continuous batching (finished rows' slots are refilled between rounds), one prefill per
prompt shared by its samples (:class:`~marin_rl_core.rollout.kv_engine.KVCacheEngine`).

Runs levanter's Llama-family models (Llama, Qwen2/2.5, Qwen3); the slots are as many as fit in
``model.inference_memory_fraction`` of the device's free memory.
"""

from __future__ import annotations

import attrs

from marin_rl_core import EnginePlugin, EngineSpec, hookimpl


@attrs.frozen(kw_only=True)
class KVEngineConfig:
    """Args:
    steps_per_round: decode steps per host round trip while prompts wait for a slot (with none
        waiting, a round runs until its rows are done).
    max_prefill_tokens: prompt tokens (padded) prefilled in one call.
    """

    steps_per_round: int = attrs.field(default=32, validator=attrs.validators.ge(1))
    max_prefill_tokens: int = attrs.field(default=8192, validator=attrs.validators.ge(16))


def build(config: KVEngineConfig, spec: EngineSpec):  # type: ignore[no-untyped-def]
    from marin_rl_core import KVCacheEngine

    return KVCacheEngine(
        spec.model,
        **spec.engine_kwargs(),
        memory_fraction=spec.memory_fraction,
        steps_per_round=config.steps_per_round,
        max_prefill_tokens=config.max_prefill_tokens,
    )


@hookimpl
def marinrl_register_engines():
    yield EnginePlugin(
        name="kv",
        summary="KV cache in slots, decode loop on the device, continuous batching.",
        config_class=KVEngineConfig,
        build=build,
    )
