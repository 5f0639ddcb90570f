"""The ``dense`` generation engine: no KV cache; each new token is one jitted forward pass over
the whole right-padded batch (:class:`~marin_rl_core.rollout.dense_sampler.DenseSampler`). For
short answers from short sequences only: its work grows with the square of the length.
"""

from __future__ import annotations

import attrs

from marin_rl_core import EnginePlugin, EngineSpec, hookimpl


@attrs.frozen(kw_only=True)
class DenseEngineConfig:
    """No settings."""


def build(config: DenseEngineConfig, spec: EngineSpec):  # type: ignore[no-untyped-def]
    from marin_rl_core import DenseSampler

    return DenseSampler(spec.model, **spec.engine_kwargs())


@hookimpl
def marinrl_register_engines():
    yield EnginePlugin(
        name="dense",
        summary="One forward pass over the padded batch per token, no KV cache.",
        config_class=DenseEngineConfig,
        build=build,
    )
