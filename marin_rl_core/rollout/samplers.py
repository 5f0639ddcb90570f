"""Choosing and making the rollout side's sampler: the paged engine
(:class:`~marin_rl_core.rollout.inference.SamplingEngine`) or the dense one
(:class:`~marin_rl_core.rollout.dense_sampler.DenseSampler`), and the mesh it runs on."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
from levanter.models.lm_model import LmHeadModel

from marin_rl_core.rollout.dense_sampler import DenseSampler
from marin_rl_core.rollout.inference import SamplingEngine

DENSE_MAX_WORK = 4096
"""``model.inference_engine = "auto"`` picks the :class:`DenseSampler` when the longest response
(``max_tokens``) times ``model.max_seq_len`` is at most this: short answers from short sequences,
where the paged engine's per-sequence host work costs more than recomputing the sequence."""


def choose_engine(kind: str, *, max_tokens: int, max_seq_len: int) -> str:
    """``"paged"`` or ``"dense"``: ``kind`` itself unless it is ``"auto"`` (see
    :data:`DENSE_MAX_WORK`)."""
    if kind != "auto":
        return kind
    return "dense" if max_tokens * max_seq_len <= DENSE_MAX_WORK else "paged"


def make_sampler(kind: str, model: LmHeadModel, **kwargs: Any) -> SamplingEngine | DenseSampler:
    """A :class:`SamplingEngine` (``"paged"``) or a :class:`DenseSampler` (``"dense"``)."""
    if kind == "dense":
        return DenseSampler(model, **kwargs)
    if kind == "paged":
        return SamplingEngine(model, **kwargs)
    if kind == "kv":
        from marin_rl_core.rollout.kv_engine import KVCacheEngine

        return KVCacheEngine(model, **kwargs)
    raise ValueError(f"unknown inference engine {kind!r}: use paged, dense or kv")


def inference_mesh(
    tensor_parallel: int, axes: Sequence[str] = ("mlp", "heads", "kv_head")
) -> tuple[Any, dict[str, Any]]:
    """``(mesh, axis_mapping)`` for a :class:`SamplingEngine` that splits ``axes`` of the model over
    ``tensor_parallel`` of this process's devices (levanter's mesh: the rest replicate).

    Raises:
        ConfigError: when ``tensor_parallel`` does not divide the device count.
    """
    import levanter.trainer

    from marin_rl_core.errors import ConfigError

    n = jax.device_count()
    if tensor_parallel < 1 or n % tensor_parallel:
        raise ConfigError(
            f"$.model.inference_tensor_parallel: {tensor_parallel} does not divide the rollout "
            f"worker's {n} device(s); use a divisor of {n} (resources.rollout sets its devices)"
        )
    config = levanter.trainer.TrainerConfig(
        model_axis_size=tensor_parallel,
        tensor_parallel_axes=list(axes),
        require_accelerator=False,
    )
    return config.device_mesh, dict(config.compute_axis_mapping)


__all__ = ["DENSE_MAX_WORK", "choose_engine", "inference_mesh", "make_sampler"]
