"""``[resources]``: what each role's Ray actor asks the cluster for, and whether the trainer and
the sampler share one process (``colocate``)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs

from marin_rl_core.errors import FieldValueError

__all__ = ["ResourcesConfig", "RoleResources"]


def _auto_or_bool(_: Any, attribute: Any, value: bool | str) -> None:
    if not isinstance(value, bool) and value != "auto":
        raise FieldValueError(attribute.name, f'expected true, false or "auto", got {value!r}')


@attrs.frozen(kw_only=True)
class RoleResources:
    """What one Ray actor of a role asks the cluster for. Ray places it on a node that has them
    and shows it only its own accelerators (``CUDA_VISIBLE_DEVICES``, ``TPU_VISIBLE_CHIPS``).

    Args:
        num_cpus: CPU cores (0: the actor takes no CPU slot, which suits one machine).
        num_gpus: GPUs.
        memory_gb: memory to reserve, in GiB (0: none).
        custom: other resources by name, e.g. ``{TPU = 4}`` or a node label of your cluster.
    """

    num_cpus: float = attrs.field(default=0.0, validator=attrs.validators.ge(0.0))
    num_gpus: float = attrs.field(default=0.0, validator=attrs.validators.ge(0.0))
    memory_gb: float = attrs.field(default=0.0, validator=attrs.validators.ge(0.0))
    custom: Mapping[str, float] = attrs.field(factory=dict)

    def ray_options(self) -> dict[str, Any]:
        """The ``.options(...)`` of an actor that asks for these resources."""
        options: dict[str, Any] = {"num_cpus": self.num_cpus, "num_gpus": self.num_gpus}
        if self.memory_gb:
            options["memory"] = int(self.memory_gb * 2**30)
        if self.custom:
            options["resources"] = {k: float(v) for k, v in self.custom.items()}
        return options

    def requested(self) -> dict[str, float]:
        """These resources under Ray's names (``CPU``, ``GPU``, ``memory`` in bytes, custom)."""
        out = {"CPU": self.num_cpus, "GPU": self.num_gpus, "memory": self.memory_gb * 2**30}
        out.update({k: float(v) for k, v in self.custom.items()})
        return {k: v for k, v in out.items() if v}


@attrs.frozen(kw_only=True)
class ResourcesConfig:
    """Ray resources per role. A job whose requests the cluster cannot meet stops before any
    actor starts, naming what was asked and what the cluster has.

    Args:
        trainer: the trainer actor's resources (the learner's devices); with several
            ``trainer_hosts``, those of each of its processes.
        trainer_hosts: processes of the trainer, one per host (a TPU slice's hosts, GPU
            nodes): more than one joins them with ``jax.distributed`` into one trainer whose
            mesh spans all their devices, placed together by a Ray placement group
            (docs/scaling.md).
        rollout: each rollout worker's resources (its inference engine's devices).
        colocate: the trainer and the sampler in one process on the same devices
            (``true``): the sampler reads the trainer's weights in place, no transfer, and
            generation and training take turns (on-policy unless
            ``replay_buffer.max_rollout_step_delay`` is set); ``resources.trainer`` is then
            the process's resources and ``resources.rollout`` is unused. ``"auto"`` (the
            default): colocated on a local machine with one accelerator (GPU or TPU chip),
            apart otherwise; the resolved config holds the choice (docs/colocation.md).
        check_memory: estimate a local job's memory before it starts and stop one that
            cannot fit (exit 3, with what would fit: :mod:`marin_rl_core.job.memory`);
            ``false`` starts it anyway.
    """

    trainer: RoleResources = RoleResources()
    trainer_hosts: int = attrs.field(default=1, validator=attrs.validators.ge(1))
    rollout: RoleResources = RoleResources()
    colocate: bool | str = attrs.field(default="auto", validator=_auto_or_bool)
    check_memory: bool = True
