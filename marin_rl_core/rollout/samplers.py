"""The rollout side's generation engine: the spec it is built with (:func:`engine_spec`; the
plugin builds it through :meth:`Registry.build_engine <marin_rl_core.registry.Registry.build_engine>`),
what ``auto`` picks (:func:`auto_engine_name`), and the tensor-parallel mesh it runs on
(:func:`inference_mesh`).

The built-in engines are plugins (``plugins/*_engine.py``): ``paged`` (levanter's
``InferenceEngine``, :class:`~marin_rl_core.rollout.inference.SamplingEngine`), ``dense``
(:class:`~marin_rl_core.rollout.dense_sampler.DenseSampler`) and ``kv``
(:class:`~marin_rl_core.rollout.kv_engine.KVCacheEngine`).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import jax

from marin_rl_core.generation import EngineSpec

logger = logging.getLogger(__name__)

AUTO_ENGINES: dict[str, tuple[str, ...]] = {
    "cpu": ("kv", "paged"),
    "gpu": ("kv", "paged"),
    "tpu": ("paged", "kv"),
}
"""What ``[engine] name = "auto"`` builds on each platform, in order of preference (the next
when one cannot run the model). From measurements, side by side on the same requests:
``bench/generation.py`` (Qwen3-0.6B shape, 32 rows x 128 new tokens on a 2-core CPU: kv 3.3x
paged) and ``bench/sampling.py`` (the default task's batch: kv 0.18x paged's time, dense 0.24x;
the guess game's: kv 0.38x, dense 0.62x). On TPU levanter's paged engine has real ragged
paged-attention kernels and stays first until the kv engine is measured to beat it there."""


def auto_engine_name(platform: str) -> tuple[str, ...]:
    """The engines ``auto`` tries on ``platform``, best first (:data:`AUTO_ENGINES`)."""
    return AUTO_ENGINES.get(platform, AUTO_ENGINES["cpu"])


def engine_spec(
    model: Any,
    *,
    max_seq_len: int,
    eos_id: int,
    max_seqs: int = 256,
    max_stop_tokens: int = 4,
    compute_dtype: str = "float32",
    tensor_parallel: int = 1,
    tensor_parallel_axes: Sequence[str] = ("mlp", "heads", "kv_head"),
    memory_fraction: float = 0.5,
) -> EngineSpec:
    """The :class:`~marin_rl_core.generation.EngineSpec` of this process: its platform, and
    the tensor-parallel mesh over ``tensor_parallel`` of its devices (none for 1)."""
    mesh, axis_mapping = None, None
    if tensor_parallel > 1:
        mesh, axis_mapping = inference_mesh(tensor_parallel, tensor_parallel_axes)
    return EngineSpec(
        model=model,
        max_seq_len=max_seq_len,
        eos_id=eos_id,
        max_seqs=max_seqs,
        max_stop_tokens=max_stop_tokens,
        compute_dtype=str(compute_dtype),
        mesh=mesh,
        axis_mapping=axis_mapping,
        memory_fraction=memory_fraction,
        platform=jax.devices()[0].platform,
    )


def inference_mesh(
    tensor_parallel: int, axes: Sequence[str] = ("mlp", "heads", "kv_head")
) -> tuple[Any, dict[str, Any]]:
    """``(mesh, axis_mapping)`` for an engine that splits ``axes`` of the model over
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


__all__ = [
    "AUTO_ENGINES",
    "auto_engine_name",
    "engine_spec",
    "inference_mesh",
]
